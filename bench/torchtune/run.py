"""torchtune's memory mechanisms, measured with torchtune's own code on CPU and estimated.

    PYTHONPATH=<torchao 0.10 folder>:src python bench/torchtune/run.py [--only SUBSTRING]

Each case runs bench/torchtune/tune_step.py in a fresh process: torchtune 0.6.1's recipe
`_loss_step`, CEWithChunkedOutputLoss, OffloadActivations and register_optim_in_bwd_hooks
on a tiny random-init Llama (transformers' modeling, pure bf16 as torchtune trains; LoRA and
QLoRA through torchtune's LoRALinear / FrozenNF4Linear on torchao's NF4Tensor), two
optimizer steps under vramplan's exact meter; the estimate is vramplan's for the same spec
(`stack: torchtune`, `loss_impl`, `activation_offloading`, `optimizer_in_backward`).
Results go to bench/torchtune/results.json (peak and per-phase error; target 2% at the peak).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(SRC))

LLAMA = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 344,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "tie_word_embeddings": True}
BASE = {"model": LLAMA, "stack": "torchtune", "precision": "bf16", "micro_batch_size": 2, "seq_len": 128,
        "optimizer": "adamw", "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu"}
AC = {"gradient_checkpointing": "full"}
# NF4 needs every quantized weight's size to be a multiple of 64 x 256 (torchao's block and
# scaler block): q/k/v/o 256 x 256, MLP 256 x 512.
LLAMA_NF4 = dict(LLAMA, hidden_size=256, intermediate_size=512, num_key_value_heads=4)
LORA = {"method": "lora", "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}
QLORA = {"method": "qlora", "model": LLAMA_NF4, "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}
CHUNKED = {"loss_impl": "chunked"}
OFFLOAD = {"activation_offloading": True}
IN_BWD = {"optimizer_in_backward": True}

CASES = {
    "full/ce": {},
    "full/chunked": CHUNKED,
    "full/chunked/ac": {**CHUNKED, **AC},
    "full/chunked/offload": {**CHUNKED, **OFFLOAD},
    "full/chunked/ac/offload": {**CHUNKED, **AC, **OFFLOAD},
    "full/chunked/in-bwd": {**CHUNKED, **IN_BWD},
    "full/chunked/ac/offload/in-bwd": {**CHUNKED, **AC, **OFFLOAD, **IN_BWD},
    "full/ce/ac/in-bwd/untied": {**AC, **IN_BWD, "model": dict(LLAMA, tie_word_embeddings=False)},
    "lora/chunked": {**CHUNKED, **LORA},
    "lora/chunked/ac/offload": {**CHUNKED, **AC, **OFFLOAD, **LORA},
    "qlora-nf4/chunked": {**CHUNKED, **QLORA},
    "qlora-nf4/chunked/ac/offload": {**CHUNKED, **AC, **OFFLOAD, **QLORA},
}


def tune_flags(spec: dict) -> dict:
    return {"chunked": spec.get("loss_impl") == "chunked", "offload": bool(spec.get("activation_offloading")),
            "optimizer_in_bwd": bool(spec.get("optimizer_in_backward"))}


def measure(spec: dict) -> dict:
    job = {k: v for k, v in spec.items()
           if k not in ("loss_impl", "activation_offloading", "optimizer_in_backward")}
    proc = subprocess.run([sys.executable, str(HERE / "tune_step.py"), str(SRC), json.dumps(job),
                           json.dumps(tune_flags(spec))], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimate(spec: dict) -> dict:
    import vramplan
    est = vramplan.estimate(vramplan.load_spec(spec))
    return {"peak_bytes": est.peak_allocated_bytes, "peak_phase": est.peak_phase,
            "phase_peaks": {"fwd": est.phases["forward"], "bwd": est.phases["backward"],
                            "opt": est.phases["optimizer"]}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    out = []
    for name, fields in CASES.items():
        if args.only not in name:
            continue
        spec = {**BASE, **fields}
        meas, est = measure(spec), estimate(spec)
        err = est["peak_bytes"] / meas["peak_bytes"] - 1
        phases = {k: round(est["phase_peaks"][k] / meas["phase_peaks"][k] - 1, 4) for k in meas["phase_peaks"]}
        print(f"{name:34s} measured {meas['peak_bytes']:>10,} ({meas['peak_phase']})  estimated "
              f"{est['peak_bytes']:>10,} ({est['peak_phase']})  {err:+.2%}  phases {phases}")
        out.append({"case": name, "spec": spec, "measured": meas, "estimated": est,
                    "peak_error": round(err, 5), "phase_errors": phases})
    (HERE / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
