"""Measured vs estimated peaks of multi-model jobs (DPO, distillation, reward model,
vision-language: a tiny LLaVA through vramplan.measure.vlm; GRPO with generation through
vramplan.measure.rl; tiny CogVideoX, Flux, SD3 and Wan 2.1 denoisers, the diffusers 0.42.1
classes, through vramplan.measure.diffusion).

    python bench/jobs/run.py [--only SUBSTRING] [--estimate-only]

Each case is measured in a fresh process with vramplan.measure.jobs.measure_job (exact
CPU meter, small random-init Llama models, two optimizer steps) and estimated with
vramplan.estimate; results go to bench/jobs/results.json and are printed as a table.
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

LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
LLAMA_GQA = dict(LLAMA, hidden_size=384, intermediate_size=1024, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=2)
TEACHER = dict(LLAMA, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
               num_attention_heads=8, num_key_value_heads=8)
# logprob_head "full": the hand-written DPO/IPO steps of vramplan.measure.jobs compute TRL 0.x's
# full-logits head (get_batch_logps); TRL 1.x's chunked head is measured on the real trainers
# in bench/trainers.
BASE = {"model": LLAMA, "micro_batch_size": 2, "seq_len": 256, "optimizer": "adamw",
        "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu", "logprob_head": "full"}
LORA = {"method": "lora", "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}
# A tiny LLaVA: CLIP vision tower (3 layers, 112 px, patch 14 -> 64 visual tokens), Llama LM.
LLAVA_TEXT = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 1024, "tie_word_embeddings": False}
LLAVA_VISION = {"model_type": "clip_vision_model", "hidden_size": 96, "intermediate_size": 384,
                "num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 112, "patch_size": 14,
                "projection_dim": 64}
LLAVA = {"model_type": "llava", "text_config": LLAVA_TEXT, "vision_config": LLAVA_VISION, "image_token_id": 2047,
         "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu"}
VLM = {"task": "sft", "model": LLAVA, "seq_len": 64}
# Tiny Qwen2-VL / Qwen2.5-VL (transformers qwen2_vl, qwen2_5_vl): native-resolution towers on
# flat patch sequences, a 2x2 patch merger, M-RoPE in a Qwen2 language model (GQA, q/k/v bias).
# A 224 x 336 image -> smart_resize keeps it -> 16 x 24 patches -> 96 language-model tokens.
QWEN_TEXT = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}}
QWEN_IDS = {"image_token_id": 2040, "video_token_id": 2041, "vision_start_token_id": 2042, "vision_end_token_id": 2043}
QWEN2_VL = {"model_type": "qwen2_vl", "text_config": QWEN_TEXT, **QWEN_IDS,
            "vision_config": {"depth": 2, "embed_dim": 64, "num_heads": 4, "mlp_ratio": 4, "hidden_size": 128}}
QWEN25_VL = {"model_type": "qwen2_5_vl", "text_config": QWEN_TEXT, **QWEN_IDS,
             "vision_config": {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                               "out_hidden_size": 128, "window_size": 112, "fullatt_block_indexes": [1, 3]}}
QIMG = {"num_images": 1, "image_height": 224, "image_width": 336}
QVL = {"task": "sft", "seq_len": 32}
# Tiny InternVL (transformers internvl): InternViT (class token, layer scale) on 224 px tiles,
# pixel shuffle 2x2 -> 64 tokens per tile, a Qwen2 language model. A 224 x 448 image -> a 2 x 1
# tile grid + the thumbnail = 3 tiles = 192 tokens.
INTERNVL_TEXT = {"model_type": "qwen2", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 344,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 4096}
INTERNVL = {"model_type": "internvl", "text_config": INTERNVL_TEXT, "image_token_id": 2040, "tie_word_embeddings": False,
            "vision_config": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                              "intermediate_size": 256, "image_size": 224, "patch_size": 14, "attention_bias": True}}
IVL_IMG = {"num_images": 1, "image_height": 224, "image_width": 448}
# GRPO: micro_batch_size completions (micro_batch_size / num_generations prompts of seq_len
# tokens), generated to max_new_tokens with the KV cache, then reference and policy log-probs.
# Diffusion: a tiny CogVideoX-style transformer (2 blocks, h 128, qk LayerNorm, joint text +
# video attention) on precomputed latents (9 frames -> 3 latent frames, 256 px / 8 / patch 2)
# and text embeddings; an inline pipeline (num_params: the built model's count, checked).
TINY_COG = {"name": "tiny-cogvideox", "kind": "video-dit",
            "denoiser": {"class": "CogVideoXTransformer3DModel", "num_layers": 2, "num_attention_heads": 4,
                         "attention_head_dim": 32, "in_channels": 4, "out_channels": 4, "patch_size": 2,
                         "text_embed_dim": 64, "max_text_seq_length": 16, "time_embed_dim": 64,
                         "num_params": 638608},
            "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 4, "num_params": 0},
            "text_encoders": [{"role": "t5", "d_model": 64, "max_tokens": 16, "num_heads": 1, "d_ff": 64,
                               "num_params": 0}]}
DIT = {"task": "diffusion", "model": TINY_COG,
       "diffusion": {"height": 256, "width": 256, "num_frames": 9, "text_encoders": "precomputed",
                     "vae": "precomputed"}}
# Flux, SD3 and Wan 2.1: the diffusers classes at tiny sizes (2 blocks each kind, h 128), 256 px
# (Flux: 2x2-packed 32x32 latents -> 256 image + 16 T5 tokens; SD3: patch 2 -> 256 + 24 joint
# tokens; Wan: 9 frames -> 3 latent frames x 16 x 16 = 768 tokens, 16 umT5 tokens by cross-attention).
# num_params: the class built from these fields (checked by measure_diffusion).
_TE = [{"role": "t5", "joins_sequence": True, "d_model": 64, "max_tokens": 16, "num_heads": 1, "d_ff": 64, "num_params": 0}]
_CLIP = {"role": "clip_l", "d_model": 32, "max_tokens": 8, "num_heads": 1, "d_ff": 32, "num_params": 0}
TINY_FLUX = {"name": "tiny-flux", "kind": "mmdit",
             "denoiser": {"class": "FluxTransformer2DModel", "num_layers": 2, "num_single_layers": 2,
                          "num_attention_heads": 4, "attention_head_dim": 32, "in_channels": 16, "patch_size": 1,
                          "latent_packing": 2, "joint_attention_dim": 64, "pooled_projection_dim": 32,
                          "guidance_embeds": True, "axes_dims_rope": [8, 12, 12], "num_params": 1847184},
             "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 1, "num_params": 0},
             "text_encoders": [_CLIP] + _TE}
TINY_SD3 = {"name": "tiny-sd3", "kind": "mmdit",
            "denoiser": {"class": "SD3Transformer2DModel", "num_layers": 2, "num_attention_heads": 4,
                         "attention_head_dim": 32, "in_channels": 4, "out_channels": 4, "patch_size": 2,
                         "joint_attention_dim": 64, "caption_projection_dim": 128, "pooled_projection_dim": 32,
                         "sample_size": 32, "pos_embed_max_size": 32, "num_params": 1088784},
            "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 1, "num_params": 0},
            "text_encoders": [dict(_CLIP, joins_sequence=True, d_model=64)] + _TE}
# SD3.5 (large): the SD3 transformer with RMSNorm on q and k of both streams (qk_norm
# "rms_norm": JointAttnProcessor2_0's norm_q / norm_k / norm_added_q / norm_added_k).
TINY_SD35 = {**TINY_SD3, "name": "tiny-sd3.5",
             "denoiser": dict(TINY_SD3["denoiser"], qk_norm="rms_norm", num_params=1089040)}
# SD3.5-medium: MMDiT-X, its first block(s) with a second, image-only attention (attn2) beside the
# joint one (dual_attention_layers; SD35AdaLayerNormZeroX's 9 modulation chunks).
TINY_SD35_MEDIUM = {**TINY_SD35, "name": "tiny-sd3.5-medium",
                    "denoiser": dict(TINY_SD35["denoiser"], dual_attention_layers=[0], num_params=1204688)}
# FLUX.1-schnell: Flux without the guidance embedder (guidance_embeds False; no `guidance` input).
TINY_FLUX_SCHNELL = {**TINY_FLUX, "name": "tiny-flux-schnell",
                     "denoiser": dict(TINY_FLUX["denoiser"], guidance_embeds=False, num_params=1797776)}
TINY_WAN = {"name": "tiny-wan", "kind": "cross-dit",
            "denoiser": {"class": "WanTransformer3DModel", "num_layers": 2, "num_attention_heads": 4,
                         "attention_head_dim": 32, "in_channels": 4, "out_channels": 4, "patch_size": [1, 2, 2],
                         "text_dim": 64, "freq_dim": 32, "ffn_dim": 256, "num_params": 548240},
            "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 4, "num_params": 0},
            "text_encoders": _TE}
# SDXL's UNet layout at tiny size: a plain down level, a cross-attention level with 2
# transformer layers, the mid block, the up path; CLIP states of 16 tokens and the pooled
# text + size ids (addition_embed_type text_time).
TINY_SDXL = {"name": "tiny-sdxl", "kind": "unet",
             "denoiser": {"class": "UNet2DConditionModel", "in_channels": 4, "out_channels": 4,
                          "block_out_channels": [32, 64], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                          "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "layers_per_block": 2,
                          "transformer_layers_per_block": [1, 2], "attention_head_dim": [2, 4],
                          "cross_attention_dim": 64, "norm_num_groups": 8, "addition_embed_type": "text_time",
                          "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 80,
                          "use_linear_projection": True, "num_params": 1976516},
             "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 1, "num_params": 0},
             "text_encoders": [dict(_CLIP, max_tokens=16), dict(_CLIP, role="clip_g", max_tokens=16)]}
# Class-conditional DiT (diffusers DiTTransformer2DModel, DiT-XL-2-256's config at 2 layers of
# h 128: adaLN-Zero blocks with their own timestep + class-label embedding, GELU-tanh MLP, learned
# sigma: 8 output channels); 256 px -> 32 x 32 latents / patch 2 = 256 tokens, no text.
TINY_DIT = {"name": "tiny-dit", "kind": "dit",
            "denoiser": {"class": "DiTTransformer2DModel", "num_layers": 2, "num_attention_heads": 4,
                         "attention_head_dim": 32, "in_channels": 4, "out_channels": 8, "patch_size": 2,
                         "sample_size": 32, "num_embeds_ada_norm": 1000, "norm_type": "ada_norm_zero",
                         "activation_fn": "gelu-approximate", "qk_norm": False, "num_params": 988064},
            "vae": {"latent_channels": 4, "spatial_compression": 8, "temporal_compression": 1, "num_params": 0},
            "text_encoders": []}
IMG = {"task": "diffusion", "diffusion": {"height": 256, "width": 256, "num_frames": 1, "text_encoders": "precomputed",
                                          "vae": "precomputed"}}
WAN = {"task": "diffusion", "model": TINY_WAN, "diffusion": dict(IMG["diffusion"], num_frames=9)}
# PPO (TRL PPOTrainer, measure/ppo.py): actor + critic trained, reference + reward frozen.
PPO = {"task": "ppo", "micro_batch_size": 4, "seq_len": 64, "max_new_tokens": 32, "reward_model": LLAMA}
GRPO = {"task": "grpo", "micro_batch_size": 8, "seq_len": 64, "num_generations": 4, "max_new_tokens": 32,
        "logprob_head": "selective"}  # measure/rl.py: TRL 0.x selective_log_softmax


def case(name: str, **fields) -> tuple[str, dict]:
    # The hand-written steps (measure/jobs.py, rl.py, ppo.py, diffusion.py) build the model
    # in the precision's dtype and run it without autocast: a 16-bit case is pure 16-bit,
    # which the spec says as `pure-bf16` (plain `bf16` means the stack's own, autocast on the
    # default HF Trainer stack; components/dtypes.py).
    if fields.get("precision") in ("bf16", "fp16"):
        fields["precision"] = "pure-" + fields["precision"]
    return name, {**BASE, **fields}


CASES = dict([
    case("dpo/bf16/full/ref-same", task="dpo", precision="bf16"),
    case("dpo/fp32/full/ref-same", task="dpo", precision="fp32"),
    case("dpo/bf16/lora/adapter-disabled", task="dpo", precision="bf16", **LORA),
    case("dpo/bf16/full/ref-precomputed", task="dpo", precision="bf16", reference_model="precomputed"),
    case("dpo/bf16/full/ref-gqa-3l/gc", task="dpo", precision="bf16", model=LLAMA_GQA,
         reference_model=dict(LLAMA_GQA, num_hidden_layers=2), gradient_checkpointing="full"),
    case("ipo/bf16/full/b1s512", task="ipo", precision="bf16", micro_batch_size=1, seq_len=512),
    case("distill/bf16/full/teacher-6l", task="distill", precision="bf16", teacher=TEACHER),
    case("distill/fp32/full/teacher-6l", task="distill", precision="fp32", teacher=TEACHER),
    case("reward-model/bf16/full", task="reward-model", precision="bf16"),
    case("reward-model/fp32/full/b4", task="reward-model", precision="fp32", micro_batch_size=4),
    case("vlm/fp32/full/tower-frozen", **VLM, precision="fp32", vision={"num_images": 1, "freeze_vision_tower": True}),
    case("vlm/fp32/full/tower-trained", **VLM, precision="fp32", vision={"num_images": 1, "freeze_vision_tower": False}),
    case("vlm/bf16/full/tower-trained", **VLM, precision="bf16", vision={"num_images": 1, "freeze_vision_tower": False}),
    case("vlm/bf16/lora/tower-frozen/2img", **VLM, precision="bf16", **LORA,
         vision={"num_images": 2, "freeze_vision_tower": True}),
    case("qwen2-vl/fp32/full/tower-trained", **QVL, model=QWEN2_VL, precision="fp32",
         vision={**QIMG, "freeze_vision_tower": False}),
    case("qwen2-vl/fp32/full/tower-frozen", **QVL, model=QWEN2_VL, precision="fp32",
         vision={**QIMG, "freeze_vision_tower": True}),
    case("qwen2-vl/bf16/lora/tower-frozen/2img", **QVL, model=QWEN2_VL, precision="bf16", **LORA,
         vision={**QIMG, "num_images": 2, "freeze_vision_tower": True}),
    case("qwen2-vl/fp32/full/video-8f", **QVL, model=QWEN2_VL, precision="fp32",
         vision={"num_images": 0, "num_videos": 1, "video_frames": 8, "image_size": 112, "video_min_pixels": 3136,
                 "freeze_vision_tower": False}),
    case("qwen2.5-vl/fp32/full/tower-trained", **QVL, model=QWEN25_VL, precision="fp32",
         vision={**QIMG, "freeze_vision_tower": False}),
    case("qwen2.5-vl/bf16/full/tower-trained", **QVL, model=QWEN25_VL, precision="bf16",
         vision={**QIMG, "freeze_vision_tower": False}),
    case("qwen2.5-vl/bf16/lora/tower-frozen", **QVL, model=QWEN25_VL, precision="bf16", **LORA,
         vision={**QIMG, "freeze_vision_tower": True}),
    case("qwen2.5-vl/fp32/full/image+video", **QVL, model=QWEN25_VL, precision="fp32",
         vision={**QIMG, "num_videos": 1, "video_frames": 4, "video_height": 112, "video_width": 112,
                 "video_min_pixels": 3136, "freeze_vision_tower": False}),
    case("internvl/fp32/full/tower-trained", **QVL, model=INTERNVL, precision="fp32",
         vision={**IVL_IMG, "freeze_vision_tower": False}),
    case("internvl/bf16/full/tower-trained", **QVL, model=INTERNVL, precision="bf16",
         vision={**IVL_IMG, "freeze_vision_tower": False}),
    case("internvl/bf16/lora/tower-frozen", **QVL, model=INTERNVL, precision="bf16", **LORA,
         vision={**IVL_IMG, "freeze_vision_tower": True}),
    case("internvl/fp32/full/rms-qknorm/1tile", **QVL, precision="fp32",
         model={**INTERNVL, "vision_config": {**INTERNVL["vision_config"], "norm_type": "rms_norm", "use_qk_norm": True,
                                              "attention_bias": False}},
         vision={"num_images": 2, "image_size": 224, "max_tiles": 1, "freeze_vision_tower": False}),
    case("qwen2.5-vl/fp32/full/tower-trained/gc", **QVL, model=QWEN25_VL, precision="fp32", gradient_checkpointing="full",
         vision={"num_images": 1, "image_size": 448, "freeze_vision_tower": False}),
    case("qwen2-vl/bf16/full/tower-trained/gc", **QVL, model=QWEN2_VL, precision="bf16", gradient_checkpointing="full",
         vision={**QIMG, "freeze_vision_tower": False}),
    case("internvl/fp32/full/tower-trained/gc", **QVL, model=INTERNVL, precision="fp32", gradient_checkpointing="full",
         vision={**IVL_IMG, "freeze_vision_tower": False}),
    case("vlm/fp32/full/tower-trained/gc", **VLM, precision="fp32", gradient_checkpointing="full",
         vision={"num_images": 1, "freeze_vision_tower": False}),
    case("ppo/fp32/full/c32", **PPO, precision="fp32"),
    case("generic/bf16/full/judge-frozen-6l", models=[{"role": "judge", "model": TEACHER}], precision="bf16"),
    case("ppo/bf16/full/c64", **dict(PPO, max_new_tokens=64), precision="bf16"),
    case("grpo/bf16/full/g4-c128", **dict(GRPO, max_new_tokens=128), precision="bf16"),
    case("grpo/bf16/full/g4-c32", **GRPO, precision="bf16"),
    case("grpo/fp32/full/g4-c32", **GRPO, precision="fp32"),
    case("grpo/bf16/lora/adapter-disabled", **GRPO, precision="bf16", **LORA),
    case("grpo/bf16/full/gqa-ref-2l/g8-c48", **dict(GRPO, seq_len=32, num_generations=8, max_new_tokens=48),
         precision="bf16", model=LLAMA_GQA, reference_model=dict(LLAMA_GQA, num_hidden_layers=2)),
    case("diffusion/fp32/full/cogvideox-tiny", **DIT, precision="fp32"),
    case("diffusion/bf16/full/cogvideox-tiny", **DIT, precision="bf16"),
    case("diffusion/bf16/lora/cogvideox-tiny", **DIT, precision="bf16", method="lora", lora={"r": 8}),
    case("diffusion/fp32/full/cogvideox-tiny/frozen-copy", **dict(DIT, diffusion=dict(DIT["diffusion"], frozen_copy=True)),
         precision="fp32"),
    case("diffusion/fp32/full/cogvideox-tiny/128px", **dict(DIT, diffusion=dict(DIT["diffusion"], height=128, width=128)),
         precision="fp32"),
    case("diffusion/fp32/full/flux-tiny", **IMG, model=TINY_FLUX, precision="fp32"),
    case("diffusion/bf16/lora/flux-tiny", **IMG, model=TINY_FLUX, precision="bf16", method="lora", lora={"r": 8}),
    case("diffusion/fp32/full/sd3-tiny", **IMG, model=TINY_SD3, precision="fp32"),
    case("diffusion/fp32/full/wan-tiny", **WAN, precision="fp32"),
    case("diffusion/fp32/lora/wan-tiny", **WAN, precision="fp32", method="lora", lora={"r": 8}),
    case("diffusion/bf16/lora/flux-tiny/b1-384px", **dict(IMG, diffusion=dict(IMG["diffusion"], height=384, width=384)),
         model=TINY_FLUX, precision="bf16", method="lora", lora={"r": 8}, micro_batch_size=1),
    case("diffusion/bf16/lora/flux-tiny/gc", **IMG, model=TINY_FLUX, precision="bf16", method="lora", lora={"r": 8},
         gradient_checkpointing="full"),
    case("diffusion/fp32/full/wan-tiny/gc", **WAN, precision="fp32", gradient_checkpointing="full"),
    case("diffusion/fp32/full/sdxl-unet-tiny", **IMG, model=TINY_SDXL, precision="fp32"),
    case("diffusion/bf16/lora/sd3-tiny", **IMG, model=TINY_SD3, precision="bf16", method="lora", lora={"r": 8}),
    case("diffusion/bf16/full/wan-tiny", **WAN, precision="bf16"),
    case("diffusion/bf16/lora/sd3-tiny/gc", **IMG, model=TINY_SD3, precision="bf16", method="lora", lora={"r": 8},
         gradient_checkpointing="full"),
    case("diffusion/fp32/full/flux-tiny/gc", **IMG, model=TINY_FLUX, precision="fp32", gradient_checkpointing="full"),
    case("diffusion/fp32/full/flux-tiny/prior-preservation", **dict(IMG, diffusion=dict(IMG["diffusion"], prior_preservation=True)),
         model=TINY_FLUX, precision="fp32", micro_batch_size=1),
    case("diffusion/fp32/full/dit-tiny", **IMG, model=TINY_DIT, precision="fp32"),
    case("diffusion/bf16/full/dit-tiny", **IMG, model=TINY_DIT, precision="bf16"),
    case("diffusion/fp32/full/dit-tiny/b4-384px", **dict(IMG, diffusion=dict(IMG["diffusion"], height=384, width=384)),
         model=TINY_DIT, precision="fp32", micro_batch_size=4),
    case("grpo/bf16/full/gc/b4", **dict(GRPO, micro_batch_size=4), precision="bf16", gradient_checkpointing="full"),
    # Wan LoRA with PEFT's fp32 adapters on a bf16 base, with and without checkpointing, and
    # fp32 under checkpointing (jobs/diffusion_wan.py; Wan's frozen norm_out in backward).
    # Estimate error before -> after (peak; forward, backward): bf16/gc -10.68% -> -0.23%
    # (-28.33%, -10.68% -> -0.25%, -0.23%); bf16 -3.74% -> -0.05% (-7.53%, +2.31% ->
    # -0.05%, -0.34%); fp32/gc -4.72% -> -0.25% (-9.28%, -4.72% -> -0.27%, -0.25%); and
    # bf16/full/wan-tiny's forward -4.57% -> -0.06% (its last line's fp32 residual tail).
    case("diffusion/bf16/lora/wan-tiny/gc", **WAN, precision="bf16", method="lora", lora={"r": 8},
         gradient_checkpointing="full"),
    case("diffusion/bf16/lora/wan-tiny", **WAN, precision="bf16", method="lora", lora={"r": 8}),
    case("diffusion/fp32/lora/wan-tiny/gc", **WAN, precision="fp32", method="lora", lora={"r": 8},
         gradient_checkpointing="full"),
    # Gradients alive in forward: accumulated over micro-steps, or zeroed in place by
    # zero_grad(set_to_none=False) (train_dreambooth.py's default; jobs/diffusion_scripts.py
    # grads_kept). Before, the diffusion step freed them after every step.
    case("diffusion/fp32/full/sdxl-unet-tiny/ga2", **IMG, model=TINY_SDXL, precision="fp32", grad_accum_steps=2),
    case("diffusion/fp32/full/sdxl-unet-tiny/grads-kept", **dict(IMG, diffusion=dict(IMG["diffusion"],
         set_grads_to_none=False)), model=TINY_SDXL, precision="fp32"),
    case("diffusion/fp32/full/dit-tiny/ga2", **IMG, model=TINY_DIT, precision="fp32", grad_accum_steps=2),
    case("diffusion/bf16/full/flux-tiny/grads-kept", **dict(IMG, diffusion=dict(IMG["diffusion"],
         set_grads_to_none=False)), model=TINY_FLUX, precision="bf16"),
    case("diffusion/bf16/lora/flux-tiny/ga2", **IMG, model=TINY_FLUX, precision="bf16", method="lora",
         lora={"r": 8}, grad_accum_steps=2),
    # SD3.5's q/k RMSNorm, SD3.5-medium's dual attention and Flux schnell (issue 13's generation
    # variants). Estimate error at the peak: sd3.5 fp32 full -1.49%, bf16 LoRA +0.06%;
    # sd3.5-medium fp32 full -1.31%, bf16 LoRA +0.05%, bf16 LoRA gc -0.70% (its forward phase
    # -5.01% -> +0.07% with the MMDiT-X block's no-grad locals); flux-schnell fp32 full +0.35%,
    # bf16 LoRA +0.12%.
    case("diffusion/fp32/full/sd3.5-tiny", **IMG, model=TINY_SD35, precision="fp32"),
    case("diffusion/bf16/lora/sd3.5-tiny", **IMG, model=TINY_SD35, precision="bf16", method="lora", lora={"r": 8}),
    case("diffusion/fp32/full/sd3.5-medium-tiny", **IMG, model=TINY_SD35_MEDIUM, precision="fp32"),
    case("diffusion/bf16/lora/sd3.5-medium-tiny", **IMG, model=TINY_SD35_MEDIUM, precision="bf16", method="lora",
         lora={"r": 8}),
    case("diffusion/bf16/lora/sd3.5-medium-tiny/gc", **IMG, model=TINY_SD35_MEDIUM, precision="bf16", method="lora",
         lora={"r": 8}, gradient_checkpointing="full"),
    case("diffusion/fp32/full/flux-schnell-tiny", **IMG, model=TINY_FLUX_SCHNELL, precision="fp32"),
    case("diffusion/bf16/lora/flux-schnell-tiny", **IMG, model=TINY_FLUX_SCHNELL, precision="bf16", method="lora",
         lora={"r": 8}),
])


def measure(job: dict) -> dict:
    fn = ("from vramplan.measure.vlm import measure_vlm as measure_job; " if job.get("vision") else
          "from vramplan.measure.rl import measure_grpo as measure_job; " if job.get("task") == "grpo" else
          "from vramplan.measure.ppo import measure_ppo as measure_job; " if job.get("task") == "ppo" else
          "from vramplan.measure.generic import measure_generic as measure_job; " if job.get("models") else
          "from vramplan.measure.diffusion import measure_diffusion as measure_job; " if job.get("task") == "diffusion" else
          "from vramplan.measure.jobs import measure_job; ")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); " + fn +
            "print(json.dumps(measure_job(json.loads(sys.argv[2])).to_dict()))")
    proc = subprocess.run([sys.executable, "-c", code, str(SRC), json.dumps(job)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import vramplan
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--estimate-only", action="store_true")
    args = ap.parse_args(argv)
    path = HERE / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    out = dict(old)
    for name, job in CASES.items():
        if args.only not in name:
            continue
        est = vramplan.estimate(job)
        row = {"job": job, "estimate": {"peak_allocated_bytes": est.peak_allocated_bytes,
                                        "peak_event": est.peak_event, "phases": est.phases}}
        row["measured"] = old.get(name, {}).get("measured") if args.estimate_only else measure(job)
        out[name] = row
        m = row["measured"]
        if m:
            err = est.peak_allocated_bytes / m["peak_allocated_bytes"] - 1
            print(f"{name:34} measured {m['peak_allocated_bytes']:>12} ({m['peak_phase']:6}) "
                  f"estimated {est.peak_allocated_bytes:>12} {err:+7.3%}  [{est.peak_event}]", flush=True)
            phases = {k: f"{est.phases[k] / v - 1:+.2%}" for k, v in m["phases"].items() if v and k in est.phases}
            print(f"{'':34} per phase: {phases}", flush=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
