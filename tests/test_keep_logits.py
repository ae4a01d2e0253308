"""keep_logits: a loop that holds the model's output (`outputs = model(**batch)`) keeps its
logits through backward, the optimizer step and the next forward (step/build.py
_kept_output). Checked against real transformers steps under the exact CPU meter, and its
bad values against the one-line SpecError."""
import pytest

import vramplan
from vramplan.spec import SpecError

TINY = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
JOB = {"backend": "cpu", "precision": "fp32", "micro_batch_size": 2, "seq_len": 64, "optimizer_impl": "foreach",
       "model": TINY}


def test_every_phase_holds_one_copy_of_the_head_output():
    """b * s * vocab in the head's dtype, more in each phase than the same job without it."""
    for precision, width in (("fp32", 4), ("bf16", 2)):
        job = {**JOB, "precision": precision}
        base = vramplan.estimate(vramplan.load_spec(job)).phases
        kept = vramplan.estimate(vramplan.load_spec({**job, "keep_logits": True})).phases
        logits = 2 * 64 * 1000 * width
        assert {k: kept[k] - base[k] for k in base} == {k: logits for k in base}, precision


@pytest.mark.parametrize("field, value, match", [
    ("keep_logits", "yes", "keep_logits: expected true or false"),
    ("task", "dpo", "keep_logits: is modelled for tasks sft, pretrain and sequence-classification, not dpo"),
    ("loss_impl", "fused-linear-cross-entropy", "keep_logits: the fused linear cross-entropy never builds"),
    ("stack", "megatron", "keep_logits: Megatron's GPTModel returns the per-token loss"),
])
def test_bad_values_are_one_line(field, value, match):
    job = {**JOB, "backend": "cuda", "keep_logits": True, field: value}
    with pytest.raises(SpecError, match=match) as err:
        vramplan.load_spec(job)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("extra", [
    {},
    # enable_input_require_grads' leaf and its .grad stay with the kept loss's graph
    {"method": "lora", "lora": {"r": 8}, "gradient_checkpointing": "full"},
], ids=["full", "lora-checkpointed"])
def test_estimate_matches_a_real_step_that_keeps_its_outputs(extra):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from conftest import measure_fresh
    job = {**JOB, **extra, "keep_logits": True}
    measured = measure_fresh(job, device="cpu")
    est = vramplan.estimate(vramplan.load_spec(job))
    assert est.peak_allocated_bytes == pytest.approx(measured["peak_allocated_bytes"], rel=0.02)
    for phase in ("forward", "backward", "optimizer"):
        assert est.phases[phase] == pytest.approx(measured["phases"][phase], rel=0.02), phase


def test_trl_sft_has_no_logits_to_keep():
    """TRL 1.16's SFTTrainer runs its fused log-prob head (jobs/logprob.py sft_head)."""
    spec = vramplan.load_spec({**JOB, "backend": "cuda", "stack": "trl", "keep_logits": True})
    with pytest.raises(SpecError, match="keep_logits: TRL's SFTTrainer computes its loss in a fused log-prob head"):
        vramplan.estimate(spec)
