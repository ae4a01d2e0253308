#!/usr/bin/env python3
"""Inference jobs: vramplan's estimate against transformers' own no-grad forward and generate.

Each case runs in a fresh process under the exact CPU meter (`vramplan measure`, task
inference: measure/inference.py runs `model(...)` under inference_mode, or
`model.generate(..., max_new_tokens=n, min_new_tokens=n)` over a DynamicCache) on a tiny
random-weight model, and is compared with `vramplan.estimate` of the same job.

    python bench/inference/run.py [--only SUBSTRING] [--out bench/inference/results.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

LLAMA = {"model_type": "llama", "vocab_size": 16000, "hidden_size": 512, "intermediate_size": 1376,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": False}
QWEN2 = {"model_type": "qwen2", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True}
GEMMA = {"model_type": "gemma", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 2048,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
         "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True}
QWEN3 = {"model_type": "qwen3", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
         "tie_word_embeddings": True}
PHI3 = {"model_type": "phi3", "vocab_size": 32064, "hidden_size": 512, "intermediate_size": 1376,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": False}
MHA = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
       "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "vocab_size": 16000, "n_embd": 512, "n_layer": 4, "n_head": 8, "n_positions": 1024}

BASE = {"task": "inference", "backend": "cpu", "micro_batch_size": 2, "seq_len": 256, "attention": "sdpa",
        "precision": "fp32"}


def case(name: str, model: dict, **fields) -> tuple[str, dict]:
    return name, {**BASE, "model": model, **fields}


CASES = dict([
    case("llama/fp32/forward", LLAMA),
    case("llama/bf16/forward", LLAMA, precision="bf16"),
    case("llama/fp32/generate-8", LLAMA, max_new_tokens=8),
    case("llama/bf16/generate-8", LLAMA, precision="bf16", max_new_tokens=8),
    case("llama/bf16/generate-16/eager/b4s128", LLAMA, precision="bf16", micro_batch_size=4, seq_len=128,
         max_new_tokens=16, attention="eager"),
    case("llama/amp-bf16-over-fp32/forward", LLAMA, precision="amp-bf16", load_dtype="float32"),
    case("llama/amp-bf16-over-fp32/generate-8", LLAMA, precision="amp-bf16", load_dtype="float32", max_new_tokens=8),
    case("llama-mha/fp32/s16/generate-48", MHA, seq_len=16, max_new_tokens=48),
    case("qwen2/fp32/forward", QWEN2),
    case("qwen2/fp32/generate-8", QWEN2, max_new_tokens=8),
    case("gemma/fp32/generate-8", GEMMA, max_new_tokens=8),
    case("qwen3/fp32/generate-8", QWEN3, max_new_tokens=8),
    case("phi3/fp32/generate-8", PHI3, max_new_tokens=8),
    case("gpt2/fp32/forward", GPT2),
    case("gpt2/fp32/generate-8", GPT2, max_new_tokens=8),
])

CHILD = ("import json, sys; sys.path.insert(0, sys.argv[1]); from vramplan.measure import measure; "
         "print(json.dumps(measure(json.loads(sys.argv[2])).to_dict()))")


def run_case(job: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(SRC), json.dumps(job)], capture_output=True,
                          text=True, check=False, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimate(job: dict) -> dict:
    sys.path.insert(0, str(SRC))
    import vramplan

    est = vramplan.estimate(vramplan.load_spec(job))
    return {"peak_allocated_bytes": est.peak_allocated_bytes, "terms": dict(est.components.terms)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--reestimate", action="store_true", help="keep the measurements, redo the estimates")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for name, job in CASES.items():
        if args.only not in name:
            continue
        row = results.get(name) if args.reestimate else None
        measured = row["measured"] if row else run_case(job)
        est = estimate(job)
        err = est["peak_allocated_bytes"] / measured["peak_allocated_bytes"] - 1
        results[name] = {"job": job, "measured": measured, "estimate": est, "error": {"peak": err}}
        print(f"{name:45s} measured {measured['peak_allocated_bytes']:>12,}  estimated "
              f"{est['peak_allocated_bytes']:>12,}  {100 * err:+.2f}%", flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
