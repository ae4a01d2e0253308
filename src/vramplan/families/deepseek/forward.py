"""DeepSeek-V2 / V3 on the symbolic recorder (transformers 5.24 modeling_deepseek_v2.py,
modeling_deepseek_v3.py): Llama's pre-norm layer with multi-head latent attention and,
past `first_k_dense_replace`, routed experts plus shared experts.

Attention (DeepseekV3Attention.forward): q from q_proj or q_a_proj -> q_a_layernorm ->
q_b_proj, viewed (b, a, s, qk) and split into q_pass, q_rot (views); the compressed latent
kv_a_proj_with_mqa(x) is split into kv_nope (RMS-normed, the input kv_b_proj saves) and
k_rot; rotary on q_rot and k_rot makes new tensors and saves only the shared cos/sin
(V3 interleaved: slices * cos/sin and a cat; V2: complex multiply of fp32 copies);
`torch.cat((q_pass, q_rot))` is the contiguous query; expand_kv writes the key into a
`new_empty` (b, a, s, qk) with two copy_ and leaves value a strided view of kv_b_proj's
output. The attention output follows q's (b, a, s, .) layout, so `reshape().contiguous()`
copies it before o_proj (as for Phi and GPT-NeoX).
Legend: b micro-batch, s sequence, h hidden, a heads, qk q/k head width, r rotary width,
dv v head width, T = b * s tokens, E experts, k top-k, m expert width.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, lin, mlp_shared, rms_norm
from vramplan.components.graph import Param, Recorder, Sym
from vramplan.components.moe import combine_moment, lora_folded, without_autocast

LAYER_PREFIX = "model.layers"


def layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """DeepseekV3DecoderLayer: x + attn(norm(x)), then + mlp(norm(.)) (MoE or dense)."""
    pre = f"{LAYER_PREFIX}.{i}"
    h = rms_norm(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm")
    x = rec.add(x, attention(rec, ctx, h, i, b, s), name="attn_residual")
    # eager's attention weights, bound to `_` by the decoder layer: alive to its return (arch.py)
    held = [w for w in (ctx.shared_keys.pop("attn_weights", None),) if w is not None]
    rec.frame += held
    h = rms_norm(rec, ctx, x, f"{pre}.post_attention_layernorm", "mlp_norm")
    h = moe(rec, ctx, h, i) if i in ctx.desc.moe_layers else mlp_shared(rec, ctx, h, f"{pre}.mlp")
    del rec.frame[len(rec.frame) - len(held):]
    return rec.add(x, h, name="mlp_residual")


def attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    d, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.self_attn"
    a, qk, r, dv, kvr = d.num_heads, d.head_dim, d.rotary_dim, d.v_head_dim, d.kv_lora_rank
    if d.q_lora_rank:
        q = lin(rec, ctx, x, f"{pre}.q_a_proj", "attn/q_a")
        q = rms_norm(rec, ctx, q, f"{pre}.q_a_layernorm", "attn/q_a_norm")
        q = lin(rec, ctx, q, f"{pre}.q_b_proj", "attn/q")
    else:
        q = lin(rec, ctx, x, f"{pre}.q_proj", "attn/q")
    kv = lin(rec, ctx, x, f"{pre}.kv_a_proj_with_mqa", "attn/kv_a")
    kv_nope = rms_norm(rec, ctx, rec.view(kv, (b, s, kvr)), f"{pre}.kv_a_layernorm", "attn/kv_a_norm")
    q_rot = _rope(rec, rec.view(q, (b, a, s, r)), "attn/q_rope")
    k_rot = _rope(rec, rec.view(kv, (b, 1, s, r)), "attn/k_rope")
    query = rec.new("attn/q_cat", (b, a, s, qk), q.dtype, q.requires_grad or q_rot.requires_grad)
    kvb = lin(rec, ctx, rec.view(kv_nope, (b, 1, s, kvr)), f"{pre}.kv_b_proj", "attn/kv_b")
    key = rec.new("attn/k_expanded", (b, a, s, qk), kvb.dtype, kvb.requires_grad or k_rot.requires_grad)
    value = rec.view(kvb, (b, a, s, dv), "attn/v")
    out = _core(rec, ctx, query, key, value)
    out = rec.new("attn/core.out_t", (b, s, a * dv), out.dtype, out.requires_grad)
    return lin(rec, ctx, out, f"{pre}.o_proj", "attn/o")


def _rope(rec: Recorder, x: Sym, name: str) -> Sym:
    """Either rotary form: products with the constant cos/sin and a cat into a new tensor;
    nothing of the layer is saved (the constants are shared by all layers)."""
    return rec.new(name, x.shape, x.dtype, x.requires_grad)


def _core(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym) -> Sym:
    """The attention interface with v narrower than q and k (dv < qk).
    CUDA SDPA: the memory-efficient kernel (flash needs equal head dims) saves q, k, v,
    the output and the log-sum-exp. CPU SDPA: the fused CPU kernel needs equal head dims
    too, so torch takes `_scaled_dot_product_attention_math`, which saves q and k^T each
    scaled by sqrt(scale) (copies), the softmax and a contiguous copy of the strided v
    (computed in fp32 for 16-bit inputs), plus its dropout's noise and output.
    Eager (eager_attention_forward): matmul(q, k^T) saves q and k, softmax in fp32 back to
    q's dtype (the cast saved when 16-bit), dropout, and matmul(probs, v) folds the strided
    v into a contiguous (b*a, s, dv) copy that it saves. All seen with the exact CPU meter."""
    b, a, s, _ = q.shape
    drop = ctx.desc.attention_dropout if ctx.training_dropout else 0.0
    out_shape = (b, a, s, v.shape[-1])
    if ctx.attention != "eager" and rec.backend != "cpu":
        return rec.sdpa(q, k, v, out_shape, "attn/core", dropout=drop)
    dtype = rec.autocast or q.dtype
    if ctx.attention != "eager" and dtype in ("bf16", "fp16"):
        dtype = "fp32"  # the CPU math path upcasts 16-bit inputs
    used = (rec.new("attn/core.q_used", q.shape, dtype, True), rec.new("attn/core.k_used", k.shape, dtype, True),
            rec.new("attn/core.v_contiguous", out_shape, dtype, True))
    rec.save(*used)
    # the scores and their masked copy (the math path's causal mask add, eager's `+ mask`) beside
    # q, k, v and their copies: the layer's forward moment (CPU meter: DeepSeek-V3, b1 s512)
    scores = rec.new("attn/core.scores", (b, a, s, s), dtype, True)
    masked = rec.new("attn/core.masked", (b, a, s, s), dtype, True)
    rec.forward_moment(*rec.frame, q, k, v, *used, scores, masked)
    probs = rec.unary_saving_output(masked, "attn/core.softmax", "fp32" if ctx.attention == "eager" else dtype)
    if ctx.attention == "eager":
        probs = rec.to(probs, rec.autocast or q.dtype, name="attn/core.probs")
        rec.save(probs)
    dropped = rec.dropout(probs, drop, "attn/core.dropout")
    if drop > 0:
        rec.save(rec.new("attn/core.dropped", (b, a, s, s), probs.dtype, True))
    if ctx.attention == "eager":
        ctx.shared_keys["attn_weights"] = dropped  # returned as the attention weights
    return rec.new("attn/core.out", out_shape, rec.autocast or q.dtype, True)


def moe(rec: Recorder, ctx: Ctx, x: Sym, i: int) -> Sym:
    """DeepseekV3MoE: router, the eager expert loop (DeepseekV3Experts.forward: gather each
    expert's rows, gate_up, act * up, down, * routing weight, index_add_), plus the shared
    experts on the same input. Rows summed over experts: T * k (even routing)."""
    d, pre = ctx.desc, f"{LAYER_PREFIX}.{i}.mlp"
    m, k, h = d.moe.expert_intermediate_size, d.moe.top_k, d.hidden_size
    tokens = x.numel // h
    weights = _router(rec, ctx, x, pre, tokens)
    rows = tokens * k
    # top_k_pos and token_idx from torch.where: kept by the gather, the weight lookup and index_add_
    rec.save(rec.new("moe/token_index", (rows,), "int64", False), rec.new("moe/topk_pos", (rows,), "int64", False))
    gathered = rec.new("moe/expert_in", (rows, h), x.dtype, x.requires_grad)
    amp = without_autocast(rec)
    gate_up, down = ctx.p(f"{pre}.experts.gate_up_proj"), ctx.p(f"{pre}.experts.down_proj")
    gate_up, down = (Param(gate_up.name, (2 * m, h), gate_up.dtype, gate_up.trainable),
                     Param(down.name, (h, m), down.dtype, down.trainable))
    if gate_up.name in ctx.lora:  # PEFT's ParamWrapper on the fused experts (components/moe_lora.py)
        gate_up = lora_folded(rec, ctx, gate_up, gathered, d.moe.num_experts, "moe/lora_folded_gate_up")
    gu = rec.linear(gathered, gate_up, name="moe/expert_gate_up")
    act = activation(rec, rec.view(gu, (rows, m), "moe/expert_gate"), d.hidden_act, "moe/expert_act")
    prod = rec.mul(act, rec.view(gu, (rows, m), "moe/expert_up"), name="moe/expert_act_times_up")
    if down.name in ctx.lora:
        down = lora_folded(rec, ctx, down, prod, d.moe.num_experts, "moe/lora_folded_down")
    out = rec.linear(prod, down, name="moe/expert_down")
    rec.autocast = amp
    # top_k_weights[token_idx, top_k_pos, None]: an fp32 (rows, 1) gather; the product
    # promotes to fp32 and `.to(final_hidden_states.dtype)` casts back
    w = rec.new("moe/expert_weight", (rows, 1), weights.dtype, weights.requires_grad)
    routed = rec.to(rec.mul(out, w, name="moe/expert_weighted"), x.dtype, "moe/expert_weighted_cast")
    combine_moment(rec, out, w.dtype, w.requires_grad, x)  # the shared experts, after, read x too
    combined = rec.new("moe/combined", x.shape, x.dtype, routed.requires_grad or x.requires_grad)
    if d.moe.num_shared_experts:
        combined = rec.add(combined, mlp_shared(rec, ctx, x, f"{pre}.shared_experts"), name="moe/out")
    return combined


def _router(rec: Recorder, ctx: Ctx, x: Sym, pre: str, tokens: int) -> Sym:
    """DeepseekV3TopkRouter: F.linear(x.float(), weight.float()), sigmoid (saves its
    output), the group-limited choice (indices only), scores.gather (saves the (T, k)
    indices), / (sum + 1e-20) when norm_topk_prob, * routed_scaling_factor.
    DeepseekV2TopkRouter: softmax in fp32 (saves its output), topk (saves the indices)."""
    d, k = ctx.desc, ctx.desc.moe.top_k
    x32 = rec.to(rec.view(x, (tokens, d.hidden_size)), "fp32", "moe/router_in_fp32")
    w = ctx.p(f"{pre}.gate.weight")
    w = Param(w.name, w.shape, "fp32", w.trainable)
    if w.name in ctx.lora:
        w = lora_folded(rec, ctx, w, x32, 1, "moe/lora_folded_router")
    logits = rec.linear(x32, w, name="moe/router_logits")
    scores = rec.unary_saving_output(logits, "moe/router_sigmoid" if d.sigmoid_router else "moe/router_softmax")
    rec.save(rec.new("moe/topk_index", (tokens, k), "int64", False))
    weights = rec.new("moe/topk_weights", (tokens, k), "fp32", scores.requires_grad)
    if d.moe.norm_topk_prob:
        rec.save(weights, rec.new("moe/topk_denominator", (tokens, 1), "fp32", False))
    return rec.scale(weights, "moe/topk_scaled")


def embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    return rec.embedding(ids, ctx.p("model.embed_tokens.weight"), "embed/tokens")


def head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rms_norm(rec, ctx, x, "model.norm", "final_norm")
    w = ctx.params.get("lm_head.weight") or ctx.params.get("score.weight") or ctx.p("model.embed_tokens.weight")
    return rec.linear(h, w, name="logits")
