"""TRL 1.16's GKDTrainer (trl.experimental.gkd) run by `vramplan measure` for task distill,
against the estimate of its generalized-JSD step (jobs/distill.py)."""
from __future__ import annotations

import pytest
from conftest import measure_fresh

import vramplan
from vramplan.jobs.distill import jsd_forward_peak, jsd_loss
from vramplan.jobs.trained import trainer_logits_dtype as loss_dtype

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False}
TEACHER = dict(TINY, hidden_size=128, intermediate_size=344, num_hidden_layers=3)
JOB = {"model": TINY, "teacher": TEACHER, "task": "distill", "stack": "trl", "micro_batch_size": 2,
       "seq_len": 32, "optimizer": "adamw", "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu"}


def test_loss_runs_on_fp32_copies_under_the_trainers_autocast():
    # TRL's bf16=True autocasts, and accelerate hands the loss fp32 logits; pure bf16 does not
    assert loss_dtype(vramplan.load_spec({**JOB, "precision": "bf16"})) == "fp32"
    assert loss_dtype(vramplan.load_spec({**JOB, "precision": "bf16", "stack": "plain"})) == "bf16"


def test_jsd_tensors_by_hand():
    # fifteen (T', v) tensors at the forward's add; twelve at LogsumexpBackward
    t1, v = 2 * 31, 512
    u = t1 * v * 4
    terms = jsd_loss(t1, v, "fp32")
    fwd = jsd_forward_peak(t1, v, "fp32")
    small = 2 * t1 * 8 + t1  # mask indices, label mask
    assert terms.saved.total() + fwd.total() == 15 * u + small
    assert terms.saved.total() + terms.backward_start.total() == 12 * u + 2 * t1 * 8


@pytest.mark.parametrize("precision,stack", [("bf16", "trl"), ("fp32", "trl")])
def test_gkd_trainer_measured_live_within_tolerance(precision, stack):
    pytest.importorskip("trl")
    job = {**JOB, "precision": precision, "stack": stack}
    m = measure_fresh(job)
    assert m["runner"]["library"] == "trl" and m["runner"]["entry"] == "GKDTrainer"
    e = vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.02, (e.peak_allocated_bytes, m)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(e.phases[phase] / m["phases"][phase] - 1) < 0.05, (phase, e.phases, m["phases"])
