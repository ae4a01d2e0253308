"""The MeasureResult of a metered multi-model step (jobs, VLM, RL, diffusion, generic)."""
from __future__ import annotations

import torch

from . import MeasureResult
from .run import unique_bytes


def metered_result(meter, model, opt, grads: int, kinds: dict[str, str], *, trace: bool = False,
                   phase_names: tuple[str, ...] = ("forward", "backward", "optimizer"),
                   activation_bytes_end_of_forward: int = 0) -> MeasureResult:
    """Peak per phase kind (phases are named `s{step}.{name}`; `kinds` maps name -> kind),
    parameter, gradient and optimizer-state bytes of the trained model."""
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    phases = {v: 0 for v in phase_names}
    for name, peak in meter.phase_peaks.items():
        kind = kinds.get(name.split(".", 1)[-1])
        if kind:
            phases[kind] = max(phases[kind], peak)
    result = MeasureResult(
        device="cpu", peak_allocated_bytes=meter.peak, phases=phases,
        params_bytes=unique_bytes(list(model.parameters())), grad_bytes=grads,
        optimizer_state_bytes=unique_bytes(states),
        activation_bytes_end_of_forward=activation_bytes_end_of_forward,
        peak_phase=meter.peak_label, phase_peaks=dict(meter.phase_peaks))
    if trace:
        from .trace import Trace
        result.trace = Trace.from_meter(meter)
    return result
