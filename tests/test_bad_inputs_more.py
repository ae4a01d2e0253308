"""Bad inputs found by the fifth sweep (badinput5) that the YAML corpus (tests/bad_inputs/)
cannot hold: files written byte by byte, the web API's request bodies, commands other
than `estimate`. Each was a traceback, an exit status other than 2, a hang or a silent
number; each is now one line naming the field and the fix."""
from __future__ import annotations

import json
import struct

import pytest

import vramplan
from vramplan.catalog.model_index_counts import header_params, weight_files


def _safetensors(path, header: bytes) -> str:
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return str(path)


@pytest.mark.parametrize("header", [
    b'{"w": {"dtype": "F32", "shape": ["a"]}}',  # ValueError: invalid literal for int()
    b'{"w": {"dtype": "F32", "shape": 5}}',  # TypeError: exit 70
    b'{"w": {"dtype": "F32", "shape": [1e400]}}',  # OverflowError
    b'{"w": {"dtype": "F32", "shape": [-5, 3]}}',  # -15 parameters, silently
    b'{"w": {"dtype": "F32", "shape": [2.5]}}',  # 2 parameters, silently
    b'{"w": {"dtype": "F32", "shape": {"a": 1}}}',
    b"[" * 100000,  # RecursionError out of json.loads: exit 70
], ids=["word", "int", "inf", "negative", "fraction", "mapping", "nested"])
def test_safetensors_header_shape_names_the_tensor(header, tmp_path):
    path = _safetensors(tmp_path / "model.safetensors", header)
    with pytest.raises(vramplan.SpecError) as info:
        header_params([path], "FluxTransformer2DModel")
    assert info.value.field == "model" and ("tensor 'w' has shape" in str(info.value) or "header" in str(info.value))
    assert "remove the file to count from config.json" in str(info.value)


def test_safetensors_header_good_shapes_count(tmp_path):
    path = _safetensors(tmp_path / "m.safetensors",
                        b'{"w": {"dtype": "F32", "shape": [3, 4]}, "s": {"dtype": "BF16", "shape": []}}')
    assert header_params([path], "X") == 13


def test_sharded_index_naming_shards_by_number_is_no_index(tmp_path):
    """os.path.join(folder, 5) raised TypeError (exit 70): such an index is skipped as an
    unreadable one is, and the single file or the config counts."""
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5}}))
    assert weight_files(str(tmp_path)) == []
    (tmp_path / "model.safetensors.index.json").write_text("[" * 100000)  # RecursionError: exit 70
    assert weight_files(str(tmp_path)) == []
    _safetensors(tmp_path / "model.safetensors", b'{"w": {"dtype": "F32", "shape": [2]}}')
    assert weight_files(str(tmp_path)) == [str(tmp_path / "model.safetensors")]


@pytest.mark.parametrize("offline,says", [
    (True, "HF_HUB_OFFLINE is set, so the hub is not asked"),  # was "LocalEntryNotFoundError"
    (False, "cannot reach the hub to fetch config.json for 'someorg/not-cached' (OSError: no network?)"),
], ids=["hf_hub_offline", "no_network"])
def test_online_hub_id_without_the_hub_is_one_line(offline, says, monkeypatch, tmp_path):
    """--online with no network retried for ~25 s (huggingface_hub's backoff), printing a
    warning line per try, then said only "LocalEntryNotFoundError"."""
    hub = pytest.importorskip("huggingface_hub")
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    asked = []

    def no_network(*args, **kwargs):
        asked.append(args)
        raise OSError("[Errno -2] Name or service not known")
    monkeypatch.setattr(hub, "get_hf_file_metadata", no_network)
    monkeypatch.setattr(hub, "hf_hub_download", no_network)
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.estimate({"model": "someorg/not-cached", "seq_len": 512, "online": True})
    assert info.value.field == "model" and says in str(info.value) and "local config.json path" in str(info.value)
    assert len(asked) == (0 if offline else 1)  # one request, not hf_hub_download's retries


def test_measure_on_cpu_past_the_host_memory_is_refused(monkeypatch, capsys):
    """`measure llama-3.1-405b --device cpu` built the model until the machine swapped or the
    process was killed (a hang): a job whose estimate is past the available RAM is one line."""
    pytest.importorskip("torch")
    import importlib
    from vramplan.cli import main
    measure_cli = importlib.import_module("vramplan.cli.measure")
    monkeypatch.setattr(measure_cli, "_available_ram", lambda: 2**30)
    code = main(["measure", "llama-3.2-1b", "--seq-len", "16", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("vramplan: error: device: measuring this job on cpu")
    assert "this machine has 1.0 GiB available; use --fake" in err[0]


@pytest.mark.parametrize("argv,step", [
    (["--task", "grpo"], 8),  # TRL's default num_generations on one GPU
    (["--task", "grpo", "--num-generations", "4", "--micro-batch-size", "4", "--grad-accum-steps", "2"], 2),
    (["--task", "sft"], 1),
], ids=["grpo_default", "grpo_accum", "sft"])
def test_fit_maximize_micro_batch_takes_grpo_groups(argv, step, capsys):
    """`fit MODEL --task grpo --maximize micro_batch_size` probed micro-batch 1, which TRL's
    GRPO refuses (a generation batch of whole groups): a valid job answered exit 2."""
    from vramplan.cli import main
    code = main(["fit", "llama-3.2-1b", "--seq-len", "256", "--gpu", "h100", *argv,
                 "--maximize", "micro_batch_size", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["value"] > 0 and out["value"] % step == 0
    assert all(point["value"] % step == 0 for point in out["sweep"])


def test_fit_maximize_seq_len_of_a_diffusion_job_is_refused(capsys):
    """It answered "largest seq_len that fits: 2048", the search's cap: a diffusion job reads no seq_len."""
    from vramplan.cli import main
    code = main(["fit", "flux.1-dev", "--task", "diffusion", "--gpu", "h100", "--maximize", "seq_len"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("vramplan: error: maximize: a diffusion job reads no seq_len")


@pytest.mark.parametrize("call", ["fit", "compare"])
@pytest.mark.parametrize("mfu", [float("nan"), 5, 0, True, "0.4"], ids=["nan", "five", "zero", "bool", "str"])
def test_plan_api_refuses_an_mfu_the_cli_refuses(call, mfu):
    """fit(mfu=nan) ranked layouts by NaN step times and compare(mfu=5) answered, where
    `--mfu nan` / `--mfu 5` are refused (plan/answers.py): the Evaluator checks it."""
    from vramplan.plan.compare import compare
    from vramplan.plan.fit import fit
    with pytest.raises(vramplan.SpecError) as info:
        (fit if call == "fit" else compare)({"model": "gpt2", "seq_len": 512, "gpu": "h100"}, mfu=mfu)
    assert info.value.field == "mfu" and "(0, 1]" in str(info.value)


def test_check_api_without_a_gpu_is_a_spec_error(monkeypatch):
    """vramplan.check with no GPU anywhere raised NoGPUError, a RuntimeError: outside the
    ValueError family every other refusal of the Python API belongs to."""
    import importlib
    monkeypatch.setattr(importlib.import_module("vramplan.check"), "local_gpus", lambda: [])
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.check({"model": "gpt2", "seq_len": 512})
    assert isinstance(info.value, ValueError) and info.value.field == "device"
    assert str(info.value).startswith("device: no local GPU")


def test_save_spec_takes_a_mapping_and_checks_it(tmp_path):
    """save_spec({...}) raised AttributeError ('dict' object has no attribute 'to_dict')."""
    path = tmp_path / "job.yaml"
    vramplan.save_spec({"model": "gpt2", "seq_len": 512}, str(path))
    assert vramplan.load_spec(str(path)).seq_len == 512
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.save_spec({"model": "gpt2", "seq_len": 0}, str(path))
    assert info.value.field == "seq_len"


def test_fit_maximize_micro_batch_of_a_lengths_job_stops_at_the_replay(tmp_path, capsys):
    """With a lengths section the doubling search reached 16,384 rows x 100 steps, past what a
    replay draws, and failed with the spec's own refusal; it now says where it stopped."""
    from vramplan.cli import main
    spec = tmp_path / "job.yaml"
    spec.write_text("model: gpt2\nseq_len: 16\ngpu: b200\nlengths: {p50: 8, max: 16}\n")
    code = main(["--lang", "zh", "fit", "--spec", str(spec), "--maximize", "micro_batch_size"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("vramplan: 错误：lengths.steps: micro_batch_size 10,000 仍能放下")


@pytest.mark.parametrize("flags,what", [
    (["--num-gpus", "2", "--tp", "2"], "not tp;"),
    (["--num-gpus", "4", "--fsdp", "full-shard"], "not fsdp;"),
    (["--num-gpus", "4"], "not 4 GPUs without ZeRO;"),
], ids=["tp", "fsdp", "ddp"])
def test_measure_refuses_a_layout_it_does_not_build(flags, what, capsys):
    """`measure --num-gpus 2 --tp 2 --fake` ran one unsharded process and printed its
    difference from the tp-sharded rank's estimate as the error (-42.7%), exit 0."""
    from vramplan.cli import main
    code = main(["measure", "gpt2", "--seq-len", "16", "--fake", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("vramplan: error: parallel: measure runs one process") and what in err[-1]


@pytest.mark.parametrize("argv,says", [
    # the pipeline's defaults note came before the error: two lines on stderr
    (["estimate", "flux.1-dev", "--micro-batch-size", "100000000"], "micro_batch_size: this job needs"),
    (["estimate", "flux.1-dev", "--gpu", "nosuchgpu"], "gpu: unknown GPU 'nosuchgpu'"),
    (["fit", "flux.1-dev", "--gpu", "80GB"], "gpu: fit ranks layouts by step time"),
    # the importer's report (used / ignored keys) came before the error
    (["estimate", "llama-3.2-1b", "--accelerate-config", "{tmp}/acc.yaml", "--seq-len", "-1"], "seq_len: expected an integer"),
], ids=["pipeline_defaults_then_size", "pipeline_defaults_then_gpu", "pipeline_defaults_then_fit_gpu", "import_report_then_seq_len"])
def test_notes_of_the_input_are_not_said_before_its_error(argv, says, tmp_path, capsys):
    """Round 3: what reading the input noted is said once the command is past the checks that
    can refuse it (cli.flags.say_notes), so a refused job is still one line."""
    from vramplan.cli import main
    (tmp_path / "acc.yaml").write_text("distributed_type: FSDP\nnum_processes: 2\nbogus_key: 1\n")
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("vramplan: error: " + says), err


def test_notes_of_the_input_are_said_with_an_answer(tmp_path, capsys):
    from vramplan.cli import main
    (tmp_path / "acc.yaml").write_text("distributed_type: FSDP\nnum_processes: 2\nbogus_key: 1\n")
    assert main(["estimate", "llama-3.2-1b", "--seq-len", "128", "--accelerate-config", str(tmp_path / "acc.yaml")]) == 0
    assert "ignored bogus_key" in capsys.readouterr().err
    assert main(["estimate", "stable-diffusion-v1-5", "--json"]) == 0
    assert "from stable-diffusion-v1-5's defaults" in capsys.readouterr().err


@pytest.mark.parametrize("content", [bytes(range(256)), b"\xff\xfe1\n"], ids=["binary", "latin1"])
def test_lengths_file_not_utf8_is_named_without_an_exception_name(content, tmp_path):
    """Round 3: it said "cannot be read (UnicodeDecodeError)"."""
    (tmp_path / "len.txt").write_bytes(content)
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.estimate({"model": "gpt2", "seq_len": 512, "lengths": {"lengths_file": str(tmp_path / "len.txt")}})
    assert info.value.field == "lengths.lengths_file" and "not UTF-8 text" in str(info.value)
    assert "Error" not in str(info.value)
