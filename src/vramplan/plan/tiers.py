"""GPU tiers: which catalog GPUs hold a job, and with which settings.

The "80 GB / 40-80 / 24-40 / under 24 GB" guidance users ask for, computed: for each catalog
GPU the first `compare` strategy that fits, in the strategies' order (least change to the
job first: as given, recomputation, sharding, 8-bit states, then LoRA and QLoRA), grouped by
the GPU's marketed memory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from vramplan.model import ModelDesc
from vramplan.plan.compare import CompareRow, Strategy, compare
from vramplan.plan.evaluate import Evaluator
from vramplan.spec import JobSpec

# (label, lowest marketed GB in the tier), largest first.
TIERS = (("80 GB and up", 80), ("40-80 GB", 40), ("24-40 GB", 24), ("under 24 GB", 0))


def marketed_gb(gpu) -> float:
    """The datasheet figure ('80 GB', '64 GB per GCD') as a number of GB."""
    match = re.match(r"\s*([\d.]+)", gpu.memory_marketed)
    return float(match.group(1)) if match else gpu.memory_bytes / 1e9


def tier_of(gpu) -> str:
    gb = marketed_gb(gpu)
    return next(label for label, low in TIERS if gb >= low)


@dataclass(slots=True)
class TierRow:
    gpu: str
    tier: str
    memory_bytes: int
    best: CompareRow | None
    """First fitting strategy (least change); None if none of them fits."""

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "tier": self.tier, "memory_bytes": self.memory_bytes,
                "strategy": None if self.best is None else self.best.strategy.name,
                "changes": None if self.best is None else dict(self.best.strategy.changes),
                "device_bytes": None if self.best is None else self.best.estimate.device_bytes,
                "step_time_s": None if self.best is None or not self.best.step.modelled else self.best.step.total_s}


def gpu_tiers(spec: JobSpec, desc: ModelDesc | None = None, *, gpus=None,
              strategies: list[Strategy] | None = None, headroom_bytes: int = 0) -> list[TierRow]:
    """One row per catalog GPU, largest memory first."""
    from vramplan.catalog import list_gpus
    if desc is None:
        from vramplan.plan.evaluate import trained_desc
        desc = trained_desc(spec)
    if strategies is None:
        from vramplan.plan.compare import default_strategies
        # Tiers answer "can this job run here": drop strategies that change the job itself.
        strategies = [s for s in default_strategies(spec)
                      if not {"seq_len", "num_gpus"} & set(s.changes)]
    out = []
    for gpu in sorted(gpus or list_gpus(), key=lambda g: -g.memory_bytes):
        ev = Evaluator(desc, gpu, headroom_bytes=headroom_bytes)
        rows = compare(spec.with_(gpu=gpu.name), evaluator=ev, strategies=strategies)
        best = next((r for r in rows if r.fits), None)
        out.append(TierRow(gpu.name, tier_of(gpu), gpu.memory_bytes, best))
    return out


def tiers_summary(rows: list[TierRow]) -> dict[str, dict]:
    """Per tier: GPUs that hold the job, and the strategies they need."""
    out: dict[str, dict] = {label: {"fits": [], "does_not_fit": []} for label, _ in TIERS}
    for r in rows:
        entry = out[r.tier]
        if r.best is None:
            entry["does_not_fit"].append(r.gpu)
        else:
            entry["fits"].append({"gpu": r.gpu, "strategy": r.best.strategy.name})
    return out
