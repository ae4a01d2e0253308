"""Llama-4 text on the symbolic recorder (transformers 5.24 models/llama4/modeling_llama4.py).

Llama4TextDecoderLayer: x + attn(input_layernorm(x)), then + feed_forward(post_attention_
layernorm(.)); the RMSNorms are Llama's (x.float() statistics, .type_as(x) * weight).
Llama4TextAttention: q/k/v views; on rotary layers apply_rotary_emb multiplies complex views
of q.float() and k.float() by the shared complex64 freqs_cis (the product saves only
freqs_cis, which needs no gradient) and casts back with type_as, then the weightless
Llama4TextL2Norm (use_qk_norm) normalizes q and k; on NoPE layers with
attn_temperature_tuning q is multiplied by per-position fp32 scales (saved, s values).
Chunked layers get an explicit mask once s >= attention_chunk_size (arch.sdpa_gets_mask).
Llama4TextMoe: sigmoid of the top-k-scattered router logits; every token goes through
every expert (`hidden_states.repeat(E, 1)` scaled by its score, two bmm over (E, T, .)),
plus the shared expert, summed over experts.
Legend: b micro-batch, s sequence, h hidden, a heads, k KV heads, d head_dim, T = b * s
tokens, E experts, m expert width.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, attention_core, lin, mlp_shared, rms_norm, sdpa_gets_mask
from vramplan.components.graph import Recorder, Sym

LAYER_PREFIX = "model.layers"


def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    pre = f"{LAYER_PREFIX}.{i}"
    h = rms_norm(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm")
    x = rec.add(x, attention(rec, ctx, h, i, b, s), name="attn_residual")
    h = rms_norm(rec, ctx, x, f"{pre}.post_attention_layernorm", "mlp_norm")
    h = moe(rec, ctx, h, i) if i in ctx.desc.moe_layers else mlp_shared(rec, ctx, h, f"{pre}.feed_forward")
    return rec.add(x, h, name="mlp_residual")


def attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    d, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.self_attn"
    a, k, hd = d.num_heads, d.num_kv_heads, d.head_dim
    q = rec.view(lin(rec, ctx, x, f"{pre}.q_proj", "attn/q"), (b, a, s, hd))
    kk = rec.view(lin(rec, ctx, x, f"{pre}.k_proj", "attn/k"), (b, k, s, hd))
    v = rec.view(lin(rec, ctx, x, f"{pre}.v_proj", "attn/v"), (b, k, s, hd))
    if i in d.rope_layers:
        _freqs_cis(rec, ctx, s)
        q = rec.new("attn/q_rope", q.shape, q.dtype, q.requires_grad)
        kk = rec.new("attn/k_rope", kk.shape, kk.dtype, kk.requires_grad)
        if d.use_qk_norm:
            q, kk = _l2_norm(rec, q, "attn/q_norm"), _l2_norm(rec, kk, "attn/k_norm")
    elif d.attn_temperature_tuning:
        # (query_states * attn_scales).to(query_states.dtype): the product saves the fp32
        # scales (made in this layer), not q (the scales need no gradient); a 16-bit q is
        # promoted to an fp32 product and cast back
        scales = rec.new("attn/temperature_scales", (s,), "fp32", False)
        rec.save(scales)
        q = rec.to(rec.new("attn/q_scaled", q.shape, "fp32", q.requires_grad), q.dtype, "attn/q_scaled_cast")
    out = attention_core(rec, ctx, q, kk, v, "attn/core", sdpa_gets_mask(d, i, s))
    return lin(rec, ctx, rec.view(out, (b, s, a * hd)), f"{pre}.o_proj", "attn/o")


def _freqs_cis(rec: Recorder, ctx: Ctx, s: int) -> None:
    """Llama4TextRotaryEmbedding: torch.polar(...) * attention_scaling, complex64 (1, s, d/2)
    = 4 * s * d bytes, made once per forward and kept by every rotary layer's product."""
    if "cos" not in ctx.shared:
        ctx.shared["cos"] = rec.new("rotary/freqs_cis", (1, s, ctx.desc.head_dim), "fp32", False)
    rec.save(ctx.shared["cos"])


def _l2_norm(rec: Recorder, x: Sym, name: str) -> Sym:
    """Llama4TextL2Norm: x.float() * rsqrt(x.pow(2).mean(-1) + eps), .type_as(x); no weight."""
    x32 = rec.to(x, "fp32", name=f"{name}.fp32")
    sq = rec.unary_saving_input(x32, f"{name}.pow")
    rstd = rec.unary_saving_output(rec.reduce(sq, x.shape[:-1] + (1,), f"{name}.var"), f"{name}.rstd")
    return rec.to(rec.mul(x32, rstd, name=f"{name}.xhat"), x.dtype, name=name)


def moe(rec: Recorder, ctx: Ctx, x: Sym, i: int) -> Sym:
    """Llama4TextMoe.forward and Llama4TextExperts.forward, every op that saves."""
    d, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.feed_forward"
    h, E, m, topk = d.hidden_size, d.moe.num_experts, d.moe.expert_intermediate_size, d.moe.top_k
    T = x.numel // h
    flat = rec.view(x, (T, h))
    logits = rec.linear(flat, ctx.p(f"{pre}.router.weight"), name="moe/router_logits")
    rec.save(rec.new("moe/topk_index", (T, topk), "int64", False))  # topk and scatter_ keep it
    scattered = rec.new("moe/router_scattered", (T, E), logits.dtype, logits.requires_grad)
    # sigmoid(router_scores.float()) saves its fp32 output; .to(router_scores.dtype)
    scores = rec.to(rec.unary_saving_output(rec.to(scattered, "fp32"), "moe/router_sigmoid", "fp32"),
                    logits.dtype, "moe/router_scores")
    repeated = rec.new("moe/routed_in", (E * T, h), x.dtype, x.requires_grad)
    # router_scores.transpose(0, 1).reshape(-1, 1): a contiguous copy; the product keeps both
    column = rec.new("moe/score_column", (E * T, 1), scores.dtype, scores.requires_grad)
    scaled = rec.mul(repeated, column, name="moe/routed_in_scaled")
    gate_up, down = ctx.p(f"{pre}.experts.gate_up_proj"), ctx.p(f"{pre}.experts.down_proj")
    # torch.bmm((E, T, h), (E, h, 2m)) saves both operands, as a linear does
    gu = rec.bmm(rec.view(scaled, (E, T, h)), gate_up, 2 * m, name="moe/expert_gate_up")
    act = activation(rec, rec.view(gu, (E, T, m), "moe/expert_gate"), d.hidden_act, "moe/expert_act")
    prod = rec.mul(rec.view(gu, (E, T, m), "moe/expert_up"), act, name="moe/expert_act_times_up")
    routed = rec.bmm(prod, down, h, name="moe/expert_down")
    summed = rec.new("moe/expert_sum", (T, h), routed.dtype, routed.requires_grad)
    shared = mlp_shared(rec, ctx, x, f"{pre}.shared_expert")
    return rec.add(shared, rec.view(summed, x.shape), name="moe/out")


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    return rec.embedding(ids, ctx.p("model.embed_tokens.weight"), "embed/tokens")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rms_norm(rec, ctx, x, "model.norm", "final_norm")
    w = ctx.params.get("lm_head.weight") or ctx.p("model.embed_tokens.weight")
    return rec.linear(h, w, name="logits")
