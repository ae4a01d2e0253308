#!/usr/bin/env python3
"""Real CUDA steps' own allocation traces against vramplan's allocator model and event list.

Each trace in traces/ (recorded on a GPU by bench/cuda/trace_cuda.py) holds every alloc and
free PyTorch's caching allocator saw during a grid case's two training steps, the phase
boundaries, and the measured `max_memory_reserved`. For each trace this prints:

- `model on real`: the allocator model (vramplan.allocator.CachingAllocator) replaying the
  real sequence of allocations; it should equal the measured reserve, byte for byte;
- `events`: the model replaying vramplan's own event list for the same job
  (vramplan.device.step_events, the replay `estimate` runs), and its error;
- per phase, the reserve at the phase's end and the number of allocations, real and
  event list;
- `eager states`: the real sequence with the optimizer states that the first step creates
  moved before the first forward (where an event list that makes them at setup puts them),
  to show what their lazy creation (torch/optim/adam.py `_init_group`) is worth.

    python bench/allocator/trace_compare.py [--traces DIR] [--json results-trace-compare.json]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
sys.path.insert(0, str(HERE.parent.parent / "src"))


def load(path: Path) -> tuple[dict, list]:
    """(trace document, ops) (vramplan.allocator.trace.ops)."""
    from vramplan.allocator.trace import ops
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        doc = json.load(fh)
    return doc, ops(doc)


def replay_real(seq: list, conf: str | None = None) -> tuple[int, dict]:
    """The model on the real sequence under the run's PYTORCH_CUDA_ALLOC_CONF: (max
    reserved, {phase: reserved at its end})."""
    from vramplan.allocator.trace import replay_ops
    from vramplan.spec.alloc_conf import parse_alloc_conf
    return replay_ops(seq, parse_alloc_conf(conf))


def eager_states(ops: list) -> list:
    """The real sequence with the first optimizer step's never-freed allocations (its
    states) made before the first forward."""
    last = {}
    for i, (kind, addr, _, _) in enumerate(ops):
        if kind == "a":
            last[addr] = i
        else:
            last.pop(addr, None)
    states = {i for i in last.values() if ops[i][3] == "s1.opt"}
    first = next((i for i, op in enumerate(ops) if op[3] != "init"), len(ops))
    rest = [op for i, op in enumerate(ops) if i not in states]
    return rest[:first] + [ops[i] for i in sorted(states)] + rest[first:]


def replay_events(job: dict) -> tuple[int, dict, dict]:
    """vramplan's event list for the job through the model, as `estimate` replays it:
    (max reserved, {phase: reserved at its end}, {phase: allocations})."""
    import vramplan
    from vramplan.device import step_events
    events = step_events(vramplan.load_spec(dict(job)))
    seq = [("a", t, nbytes, "init") for _, t, nbytes, _, _ in events.setup]
    for step in (1, 2):
        # the first step makes the tensors it keeps (StepEvents.lazy)
        for kind, t, nbytes, _, phase in events.first_events() if step == 1 else events.step:
            seq.append(("a" if kind == "alloc" else "f", t, nbytes, f"s{step}.{SHORT[phase]}"))
    counts: dict[str, int] = {}
    for kind, _, _, name in seq:
        counts[name] = counts.get(name, 0) + (kind == "a")
    top, ends = replay_real(seq, job.get("alloc_conf"))
    return top, ends, counts


def main() -> int:
    from vramplan.allocator.trace import is_marker
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default=str(HERE / "traces"))
    ap.add_argument("--json", default=str(HERE / "results-trace-compare.json"))
    args = ap.parse_args()
    rows = []
    for path in sorted(Path(args.traces).glob("*.json*")):
        doc, ops = load(path)
        measured = doc["max_memory_reserved"]
        conf = doc["job"].get("alloc_conf")
        real_top, real_ends = replay_real(ops, conf)
        eager_top, _ = replay_real(eager_states(ops), conf)
        ev_top, ev_ends, ev_counts = replay_events(doc["job"])
        real_counts: dict = {}
        for kind, _, size, phase in ops:
            if kind == "a" and not is_marker(doc, size):
                real_counts[phase] = real_counts.get(phase, 0) + 1
        rows.append({
            "case": doc["case"], "gpu": doc["gpu"], "torch": doc["torch"],
            "measured_reserved": measured, "model_on_real": real_top,
            "events_reserved": ev_top, "events_error": (ev_top - measured) / measured,
            "eager_states_reserved": eager_top, "eager_states_effect": (eager_top - real_top) / real_top,
            "phases": {p: {"real_reserved_end": real_ends.get(p), "events_reserved_end": ev_ends.get(p),
                           "real_allocs": real_counts.get(p, 0), "events_allocs": ev_counts.get(p, 0)}
                       for p in ["init"] + doc["phases"]},
        })
    mib = 2**20
    print(f"{'case':<68} {'measured':>9} {'model on real':>13} {'events':>16} {'eager states':>13}")
    for r in rows:
        print(f"{r['case'][:68]:<68} {r['measured_reserved'] / mib:9.0f} {r['model_on_real'] / mib:13.0f} "
              f"{r['events_reserved'] / mib:8.0f} {100 * r['events_error']:+6.1f}% "
              f"{100 * r['eager_states_effect']:+12.1f}%")
    exact = sum(r["model_on_real"] == r["measured_reserved"] for r in rows)
    errs = [r["events_error"] for r in rows]
    summary = {"traces": len(rows), "model_on_real_exact": exact,
               "events_median_abs": statistics.median(abs(e) for e in errs) if errs else None,
               "events_median": statistics.median(errs) if errs else None}
    print(f"\nmodel on the real sequence equals the measured reserve: {exact} of {len(rows)}")
    if errs:
        print(f"event list: median |err| {100 * summary['events_median_abs']:.1f}%, "
              f"median {100 * summary['events_median']:+.1f}%")
    with open(args.json, "w") as fh:
        json.dump({"summary": summary, "rows": rows}, fh, indent=1)
    print(f"wrote {os.path.relpath(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
