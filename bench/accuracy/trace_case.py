"""Which tensors are alive at the peak and at the end of forward, for one job.

    python bench/accuracy/trace_case.py SPEC_JSON_OR_NAME [--fake] [--snap s2.bwd ...]
                                        [--raw] [--limit 60] [--json OUT]

SPEC_JSON_OR_NAME: a spec file (JSON/YAML), a cpu-dev-truth row name (or a unique
substring of one, e.g. 'llama-60m/b2s512/fp32/full/adamw-foreach/sdpa/nogc'), or an
inline JSON job.  Prints, per snapshot, bytes per category, then the tensors grouped
by module path (layer index -> '*'), creating op, dtype and shape, then the saved
activations of one decoder layer (what autograd keeps per layer) and bytes per layer.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

TRUTH = Path("/work/shared/validation/cpu-dev-truth.jsonl")


def load_job(arg: str) -> tuple[str, dict]:
    if Path(arg).exists():
        from vramplan import load_spec

        return arg, load_spec(arg).to_dict()
    if arg.lstrip().startswith("{"):
        return "inline", json.loads(arg)
    rows = [json.loads(line) for line in TRUTH.read_text().splitlines()]
    hits = [r for r in rows if r["name"] == arg] or [r for r in rows if arg in r["name"]]
    if len(hits) != 1:
        names = "\n  ".join(r["name"] for r in (hits or rows))
        raise SystemExit(f"{arg!r} matches {len(hits)} dev-truth rows; pick one of:\n  {names}")
    return hits[0]["name"], hits[0]["job"]


def layer_table(trace, name: str) -> str:
    """Activations ('other') created inside decoder layer 0, one line per tensor kind,
    plus the bytes each layer holds: the per-layer saved-tensor list."""
    from vramplan.measure.trace import fmt_bytes, layer_index, module_pattern

    snap = trace.snapshots[name]
    rows: dict[tuple, list[int]] = {}
    for info in snap.storages:
        if snap.category(info) != "other" or layer_index(info.module) != "0":
            continue
        key = (module_pattern(info.module), info.op, info.dtype, tuple(info.shape), info.node)
        rows.setdefault(key, []).append(info.nbytes)
    lines = [f"-- {name}: tensors created in layer 0 (same set in every layer) --"]
    total = 0
    for (mod, op, dtype, shape, node), sizes in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        total += sum(sizes)
        where = mod.split("layers.*.", 1)[-1] + (f" <{node}>" if node else "")
        lines.append(f"  {where[:48]:48s} {op[:34]:34s} {dtype:9s} {str(list(shape)):24s} "
                     f"x{len(sizes)} {sum(sizes):>12d}")
    lines.append(f"  {'layer 0 total':48s} {'':34s} {'':9s} {'':24s}    {total:>12d}  {fmt_bytes(total)}")
    per_layer = trace.by_layer(name, "other")
    lines.append("  bytes per layer: " + ", ".join(
        f"{k or 'outside'}={v}" for k, v in sorted(per_layer.items(), key=lambda kv: (kv[0] == "", kv[0].zfill(4)))))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case")
    ap.add_argument("--fake", action="store_true", help="FakeTensorMode: big shapes, no memory")
    ap.add_argument("--snap", nargs="*", default=[], help="more snapshots, e.g. s2.bwd s2.opt")
    ap.add_argument("--raw", action="store_true", help="also print every live storage")
    ap.add_argument("--limit", type=int, default=60)
    ap.add_argument("--json", default="", help="write all snapshots' raw lists here")
    args = ap.parse_args(argv)

    from vramplan.measure import measure

    name, job = load_job(args.case)
    result = measure(job, fake=args.fake, trace=True)
    trace = result.trace
    print(f"# {name}\n# {json.dumps(result.to_dict())}\n")
    for snap in ["peak", "end_of_forward", *args.snap]:
        if snap not in trace.snapshots:
            print(f"(no snapshot {snap!r}; have {', '.join(trace.names())})")
            continue
        print(trace.render(snap, limit=args.limit))
        print(layer_table(trace, snap))
        if args.raw:
            for row in trace.raw(snap):
                print("   ", json.dumps(row))
        print()
    if args.json:
        Path(args.json).write_text(json.dumps(trace.to_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
