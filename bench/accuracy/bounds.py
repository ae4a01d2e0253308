#!/usr/bin/env python3
"""Build the estimate's error bars from the published GPU measurements, and the catalog-size
steps measured here on a GPU (bench/cuda/results-cuda-scale-*.json, all three metrics, exact),
and write them to src/vramplan/catalog/bounds.json (read by Estimate.bounds, the verdict and
fit's headroom).

For each metric (allocated <- rows measured as max_memory_allocated, reserved <- rows of
max_memory_reserved, device <- rows read from nvidia-smi/NVML) it re-estimates every row
with the current estimator (score_published.score), takes r = measured / estimated on the
rows whose spec is not of fidelity `poor` (those specs cannot express the run: paged
optimizers, packed sequences, ...), and keeps the empirical interval of r that holds at
least 90% of them (vramplan.bounds.interval: an order statistic over rows, no constant
fitted to any row). It reports the in-sample coverage, the leave-one-out coverage (each row
against the interval built without it) and, as rows never used, the coverage of the device
interval on rows whose metric is unknown and of each interval on the `poor` rows.

    python bench/accuracy/bounds.py [path/to/published-dev-specs.json] [--target 0.9]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import score_published  # noqa: E402

OUT = os.path.join(score_published.ROOT, "src", "vramplan", "catalog", "bounds.json")
SOURCES = {"allocated": ("allocated",), "reserved": ("reserved",), "device": ("nvml",)}
"""Which measured metric builds each bound: like with like (active is below allocated and
unknown may be any of them, so neither builds a bound)."""


GPU_RESULTS = os.path.join(score_published.ROOT, "bench", "cuda")
"""Catalog-size training steps measured here on a GPU (bench/cuda/results-cuda-scale-*.json
only: the published rows' shapes and the Adafactor steps measured since are fixed-length
steps of one session, which would outweigh the published rows and their run-to-run spread,
two runs of one torchtune config 10% apart): rows of every metric, measured exactly
(max_memory_allocated, max_memory_reserved and NVML device-level used memory of a case run
alone)."""
MEASURED_HERE = (("allocated", "peak_allocated_bytes", "peak_allocated_bytes"),
                 ("reserved", "peak_reserved_bytes", "reserved_bytes"),
                 ("nvml", "device_bytes", "device_bytes"))


def measured_here(folder: str = GPU_RESULTS) -> list[dict]:
    """The GPU rows as score_published results (error = estimated / measured - 1), each
    re-estimated with this code."""
    import glob
    import vramplan
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "results-cuda-scale-*.json"))):
        with open(path) as fh:
            doc = json.load(fh)
        for case in doc["cases"]:
            measured = case.get("measured")
            if not measured:
                continue
            est = vramplan.estimate(vramplan.load_spec(case["job"])).to_dict()
            for metric, meas_key, est_key in MEASURED_HERE:
                # side by side with other processes the device-level figure held theirs too
                shared = metric == "nvml" and case.get("parallel_jobs", 1) > 1
                if measured.get(meas_key) and not shared:
                    rows.append({"id": f"{doc['gpu']}: {case['name']}", "metric": metric, "fidelity": "exact",
                                 "error": est[est_key] / measured[meas_key] - 1})
    return rows


def build(results: list[dict], target: float) -> dict:
    from vramplan.bounds import coverage, interval, leave_one_out
    metrics, checks = {}, {}
    for name, measured_as in SOURCES.items():
        rows = [r for r in results if r["metric"] in measured_as and r["fidelity"] != "poor"]
        ratios = [1 / (1 + r["error"]) for r in rows]   # error = estimated / measured - 1
        lo, hi = interval(ratios, target)
        metrics[name] = {"lo": round(lo, 4), "hi": round(hi, 4), "n": len(rows),
                         "coverage": round(coverage(ratios, lo, hi), 3),
                         "coverage_leave_one_out": _round(leave_one_out(ratios, target)),
                         "measured_as": list(measured_as), "rows": [r["id"] for r in rows]}
        poor = [1 / (1 + r["error"]) for r in results if r["metric"] in measured_as and r["fidelity"] == "poor"]
        if poor:
            checks[f"{name}_on_poor_rows"] = {"n": len(poor), "coverage": round(coverage(poor, lo, hi), 3)}
    unknown = [1 / (1 + r["error"]) for r in results if r["metric"] == "unknown" and r["fidelity"] != "poor"]
    if unknown:
        lo, hi = metrics["device"]["lo"], metrics["device"]["hi"]
        checks["device_on_unknown_metric_rows"] = {"n": len(unknown), "coverage": round(coverage(unknown, lo, hi), 3)}
    return {"metrics": metrics, "checks": checks}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="?", default=None)
    ap.add_argument("--target", type=float, default=0.9)
    args = ap.parse_args()
    path = args.rows or score_published.default_rows_path()
    out = score_published.score(score_published.load_rows(path))
    built = build(out["results"] + measured_here(), args.target)
    data = {"schema_version": 1,
            "what": "Relative error interval per metric: the measured figure lay in [lo * estimate, hi * estimate] "
                    "on at least target_coverage of the rows it was built from. Empirical quantile over rows "
                    "(vramplan/bounds.py), not a fitted constant.",
            "target_coverage": args.target, "excluded_fidelity": ["poor"],
            "built_by": "bench/accuracy/bounds.py", "rows_file": os.path.relpath(path, score_published.ROOT),
            "gpu_rows": "bench/cuda/results-cuda-scale-*.json",
            "estimator_commit": score_published._commit(), **built}
    with open(OUT, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    for name, m in data["metrics"].items():
        loo = "n/a" if m["coverage_leave_one_out"] is None else f"{m['coverage_leave_one_out']:.0%}"
        print(f"{name:>9}: [{m['lo']:.3f}, {m['hi']:.3f}] x estimate  n={m['n']:2d}  "
              f"coverage {m['coverage']:.0%}  leave-one-out {loo}")
    for name, c in data["checks"].items():
        print(f"{name:>31}: n={c['n']:2d}  coverage {c['coverage']:.0%}")
    print(f"wrote {os.path.relpath(OUT, score_published.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
