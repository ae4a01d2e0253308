"""The static build (`vramplan serve --static-build OUT --pyodide DIR`) in headless Chromium:
served by a plain file server with no API behind it, the page answers through Pyodide and
shows the figure the command line prints for the same spec.

Needs the npm package pyodide unpacked (VRAMPLAN_PYODIDE=its package/ folder; .ci/run fetches
it with `npm pack` when npm is there) and /usr/bin/chromium."""
from __future__ import annotations

import json
import mimetypes
import os
import socket
import threading
import time
from urllib.parse import quote

import pytest

PYODIDE = os.environ.get("VRAMPLAN_PYODIDE", "")
CHROMIUM = os.environ.get("VRAMPLAN_CHROMIUM", "/usr/bin/chromium")
if not (PYODIDE and os.path.isfile(os.path.join(PYODIDE, "pyodide.asm.wasm"))):
    pytest.skip("no Pyodide: set VRAMPLAN_PYODIDE to the npm package pyodide's folder "
                "(npm pack pyodide@314.0.7; tar xzf; package/)", allow_module_level=True)
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
uvicorn = pytest.importorskip("uvicorn", reason="the web extra (uvicorn) is not installed")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (in the test extra) is not installed")

from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Mount  # noqa: E402
from starlette.staticfiles import StaticFiles  # noqa: E402

from test_web_browser import cli_estimate  # noqa: E402
from vramplan.web.static_build import build  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The static build, served as plain files (no /api route exists)."""
    out = tmp_path_factory.mktemp("site")
    files = build(str(out), PYODIDE)
    assert "index.html" in files and "vramplan.zip" in files
    mimetypes.add_type("text/javascript", ".mjs")
    mimetypes.add_type("application/wasm", ".wasm")
    app = Starlette(routes=[Mount("/", StaticFiles(directory=str(out), html=True))])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/"
    srv.should_exit = True
    thread.join(10)


def test_the_static_page_answers_in_the_browser(site, tmp_path):
    spec = {"model": "qwen2.5-0.5b", "method": "lora", "micro_batch_size": 2, "seq_len": 512, "gpu": "a10g"}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.set_default_timeout(300_000)  # Pyodide compiles its runtime on first use
        page.goto(site + "#spec=" + quote(json.dumps(spec)))
        page.wait_for_function("document.body.dataset.state === 'ready'")
        peak = page.locator("#peak")
        assert json.loads(peak.get_attribute("data-spec")) == spec
        assert int(peak.get_attribute("data-bytes")) == cli_estimate(spec, tmp_path)["peak_allocated_bytes"]
        assert page.locator("#fit tbody tr").count() >= 1
        browser.close()
    assert errors == []
