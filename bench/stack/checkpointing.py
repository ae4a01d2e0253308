"""torchtitan's activation checkpointing, measured: each case is one real training step of
a tiny random transformers model under vramplan's exact CPU meter (`vramplan.measure`, a
fresh process per case, as bench/accuracy/grid.py runs them) with

* `gradient_checkpointing: op-selective`: torchtitan 0.3.0's own `SelectiveAC` applied to
  the model's decoder layers (measure/torchtitan_ac.py), its per-op save policy running as
  torchtitan ships it;
* `gradient_checkpointing: full, checkpoint_every: N`: torch's checkpoint_wrapper on every
  N-th layer, torchtitan <= 0.2's layer-selective mode,

next to `vramplan.estimate` of the same job (components/op_checkpoint.py, activations.py).

    PYTHONPATH=src python bench/stack/checkpointing.py          # all cases -> results-checkpointing.json
    PYTHONPATH=src python bench/stack/checkpointing.py --only qwen2   # those cases, merged into it
    PYTHONPATH=src python bench/stack/checkpointing.py --summary
"""
from __future__ import annotations

import json
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "accuracy"))
import grid  # noqa: E402  (bench/accuracy/grid.py: the subprocess runner and the error table)

OUT = HERE / "results-checkpointing.json"
SMALL = {"model_type": "llama", "vocab_size": 16000, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False}
GQA = {**SMALL, "num_attention_heads": 8, "num_key_value_heads": 2}
QWEN2 = {**SMALL, "model_type": "qwen2", "num_key_value_heads": 2}  # q, k, v with bias: addmm
BASE = {"backend": "cpu", "method": "full", "optimizer": "adamw", "optimizer_impl": "foreach",
        "attention": "sdpa", "micro_batch_size": 2, "seq_len": 512, "stack": "torchtitan"}
CASES = [
    ("llama/fp32/op-selective", {"model": SMALL, "precision": "fp32", "gradient_checkpointing": "op-selective"}),
    ("llama/bf16/op-selective", {"model": SMALL, "precision": "pure-bf16", "gradient_checkpointing": "op-selective"}),
    ("llama/amp-bf16/op-selective", {"model": SMALL, "precision": "amp-bf16", "gradient_checkpointing": "op-selective"}),
    ("llama/fp32/selective (stack torchtitan)", {"model": SMALL, "precision": "fp32", "gradient_checkpointing": "selective"}),
    ("llama-gqa/fp32/op-selective", {"model": GQA, "precision": "fp32", "gradient_checkpointing": "op-selective"}),
    ("llama/fp32/op-selective/eager", {"model": SMALL, "precision": "fp32", "gradient_checkpointing": "op-selective",
                                       "attention": "eager", "seq_len": 256}),
    ("qwen2/fp32/op-selective", {"model": QWEN2, "precision": "fp32", "gradient_checkpointing": "op-selective"}),
    ("llama/fp32/full every 2", {"model": SMALL, "precision": "fp32", "gradient_checkpointing": "full",
                                 "checkpoint_every": 2}),
    ("llama/bf16/full every 3", {"model": SMALL, "precision": "pure-bf16", "gradient_checkpointing": "full",
                                 "checkpoint_every": 3}),
    ("llama/fp32/none (reference)", {"model": SMALL, "precision": "fp32", "gradient_checkpointing": "none"}),
]


def run(only: str | None) -> list[dict]:
    rows = []
    for name, job in CASES:
        if only and only not in name:
            continue
        job = {**BASE, **job}
        row = {"name": name, "job": job}
        t0 = time.perf_counter()
        try:
            child = grid.measure_in_subprocess(job, "cpu", False)
            measured = child["measured"]
            measured["peak_phase_kind"] = grid.PHASE_KINDS.get(measured["peak_phase"].rsplit(".", 1)[-1], "")
            row["measured"] = {k: measured[k] for k in ("peak_allocated_bytes", "phases", "peak_phase_kind")}
            est = grid.estimate(job)
            row["estimated"] = {k: est[k] for k in ("peak_allocated_bytes", "phases", "peak_phase")}
            row["error"] = grid.errors(measured, est)
        except Exception as exc:  # reported, the others go on
            row["failed"] = f"{type(exc).__name__}: {exc}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(line(row), flush=True)
        rows.append(row)
        save(row)
    return rows


def save(row: dict) -> None:
    """Merge one case into the results file (by name), so a partial run keeps what it measured."""
    data = json.loads(OUT.read_text()) if OUT.exists() else {"rows": []}
    versions = {p: metadata.version(p) for p in ("torch", "transformers", "torchtitan")}
    order = [name for name, _ in CASES]
    rows = {r["name"]: r for r in data["rows"]}
    rows[row["name"]] = row
    data.update({"what": __doc__.split("\n\n")[0], "versions": versions, "source": grid.source_state(),
                 "rows": sorted(rows.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else 99)})
    OUT.write_text(json.dumps(data, indent=1) + "\n")


def line(row: dict) -> str:
    if "failed" in row:
        return f"{row['name']:<42} FAILED {row['failed'][:200]}"
    e, m = row["error"], row["measured"]
    return (f"{row['name']:<42} peak {m['peak_allocated_bytes'] / 2**20:8.2f} MiB  est {e['peak']:+.3%}  "
            f"fwd {e['forward']:+.3%}  bwd {e['backward']:+.3%}  opt {e['optimizer']:+.3%}")


def main(argv: list[str]) -> int:
    if "--summary" in argv:
        for row in json.loads(OUT.read_text())["rows"]:
            print(line(row))
        return 0
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    rows = run(only)
    worst = max((max(abs(r["error"][k]) for k in ("peak", "forward", "backward", "optimizer"))
                 for r in rows if "error" in r), default=0.0)
    print(f"worst |error| over peaks and phases: {worst:.3%}")
    return 0 if all("error" in r for r in rows) and worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
