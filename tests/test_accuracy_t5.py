"""T5 (v1.0 ReLU, v1.1 gated-gelu) estimates against real training steps under the exact CPU meter.

Each case runs two real steps of a tiny random-init T5ForConditionalGeneration (labels in,
the model shifts them into decoder_input_ids; the target length is seq_len) under
vramplan.measure (CPU, exact live-tensor bytes) and checks the estimate of the same spec:
the peak within 2% and every phase within 5%. dropout_rate is T5's default 0.1 unless a
case says otherwise, so SDPA takes the CPU math path (bf16 computed in fp32 there).
"""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import vramplan  # noqa: E402
from vramplan.measure import measure  # noqa: E402

V10 = {"model_type": "t5", "vocab_size": 1000, "d_model": 64, "d_kv": 16, "d_ff": 256, "num_layers": 2,
       "num_heads": 4, "decoder_start_token_id": 0}
V11 = V10 | {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
LORA_QV = {"method": "lora", "lora": {"r": 4, "target_modules": ["q", "v"]}}

CASES = {
    "v1.0-fp32": {"model": V10},
    "v1.0-bf16": {"model": V10, "precision": "pure-bf16"},
    "v1.1-fp32": {"model": V11},
    "v1.1-bf16": {"model": V11, "precision": "pure-bf16"},
    "v1.0-lora-qv": {"model": V10, **LORA_QV},
    "v1.1-bf16-lora-qv": {"model": V11, "precision": "pure-bf16", **LORA_QV},
    "v1.0-checkpointing": {"model": V10, "gradient_checkpointing": "full"},
    "v1.1-bf16-checkpointing": {"model": V11, "precision": "pure-bf16", "gradient_checkpointing": "full"},
    "v1.0-eager": {"model": V10, "attention": "eager"},
    # no dropout and a frozen position bias: the CPU flash kernel, which keeps its float mask
    "v1.0-no-dropout-lora-qv-flash": {"model": V10 | {"dropout_rate": 0.0}, **LORA_QV},
}


# HF Trainer's bf16 (the default stack): autocast over the bf16-loaded weights. On CPU,
# autocast sends T5's scaled_dot_product_attention with its float position-bias mask down
# the math path in fp32 (q, k, v and the scores copied to fp32); components/seq2seq.py does
# not model that yet: the estimate reads 9% low.
CASES["v1.0-bf16-hf-trainer-autocast"] = {"model": V10, "precision": "bf16", "stack": "hf-trainer"}
NOT_MODELLED = {"v1.0-bf16-hf-trainer-autocast": "T5 SDPA under CPU autocast is not modelled"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=NOT_MODELLED[n], strict=True))
                                  if n in NOT_MODELLED else n for n in sorted(CASES)])
def test_estimate_matches_measured_cpu_step(name):
    job = {"backend": "cpu", "precision": "fp32", "micro_batch_size": 2, "seq_len": 64,
           "optimizer_impl": "foreach", **CASES[name]}
    measured = measure(job, device="cpu").to_dict()
    est = vramplan.estimate(vramplan.load_spec(job))
    assert est.peak_allocated_bytes == pytest.approx(measured["peak_allocated_bytes"], rel=0.02)
    for phase in ("forward", "backward", "optimizer"):
        assert est.phases[phase] == pytest.approx(measured["phases"][phase], rel=0.05), phase
