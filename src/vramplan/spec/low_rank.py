"""The `low_rank` section: GaLore / APOLLO projections (one idea apart from the other sections)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from vramplan.spec.enums import SpecError
from vramplan.spec.sections import ALL_LINEAR, module_targets, number, positive_int


@dataclass(frozen=True, kw_only=True, slots=True)
class LowRankConfig:
    """GaLore / APOLLO projection of the targeted matrices (transformers `optim_args` and
    `optim_target_modules`; galore_torch/galore_projector.py, apollo_torch/apollo.py)."""

    rank: int
    """Rank r of the projection; Adam states of a target (m, n) are (m, r) or (r, n)."""
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    """Linear module name suffixes, or "all-linear" (every nn.Linear, the LM head included)."""
    update_proj_gap: int = 200
    """Steps between recomputations of the projection (an SVD for GaLore)."""
    scale: float | None = None
    """Update scale; no memory effect (None: the library's default)."""
    proj_type: str = "std"
    """std (project the smaller side), reverse_std, left, right."""

    def __post_init__(self):
        object.__setattr__(self, "rank", positive_int("low_rank.rank", self.rank))
        object.__setattr__(self, "update_proj_gap", positive_int("low_rank.update_proj_gap", self.update_proj_gap))
        if self.scale is not None:
            object.__setattr__(self, "scale", number("low_rank.scale", self.scale, high=1e6))
        targets = module_targets("low_rank.target_modules", self.target_modules)
        if targets != ALL_LINEAR:
            for t in targets:  # transformers also matches each as a regular expression
                try:
                    re.compile(t)
                except re.error as exc:
                    raise SpecError("low_rank.target_modules", f"{t!r} is not a valid pattern ({exc})") from None
        object.__setattr__(self, "target_modules", targets)
        if self.proj_type not in PROJ_TYPES:
            raise SpecError("low_rank.proj_type", f"unknown value {self.proj_type!r}; choose one of "
                            f"{', '.join(PROJ_TYPES)}.")

    def to_dict(self) -> dict:
        targets = self.target_modules
        out = {"rank": self.rank, "target_modules": targets if isinstance(targets, str) else list(targets),
               "update_proj_gap": self.update_proj_gap, "proj_type": self.proj_type}
        if self.scale is not None:
            out["scale"] = self.scale
        return out


PROJ_TYPES = ("std", "reverse_std", "left", "right")
