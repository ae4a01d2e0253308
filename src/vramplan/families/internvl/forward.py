"""InternViT layers and the InternVL projector on the symbolic recorder.

Mirrors transformers 5.24 models/internvl/modeling_internvl.py. Tiles are the batch rows:
the tower runs on (n, t, e) with n tiles of the whole batch and t = g^2 + 1 tokens.
Legend: n tiles, t tokens per tile, e width, a heads, d = e / a, f MLP width, s = 1 / r.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch import rms_norm
from vramplan.components.arch_vit import vit_activation, vit_linear
from vramplan.components.graph import Recorder, Sym
from vramplan.families.common import TowerCtx, tower_norm
from vramplan.families.internvl.vision import InternVisionDesc
from vramplan.units import nbytes


def embed(rec: Recorder, ctx: TowerCtx, pixels: Sym) -> Sym:
    """InternVLVisionEmbeddings.forward: Conv2d (saves the pixels, the batch's tensor, when
    its weight trains), flatten + transpose (a view), cat with the class token (new), +
    position_embeddings (the parameter itself at the trained size; the add saves nothing),
    dropout 0 (the input itself)."""
    vis = ctx.vis
    n, t, e = pixels.shape[0], vis.patches + 1, vis.hidden_size
    w = ctx.p("embeddings.patch_embeddings.projection.weight")
    if w.trainable:
        rec.save(pixels)
    rec.new("vision/patch_embeds", (n, e, t - 1), w.dtype, w.trainable)
    x = rec.new("vision/cat_class", (n, t, e), w.dtype, w.trainable)
    return rec.new("vision/pos_added", (n, t, e), w.dtype, w.trainable)


def layer(rec: Recorder, ctx: TowerCtx, x: Sym, i: int) -> Sym:
    """InternVLVisionLayer: h = x + lambda_1 * proj(attn(norm_before(x)));
    h + lambda_2 * fc2(act(fc1(norm_after(h)))). q, k, v are the projections viewed as
    (n, a, t, d) (q_norm / k_norm first when use_qk_norm), SDPA saves them, its output and
    the log-sum-exp; its output, transposed back, is already contiguous (the fused kernels
    write (n, t, a, d)), so sdpa_attention_forward's `.contiguous()` copies nothing and
    projection_layer saves that same storage. `lambda * y` saves y for lambda's gradient."""
    vis = ctx.vis
    n, t, e = x.shape
    a, pre = vis.num_heads, f"encoder.layer.{i}"
    h = tower_norm(rec, ctx, x, f"{pre}.layernorm_before", "vision/norm_before")
    qkv = []
    for c in "qkv":
        y = vit_linear(rec, ctx, h, f"{pre}.attention.{c}_proj", f"vision/{c}")
        if vis.qk_norm and c != "v":
            y = rms_norm(rec, ctx, y, f"{pre}.attention.{c}_norm", f"vision/{c}_norm")
        qkv.append(rec.view(y, (n, a, t, e // a)))
    o = rec.sdpa(*qkv, (n, a, t, e // a), "vision/attn")
    o = rec.view(o, (n, t, e))  # the fused kernel's output is laid out (n, t, a, d): .contiguous() is a no-op
    o = vit_linear(rec, ctx, o, f"{pre}.attention.projection_layer", "vision/proj")
    x = rec.add(rec.mul(o, ctx.p(f"{pre}.lambda_1"), name="vision/ls1"), x, name="vision/attn_residual")
    h = tower_norm(rec, ctx, x, f"{pre}.layernorm_after", "vision/norm_after")
    h = vit_activation(rec, vit_linear(rec, ctx, h, f"{pre}.mlp.fc1", "vision/fc1"), vis.hidden_act, "vision/act")
    h = vit_linear(rec, ctx, h, f"{pre}.mlp.fc2", "vision/fc2")
    return rec.add(rec.mul(h, ctx.p(f"{pre}.lambda_2"), name="vision/ls2"), x, name="vision/mlp_residual")


def projector(rec: Recorder, ctx: TowerCtx, x: Sym) -> Sym:
    """InternVLModel.get_image_features: `[:, 1:]` and the reshape to (n, g, g, e) are
    views; pixel_shuffle makes two `permute(...).contiguous()` copies (nothing saved), the
    second, viewed as (n, t/s^2, s^2 e), is the projector's LayerNorm input; then linear_1,
    act (GELU saves its input), linear_2."""
    vis = ctx.vis
    n, t, e = x.shape
    wide, k = e * vis.shuffle ** 2, (t - 1) // vis.shuffle ** 2
    rec.new("projector/shuffle_1", (n, t - 1, e), x.dtype, x.requires_grad)
    h = rec.new("projector/shuffle_2", (n, k, wide), x.dtype, x.requires_grad)
    h = rec.layer_norm(h, ctx.p("layer_norm.weight"), "projector/layer_norm")
    h = vit_activation(rec, vit_linear(rec, ctx, h, "linear_1", "projector/linear_1"), vis.projector_act,
                       "projector/act")
    return vit_linear(rec, ctx, h, "linear_2", "projector/linear_2")


def frozen_transient(vis: InternVisionDesc, n: int, c: str) -> Breakdown:
    """A frozen tower's forward (nothing saved): the largest working set of one layer. The
    attention holds x, norm_before's output, q, k, v, SDPA's output, projection_layer's
    output and lambda_1 times it: 8 (n, t, e); the MLP holds
    the residual, norm_after's output (the MLP's argument), fc1's output and the
    activation's: 2 (n, t, e) + 2 (n, t, f)."""
    t, e, f = vis.patches + 1, vis.hidden_size, vis.intermediate_size
    attn = 8 * nbytes(n * t * e, c)
    mlp = 2 * nbytes(n * t * e, c) + 2 * nbytes(n * t * f, c)
    return Breakdown().add("vision_tower/forward/layer", max(attn, mlp))


__all__ = ["TowerCtx", "embed", "frozen_transient", "layer", "projector"]
