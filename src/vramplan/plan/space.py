"""The layouts a search may choose from: named axes, each a list of values.

An axis is a spec key (dotted for sections: `parallel.zero_stage`, `lora.r`). The micro-batch
is not an axis of its own: it is every divisor of the rows each data-parallel rank must
process, with gradient accumulation making up the rest, so the global batch stays as the
job has it.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Iterator, Mapping

from vramplan.model import ModelDesc
from vramplan.plan.steptime import data_parallel, global_batch
from vramplan.spec import JobSpec, Method, ParallelConfig, SpecError, load_spec
from vramplan.spec.job import copy_with
from vramplan.spec.tasks import drop_unread_sections
from vramplan.spec.variants import check_layout, load_section, split_checked, with_dotted, with_layout

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
    if key in ("micro_batch_size", "grad_accum_steps"):  # fuzz: was "unknown axis", no fix named
        raise SpecError("vary", f"fit tries every micro-batch that divides the global batch, gradient "
                        f"accumulation making up the rest, so {name!r} is no axis; drop it, or use "
                        "--maximize micro_batch_size")
    if key not in KNOWN_AXES:
        import difflib
        hint = difflib.get_close_matches(key, list(KNOWN_AXES) + list(SHORT_NAMES), n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else f"; known: {', '.join(KNOWN_AXES)}"
        raise SpecError("vary", f"unknown axis {name!r}{extra}")
    return key


def check_axes(axes: Mapping[str, tuple]) -> None:
    """Each value of each axis is one the spec takes for that field (SpecError naming the
    field otherwise): the search combines them unchecked (num_gpus 0 would divide by zero)."""
    from vramplan.spec import Attention, Checkpointing, LossImpl, Optimizer, Precision
    from vramplan.spec.lora import LoraConfig
    from vramplan.spec.sections import ParallelConfig, positive_int
    enums = {"gradient_checkpointing": Checkpointing, "optimizer": Optimizer, "precision": Precision,
             "attention": Attention, "loss_impl": LossImpl, "method": Method}
    if not isinstance(axes, Mapping):  # fit(axes=...) from Python: the CLI builds a mapping
        raise SpecError("vary", f"expected a mapping of axis -> values, got {type(axes).__name__}")
    for axis, values in axes.items():
        _check_axis_key(str(axis))
        if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
            raise SpecError("vary", f"axis {axis}: expected a non-empty list of values, got {values!r:.60}")
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


def _check_axis_key(axis: str) -> None:
    """A spec key (dotted into parallel or lora): an unknown one made every layout invalid,
    and fit answered as if nothing fitted."""
    from dataclasses import fields
    from vramplan.spec.lora import LoraConfig
    from vramplan.spec.sections import ParallelConfig, did_you_mean
    head, _, rest = axis.partition(".")
    known = {f.name for f in fields(JobSpec)} - {"seq_len_given"}
    if head not in known:
        raise SpecError("vary", f"unknown axis {axis!r}{did_you_mean(head, known)}")
    if rest:
        inner = {"parallel": ParallelConfig, "lora": LoraConfig}.get(head)
        names = {f.name for f in fields(inner)} if inner else set()
        if rest not in names:
            raise SpecError("vary", f"unknown axis {axis!r}{did_you_mean(rest, names)}")


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


class Candidate:
    """One layout of a space at one batch split. `spec` is made on first use: a search over
    thousands of layouts reads the spec of the few hundred whose memory it checks; the rest
    need only `layout` (the spec at the layout's first split) and the split."""

    __slots__ = ("index", "values", "layout", "micro_batch_size", "grad_accum_steps", "_spec")

    def __init__(self, index: int, values: tuple[tuple[str, Any], ...], layout: JobSpec,
                 micro_batch_size: int, grad_accum_steps: int):
        self.index = index
        """Position in enumeration order: the last tie-break, so results are reproducible."""
        self.values = values
        """The axes' values, (axis, value) in the order of the axes (shared by the splits)."""
        self.layout = layout
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self._spec: JobSpec | None = None

    @property
    def changes(self) -> tuple[tuple[str, Any], ...]:
        return self.values + (("micro_batch_size", self.micro_batch_size), ("grad_accum_steps", self.grad_accum_steps))

    @property
    def spec(self) -> JobSpec:
        if self._spec is None:
            self._spec = with_batch(self.layout, self.micro_batch_size, self.grad_accum_steps)
        return self._spec

    @property
    def change_dict(self) -> dict:
        return dict(self.changes)


def divisors(n: int, cap: int) -> list[int]:
    return list(_divisors(n, cap))


@functools.lru_cache(maxsize=256)
def _divisors(n: int, cap: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, min(n, cap) + 1) if n % d == 0)


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
    """Every valid layout in the product of `axes`, with the micro-batch split.

    A layout is valid where load_spec of it is. load_spec runs once per combination of the
    axes outside the parallel section (a few); the combinations that differ from a
    validated one only in the parallel section (most: ZeRO stage x offload x TP x PP) are
    spec.variants.with_layout copies of it with the parallel section validated once per
    combination of its axes, and the checks that read it or the split run again."""
    check_axes(axes)
    base = spec.to_dict(as_given=True)
    rows_total = global_batch(spec)
    names = list(axes)
    outer = [i for i, n in enumerate(names) if not n.startswith("parallel.")]
    inner = [i for i, n in enumerate(names) if n.startswith("parallel.")]
    # what _valid and the data-parallel size read: the parallel section, num_gpus, method
    at_gpus, at_method = (names.index(n) if n in names else None for n in ("num_gpus", "method"))
    checked: dict[tuple, object] = {}          # -> the split of the rows per rank, None: refused
    validated: dict[tuple, JobSpec] = {}       # values of the outer axes -> a spec load_spec validated
    sections: dict[tuple, object] = {}         # values of the parallel axes -> ParallelConfig or SpecError
    index = 0
    for combo in itertools.product(*(axes[n] for n in names)):
        in_values = tuple(combo[i] for i in inner)
        key = (in_values, None if at_gpus is None else combo[at_gpus], None if at_method is None else combo[at_method])
        splits = checked.get(key, checked)
        if splits is checked:
            splits = checked[key] = _splits(spec, _data(base, names, combo), dict(zip(names, combo)), desc,
                                            rows_total, vary_micro_batch, max_micro_batch)
        if not splits:
            continue
        layout = _layout(lambda: _data(base, names, combo), splits[0], validated,
                         tuple(combo[i] for i in outer), sections, in_values)
        if layout is None:
            continue
        shared = tuple(zip(names, combo))
        per_split = split_checked(layout)
        for mb, ga in splits:
            if per_split and not _split_valid(layout, mb, ga):
                continue
            yield Candidate(index, shared, layout, mb, ga)
            index += 1


def _split_valid(layout: JobSpec, mb: int, ga: int) -> bool:
    """Whether load_spec would take `layout` at this batch split (check_layout runs every
    check that reads the split)."""
    try:
        check_layout(with_batch(layout, mb, ga))
    except SpecError:
        return False
    return True


def _data(base: dict, names: list[str], combo: tuple) -> dict:
    """The spec mapping of one combination of the axes (dotted names reach into sections),
    without the sections a method it sets does not read (spec.tasks.drop_unread_sections)."""
    data = with_dotted(base, zip(names, combo))
    drop_unread_sections(data, names)
    return data


def _splits(spec: JobSpec, data: dict, values: dict, desc: ModelDesc | None, rows_total: int,
            vary_micro_batch: bool, max_micro_batch: int) -> list[tuple[int, int]] | None:
    """The (micro-batch, accumulation) splits of a layout's rows per rank; None where the
    layout is refused before validation (_valid) or its rows do not divide."""
    if not _valid(values, data, desc):
        return None
    par = data.get("parallel") or {}
    dp = data.get("num_gpus", 1) // _model_parallel(par)
    if vary_micro_batch:
        if rows_total % dp:
            return None
        return [(int(mb), int(rows_total // dp // mb)) for mb in _divisors(rows_total // dp, max_micro_batch)]
    mb = spec.micro_batch_size
    if rows_total % (dp * mb):
        return None
    return [(int(mb), int(rows_total // (dp * mb)))]


def _layout(make_data, split: tuple[int, int], validated: dict, outer: tuple, sections: dict,
            inner: tuple) -> JobSpec | None:
    """load_spec of the combination's mapping (`make_data()`) at `split`, None where it
    raises SpecError (enumerate_candidates)."""
    mb, ga = split
    known = validated.get(outer)
    try:
        if known is None:
            layout = validated[outer] = load_spec(dict(make_data(), micro_batch_size=mb, grad_accum_steps=ga))
            return layout
        if inner not in sections:
            try:
                sections[inner] = load_section("parallel", make_data().get("parallel"))
            except SpecError as exc:    # load_spec raises the same (it loads the section first)
                sections[inner] = exc
        par = sections[inner]
        if isinstance(par, SpecError):
            return None
        return with_layout(known, par if par is not None else ParallelConfig(), mb, ga)
    except SpecError:
        return None


def with_batch(spec: JobSpec, micro_batch_size: int, grad_accum_steps: int) -> JobSpec:
    """`spec` with another micro-batch split, without validating the whole spec again.

    Both values are positive integers by construction (divisors of the rows per rank), and
    no other field depends on them, so the copy is as valid as `spec` wherever check_layout
    reads only the rows per rank (spec.variants.split_checked says where it does not). This is the hot loop
    of a 10k-layout search: `JobSpec.with_` re-validates everything (~0.1 ms each)."""
    return copy_with(spec, micro_batch_size=int(micro_batch_size), grad_accum_steps=int(grad_accum_steps))


__all__ = ["Candidate", "KNOWN_AXES", "axis_name", "default_axes", "divisors",
           "enumerate_candidates", "data_parallel"]
