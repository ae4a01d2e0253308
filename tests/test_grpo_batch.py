"""TRL's GRPO batch rules: vramplan refuses a GRPO (or RLOO) job exactly where trl.GRPOConfig
(trl.RLOOConfig; the installed TRL) refuses the same batch, and says which field to change."""
import itertools
from unittest import mock

import pytest

from vramplan import load_spec
from vramplan.cli import main
from vramplan.spec import SpecError

trl = pytest.importorskip("trl")


CONFIGS = {"grpo": "GRPOConfig", "rloo": "RLOOConfig"}


def _trl_accepts(tmp_path, mb, ga, dp, gens, gen_batch, task="grpo"):
    config = getattr(trl, CONFIGS[task])
    kwargs = dict(output_dir=str(tmp_path), gradient_accumulation_steps=ga, use_cpu=True, bf16=False, report_to=[])
    if mb is not None:   # None: each side's default
        kwargs["per_device_train_batch_size"] = mb
    if gens is not None:
        kwargs["num_generations"] = gens
    if gen_batch is not None:   # TRL's generation_batch_size counts every process's rows
        kwargs["generation_batch_size"] = gen_batch * dp
    with mock.patch.object(config, "world_size", new_callable=mock.PropertyMock, return_value=dp):
        try:
            config(**kwargs)
        except ValueError:
            return False
    return True


def _vramplan_accepts(mb, ga, dp, gens, gen_batch, task="grpo"):
    job = {"model": "qwen2.5-0.5b", "task": task, "grad_accum_steps": ga, "num_gpus": dp}
    if mb is not None:
        job["micro_batch_size"] = mb
    if gens is not None:
        job["num_generations"] = gens
    if gen_batch is not None:
        job["generation"] = {"generation_batch_size": gen_batch}
    try:
        load_spec(job)
    except SpecError as exc:
        assert exc.field in ("num_generations", "generation.generation_batch_size"), exc
        return False
    return True


CASES = list(itertools.product((None, 1, 2, 3, 4, 8), (1, 2, 4), (1, 2, 4), (None, 2, 3, 4, 16), (None, 12, 16)))


@pytest.mark.parametrize("mb, ga, dp, gens, gen_batch", CASES[::7])
def test_accepts_exactly_what_trl_accepts(tmp_path, mb, ga, dp, gens, gen_batch):
    assert _vramplan_accepts(mb, ga, dp, gens, gen_batch) == _trl_accepts(tmp_path, mb, ga, dp, gens, gen_batch)


@pytest.mark.parametrize("mb, ga, dp, gens, gen_batch", CASES[3::11])
def test_rloo_accepts_exactly_what_rlooconfig_accepts(tmp_path, mb, ga, dp, gens, gen_batch):
    # RLOOConfig: GRPO's rules with its own default of 2 completions per prompt
    assert (_vramplan_accepts(mb, ga, dp, gens, gen_batch, "rloo")
            == _trl_accepts(tmp_path, mb, ga, dp, gens, gen_batch, "rloo"))


def test_rloo_cases_hold_both_answers_and_its_default_differs_from_grpos(tmp_path):
    assert {_vramplan_accepts(*c, task="rloo") for c in CASES[3::11]} == {True, False}
    # micro-batch 1 x 2 accumulation: whole RLOO groups of 2, not GRPO groups of 8
    assert _vramplan_accepts(1, 2, 1, None, None, "rloo") and _trl_accepts(tmp_path, 1, 2, 1, None, None, "rloo")
    assert not _vramplan_accepts(1, 2, 1, None, None, "grpo")
    rloo = trl.RLOOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    spec = load_spec({"model": "qwen2.5-0.5b", "task": "rloo"})
    assert spec.micro_batch_size == rloo.per_device_train_batch_size


def test_both_answers_occur_in_the_cases(tmp_path):
    answers = {_vramplan_accepts(*c) for c in CASES[::7]}
    assert answers == {True, False}


def test_the_default_job_is_trls_default_job(tmp_path):
    # no batch named: TRL's defaults (per_device_train_batch_size, num_generations), which TRL accepts
    trl_default = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    spec = load_spec({"model": "qwen2.5-0.5b", "task": "grpo"})
    assert spec.micro_batch_size == trl_default.per_device_train_batch_size
    assert _vramplan_accepts(None, 1, 1, None, None) and _trl_accepts(tmp_path, None, 1, 1, None, None)
    assert load_spec({"model": "qwen2.5-0.5b", "task": "dpo"}).micro_batch_size == 1   # only GRPO's is TRL's


def test_a_refused_batch_is_one_line_naming_num_generations(capsys):
    assert main(["estimate", "qwen2.5-0.5b", "--task", "grpo"]) == 0
    capsys.readouterr()
    code = main(["estimate", "qwen2.5-0.5b", "--task", "grpo", "--micro-batch-size", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "num_generations" in err and "TRL's default" in err and "multiple of 8" in err


def test_fit_offers_only_splits_trl_accepts(tmp_path):
    """fit varies the micro-batch of a GRPO job with an explicit generation batch: every
    layout it enumerates is one load_spec accepts, and the splits it drops are those TRL
    refuses (the generation batch is no whole number of micro-batches)."""
    from vramplan.plan.evaluate import trained_desc
    from vramplan.plan.space import enumerate_candidates
    job = {"model": "qwen2.5-0.5b", "task": "grpo", "gpu": "a100-80gb", "num_gpus": 2, "micro_batch_size": 4,
           "grad_accum_steps": 4, "generation": {"generation_batch_size": 12}}
    spec = load_spec(job)
    cands = list(enumerate_candidates(spec, trained_desc(spec), {"parallel.zero_stage": (0, 2)}))
    offered = {c.micro_batch_size for c in cands}
    for c in cands:
        load_spec(dict(job, micro_batch_size=c.micro_batch_size, grad_accum_steps=c.grad_accum_steps,
                       parallel={"zero_stage": dict(c.values)["parallel.zero_stage"]}))
    rows = 4 * 4   # per GPU, what every split divides
    for mb in (d for d in range(1, rows + 1) if rows % d == 0):
        assert (mb in offered) == _trl_accepts(tmp_path, mb, rows // mb, 2, None, 12), mb


def test_rloo_refusals_name_rloo(capsys):
    code = main(["estimate", "qwen2.5-0.5b", "--task", "rloo", "--micro-batch-size", "3", "--num-generations", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "TRL's RLOO generates whole groups of 4" in err
    code = main(["estimate", "qwen2.5-0.5b", "--task", "rloo", "--num-generations", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "num_generations: RLOO needs at least 2" in err and "RLOOConfig" in err


def test_measuring_rloo_without_trl_names_the_extra():
    # no written-out RLOO step: without trl, measuring says what to install
    from vramplan.measure import dispatch, trainers
    with mock.patch.object(trainers, "runs_library", return_value=False):
        with pytest.raises(ValueError, match=r"RLOOTrainer; install the measure extra"):
            dispatch.measure_cpu({"model": "qwen2.5-0.5b", "task": "rloo", "seq_len": 16, "max_new_tokens": 8})


def test_a_grpo_job_counting_a_reference_says_trls_default_has_none():
    # GRPOConfig.beta defaults to 0.0 from TRL 0.19 (no reference loaded or run); a job that
    # names no reference still counts one, and says how to write TRL's default
    import vramplan
    def said(**kw):
        est = vramplan.estimate({"model": "qwen2.5-0.5b", "task": "grpo", "seq_len": 64, "max_new_tokens": 32} | kw)
        return any("TRL's default beta is 0.0" in str(n) for n in est.notes), est
    counted, with_ref = said()
    assert counted and with_ref.components.total("reference/weights") > 0
    dropped, without = said(reference_model="precomputed")
    assert not dropped and without.peak_allocated_bytes < with_ref.peak_allocated_bytes
    assert not said(stack={"framework": "trl", "trl": "0.18"})[0]   # 0.04 was TRL's default then
    assert not said(task="rloo")[0]                                  # RLOOConfig's default is 0.05
