"""The web page's JSON API (vramplan.web.app) against the command line: every endpoint
answers what `vramplan ... --json` prints for the same spec (the CLI run in a subprocess,
its stdout parsed), and bad input gets HTTP 400 with the CLI's one stderr line."""
from __future__ import annotations

import fnmatch
import json
import os
import pathlib
import subprocess
import sys
import time
import tomllib

import pytest

pytest.importorskip("starlette", reason="the web extra (starlette) is not installed")
pytest.importorskip("httpx", reason="starlette's TestClient needs httpx (in the test extra)")
from starlette.testclient import TestClient  # noqa: E402

from vramplan.web.app import create_app  # noqa: E402

ROOT = pathlib.Path(__file__).parents[1]
SPEC = {"model": "qwen2.5-0.5b", "method": "lora", "micro_batch_size": 2, "seq_len": 512, "gpu": "a10g"}
# elapsed_s is the search's wall time: the one field two runs of the same search differ in
VOLATILE = ("elapsed_s",)


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app())


def cli_json(tmp_path, *args: str, spec: dict | None = None, status: int = 0):
    """What `vramplan ARGS [--spec FILE] ` prints on stdout, parsed (and the exit status checked)."""
    cmd = [sys.executable, "-m", "vramplan", *args]
    if spec is not None:
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(spec))
        cmd += ["--spec", str(path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LANG": "C"}
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "VRAMPLAN_ONLINE"):
        env.pop(key, None)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == status, out.stderr
    return json.loads(out.stdout) if out.stdout.strip() else out.stderr


def without(data, keys=VOLATILE):
    if isinstance(data, dict):
        return {k: without(v, keys) for k, v in data.items() if k not in keys}
    if isinstance(data, list):
        return [without(v, keys) for v in data]
    return data


def test_estimate_is_the_cli_json(client, tmp_path):
    answer = client.post("/api/estimate", json=SPEC)
    assert answer.status_code == 200
    assert answer.json() == cli_json(tmp_path, "estimate", "--json", spec=SPEC)
    timeline = answer.json()["timeline"]
    assert max(e["bytes"] for e in timeline) == answer.json()["peak_allocated_bytes"]


def test_compare_is_the_cli_json(client, tmp_path):
    answer = client.post("/api/compare", json=SPEC)
    assert answer.status_code == 200
    assert answer.json() == cli_json(tmp_path, "compare", "--format", "json", spec=SPEC)
    assert len(answer.json()["rows"]) > 1


def test_fit_is_the_cli_json_with_paste_forms(client, tmp_path):
    answer = client.post("/api/fit?top_k=3&headroom=1GiB", json=SPEC)
    assert answer.status_code == 200
    cli = cli_json(tmp_path, "fit", "--format", "json", "--top-k", "3", "--headroom", "1GiB", spec=SPEC)
    assert without(answer.json()) == without(cli)
    best = answer.json()["results"][0]
    # the command fit offers estimates the layout it names: the same device bytes
    words = best["paste"]["command"].split()[1:]
    assert words[0] == "estimate"
    again = cli_json(tmp_path, *words, "--json")
    assert again["device_bytes"] == best["estimate"]["device_bytes"]


def test_models_and_gpus_are_the_cli_json(client, tmp_path):
    models = client.get("/api/models?kind=llm&name=qwen2.5")
    assert models.status_code == 200
    assert models.json() == cli_json(tmp_path, "models", "--kind", "llm", "qwen2.5", "--json")
    gpus = client.get("/api/gpus")
    assert gpus.json() == cli_json(tmp_path, "gpus", "--json")


@pytest.mark.parametrize("path", ["/api/estimate", "/api/compare", "/api/fit"])
def test_bad_spec_is_400_with_the_cli_line(client, tmp_path, path):
    bad = {**SPEC, "micro_batch_size": 0}
    answer = client.post(path, json=bad)
    assert answer.status_code == 400
    line = cli_json(tmp_path, path.rsplit("/", 1)[1], spec=bad, status=2).strip()
    assert answer.json() == {"error": line, "field": "micro_batch_size"}
    assert "\n" not in line and "micro_batch_size" in line


def test_bad_input_in_chinese_and_not_json(client, tmp_path):
    bad = {**SPEC, "gpu": "h10"}
    answer = client.post("/api/estimate?lang=zh", json=bad)
    assert answer.status_code == 400
    assert answer.json()["error"] == cli_json(tmp_path, "estimate", "--lang", "zh", spec=bad, status=2).strip()
    assert client.post("/api/estimate", content=b"{not json").json()["field"] == "spec"
    assert client.post("/api/compare", json={"model": "qwen2.5-0.5b"}).json()["field"] == "gpu"


def test_import_reads_what_the_cli_flag_reads(client, tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    answer = client.post("/api/import?kind=deepspeed&name=ds.json", content=json.dumps(ds))
    assert answer.status_code == 200
    spec = {**answer.json()["spec"], "model": "qwen2.5-0.5b", "gpu": "a100-80gb", "num_gpus": 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cli = cli_json(tmp_path, "estimate", "qwen2.5-0.5b", "--gpu", "a100-80gb", "--num-gpus", "2",
                   "--deepspeed", str(path), "--json")
    assert client.post("/api/estimate", json=spec).json()["spec"] == cli["spec"]
    assert any("ds.json" in line for line in answer.json()["lines"])
    assert client.post("/api/import?kind=nothing", content=b"{}").status_code == 400


def test_page_and_its_files_are_served_and_shipped(client):
    page = client.get("/")
    assert page.status_code == 200 and "chart.umd.min.js" in page.text
    static = ROOT / "src" / "vramplan" / "web" / "static"
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vramplan"]
    files = [p for p in static.rglob("*") if p.is_file()]
    assert files
    for p in files:
        rel = p.relative_to(ROOT / "src" / "vramplan").as_posix()
        assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel
        url = "/static/" + p.relative_to(static).as_posix()
        assert client.get(url).content == p.read_bytes(), url
    en = json.loads((static / "i18n" / "en.json").read_text(encoding="utf-8"))
    zh = json.loads((static / "i18n" / "zh.json").read_text(encoding="utf-8"))
    assert set(en) == set(zh)
    # every page string that holds English words has a different Chinese one, but names
    names = ("title", "kind_deepspeed", "device", "level_device")
    untranslated = [k for k in en if en[k] == zh[k] and any(c.islower() for c in en[k]) and k not in names]
    assert untranslated == []


def test_static_build_runs_the_api_from_its_zip_alone(tmp_path):
    """The static build's vramplan.zip answers as the CLI does with nothing but the standard
    library beside it (python -I -S: no site-packages; yaml from the zip). Pyodide's files are
    stand-ins here: tests/test_web_static.py runs the real ones in Chromium."""
    from vramplan.web.static_build import PYODIDE_FILES, build
    fake = tmp_path / "pyodide"
    fake.mkdir()
    for name in PYODIDE_FILES:
        (fake / name).write_bytes(b"")
    files = build(str(tmp_path / "site"), str(fake))
    assert {"index.html", "vramplan.zip", "static/pyodide-api.js", "static/chart.umd.min.js"} <= set(files)
    assert "static/pyodide-api.js" in (tmp_path / "site" / "index.html").read_text()
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from vramplan.web.api import answer_json; "
            "print(answer_json('estimate', '{}', sys.argv[2])); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', '_yaml', 'rich', 'starlette')))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path / "site" / "vramplan.zip"), json.dumps(SPEC)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    answer, modules = out.stdout.splitlines()
    assert json.loads(answer) == {"status": 200, "payload": cli_json(tmp_path, "estimate", "--json", spec=SPEC)}
    assert modules == "[]"


def test_static_build_bad_input_is_one_line(tmp_path):
    out = cli_json(tmp_path, "serve", "--static-build", str(tmp_path / "site"), "--pyodide", str(tmp_path), status=2)
    assert out.count("\n") == 1 and "pyodide:" in out and "pyodide.asm.wasm" in out


def test_serve_binds_this_machine_and_answers(tmp_path):
    """`vramplan serve --port N`: one line naming the local URL, the page and the API there."""
    import socket
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LANG": "C"}
    proc = subprocess.Popen([sys.executable, "-m", "vramplan", "serve", "--port", str(port)],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/" in line
        gpus = None
        for _ in range(200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/gpus", timeout=5) as r:
                    gpus = json.load(r)
                break
            except OSError:
                proc.poll()
                assert proc.returncode is None
                time.sleep(0.1)
        assert gpus == cli_json(tmp_path, "gpus", "--json")
    finally:
        proc.terminate()
        proc.wait(30)


def test_lengths_file_is_not_read_on_the_server():
    """badinput4: a lengths_file in a request was opened on the server and its first line
    that is no token count came back in the error (/etc/passwd's root line)."""
    import json
    from vramplan.web.api import answer
    status, payload = answer("estimate", {}, json.dumps(
        {"model": "gpt2", "seq_len": 512, "lengths": {"lengths_file": "/etc/passwd"}}).encode())
    assert status == 400 and payload["field"] == "lengths.lengths_file"
    assert "root" not in payload["error"] and "percentiles" in payload["error"]
    status, _ = answer("estimate", {}, json.dumps(
        {"model": "gpt2", "seq_len": 512, "lengths": {"p50": 300, "max": 512}}).encode())
    assert status == 200


@pytest.mark.parametrize("field,body", [
    ("model", {"model": "/etc/passwd"}),
    ("model", {"model": "./config.json"}),
    ("model", {"model": "~/models/llama"}),
    ("teacher", {"model": "gpt2", "task": "distill", "teacher": "/etc"}),
    # badinput round 3: a models list's entry was read on the server ("folder has no config.json: /etc")
    ("models.critic2.model", {"model": "gpt2", "models": [{"role": "critic2", "model": "/etc"}]}),
])
def test_model_paths_are_not_read_on_the_server(field, body):
    """A local path as a model in a request names a file or folder on the server, which
    sources.py would open: refused, while catalog names and inline configs still answer."""
    import json
    from vramplan.web.api import answer
    status, payload = answer("estimate", {}, json.dumps({"seq_len": 128, **body}).encode())
    assert status == 400 and payload["field"] == field and "reads no files" in payload["error"]
    status, _ = answer("estimate", {}, json.dumps({"model": "gpt2", "seq_len": 128}).encode())
    assert status == 200


def test_an_imported_file_does_not_open_the_deepspeed_path_it_names():
    """A TrainingArguments file's `deepspeed: PATH` names a file on the server: refused; an
    inline DeepSpeed mapping is still read."""
    import json
    from vramplan.web.api import answer
    query = {"kind": "training_args", "name": "args.json"}
    status, payload = answer("import", query, json.dumps({"deepspeed": "/etc/passwd"}).encode())
    assert status == 400 and "reads no files" in payload["error"] and "root" not in payload["error"]
    inline = {"per_device_train_batch_size": 2, "deepspeed": {"zero_optimization": {"stage": 2}}}
    status, payload = answer("import", query, json.dumps(inline).encode())
    assert status == 200 and payload["spec"]["parallel"] == {"zero_stage": 2}


@pytest.mark.parametrize("name,query,body,says", [
    # badinput5: the last of two keys won unseen (a spec file refuses it: vramplan.files)
    ("estimate", {}, b'{"model": "gpt2", "seq_len": 512, "model": "llama-3.2-1b"}', "gives 'model' twice; keep one"),
    ("estimate", {}, b'{"model": "gpt2", "seq_len": 512, "parallel": {"tp": 1, "tp": 2}}', "gives 'tp' twice"),
    # RecursionError out of json.loads: HTTP 500 "internal error"
    ("estimate", {}, b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    # an imported file's error named the server's temporary copy (/tmp/vramplan-web-.../config.json)
    ("import", {"kind": "deepspeed", "name": "ds.json"}, b'{"zero_optimization": {"stage": 7}}',
     "error: ds.json: zero_optimization.stage: must be 0, 1, 2 or 3"),
    ("import", {"kind": "training_args", "name": "args.json"}, b'{"deepspeed": "ds_z3.json"}', "error: args.json: deepspeed: the web API reads no files on the server"),
], ids=["duplicate_top", "duplicate_nested", "nested_deep", "import_names_the_file", "import_names_the_file_beside"])
def test_request_slips_are_400_naming_the_fix(name, query, body, says):
    from vramplan.web.api import answer
    status, payload = answer(name, query, body)
    assert status == 400 and says in payload["error"] and "vramplan-web-" not in json.dumps(payload), payload


def test_import_of_a_long_file_name_is_answered():
    """Round 3: the temporary file took the caller's name: a 5,000-character name was OSError
    (File name too long), HTTP 500. The file is now saved under a fixed name and the answer
    names it as the caller did."""
    from vramplan.web.api import answer
    name = "a" * 5000 + ".json"
    status, payload = answer("import", {"kind": "deepspeed", "name": name}, b'{"zero_optimization": {"stage": 7}}')
    assert status == 400 and "zero_optimization.stage: must be 0, 1, 2 or 3" in payload["error"]
    status, payload = answer("import", {"kind": "deepspeed", "name": name}, b'{"zero_optimization": {"stage": 2}}')
    assert status == 200 and payload["spec"]["parallel"]["zero_stage"] == 2
