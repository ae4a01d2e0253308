"""The layouts a search may choose from: named axes, each a list of values.

An axis is a spec key (dotted for sections: `parallel.zero_stage`, `lora.r`). The micro-batch
is not an axis of its own: it is every divisor of the rows each data-parallel rank must
process, with gradient accumulation making up the rest, so the global batch stays as the
job has it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from vramplan.model import ModelDesc
from vramplan.plan.steptime import data_parallel, global_batch
from vramplan.spec import JobSpec, Method, SpecError, load_spec
from vramplan.spec.job import copy_with
from vramplan.spec.tasks import drop_unread_sections

# Axes a user may open with --vary, and the values tried when none are given.
KNOWN_AXES: dict[str, tuple] = {
    "parallel.zero_stage": (0, 1, 2, 3),
    "parallel.fsdp": ("none", "full-shard", "shard-grad-op"),
    "parallel.offload_optimizer": ("none", "cpu"),
    "parallel.offload_params": ("none", "cpu"),
    "parallel.tp": (1, 2, 4, 8),
    "parallel.pp": (1, 2, 4, 8),
    "parallel.cp": (1, 2, 4, 8),
    "gradient_checkpointing": ("none", "selective", "full"),
    "optimizer": ("adamw", "adamw-8bit", "adafactor"),
    "precision": ("bf16", "mixed-bf16", "amp-bf16"),
    "attention": ("sdpa", "flash"),
    "loss_impl": ("standard", "chunked", "fused-linear-cross-entropy"),
    "lora.r": (8, 16, 32, 64),
    "method": ("full", "lora", "qlora"),
    "num_gpus": (1, 2, 4, 8),
    "seq_len": (),
}
SHORT_NAMES = {"zero_stage": "parallel.zero_stage", "zero": "parallel.zero_stage",
               "fsdp": "parallel.fsdp", "offload": "parallel.offload_optimizer",
               "offload_optimizer": "parallel.offload_optimizer",
               "offload_params": "parallel.offload_params", "tp": "parallel.tp",
               "pp": "parallel.pp", "cp": "parallel.cp", "checkpointing": "gradient_checkpointing",
               "lora_r": "lora.r", "rank": "lora.r"}


def axis_name(name: str) -> str:
    key = name.strip().replace("-", "_")
    key = SHORT_NAMES.get(key, key)
    if key not in KNOWN_AXES:
        import difflib
        hint = difflib.get_close_matches(key, list(KNOWN_AXES) + list(SHORT_NAMES), n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        raise SpecError("vary", f"unknown axis {name!r}{extra}")
    return key


def check_axes(axes: Mapping[str, tuple]) -> None:
    """Each value of each axis is one the spec takes for that field (SpecError naming the
    field otherwise): the search combines them unchecked (num_gpus 0 would divide by zero)."""
    from vramplan.spec import Attention, Checkpointing, LossImpl, Optimizer, Precision
    from vramplan.spec.sections import LoraConfig, ParallelConfig, positive_int
    enums = {"gradient_checkpointing": Checkpointing, "optimizer": Optimizer, "precision": Precision,
             "attention": Attention, "loss_impl": LossImpl, "method": Method}
    for axis, values in axes.items():
        head, _, rest = axis.partition(".")
        for value in values:
            if head == "parallel":
                ParallelConfig(**{rest: value})
            elif head == "lora":
                LoraConfig(**{rest: value})
            elif head in enums:
                enums[head].parse(value, head)
            else:
                positive_int(axis, value)


def default_axes(spec: JobSpec, desc: ModelDesc | None) -> dict[str, tuple]:
    """What `fit` searches when the user names nothing: the memory/speed trade-offs that do
    not change the model being trained (sharding, offload, recomputation, micro-batch)."""
    axes: dict[str, tuple] = {"gradient_checkpointing": KNOWN_AXES["gradient_checkpointing"]}
    if spec.method is Method.FULL or spec.num_gpus > 1:
        axes["parallel.zero_stage"] = (0, 1, 2, 3)
        axes["parallel.offload_optimizer"] = ("none", "cpu")
    if spec.num_gpus > 1:
        axes["parallel.tp"] = tuple(t for t in (1, 2, 4, 8) if spec.num_gpus % t == 0)
        axes["parallel.pp"] = tuple(p for p in (1, 2, 4, 8) if spec.num_gpus % p == 0)
    return axes


@dataclass(frozen=True, slots=True)
class Candidate:
    index: int
    """Position in enumeration order: the last tie-break, so results are reproducible."""
    changes: tuple[tuple[str, Any], ...]
    spec: JobSpec

    @property
    def change_dict(self) -> dict:
        return dict(self.changes)


def divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _model_parallel(par: Mapping[str, Any]) -> int:
    return par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1) * par.get("ulysses", 1)


def _valid(values: Mapping[str, Any], spec_data: dict, desc: ModelDesc | None) -> bool:
    par = spec_data.get("parallel") or {}
    tp, pp = par.get("tp", 1), par.get("pp", 1)
    gpus, mp = spec_data.get("num_gpus", 1), _model_parallel(par)
    if gpus % mp:
        return False
    if desc is None:
        if mp > 1:
            return False                      # no layer shapes to split (diffusion pipelines)
    elif desc.num_heads % tp or desc.num_kv_heads % tp or pp > desc.num_layers:
        return False
    zero, fsdp = par.get("zero_stage", 0), par.get("fsdp", "none")
    if zero and fsdp != "none":
        return False
    sharded = zero > 0 or fsdp != "none"
    offload = par.get("offload_optimizer", "none") != "none" or par.get("offload_params", "none") != "none"
    if offload and not sharded:
        return False                      # DeepSpeed offload runs under ZeRO; FSDP under a shard
    if par.get("offload_params", "none") != "none" and zero not in (0, 3):
        return False                      # parameter offload is ZeRO-3 only (ZeRO-Infinity)
    dp = gpus // mp * par.get("ulysses", 1)  # Ulysses ranks shard ZeRO states like data ranks
    if sharded and dp == 1 and not offload:
        return False                      # nothing to shard over: the same as no ZeRO
    method = spec_data.get("method", "full")
    if "lora.r" in values and method not in ("lora", "qlora"):
        return False
    return True


def enumerate_candidates(spec: JobSpec, desc: ModelDesc | None, axes: Mapping[str, tuple], *,
                         vary_micro_batch: bool = True, max_micro_batch: int = 256) -> Iterator[Candidate]:
    """Every valid layout in the product of `axes`, with the micro-batch split."""
    check_axes(axes)
    base = spec.to_dict(as_given=True)
    rows_total = global_batch(spec)
    names = list(axes)
    index = 0
    for combo in itertools.product(*(axes[n] for n in names)):
        values = dict(zip(names, combo))
        data = dict(base)
        for key, value in values.items():
            head, _, rest = key.partition(".")
            if rest:
                section = dict(data.get(head) or {})
                section[rest] = value
                data[head] = section
            else:
                data[key] = value
        drop_unread_sections(data, values)
        if not _valid(values, data, desc):
            continue
        par = data.get("parallel") or {}
        dp = data.get("num_gpus", 1) // _model_parallel(par)
        if vary_micro_batch:
            if rows_total % dp:
                continue
            splits = [(mb, rows_total // dp // mb) for mb in divisors(rows_total // dp, max_micro_batch)]
        else:
            mb = spec.micro_batch_size
            if rows_total % (dp * mb):
                continue
            splits = [(mb, rows_total // (dp * mb))]
        if not splits:
            continue
        try:
            layout = load_spec(dict(data, micro_batch_size=splits[0][0], grad_accum_steps=splits[0][1]))
        except SpecError:
            continue
        for mb, ga in splits:
            changes = dict(values, micro_batch_size=mb, grad_accum_steps=ga)
            yield Candidate(index=index, changes=tuple(changes.items()), spec=with_batch(layout, mb, ga))
            index += 1


def with_batch(spec: JobSpec, micro_batch_size: int, grad_accum_steps: int) -> JobSpec:
    """`spec` with another micro-batch split, without validating the whole spec again.

    Both values are positive integers by construction (divisors of the rows per rank), and
    no other field depends on them, so the copy is as valid as `spec`. This is the hot loop
    of a 10k-layout search: `JobSpec.with_` re-validates everything (~0.1 ms each)."""
    return copy_with(spec, micro_batch_size=int(micro_batch_size), grad_accum_steps=int(grad_accum_steps))


__all__ = ["Candidate", "KNOWN_AXES", "axis_name", "default_axes", "divisors",
           "enumerate_candidates", "data_parallel"]
