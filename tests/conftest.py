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
