#!/usr/bin/env python3
"""Score vramplan against published GPU measurements (../shared/validation/published-dev-specs.json).

Compares like with like: an `allocated` or `active` row against max_memory_allocated
(peak_allocated_bytes), `reserved` against max_memory_reserved, `nvml` against what
nvidia-smi shows (device_bytes). Rows with metric `unknown` are compared with device_bytes
(what users read off nvidia-smi) and reported apart. Rows the spec cannot express yet are
listed with the reason. Writes results-published.json beside this script.

    python bench/accuracy/score_published.py [path/to/published-dev-specs.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ROWS_NAME = os.path.join("shared", "validation", "published-dev-specs.json")


def default_rows_path() -> str:
    """$VRAMPLAN_VALIDATION (a folder) or the first ../shared/validation above the checkout
    (/work/main and /work/wt/<name> both find /work/shared)."""
    env = os.environ.get("VRAMPLAN_VALIDATION")
    if env:
        return os.path.join(env, os.path.basename(ROWS_NAME))
    here = ROOT
    while True:
        candidate = os.path.join(os.path.dirname(here), ROWS_NAME)
        if os.path.exists(candidate) or os.path.dirname(here) == here:
            return candidate
        here = os.path.dirname(here)


FIELD = {"allocated": "peak_allocated_bytes", "active": "peak_allocated_bytes",
         "reserved": "reserved_bytes", "nvml": "device_bytes", "unknown": "device_bytes"}


def _job(row: dict) -> dict:
    job = dict(row["job"])
    if row.get("model_inline"):
        job["model"] = row["model_inline"]
    return job


def load_rows(path: str) -> list[dict]:
    with open(path) as fh:
        return json.load(fh)


def score(rows: list[dict]) -> dict:
    import vramplan
    from vramplan.catalog import UnknownNameError
    results, skipped = [], []
    for row in rows:
        try:
            spec = vramplan.load_spec(_job(row))
            est = vramplan.estimate(spec)
        except (ValueError, KeyError, UnknownNameError) as exc:
            skipped.append({"id": row["id"], "why": str(exc).strip("'\"")[:200]})
            continue
        got = getattr(est, FIELD[row["metric"]])
        err = got / row["measured_bytes"] - 1
        results.append({"id": row["id"], "metric": row["metric"], "fidelity": row["fidelity"],
                        "measured_gib": round(row["measured_bytes"] / 2**30, 3),
                        "estimated_gib": round(got / 2**30, 3), "error": round(err, 4),
                        "peak_phase": est.peak_phase, "gaps": row.get("gaps", [])})
    return {"results": results, "skipped": skipped}


METRICS = ("allocated", "active", "reserved", "nvml", "unknown")
"""The `metric` of a row: what its source measured (nvml = nvidia-smi / NVML used memory)."""


def stats(errors: list[float]) -> dict:
    """n, median and worst |error|, and the share of rows under- and over-estimated (and
    under by more than 10%: the rows a user would be told fit with >10% less than they took)."""
    n = len(errors)
    if not n:
        return {"n": 0}
    mags = [abs(e) for e in errors]
    return {"n": n, "median_abs_error": round(statistics.median(mags), 4), "worst_abs_error": round(max(mags), 4),
            "share_under": round(sum(e < 0 for e in errors) / n, 3),
            "share_over": round(sum(e > 0 for e in errors) / n, 3),
            "share_under_10pct": round(sum(e < -0.10 for e in errors) / n, 3)}


def by_metric(results: list[dict], *, exclude_poor: bool) -> dict[str, dict]:
    return {m: stats([r["error"] for r in results
                      if r["metric"] == m and not (exclude_poor and r["fidelity"] == "poor")])
            for m in METRICS}


def by_fidelity(results: list[dict]) -> dict[str, dict]:
    groups: dict[str, list[float]] = {}
    for r in results:
        key = "unknown-metric" if r["metric"] == "unknown" else r["fidelity"]
        groups.setdefault(key, []).append(r["error"])
        groups.setdefault("all", []).append(r["error"])
    return {k: stats(v) for k, v in sorted(groups.items())}


def _line(name: str, st: dict) -> str:
    if not st["n"]:
        return f"{name:>22}: n=  0"
    return (f"{name:>22}: n={st['n']:3d}  median |err| {st['median_abs_error']:6.1%}  worst {st['worst_abs_error']:6.1%}"
            f"  under {st['share_under']:4.0%}  over {st['share_over']:4.0%}  under>10% {st['share_under_10pct']:4.0%}")


def summary(out: dict) -> list[str]:
    """Per metric (all rows, then without fidelity `poor`), then per fidelity as before."""
    out["by_metric"] = by_metric(out["results"], exclude_poor=False)
    out["by_metric_without_poor"] = by_metric(out["results"], exclude_poor=True)
    out["by_fidelity"] = by_fidelity(out["results"])
    lines = ["per metric (estimate of the same kind; nvml and unknown against nvidia-smi):"]
    lines += [_line(m, st) for m, st in out["by_metric"].items()]
    lines.append("per metric, without fidelity poor:")
    lines += [_line(m, st) for m, st in out["by_metric_without_poor"].items()]
    lines.append("per fidelity:")
    lines += [_line(k, st) for k, st in out["by_fidelity"].items()]
    lines.append(f"{'not expressible':>22}: n={len(out['skipped']):3d}")
    return lines


def _commit() -> str | None:
    import subprocess
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "src"], capture_output=True, text=True)
    except OSError:
        return None
    return head.stdout.strip() + ("+modified-src" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else default_rows_path()
    out = score(load_rows(path))
    for r in sorted(out["results"], key=lambda r: r["id"]):
        print(f"{r['id']} {r['fidelity']:>6} {r['metric']:>9} measured {r['measured_gib']:7.2f} GiB  "
              f"estimated {r['estimated_gib']:7.2f} GiB  {r['error']:+7.1%}  ({r['peak_phase']})")
    for s in out["skipped"]:
        print(f"{s['id']} skipped: {s['why']}")
    out["rows_file"] = os.path.relpath(path, ROOT)
    out["estimator_commit"] = _commit()
    out["summary"] = summary(out)
    print("\n".join(out["summary"]))
    with open(os.path.join(HERE, "results-published.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
