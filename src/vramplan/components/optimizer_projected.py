"""GaLore and APOLLO: Adam states of the targeted matrices in a rank-r projected space.

Targets are the weights of the `nn.Linear` modules named by `low_rank.target_modules`
("all-linear": every nn.Linear, the LM head included), as transformers'
`_setup_low_rank_optimizer` (trainer_optimizer.py) picks them; every other trainable
parameter is in a plain group that the same class steps as an ordinary Adam (states
full size, `state["step"]` a Python int). Symbols: a target of shape (m, n), k = min(m, n),
r = min(rank, k), w its gradient's width in bytes.
"""
from __future__ import annotations

import re

from vramplan.components.trainable import HeldParam
from vramplan.spec import JobSpec, Optimizer
from vramplan.spec.sections import ALL_LINEAR
from vramplan.units import nbytes

_EMBED_WORDS = ("embed", "wte", "wpe")


def is_target(spec: JobSpec, p: HeldParam) -> bool:
    """A trainable nn.Linear weight that `low_rank.target_modules` names."""
    if len(p.shape) != 2 or not p.name.endswith(".weight") or p.kind != "base":
        return False
    return targets_linear(spec.low_rank.target_modules, p.name.rsplit(".", 1)[0])


def targets_linear(targets: tuple[str, ...] | str, module: str) -> bool:
    """Whether `low_rank.target_modules` names this linear module (the owner of a 2-D weight)."""
    if any(w in module.rsplit(".", 1)[-1] for w in _EMBED_WORDS):
        return False  # nn.Embedding, not nn.Linear
    if targets == ALL_LINEAR:
        return True
    # transformers/trainer_utils.py check_target_module_exists (a list): the module's name
    # is one of them, contains one, or fully matches one as a regular expression
    return any(t in module or re.fullmatch(t, module) for t in targets)


def _sides(spec: JobSpec, p: HeldParam) -> tuple[int, int, int, bool]:
    """(m, n, r, right): `right` when the projection multiplies from the right, i.e. the
    states are (m, r) (galore_projector.py `project`, proj_type std: m >= n)."""
    m, n = p.shape
    r = min(spec.low_rank.rank, m, n)
    kind = spec.low_rank.proj_type
    right = {"std": m >= n, "reverse_std": m < n, "right": True, "left": False}[kind]
    return m, n, r, right


def state_tensors(spec: JobSpec, p: HeldParam, dtype: str) -> dict[str, int]:
    """Persistent state of one parameter under GaLore or APOLLO (`dtype`: the gradient's)."""
    if not is_target(spec, p):
        return {"exp_avg": nbytes(p.numel, dtype), "exp_avg_sq": nbytes(p.numel, dtype)}
    m, n, r, right = _sides(spec, p)
    low = m * r if right else r * n
    out = {"exp_avg": nbytes(low, dtype), "exp_avg_sq": nbytes(low, dtype)}
    if spec.optimizer is Optimizer.GALORE_ADAMW:
        out["projector"] = _galore_projector(m, n, r, right, dtype)
    else:
        # apollo_torch/random_projector.py: a Gaussian (r, n) or (m, r) matrix drawn from a
        # seeded generator in the gradient's dtype, redrawn every update_proj_gap steps.
        out["projector"] = nbytes((r * n) if right else (m * r), dtype)
        # apollo.py: state["scaled_grad"] = torch.norm(scaled_grad), a 0-d tensor (the
        # norm-growth limiter, on unless disable_nl)
        out["scaled_grad_norm"] = nbytes(1, dtype)
    return out


def _galore_projector(m: int, n: int, r: int, right: bool, dtype: str) -> int:
    """galore_projector.py `get_orthogonal_matrix`: U, s, Vh = svd(grad.float()); the
    projector is `Vh[:r, :]` (right) or `U[:, :r]` (left). For an fp32 gradient that slice
    is a view, so the whole Vh (k, n) or U (m, k) stays alive; a 16-bit gradient gets a
    (r, n) or (m, r) copy in its dtype (`.type(original_type)`)."""
    k = min(m, n)
    if dtype == "fp32":
        return nbytes(k * n if right else m * k, "fp32")
    return nbytes(r * n if right else m * r, dtype)


def step_temporary(spec: JobSpec, p: HeldParam, dtype: str) -> int:
    """Bytes alive beyond states while one parameter steps (the class steps one at a time).

    galore_torch/adamw.py and apollo_torch/apollo.py `step`: the projected gradient, the
    denominator `exp_avg_sq.sqrt()` and `exp_avg / denom` are (m, r); GaLore's
    `project_back` makes the full (m, n) `ortho @ norm_grad` and its `* scale` copy;
    APOLLO's `p.grad * grad_scaling_factor` and `scaled_grad / limiter` are two (m, n) too.
    A plain-group parameter: `denom` and `exp_avg / denom`, two full-size tensors."""
    if not is_target(spec, p):
        return 2 * nbytes(p.numel, dtype)
    m, n, r, right = _sides(spec, p)
    low = m * r if right else r * n
    usual = 2 * nbytes(m * n, dtype) + 3 * nbytes(low, dtype)
    if spec.optimizer is Optimizer.GALORE_ADAMW:
        return max(usual, _galore_refresh(m, n, r, right, dtype))
    return usual


def galore_step_peak(spec: JobSpec, widths: list[tuple[HeldParam, str]]) -> int:
    """The largest bytes beyond states and gradients during GaLoreAdamW.step, walking the
    parameters in its order (transformers' groups: the plain parameters, then the
    targets). galore_torch/adamw.py keeps `denom` and `norm_grad` as loop locals, so the
    previous parameter's pair (low-rank `denom`, full-size projected-back `norm_grad` for
    a target; both full-size for a plain one) is alive while the next one is projected
    (an SVD on refresh steps) and until its own are assigned. The larger of a steady step
    and a refresh step (every target's projection recomputed)."""
    order = [x for x in widths if not is_target(spec, x[0])] + [x for x in widths if is_target(spec, x[0])]
    return max(_galore_walk(spec, order, refresh) for refresh in (False, True))


def _galore_walk(spec: JobSpec, order: list[tuple[HeldParam, str]], refresh: bool) -> int:
    peak, prev_denom, prev_norm = 0, 0, 0
    for p, w in order:
        if is_target(spec, p):
            m, n, r, right = _sides(spec, p)
            low, full = nbytes(m * r if right else r * n, w), nbytes(m * n, w)
            project = _galore_refresh(m, n, r, right, w) if refresh else 0
            steps = (prev_denom + prev_norm + max(project, low),  # projected grad made
                     prev_denom + prev_norm + 2 * low,             # + denom = exp_avg_sq.sqrt()
                     prev_norm + 3 * low,                          # + exp_avg / denom
                     3 * low + 2 * full)                           # project_back and * scale
            prev_denom, prev_norm = low, full
        else:
            full = nbytes(p.numel, w)
            steps = (prev_denom + prev_norm + full, prev_norm + 2 * full)
            prev_denom, prev_norm = full, full
        peak = max(peak, *steps)
    return peak


def _galore_refresh(m: int, n: int, r: int, right: bool, dtype: str) -> int:
    """The step that recomputes the projection (the first, then every update_proj_gap):
    galore_projector.py `get_orthogonal_matrix` runs `torch.linalg.svd(matrix,
    full_matrices=False)` on the fp32 gradient (a `.float()` copy of a 16-bit one): U (m, k),
    s (k) and Vh (k, n) in fp32, then for `right` A = U[:, :r] @ diag(s[:r]) (m, r) and
    diag (r, r), for `left` B = diag(s[:r]) @ Vh[:r] (r, n); a 16-bit gradient's projector
    is then a copy in its dtype."""
    k = min(m, n)
    out = nbytes(m * k + k + k * n + r * r, "fp32")
    out += nbytes(m * r if right else r * n, "fp32")
    if dtype != "fp32":
        out += nbytes(m * n, "fp32") + nbytes(r * n if right else m * r, dtype)
    return out
