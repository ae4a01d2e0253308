"""LTX-Video, HunyuanVideo and Mochi denoisers (the diffusers 0.42.1 classes at tiny sizes)
trained one step at a time under the exact CPU meter (vramplan.measure.diffusion), against
vramplan.estimate.

    python bench/video/run.py [--only SUBSTRING] [--estimate-only]

Each case is measured in a fresh process (the meter counts every tensor alive in the
process): the real LTXVideoTransformer3DModel, HunyuanVideoTransformer3DModel or
MochiTransformer3DModel built from the inline pipeline's fields with random weights,
precomputed latents and text embeddings, two optimizer steps (AdamW, foreach), full
fine-tuning or PEFT LoRA on to_q/to_k/to_v/to_out.0. Results go to results.json beside
this script and are printed as a table: the peak and each phase against the estimate.
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

# The text states: 16 tokens of 64 features (precomputed); the VAE and text encoder are not
# built (num_params 0), only their compression factors and token counts are read.
_T5 = [{"role": "t5", "d_model": 64, "max_tokens": 16, "num_heads": 1, "d_ff": 64, "num_params": 0}]
# LTX-Video: its VAE compresses 32 x 32 pixels and 8 frames into one latent (patch 1):
# 512 px, 17 frames -> 3 x 16 x 16 = 768 video tokens; the text by cross-attention.
TINY_LTX = {"name": "tiny-ltx-video", "kind": "cross-dit",
            "denoiser": {"class": "LTXVideoTransformer3DModel", "in_channels": 8, "out_channels": 8,
                         "patch_size": 1, "patch_size_t": 1, "num_attention_heads": 4, "attention_head_dim": 32,
                         "cross_attention_dim": 128, "num_layers": 2, "caption_channels": 64,
                         "num_params": 705928},
            "vae": {"latent_channels": 8, "spatial_compression": 32, "temporal_compression": 8, "num_params": 0},
            "text_encoders": _T5}
# HunyuanVideo: dual-stream then single-stream blocks (as Flux), a token refiner over the
# text; 256 px, 9 frames -> 3 x 32 x 32 latents, patch (1, 2, 2) -> 768 video + 16 text tokens.
TINY_HUNYUAN = {"name": "tiny-hunyuanvideo", "kind": "mmdit",
                "denoiser": {"class": "HunyuanVideoTransformer3DModel", "in_channels": 4, "out_channels": 4,
                             "num_attention_heads": 4, "attention_head_dim": 32, "num_layers": 2,
                             "num_single_layers": 2, "num_refiner_layers": 1, "patch_size": 2, "patch_size_t": 1,
                             "text_embed_dim": 64, "pooled_projection_dim": 32, "rope_axes_dim": [8, 12, 12],
                             "guidance_embeds": True, "num_params": 2152720},
                "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 4, "num_params": 0},
                "text_encoders": [dict(_T5[0], role="llama", joins_sequence=True)]}
# Mochi: asymmetric joint attention (video 128 wide, text 64 wide); its VAE takes 6 frames to
# one latent: 13 frames, 256 px -> 3 x 32 x 32 latents, patch 2 -> 768 video + 16 text tokens.
TINY_MOCHI = {"name": "tiny-mochi", "kind": "mmdit",
              "denoiser": {"class": "MochiTransformer3DModel", "patch_size": 2, "num_attention_heads": 4,
                           "attention_head_dim": 32, "num_layers": 2, "pooled_projection_dim": 64, "in_channels": 4,
                           "text_embed_dim": 64, "time_embed_dim": 32, "max_sequence_length": 16,
                           "num_params": 740048},
              "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 6, "num_params": 0},
              "text_encoders": [dict(_T5[0], joins_sequence=True)]}
# Wider and deeper (8 heads, 3-4 blocks; Mochi's text stream 96 wide, Hunyuan 2 refiner
# layers), one sample of 4 latent frames (1,024 video tokens): the same mechanisms at other
# shapes than the ones they were read from.
WIDE = {
    "ltx": dict(TINY_LTX, name="wide-ltx-video", denoiser=dict(
        TINY_LTX["denoiser"], num_attention_heads=8, cross_attention_dim=256, num_layers=4, num_params=4831496)),
    "hunyuan": dict(TINY_HUNYUAN, name="wide-hunyuanvideo", denoiser=dict(
        TINY_HUNYUAN["denoiser"], num_attention_heads=8, num_layers=3, num_single_layers=3, num_refiner_layers=2,
        num_params=12609872)),
    "mochi": dict(TINY_MOCHI, name="wide-mochi", denoiser=dict(
        TINY_MOCHI["denoiser"], num_attention_heads=8, num_layers=4, pooled_projection_dim=96, num_params=5358768)),
}
WIDE_FRAMES = {"ltx": 25, "hunyuan": 13, "mochi": 19}
BASE = {"task": "diffusion", "micro_batch_size": 2, "optimizer": "adamw", "optimizer_impl": "foreach",
        "backend": "cpu"}
SIZES = {"ltx": (TINY_LTX, {"height": 512, "width": 512, "num_frames": 17}),
         "hunyuan": (TINY_HUNYUAN, {"height": 256, "width": 256, "num_frames": 9}),
         "mochi": (TINY_MOCHI, {"height": 256, "width": 256, "num_frames": 13})}


def case(model: str, precision: str, method: str, wide: bool = False, **extra) -> tuple[str, dict]:
    """One job: measure/diffusion.py builds the model in the precision's dtype and runs it
    without autocast, so a 16-bit case is pure 16-bit (`pure-bf16` in the spec)."""
    pipe, size = SIZES[model]
    if wide:
        pipe, size = WIDE[model], dict(size, num_frames=WIDE_FRAMES[model])
    diffusion = {**size, "text_encoders": "precomputed", "vae": "precomputed", **extra.pop("diffusion", {})}
    job = {**BASE, "model": pipe, "diffusion": diffusion, "method": method,
           "precision": "pure-bf16" if precision == "bf16" else precision, **extra}
    if method == "lora":
        job["lora"] = {"r": 8}
    tail = ("/wide" if wide else "") + ("/gc" if extra.get("gradient_checkpointing") else "") + (
        f"/b{extra['micro_batch_size']}" if "micro_batch_size" in extra else "")
    return f"{model}/{precision}/{method}{tail}", job


CASES = dict([case(m, p, meth) for m in SIZES for p, meth in (("fp32", "full"), ("bf16", "lora"), ("fp32", "lora"))]
             + [case(m, "bf16", "full", gradient_checkpointing="full") for m in SIZES]
             # one sample: the joint attention's slices are views, not copies (b > 1)
             + [case(m, "fp32", "lora", micro_batch_size=1) for m in SIZES]
             + [case("ltx", "bf16", "lora", wide=True, micro_batch_size=1),
                case("hunyuan", "bf16", "lora", wide=True, micro_batch_size=1),
                case("mochi", "fp32", "full", wide=True, micro_batch_size=1)])


def measure(job: dict) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from vramplan.measure.diffusion import measure_diffusion; "
            "print(json.dumps(measure_diffusion(json.loads(sys.argv[2])).to_dict()))")
    proc = subprocess.run([sys.executable, "-c", code, str(SRC), json.dumps(job)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def errors(est, measured: dict) -> dict:
    out = {"peak": est.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1}
    out.update({k: est.phases.get(k, 0) / v - 1 for k, v in measured["phases"].items() if v})
    return {k: round(v, 4) for k, v in out.items()}


def main(argv=None) -> int:
    import vramplan
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--estimate-only", action="store_true", help="re-estimate the committed measurements")
    args = ap.parse_args(argv)
    path = HERE / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name, job in CASES.items():
        if args.only not in name:
            continue
        measured = results.get(name, {}).get("measured") if args.estimate_only else measure(job)
        if not measured:
            continue
        est = vramplan.estimate(job)
        results[name] = {"job": job, "measured": measured,
                         "estimate": {"peak_allocated_bytes": est.peak_allocated_bytes, "peak_event": est.peak_event,
                                      "phases": est.phases},
                         "errors": errors(est, measured)}
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{'case':28s} {'measured':>11s} {'estimate':>11s}   peak    fwd     bwd     opt")
    for name, r in sorted(results.items()):
        e = r["errors"]
        print(f"{name:28s} {r['measured']['peak_allocated_bytes']:>11d} {r['estimate']['peak_allocated_bytes']:>11d} "
              f"{e['peak']:+.2%} {e.get('forward', 0):+.2%} {e.get('backward', 0):+.2%} {e.get('optimizer', 0):+.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
