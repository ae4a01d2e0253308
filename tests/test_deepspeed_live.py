"""The real DeepSpeed ZeRO-2 on 2 gloo ranks (CPU accelerator, HF Trainer) against the
estimate of the same job. Skips when DeepSpeed is not installed or the ranks cannot start."""
import pytest

TINY = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}
# Buckets of 1e6 elements, a quarter of the model, so that buckets are reduced during
# backward and the model's own terms, not one 2 GB default buffer, decide the peak.
# (The bench's case tiny-llama/b2s128/fp32/zero2/bucket1e6; ~1-2 minutes, mostly imports.)
JOB = {"model": TINY, "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "forloop",
       "micro_batch_size": 2, "seq_len": 128, "backend": "cpu", "attention": "sdpa", "num_gpus": 2,
       "parallel": {"zero_stage": 2, "extras": {"dist_backend": "gloo", "reduce_bucket_size": 1_000_000,
                                                 "allgather_bucket_size": 1_000_000}}}


def test_zero2_two_gloo_ranks_match_the_estimate():
    pytest.importorskip("deepspeed")
    from vramplan.estimation import estimate
    from vramplan.measure import measure
    from vramplan.spec import load_spec

    try:
        result = measure(JOB, steps=2)
    except RuntimeError as exc:  # a rank could not start (no loopback, no gloo)
        pytest.skip(f"DeepSpeed ranks did not run: {exc}")
    assert result.runner["library"] == "deepspeed" and result.runner["entry"] == "Trainer+ZeRO-2"
    assert len(result.runner["ranks"]) == 2
    est = estimate(load_spec(JOB))
    assert est.peak_allocated_bytes == pytest.approx(result.peak_allocated_bytes, rel=0.02)
    for phase in ("backward", "optimizer"):
        assert est.phases[phase] == pytest.approx(result.phases[phase], rel=0.05), phase
