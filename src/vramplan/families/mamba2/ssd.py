"""The SSD chunked scan of Mamba-2 on the symbolic recorder: transformers 5.24
models/mamba2/modeling_mamba2.py `mamba2_chunk_scan` (the torch fallback of mamba_ssm's
`mamba_chunk_scan_combined`, what runs on CPU) and `segment_sum`, op for op where an op
saves a tensor for backward.

torch.einsum contracts through bmm (aten/src/ATen/native/Linear.cpp sumproduct_pair): each
operand is permuted to (batch, rows, inner) and reshaped, which copies a permuted operand,
and bmm keeps both copies (each when the other needs a gradient). Every contraction below
reads a (b, c, l, h, .) chunked tensor with the head moved before the chunk position, so
its operands are copies. All checked against the autograd graph of the real model
(`_saved_*` of each node) and the exact CPU meter.
Legend: b batch, s sequence, c = ceil(s / Ls) chunks, Ls chunk_size, H heads, P head_dim,
N state_size, S = b * c * Ls padded tokens.
"""
from __future__ import annotations

from vramplan.components.graph import Param, Recorder, Sym


def param_sym(rec: Recorder, p: Param) -> Sym:
    """A parameter as an operand: no activation storage, requires grad when trained."""
    sym = rec.new(p.name, (0,), p.dtype, p.trainable)
    return Sym(p.name, p.shape, p.dtype, p.trainable, sym.storage)


def bmm_operand(rec: Recorder, name: str, shape, rg: bool, other_rg: bool) -> None:
    """One operand of an einsum's bmm, copied to the bmm layout; saved when the other
    operand needs a gradient."""
    if other_rg:
        rec.save(rec.new(name, shape, "fp32", rg))


def segment_sum(rec: Recorder, x: Sym, name: str) -> Sym:
    """segment_sum(x) for x (..., n): two masked_fill with `~tril` bool (n, n) masks, which
    MaskedFillBackward keeps, and a cumsum; returns the (..., n, n) sums (not saved)."""
    n = x.shape[-1]
    if x.requires_grad:
        rec.save(rec.new(f"{name}.mask_lower", (n, n), "bool", False),
                 rec.new(f"{name}.mask_upper", (n, n), "bool", False))
    return rec.new(name, x.shape + (n,), x.dtype, x.requires_grad)


def chunk_scan(rec: Recorder, hs: Sym, dt: Sym, A: Sym, B: Sym, C: Sym, D: Param | None,
               dt_bias: Param, chunk: int) -> Sym:
    """mamba2_chunk_scan(hidden_states (b,s,H,P), dt (b,s,H), A (H,), B, C (b,s,G,N)) with
    dt_softplus: returns the (b, s_pad, H, P) fp32 output (sliced to s by the caller's view)."""
    b, s, H, P = hs.shape
    N = B.shape[-1]
    c = -(-s // chunk)
    Ls = chunk
    # dt = dt + dt_bias.to(dt.dtype); softplus keeps its input; clamp keeps its input
    dt = rec.add(dt, param_sym(rec, dt_bias), name="ssm/dt_biased")
    dt = rec.unary_saving_input(dt, "ssm/dt_softplus")
    dt = rec.unary_saving_input(dt, "ssm/dt_clamped")
    hs32 = rec.to(hs, "fp32", "ssm/x_fp32")
    # B.float().repeat_interleave(H // G, dim=2): (b, s, H, N) fp32, nothing saved
    Bh = rec.new("ssm/B_heads", (b, s, H, N), "fp32", B.requires_grad)
    Ch = rec.new("ssm/C_heads", (b, s, H, N), "fp32", C.requires_grad)
    pad = (b, c * Ls, H, P)
    out_d = None
    if D is not None:
        # D_residual = D[..., None] * pad_tensor_by_size(hidden_states, pad_size): the pad is a
        # new tensor, kept when D trains
        out_d = rec.mul(rec.new("ssm/x_padded", pad, "fp32", hs32.requires_grad), D, name="ssm/D_residual")
    # hidden_states * dt[..., None].float(); A.to(fp32) * dt.float(): `.float()` copies a
    # 16-bit dt once per call
    xdt = rec.mul(hs32, rec.to(dt, "fp32", "ssm/dt_fp32_x"), name="ssm/x_dt")
    Adt = rec.mul(A, rec.to(dt, "fp32", "ssm/dt_fp32_A"), name="ssm/A_dt")
    # reshape_into_chunks: pad (a new tensor) then a view into (b, c, Ls, ...)
    xc = rec.new("ssm/x_dt_chunks", (b, c, Ls, H, P), "fp32", xdt.requires_grad)
    Ac = rec.new("ssm/A_chunks", (b, H, c, Ls), "fp32", Adt.requires_grad)
    Bc = rec.new("ssm/B_chunks", (b, c, Ls, H, N), "fp32", Bh.requires_grad)
    Cc = rec.new("ssm/C_chunks", (b, c, Ls, H, N), "fp32", Ch.requires_grad)
    A_cumsum = rec.new("ssm/A_cumsum", Ac.shape, "fp32", Ac.requires_grad)
    # 1. intra-chunk: L = exp(segment_sum(A)); G = einsum(C, B); M = G * L; Y_diag = einsum(M, x)
    Lmat = rec.unary_saving_output(segment_sum(rec, Ac, "ssm/segsum"), "ssm/L")
    bch = b * c * H
    bmm_operand(rec, "ssm/G.C", (bch, Ls, N), Cc.requires_grad, Bc.requires_grad)
    bmm_operand(rec, "ssm/G.B", (bch, N, Ls), Bc.requires_grad, Cc.requires_grad)
    G = rec.new("ssm/G", (b, c, Ls, Ls, H), "fp32", Cc.requires_grad or Bc.requires_grad)
    M = rec.mul(G, Lmat, name="ssm/M")
    bmm_operand(rec, "ssm/Y_diag.M", (bch, Ls, Ls), M.requires_grad, xc.requires_grad)
    bmm_operand(rec, "ssm/Y_diag.x", (bch, Ls, P), xc.requires_grad, M.requires_grad)
    y_diag = rec.new("ssm/Y_diag", (b, c, Ls, H, P), "fp32", M.requires_grad or xc.requires_grad)
    # 2. chunk states: decay_states = exp(A_cumsum[..., -1:] - A_cumsum); B * decay; einsum with x
    decay = rec.unary_saving_output(rec.new("ssm/decay_in", Ac.shape, "fp32", Ac.requires_grad), "ssm/decay_states")
    B_decay = rec.mul(Bc, decay, name="ssm/B_decay")
    bmm_operand(rec, "ssm/states.x", (bch, P, Ls), xc.requires_grad, B_decay.requires_grad)
    bmm_operand(rec, "ssm/states.B", (bch, Ls, N), B_decay.requires_grad, xc.requires_grad)
    states_rg = B_decay.requires_grad or xc.requires_grad
    # 3. inter-chunk recurrence: cat zeros in front (b, c+1, H, P, N); decay_chunk =
    # exp(segment_sum(pad(A_cumsum[..., -1]))) (b, H, c+1, c+1), a view in its bmm
    chunk_sums = rec.new("ssm/A_chunk_sums", (b, H, c + 1), "fp32", Ac.requires_grad)
    decay_chunk = rec.unary_saving_output(segment_sum(rec, chunk_sums, "ssm/segsum_chunks"), "ssm/decay_chunk")
    if states_rg:
        rec.save(decay_chunk)
    bmm_operand(rec, "ssm/new_states.states", (b * H, c + 1, P * N), states_rg, decay_chunk.requires_grad)
    new_rg = states_rg or decay_chunk.requires_grad
    # 4. state -> output: state_decay_out = exp(A_cumsum); C_times_states = einsum(C, states)
    decay_out = rec.unary_saving_output(A_cumsum, "ssm/state_decay_out")
    bmm_operand(rec, "ssm/C_times_states.C", (bch, Ls, N), Cc.requires_grad, new_rg)
    bmm_operand(rec, "ssm/C_times_states.states", (bch, N, P), new_rg, Cc.requires_grad)
    cts = rec.new("ssm/C_times_states", (b, c, Ls, H, P), "fp32", Cc.requires_grad or new_rg)
    y_off = rec.mul(cts, decay_out, name="ssm/Y_off")
    out = rec.add(y_diag, y_off, name="ssm/Y")
    out = rec.view(out, pad)
    return rec.add(out, out_d, name="ssm/out") if out_d is not None else out
