"""TRL's SFTTrainer and DPOTrainer of earlier releases measured under the exact CPU meter
(bench/trainers/results-trl-releases.json, bench/trainers/trl_releases.py): today's estimate
of each recorded job against its measurement, at the targets (2% at the peak, 5% per phase),
and the release ranges of components/trl_sft_metrics.py and jobs/dpo_head.py read from their
source."""
from __future__ import annotations

import json
import pathlib

import pytest

import vramplan
from vramplan import load_spec
from vramplan.components.trl_sft_metrics import metrics_moment, notes

ROWS = json.loads((pathlib.Path(__file__).parents[1] / "bench/trainers/results-trl-releases.json").read_text())


@pytest.mark.parametrize("name", sorted(ROWS))
def test_estimate_within_targets_of_the_release_s_trainer(name):
    row = ROWS[name]
    measured, est = row["measured"], vramplan.estimate(row["job"])
    release = name.split("/")[0].removeprefix("trl-")
    entry = {"dpo": "DPOTrainer", "ipo": "DPOTrainer", "grpo": "GRPOTrainer", "rloo": "RLOOTrainer",
             "kto": "KTOTrainer"}.get(row["job"]["task"], "SFTTrainer")
    assert measured["runner"] == {"library": "trl", "version": release, "entry": entry}
    assert row["job"]["stack"]["trl"] == ".".join(release.split(".")[:2])
    assert abs(est.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1) < 0.02, name
    for phase, got in measured["phases"].items():
        if got:
            assert abs(est.phases[phase] / got - 1) < 0.05, (name, phase)


def test_every_release_range_was_measured():
    # one release in each branch of trl_sft_metrics: 0.15..0.21 (accuracy only), 0.22 (entropy
    # one batch row at a time), 0.23..1.3 (entropy on the logits),
    # 1.4..1.5 (shifted copy first), 1.6 (a view, copied by entropy's reshape); and the
    # chunked_nll head of 1.7..1.14 (jobs/chunked_nll.py)
    assert {n.split("/")[0] for n in ROWS} >= {"trl-0.19.1", "trl-0.22.2", "trl-0.25.1", "trl-1.4.0", "trl-1.6.0",
                                                "trl-1.9.0", "trl-1.12.0", "trl-1.14.0"}


def _spec(release: str, **kw):
    job = {"model": "llama-3.2-1b", "seq_len": 512, "micro_batch_size": 2,
           "stack": {"framework": "trl", "trl": release}} | kw
    return load_spec(job)


def test_the_metrics_moment_follows_the_release():
    v, c = 128256, "fp32"
    assert metrics_moment(_spec("0.14"), 2, 512, v, c) is None        # the Trainer's own loss, nothing after it
    # 0.15-0.21: the token accuracy's shifted copy and argmax only; 0.22: entropy one batch row
    # (s x v, three at once) at a time, then the same accuracy
    assert metrics_moment(_spec("0.19"), 2, 512, v, c).total() == 2 * 512 * v * 4 + 2 * 511 * v * 4 + 2 * 511 * 8
    assert metrics_moment(_spec("0.22"), 2, 512, v, c).total() == 2 * 512 * v * 4 + 3 * 512 * v * 4
    assert metrics_moment(_spec("0.22"), 1, 512, v, c).total() == 512 * v * 4 + 3 * 512 * v * 4
    assert metrics_moment(_spec("1.7"), 2, 512, v, c) is None         # chunked_nll default from 1.7
    assert metrics_moment(_spec("1.16"), 2, 512, v, c) is None        # the fused head
    assert metrics_moment(_spec("1.4", stack="hf-trainer"), 2, 512, v, c) is None   # not TRL's SFTTrainer
    logits = 2 * 512 * v * 4
    shifted = 2 * 511 * v * 4
    early = metrics_moment(_spec("1.0"), 2, 512, v, c)
    # at this size the accuracy's shifted copy outweighs three 128-row entropy chunks
    assert early.total() == logits + shifted + 2 * 511 * 8
    copy_first = metrics_moment(_spec("1.4"), 2, 512, v, c)
    assert copy_first.total() == logits + 2 * shifted + 2 * 511 * 8
    view = metrics_moment(_spec("1.6"), 2, 512, v, c)
    assert view.total() == logits + shifted + 3 * 128 * v * 4
    # one row: the shifted logits are a contiguous slice, never copied
    assert metrics_moment(_spec("1.6"), 1, 512, v, c).total() == 512 * v * 4 + 3 * 128 * v * 4


def test_releases_whose_head_is_not_modelled_say_so():
    assert "chunked_nll" in str(notes(_spec("1.9"))[0])
    assert notes(_spec("1.6")) == [] and notes(_spec("1.16")) == [] and notes(_spec("1.15")) == []
    assert "chunked_nll" in str(notes(_spec("1.14"))[0])
    est = vramplan.estimate({"model": "llama-3.2-1b", "seq_len": 512, "stack": {"framework": "trl", "trl": "1.12"}})
    assert any("chunked_nll" in str(n) for n in est.notes)


def test_every_dpo_head_variant_was_measured_at_its_ends():
    # jobs/dpo_head.py: 0.15..0.28 rolled, 0.29..1.5 contiguous copies, 1.6..1.13 views, 1.14 joint
    dpo = {n.split("/")[0] for n in ROWS if ROWS[n]["job"]["task"] in ("dpo", "ipo")}
    assert dpo >= {"trl-0.25.1", "trl-0.29.1", "trl-1.5.1", "trl-1.6.0", "trl-1.13.0", "trl-1.14.0"}
    # KTO from 1.9 (views) to 1.14 (joint)
    assert {n.split("/")[0] for n in ROWS if ROWS[n]["job"]["task"] == "kto"} >= {
        "trl-1.9.0", "trl-1.13.0", "trl-1.14.0"}


def test_the_dpo_head_follows_the_release():
    from vramplan.jobs.dpo_head import Variant, variant
    from vramplan.jobs.logprob import resolve_head
    from vramplan.spec import LogprobHead
    dpo = {"task": "dpo"}
    assert [variant(_spec(r, **dpo)) for r in ("0.28", "0.29", "1.5", "1.6", "1.13", "1.14")] == [
        Variant.ROLLED, Variant.CONTIGUOUS, Variant.CONTIGUOUS, Variant.VIEW, Variant.VIEW, Variant.JOINT]
    heads = [resolve_head(_spec(r, **dpo)) for r in ("0.14", "0.15", "1.14", "1.15", "1.16")]
    assert heads == [LogprobHead.FULL, LogprobHead.SELECTIVE, LogprobHead.SELECTIVE,
                     LogprobHead.CHUNKED, LogprobHead.CHUNKED]
    # KTO's head before 1.9 is still TRL 1.16's, and the answer says so; from 1.9 it is its own
    kto = vramplan.estimate({"model": "llama-3.2-1b", "task": "kto", "seq_len": 512,
                             "stack": {"framework": "trl", "trl": "1.6"}})
    assert any("TRL 1.6's is not modelled" in str(n) for n in kto.notes)
    kto = {"task": "kto"}
    assert [resolve_head(_spec(r, **kto)) for r in ("1.8", "1.9", "1.14", "1.15")] == [
        LogprobHead.CHUNKED, LogprobHead.SELECTIVE, LogprobHead.SELECTIVE, LogprobHead.CHUNKED]
    assert [variant(_spec(r, **kto)) for r in ("1.9", "1.13", "1.14")] == [Variant.VIEW, Variant.VIEW, Variant.JOINT]
    old = vramplan.estimate({"model": "llama-3.2-1b", "task": "dpo", "seq_len": 512,
                             "stack": {"framework": "trl", "trl": "1.6"}})
    assert not any("not modelled" in str(n) for n in old.notes)
    assert any("TRL 1.6 DPOTrainer's selective_log_softmax" in str(n) for n in old.notes)


def test_the_dpo_metrics_moments_worked_from_the_source():
    # llama-3.2-1b, one pair (2 rows) of 512 tokens under the trainer's autocast: fp32 logits
    from vramplan.jobs.dpo_head import dpo_head
    v, rows, s = 128256, 2, 512
    logits, shifted, chunks = rows * s * v * 4, rows * (s - 1) * v * 4, 3 * 128 * v * 4
    chosen = (s - 1) * v * 4  # the chosen row's mean-logits copy, all positions counted
    view = dpo_head(_spec("1.6", task="dpo", precision="bf16"), rows, s, v, with_reference=True)
    # entropy's reshape copies the shifted view beside the reference's logits, still bound
    assert view.reference_held.total() == logits and view.metrics.total() == shifted + chunks
    assert view.held.total() == 0  # the policy's fp32 logits are saved by gather/logsumexp
    contiguous = dpo_head(_spec("1.4", task="dpo", precision="bf16"), rows, s, v, with_reference=True)
    # the copies are made in _compute_loss: the policy's logits and the reference's logits and
    # copy stay bound; 511 chosen positions outweigh three 128-row entropy chunks
    assert contiguous.terms.saved.total() == shifted and contiguous.held.total() == logits
    assert contiguous.reference_held.total() == logits + shifted and contiguous.metrics.total() == chosen
    joint = dpo_head(_spec("1.14", task="dpo", precision="bf16", backend="cpu"), rows, s, v, with_reference=True)
    # entropy before the reference's forward: the copy and chunks sit beside the policy's logits
    assert joint.terms.forward_end.total() == shifted + chunks and joint.metrics.total() == chosen
    # on CUDA TRL's Triton kernel computes both: only accelerate's bf16 logits beside the copy
    triton = dpo_head(_spec("1.14", task="dpo", precision="bf16", backend="cuda"), rows, s, v, with_reference=True)
    assert triton.terms.forward_end.total() == rows * s * v * 2 and triton.metrics.total() == chosen
    rolled = dpo_head(_spec("0.25", task="dpo", precision="bf16"), rows, s, v, with_reference=True)
    assert rolled.metrics is None and rolled.reference_held.total() == 0
    assert rolled.terms.saved.total() == logits  # all s positions scored: no shifted slice
    # accelerate's cast holds the model's bf16 logits beside the fp32 copy in the reference
    assert rolled.reference.total() == logits + rows * s * v * 2
    # KTO 1.9-1.13 (two unpaired rows): the mean logits' index_select copies of all rows, then
    # one class's boolean copy (half the rows); entropy's reshape copy and chunks are smaller
    # here only when the rows are long: at 512 tokens the index copies plus one row win
    kto = dpo_head(_spec("1.13", task="kto", precision="bf16"), rows, s, v, with_reference=True)
    assert kto.metrics.total() == max(shifted + chunks, shifted + chosen)


def test_chunked_nll_follows_each_backend_s_autocast_lists():
    # aten/src/ATen/autocast_mode.cpp: CUDA runs log_softmax in fp32 (no cast for nll_loss
    # then); CPU runs it in bf16 and casts its output to fp32 for nll_loss (TRL 1.9.0 on CPU)
    from vramplan.jobs.chunked_nll import ChunkedNll
    cpu = ChunkedNll(2, 512, 4096, 128256, "bf16", "bf16", "bf16", cuda=False)
    cuda = ChunkedNll(2, 512, 4096, 128256, "bf16", "bf16", "bf16", cuda=True)
    assert (cpu.log_p_dtype, cpu.nll_cast) == ("bf16", True)
    assert (cuda.log_p_dtype, cuda.nll_cast) == ("fp32", False)
    # the whole head weight in fp32 and its autocast cast at each chunk's matmul
    vh = 128256 * 4096
    assert cuda.forward_fold().total() >= vh * 4 + vh * 2
    # no autocast, an fp32 head: no weight copies, fp32 logits and log-probs
    fp32 = ChunkedNll(1, 512, 4096, 128256, "fp32", "fp32", None, cuda=True)
    assert fp32.forward_fold().total() == 4 * 256 * 128256 * 4


def test_the_grpo_head_follows_the_release():
    from vramplan.jobs.grpo_head import Division, division
    from vramplan.jobs.logprob import resolve_head
    from vramplan.spec import LogprobHead
    grpo = {"task": "grpo", "max_new_tokens": 256, "num_generations": 2}
    assert [division(_spec(r, **grpo)) for r in ("0.16", "0.21", "0.29", "1.0", "1.9", "1.10", "1.13", "1.14")] == [
        Division.COPY, Division.COPY, Division.COPY, Division.IN_PLACE, Division.IN_PLACE, Division.COPY_BOUND,
        Division.COPY_BOUND, Division.JOINT]
    heads = [resolve_head(_spec(r, **grpo)) for r in ("0.15", "0.16", "1.14", "1.15")]
    assert heads == [LogprobHead.CHUNKED, LogprobHead.SELECTIVE, LogprobHead.SELECTIVE, LogprobHead.CHUNKED]
    from vramplan.jobs.logprob import head_note
    assert "no entropy pass" in str(head_note(_spec("0.19", **grpo)))
    assert "with its entropy" in str(head_note(_spec("0.21", **grpo)))


def test_rloo_takes_grpos_head_of_its_release_and_says_what_it_does_not_model():
    # RLOOTrainer is GRPOTrainer's layout from 0.22, with the same head in each release to
    # 1.14 (jobs/logprob.py RLOO_GROUP_SINCE); before 0.22 it is another trainer
    from vramplan.jobs.logprob import head_note, resolve_head
    from vramplan.spec import LogprobHead
    rloo = {"task": "rloo", "max_new_tokens": 64}
    heads = [resolve_head(_spec(r, **rloo)) for r in ("0.21", "0.22", "1.14", "1.15", "1.16")]
    assert heads == [LogprobHead.CHUNKED, LogprobHead.SELECTIVE, LogprobHead.SELECTIVE,
                     LogprobHead.CHUNKED, LogprobHead.CHUNKED]
    assert "PPO-style" in str(head_note(_spec("0.21", **rloo)))
    assert "RLOOTrainer's selective_log_softmax" in str(head_note(_spec("1.6", **rloo)))
    measured = {n.split("/")[0] for n in ROWS if ROWS[n]["job"]["task"] == "rloo"}
    assert measured >= {"trl-1.0.0", "trl-1.12.0", "trl-1.14.0"}


def test_the_grpo_moments_worked_from_the_source():
    # llama-3.2-1b, 8 completions of 256 tokens in fp32 (no autocast: no cast moment)
    from vramplan.jobs.grpo_head import grpo_head
    v, rows, new = 128256, 8, 256
    full, scored = rows * (new + 1) * v * 4, rows * new * v * 4
    chunks = 3 * 128 * v * 4
    grpo = {"task": "grpo", "max_new_tokens": new, "num_generations": 2, "precision": "fp32", "backend": "cpu"}
    # 1.0-1.9: div_ on the view; entropy's reshape copies it beside the logits; backward's
    # CopySlices stage (two logits-sized, two scored-sized) after the selective's own
    in_place = grpo_head(_spec("1.6", **grpo), rows, new, v).terms
    assert in_place.saved.total() == 0 and in_place.forward_end.total() == full + scored + chunks
    assert in_place.backward_start.total() == max(full + 3 * scored, 2 * full + 2 * scored)
    # 0.21-0.29: the division's copy is what gather and logsumexp save; the logits die with
    # the views, so the entropy's chunks sit beside the copy only
    copy = grpo_head(_spec("0.25", **grpo), rows, new, v).terms
    assert copy.saved.total() == scored and copy.forward_end.total() == max(full, chunks)
    # 0.21-0.22: entropy_from_logits splits one batch row (all C positions) at a time; from
    # 0.23, 128 flattened rows: for one completion of 256 tokens, 768 rows' worth of logits
    # against 384 (three chunks at once), either above the 257 positions of the logits
    one = {"task": "grpo", "max_new_tokens": new, "num_generations": 2, "precision": "fp32", "backend": "cpu"}
    assert grpo_head(_spec("0.22", **one), 1, new, v).terms.forward_end.total() == 3 * new * v * 4
    assert grpo_head(_spec("0.25", **one), 1, new, v).terms.forward_end.total() == 3 * 128 * v * 4
    # 0.16-0.20: `_get_per_token_logps` computes no entropy: the division's moment alone
    assert grpo_head(_spec("0.19", **grpo), rows, new, v).terms.forward_end.total() == full
    # 1.10-1.13: `outputs` keeps the logits bound through the entropy
    bound = grpo_head(_spec("1.12", **grpo), rows, new, v).terms
    assert bound.saved.total() == scored and bound.forward_end.total() == full + chunks
    # 1.14 at temperature 1.0 divides nothing: the view is scored and its logits saved
    joint = grpo_head(_spec("1.14", **grpo), rows, new, v).terms
    assert joint.saved.total() == full and joint.forward_end.total() == scored + chunks
