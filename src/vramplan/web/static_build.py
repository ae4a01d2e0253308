"""The page as static files for hosting without a server (`vramplan serve --static-build OUT
--pyodide DIR`): the same page and strings, the API answered in the browser by
vramplan.web.api under Pyodide (static/pyodide-api.js). The estimator is pure Python that
imports nothing outside the standard library on the answer's path (tests/test_packaging.py
holds that for torch), so Pyodide's core runs it as is; PyYAML (a dependency, read for YAML
config files) goes along as its pure-Python modules, which it falls back to without libyaml.

OUT/
  index.html        the page, loading static/pyodide-api.js before the page's scripts
  static/           the page's files (web/static)
  pyodide/          Pyodide's runtime, copied from DIR (the npm package `pyodide`, e.g. from
                    `npm pack pyodide@314.0.7`): not shipped with vramplan
  vramplan.zip      this vramplan's sources without the measurement branch (torch), and yaml/
"""
from __future__ import annotations

import os
import shutil
import zipfile
from importlib import resources

from vramplan.spec import SpecError

PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
"""What loadPyodide reads (pyodide's own documentation: "Serving Pyodide packages")."""
LEFT_OUT = ("measure", "web/static", "__pycache__")
"""Package folders the page does not run: the measurement branch (torch), and the page's own
files, which OUT/static already holds."""


def build(out: str, pyodide_dir: str) -> list[str]:
    """Write the static site to `out` (created; must be empty if it exists); the files written."""
    missing = [f for f in PYODIDE_FILES if not os.path.isfile(os.path.join(pyodide_dir, f))]
    if missing:
        raise SpecError("pyodide", f"{pyodide_dir} lacks {', '.join(missing)}: give the folder of the npm "
                                   f"package pyodide (npm pack pyodide; tar xzf; its package/ folder)")
    if os.path.exists(out) and os.listdir(out):
        raise SpecError("static_build", f"{out} is not empty; give a new or empty folder")
    package = resources.files("vramplan")
    shutil.copytree(str(package / "web" / "static"), os.path.join(out, "static"))
    os.makedirs(os.path.join(out, "pyodide"), exist_ok=True)
    for name in PYODIDE_FILES:
        shutil.copy2(os.path.join(pyodide_dir, name), os.path.join(out, "pyodide", name))
    page = (package / "web" / "static" / "index.html").read_text(encoding="utf-8")
    hook = '<script src="static/pyodide-api.js"></script>\n<script src="static/render.js" defer></script>'
    with open(os.path.join(out, "index.html"), "w", encoding="utf-8") as fh:
        fh.write(page.replace('<script src="static/render.js" defer></script>', hook))
    import yaml
    _zip_package(str(package), os.path.join(out, "vramplan.zip"), os.path.dirname(yaml.__file__))
    return sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)


def _zip_package(root: str, path: str, yaml_root: str) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        _add(zf, root, "vramplan")
        _add(zf, yaml_root, "yaml")


def _add(zf: zipfile.ZipFile, root: str, name: str) -> None:
    """The package folder `root` as `name/` in the zip: its sources and data, no compiled code."""
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        dirs[:] = [d for d in dirs if (d if rel == "." else f"{rel}/{d}") not in LEFT_OUT and d not in LEFT_OUT]
        for file in files:
            if not file.endswith((".pyc", ".po", ".so", ".pyd")):
                full = os.path.join(folder, file)
                zf.write(full, os.path.join(name, os.path.relpath(full, root)))
