"""TRL 1.16's ORPOTrainer and CPOTrainer (SimPO) from trl.experimental, run by
`vramplan measure`, against the estimate of their full-logits step (jobs/odds_ratio.py)."""
from __future__ import annotations

import pytest
from conftest import measure_fresh

import vramplan

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False}
BASE = {"model": TINY, "stack": "trl", "micro_batch_size": 2, "seq_len": 32, "optimizer": "adamw",
        "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu"}


def test_orpo_keeps_the_chosen_rows_nll_beside_the_logits():
    # ORPO's NLL saves the chosen rows' log_softmax; SimPO (cpo_alpha 0) has none
    def saved(task):
        e = vramplan.estimate({**BASE, "task": task, "precision": "fp32"})
        return max(ev.live.total("policy/logits/nll_log_softmax") for ev in e.events)
    assert saved("orpo") == 2 * 31 * 512 * 4
    assert saved("simpo") == 0


@pytest.mark.parametrize("task,entry", [("orpo", "ORPOTrainer"), ("simpo", "CPOTrainer")])
def test_trainer_measured_live_within_tolerance(task, entry):
    pytest.importorskip("trl")
    job = {**BASE, "task": task, "precision": "bf16"}
    m = measure_fresh(job)
    assert m["runner"]["library"] == "trl" and m["runner"]["entry"] == entry
    e = vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.02, (e.peak_allocated_bytes, m)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(e.phases[phase] / m["phases"][phase] - 1) < 0.05, (phase, e.phases, m["phases"])


def test_cuda_selective_head_is_tritons_one_gradient():
    # trl/kernels/logprob_entropy.py on CUDA: the logits and four per-token fp32 vectors are
    # saved, backward writes one gradient of the shifted logits (no per-row temporaries)
    e = vramplan.estimate({**BASE, "task": "simpo", "precision": "fp32", "backend": "cuda", "gpu": "h100-80gb"})
    rows, s, v = 2 * BASE["micro_batch_size"], BASE["seq_len"], TINY["vocab_size"]
    live = {k: max(ev.live.total(f"policy/{k}") for ev in e.events)
            for k in ("logprob/per_token_fp32", "logits/grad_logits_shifted", "logits/grad_rows_stacked")}
    assert live == {"logprob/per_token_fp32": 4 * rows * (s - 1) * 4,
                    "logits/grad_logits_shifted": rows * (s - 1) * v * 4, "logits/grad_rows_stacked": 0}
