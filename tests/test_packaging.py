"""Every data file the package reads is shipped by a non-editable install's package-data."""
import fnmatch
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).parents[1]


def test_package_data_covers_every_catalog_file():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["vramplan"]
    pkg = ROOT / "src" / "vramplan"
    data = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*.json")]
    assert data
    missing = [f for f in data if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert missing == []


def test_estimate_path_imports_no_torch():
    import subprocess
    import sys
    code = ("import sys, vramplan; vramplan.estimate(vramplan.load_spec({'model': 'llama-3.1-8b', 'method': 'lora', "
            "'num_gpus': 4, 'parallel': {'zero_stage': 3}})); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
