"""Mamba-2 on the symbolic recorder (transformers 5.24 models/mamba2/modeling_mamba2.py).

Mamba2Block: residual = x; h = norm(x.to(norm.weight.dtype)) (Llama's RMSNorm), the mixer,
then residual (an fp32 copy when `residual_in_fp32`, so the stream is fp32 from the first
block on) + mixer output.
Mamba2Mixer on CPU (no mamba_ssm / causal_conv1d kernels: the torch path of `forward`):
in_proj -> split into gate z (I), xBC (conv_dim), dt (H) as views; the depthwise conv1d
(padding K-1, keeps its input when its weight trains) and silu (keeps the conv output);
x, B, C views of the silu output; A = -exp(A_log.float()); the SSD chunk scan (ssd.py);
MambaRMSNormGated in fp32 (y * silu(z.float()), per-group rsqrt, weight * y_hat: the
product promotes to fp32); out_proj of `.to(dtype)` (a copy for 16-bit models).
On CUDA with mamba_ssm installed, training calls `mamba_split_conv1d_scan_combined`
(mamba_ssm/ops/triton/ssd_combined.py, MambaSplitConv1dScanCombinedFn): one autograd
Function from in_proj's output to out_proj's, whose forward keeps only
`ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, ...,
rmsnorm_weight, rstd, outproj_weight, ...)`: the in_proj output, the scan output x
(b, s, H, P in the model dtype) and the gated norm's rstd (fp32, one per group and token);
backward recomputes the conv, the norm and out_proj's input. out_proj's weight is used
inside the Function, so a LoRA adapter on out_proj is bypassed there.
Legend: b batch, s sequence, h hidden, I inner width, H heads, P head_dim, N state_size,
G groups, K conv kernel, T = b * s.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, lin, rms_norm
from vramplan.components.graph import Recorder, Sym
from vramplan.families.mamba2.ssd import chunk_scan, param_sym

LAYER_PREFIX = "backbone.layers"


def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """Mamba2Block.forward."""
    pre = f"{LAYER_PREFIX}.{i}"
    w = ctx.p(f"{pre}.norm.weight")
    h = rms_norm(rec, ctx, rec.to(x, w.dtype, "norm_in"), f"{pre}.norm", "ssm_norm")
    out = mixer(rec, ctx, h, f"{pre}.mixer", b, s)
    residual = rec.to(x, "fp32", "residual_fp32") if ctx.desc.residual_in_fp32 else x
    return rec.add(residual, out, name="ssm_residual")


def conv1d(rec: Recorder, ctx: Ctx, x: Sym, module: str, out_shape) -> Sym:
    """nn.functional.conv1d (depthwise): ConvolutionBackward keeps the input when the
    weight trains and the weight when the input needs a gradient."""
    w = ctx.p(module + ".weight")
    if w.trainable:
        rec.save(x)
    return rec.new("ssm/conv", out_shape, x.dtype, x.requires_grad or w.trainable)


def mixer(rec: Recorder, ctx: Ctx, x: Sym, pre: str, b: int, s: int) -> Sym:
    d = ctx.desc
    H, P, N, G, inner = d.num_heads, d.head_dim, d.state_size, d.n_groups, d.intermediate_size
    proj = lin(rec, ctx, x, f"{pre}.in_proj", "ssm/in_proj")
    gate = rec.view(proj, (b, s, inner), "ssm/gate")
    xbc = rec.view(proj, (b, d.conv_dim, s), "ssm/xBC")
    dt = rec.view(proj, (b, s, H), "ssm/dt")
    if rec.backend == "cuda":
        return _fused(rec, ctx, proj, pre, b, s)
    a_log = param_sym(rec, ctx.p(f"{pre}.A_log"))
    A = rec.scale(rec.unary_saving_output(rec.to(a_log, "fp32", "ssm/A_log_fp32"), "ssm/A_exp"), "ssm/A")
    conv = conv1d(rec, ctx, xbc, f"{pre}.conv1d", (b, d.conv_dim, s + d.conv_kernel - 1))
    # [:, :, :s] then silu, which keeps the (b, conv_dim, s + K - 1) conv output
    act = rec.unary_saving_input(rec.view(conv, (b, d.conv_dim, s)), "ssm/conv_act")
    hs = rec.view(act, (b, s, H, P), "ssm/x")
    B = rec.view(act, (b, s, G, N), "ssm/B")
    C = rec.view(act, (b, s, G, N), "ssm/C")
    y = chunk_scan(rec, hs, dt, A, B, C, ctx.p(f"{pre}.D"), ctx.p(f"{pre}.dt_bias"), d.chunk_size)
    y = rec.view(y, (b, s, inner), "ssm/scan_out")
    y = gated_norm(rec, ctx, y, gate, f"{pre}.norm", b, s)
    return lin(rec, ctx, rec.to(y, x.dtype, "ssm/norm_out_cast"), f"{pre}.out_proj", "ssm/out_proj")


def gated_norm(rec: Recorder, ctx: Ctx, y: Sym, gate: Sym, module: str, b: int, s: int) -> Sym:
    """MambaRMSNormGated.forward (norm after the gate): y.float() * silu(z.float()), then
    per-group x * rsqrt(mean(x^2) + eps), then weight * x_hat.to(y's dtype)."""
    G = ctx.desc.n_groups
    y32 = rec.to(y, "fp32", "ssm/gn_in_fp32")
    z = rec.unary_saving_input(rec.to(gate, "fp32", "ssm/gate_fp32"), "ssm/gate_silu")
    g = rec.mul(y32, z, name="ssm/gated")
    sq = rec.unary_saving_input(g, "ssm/gn_pow")
    rstd = rec.unary_saving_output(rec.reduce(sq, (b, s, G, 1), "ssm/gn_var"), "ssm/gn_rstd")
    xhat = rec.mul(g, rstd, name="ssm/gn_xhat")
    return rec.mul(rec.to(xhat, y.dtype, "ssm/gn_xhat_cast"), ctx.p(module + ".weight"), name="ssm/gn_out")


def _fused(rec: Recorder, ctx: Ctx, proj: Sym, pre: str, b: int, s: int) -> Sym:
    """MambaSplitConv1dScanCombinedFn (see the module docstring): keeps zxbcdt, out_x and
    rstd; out_proj runs inside it (F.linear on its weight)."""
    d = ctx.desc
    rec.save(proj, rec.new("ssm/fused.out_x", (b, s, d.num_heads, d.head_dim), proj.dtype, True),
             rec.new("ssm/fused.rstd", (b * s * d.n_groups,), "fp32", False))
    return rec.new("ssm/out_proj", (b, s, d.hidden_size), rec.autocast or proj.dtype, True)


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    return rec.embedding(ids, ctx.p("backbone.embeddings.weight"), "embed/tokens")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    """norm_f, then lm_head(hidden.to(lm_head.weight.dtype)).float()."""
    h = rms_norm(rec, ctx, x, "backbone.norm_f", "final_norm")
    w = ctx.params.get("lm_head.weight") or ctx.params.get("score.weight") or ctx.p("backbone.embeddings.weight")
    return rec.linear(rec.to(h, w.dtype, "final_norm_cast"), w, name="logits")

