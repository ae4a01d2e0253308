"""Shared test setup."""
import pytest


@pytest.fixture(autouse=True)
def _english_answers(monkeypatch):
    """The CLI takes its language from LC_ALL / LC_MESSAGES / LANG; tests that read English
    text must not turn Chinese on a machine set to zh_CN. Each test starts and ends in English."""
    from vramplan import i18n
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(var, raising=False)
    i18n.set_language("en")
    yield
    i18n.set_language("en")


@pytest.fixture(autouse=True)
def _allocator_env():
    """The CLI reads PYTORCH_(CUDA_)ALLOC_CONF from the environment, and some libraries set it
    when imported (GPTQModel 7.7: expandable_segments, max_split_size_mb:256 and a
    garbage-collection threshold, 'for memory saving'); a test that imports one must not
    hand its allocator options to every later test. Each test ends with them as it began."""
    import os
    keys = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
    before = {k: os.environ.get(k) for k in keys}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def measure_fresh(job: dict, **kwargs) -> dict:
    """`vramplan.measure.measure(job, **kwargs).to_dict()` in a fresh Python process. The meter
    counts every tensor alive when it starts (the reference meter's rule), so a measurement
    inside the test process would also count what earlier tests left alive."""
    import json
    import subprocess
    import sys
    code = ("import json, sys; from vramplan.measure import measure; "
            "print(json.dumps(measure(json.loads(sys.argv[1]), **json.loads(sys.argv[2])).to_dict()))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job), json.dumps(kwargs)],
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
