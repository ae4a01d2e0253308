"""compare: --strategy in the command line's flag words, default rows that each change the job;
TP/PP details in the text answer; fit as a table, a command line and config fragments."""
import json
import shlex

import pytest

import vramplan

from vramplan.cli import main, strategy_from_flags
from vramplan.importers.deepspeed import from_deepspeed
from vramplan.importers.hf_args import from_training_args
from vramplan.plan.compare import default_strategies
from vramplan.plan.evaluate import apply_changes
from vramplan.report.emit import command_line, deepspeed_config, training_args
from vramplan.spec import SpecError, load_spec

JOB = ["qwen2.5-0.5b", "--gpu", "rtx-4090", "--micro-batch-size", "4", "--grad-accum-steps", "2",
       "--seq-len", "1024", "--num-gpus", "2"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_strategy_flags_equal_key_value_form(capsys):
    s = strategy_from_flags("z3 --zero-stage 3 --gradient-checkpointing full --max-length 512")
    assert s.name == "z3"
    assert s.changes == {"parallel.zero_stage": 3, "gradient_checkpointing": "full", "seq_len": 512}
    flags = json.loads(run(capsys, "compare", *JOB, "--json", "--strategy",
                           "--zero-stage 3 --gradient-checkpointing full")[1])["rows"][1]
    pairs = json.loads(run(capsys, "compare", *JOB, "--json", "--strategy",
                           "z parallel.zero_stage=3 gradient_checkpointing=full")[1])["rows"][1]
    assert flags["estimate"]["device_bytes"] == pairs["estimate"]["device_bytes"]
    assert flags["spec"] == pairs["spec"]


@pytest.mark.parametrize("text", ["--bogus 1", "--zero-stage 3 other-model", "--spec x.yaml", "name-only"])
def test_bad_strategies_are_one_line(capsys, text):
    code, _, err = run(capsys, "compare", *JOB, "--strategy", text)
    assert code == 2 and "strategy" in err and err.count("\n") == 1


@pytest.mark.parametrize("extra", [
    {}, {"gradient_checkpointing": "full"}, {"gradient_checkpointing": "selective", "method": "lora"},
    {"parallel": {"zero_stage": 3}, "gradient_checkpointing": "full", "num_gpus": 2},
    {"optimizer": "adamw-8bit", "method": "qlora"}, {"parallel": {"fsdp": "full-shard"}, "num_gpus": 2}])
def test_default_rows_each_change_the_job(extra):
    spec = load_spec({"model": "qwen2.5-0.5b", **extra})
    rows = default_strategies(spec)
    assert rows[0].name == "baseline" and not rows[0].changes
    specs = [apply_changes(spec, r.changes).to_dict() for r in rows[1:]]
    base = spec.to_dict()
    assert all(s != base for s in specs), "a row repeats the baseline"
    assert len({json.dumps(s, sort_keys=True) for s in specs}) == len(specs), "two rows are one job"
    for r in rows[1:]:  # nothing the job has is weakened
        s = apply_changes(spec, r.changes)
        order = ["none", "selective", "full"]
        assert order.index(s.gradient_checkpointing.value) >= order.index(spec.gradient_checkpointing.value)
        assert s.parallel.zero_stage >= spec.parallel.zero_stage
        if spec.parallel.zero_stage == 3:  # no name claims a weaker setting than the job's
            assert "zero-1" not in r.name and "zero-2" not in r.name, r.name


def test_text_answer_shows_stage_peaks_and_communication(capsys):
    code, out, _ = run(capsys, "estimate", "llama-3.2-1b", "--num-gpus", "8", "--tp", "2", "--pp", "2",
                       "--zero-stage", "1", "--gpu", "h100-80gb")
    data = json.loads(run(capsys, "estimate", "llama-3.2-1b", "--num-gpus", "8", "--tp", "2", "--pp", "2",
                          "--zero-stage", "1", "--gpu", "h100-80gb", "--json")[1])
    text = " ".join(out.split())
    assert code == 0 and "pipeline stage peaks" in text
    for peak in data["parallel"]["pp_stage_peaks"]:
        assert f"{peak / 2**30:,.2f} GiB" in text
    for axis, info in data["communication"].items():
        assert f"communication {axis}: {info['bytes'] / 1e9:,.2f} GB" in text


def test_fit_command_line_reproduces_the_layout(capsys):
    data = json.loads(run(capsys, "fit", *JOB, "--json", "--top-k", "2")[1])
    code, out, _ = run(capsys, "fit", *JOB, "--top-k", "2", "--format", "markdown")
    line = next(l for l in out.splitlines() if "#1 as a command:" in l).split("as a command: ", 1)[1]
    argv = shlex.split(line)
    assert argv[:2] == ["vramplan", "estimate"]
    again = json.loads(run(capsys, *argv[1:], "--json")[1])
    assert again["device_bytes"] == data["results"][0]["estimate"]["device_bytes"]
    # the estimate fills the load dtype from the checkpoint; the layout's spec leaves it unset
    assert {k: v for k, v in again["spec"].items() if k != "load_dtype"} == data["results"][0]["spec"]


def _stored(d) -> tuple:
    """What decides memory: the dtypes stored and computed in (not the words or sources)."""
    return (d.weights, d.gradients, d.optimizer_states, d.master_weights, d.compute, d.autocast)


def test_emitted_configs_import_back():
    spec = load_spec({"model": "qwen2.5-0.5b", "precision": "mixed-bf16", "micro_batch_size": 3,
                      "grad_accum_steps": 5, "num_gpus": 4,
                      "parallel": {"zero_stage": 2, "offload_optimizer": "cpu"}})
    back, _ = from_deepspeed(deepspeed_config(spec))
    assert back["parallel"] == {"zero_stage": 2, "offload_optimizer": "cpu"}
    assert (back["micro_batch_size"], back["grad_accum_steps"]) == (3, 5)
    # DeepSpeed's bf16 section is the deepspeed stack's bf16: the same dtypes as mixed-bf16
    from vramplan.components.dtypes import dtypes_of
    again = load_spec({"model": "qwen2.5-0.5b", "num_gpus": 4, **back})
    assert _stored(dtypes_of(again)) == _stored(dtypes_of(spec))
    spec = load_spec({"model": "qwen2.5-0.5b", "precision": "amp-bf16", "micro_batch_size": 2, "num_gpus": 2,
                      "gradient_checkpointing": "full", "optimizer_impl": "fused",
                      "parallel": {"fsdp": "full-shard"}})
    back, rep = from_training_args(training_args(spec))
    assert not rep.unresolved
    rebuilt = apply_changes(load_spec({"model": "qwen2.5-0.5b", "num_gpus": 2}), {
        k if not isinstance(v, dict) else k: v for k, v in back.items()})
    for key in ("micro_batch_size", "gradient_checkpointing", "optimizer", "optimizer_impl"):
        assert getattr(rebuilt, key) == getattr(spec, key), key
    # TrainingArguments cannot say the load dtype (amp-bf16 loads fp32): given as --load-dtype
    from vramplan.components.dtypes import dtypes_of
    assert _stored(dtypes_of(apply_changes(rebuilt, {"load_dtype": "float32"}))) == _stored(dtypes_of(spec))
    assert rebuilt.parallel.fsdp == "full-shard"


def test_emit_refuses_what_the_format_cannot_say():
    with pytest.raises(SpecError, match="Megatron"):
        deepspeed_config(load_spec({"model": "qwen2.5-0.5b", "num_gpus": 4, "parallel": {"tp": 2}}))
    with pytest.raises(SpecError, match="master weights"):
        deepspeed_config(load_spec({"model": "qwen2.5-0.5b", "precision": "bf16"}))
    with pytest.raises(SpecError, match="selective"):
        training_args(load_spec({"model": "qwen2.5-0.5b", "gradient_checkpointing": "selective"}))
    assert command_line(load_spec({"model": "qwen2.5-0.5b"})) == "vramplan estimate qwen2.5-0.5b"


@pytest.mark.parametrize("job", [{"task": "grpo"}, {"task": "grpo", "micro_batch_size": 4, "num_generations": 4},
                                 {"task": "dpo", "micro_batch_size": 2}, {"task": "kto", "reference_model": "precomputed"}])
def test_command_line_keeps_the_task(capsys, job):
    # the printed command estimates the same job: the task is said, its defaults are not
    spec = load_spec({"model": "qwen2.5-0.5b", **job})
    argv = shlex.split(command_line(spec))
    again = json.loads(run(capsys, *argv[1:], "--json")[1])
    assert again["spec"]["task"] == job["task"]
    assert {k: v for k, v in again["spec"].items() if k != "load_dtype"} == spec.to_dict()


@pytest.mark.parametrize("job", [
    {"method": "qlora", "stack": "hf-trainer"},
    {"method": "qlora", "stack": "trl", "load_dtype": "float32",
     "quantization": {"type": "nf4", "double_quant": False, "prepare": "peft"}},
    {"method": "qlora", "quantization": {"type": "gptq", "bits": 3, "group_size": 64}},
    {"precision": "bf16", "stack": "torchtune"},
    # the framework's own library release: `--stack trl@0.25` (TRL's heads change by release)
    {"task": "dpo", "precision": "bf16", "stack": {"framework": "trl", "trl": "0.25"}},
    {"stack": {"framework": "hf-trainer", "transformers": "4.57"}},
])
def test_command_line_keeps_the_stack_and_the_quantization(capsys, job):
    # the printed command estimates the same job: what bf16 means (the stack), the load dtype
    # and how the base is quantized and prepared
    spec = load_spec({"model": "qwen2.5-0.5b", **job})
    argv = shlex.split(command_line(spec))
    again = json.loads(run(capsys, *argv[1:], "--json")[1])
    assert again["spec"] == spec.to_dict() | {"load_dtype": again["spec"]["load_dtype"]}
    assert again["peak_allocated_bytes"] == vramplan.estimate(spec).peak_allocated_bytes


def test_command_line_refuses_what_no_flag_says():
    with pytest.raises(SpecError, match="save-spec"):
        command_line(load_spec({"model": "qwen2.5-0.5b", "stack": {"framework": "trl", "peft": "0.17"}}))
    with pytest.raises(SpecError, match="save-spec"):
        command_line(load_spec({"model": "qwen2.5-0.5b", "stack": {"framework": "plain", "trl": "0.25"}}))


def test_stack_at_release_names_the_framework_s_library():
    from vramplan.spec.stack import parse_stack
    assert parse_stack("trl@1.9").to_dict() == parse_stack({"framework": "trl", "trl": "1.9"}).to_dict()
    assert parse_stack("hf-trainer@4.57").transformers == "4.57"
    for bad, word in (("torchtune@1.0", "takes no release"), ("trl@abc", "release"), ("trl@", "release")):
        with pytest.raises(SpecError, match=word):
            parse_stack(bad)


def test_fit_emit_on_the_command_line(capsys):
    code, out, err = run(capsys, "fit", *JOB, "--precision", "mixed-bf16", "--emit", "deepspeed")
    cfg = json.loads(out)
    assert code == 0 and "zero_optimization" in cfg and "layout #" in err
    code, _, err = run(capsys, "fit", *JOB, "--emit", "deepspeed")  # bf16: no DeepSpeed form
    assert code == 2 and "master weights" in err and err.count("\n") == 1
