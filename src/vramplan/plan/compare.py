"""compare: named strategies against the job as given, side by side.

A strategy is a name and a set of spec changes (dotted keys reach into sections). Each row
has the estimate, the saving against the baseline in bytes and per cent, whether it fits,
and its step time relative to the baseline with its communication volume.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vramplan.estimation import Estimate
from vramplan.plan.evaluate import Evaluator, apply_changes
from vramplan.plan.steptime import StepTime
from vramplan.spec import Backend, JobSpec, Method, SpecError
from vramplan.spec.alloc_conf import parse_alloc_conf

COMPARE_SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    changes: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """'NAME WORDS key=value key2=value' (pairs may be comma-separated) -> Strategy;
        the words without '=' name it."""
        words = text.replace(",", " ").split()
        pairs = [w for w in words if "=" in w]
        name = " ".join(w for w in words if "=" not in w) or text.strip()
        changes = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if not key:
                raise SpecError("strategy", f"expected key=value, got {pair!r} in {text!r}")
            changes[key] = parse_scalar(value)
        return cls(name=name, changes=changes)


FIXED_FIELDS = ("model", "num_params", "num_layers", "hidden_size", "gpu")
"""What one comparison holds fixed: the Evaluator is made once for the job's trained model
and GPU, so a strategy that changed them would be estimated for the job's own."""


def check_strategy(strat: Strategy) -> None:
    """A change to an unknown spec key, or to what a comparison holds fixed, is the user's
    slip (one SpecError for the whole comparison), not a row that is "not applicable"."""
    if not isinstance(strat, Strategy) or not isinstance(strat.changes, Mapping):
        raise SpecError("strategies", f"expected Strategy(name, {{spec key: value}}), got {strat!r:.80}")
    from dataclasses import fields as _fields
    from vramplan.spec.job import SECTION_ALIASES, SECTION_TYPES
    from vramplan.spec.sections import did_you_mean
    from vramplan.spec.tasks import SECTIONS
    known = {f.name for f in _fields(JobSpec)} - {"seq_len_given"}
    for key in strat.changes:
        top, _, sub = str(key).partition(".")
        if top not in known:
            raise SpecError("strategy", f"{strat.name}: {key} is no spec key{did_you_mean(top, known)}")
        cls = {**SECTION_TYPES, **SECTIONS}.get(top)
        sub = sub.split(".", 1)[0]
        if sub and cls is not None:
            fields_ = {f.name for f in _fields(cls)} | set(SECTION_ALIASES.get(top, {}))
            if sub not in fields_:
                raise SpecError("strategy", f"{strat.name}: {key} is no spec key{did_you_mean(sub, fields_)}")
        if top in FIXED_FIELDS:
            raise SpecError("strategy", f"{strat.name}: changes {top}, which one comparison holds fixed; "
                            f"run compare with that {'gpu' if top == 'gpu' else 'model'} instead"
                            + (" (or --tiers for every catalog GPU)" if top == "gpu" else ""))
        try:
            _check_value(str(key), strat.changes[key])
        except SpecError as exc:
            raise SpecError("strategy", f"{strat.name}: {exc}") from None


def _check_value(key: str, value) -> None:
    """A value no job takes (zero_stage 9, num_gpus 0, precision fp8), by the spec's own
    parser of that field alone: the user's slip, not a row. What only this job refuses
    (LoRA targets its model lacks, tp past its heads) stays a "not applicable" row."""
    from vramplan.spec.job import BOOL_FIELDS, ENUM_FIELDS, INT_FIELDS
    from vramplan.spec.lora import LoraConfig
    from vramplan.spec.sections import ParallelConfig, boolean, count_field
    head, _, rest = key.partition(".")
    if rest and "." not in rest and head in ("parallel", "lora"):  # fields checked one at a time (as fit's axes)
        rest = {"lora_alpha": "alpha", "lora_dropout": "dropout", "rank": "r"}.get(rest, rest) if head == "lora" else rest
        ({"parallel": ParallelConfig, "lora": LoraConfig}[head])(**{rest: value})
    elif not rest and head in ENUM_FIELDS and value is not None:
        ENUM_FIELDS[head].parse(value, head)
    elif not rest and head in INT_FIELDS:
        count_field(head, value)
    elif not rest and head in BOOL_FIELDS:
        boolean(head, value)


def parse_scalar(text: str):
    """A flag value as int, float or bool where it reads as one, else the text."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def default_strategies(spec: JobSpec) -> list[Strategy]:
    """The strategies users ask about, from the least to the most change to the job; each
    row changes the job as given (a setting the job already has, or has stronger, is kept,
    and a row that would then repeat the baseline or an earlier row is left out)."""
    ckpt = {"gradient_checkpointing": "full"}
    more = spec.num_gpus * 2
    candidates = [
        Strategy("selective checkpointing", {"gradient_checkpointing": "selective"}),
        Strategy("checkpointing", ckpt),
        Strategy("zero-1 + checkpointing", {**ckpt, "parallel.zero_stage": 1}),
        Strategy("zero-2 + checkpointing", {**ckpt, "parallel.zero_stage": 2}),
        Strategy("zero-3 + checkpointing", {**ckpt, "parallel.zero_stage": 3}),
        Strategy("zero-2 + cpu offload + checkpointing",
                 {**ckpt, "parallel.zero_stage": 2, "parallel.offload_optimizer": "cpu"}),
        Strategy("8-bit optimizer", {"optimizer": "adamw-8bit"}),
        Strategy("lora", {"method": "lora"}),
        Strategy("lora + checkpointing", {**ckpt, "method": "lora"}),
        Strategy("qlora", {"method": "qlora"}),
        Strategy("qlora + checkpointing", {**ckpt, "method": "qlora"}),
        Strategy("half sequence", {"seq_len": max(1, spec.seq_len // 2)}),
        Strategy(f"{more} GPUs, zero-3 + checkpointing",
                 {**ckpt, "num_gpus": more, "parallel.zero_stage": 3}),
    ]
    if spec.parallel.fsdp != "none":  # ZeRO rows would fight the job's FSDP: shard with FSDP
        candidates = [Strategy(c.name, {k: v for k, v in c.changes.items() if k != "parallel.zero_stage"})
                      for c in candidates]
    out, seen = [Strategy("baseline")], set()
    for cand in candidates:
        effective = {k: v for k, v in cand.changes.items() if _saves_more(k, v, _current(spec, k))}
        key = frozenset(effective.items())
        if not effective or key in seen:
            continue
        seen.add(key)
        # The row's name still describes it when what was left out the job already has;
        # where the job has a setting stronger, the name says what the row really changes.
        as_named = all(_current(spec, k) == v for k, v in cand.changes.items() if k not in effective)
        name = cand.name if as_named else " + ".join(f"{k.split('.')[-1]}={v}" for k, v in effective.items())
        out.append(Strategy(name, effective))
    if spec.lengths is not None and spec.lengths.batching != "sorted-longest-first":
        out.append(Strategy("longest-first", {"lengths.batching": "sorted-longest-first"}))
    if spec.backend is Backend.CUDA and not parse_alloc_conf(spec.alloc_conf).expandable_segments:
        out.append(Strategy("expandable segments", {"alloc_conf": with_alloc_option(spec.alloc_conf, "expandable_segments:True")}))
    return out


# Orders in which a setting holds less memory (a row only moves a setting up its order).
# Optimizer: state bytes per parameter (AdamW 2 fp32 moments = 8; Lion, SGD one = 4;
# bitsandbytes 8-bit AdamW 2 one-byte moments = 2; Adafactor factored second moment ~ 0).
_ORDERS = {"gradient_checkpointing": {"none": 0, "selective": 1, "op-selective": 1, "full": 2},
           "parallel.zero_stage": {0: 0, 1: 1, 2: 2, 3: 3},
           "parallel.offload_optimizer": {"none": 0, "cpu": 1, "nvme": 2},
           "method": {"full": 0, "freeze": 1, "lora": 1, "qlora": 2},
           "optimizer": {"adamw": 0, "adam": 0, "paged-adamw-32bit": 0, "lion": 1, "sgd": 1,
                         "adamw-8bit": 2, "paged-adamw-8bit": 2, "adafactor": 3}}


def _current(spec: JobSpec, key: str):
    head, _, rest = key.partition(".")
    value = getattr(getattr(spec, head), rest) if rest else getattr(spec, head)
    return getattr(value, "value", value)


def _saves_more(key: str, new, old) -> bool:
    order = _ORDERS.get(key)
    if order is None or new not in order or old not in order:
        return new != old
    return order[new] > order[old]


# PyTorch's documented remedy for fragmentation (docs/source/notes/cuda.rst, "Optimizing
# memory usage with PYTORCH_CUDA_ALLOC_CONF": max_split_size_mb), offered when the allocator
# model finds much of the reserve in cached free blocks at the peak.
MAX_SPLIT_MB = 128
FRAGMENTATION_SHARE = 0.05


def with_alloc_option(conf: str | None, option: str) -> str:
    """conf with `key:value` set (replacing the key if present)."""
    key = option.split(":", 1)[0]
    kept = [p for p in (conf or "").split(",") if p.strip() and p.split(":", 1)[0].strip() != key]
    return ",".join(kept + [option])


def _fragmentation_strategy(base) -> Strategy | None:
    alloc = base.estimate.allocator if base.estimate is not None else None
    if alloc is None or alloc.fragmentation_bytes <= FRAGMENTATION_SHARE * alloc.reserved_bytes:
        return None
    conf = parse_alloc_conf(base.spec.alloc_conf)
    if conf.max_split_size is not None or conf.expandable_segments:
        return None
    return Strategy(f"max_split_size_mb {MAX_SPLIT_MB}",
                    {"alloc_conf": with_alloc_option(base.spec.alloc_conf, f"max_split_size_mb:{MAX_SPLIT_MB}")})


@dataclass(slots=True)
class CompareRow:
    strategy: Strategy
    spec: JobSpec | None
    estimate: Estimate | None
    step: StepTime | None
    fits: bool | None
    saving_bytes: int = 0
    saving_pct: float = 0.0
    relative_step_time: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return {"name": self.strategy.name, "changes": dict(self.strategy.changes),
                "spec": None if self.spec is None else self.spec.to_dict(),
                "estimate": None if self.estimate is None else self.estimate.to_dict(),
                "fits": self.fits, "saving_bytes": self.saving_bytes, "saving_pct": self.saving_pct,
                "step_time_s": None if self.step is None or not self.step.modelled else self.step.total_s,
                "relative_step_time": self.relative_step_time,
                "comm_bytes": None if self.step is None else self.step.comm_bytes,
                "note": self.note}


class CompareRows(list):
    """compare()'s rows (a list), with the JSON form and a notebook display."""

    def to_dict(self) -> dict:
        return compare_to_dict(self)

    def _repr_html_(self) -> str:
        from vramplan.report.answers import compare_table
        return compare_table(self, "strategies side by side").to_html()


def compare(spec: JobSpec, gpu=None, *, strategies: list[Strategy] | None = None,
            evaluator: Evaluator | None = None, headroom_bytes: int = 0, **ev_kwargs) -> CompareRows:
    """One row per strategy; the first is the baseline (the job as given)."""
    if not isinstance(spec, JobSpec):  # a mapping or a spec file, as vramplan.estimate takes
        from vramplan.spec import load_spec
        spec = load_spec(spec)
    if strategies is not None and (isinstance(strategies, (str, bytes)) or not hasattr(strategies, "__iter__")):
        raise SpecError("strategies", f"expected a list of Strategy, got {type(strategies).__name__}")
    ev = evaluator or Evaluator.for_spec(spec, gpu, headroom_bytes=headroom_bytes, **ev_kwargs)
    defaults = strategies is None
    if strategies is None:  # "half sequence" halves the seq_len estimated (a default capped at the positions)
        from vramplan.validity import assume_seq_len
        strategies = default_strategies(spec if ev.desc is None else assume_seq_len(ev.desc, spec))
    strategies = list(strategies)
    for strat in strategies:
        check_strategy(strat)
    if not strategies or strategies[0].changes:
        strategies.insert(0, Strategy("baseline"))
    names = [str(strat.name) for strat in strategies]
    twice = next((name for k, name in enumerate(names) if name in names[:k]), None)
    if twice is not None:  # the rows are told apart by name only
        raise SpecError("strategies", f"two strategies are named {twice!r}; give each a name of its own")
    rows = []
    for k, strat in enumerate(strategies):
        try:
            s = apply_changes(spec, strat.changes)
            v = ev.verdict(s)  # the libraries' refusals (validity.check_job) too, e.g. LoRA targets
        except SpecError as exc:  # a model does not have
            if k == 0:
                raise
            rows.append(CompareRow(strat, None, None, None, None, note=f"not applicable: {exc}"))
            continue
        rows.append(CompareRow(strat, s, v.estimate, v.step, v.fits))
        if defaults and k == 0 and spec.backend is Backend.CUDA:
            extra = _fragmentation_strategy(rows[0])
            if extra is not None:
                strategies.append(extra)
    base = rows[0]
    for r in rows:
        if r.estimate is None:
            continue
        r.saving_bytes = base.estimate.device_bytes - r.estimate.device_bytes
        r.saving_pct = r.saving_bytes / base.estimate.device_bytes if base.estimate.device_bytes else 0.0
        r.relative_step_time = r.step.total_s / base.step.total_s if base.step.total_s else None
    return CompareRows(rows)


def compare_to_dict(rows: list[CompareRow]) -> dict:
    return {"schema_version": COMPARE_SCHEMA_VERSION, "rows": [r.to_dict() for r in rows]}
