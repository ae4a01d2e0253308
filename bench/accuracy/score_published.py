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
DEFAULT = os.path.join(HERE, "..", "..", "..", "shared", "validation", "published-dev-specs.json")
FIELD = {"allocated": "peak_allocated_bytes", "active": "peak_allocated_bytes",
         "reserved": "reserved_bytes", "nvml": "device_bytes", "unknown": "device_bytes"}


def _job(row: dict) -> dict:
    job = dict(row["job"])
    if row.get("model_inline"):
        job["model"] = row["model_inline"]
    return job


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


def summary(out: dict) -> list[str]:
    lines = []
    groups: dict[str, list[float]] = {}
    for r in out["results"]:
        key = "unknown-metric" if r["metric"] == "unknown" else r["fidelity"]
        groups.setdefault(key, []).append(abs(r["error"]))
        groups.setdefault("all", []).append(abs(r["error"]))
    for key, errs in sorted(groups.items()):
        lines.append(f"{key:>15}: n={len(errs):3d}  median |err| {statistics.median(errs):6.1%}  worst {max(errs):6.1%}")
    lines.append(f"{'not expressible':>15}: n={len(out['skipped']):3d}")
    return lines


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    rows = json.load(open(path))
    out = score(rows)
    for r in sorted(out["results"], key=lambda r: r["id"]):
        print(f"{r['id']} {r['fidelity']:>6} {r['metric']:>9} measured {r['measured_gib']:7.2f} GiB  "
              f"estimated {r['estimated_gib']:7.2f} GiB  {r['error']:+7.1%}  ({r['peak_phase']})")
    for s in out["skipped"]:
        print(f"{s['id']} skipped: {s['why']}")
    out["summary"] = summary(out)
    print("\n".join(out["summary"]))
    with open(os.path.join(HERE, "results-published.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
