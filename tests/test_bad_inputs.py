"""The bad-input corpus (tests/bad_inputs/*.yaml): every case through the Python API
(`vramplan.estimate`, with `import_config_files` for engine/trainer files) and through the
CLI (`main(["estimate", "--spec", ...])`).

Outcomes: `error` -> the API raises SpecError whose `field` is the case's field and whose
message holds `says`; the CLI exits 2 with one `vramplan: error:` line naming the field and
no traceback. `warn` -> an estimate whose notes hold `says`, printed by the CLI as `note:`.
`ok` -> an estimate with a positive peak and no notes (but `allow_note`).
"""
from __future__ import annotations

import json
import os
import pathlib

import pytest
import yaml

import vramplan
from vramplan.cli import main
from vramplan.importers import import_config_files
from vramplan.importers.report import merge

HERE = pathlib.Path(__file__).parent / "bad_inputs"
_FILES = {"deepspeed": "ds.json", "deepspeed_yaml": "ds.yaml", "training_args": "args.json",
          "accelerate_config": "accelerate.yaml", "recipe": "recipe.yaml"}


def _cases() -> list[dict]:
    out = []
    for path in sorted(HERE.glob("*.yaml")):
        for case in yaml.safe_load(path.read_text()):
            case["source"] = path.name
            out.append(case)
    return out


CASES = _cases()


def _squash(text: str) -> str:
    return "".join(str(text).split()).lower()


def _write(path: pathlib.Path, content) -> str:
    if isinstance(content, str):
        path.write_text(content)
    elif path.suffix == ".json":
        path.write_text(json.dumps(content))
    else:
        path.write_text(yaml.safe_dump(content))
    return str(path)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _materialize(case: dict, tmp: pathlib.Path) -> tuple[object, dict, str | None]:
    """(what the API gets, the config files by flag, the spec path the CLI gets or None)."""
    spec = dict(case.get("spec") or {})
    if "config" in case or "config_text" in case:
        if case.get("inline"):
            spec["model"] = case["config"]
        else:
            content = case["config"] if "config" in case else case["config_text"]
            spec["model"] = _write(tmp / "config.json", content)
    if case.get("config_folder"):
        (tmp / "model").mkdir()
        spec["model"] = str(tmp / "model")
    files = {}
    for key, content in (case.get("files") or {}).items():
        flag = "deepspeed" if key == "deepspeed_yaml" else key
        files[flag] = _write(tmp / _FILES[key], content)
    spec_path = None
    if "spec_text" in case or "spec_text_hex" in case:
        text = case.get("spec_text", "")
        if "deep" in case:
            text = text.replace("PLACEHOLDER_DEEP", _nested(case["deep"]))
        text += "#" + "x" * case["pad_bytes"] + "\n" if case.get("pad_bytes") else ""
        spec_path = tmp / case.get("spec_name", "spec.yaml")
        if "spec_text_hex" in case:
            spec_path.write_bytes(bytes.fromhex(case["spec_text_hex"]))
        else:
            spec_path.write_text(text)
        spec_path = str(spec_path)
    if "spec_path" in case:
        spec_path = case["spec_path"].format(tmp=tmp)
    return (spec_path if spec_path else spec), files, spec_path


def _api(case: dict, tmp: pathlib.Path):
    source, files, _ = _materialize(case, tmp)
    if files:
        overrides, _ = import_config_files(**files)
        source = merge(dict(source), overrides)
    return vramplan.estimate(source)


def _cli(case: dict, tmp: pathlib.Path, capsys) -> tuple[int, str, str]:
    if "flags" in case:  # a command line (tests/bad_inputs/flags.yaml)
        code = main(["estimate", *map(str, case["flags"])])
        out, err = capsys.readouterr()
        return code, out, err
    source, files, spec_path = _materialize(case, tmp)
    if spec_path is None:
        spec_path = _write(tmp / "cli-spec.yaml", source)
    argv = ["estimate", "--spec", spec_path]
    for flag, path in files.items():
        argv += ["--" + flag.replace("_", "-"), path]
    code = main(argv + list(case.get("cli") or []))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_python_api(case, tmp_path):
    if case["expect"] == "error":
        with pytest.raises(vramplan.SpecError) as info:
            _api(case, tmp_path)
        assert isinstance(info.value, ValueError)
        if "field" in case:
            assert info.value.field == str(case["field"]) or info.value.field.endswith(str(case["field"])), str(info.value)
        assert _squash(case.get("says", case.get("field", ""))) in _squash(info.value), str(info.value)
        assert "\n" not in str(info.value)
        return
    est = _api(case, tmp_path)
    assert est.peak_allocated_bytes > 0
    if case["expect"] == "warn":
        assert any(_squash(case["says"]) in _squash(n) for n in est.notes), est.notes
    else:  # `allow_note`: an informational note this job always carries (host memory)
        allowed = _squash(case.get("allow_note", "\0"))
        assert [n for n in est.notes if allowed not in _squash(n)] == [], est.notes


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_cli(case, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VRAMPLAN_ONLINE", raising=False)
    code, out, err = _cli(case, tmp_path, capsys)
    assert "Traceback" not in out + err
    if case["expect"] == "error":
        assert code == 2, (out, err)
        errors = [line for line in err.splitlines() if line.startswith("vramplan: error:")]
        assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err
        if not case.get("files"):
            assert len(err.strip().splitlines()) == 1, err
        assert _squash(case.get("field", "")) in _squash(errors[0]), errors[0]
        assert _squash(case.get("says", "")) in _squash(errors[0]), errors[0]
        return
    assert code in (0, 1), err
    if case["expect"] == "warn":
        assert "note:" in out and _squash(case["says"]) in _squash(out), out
    elif "allow_note" not in case:
        assert "note:" not in out, out


FLAG_CASES = [c for c in CASES if "flags" in c]


@pytest.mark.parametrize("case", FLAG_CASES, ids=[c["id"] for c in FLAG_CASES])
def test_flags_make_the_spec_of_their_case(case, monkeypatch):
    """A flags case's command line makes exactly its `spec` (so the API and the CLI see one job)."""
    from vramplan.cli.main import build_parser, dashed, flags_to_data
    monkeypatch.delenv("VRAMPLAN_ONLINE", raising=False)
    args = build_parser().parse_args(dashed(["estimate", *map(str, case["flags"])]))
    assert flags_to_data(args, {}) == case["spec"]


def test_corpus_is_large_and_covers_every_outcome():
    kinds = [c["expect"] for c in CASES]
    assert len(CASES) >= 150
    assert {"error", "warn", "ok"} <= set(kinds)
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    for case in CASES:
        assert case["expect"] in ("error", "warn", "ok"), case["id"]
        assert case["expect"] != "error" or "field" in case or "says" in case, case["id"]
        assert case["expect"] != "warn" or "says" in case, case["id"]


FLAGS = [  # (command line, a substring of the one error line); {tmp} is a folder
    (["estimate", "gpt2", "--seq-len", "abc"], "--seq-len"),
    (["estimate", "gpt2", "--zero-stage", "true"], "--zero-stage"),
    (["estimate", "llama-3.2-1b", "--num-gpus", "2", "--tp", "2", "--sp", "maybe"], "--sp"),
    (["estimate", "gpt2", "--seq-len", "512", "--plot", "/nonexistent-folder/x.png"], "No such file"),
    (["estimate", "gpt2", "--seq-len", "512", "--save-spec", "{tmp}"], "directory"),
    (["estimate", "gpt2", "--seq-len", "8192"], "learned positions"),
    (["estimate", "llama-3.1-8b", "--num-gpus", "3", "--tp", "3"], "parallel.tp"),
    (["estimate", "llama-3.1-8b", "--num-gpus", "16", "--tp", "16"], "8 KV heads"),
    (["estimate", "gpt2", "--seq-len", "512", "--num-gpus", "64", "--pp", "64"], "parallel.pp"),
    (["estimate", "mixtral-8x7b", "--num-gpus", "16", "--ep", "16"], "parallel.ep"),
    (["estimate", "llama-3.1-8b", "--num-gpus", "3", "--cp", "3", "--seq-len", "1000"], "parallel.cp"),
    (["estimate", "llama-3.2-1b", "--offload-optimizer", "cpu"], "offload"),
    (["estimate", "llama-3.2-1b", "--num-gpus", "4", "--pp", "2", "--zero-stage", "3"], "pipeline"),
    (["estimate", "--spec", "{tmp}/missing.yaml"], "file not found"),
    (["estimate", "vramplan-test-org/not-cached"], "--online"),
    (["estimate", "gpt2", "--seq-len", "512", "--gpu", "h1000"], "gpu"),
    (["compare", "llama-3.1-8b", "--num-gpus", "3", "--tp", "3", "--gpu", "h100"], "parallel.tp"),
    (["check", "llama-3.1-8b", "--num-gpus", "16", "--tp", "16", "--gpu", "h100"], "KV heads"),
    (["fit", "llama-3.2-1b", "--gpu", "h1000"], "gpu: unknown GPU 'h1000'"),  # round 3: was field `spec`
    # round 3: --minimize was dropped for --maximize, and --only without --vary searched the defaults
    (["fit", "llama-3.2-1b", "--gpu", "h100", "--maximize", "seq_len", "--minimize", "num_gpus"], "ask two questions"),
    (["fit", "llama-3.2-1b", "--gpu", "h100", "--only"], "only: searches only the --vary axes"),
    # fuzz: --vary micro_batch_size (no axis: fit derives it) said "unknown axis" and no fix
    (["fit", "llama-3.2-1b", "--gpu", "h100", "--vary", "micro_batch_size=1,2"], "use --maximize micro_batch_size"),
    (["fit", "llama-3.2-1b", "--gpu", "h100", "--vary", "nosuch"], "known: parallel.zero_stage"),
    (["compare", "llama-3.2-1b", "--gpu", "1e30GiB"], "gpu: unknown GPU '1e30GiB'"),
    (["estimate", "llama-3.2-1b", "--optimizer", "galore-adamw", "--optim-args", "="], "--optim-args"),
    (["estimate", "gpt2", "--seq-len", "512", "--depth", "0"], "depth"),
    (["estimate", "gpt2", "--seq-len", "512", "--depth", "-1"], "depth"),
    (["estimate", "llama-3.2-1b", "--num-params", "7b"], "num_params"),
    # compare / fit / check / measure / serve options (badinput sweep: tracebacks, exit 70, silent answers)
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--headroom", "200%"], "headroom: 200% leaves nothing"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--headroom", "100%"], "headroom"),
    (["check", "gpt2", "--seq-len", "512", "--gpu", "h100", "--headroom", "5%"], "headroom"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--mfu", "0"], "mfu"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--mfu", "nan"], "mfu"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--top-k", "0"], "top_k"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--vary", "num_gpus=0"], "num_gpus"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--vary", "tp=0", "--only"], "parallel.tp"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--vary", "num_gpus=1000000"], "no layout to search"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--max-gpus", "4"], "max_gpus"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--minimize", "num_gpus", "--max-gpus", "0"], "max_gpus"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategies", "{tmp}/missing.yaml"], "strategies"),
    (["measure", "gpt2", "--seq-len", "64", "--device", "tpu"], "device"),
    (["serve", "--port", "99999"], "port"),
    (["serve", "--port", "0"], "from 1 to 65535"),  # badinput5: "serving the page at http://127.0.0.1:0/"
    (["estimate", "--spec", "/dev/null"], "not a regular file"),
    (["estimate", "--spec", "-"], "not a regular file"),
    # badinput3: a filter that matches nothing printed an empty table (read as an empty catalog), exit 0
    (["models", "nosuch-model-xyz"], "no catalog model has 'nosuch-model-xyz'"),
    (["models", "llama", "--kind", "diffusion"], "of kind diffusion"),
    # badinput4: a raw size under task diffusion / with vision flags was exit 70 (AttributeError)
    (["estimate", "--num-params", "7b", "--task", "diffusion"], "num_params"),
    (["estimate", "--num-params", "7b", "--images-per-sample", "2", "--seq-len", "512"], "vision"),
    (["estimate", "llama-3.2-1b", "--seq-len", "512", "--optimizer", "galore-adamw", "--rank", "8",
      "--optim-target-modules", ""], "low_rank.target_modules"),
    # badinput4: a strategy that changed the GPU or the model was estimated for the job's own
    # (a silent number: `a --gpu h1000` fit the h100); a typo in a key was a "not applicable" row
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "a --gpu a100-40gb"], "holds fixed"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "big model=llama-3.1-8b"], "holds fixed"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "t seqlen=256"], "did you mean 'seq_len'"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "t lora.rr=4"], "lora.rr is no spec key"),
    # a value no job takes was a "not applicable" row and exit 0
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "z --zero-stage 9"], "strategy: z: parallel.zero_stage"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "n --num-gpus 0"], "num_gpus"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "p precision=fp8"], "precision"),
    # badinput4: `--device -1` / `--device 3` answered "device 0" from the catalog GPU; `--fake` ran
    # under any --device word; a bare headroom of 2 or 2.5 kept 2 bytes free
    (["check", "gpt2", "--seq-len", "512", "--gpu", "h100", "--device", "-1"], "device: expected a local GPU index"),
    (["measure", "gpt2", "--seq-len", "16", "--fake", "--device", "abc"], "device"),
    (["check", "gpt2", "--seq-len", "512", "--gpu", "h100", "--headroom", "2"], "reads as 2 bytes"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--headroom", "2.5"], "headroom"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--headroom", "1.0"], "headroom"),
    # badinput4: an empty path was skipped as if the option were not given; --json beside
    # another --format printed JSON
    (["estimate", "gpt2", "--seq-len", "512", "--plot", ""], "--plot: the path is empty"),
    (["estimate", "gpt2", "--seq-len", "512", "--save-spec", " "], "--save-spec"),
    (["estimate", "gpt2", "--seq-len", "512", "--spec", ""], "--spec"),
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategies", ""], "--strategies"),
    # fuzz2: two strategies under one name were two rows of the answer told apart by nothing
    (["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategy", "z --zero-stage 3", "--strategy",
      "z --gradient-checkpointing full"], "strategies: two strategies are named 'z'"),
    # fuzz2: an empty --headroom was read as no headroom (fit: its default), without a word
    (["fit", "llama-3.2-1b", "--gpu", "h100", "--headroom", ""], "--headroom: the value is empty"),
    (["check", "gpt2", "--seq-len", "512", "--gpu", "h100", "--headroom", " "], "--headroom: the value is empty"),
    (["estimate", "gpt2", "--seq-len", "512", "--json", "--format", "csv"], "keep one"),
    # badinput4: --tiers skipped these without a word (an invalid --mfu 0 too)
    (["compare", "gpt2", "--seq-len", "512", "--tiers", "--mfu", "0"], "tiers: --mfu is not read with --tiers"),
    (["compare", "gpt2", "--seq-len", "512", "--tiers", "--format", "csv"], "--format csv"),
    (["compare", "gpt2", "--seq-len", "512", "--tiers", "--strategy", "a --zero-stage 3"], "--strategy"),
    # badinput4: fit --maximize / --minimize answer one layout; these were skipped without a word
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--maximize", "seq_len", "--top-k", "3"], "top_k: --top-k is not read"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--minimize", "num_gpus", "--emit", "deepspeed"], "emit"),
    (["fit", "gpt2", "--seq-len", "512", "--gpu", "h100", "--maximize", "seq_len", "--vary", "seq_len=256,512"], "vary"),
]


@pytest.mark.parametrize("argv,says", FLAGS, ids=[" ".join(a[1:4]) for a, _ in FLAGS])
def test_cli_flags_one_line(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VRAMPLAN_ONLINE", raising=False)
    code = main([a.format(tmp=tmp_path) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("vramplan: error:"), (code, err)
    assert says in lines[0] and "Traceback" not in out + err


def test_cli_warning_is_printed_as_a_note(capsys):
    code = main(["estimate", "llama-3.2-1b", "--seq-len", "200000", "--gradient-checkpointing", "full"])
    out = _squash(capsys.readouterr().out)
    assert code == 0 and _squash("note: seq_len: 200,000 tokens are past") in out


@pytest.mark.parametrize("text,says", [
    ("[]\n", "holds no strategies"),  # the baseline alone was printed
    ("- {name: a, changes: {}}\n", "changes nothing"),  # a row repeating the baseline
    ("- {name: a, changes: {seq_len: 256}, chagnes: {}}\n", "name and changes only"),  # a key dropped unread
    # fuzz2: two rows of the answer under one name, told apart by nothing
    ("- {name: z, changes: {seq_len: 256}}\n- {name: z, changes: {gradient_checkpointing: full}}\n",
     "entries 1 and 2 are both named 'z'"),
], ids=["empty_list", "empty_changes", "unknown_entry_key", "same_name_twice"])
def test_strategies_file_slips(text, says, tmp_path, capsys):
    path = tmp_path / "strategies.yaml"
    path.write_text(text)
    code = main(["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategies", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("vramplan: error: strategies: ") and says in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err


def test_strategies_file_entries_not_mappings(tmp_path, capsys):
    path = tmp_path / "strategies.yaml"
    path.write_text("- zero3\n- offload\n")  # names alone: each entry needs its changes
    code = main(["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--strategies", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("vramplan: error: strategies: ") and "entry 1" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err


def test_compare_rows_the_libraries_refuse_are_not_applicable(capsys):
    """A strategy whose job the libraries refuse (PEFT: LoRA targets the model lacks, caught
    in validity.check_job, after the spec loaded) is a row that says why, not an error for
    the whole comparison (it was exit 2 before; the default LoRA rows on GPT-2 hit it too)."""
    code = main(["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--json",
                 "--strategy", "bad --method lora --lora-target-modules nomatch"])
    out, err = capsys.readouterr()
    rows = json.loads(out)["rows"]
    assert code == 0 and [r["name"] for r in rows] == ["baseline", "bad"] and rows[0]["fits"]
    assert "not applicable: lora.target_modules" in rows[1]["note"]


def test_compare_strategy_reaches_deeper_keys(capsys):
    """`parallel.extras.overlap_comm=false` was set as parallel["extras.overlap_comm"], an
    unknown key, so the row said "not applicable" (spec/variants.py with_dotted)."""
    code = main(["compare", "gpt2", "--seq-len", "512", "--gpu", "h100", "--num-gpus", "2", "--zero-stage", "2",
                 "--json", "--strategy", "no-overlap parallel.extras.overlap_comm=false"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert code == 0 and rows[1]["note"] == "" and rows[1]["spec"]["parallel"]["extras"]["overlap_comm"] is False


def test_check_device_without_a_local_gpu(capsys, monkeypatch):
    """No local GPU: the catalog GPU stands in as device 0; another index was answered as
    device 0 (a silent number for a device the user did not ask about)."""
    import importlib
    monkeypatch.setattr(importlib.import_module("vramplan.check"), "local_gpus", lambda: [])
    code = main(["check", "gpt2", "--seq-len", "512", "--gpu", "h100", "--device", "3"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vramplan: error: device: no GPU 3") and len(err.strip().splitlines()) == 1


def test_serve_port_in_use_is_one_line(capsys):
    """uvicorn logged "ERROR: [Errno 98] ..." and exited 3 for an address it could not bind."""
    import socket
    pytest.importorskip("uvicorn")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        code = main(["serve", "--port", str(held.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vramplan: error: port: cannot listen on") and len(err.strip().splitlines()) == 1


def test_alloc_conf_from_the_environment_names_the_variable(capsys, monkeypatch):
    """A bad PYTORCH_CUDA_ALLOC_CONF was reported as the spec's alloc_conf, which the user never wrote."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:maybe")
    code = main(["estimate", "gpt2", "--seq-len", "512"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vramplan: error: alloc_conf: ") and len(err.strip().splitlines()) == 1
    assert "environment's PYTORCH_ALLOC_CONF" in err
    assert main(["estimate", "gpt2", "--seq-len", "512", "--alloc-conf", "expandable_segments:True"]) == 0


LENGTHS_FILES = [  # (file content, a substring of the error): badinput4, each was "spec: invalid literal
    ("100\n\u00b2\n", "line 2 is '\u00b2'"),  # for int()" / "spec: Exceeds the limit (4300 digits)"
    ("7" * 5000 + "\n", "5,000-digit number"),
    ("[" + "7" * 5000 + "]", "thousands of digits"),
    ("[" * 100000, "(nested lists)"),  # badinput5: RecursionError, exit 70
]


@pytest.mark.parametrize("content,says", LENGTHS_FILES, ids=["superscript", "digits_line", "digits_json", "json_nested"])
def test_lengths_file_numbers_python_cannot_read(content, says, tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.estimate({"model": "gpt2", "seq_len": 512, "lengths": {"lengths_file": str(path)}})
    assert info.value.field == "lengths.lengths_file" and says in str(info.value)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: gpt2\nseq_len: 512\nlengths: {{lengths_file: {path}}}\n")
    code = main(["estimate", "--spec", str(spec)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("vramplan: error: lengths.lengths_file:") and len(err.strip().splitlines()) == 1


def test_lengths_file_folder_is_not_file_not_found(tmp_path):
    with pytest.raises(vramplan.SpecError, match="is a folder"):
        vramplan.estimate({"model": "gpt2", "seq_len": 512, "lengths": {"lengths_file": str(tmp_path)}})


@pytest.mark.parametrize("argv", [["estimate", "x" * 3000], ["estimate", "gpt2", "--gpu", "h" * 3000],
                                  ["estimate", "gpt2", "--precision", "b" * 3000]], ids=["model", "gpu", "precision"])
def test_a_pasted_value_keeps_the_line_short(argv, capsys):
    """A 3,000-character value was echoed whole (twice for an unknown key): the line is cut."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and len(err) < 400 and "characters)" in err


def test_jobspec_built_directly_parses_its_sections():
    """JobSpec(lora=5) / JobSpec(quantization={...}) bypassed load_spec's section parsing and
    failed later with AttributeError ('int' object has no attribute 'use_dora')."""
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.JobSpec(model="gpt2", method="lora", lora=5)
    assert info.value.field == "lora"
    spec = vramplan.JobSpec(model="gpt2", method="qlora", quantization={"type": "nf4"})
    assert spec.quantization.type.value == "nf4"
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.JobSpec(model="gpt2", parallel="x")
    assert info.value.field == "parallel"


def test_compare_api_bad_arguments():
    """compare() took a mapping as the spec, a str or ints as strategies, a negative
    headroom: AttributeError/TypeError deep inside, or a headroom that adds memory."""
    from vramplan.plan.compare import Strategy, compare
    job = {"model": "gpt2", "seq_len": 512, "gpu": "h100"}
    assert compare(job)[0].fits  # a mapping is loaded, as estimate() loads it
    for strategies in ("zero3", [5], [Strategy("a", 5)]):
        with pytest.raises(vramplan.SpecError) as info:
            compare(job, strategies=strategies)
        assert info.value.field == "strategies"
    with pytest.raises(vramplan.SpecError) as info:
        compare(job, headroom_bytes=-1)
    assert info.value.field == "headroom"


@pytest.mark.parametrize("kwargs,field", [
    ({"axes": 5}, "vary"), ({"axes": {"foo": [1]}}, "vary"), ({"axes": {"parallel.tpp": [1]}}, "vary"),
    ({"axes": {"num_gpus": 5}}, "vary"), ({"axes": {"num_gpus": []}}, "vary"),
    ({"top_k": 0}, "top_k"), ({"top_k": "x"}, "top_k"), ({"gpu": "h1000"}, "gpu"), ({"headroom_bytes": -1}, "headroom"),
], ids=["axes_int", "axis_unknown", "axis_unknown_inner", "axis_values_int", "axis_values_empty",
        "top_k_zero", "top_k_word", "gpu_unknown", "headroom_negative"])
def test_fit_api_bad_arguments(kwargs, field):
    """fit() from Python: AttributeError/TypeError/IndexError deep inside, or an unknown axis
    that made every layout invalid (answered as "nothing fits")."""
    from vramplan.plan.fit import fit
    with pytest.raises(vramplan.SpecError) as info:
        fit({"model": "gpt2", "seq_len": 512, "gpu": "h100"}, **kwargs)
    assert info.value.field == field and "\n" not in str(info.value)


def test_measure_refusal_is_exit_2(capsys):
    """A job `measure` does not build (loss_impl chunked) printed "failed (measure): ..." and
    exited 0; it is bad input: exit 2 and the error line last on stderr (the document stays)."""
    pytest.importorskip("torch")
    code = main(["measure", "gpt2", "--seq-len", "16", "--loss-impl", "chunked", "--fake"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == "vramplan: error: loss_impl: only 'standard' is measured, got 'chunked'"


def test_measure_ppo_takes_a_model_path(tmp_path, capsys):
    """measure_ppo built the critic and reward from dict(job["model"]): a catalog name or a
    config.json path failed with "dictionary update sequence element #0 has length 1"."""
    pytest.importorskip("torch")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                "vocab_size": 256, "max_position_embeddings": 128}))
    code = main(["measure", str(path), "--task", "ppo", "--seq-len", "8", "--max-new-tokens", "4",
                 "--micro-batch-size", "1", "--device", "cpu", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["failure"] is None and data["measured"]["peak_allocated_bytes"] > 0


def test_check_api_headroom_not_bytes():
    with pytest.raises(vramplan.SpecError) as info:  # was int('x') leaking a ValueError
        vramplan.check({"model": "gpt2", "seq_len": 512, "gpu": "h100"}, headroom_bytes="2GiB")
    assert info.value.field == "headroom" and "\n" not in str(info.value)
