"""diffusers' example LoRA training steps (measure/diffusers_step.py) measured on CPU under
the exact meter and estimated with `stack: diffusers-scripts`.

    python bench/diffusers/run.py [--only SUBSTRING] [--estimate-only]

Each case runs in a fresh process through `vramplan.measure.measure` (which picks the
diffusers runner for these jobs; the result names it: `runner.library == "diffusers"`), two
training steps on tiny random-init pipelines built from the real classes (diffusers 0.42.1
CogVideoXTransformer3DModel, AutoencoderKLCogVideoX, UNet2DConditionModel, AutoencoderKL,
ControlNetModel; transformers T5EncoderModel, CLIPTextModel, CLIPTextModelWithProjection; PEFT
LoRA; accelerate): the LoRA scripts (CogVideoX, SD, SDXL) and train_controlnet.py. Results go to
results.json and are printed as a table: the peak and each phase (forward, backward,
optimizer) against the estimate.
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

# A tiny CogVideoX pipeline (num_params: the real classes' counts, tests/test_diffusers_step.py).
COGVIDEOX = {
    "name": "tiny-cogvideox", "kind": "video-dit",
    "denoiser": {"class": "CogVideoXTransformer3DModel", "num_layers": 2, "num_attention_heads": 4,
                 "attention_head_dim": 32, "in_channels": 4, "out_channels": 4, "patch_size": 2,
                 "text_embed_dim": 64, "max_text_seq_length": 16, "time_embed_dim": 64, "num_params": 638608},
    "vae": {"class": "AutoencoderKLCogVideoX", "block_out_channels": [16, 32, 32, 32], "layers_per_block": 1,
            "latent_channels": 4, "norm_num_groups": 8, "temporal_compression_ratio": 4,
            "spatial_compression": 8, "temporal_compression": 4, "num_params": 825019},
    "text_encoders": [{"role": "t5", "class": "T5EncoderModel", "d_model": 64, "num_layers": 2, "num_heads": 2,
                       "d_kv": 32, "d_ff": 128, "max_tokens": 16, "vocab_size": 1000, "num_params": 146304}]}
# A tiny Stable Diffusion pipeline: UNet2DConditionModel (32/64 channels, one CrossAttn level
# each way and the mid block's attention), AutoencoderKL (4 levels, 16 channels first),
# CLIPTextModel (2 layers, 77 tokens).
SD = {
    "name": "tiny-sd", "kind": "unet",
    "denoiser": {"class": "UNet2DConditionModel", "in_channels": 4, "out_channels": 4, "block_out_channels": [32, 64],
                 "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                 "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "layers_per_block": 2,
                 "attention_head_dim": 8, "cross_attention_dim": 32, "norm_num_groups": 8, "sample_size": 32,
                 "num_params": 1106212},
    "vae": {"class": "AutoencoderKL", "block_out_channels": [16, 32, 32, 32],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 8, "spatial_compression": 8,
            "temporal_compression": 1, "num_params": 316695},
    "text_encoders": [{"role": "clip_l", "class": "CLIPTextModel", "d_model": 32, "num_layers": 2, "num_heads": 4,
                       "d_ff": 64, "max_tokens": 77, "vocab_size": 1000, "num_params": 51616}]}
# A tiny SDXL pipeline: SDXL's UNet layout (a plain first level, a CrossAttn level two
# transformer layers deep, added conditioning `text_time`: CLIP-G's pooled embedding and six
# size/crop ids), the SD VAE above, CLIPTextModel (32 wide) and CLIPTextModelWithProjection
# (64 wide, projection 64), whose penultimate states concatenate to the UNet's 96.
SDXL = {
    "name": "tiny-sdxl", "kind": "unet",
    "denoiser": {"class": "UNet2DConditionModel", "in_channels": 4, "out_channels": 4, "block_out_channels": [32, 64],
                 "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                 "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "layers_per_block": 2,
                 "transformer_layers_per_block": [1, 2], "attention_head_dim": [2, 4], "cross_attention_dim": 96,
                 "norm_num_groups": 8, "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
                 "projection_class_embeddings_input_dim": 112, "use_linear_projection": True, "sample_size": 32,
                 "num_params": 2029764},
    "vae": SD["vae"],
    "text_encoders": [SD["text_encoders"][0],
                      {"role": "clip_g", "class": "CLIPTextModelWithProjection", "d_model": 64, "num_layers": 2,
                       "num_heads": 4, "d_ff": 128, "max_tokens": 77, "vocab_size": 1000, "projection_dim": 64,
                       "num_params": 140096}]}
# The same SD pipeline with a ControlNet (ControlNetModel.from_unet: conditioning embedding
# 16/32/96/256, 962,864 parameters) for examples/controlnet/train_controlnet.py.
SD_CONTROLNET = {**SD, "name": "tiny-sd-controlnet",
                 "controlnet": {"conditioning_embedding_out_channels": [16, 32, 96, 256], "num_params": 962864}}
# The SD pipeline with the VAE's tile at 128 px (AutoencoderKL reads tile_sample_min_size from
# its config's sample_size), so that `enable_tiling()` splits a 256 px image into 3 x 3 tiles.
SD_TILE128 = {**SD, "name": "tiny-sd-tile128", "vae": dict(SD["vae"], sample_size=128)}
BASE = {"task": "diffusion", "stack": "diffusers-scripts", "method": "lora", "lora": {"r": 8},
        "micro_batch_size": 2, "optimizer": "adamw", "optimizer_impl": "foreach", "backend": "cpu"}
VIDEO = {"height": 128, "width": 128, "num_frames": 9}


def cases() -> dict[str, dict]:
    out = {}
    for prec in ("fp32", "bf16"):
        out[f"cogvideox-lora/{prec}"] = {**BASE, "model": COGVIDEOX, "precision": prec, "diffusion": dict(VIDEO)}
    out["cogvideox-lora/bf16/latents-precomputed"] = {
        **BASE, "model": COGVIDEOX, "precision": "bf16", "diffusion": {**VIDEO, "vae": "precomputed"}}
    out["cogvideox-lora/fp32/b4-gc"] = {**BASE, "model": COGVIDEOX, "precision": "fp32", "micro_batch_size": 4,
                                        "gradient_checkpointing": "full", "diffusion": dict(VIDEO)}
    for prec in ("fp32", "bf16"):
        out[f"sd-lora/{prec}"] = {**BASE, "model": SD, "precision": prec,
                                  "diffusion": {"height": 256, "width": 256, "num_frames": 1}}
    for prec in ("fp32", "bf16"):
        out[f"sd-controlnet/{prec}"] = {**{k: v for k, v in BASE.items() if k != "lora"}, "method": "full",
                                        "model": SD_CONTROLNET, "precision": prec,
                                        "diffusion": {"height": 256, "width": 256, "num_frames": 1, "controlnet": True}}
    for prec in ("fp32", "bf16"):
        out[f"sdxl-lora/{prec}"] = {**BASE, "model": SDXL, "precision": prec,
                                    "diffusion": {"height": 256, "width": 256, "num_frames": 1}}
    for mode in ("tiling", "slicing"):  # the VAE encode in the step, tiled / one sample at a time
        out[f"sd-lora/fp32/vae-{mode}"] = {**BASE, "model": SD_TILE128, "precision": "fp32",
                                           "diffusion": {"height": 256, "width": 256, "num_frames": 1,
                                                         f"vae_{mode}": True}}
    return out


def measure(job: dict) -> dict:
    code = ("import json, sys; from vramplan.measure import measure; "
            "print(json.dumps(measure(json.loads(sys.argv[1])).to_dict()))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True,
                         timeout=1200, check=True, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(job: dict, measured: dict) -> dict:
    import vramplan
    e = vramplan.estimate(job)
    errors = {"peak": e.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1}
    for kind, value in measured["phases"].items():
        if value:
            errors[kind] = e.phases.get(kind, 0) / value - 1
    estimate = {"peak_allocated_bytes": e.peak_allocated_bytes, "phases": e.phases}
    # the VAE encode inside the step (measured as its own phase, s{n}.encode) against the
    # estimate's `vae forward` event: its peak, whether or not it is the step's
    encode = [v for k, v in measured.get("phase_peaks", {}).items() if k.endswith(".encode") and k != "s0.encode"]
    vae = [ev.total for ev in e.events if ev.label.startswith("vae forward")]
    if encode and vae:
        estimate["encode"] = vae[0]
        errors["encode"] = vae[0] / max(encode) - 1
    return {"job": job, "measured": measured, "estimate": estimate,
            "errors": {k: round(v, 4) for k, v in errors.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--estimate-only", action="store_true", help="re-estimate the committed measurements")
    args = ap.parse_args()
    path = HERE / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name, job in cases().items():
        if args.only not in name:
            continue
        measured = results[name]["measured"] if args.estimate_only and name in results else measure(job)
        results[name] = row(job, measured)
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{'case':42s} {'measured':>12s} {'estimate':>12s}  peak   fwd    bwd    opt   runner")
    for name, r in results.items():
        err = r["errors"]
        runner = r["measured"].get("runner", {})
        print(f"{name:42s} {r['measured']['peak_allocated_bytes']:>12d} {r['estimate']['peak_allocated_bytes']:>12d} "
              f"{err['peak']:+.2%} {err.get('forward', 0):+.2%} {err.get('backward', 0):+.2%} "
              f"{err.get('optimizer', 0):+.2%}  {runner.get('library')} {runner.get('version')}"
              + (f"  encode {err['encode']:+.2%}" if "encode" in err else ""))


if __name__ == "__main__":
    main()
