"""Instructions per estimate and per CLI run, before and after a change, counted by valgrind
(callgrind's `Ir`): unlike CPU time, the count does not move with the machine's load.

    .venv/bin/python bench/speed/instructions.py --baseline 9861029   # -> instructions.json

Per run.py ESTIMATES case: the instructions of a process that estimates the spec 2 + N times
less those of one that estimates it twice, over N (model resolution and memos warm, as
run.py's `repeat`); those of fit's default-axes search (run.py fit_default, cold, in a fresh
process, less the same process without it); and the instructions of the whole `vramplan estimate llama-3.1-8b --gpu
a100-80gb --json` process (start, imports, estimate, the allocator replay its JSON holds).
Needs valgrind on PATH; takes some minutes (valgrind runs Python ~50x slower). PYTHONHASHSEED
is fixed, so a figure is the same from run to run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import DEFAULT_FIT, ESTIMATES, ROOT, baseline_tree  # noqa: E402

_CHILD = """
import sys
from vramplan import estimate, load_spec
spec = load_spec({job})
estimate(spec); estimate(spec)
for _ in range({n}):
    estimate(spec)
"""
# fit's default-axes search (run.py fit_default) in a fresh process, as run.py times it; the
# same process without the search (imports, the spec) is subtracted
_FIT = """
from vramplan.plan import fit
from vramplan.spec import load_spec
spec = load_spec({job})
if {run}:
    fit(spec, top_k=5, suggest=False)
"""


def _instructions(src: str, argv: list[str]) -> int:
    # a fixed string hash: with a random one the same code's count moves by ~5% between runs
    env = dict(os.environ, PYTHONPATH=src, PYTHONHASHSEED="0")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, *argv], env=env, check=True, capture_output=True,
                   cwd=tempfile.gettempdir())  # bytecode written before counting
    proc = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, *argv],
                          env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return int(re.search(r"Collected : (\d+)", proc.stderr).group(1))


def measure(src: str, n: int) -> dict:
    out = {}
    for name, job in ESTIMATES.items():
        base = _instructions(src, ["-c", _CHILD.format(job=repr(job), n=0)])
        more = _instructions(src, ["-c", _CHILD.format(job=repr(job), n=n)])
        out[name] = {"instructions_per_estimate": (more - base) // n}
    fit = [_instructions(src, ["-c", _FIT.format(job=repr(DEFAULT_FIT), run=run)]) for run in (False, True)]
    out["fit_default"] = {"instructions": fit[1] - fit[0]}
    out["cli"] = {"instructions": _instructions(
        src, ["-m", "vramplan", "estimate", "llama-3.1-8b", "--gpu", "a100-80gb", "--json"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="9861029")
    ap.add_argument("-n", type=int, default=10, help="estimates counted per case")
    args = ap.parse_args()
    trees = {"before": baseline_tree(args.baseline), "after": os.path.join(ROOT, "src")}
    res = {k: measure(src, args.n) for k, src in trees.items()}
    out = {"baseline_commit": args.baseline, "n": args.n, "counter": "valgrind --tool=callgrind, Ir",
           "python": sys.version.split()[0], **res,
           "after_over_before": {k: round(res["after"][k][m] / res["before"][k][m], 3)
                                 for k in res["after"] for m in res["after"][k]}}
    with open(os.path.join(HERE, "instructions.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2)
        fh.write("\n")
    print(json.dumps(out["after_over_before"]))


if __name__ == "__main__":
    main()
