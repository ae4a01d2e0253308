"""The Qwen2-VL / Qwen2.5-VL vision tower and patch merger on the symbolic recorder.

Mirrors transformers 5.24 models/qwen2_vl/modeling_qwen2_vl.py and
models/qwen2_5_vl/modeling_qwen2_5_vl.py. The tower runs on one flat sequence of patches
(every image and frame of the batch, `hidden_states` of shape (N, e)); attention is split
per image and frame (`cu_seqlens`) or, in Qwen2.5-VL's window blocks, per window
(`cu_window_seqlens`), one SDPA call per piece. Each piece saves its q, k, v views, its
output and its log-sum-exp, so the pieces together save what one call over N would.
Legend: N patches in the batch, e width, a heads, d = e / a, f MLP width, u = merge^2,
H language-model width.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_vit import vit_activation, vit_linear
from vramplan.components.graph import Recorder, Sym
from vramplan.families.common import TowerCtx, tower_norm
from vramplan.families.qwen2_vl.vision import QwenVisionDesc
from vramplan.units import nbytes


def embed(rec: Recorder, ctx: TowerCtx, pixels: Sym) -> Sym:
    """Qwen2VisionTransformerPretrainedModel.forward up to the blocks: PatchEmbed views the
    (N, C*tp*p*p) pixels as (N, C, tp, p, p) and runs the Conv3d (which saves the pixels,
    the batch's own tensor, when its weight trains), then `.view(-1, e)`; the vision rotary
    embedding makes cos and sin, (N, d) fp32 each, shared by every block and saved by each
    block's rotary products. Qwen2.5-VL reorders the patches window by window
    (permute_input_for_window_attn: an index_select into a new tensor, whose backward keeps
    the (N / u) int64 window index) and reorders cos and sin the same way."""
    vis = ctx.vis
    n, e, d = pixels.shape[0], vis.hidden_size, vis.hidden_size // vis.num_heads
    w = ctx.p("patch_embed.proj.weight")
    if w.trainable:
        rec.save(pixels)
    x = rec.new("vision/patch_embed", (n, e), w.dtype, w.trainable)
    if vis.window_size:
        if x.requires_grad:
            rec.save(rec.new("vision/window_index", (n // vis.merge_unit,), "int64", False))
        x = rec.new("vision/window_permuted", (n, e), x.dtype, x.requires_grad)
    ctx.shared["cos"] = rec.new("vision/rotary_cos", (n, d), "fp32", False)
    ctx.shared["sin"] = rec.new("vision/rotary_sin", (n, d), "fp32", False)
    return x


def _rope(rec: Recorder, x: Sym, ctx: TowerCtx, name: str) -> Sym:
    """apply_rotary_pos_emb_vision: x.float() (a copy below fp32), x * cos (saves cos),
    rotate_half(x) (neg and cat: new tensors, nothing saved) * sin (saves sin), the sum,
    then `.to(orig dtype)`."""
    xf = rec.to(x, "fp32", name=f"{name}.fp32")
    a = rec.mul(xf, ctx.shared["cos"], name=f"{name}.cos")
    half = rec.new(f"{name}.rotate_half", xf.shape, "fp32", xf.requires_grad)
    b = rec.mul(half, ctx.shared["sin"], name=f"{name}.sin")
    return rec.to(rec.add(a, b, name=f"{name}.fp32_out"), x.dtype, name=name)


def block(rec: Recorder, ctx: TowerCtx, x: Sym, i: int) -> Sym:
    """Qwen2VLVisionBlock / Qwen2_5_VLVisionBlock: x + proj(attn(norm1(x))); x + mlp(norm2(x)).
    VisionAttention: qkv (N, 3e) reshaped and unbound into q, k, v views, rotary on q and k,
    SDPA per piece (v stays a view of qkv, so qkv's storage is what v keeps), each piece's
    output transposed to a contiguous copy and concatenated (cat saves nothing), the
    concatenation is `proj`'s input."""
    vis = ctx.vis
    n, e = x.shape
    a, d = vis.num_heads, e // vis.num_heads
    pre = f"blocks.{i}"
    h = tower_norm(rec, ctx, x, f"{pre}.norm1", "vision/norm1")
    qkv = vit_linear(rec, ctx, h, f"{pre}.attn.qkv", "vision/qkv")
    q, k, v = (rec.view(qkv, (n, a, d), f"vision/{c}") for c in "qkv")
    q, k = _rope(rec, q, ctx, "vision/q_rot"), _rope(rec, k, ctx, "vision/k_rot")
    q4, k4, v4 = (rec.view(t, (1, a, n, d)) for t in (q, k, v))
    o = rec.sdpa(q4, k4, v4, (1, a, n, d), "vision/attn")
    o = rec.new("vision/attn_cat", (n, e), o.dtype, o.requires_grad)
    x = rec.add(x, vit_linear(rec, ctx, o, f"{pre}.attn.proj", "vision/proj"), name="vision/attn_residual")
    h = tower_norm(rec, ctx, x, f"{pre}.norm2", "vision/norm2")
    if vis.rms:  # Qwen2_5_VLMLP: down(act(gate(x)) * up(x)), SiLU saves its input
        g = rec.unary_saving_input(vit_linear(rec, ctx, h, f"{pre}.mlp.gate_proj", "vision/gate"), "vision/act")
        h = rec.mul(g, vit_linear(rec, ctx, h, f"{pre}.mlp.up_proj", "vision/up"), name="vision/gated")
        h = vit_linear(rec, ctx, h, f"{pre}.mlp.down_proj", "vision/down")
    else:  # VisionMlp: fc2(act(fc1(x))), QuickGELU by default
        h = vit_activation(rec, vit_linear(rec, ctx, h, f"{pre}.mlp.fc1", "vision/fc1"), vis.hidden_act, "vision/act")
        h = vit_linear(rec, ctx, h, f"{pre}.mlp.fc2", "vision/fc2")
    return rec.add(x, h, name="vision/mlp_residual")


def merger(rec: Recorder, ctx: TowerCtx, x: Sym) -> Sym:
    """PatchMerger / Qwen2_5_VLPatchMerger: ln_q (LayerNorm / RMSNorm), `.view(-1, u * e)`
    (a view of the norm's contiguous output), Linear, GELU (exact, saves its input), Linear.
    Qwen2.5-VL then undoes the window order with `merged[argsort(window_index)]` (index:
    saves the (N / u) int64 indices)."""
    vis = ctx.vis
    n, e = x.shape
    h = tower_norm(rec, ctx, x, "merger.ln_q", "merger/ln_q")
    h = rec.view(h, (n // vis.merge_unit, e * vis.merge_unit))
    h = rec.unary_saving_input(vit_linear(rec, ctx, h, "merger.mlp.0", "merger/mlp0"), "merger/gelu")
    out = vit_linear(rec, ctx, h, "merger.mlp.2", "merger/mlp2")
    if vis.window_size:
        if out.requires_grad:
            rec.save(rec.new("merger/reverse_index", (n // vis.merge_unit,), "int64", False))
        out = rec.new("merger/unpermuted", out.shape, out.dtype, out.requires_grad)
    return out


def frozen_transient(vis: QwenVisionDesc, n: int, c: str) -> Breakdown:
    """A frozen tower's forward (nothing requires grad, nothing saved): the largest working
    set of one block. cos and sin (fp32) live through the tower; in the MLP the block's
    input is gone (rebound by the attention residual), its norm2 output stays (the MLP's
    argument) and the MLP holds three (N, f) tensors at once (QuickGELU: fc1's output,
    1.702 x and its sigmoid; SwiGLU: SiLU's output, up's output and their product). The
    attention holds x, norm1's output, qkv (3e), the rotated q and k, the per-piece
    outputs, their concatenation and proj's output: 9 (N, e)."""
    e, f, d = vis.hidden_size, vis.intermediate_size, vis.hidden_size // vis.num_heads
    rope = 2 * nbytes(n * d, "fp32")
    mlp = 2 * nbytes(n * e, c) + 3 * nbytes(n * f, c)
    attn = 9 * nbytes(n * e, c) + (2 * nbytes(n * e, "fp32") if c != "fp32" else 0)
    return Breakdown().add("vision_tower/forward/rotary", rope).add("vision_tower/forward/block", max(mlp, attn))


__all__ = ["TowerCtx", "block", "embed", "frozen_transient", "merger"]
