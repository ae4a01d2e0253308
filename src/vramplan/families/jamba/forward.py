"""Jamba on the symbolic recorder (transformers 5.24 models/jamba/modeling_jamba.py).

Both layer kinds are pre-norm: x + mixer(input_layernorm(x)), then + feed_forward(
pre_ff_layernorm(.)), the feed-forward being the MoE block (components/moe.py, router
`router`) on MoE layers and Llama's SwiGLU elsewhere. JambaAttention: q/k/v views, no
rotary, the configured attention (arch.attention_core), o_proj.
JambaMambaMixer on CPU (no mamba_ssm / causal_conv1d: `mamba_selective_scan`'s recurrent
loop, what runs in eager mode; its associative scan is taken only under torch.compile):
in_proj -> (b, 2I, s) as a transposed view, chunked into x and the gate z; the depthwise
conv1d (keeps its input when its weight trains) and silu (keeps the conv output);
x_proj of the transposed silu output, which F.linear reshapes into a contiguous (T, I) copy
that its MmBackward keeps; RMSNorms on dt, B and C (views of x_proj's output);
dt_proj.weight @ dt^T (keeps the normed dt); the scan in fp32: softplus(dt + bias),
discrete_A = exp(A * dt), discrete_B = dt * B.float(), deltaB_u = discrete_B * x.float()
(each (b, I, s, N), kept by its product or exp), then per position t
state_t = discrete_A[:, :, t] * state_{t-1} + deltaB_u[:, :, t] (each (b, I, N) fp32
state kept by the next product) and state_t.to(dtype) @ C_t (keeps the cast state);
+ x * D.float(), * silu(z); out_proj of the transposed output, reshaped into a copy.
Under full checkpointing nothing of this is kept, but the layer's own forward still peaks
inside the scan with all its locals alive (three (b, I, s, N) fp32 tensors, recorded in
rec.forward_peak): over the logits, this is the checkpointed step's forward peak.
The same path is recorded for backend cuda: it is what runs there without mamba_ssm;
mamba_ssm's fused `mamba_inner_fn` (MambaInnerFn, which keeps xz, x_dbl, B, C, the scan's
chunk intermediates and its output and recomputes the rest) is not modelled yet.
Legend: b batch, s sequence, h hidden, I inner width, N state, R dt rank, K conv kernel,
a heads, k KV heads, d head_dim, T = b * s.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch import Ctx, attention_core, lin, mlp_shared, rms_norm
from vramplan.components.graph import Recorder, Sym
from vramplan.components.moe import moe_block
from vramplan.families.mamba2.forward import conv1d
from vramplan.families.mamba2.ssd import param_sym
from vramplan.units import nbytes

LAYER_PREFIX = "model.layers"


def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """JambaAttentionDecoderLayer / JambaMambaDecoderLayer.forward."""
    d, pre = ctx.desc, f"{LAYER_PREFIX}.{i}"
    h = rms_norm(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm")
    if d.layer_kind(i) == "attention":
        h = attention(rec, ctx, h, f"{pre}.self_attn", b, s)
    else:
        h = mamba(rec, ctx, h, f"{pre}.mamba", b, s)
    x = rec.add(x, h, name="attn_residual")
    h = rms_norm(rec, ctx, x, f"{pre}.pre_ff_layernorm", "mlp_norm")
    if i in d.moe_layers:
        h = moe_block(rec, ctx, h, i, f"{pre}.feed_forward", "router")
    else:
        h = mlp_shared(rec, ctx, h, f"{pre}.feed_forward")
    return rec.add(x, h, name="mlp_residual")


def attention(rec: Recorder, ctx: Ctx, x: Sym, pre: str, b: int, s: int) -> Sym:
    d = ctx.desc
    a, k, hd = d.num_heads, d.num_kv_heads, d.head_dim
    q = rec.view(lin(rec, ctx, x, f"{pre}.q_proj", "attn/q"), (b, a, s, hd))
    kk = rec.view(lin(rec, ctx, x, f"{pre}.k_proj", "attn/k"), (b, k, s, hd))
    v = rec.view(lin(rec, ctx, x, f"{pre}.v_proj", "attn/v"), (b, k, s, hd))
    out = attention_core(rec, ctx, q, kk, v, "attn/core")
    return lin(rec, ctx, rec.view(out, (b, s, a * hd)), f"{pre}.o_proj", "attn/o")


def mamba(rec: Recorder, ctx: Ctx, x: Sym, pre: str, b: int, s: int) -> Sym:
    d = ctx.desc
    inner, N, R = d.mamba_inner, d.state_size, d.dt_rank
    dtype = x.dtype
    proj = lin(rec, ctx, x, f"{pre}.in_proj", "ssm/in_proj")
    xs = rec.view(proj, (b, inner, s), "ssm/x_in")
    gate = rec.view(proj, (b, inner, s), "ssm/gate")
    a_log = param_sym(rec, ctx.p(f"{pre}.A_log"))
    A = rec.scale(rec.unary_saving_output(rec.to(a_log, "fp32", "ssm/A_log_fp32"), "ssm/A_exp"), "ssm/A")
    conv = conv1d(rec, ctx, xs, f"{pre}.conv1d", (b, inner, s + d.conv_kernel - 1))
    act = rec.unary_saving_input(rec.view(conv, (b, inner, s)), "ssm/conv_act")
    xt = rec.new("ssm/x_proj_in", (b * s, inner), act.dtype, act.requires_grad)  # reshape copy
    dbc = lin(rec, ctx, xt, f"{pre}.x_proj", "ssm/x_proj")
    dt = rms_norm(rec, ctx, rec.view(dbc, (b, s, R)), f"{pre}.dt_layernorm", "ssm/dt_norm")
    B = rms_norm(rec, ctx, rec.view(dbc, (b, s, N)), f"{pre}.b_layernorm", "ssm/B_norm")
    C = rms_norm(rec, ctx, rec.view(dbc, (b, s, N)), f"{pre}.c_layernorm", "ssm/C_norm")
    dt = rec.linear(dt, ctx.p(f"{pre}.dt_proj.weight"), name="ssm/dt_proj")  # weight @ dt^T (b, I, s)
    # the scan's moment is built by the two `_live` calls below; a LoRA linear's moment
    # recorded before it (components/arch.py lin) is another moment, never added to it
    prior, rec.forward_peak[:] = rec.forward_peak[:], []
    y = selective_scan(rec, ctx, act, dt, A, B, C, gate, pre, dtype)
    # JambaMambaMixer.forward's locals while mamba_selective_scan runs: the normed input
    # (the decoder layer's and the mixer's `hidden_states`), projected_states (in_proj's
    # output; the conv input and the gate are views of it), A, the conv's silu output, the
    # dt_proj product `time_step` and the normed B and C
    _live(rec, x, proj, A, act, dt, B, C)
    if sum(n for _, n in prior) > sum(n for _, n in rec.forward_peak):
        rec.forward_peak[:] = prior
    yt = rec.new("ssm/out_proj_in", (b * s, inner), dtype, y.requires_grad)  # .to(dtype), reshape copy
    return rec.view(lin(rec, ctx, yt, f"{pre}.out_proj", "ssm/out_proj"), (b, s, d.hidden_size))


def selective_scan(rec: Recorder, ctx: Ctx, xs: Sym, dt: Sym, A: Sym, B: Sym, C: Sym, gate: Sym,
                   pre: str, dtype: str) -> Sym:
    """mamba_selective_scan's recurrent loop (delta_softplus, D and z given)."""
    b, inner, s = xs.shape
    N = B.shape[-1]
    bias = rec.to(param_sym(rec, ctx.p(f"{pre}.dt_proj.bias")), "fp32", "ssm/dt_bias_fp32")  # .float()
    dt = rec.add(dt, rec.to(bias, dt.dtype), name="ssm/dt_biased")
    dt = rec.unary_saving_input(dt, "ssm/dt_softplus")
    full = (b, inner, s, N)
    dA = rec.unary_saving_output(_broadcast_mul(rec, A, dt, full, "ssm/A_dt"), "ssm/discrete_A")
    dB = _broadcast_mul(rec, dt, rec.to(B, "fp32", "ssm/B_fp32"), full, "ssm/discrete_B")
    dBu = _broadcast_mul(rec, dB, rec.to(xs, "fp32", "ssm/x_fp32"), full, "ssm/deltaB_u")
    state = rec.new("ssm/state0", (b, inner, N), dtype, False)
    for t in range(s):
        # discrete_A[:, :, t] * state: keeps the state (discrete_A needs a gradient) and,
        # once the state needs one, the discrete_A view (already kept by exp)
        prod = rec.mul(dA, state, name="ssm/state_decay")
        state = rec.new(f"ssm/state{t + 1}", (b, inner, N), "fp32", prod.requires_grad or dBu.requires_grad)
        cast = rec.to(state, dtype, "ssm/state_cast")
        if C.requires_grad:
            rec.save(cast)
        if cast.requires_grad:
            rec.save(C)
    stacked = rec.new("ssm/scan", (b, inner, s), dtype, state.requires_grad)
    D = rec.to(param_sym(rec, ctx.p(f"{pre}.D")), "fp32", "ssm/D_fp32")  # the mixer's self.D.float()
    x_D = rec.mul(xs, D, name="ssm/x_D")
    y = rec.add(stacked, x_D, name="ssm/scan_D")
    # The layer's forward peak when nothing is saved (checkpointing): at `scan_output +
    # hidden_states * D[None, :, None]` the scan's locals are all alive -- the softplus dt,
    # discrete_A, discrete_B, deltaB_u (three (b, I, s, N) fp32), the last fp32 state, the
    # list `scan_outputs` of s matmul outputs (b, I, 1), their torch.stack, the product and
    # the sum (fp32: D is fp32) -- beside the fp32 copies of the bias and D; the gated
    # product after it holds as much, and the function's return frees the four-dimensional
    # ones (transformers 5.24 models/jamba/modeling_jamba.py mamba_selective_scan).
    outs = rec.new("ssm/scan_outputs", (b, inner, s), dtype, False)
    _live(rec, bias, dt, dA, dB, dBu, state, outs, stacked, x_D, y, D)
    z = rec.unary_saving_input(gate, "ssm/gate_silu")
    return rec.mul(y, z, name="ssm/scan_gated")


_AFTER_SCAN = ("ssm/scan_D", "ssm/gate_silu", "ssm/out_proj_in", "attn_residual")
_AFTER_SCAN_PREFIXES = ("mlp", "moe/")


_GRADS_BEFORE_SCAN = (".feed_forward.", ".pre_ff_layernorm.", ".mamba.out_proj.")


def backward_peak(desc, spec, params, i: int, saved: list[tuple[str, int]]):
    """A Mamba layer's backward peaks inside the scan's backward, not in its MLP: for each
    position t, SelectBackward materializes a full (b, I, s, N) zero tensor around the
    gradient of discrete_A[:, :, t] and of deltaB_u[:, :, t] (torch select_backward), which
    autograd's input buffers sum into one gradient per tensor; at the first position's
    backward the meter holds four of them (three select_backward outputs and one sum), with
    the gradients of the gated product's inputs (y fp32, silu(z)) and of the hidden state.
    By then the layer's feed-forward, out_proj's input and the gated product's saved inputs
    are released, and the gradients of the feed-forward, its norm and out_proj exist (beyond
    the MLP output projection's, which weights.gradient_stages_at_peak counts). Attention
    layers keep the usual MLP-backward peak (None)."""
    if desc.layer_kind(i) != "mamba":
        return None
    from vramplan.components.dtypes import dtypes_of
    b, s = spec.micro_batch_size, spec.seq_len
    w = dtypes_of(spec).weights if spec.method.value != "qlora" else spec.quantization.compute_dtype
    big = b * desc.mamba_inner * s
    t = (Breakdown().add("backward/grad_hidden", nbytes(b * s * desc.hidden_size, w))
         .add("backward/scan_grad_y_z", nbytes(big, "fp32") + nbytes(big, w))
         .add("backward/scan_select_grads", 4 * nbytes(big * desc.state_size, "fp32")))
    from vramplan.components.trainable import grad_dtype
    from vramplan.components.weights import is_mlp_out
    for p in params.trainable():
        if (p.layer == i and not is_mlp_out(p.name)
                and any(m in p.name.split("#")[0] for m in _GRADS_BEFORE_SCAN)):
            t.add("gradients/before_scan_backward", nbytes(p.numel, grad_dtype(spec, p)))
    freed = tuple(n for n, _ in saved if n in _AFTER_SCAN or n.startswith(_AFTER_SCAN_PREFIXES))
    return t, freed


def _live(rec: Recorder, *tensors: Sym) -> None:
    """Count each storage once in the layer's forward peak (a parameter operand has none)."""
    seen: set[int] = set()
    for t in tensors:
        if id(t.storage) not in seen and t.storage.nbytes:
            seen.add(id(t.storage))
            rec.forward_peak.append((t.name, t.storage.nbytes))


def _broadcast_mul(rec: Recorder, a: Sym, b: Sym, shape, name: str) -> Sym:
    """a * b broadcast to `shape`: saves as rec.mul does."""
    out = rec.mul(a, b, name=name)
    return rec.new(name, shape, out.dtype, out.requires_grad)


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    return rec.embedding(ids, ctx.p("model.embed_tokens.weight"), "embed/tokens")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rms_norm(rec, ctx, x, "model.final_layernorm", "final_norm")
    w = ctx.params.get("lm_head.weight") or ctx.params.get("score.weight") or ctx.p("model.embed_tokens.weight")
    return rec.linear(h, w, name="logits")
