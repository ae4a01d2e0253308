#!/usr/bin/env python3
"""The allocator model's reserve against published GPU measurements, beside the estimate's.

For each published row measured as max_memory_reserved, nvidia-smi or an unstated memory
figure (../shared/validation/published-dev-specs.json, the rows
bench/accuracy/score_published.py compares with reserved_bytes or device_bytes), it
compares two reserves: the live peak plus the fitted reserve of components/runtime.py
(device.reserved_bytes: what the estimate reports on several GPUs) and the allocator model's
replay of the step's tensor events (`allocator.reserved_bytes`: what it reports on one GPU),
each with the same CUDA context on top for nvidia-smi rows. Prints the median |err| per
metric for both and writes results-published-replay.json.

    python bench/allocator/score_replay.py [path/to/published-dev-specs.json]
"""
from __future__ import annotations

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "..", "..", "shared", "validation", "published-dev-specs.json")
DEVICE_METRICS = ("nvml", "unknown")


def _job(row: dict) -> dict:
    job = dict(row["job"])
    if row.get("model_inline"):
        job["model"] = row["model_inline"]
    return job


def score(rows: list[dict]) -> list[dict]:
    import vramplan
    from vramplan.catalog import UnknownNameError
    from vramplan.device import reserved_bytes
    from vramplan.timeline import peak_event
    out = []
    for row in rows:
        if row["metric"] not in ("reserved",) + DEVICE_METRICS:
            continue
        try:
            est = vramplan.estimate(vramplan.load_spec(_job(row)))
        except (ValueError, KeyError, UnknownNameError):
            continue
        alloc = est.allocator
        if alloc is None:  # multi-model jobs: not replayed
            continue
        above = est.device_bytes - est.reserved_bytes if row["metric"] in DEVICE_METRICS else 0
        measured = row["measured_bytes"]
        # the fitted reserve itself (device.reserved_bytes): on one GPU the estimate now
        # reports the replay, so the two columns compare the models, not the reported figure
        fitted = reserved_bytes(est.events, peak_event(est.events))
        out.append({"id": row["id"], "metric": row["metric"], "fidelity": row["fidelity"],
                    "measured_gib": round(measured / 2**30, 3),
                    "fitted_error": round((fitted + above) / measured - 1, 4),
                    "replay_error": round((alloc.reserved_bytes + above) / measured - 1, 4),
                    "replay_fragmentation_gib": round(alloc.fragmentation_bytes / 2**30, 3)})
    return out


def summary(results: list[dict]) -> list[str]:
    lines = []
    for metric in ("reserved",) + DEVICE_METRICS:
        rs = [r for r in results if r["metric"] == metric]
        if not rs:
            continue
        for key in ("fitted_error", "replay_error"):
            errs = [r[key] for r in rs]
            lines.append(f"{metric:>9} {key.split('_')[0]:>6}: n={len(rs):2d}  median |err| "
                         f"{statistics.median(abs(e) for e in errs):6.1%}  under by >10%: "
                         f"{sum(e < -0.10 for e in errs)}")
    return lines


def main() -> int:
    rows = json.load(open(sys.argv[1] if len(sys.argv) > 1 else DEFAULT))
    results = score(rows)
    for r in results:
        print(f"{r['id']} {r['metric']:>9} measured {r['measured_gib']:7.2f} GiB  fitted {r['fitted_error']:+7.1%}"
              f"  replay {r['replay_error']:+7.1%}  (replay fragmentation {r['replay_fragmentation_gib']:.2f} GiB)")
    lines = summary(results)
    print("\n".join(lines))
    with open(os.path.join(HERE, "results-published-replay.json"), "w") as fh:
        json.dump({"results": results, "summary": lines}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
