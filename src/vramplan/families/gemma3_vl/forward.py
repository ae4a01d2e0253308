"""Gemma 3's SigLIP tower end and multi-modal projector on the symbolic recorder.

Mirrors transformers 5.24 models/siglip/modeling_siglip.py SiglipVisionModel.forward (the
layers are components/arch_vit.py's vit_embed / vit_layer: SigLIP has no class token and no
pre-norm) and models/gemma3/modeling_gemma3.py Gemma3MultiModalProjector.forward.
Legend: n images, t = g^2 patches, e width, f MLP width, k^2 tokens per image, H LM width.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch import rms_norm
from vramplan.components.graph import Param, Recorder, Sym
from vramplan.families.common import TowerCtx
from vramplan.families.gemma3_vl.vision import Gemma3VisionDesc
from vramplan.units import nbytes


def projector(rec: Recorder, ctx: TowerCtx, x: Sym) -> Sym:
    """post_layernorm (saves its input, mean and rstd), then the projector: transpose and
    reshape are views, `.contiguous()` copies (n, e, g, g) (nothing saved), AvgPool2d saves
    that copy (avg_pool2d_backward takes `self`), flatten + transpose are views,
    mm_soft_emb_norm is Gemma's RMSNorm (x.float(), x_hat * (1 + w), .type_as(x)), and
    torch.matmul with the (e, H) parameter saves the normed input when the weight trains."""
    vis = ctx.vis
    n, t, e = x.shape
    g, k = vis.patches_per_side, vis.tokens_per_side
    h = rec.layer_norm(x, ctx.p("post_layernorm.weight"), "vision/post_layernorm")
    h = rec.new("projector/transposed_contiguous", (n, e, g, g), h.dtype, h.requires_grad)
    if h.requires_grad:
        rec.save(h)
    pooled = rec.view(rec.new("projector/avg_pool", (n, e, k, k), h.dtype, h.requires_grad), (n, k * k, e))
    normed = rms_norm(rec, ctx, pooled, "mm_soft_emb_norm", "projector/mm_soft_emb_norm")
    w = ctx.p("mm_input_projection_weight")
    return rec.linear(normed, Param(w.name, (vis.text_hidden, e), w.dtype, w.trainable), name="projector/projection")


def layer_forward(vis: Gemma3VisionDesc, n: int, c: str) -> Breakdown:
    """One SiglipEncoderLayer's forward working set beyond its input when it saves nothing
    (frozen, or under checkpointing): in the attention layer_norm1's output, q, k, v, SDPA's
    output (its transpose back is already contiguous: the CPU and CUDA kernels write
    (n, t, a, d)) and out_proj's output: 6 (n, t, e); in the MLP the attention residual,
    layer_norm2's output (the caller's reference), fc1's output and the activation's:
    2 (n, t, e) + 2 (n, t, f)."""
    t, e, f = vis.patches, vis.tower.hidden_size, vis.tower.intermediate_size
    attn, mlp = 6 * nbytes(n * t * e, c), 2 * nbytes(n * t * e, c) + 2 * nbytes(n * t * f, c)
    return Breakdown().add("vision_tower/forward/layer", max(attn, mlp))


def frozen_transient(vis: Gemma3VisionDesc, n: int, c: str) -> Breakdown:
    """A frozen tower's forward (nothing requires grad, nothing saved; no hidden states are
    asked for): a layer past the first (layer_forward) with the embeddings' output
    (SiglipVisionModel.forward's local) and the layer's input (SiglipEncoder's loop
    variable; the same tensor in layer 0) alive."""
    held = 2 if vis.tower.num_layers > 1 else 1
    return layer_forward(vis, n, c).add("vision_tower/forward/held", held * nbytes(n * vis.patches * vis.tower.hidden_size, c))


def layer_backward(vis: Gemma3VisionDesc, n: int, c: str) -> Breakdown:
    """A trained layer's MLP backward: the gradient of fc2's input and the activation's
    gradient of fc1's output (gelu_backward) are alive together after fc2's node has freed
    its saved input: one (n, t, f) beyond the layer's saved set."""
    return Breakdown().add("vision_tower/backward/mlp_gradients", nbytes(n * vis.patches * vis.tower.intermediate_size, c))


__all__ = ["frozen_transient", "layer_backward", "layer_forward", "projector"]
