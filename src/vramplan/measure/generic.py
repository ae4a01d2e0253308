"""The generic `models` list measured: the spec's `model` trained with the causal-LM loss
(``loss = model(input_ids, labels=input_ids).loss``, as measure/run.py) plus frozen models
on this device, each run under ``torch.no_grad()`` on the same ids after the trained
model's forward (its graph alive), as jobs/generic.py describes; their logits are dropped
(a judge, a monitor). The exact CPU meter counts every storage.

    from vramplan.measure.generic import measure_generic
    result = measure_generic({"task": "sft", "model": {...}, "models": [{"role": "judge", "model": {...}}], ...})

Only `method: frozen`, `placement: gpu` roles are built here (the others are counted by
the estimate without a measurement). Phases: ``s{n}.fwd``, ``s{n}.<role>``, ``s{n}.bwd``,
``s{n}.opt``; a role's no_grad forward counts as forward.
"""
from __future__ import annotations

import torch

from . import MeasureResult
from .build import norm_precision, precision_dtypes
from .jobs import _build_frozen, _build_trained, _live_tensors, make_batch
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes


def _frozen_roles(job: dict) -> list[dict]:
    roles = []
    for role in job.get("models") or []:
        if role.get("method", "frozen") != "frozen" or role.get("placement", "gpu") != "gpu":
            raise NotImplementedError(f"models.{role['role']}: only frozen roles on this device are measured")
        roles.append(role)
    return roles


def measure_generic(job: dict, steps: int = 2, trace: bool = False) -> MeasureResult:
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    job.setdefault("precision", "fp32")
    job.setdefault("task", "sft")
    roles = _frozen_roles(job)
    torch.manual_seed(0)
    model, opt, dtype = _build_trained(job)
    frozen = {}
    for role in roles:
        rdtype = precision_dtypes(norm_precision(role["precision"]))[0] if role.get("precision") else dtype
        frozen[role["role"]] = _build_frozen(job, role["model"], rdtype)
    meter = MemoryMeter(trace=trace)
    meter.register(model.parameters(), "parameter")
    meter.register(model.buffers(), "buffer")
    for m in frozen.values():
        meter.register(m.parameters(), "frozen_parameter")
        meter.register(m.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    grads = 0
    with meter:
        batch = make_batch({**job, "task": "sft"}, int(model.config.vocab_size))
        meter.register(batch.values(), "batch")
        for step in range(1, steps + 1):
            with meter.phase(f"s{step}.fwd"):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            for name, m in frozen.items():
                with meter.phase(f"s{step}.{name}"), torch.no_grad():
                    logits = m(input_ids=batch["input_ids"]).logits
                    del logits
            with meter.phase(f"s{step}.bwd"):
                loss.backward()
            grads = unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            with meter.phase(f"s{step}.opt"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss
    kinds = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"} | {name: "forward" for name in frozen}
    return metered_result(meter, model, opt, grads, kinds, trace=trace)


__all__ = ["measure_generic"]
