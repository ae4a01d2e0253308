"""A library trainer's real ``train()`` under the exact CPU meter, with its phases attributed.

    result = metered_train(trainer, models={"policy": m, "reference": ref}, runner={...})

The meter (measure/meter.py) is active for the whole ``trainer.train()`` call (two optimizer
steps); the trainer's own methods are wrapped, on the instance only, to name the phases:

* ``compute_loss`` (transformers/trainer.py ``Trainer.training_step`` calls it inside
  ``compute_loss_context_manager``): ``s{n}.fwd``. TRL's reference forwards run inside it
  (dpo_trainer.py ``_compute_loss``), so they count as forward, as in the estimate.
* ``accelerator.backward`` (the ``loss.backward()`` of ``training_step``): ``s{n}.bwd``.
* the ``on_pre_optimizer_step`` callback (fired after gradient clipping, before
  ``optimizer.step()`` in ``Trainer._inner_training_loop``) to ``on_step_end`` (after
  ``model.zero_grad()``): ``s{n}.opt``.
* GRPO's ``_generate_and_score_completions`` (trl/trainer/grpo_trainer.py, called from
  ``_prepare_inputs`` before ``compute_loss``): ``s{n}.gen``, its reference log-prob forward
  ``s{n}.ref`` (counted as forward, as in the estimate).

Everything alive before ``train()`` (the models, the tokenizer's tensors, library constants)
is registered as pre-existing, as measure/run_modes.py does; the optimizer states appear at
the first ``optimizer.step()`` and the batch when the collator builds it.
"""
from __future__ import annotations

import functools

import torch

from . import MeasureResult
from .meter import MemoryMeter
from .run import unique_bytes
from .run_modes import _live_tensors

PHASES = {"gen": "generation", "ref": "forward", "fwd": "forward", "bwd": "backward", "opt": "optimizer"}


class _Phases:
    """Names the meter's phase from the trainer's own calls; counts optimizer steps."""

    def __init__(self, meter: MemoryMeter, trainer, trained: torch.nn.Module):
        self.meter, self.trainer, self.trained = meter, trainer, trained
        self.step = 1
        self.before_forward = 0
        self.end_of_forward = 0
        self.grad_bytes = 0

    def enter(self, name: str) -> None:
        self.meter.set_phase(f"s{self.step}.{name}")

    def wrap(self, owner, attr: str, name: str, after=None) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            self.enter(name)
            if name == "fwd":
                self.before_forward = self.meter.current
            out = original(*args, **kwargs)
            if after is not None:
                after()
            return out

        setattr(owner, attr, wrapped)

    def wrap_scoring(self, trainer) -> None:
        """GRPO's no_grad log-prob forwards inside generation (the reference's, grpo_trainer.py
        `_get_per_token_logps_and_entropies`; `_get_per_token_logps` before TRL 0.21) are
        forward passes: phase ``s{n}.ref``."""
        attr = ("_get_per_token_logps_and_entropies" if hasattr(trainer, "_get_per_token_logps_and_entropies")
                else "_get_per_token_logps")
        original = getattr(trainer, attr, None)
        if original is None:  # DistillationTrainer scores nothing after generation
            return

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            name = self.meter.phase_name
            if not name.endswith(".gen"):
                return original(*args, **kwargs)
            self.enter("ref")
            try:
                return original(*args, **kwargs)
            finally:
                self.meter.set_phase(name)

        setattr(trainer, attr, wrapped)

    def forward_done(self) -> None:
        # live bytes the forward added (saved activations, the loss's tensors, the outputs
        # the trainer keeps): current after compute_loss minus current before it.
        self.end_of_forward = self.meter.current - self.before_forward
        self.meter.mark("end_of_forward")

    def callback(self):
        from transformers import TrainerCallback

        phases = self

        class PhaseCallback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                grads = [p.grad for p in phases.trained.parameters() if p.grad is not None]
                phases.grad_bytes = unique_bytes(grads)
                phases.enter("opt")

            def on_step_end(self, args, state, control, **kwargs):
                phases.meter.phase_name = ""
                phases.step += 1

        return PhaseCallback()


def _optimizer_states(trainer) -> list[torch.Tensor]:
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def metered_train(trainer, models: dict[str, torch.nn.Module], runner: dict,
                  trace: bool = False, generation: bool = False) -> MeasureResult:
    """Run ``trainer.train()`` under the meter; ``models['policy']`` is the trained one."""
    trained = models["policy"]
    meter = MemoryMeter(trace=trace)
    for role, model in models.items():
        meter.register(model.parameters(), "parameter" if role == "policy" else f"{role}_parameter")
        meter.register(model.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    phases = _Phases(meter, trainer, trained)
    phases.wrap(trainer, "compute_loss", "fwd", after=phases.forward_done)
    phases.wrap(trainer.accelerator, "backward", "bwd")
    if generation:
        phases.wrap(trainer, "_generate_and_score_completions", "gen")
        phases.wrap_scoring(trainer)
    trainer.add_callback(phases.callback())
    if trace:
        meter.track_modules(trained)
    try:
        with meter:
            trainer.train()
    finally:
        meter.close()
    kinds = {v: 0 for v in ("forward", "backward", "optimizer")}
    for name, peak in meter.phase_peaks.items():
        kind = PHASES.get(name.split(".", 1)[-1])
        if kind:
            kinds[kind] = max(kinds.get(kind, 0), peak)
    result = MeasureResult(
        device="cpu", peak_allocated_bytes=meter.peak, phases=kinds,
        params_bytes=unique_bytes(list(trained.parameters())), grad_bytes=phases.grad_bytes,
        optimizer_state_bytes=unique_bytes(_optimizer_states(trainer)),
        activation_bytes_end_of_forward=phases.end_of_forward, peak_phase=meter.peak_label,
        phase_peaks=dict(meter.phase_peaks), runner=dict(runner))
    if trace:
        from .trace import Trace

        result.trace = Trace.from_meter(meter)
    return result


__all__ = ["metered_train", "PHASES"]
