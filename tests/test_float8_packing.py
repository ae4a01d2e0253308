"""float8 training (torchao), packed rows (padding-free) and NEFTune: the spec, the
estimate against the real steps measured under the meter (bench/accuracy), and one fresh
measurement of torchao's Float8Linear."""
from __future__ import annotations

import json
import pathlib

import pytest

from vramplan import estimate, load_spec
from vramplan.spec import SpecError

ROOT = pathlib.Path(__file__).parents[1]
GRID = ROOT / "bench/accuracy/results-cpu.json"
WIDE = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 4096,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False}
JOB = {"model": WIDE, "backend": "cpu", "precision": "bf16", "micro_batch_size": 2, "seq_len": 512,
       "optimizer_impl": "foreach"}


def _rows(word: str) -> list[dict]:
    rows = [r for r in json.loads(GRID.read_text())["cases"] if word in r["name"] and "failed" not in r]
    assert rows, f"no measured {word} case in {GRID}"
    return rows


@pytest.mark.parametrize("word", ["float8", "packing", "neftune"])
def test_estimate_within_2_percent_of_the_measured_step(word):
    for row in _rows(word):
        measured = row["measured"]["peak_allocated_bytes"]
        got = estimate(load_spec(row["job"])).peak_allocated_bytes
        assert abs(got - measured) / measured < 0.02, (row["name"], got, measured)


def test_float8_measured_casts_raise_the_peak_and_the_estimate_follows():
    # the same job measured with and without float8 (bench/accuracy grid): the casts cost
    # memory torchao does not save for backward, and the estimate moves by a like amount
    rows = {r["name"]: r for r in json.loads(GRID.read_text())["cases"]}
    f8 = rows["llama-wide/b2s512/bf16/full/adamw-foreach/sdpa/nogc/float8-tensorwise"]
    plain_est = estimate(load_spec({k: v for k, v in f8["job"].items() if k != "float8"})).peak_allocated_bytes
    measured_f8 = f8["measured"]["peak_allocated_bytes"]
    assert measured_f8 > 1.05 * plain_est  # the casts matter at this size
    assert estimate(load_spec(f8["job"])).peak_allocated_bytes > 1.05 * plain_est


def test_float8_spec_words():
    spec = load_spec({**JOB, "float8": "rowwise"})
    assert spec.float8.recipe.value == "rowwise" and not spec.float8.convert_lm_head
    assert load_spec(spec.to_dict()).float8 == spec.float8  # round trip
    with pytest.raises(SpecError, match="float8.recipe"):
        load_spec({**JOB, "float8": "blockwise"})
    with pytest.raises(SpecError, match="float8.convert_lm_head"):
        load_spec({**JOB, "float8": {"recipe": "tensorwise", "convert_lm_head": "yes"}})
    with pytest.raises(SpecError, match="float8.scale"):
        load_spec({**JOB, "float8": {"scale": 1}})
    with pytest.raises(SpecError, match="^float8: "):
        load_spec({**JOB, "float8": "tensorwise", "method": "lora"})
    # torchao's float8 all-gather is an FSDP2 extension (fsdp_pre_all_gather): without FSDP2
    # sharding, or on FSDP1, it is refused; with it, it is estimated
    for parallel in (None, {"fsdp": "full-shard", "fsdp_version": 1}, {"fsdp": "no-shard"}):
        with pytest.raises(SpecError, match="fsdp_float8_all_gather"):
            load_spec({**JOB, "float8": {"fsdp_float8_all_gather": True},
                       **({"parallel": parallel, "num_gpus": 4} if parallel else {})})
    with pytest.raises(SpecError, match="fsdp_float8_all_gather"):
        load_spec({**JOB, "float8": {"recipe": "rowwise", "fsdp_float8_all_gather": True},
                   "parallel": {"fsdp": "full-shard"}, "num_gpus": 4})
    assert load_spec({**JOB, "float8": {"fsdp_float8_all_gather": True}, "parallel": {"fsdp": "full-shard"},
                      "num_gpus": 4}).float8.fsdp_float8_all_gather
    with pytest.raises(SpecError, match="^float8: "):
        load_spec({**JOB, "float8": "tensorwise", "precision": "amp-bf16"})


def test_neftune_spec_word():
    assert load_spec({**JOB, "neftune_noise_alpha": 5}).neftune_noise_alpha == 5.0
    with pytest.raises(SpecError, match="neftune_noise_alpha"):
        load_spec({**JOB, "neftune_noise_alpha": -1})


def test_packing_masks_every_sdpa_layer_and_eager_is_unchanged():
    # create_causal_mask builds a (b, 1, s, s) mask for packed rows, which SDPA turns into a
    # float mask it keeps for backward in each layer; eager builds its mask either way
    base = {**JOB, "model": {**WIDE, "num_key_value_heads": 2}}
    packed, plain = estimate(load_spec({**base, "packing": True})), estimate(load_spec(base))
    mask = 2 * 512 * 512 * 2  # b * s * s bf16
    diff = packed.components.total("activations/") - plain.components.total("activations/")
    assert diff >= WIDE["num_hidden_layers"] * mask
    eager = {**base, "attention": "eager"}
    e_packed, e_plain = estimate(load_spec({**eager, "packing": True})), estimate(load_spec(eager))
    assert e_packed.components.total("activations/") == e_plain.components.total("activations/")


def test_training_args_import_neftune_and_padding_free():
    from vramplan.importers.hf_args import from_training_args
    out, _ = from_training_args({"neftune_noise_alpha": 5, "padding_free": True, "bf16": True})
    assert out["neftune_noise_alpha"] == 5 and out["packing"] is True


def test_float8_fresh_measurement_matches_the_estimate():
    pytest.importorskip("torchao")
    from conftest import measure_fresh
    job = {**JOB, "float8": "tensorwise", "seq_len": 256}
    measured = measure_fresh(job)["peak_allocated_bytes"]
    got = estimate(load_spec(job)).peak_allocated_bytes
    assert abs(got - measured) / measured < 0.02
