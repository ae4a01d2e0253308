"""Reproduce /work/shared/validation/cpu-dev-truth.jsonl with vramplan.measure.

    python bench/accuracy/reproduce_dev_truth.py [--only SUBSTRING] [--fake] [--json OUT]

Prints, per row and field, the reference figure, ours, and the difference in bytes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

TRUTH = Path("/work/shared/validation/cpu-dev-truth.jsonl")
FIELDS = ["peak_allocated_bytes", "phases.forward", "phases.backward", "phases.optimizer",
          "params_bytes", "grad_bytes", "optimizer_state_bytes",
          "activation_bytes_end_of_forward", "peak_phase"]


def get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def compare(ref: dict, ours: dict) -> list[tuple[str, object, object, object]]:
    rows = []
    for f in FIELDS:
        a, b = get(ref, f), get(ours, f)
        diff = (b - a) if isinstance(a, int) else ("ok" if a == b else "DIFF")
        rows.append((f, a, b, diff))
    return rows


def measure_in_subprocess(job: dict, fake: bool) -> dict:
    """One job per fresh process: the meter counts every tensor alive at start
    (e.g. the two int64 scalars importing peft creates), so a process that
    ran a LoRA job before would carry 16 extra bytes into the next."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from vramplan.measure import measure; "
            "print(json.dumps(measure(json.loads(sys.argv[2]), fake=sys.argv[3] == '1').to_dict()))")
    proc = subprocess.run([sys.executable, "-c", code, str(SRC), json.dumps(job), "1" if fake else "0"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    out, exact_rows, total = [], 0, 0
    for line in TRUTH.read_text().splitlines():
        row = json.loads(line)
        if args.only not in row["name"]:
            continue
        t0 = time.time()
        ours = measure_in_subprocess(row["job"], args.fake)
        rows = compare(row["measured"], ours)
        exact = all(d in (0, "ok") for _, _, _, d in rows)
        exact_rows += exact
        total += 1
        print(f"\n{row['name']}  ({time.time() - t0:.1f}s)  {'EXACT' if exact else 'DIFFERS'}")
        print(f"  {'field':34s} {'reference':>14s} {'measured':>14s} {'diff':>10s}")
        for f, a, b, d in rows:
            print(f"  {f:34s} {a!s:>14s} {b!s:>14s} {d!s:>10s}")
        out.append({"name": row["name"], "reference": row["measured"], "measured": ours})
    print(f"\n{exact_rows}/{total} rows byte-exact on every field")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if exact_rows == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
