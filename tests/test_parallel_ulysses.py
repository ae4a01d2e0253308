"""DeepSpeed Ulysses sequence parallelism (parallel.ulysses): what the libraries refuse, and the
mechanism's invariants on a tiny Llama. The real DeepSpeed ALST run on 2 gloo ranks is in
bench/parallel/deepspeed_cpu.py (cases .../ulysses2/...)."""
import json

import pytest

from vramplan.cli import main
from vramplan.estimation import estimate
from vramplan.spec import SpecError, load_spec

TINY = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}


def spec(u=2, gpus=2, kv=4, seq=256, **over):
    par = {"ulysses": u, **over.pop("parallel", {})}
    return load_spec({"model": {**TINY, "num_key_value_heads": kv}, "precision": "fp32", "micro_batch_size": 2,
                      "seq_len": seq, "backend": "cpu", "num_gpus": gpus, "parallel": par, **over})


@pytest.mark.parametrize("kwargs, field", [
    ({"u": 8, "gpus": 8}, "parallel.ulysses"),            # 4 heads over 8 ranks
    ({"u": 2, "gpus": 2, "seq": 255}, "parallel.ulysses"),  # the sequence does not split
    ({"u": 4, "gpus": 6}, "num_gpus"),
    ({"u": 2, "gpus": 2, "attention": "eager"}, "attention"),
])
def test_layouts_deepspeed_refuses_are_errors(kwargs, field):
    with pytest.raises(SpecError) as err:
        estimate(spec(**kwargs))
    assert err.value.field == field


def test_kv_heads_neither_dividing_nor_multiple_are_refused():
    with pytest.raises(SpecError, match="KV heads"):
        estimate(load_spec({"model": {**TINY, "num_attention_heads": 12, "hidden_size": 384,
                                      "num_key_value_heads": 3}, "backend": "cpu", "seq_len": 256,
                            "num_gpus": 4, "parallel": {"ulysses": 4}}))


def _acts(e):
    """The saved activations at the end of forward (the event holding the most of them)."""
    at_peak = max(e.events, key=lambda ev: ev.live.total("activations/"))
    return {k: v for k, v in at_peak.live.to_dict().items() if k.startswith("activations/")}


def test_every_saved_activation_is_split_over_the_ulysses_ranks():
    one, two = estimate(spec(u=1, gpus=1)), estimate(spec(u=2))
    a1, a2 = _acts(one), _acts(two)
    assert a1 and set(a2) == set(a1) | {"activations/layers/attn/ulysses_out"}
    for name, value in a1.items():
        assert a2[name] == -(-value // 2), name
    # the output projection saves the all-to-all's output, a tensor apart from the kernel's
    assert a2["activations/layers/attn/ulysses_out"] == a2["activations/layers/attn/core"]


def test_replicated_kv_heads_keep_a_whole_head_each():
    # 2 KV heads over 4 ranks: kv_replication_factor 2, each rank saves one KV head over the
    # whole sequence, i.e. half the unsharded k and v, not a quarter.
    one, four = _acts(estimate(spec(u=1, gpus=1, kv=2))), _acts(estimate(spec(u=4, gpus=4, kv=2)))
    for name in one:
        if name not in four:
            continue
        want = -(-one[name] // 2) if name.endswith(("attn/k_rope", "attn/v")) else -(-one[name] // 4)
        assert four[name] == want, name


def test_ulysses_ranks_shard_zero_states_like_data_ranks():
    uly = estimate(spec(u=2, gpus=2, parallel={"zero_stage": 3}))
    dp = estimate(spec(u=1, gpus=2, parallel={"zero_stage": 3}))
    assert uly.parallel.layout.shard_group == dp.parallel.layout.shard_group == 2
    last_u, last_d = uly.events[-1].live, dp.events[-1].live
    assert last_u.total("optimizer/") == last_d.total("optimizer/") > 0


def test_cli_flag_and_all_to_all_volume(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    argv = ["estimate", str(cfg), "--backend", "cpu", "--seq-len", "256", "--json"]
    assert main(argv + ["--num-gpus", "2", "--ulysses", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert main(argv + ["--num-gpus", "4", "--ulysses", "4"]) == 0
    four = json.loads(capsys.readouterr().out)
    assert two["parallel"]["ulysses"] == 2 and two["parallel"]["shard_group"] == 2
    # all-to-all sends (u-1)/u of the rank's q, k, v and output, which are 1/u of the sequence:
    # twice the ranks send 3/4 of a half instead of 1/2 of a whole, i.e. 3/4 as many bytes.
    v2, v4 = (d["communication"]["ulysses"]["bytes"] for d in (two, four))
    assert v4 * 4 == v2 * 3


def test_deepspeed_json_sets_ulysses_and_hpz():
    from vramplan.importers.deepspeed import from_deepspeed
    out, _ = from_deepspeed({"sequence_parallel_size": 4,
                             "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert out["parallel"]["ulysses"] == 4
    assert out["parallel"]["extras"]["zero_hpz_partition_size"] == 8


def test_hpz_keeps_a_secondary_partition_of_the_weights():
    # bench/parallel/results-deepspeed-hpz-cpu.json: every parameter's secondary partition
    # (the persistent ones too) in the optimizer step; in a later step's backward only those
    # of the stages already done
    base = {"model": "llama-3.1-8b", "precision": "bf16", "num_gpus": 16, "seq_len": 1024}
    plain = estimate(load_spec({**base, "parallel": {"zero_stage": 3}}))
    hpz = estimate(load_spec({**base, "parallel": {"zero_stage": 3, "extras": {"zero_hpz_partition_size": 8}}}))
    step = hpz.events[-1]
    assert step.phase == "optimizer"
    sec = step.live.total("zero/hpz_secondary_partition")
    assert sec == pytest.approx(plain.num_params * 2 / 8, rel=1e-4)    # an 8th of the bf16 weights
    assert step.total - plain.events[-1].total == sec
    # the fp32 AdamW states (0.5 B a parameter on 16 ranks) outweigh the secondary partitions
    # (0.25 B), so the first step holds less than the later ones: no first-step term
    assert not any(e.live.total("zero/hpz_secondary_first_step") for e in hpz.events)
    backward = [e for e in hpz.events if e.phase == "backward"]
    held = [e.live.total("zero/hpz_secondary_partition") for e in backward]
    assert held[0] == 0 and held == sorted(held) and held[-1] < sec
    assert 0 <= hpz.peak_allocated_bytes - plain.peak_allocated_bytes < sec


def test_hpz_first_step_where_the_secondary_partitions_outweigh_the_states():
    # 64 ranks in groups of 8: 0.25 B of bf16 secondary partition a parameter against 0.125 B
    # of AdamW states, which torch makes only at the first optimizer.step(): the first step's
    # forward and backward hold all the secondary partitions and none of the states
    base = {"model": "llama-3.1-8b", "precision": "bf16", "num_gpus": 64, "seq_len": 1024}
    hpz = estimate(load_spec({**base, "parallel": {"zero_stage": 3, "extras": {"zero_hpz_partition_size": 8}}}))
    step = hpz.events[-1]
    sec = step.live.total("zero/hpz_secondary_partition")
    states = step.live.total("optimizer/")
    end = next(e for e in hpz.events if e.label.startswith("end of forward"))
    assert end.live.total("zero/hpz_secondary_first_step") == sec - states > 0
    for e in hpz.events:
        if e.phase == "backward" and not e.label.startswith("loss"):
            held = e.live.total("zero/hpz_secondary_partition") + e.live.total("zero/hpz_secondary_first_step")
            assert held == max(sec - states, e.live.total("zero/hpz_secondary_partition"))
