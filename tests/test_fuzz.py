"""Hypothesis fuzz of the spec loader and properties of estimate().

The loader takes any mapping or any file text and either returns a JobSpec or raises
SpecError (nothing else, no hang). Estimates are never negative, grow (weakly) with the
micro-batch and the sequence length, and sharding more (a higher ZeRO stage, more GPUs
under ZeRO/FSDP) never raises a GPU's optimizer states or gradients. Budgets are small
(CI runs each in seconds; VRAMPLAN_FUZZ_EXAMPLES=500 searches longer); the bad-input
corpus holds the cases found so far.
"""
from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

import vramplan  # noqa: E402
from vramplan.spec import JobSpec, SpecError, load_spec  # noqa: E402

FAST = settings(max_examples=int(os.environ.get("VRAMPLAN_FUZZ_EXAMPLES", "30")), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

_KEYS = ["model", "num_params", "task", "method", "precision", "optimizer", "optimizer_impl",
         "micro_batch_size", "seq_len", "grad_accum_steps", "num_gpus", "gradient_checkpointing",
         "attention", "packing", "loss_impl", "momentum", "weight_decay", "trust_remote_code",
         "online", "lora", "quantization", "freeze", "parallel", "num_labels", "max_new_tokens",
         "float8", "neftune_noise_alpha", "keep_logits", "prompt_len", "stack"]
_SECTION_KEYS = ["r", "alpha", "dropout", "target_modules", "bits", "type", "trainable_layers",
                 "trainable_modules", "zero_stage", "fsdp", "fsdp_version", "tp", "pp", "cp", "ep",
                 "sp", "pp_schedule", "offload_optimizer", "offload_params", "extras", "recipe",
                 "convert_lm_head"]
_WORDS = ["gpt2", "llama-3.2-1b", "lora", "qlora", "freeze", "full", "bf16", "fp16", "amp-bf16",
          "adamw", "sgd", "full-shard", "cpu", "none", "1f1b", "q_proj", "", "no", "false", "auto"]

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(_WORDS), st.text(max_size=12))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_SECTION_KEYS), inner, max_size=3)),
    max_leaves=8)


@FAST
@given(st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=8), _values, max_size=6))
@example({"model": {}})  # no seq_len: the default written back must load to an equal spec
@example({"model": "gpt2"})
def test_loader_returns_a_spec_or_a_spec_error(data):
    try:
        spec = load_spec(data)
    except SpecError as exc:
        assert exc.field and "\n" not in str(exc)
        return
    assert isinstance(spec, JobSpec)
    assert load_spec(spec.to_dict()) == spec  # what it writes back loads to the same spec


@FAST
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_loader_reads_any_file_text(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "spec.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_spec(str(path))
    except SpecError as exc:
        assert exc.field
    except UnicodeEncodeError:
        pass  # the text could not be written; nothing read


_MODELS = ["gpt2", "llama-3.2-1b", "qwen3-0.6b"]
_jobs = st.fixed_dictionaries({
    "model": st.sampled_from(_MODELS),
    "method": st.sampled_from(["full", "lora"]),
    "precision": st.sampled_from(["bf16", "amp-bf16", "fp32", "mixed-bf16"]),
    "optimizer": st.sampled_from(["adamw", "sgd", "adafactor", "adamw-8bit"]),
    "gradient_checkpointing": st.sampled_from(["none", "full", "selective"]),
    "attention": st.sampled_from(["sdpa", "eager"]),
    "micro_batch_size": st.integers(1, 6),
    "seq_len": st.integers(1, 8).map(lambda k: 64 * k),  # + 8 * 64 stays within GPT-2's 1,024
}).map(lambda job: {**job, "lora": {"target_modules": "all-linear"}} if job["method"] == "lora" else job)


def _states(est, group: str) -> int:
    """Most of a group (optimizer, gradients) alive at once on this GPU, over the step."""
    return max(sum(v for k, v in e.live if k.split("/", 1)[0] == group) for e in est.events)


@FAST
@given(_jobs)
def test_estimates_are_never_negative(job):
    est = vramplan.estimate(job)
    assert est.peak_allocated_bytes > 0
    assert all(v >= 0 for e in est.events for _, v in e.live)
    assert all(v >= 0 for v in est.phases.values())
    assert est.device_bytes >= est.reserved_bytes >= est.peak_allocated_bytes


def _assert_grows(small, large) -> None:
    """A larger step holds at least the live bytes of a smaller one, and nvidia-smi's level
    adds the same memory outside the allocator. The allocator's reserve above the live peak
    is not monotone: on one GPU it is the caching allocator's replay of the step's tensors
    (device.reserved_bytes), where a larger step's blocks can fill the cached segments better
    than a smaller one's (PyTorch's allocator does the same; bench/allocator/README.md)."""
    assert large.peak_allocated_bytes >= small.peak_allocated_bytes
    assert large.reserved_bytes >= large.peak_allocated_bytes
    outside = large.device_bytes - large.reserved_bytes
    assert outside == small.device_bytes - small.reserved_bytes


@FAST
@given(_jobs, st.integers(1, 4))
def test_monotone_in_micro_batch(job, more):
    small = vramplan.estimate(job)
    large = vramplan.estimate({**job, "micro_batch_size": job["micro_batch_size"] + more})
    _assert_grows(small, large)


@FAST
@given(_jobs, st.integers(1, 8))
def test_monotone_in_seq_len(job, more):
    small = vramplan.estimate(job)
    large = vramplan.estimate({**job, "seq_len": job["seq_len"] + 64 * more})
    _assert_grows(small, large)


_elementwise = _jobs.filter(lambda job: job["optimizer"] in ("adamw", "sgd"))
"""Sharding properties hold for optimizers whose state is per element and independent of a
tensor's size. Not for Adafactor: ZeRO-1/2 hand the optimizer flat 1-D partitions
(deepspeed/runtime/zero/stage_1_and_2.py, single_partition_of_fp32_groups), on which it
keeps an unfactored second moment, so ZeRO-1 can hold more than no ZeRO. Not for
bitsandbytes 8-bit: shards below min_8bit_size (4096 elements) keep 32-bit state, so more
GPUs can hold slightly more."""


@FAST
@given(_elementwise, st.sampled_from([2, 4, 8]))
def test_a_higher_zero_stage_never_raises_states(job, gpus):
    states = []
    for stage in (0, 1, 2, 3):
        est = vramplan.estimate({**job, "num_gpus": gpus, "parallel": {"zero_stage": stage}})
        states.append((_states(est, "optimizer"), _states(est, "gradients")))
    for lower, higher in zip(states, states[1:]):
        assert higher[0] <= lower[0] and higher[1] <= lower[1], states


@FAST
@given(_elementwise, st.sampled_from([{"zero_stage": 1}, {"zero_stage": 2}, {"zero_stage": 3},
                               {"fsdp": "full-shard"}, {"fsdp": "shard-grad-op"}]))
def test_more_gpus_never_raise_sharded_states(job, parallel):
    states = []
    for gpus in (2, 4, 8):
        est = vramplan.estimate({**job, "num_gpus": gpus, "parallel": parallel})
        states.append((_states(est, "optimizer"), _states(est, "gradients")))
    for fewer, more in zip(states, states[1:]):
        assert more[0] <= fewer[0] and more[1] <= fewer[1], (parallel, states)


_mutable = st.sampled_from(_KEYS + ["parallel.tp", "parallel.pp", "parallel.zero_stage", "parallel.ep",
                                    "parallel.cp", "parallel.sp", "lora.r", "lora.target_modules",
                                    "freeze.trainable_layers", "num_gpus"])


@FAST
@given(_jobs, _mutable, _values)
def test_one_bad_field_gives_an_estimate_or_a_spec_error(job, key, value):
    """A valid job with one field replaced by anything: estimate() answers or raises
    SpecError naming a field, nothing else."""
    data = dict(job)
    head, _, rest = key.partition(".")
    if rest:
        data[head] = {rest: value}
        if head == "freeze":
            data["method"] = "freeze"
    else:
        data[key] = value
    try:
        est = vramplan.estimate(data)
    except SpecError as exc:
        assert exc.field and "\n" not in str(exc)
        return
    assert est.peak_allocated_bytes > 0
