"""LLaVA-OneVision's projector and feature packing on the symbolic recorder.

Mirrors transformers 5.24 models/llava_onevision/modeling_llava_onevision.py
(LlavaOnevisionModel.get_image_features, LlavaOnevisionMultiModalProjector.forward,
pack_image_features); the SigLIP layers are components/arch_vit.py's.
Legend: n tower inputs (tiles and base images of the batch), t = g^2 patches, e width,
f MLP width, H LM width.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_vit import VitCtx, vit_activation, vit_linear
from vramplan.components.graph import Recorder, Sym
from vramplan.families.llava_onevision.vision import OnevisionDesc
from vramplan.units import nbytes


def projector(rec: Recorder, ctx: VitCtx, x: Sym) -> Sym:
    """hidden_states[-1] (the last layer's output, before post_layernorm) through linear_1
    (saves it), the activation (GELU saves its input) and linear_2 (saves the activation's
    output). Its output is not saved: pack_image_features copies it (the grid's permute
    `.contiguous()`, the unpad slice, the interpolation, the newline and base-image cats)."""
    h = vit_linear(rec, ctx, x, "linear_1", "projector/linear_1")
    h = vit_activation(rec, h, ctx.vis.projector_act, "projector/act")
    return vit_linear(rec, ctx, h, "linear_2", "projector/linear_2")


def forward_end(vis: OnevisionDesc, n: int, tokens: int, trained: bool, c: str) -> Breakdown:
    """Held by the model's output (image_outputs) until the end of forward: the tower's
    last_hidden_state (post_layernorm's output: SiglipVisionModel applies it though the
    features are taken before it), with a trained tower post_layernorm's graph (its mean and
    rstd; no gradient reaches it, so it goes with the output), and the packed features
    (pooler_output, one tensor per image). hidden_states[-1] is the projector's saved input."""
    t, e = vis.side ** 2, vis.tower.hidden_size
    out = Breakdown().add("vision_tower/forward/last_hidden_state", nbytes(n * t * e, c))
    if trained:
        out.add("vision_tower/forward/post_layernorm_stats", 2 * nbytes(n * t, "fp32"))
    return out.add("projector/forward/packed_features", nbytes(tokens * vis.text_hidden, c))


def layer_forward(vis: OnevisionDesc, n: int, c: str) -> Breakdown:
    """One SiglipEncoderLayer's forward working set beyond its input when it saves nothing
    (frozen, or checkpointed): 6 (n, t, e) in the attention (layer_norm1's output, q, k, v,
    SDPA's output, out_proj's), 2 (n, t, e) + 2 (n, t, f) in the MLP (the attention residual,
    layer_norm2's output, fc1's output and the activation's)."""
    t, e, f = vis.side ** 2, vis.tower.hidden_size, vis.tower.intermediate_size
    attn, mlp = 6 * nbytes(n * t * e, c), 2 * nbytes(n * t * e, c) + 2 * nbytes(n * t * f, c)
    return Breakdown().add("vision_tower/forward/layer", max(attn, mlp))


def layer_backward(vis: OnevisionDesc, n: int, c: str) -> Breakdown:
    """A trained layer's MLP backward: the gradients of fc2's input and of fc1's output alive
    together after fc2's node freed its saved input: one (n, t, f) beyond the saved set."""
    return Breakdown().add("vision_tower/backward/mlp_gradients",
                           nbytes(n * vis.side ** 2 * vis.tower.intermediate_size, c))


__all__ = ["forward_end", "layer_backward", "layer_forward", "projector"]
