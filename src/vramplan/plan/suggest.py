"""What to change so a job fits: the smallest changes first, then a bigger GPU.

Shared by `fit` (when nothing in the space fits), `check` and `vramplan.check`.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.estimation import Estimate
from vramplan.i18n import Msg
from vramplan.plan.evaluate import Evaluator, apply_changes
from vramplan.spec import Checkpointing, JobSpec, Method, SpecError
from vramplan.units import GiB


@dataclass(slots=True)
class Suggestion:
    description: str
    """English (a `Msg`, so the report edge can translate it with the same values)."""
    changes: dict
    estimate: Estimate | None
    gpu: str | None = None

    def to_dict(self) -> dict:
        return {"description": self.description, "changes": dict(self.changes), "gpu": self.gpu,
                "device_bytes": None if self.estimate is None else self.estimate.device_bytes}

    def message(self) -> Msg:
        """The description with the device memory it needs, as a translatable `Msg`."""
        description = self.description if isinstance(self.description, Msg) else Msg("{text}", text=self.description)
        if self.estimate is None:
            return description
        return Msg("{description} ({gib:.2f} GiB)", description=description,
                   gib=self.estimate.device_bytes / GiB)

    def __str__(self) -> str:
        return str(self.message())


def _ladder(spec: JobSpec) -> list[tuple[str, dict]]:
    """Single changes ordered from least to most disruptive to the job."""
    ckpt = {} if spec.gradient_checkpointing is Checkpointing.FULL else {"gradient_checkpointing": "full"}
    rows = spec.micro_batch_size * spec.grad_accum_steps
    steps: list[tuple[str, dict]] = []
    if ckpt:
        steps.append((Msg("turn on full gradient checkpointing"), ckpt))
    if spec.micro_batch_size > 1:
        steps.append((Msg("micro_batch_size 1 with grad_accum_steps {rows} (same global batch)", rows=rows),
                      {**ckpt, "micro_batch_size": 1, "grad_accum_steps": rows}))
    if spec.num_gpus > 1 and spec.parallel.zero_stage < 3:
        steps.append((Msg("ZeRO-3 across the job's GPUs"), {**ckpt, "parallel.zero_stage": 3}))
    steps.append((Msg("ZeRO-2 with the optimizer offloaded to CPU"),
                  {**ckpt, "parallel.zero_stage": 2, "parallel.offload_optimizer": "cpu"}))
    if spec.method is Method.FULL:
        steps.append((Msg("8-bit AdamW (bitsandbytes)"), {**ckpt, "optimizer": "adamw-8bit"}))
        steps.append((Msg("LoRA instead of full fine-tuning"), {**ckpt, "method": "lora"}))
    if spec.method in (Method.FULL, Method.LORA):
        steps.append((Msg("QLoRA (4-bit base)"), {**ckpt, "method": "qlora"}))
    for n in (2, 4, 8, 16, 32, 64):
        if n > spec.num_gpus:
            steps.append((Msg("{n} GPUs with ZeRO-3", n=n), {**ckpt, "num_gpus": n, "parallel.zero_stage": 3}))
    return steps


def suggestions(ev: Evaluator, spec: JobSpec, *, limit: int = 4) -> list[Suggestion]:
    """Up to `limit` single changes that fit on ev's GPU, then the smallest catalog GPU that
    holds the job as given (or with checkpointing)."""
    out: list[Suggestion] = []
    for description, changes in _ladder(spec):
        try:
            s = apply_changes(spec, changes)
            est = ev.estimate(s)  # also refused where the libraries refuse it (e.g. LoRA targets)
        except SpecError:
            continue
        if est.device_bytes <= ev.limit_bytes:
            out.append(Suggestion(description, changes, est))
            if len(out) >= limit:
                break
    if not any("seq_len" in s.changes for s in out) and spec.seq_len > 1:
        longest = _longest_seq(ev, spec)
        if longest and longest < spec.seq_len:
            s = spec.with_(seq_len=longest, gradient_checkpointing="full")
            out.append(Suggestion(Msg("seq_len {longest} with full checkpointing (the longest that fits)", longest=longest),
                                  {"seq_len": longest, "gradient_checkpointing": "full"}, ev.estimate(s)))
    bigger = smallest_gpu(ev, spec)
    if bigger is not None:
        out.append(bigger)
    return out


def _longest_seq(ev: Evaluator, spec: JobSpec) -> int | None:
    from vramplan.plan.solve import largest_value
    return largest_value(ev, spec.with_(gradient_checkpointing="full"), "seq_len", hi=spec.seq_len)


def smallest_gpu(ev: Evaluator, spec: JobSpec) -> Suggestion | None:
    """The catalog GPU with the least memory that holds the job (as given, else with full
    checkpointing), with the same headroom; None if none does."""
    from vramplan.catalog import list_gpus
    variants = [(Msg("as given"), {})]
    if spec.gradient_checkpointing is not Checkpointing.FULL:
        variants.append((Msg("with full checkpointing"), {"gradient_checkpointing": "full"}))
    for gpu in sorted(list_gpus(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes <= ev.gpu.memory_bytes:
            continue
        other = Evaluator(ev.desc, gpu, headroom_bytes=ev.headroom_bytes, mfu=ev.mfu)
        for label, changes in variants:
            s = apply_changes(spec, {**changes, "gpu": gpu.name})
            est = other.estimate(s)
            if est.device_bytes <= other.limit_bytes:
                return Suggestion(Msg("a {gpu} ({marketed}) {variant}", gpu=gpu.name, marketed=gpu.memory_marketed,
                                      variant=label),
                                  {**changes, "gpu": gpu.name}, est, gpu=gpu.name)
    return None
