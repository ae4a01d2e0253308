"""TRL's on-policy DistillationTrainer (task distill with max_new_tokens): the chunked
divergence's moments as read from trl/kernels/chunked_divergence.py, and the spec's words
for it. The estimate against the real trainer: bench/trainers/results-cpu.json, the
`distill/.../on-policy` rows (tests/test_trainers_bench.py)."""
from __future__ import annotations

import json
import pathlib

import vramplan
from vramplan.cli import main
from vramplan.jobs.divergence import Divergence

ROWS = json.loads((pathlib.Path(__file__).parents[1] / "bench/trainers/results-cpu.json").read_text())
V, H, HT = 151936, 896, 1536


def _head(rows=4, completion=256, torch_fold=True, c="bf16"):
    return Divergence(rows, completion, H, HT, V, c, c, c, c, rows * 512 * HT * 2, torch_fold=torch_fold)


def test_the_forward_fold_worked_from_the_source():
    head = _head()
    n, tile = 4 * 256, 4 * 256 * 32768 * 4
    buffers = 2 * n * 32768 * 4                      # s_buf and t_buf, always 32768 wide
    stats = 9 * n * 4                                # nine fp32 running statistics
    # `_stats_tile`: zs, zt, gap, es, et and the last product (six fp32 tiles of n x 32768);
    # the teacher's projection copies (h.float(): n x 1536, w.float(): 32768 x 1536) are smaller here
    assert head.forward_fold().total() == buffers + stats + 6 * tile
    # one completion of 8 tokens: the projection's fp32 weight copy outweighs six tiny tiles
    small = _head(rows=1, completion=8)
    proj = 8 * HT * 4 + 32768 * HT * 4
    assert small.forward_fold().total() == 2 * 8 * 32768 * 4 + 9 * 8 * 4 + proj


def test_cuda_folds_in_the_kernels_and_gathers_the_valid_rows():
    cpu, cuda = _head(rows=1), _head(rows=1, torch_fold=False)
    # one row: off Triton the saved hidden state is a view of the whole last hidden state;
    # on CUDA `h[valid]` is a copy of the completion's rows
    assert dict(cpu.saved(12345))["divergence/student_hidden"] == 12345
    assert dict(cuda.saved(12345))["divergence/student_hidden"] == 256 * H * 2
    assert cuda.forward_fold().total() == 2 * 256 * 32768 * 4 + 9 * 256 * 4
    assert cuda.backward_fold(True).total() < cpu.backward_fold(True).total()


def test_every_on_policy_row_ran_trls_distillation_trainer():
    onpolicy = {k: r for k, r in ROWS.items() if "/on-policy" in k}
    assert len(onpolicy) >= 8
    for name, row in onpolicy.items():
        assert row["measured"]["runner"]["entry"] == "DistillationTrainer", name
        assert row["job"]["max_new_tokens"] and row["job"]["task"] == "distill"


def test_the_spec_words_for_on_policy_distillation(capsys):
    job = {"model": "qwen2.5-0.5b", "task": "distill", "teacher": "qwen2.5-1.5b", "seq_len": 128,
           "max_new_tokens": 64, "micro_batch_size": 2}
    est = vramplan.estimate(job)
    assert any("DistillationTrainer" in str(n) for n in est.notes)
    assert est.phases["generation"] > 0
    old = vramplan.estimate(dict(job, stack={"framework": "trl", "trl": "1.12"}))
    assert any("without the chunked divergence" in str(n) for n in old.notes)
    code = main(["estimate", "qwen2.5-0.5b", "--task", "distill", "--teacher", "qwen2.5-1.5b",
                 "--max-new-tokens", "64", "--logprob-head", "full"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "logprob_head" in err
    code = main(["estimate", "qwen2.5-0.5b", "--task", "distill", "--teacher", "qwen2.5-1.5b",
                 "--num-generations", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "num_generations" in err


def test_the_backbones_run_without_the_trainers_autocast():
    # measured: the amp-bf16 step is byte-identical to the fp32 one in training (the backbone
    # is called past accelerate's autocast-wrapped forward); the estimate's phases agree
    amp, fp32 = ROWS["distill/amp-bf16/full/on-policy/c32"], ROWS["distill/fp32/full/on-policy/c32"]
    assert amp["measured"]["phases"]["backward"] == fp32["measured"]["phases"]["backward"]
    est_amp, est_fp32 = vramplan.estimate(amp["job"]), vramplan.estimate(fp32["job"])
    assert est_amp.phases["backward"] == est_fp32.phases["backward"]
    assert est_amp.phases["forward"] == est_fp32.phases["forward"]
