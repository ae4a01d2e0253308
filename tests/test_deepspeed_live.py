"""The real DeepSpeed ZeRO-2 on 2 gloo ranks (CPU accelerator, HF Trainer) against the
estimate of the same job. Skips when DeepSpeed is not installed or the ranks cannot start."""
import pytest

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}
# A bucket smaller than the model (~0.6 M parameters) so that the reduction happens during
# backward and the model's own terms, not one huge buffer, decide the peak.
JOB = {"model": TINY, "precision": "fp32", "optimizer": "adamw", "micro_batch_size": 2, "seq_len": 64,
       "backend": "cpu", "attention": "sdpa", "num_gpus": 2,
       "parallel": {"zero_stage": 2, "extras": {"dist_backend": "gloo", "reduce_bucket_size": 200_000,
                                                 "allgather_bucket_size": 200_000}}}


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
