#!/usr/bin/env python3
"""Quantized bases against the real libraries on CPU.

1. storage: one quantized linear layer built by its library (bitsandbytes Linear4bit /
   Linear8bitLt, GPTQModel TorchLinear, GPTQModel AwqTorchLinear, torchao Int8Tensor /
   Float8Tensor weights); the bytes of its unique storages (bias left out: vramplan lists
   it as its own parameter) next to vramplan.components.quant.storage.
2. steps: two QLoRA training steps of a tiny Llama on a real quantized base under the exact
   CPU meter (vramplan.measure; one process per job), next to vramplan.estimate.

    PYTHONPATH=src python bench/quant/run.py [storage|steps] [--only NAME]   # writes results.json
    PYTHONPATH=src python bench/quant/run.py --reestimate      # new estimates, same measurements
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = ((384, 512), (688, 256), (256, 1024))
"""(out_features, in_features) of the layers checked."""

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 512}
WIDE = dict(TINY, intermediate_size=2048, vocab_size=256)
"""A wide MLP and a small vocabulary: the layer's backward, not the head's, sets the peak."""
AWQ_TINY = dict(TINY, intermediate_size=768)
"""AWQ's groups must be whole (dequantize_gemm repeats each group's scale group_size times):
an MLP width that 128 divides."""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = [  # (name, quantization, precision, gradient_checkpointing[, model, micro batch, seq_len])
    ("nf4 double-quant", {"type": "nf4"}, "bf16", "none"),
    ("nf4 double-quant, checkpointing", {"type": "nf4"}, "bf16", "full"),
    ("fp4", {"type": "fp4", "double_quant": False}, "bf16", "none"),
    ("bitsandbytes int8", {"type": "int8"}, "bf16", "none"),
    ("gptq 4-bit g128, torch kernel", {"type": "gptq", "compute_dtype": "fp16"}, "fp16", "none"),
    ("gptq 4-bit g128, torch kernel, checkpointing", {"type": "gptq", "compute_dtype": "fp16"}, "fp16", "full"),
    ("gptq 8-bit g-1, torch kernel", {"type": "gptq", "bits": 8, "group_size": -1, "compute_dtype": "fp16"},
     "fp16", "none"),
    ("awq 4-bit g128, torch kernel", {"type": "awq", "kernel": "torch", "compute_dtype": "fp16"}, "fp16", "none",
     AWQ_TINY),
    ("awq 4-bit g128, torch kernel, checkpointing", {"type": "awq", "kernel": "torch", "compute_dtype": "fp16"},
     "fp16", "full", AWQ_TINY),
    ("torchao int8 weight-only", {"type": "torchao-int8"}, "bf16", "none"),
    ("torchao int8 weight-only, checkpointing", {"type": "torchao-int8"}, "bf16", "full"),
    ("torchao fp8 weight-only", {"type": "torchao-fp8"}, "bf16", "none"),
    ("hqq 4-bit g64", {"type": "hqq", "bits": 4, "group_size": 64}, "bf16", "none"),
    ("hqq 4-bit g64, checkpointing", {"type": "hqq", "bits": 4, "group_size": 64}, "bf16", "full"),
    ("hqq 2-bit g16", {"type": "hqq", "bits": 2, "group_size": 16}, "bf16", "none"),
    ("hqq 8-bit g64", {"type": "hqq", "bits": 8, "group_size": 64}, "bf16", "none"),
    ("hqq 4-bit g64, wide MLP, checkpointing", {"type": "hqq", "bits": 4, "group_size": 64}, "bf16", "full",
     WIDE, 1, 64),
    # DoRA (PEFT use_dora): DoraLinearLayer dequantizes the base weight at every forward
    # (peft/utils/integrations.py dequantize_module_weight) for the weight norm
    ("nf4 double-quant, DoRA", {"type": "nf4"}, "bf16", "none", TINY, 2, 128, {"use_dora": True}),
    ("nf4 double-quant, DoRA, dropout", {"type": "nf4"}, "bf16", "none", TINY, 2, 128,
     {"use_dora": True, "dropout": 0.05}),
    ("hqq 4-bit g64, DoRA, wide MLP, checkpointing", {"type": "hqq", "bits": 4, "group_size": 64}, "bf16", "full",
     WIDE, 1, 64, {"use_dora": True}),
]


def _job(quant: dict, precision: str, gc: str, model: dict = TINY, batch: int = 2, seq: int = 128,
         lora: dict | None = None) -> dict:
    return {"model": model, "task": "sft", "method": "qlora",
            "lora": {"r": 8, "target_modules": TARGETS, **(lora or {})},
            "quantization": quant, "precision": precision, "micro_batch_size": batch, "seq_len": seq,
            "backend": "cpu", "gradient_checkpointing": gc}


# ------------------------------------------------------------------ storage
def _unique(tensors) -> int:
    from vramplan.measure.quantized import storage_bytes
    return storage_bytes(tensors)


def _bnb(kind: str, m: int, n: int, double_quant: bool = True) -> int:
    import bitsandbytes as bnb
    import torch

    w = torch.randn(m, n, dtype=torch.bfloat16)
    if kind == "int8":
        p = bnb.nn.Int8Params(w.to(torch.float16), requires_grad=False, has_fp16_weights=False)
        p = p.to("cpu")  # Int8Params._quantize on .to(device): CB int8 (m, n), SCB fp32 (m,)
        return _unique([p.data, p.SCB])
    p = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=double_quant, quant_type=kind)._quantize("cpu")
    qs = p.quant_state
    state = [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
    return _unique([p.data] + state)


def _gptq(m: int, n: int, bits: int, group: int, desc_act: bool) -> int:
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    ql = TorchLinear(bits=bits, group_size=group, sym=True, desc_act=desc_act, in_features=n, out_features=m,
                     bias=False, register_buffers=True)
    ql.post_init()
    return _unique(ql.buffers())


def _awq(m: int, n: int, group: int) -> int:
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

    ql = AwqTorchLinear(bits=4, group_size=group, sym=False, desc_act=False, in_features=n, out_features=m,
                        bias=False, register_buffers=True)
    return _unique(ql.buffers())


def _torchao(kind: str, m: int, n: int) -> int:
    import torch
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    lin = torch.nn.Sequential(torch.nn.Linear(n, m, bias=False)).to(torch.bfloat16)
    quantize_(lin, Int8WeightOnlyConfig() if kind == "torchao-int8" else Float8WeightOnlyConfig())
    return _unique([lin[0].weight])


def _hqq(m: int, n: int, bits: int, group: int) -> int:
    import torch
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    # transformers' HqqConfig passes axis=1, hqq's default; compute dtype bf16
    lin = torch.nn.Linear(n, m, bias=False)
    q = HQQLinear(lin, BaseQuantizeConfig(nbits=bits, group_size=group, axis=1), compute_dtype=torch.bfloat16,
                  device="cpu", initialize=True)
    return _unique([q.W_q] + [v for v in q.meta.values() if isinstance(v, torch.Tensor)])


def storage_cases():
    for m, n in SHAPES:
        for kind in ("nf4", "fp4"):
            for dq in (True, False):
                yield {"type": kind, "double_quant": dq}, (m, n), lambda k=kind, d=dq, m=m, n=n: _bnb(k, m, n, d)
        yield {"type": "int8"}, (m, n), lambda m=m, n=n: _bnb("int8", m, n)
        for bits, group, act in ((4, 128, False), (4, 128, True), (4, -1, False), (8, 32, False),
                                 (3, 64, False), (2, 128, False)):
            if bits == 3 and m % 32:
                continue  # GPTQModel packs 3 bits in whole 32-column words
            q = {"type": "gptq", "bits": bits, "group_size": group, "desc_act": act}
            yield q, (m, n), lambda b=bits, g=group, a=act, m=m, n=n: _gptq(m, n, b, g, a)
        for group in (64, 128):
            yield {"type": "awq", "group_size": group}, (m, n), lambda g=group, m=m, n=n: _awq(m, n, g)
        for kind in ("torchao-int8", "torchao-fp8"):
            yield {"type": kind}, (m, n), lambda k=kind, m=m, n=n: _torchao(k, m, n)
        for bits, group in ((8, 64), (4, 64), (3, 64), (2, 16), (1, 8)):
            q = {"type": "hqq", "bits": bits, "group_size": group}
            yield q, (m, n), lambda b=bits, g=group, m=m, n=n: _hqq(m, n, b, g)


def run_storage(old: list[dict] = ()) -> list[dict]:
    """Every storage case; one whose library is not installed here keeps its committed
    measurement (GPTQModel wants torch>=2.14 and is installed only for its run)."""
    from vramplan.components.quant import storage
    from vramplan.spec import QuantConfig

    kept = {(json.dumps(r["quantization"], sort_keys=True), r["out_features"], r["in_features"]): r["measured_bytes"]
            for r in old}
    rows = []
    for quant, (m, n), real in storage_cases():
        codes, state = storage(QuantConfig(**quant), m, n)
        try:
            measured = real()
        except ImportError:
            key = (json.dumps(quant, sort_keys=True), m, n)
            if key not in kept:
                raise
            measured = kept[key]
        rows.append({"quantization": quant, "out_features": m, "in_features": n, "measured_bytes": measured,
                     "estimated_bytes": codes + state, "exact": measured == codes + state})
        print(f"{json.dumps(quant):70s} ({m}, {n}) measured {measured:>8} estimated {codes + state:>8}")
    return rows


# -------------------------------------------------------------------- steps
def run_step(index: int) -> dict:
    import vramplan
    from vramplan.measure import measure

    name, *args = STEPS[index]
    job = _job(*args)
    est = vramplan.estimate(vramplan.load_spec(job))
    res = measure(job, device="cpu")
    return {"name": name, "job": job, "measured_peak_bytes": res.peak_allocated_bytes,
            "measured_peak_phase": res.peak_phase, "estimated_peak_bytes": est.peak_allocated_bytes,
            "error": round(est.peak_allocated_bytes / res.peak_allocated_bytes - 1, 5)}


def run_steps(old: list[dict] = (), only: str | None = None) -> list[dict]:
    """Every step, one process each; with `only`, the steps whose name contains it, the
    others keeping their committed rows."""
    kept = {r["name"]: r for r in old}
    rows = []
    for i in range(len(STEPS)):
        if only is not None and only not in STEPS[i][0] and STEPS[i][0] in kept:
            rows.append(kept[STEPS[i][0]])
            continue
        out = subprocess.run([sys.executable, __file__, "--step", str(i)], capture_output=True, text=True,
                             env=dict(os.environ, TQDM_DISABLE="1"))
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        if out.returncode or not line:
            raise SystemExit(f"step {STEPS[i][0]} failed:\n{out.stderr[-3000:]}")
        row = json.loads(line[-1])
        rows.append(row)
        print(f"{row['name']:50s} measured {row['measured_peak_bytes']:>10} estimated "
              f"{row['estimated_peak_bytes']:>10} {row['error']:+.2%}")
    return rows


def reestimate(rows: list[dict]) -> list[dict]:
    """The committed measurements with the current estimator's figures."""
    import vramplan

    for row in rows:
        est = vramplan.estimate(vramplan.load_spec(row["job"]))
        row["estimated_peak_bytes"] = est.peak_allocated_bytes
        row["error"] = round(est.peak_allocated_bytes / row["measured_peak_bytes"] - 1, 5)
        print(f"{row['name']:50s} measured {row['measured_peak_bytes']:>10} estimated "
              f"{row['estimated_peak_bytes']:>10} {row['error']:+.2%}")
    return rows


def versions(old: dict) -> dict:
    """The releases measured with (a library not installed now keeps its committed release)."""
    from importlib.metadata import PackageNotFoundError, version

    out = dict(old)
    for p in ("torch", "transformers", "peft", "bitsandbytes", "gptqmodel", "torchao", "hqq"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            pass
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["--step"]:
        print(json.dumps(run_step(int(argv[1]))))
        return
    path = os.path.join(HERE, "results.json")
    old = json.load(open(path)) if os.path.exists(path) else {}
    what = argv[0] if argv else "all"
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    if what == "--reestimate":
        out = dict(old, steps=reestimate(old.get("steps", [])))
    else:
        out = {"versions": versions(old.get("versions", {})),
               "storage": run_storage(old.get("storage", [])) if what in ("all", "storage") else old.get("storage", []),
               "steps": run_steps(old.get("steps", []), only) if what in ("all", "steps") else old.get("steps", [])}
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
