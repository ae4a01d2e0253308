"""The web page in a real browser: Debian's Chromium (/usr/bin/chromium, headless) driven by
playwright against `vramplan serve`'s app on a free local port. Each figure the page shows
is checked against the command line's answer for the spec the page sent (read back from the
page, run through `vramplan estimate --spec FILE --json` in a subprocess).

Set VRAMPLAN_WEB_SCREENSHOTS=docs to write the READMEs' screenshots there (web-page.png,
web-page.zh.png)."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import quote

import pytest

CHROMIUM = os.environ.get("VRAMPLAN_CHROMIUM", "/usr/bin/chromium")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)",
                allow_module_level=True)
pytest.importorskip("uvicorn", reason="the web extra (uvicorn) is not installed")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (in the test extra) is not installed")

from vramplan.web.app import create_app  # noqa: E402

ROOT = pathlib.Path(__file__).parents[1]
STATIC = ROOT / "src" / "vramplan" / "web" / "static"
GiB = 2**30
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def server():
    import uvicorn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}/"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    page.close()
    assert errors == []


def shown(page, **expect) -> tuple[dict, int]:
    """Wait until the page shows the answer to a spec with these fields; return the spec it
    sent and the peak allocated bytes it shows."""
    page.wait_for_function("(expect) => { const s = document.querySelector('#peak').dataset.spec;"
                           " if (!s) return false; const spec = JSON.parse(s);"
                           " return Object.entries(expect).every(([k, v]) => spec[k] === v); }", arg=expect)
    peak = page.locator("#peak")
    return json.loads(peak.get_attribute("data-spec")), int(peak.get_attribute("data-bytes"))


def screenshot(page, name: str) -> None:
    folder = os.environ.get("VRAMPLAN_WEB_SCREENSHOTS")
    if folder:
        page.wait_for_function("document.body.dataset.state === 'ready'")
        page.screenshot(path=str(ROOT / folder / name), full_page=True)


def cli_estimate(spec: dict, tmp_path) -> dict:
    path = tmp_path / "page-spec.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LANG": "C"}
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "VRAMPLAN_ONLINE"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-m", "vramplan", "estimate", "--spec", str(path), "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def test_choose_a_model_change_the_batch_and_match_the_cli(page, server, tmp_path):
    page.goto(server)
    page.wait_for_function("document.body.dataset.state === 'ready'")
    page.fill("#model", "qwen2.5-0.5b")
    spec1, peak1 = shown(page, model="qwen2.5-0.5b")
    page.fill("#micro_batch_size", "4")
    spec4, peak4 = shown(page, model="qwen2.5-0.5b", micro_batch_size=4)
    assert peak4 != peak1
    cli = cli_estimate(spec4, tmp_path)
    assert peak4 == cli["peak_allocated_bytes"]
    assert page.text_content("#peak").startswith(f"{cli['peak_allocated_bytes'] / GiB:.2f} GiB")
    assert page.get_attribute("#verdict", "data-verdict") == cli["verdict"]
    assert cli_estimate(spec1, tmp_path)["peak_allocated_bytes"] == peak1
    page.wait_for_function("document.body.dataset.state === 'ready'")
    assert page.locator("#compare tbody tr").count() > 1
    assert page.locator("#paste-command").text_content().startswith("vramplan estimate qwen2.5-0.5b")
    screenshot(page, "web-page.png")


def test_a_shared_url_opens_the_same_answer(page, server, tmp_path):
    spec = {"model": "llama-3.2-1b", "method": "lora", "micro_batch_size": 2, "seq_len": 1024, "gpu": "l4",
            "parallel": {"zero_stage": 2}, "num_gpus": 2}
    page.goto(server + "#spec=" + quote(json.dumps(spec)))
    sent, peak = shown(page, model="llama-3.2-1b", method="lora")
    assert sent == spec
    for sel, value in (("#model", "llama-3.2-1b"), ("#method", "lora"), ("#micro_batch_size", "2"),
                       ("#seq_len", "1024"), ("#gpu", "l4"), ("#zero_stage", "2"), ("#num_gpus", "2")):
        assert page.input_value(sel) == value, sel
    assert peak == cli_estimate(spec, tmp_path)["peak_allocated_bytes"]


def test_switch_to_chinese_and_keep_it_in_the_url(page, server):
    zh = json.loads((STATIC / "i18n" / "zh.json").read_text(encoding="utf-8"))
    page.goto(server)
    page.wait_for_function("document.body.dataset.state === 'ready'")
    page.click("#lang-zh")
    page.wait_for_function("document.documentElement.lang === 'zh-CN'")
    assert page.text_content("legend[data-i18n=model_section]") == zh["model_section"]
    assert page.text_content("#verdict") == zh["verdict_" + page.get_attribute("#verdict", "data-verdict").replace(" ", "_")]
    assert "lang=zh" in page.url
    page.goto(page.url.replace("#", "?reload#"))  # the shared link opens in Chinese
    page.wait_for_function("document.documentElement.lang === 'zh-CN'")
    assert page.text_content("h2[data-i18n=compare_title]") == zh["compare_title"]
    screenshot(page, "web-page.zh.png")


def test_a_dropped_deepspeed_json_sets_the_layout(page, server, tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 3}}))
    page.goto(server)
    page.wait_for_function("document.body.dataset.state === 'ready'")
    page.set_input_files("#file", str(ds))
    sent, _ = shown(page, micro_batch_size=3)
    assert sent["parallel"]["zero_stage"] == 3 and page.input_value("#zero_stage") == "3"
    assert "ds_config.json" in page.text_content("#import-lines")


def test_bad_input_shows_the_cli_line_at_its_field(page, server, tmp_path):
    page.goto(server)
    page.wait_for_function("document.body.dataset.state === 'ready'")
    page.fill("#seq_len", "0")
    page.wait_for_function("document.body.dataset.state === 'error'")
    sent = json.loads(page.get_attribute("#peak", "data-spec") or "null")
    assert sent is None  # no figure is left standing beside the error
    path = tmp_path / "bad.json"
    shared = page.evaluate("JSON.parse(new URLSearchParams(location.hash.slice(1)).get('spec'))")
    assert shared["seq_len"] == 0  # the URL carries the spec as typed
    path.write_text(json.dumps(shared))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LANG": "C"}
    out = subprocess.run([sys.executable, "-m", "vramplan", "estimate", "--spec", str(path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert page.text_content("#error") == out.stderr.strip()
    assert "invalid" in page.get_attribute("#seq_len", "class")


def test_a_model_with_learned_positions_opens_without_a_sequence_length(page, server, tmp_path):
    # the page sends no seq_len until one is typed, so GPT-2 (1024 learned positions) gets
    # the estimator's capped default, as the CLI does, instead of a refusal of 2048
    page.goto(server)
    page.wait_for_function("document.body.dataset.state === 'ready'")
    assert page.input_value("#seq_len") == ""
    page.fill("#model", "gpt2")
    sent, peak = shown(page, model="gpt2")
    assert "seq_len" not in sent
    assert page.is_hidden("#error")
    assert peak == cli_estimate(sent, tmp_path)["peak_allocated_bytes"]
    page.fill("#seq_len", "2048")  # typed past the positions: refused, naming the field
    page.wait_for_selector("#error", state="visible")
    assert "seq_len" in page.text_content("#error")


def test_grpo_from_the_default_page_is_trls_default_batch(page, server, tmp_path):
    # the page sends no micro_batch_size until one is typed: choosing GRPO gets TRL's
    # default batch (8 rows, one group of 8 generations), as the CLI does, not a refusal of 1
    page.goto(server)
    page.wait_for_function("document.body.dataset.state === 'ready'")
    assert page.input_value("#micro_batch_size") == ""
    page.fill("#model", "qwen2.5-0.5b")
    page.select_option("#task", "grpo")
    sent, peak = shown(page, model="qwen2.5-0.5b", task="grpo")
    assert "micro_batch_size" not in sent
    assert page.is_hidden("#error")
    assert peak == cli_estimate(sent, tmp_path)["peak_allocated_bytes"]
