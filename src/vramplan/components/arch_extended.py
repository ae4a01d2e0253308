"""GPT-NeoX, BLOOM, OPT and Qwen-1 forwards on the symbolic recorder.

Each function names the transformers 5.23 modeling code it mirrors, op for op where the op
allocates or saves. The facts ModelDesc has no field for (partial rotary, parallel
residual, ALiBi, OPT's post-norm and embedding projection) come from
`vramplan.catalog.hf_extended.ExtendedDesc`.
Legend: b micro-batch, s sequence, h hidden, a heads, d head_dim, r rotary dims, f MLP width.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, attention_core, eager_attention, lin, rms_norm
from vramplan.components.graph import Recorder, Sym

MORE_LAYER_PREFIX = {"gpt_neox": "gpt_neox.layers", "bloom": "transformer.h",
                     "opt": "model.decoder.layers", "qwen": "transformer.h", "falcon": "transformer.h"}



def _ln(rec: Recorder, ctx: Ctx, x: Sym, module: str, name: str) -> Sym:
    return rec.layer_norm(x, ctx.p(module + ".weight"), name)


def mlp_act(rec: Recorder, x: Sym, kind: str) -> Sym:
    """The plain MLP's activation, named `mlp/act` (its output is fc2's saved input).
    relu saves its result (derivatives.yaml: threshold_backward(grad, result, 0)), which is
    the tensor fc2 saves anyway; BLOOM's GeLUFunction saves its input (ctx.save_for_backward)."""
    if kind == "relu":
        return rec.unary_saving_output(x, "mlp/act")
    if kind == "bloom_gelu":
        return rec.unary_saving_input(x, "mlp/act")
    return activation(rec, x, kind, "mlp/act")


# --- rotary on the first r channels (GPT-NeoX, Qwen-1) ---------------------------------------
def partial_rotary(rec: Recorder, ctx: Ctx, s: int) -> tuple[Sym, Sym]:
    """GPTNeoXRotaryEmbedding.forward: cos, sin of shape (1, s, r) in the hidden dtype, made
    once per forward; `rotary/` names keep them out of the per-layer lists."""
    if "cos" not in ctx.shared:
        r = ctx.desc.rotary_dim
        ctx.shared["cos"] = rec.new("rotary/cos", (1, s, r), ctx.act_dtype, False)
        ctx.shared["sin"] = rec.new("rotary/sin", (1, s, r), ctx.act_dtype, False)
    return ctx.shared["cos"], ctx.shared["sin"]


def apply_partial_rope(rec: Recorder, x: Sym, cos: Sym, sin: Sym, name: str) -> Sym:
    """modeling_gpt_neox.py apply_rotary_pos_emb: x_rot * cos + rotate_half(x_rot) * sin on
    the first r channels (multiplications by the constant cos/sin save only them), then
    cat([x_embed, x_pass]) into a new (b, a, s, d) tensor."""
    r = cos.shape[-1]
    x_rot = rec.view(x, x.shape[:-1] + (r,), f"{name}.rot")
    a = rec.mul(x_rot, cos, name=f"{name}.cos")
    rotated = rec.new(f"{name}.rotate_half", x_rot.shape, x.dtype, x.requires_grad)
    embed = rec.add(a, rec.mul(rotated, sin, name=f"{name}.sin"), name=f"{name}.embed")
    return rec.new(name, x.shape, embed.dtype, embed.requires_grad)


# --- GPT-NeoX: models/gpt_neox/modeling_gpt_neox.py ------------------------------------------
def gpt_neox_layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """GPTNeoXLayer: attn(ln1(x)) with dropout, then either x + attn + mlp(ln2(x))
    (use_parallel_residual) or the sequential pre-norm form."""
    desc, pre = ctx.desc, f"gpt_neox.layers.{i}"
    drop = ctx.module_p(desc.hidden_dropout)
    attn = rec.dropout(gpt_neox_attention(rec, ctx, _ln(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm"), i, b, s),
                       drop, "attn/resid_dropout")
    if desc.parallel_residual:
        mlp_in = x
    else:
        attn = mlp_in = rec.add(attn, x, name="attn_residual")
    h = _ln(rec, ctx, mlp_in, f"{pre}.post_attention_layernorm", "mlp_norm")
    h = lin(rec, ctx, h, f"{pre}.mlp.dense_h_to_4h", "mlp/fc")
    h = lin(rec, ctx, mlp_act(rec, h, desc.hidden_act), f"{pre}.mlp.dense_4h_to_h", "mlp/proj")
    h = rec.dropout(h, drop, "mlp/dropout")
    out = rec.add(h, attn, name="mlp_residual")
    return rec.add(out, x, name="residual") if desc.parallel_residual else out


def gpt_neox_attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """GPTNeoXAttention: query_key_value viewed (b, s, a, 3d), transposed and chunked into
    q, k, v (views of one output); rotary on q and k, whose torch.cat makes them
    contiguous (b, a, s, d); the attention interface; dense.
    Layouts that cost memory (seen with the exact CPU meter, torch 2.13):
    SDPA saves v as the strided view, i.e. the whole (b, s, 3h) qkv output; its output
    follows q's (b, a, s, d) layout, so `transpose(1, 2).contiguous()` copies it and dense
    saves the copy. Eager: matmul(probs, v) folds v to (b*a, s, d), a copy it saves."""
    desc, pre = ctx.desc, f"gpt_neox.layers.{i}.attention"
    a, d = desc.num_heads, desc.head_dim
    qkv = lin(rec, ctx, x, f"{pre}.query_key_value", "attn/qkv")
    q, k, v = (rec.view(qkv, (b, a, s, d), f"attn/{n}") for n in "qkv")
    return rotary_cat_attention(rec, ctx, q, k, v, b, s, f"{pre}.dense", fold_v_for_eager=True)


def rotary_cat_attention(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym, b: int, s: int,
                         out_proj: str, fold_v_for_eager: bool = False) -> Sym:
    """Partial rotary on q and k, whose torch.cat makes them contiguous (b, a, s, d); the
    attention interface; the output projection `out_proj` (GPT-NeoX, Phi, GLM-4). SDPA's
    output follows q's layout, so `transpose(1, 2).contiguous()` copies it and the
    projection saves the copy. `fold_v_for_eager`: eager matmul(probs, v) folds a strided v
    (GPT-NeoX's view of the fused qkv) to (b*a, s, d), a copy it saves."""
    a, d = ctx.desc.num_heads, ctx.desc.head_dim
    cos, sin = partial_rotary(rec, ctx, s)
    q = apply_partial_rope(rec, q, cos, sin, "attn/q_rope")
    k = apply_partial_rope(rec, k, cos, sin, "attn/k_rope")
    if ctx.attention == "eager":
        if fold_v_for_eager:
            v = rec.new("attn/v_folded", v.shape, v.dtype, v.requires_grad)
        out = eager_attention(rec, ctx, q, k, v, "attn/core")
    else:
        out = attention_core(rec, ctx, q, k, v, "attn/core")
        out = rec.new("attn/core.out_t", (b, s, a, d), out.dtype, out.requires_grad)
    return lin(rec, ctx, rec.view(out, (b, s, a * d)), out_proj, "attn/o")


def gpt_neox_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """GPTNeoXModel.forward: embed_in, emb_dropout (p = hidden_dropout)."""
    x = rec.embedding(ids, ctx.p("gpt_neox.embed_in.weight"), "embed/tokens")
    return rec.dropout(x, ctx.module_p(ctx.desc.embedding_dropout), "embed/dropout")


def gpt_neox_head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = _ln(rec, ctx, x, "gpt_neox.final_layer_norm", "final_norm")
    head = ctx.params.get("lm_head.weight") or ctx.p("gpt_neox.embed_in.weight")
    return rec.linear(h, head, name="logits")


# --- BLOOM: models/bloom/modeling_bloom.py ----------------------------------------------------
def bloom_block(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """BloomBlock: ln1, attention + dropout_add(residual), ln2, MLP + dropout_add(residual);
    the residual is the block input, or the norm output under
    apply_residual_connection_post_layernorm."""
    desc, pre = ctx.desc, f"transformer.h.{i}"
    drop = ctx.module_p(desc.hidden_dropout)
    ln1 = _ln(rec, ctx, x, f"{pre}.input_layernorm", "attn_norm")
    attn = rec.dropout(bloom_attention(rec, ctx, ln1, i, b, s), drop, "attn/resid_dropout")
    attn = rec.add(attn, x if desc.pre_norm else ln1, name="attn_residual")
    ln2 = _ln(rec, ctx, attn, f"{pre}.post_attention_layernorm", "mlp_norm")
    h = lin(rec, ctx, ln2, f"{pre}.mlp.dense_h_to_4h", "mlp/fc")
    h = lin(rec, ctx, mlp_act(rec, h, "bloom_gelu"), f"{pre}.mlp.dense_4h_to_h", "mlp/proj")
    h = rec.dropout(h, drop, "mlp/dropout")
    return rec.add(h, attn if desc.pre_norm else ln2, name="mlp_residual")


def bloom_attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """BloomAttention (its own eager code whatever attn_implementation says): q, k, v are
    strided views of query_key_value reshaped to (b*a, s, d), i.e. copies;
    alibi.baddbmm(q, k^T) saves both; + causal mask; softmax in fp32 (saved), back to q's
    dtype, dropout; bmm with v saves the probabilities and v; _merge_heads copies the
    context to (b, s, h), which dense saves."""
    desc, pre = ctx.desc, f"transformer.h.{i}.self_attention"
    a, d = desc.num_heads, desc.head_dim
    qkv = lin(rec, ctx, x, f"{pre}.query_key_value", "attn/qkv")
    mm = rec.autocast or qkv.dtype
    q, k, v = (rec._autocast_input(rec.new(f"attn/{n}", (b * a, s, d), qkv.dtype, qkv.requires_grad))
               for n in "qkv")
    rec.save(q, k)
    scores = rec.new("attn/scores", (b, a, s, s), mm, True)
    scores = rec.new("attn/masked", scores.shape, mm, True)
    probs32 = rec.unary_saving_output(rec.to(scores, "fp32"), "attn/softmax", "fp32")
    probs = rec.to(probs32, q.dtype, name="attn/probs")
    probs = rec._autocast_input(rec.dropout(probs, ctx.module_p(desc.attention_dropout), "attn/dropout"))
    rec.save(probs, v)
    rec.new("attn/context", (b * a, s, d), mm, True)
    merged = rec.new("attn/merged", (b, s, a * d), mm, True)
    return lin(rec, ctx, merged, f"{pre}.dense", "attn/o")


def bloom_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """BloomModel.forward: word_embeddings then word_embeddings_layernorm; the ALiBi tensor
    (b*a, 1, s) is not saved (baddbmm does not save its `self`)."""
    x = rec.embedding(ids, ctx.p("transformer.word_embeddings.weight"), "embed/tokens")
    return _ln(rec, ctx, x, "transformer.word_embeddings_layernorm", "embed/norm")


def bloom_head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = _ln(rec, ctx, x, "transformer.ln_f", "final_norm")
    head = ctx.params.get("lm_head.weight") or ctx.p("transformer.word_embeddings.weight")
    return rec.linear(h, head, name="logits")


# --- OPT: models/opt/modeling_opt.py ----------------------------------------------------------
def opt_layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """OPTDecoderLayer: (pre-norm) attention, dropout, residual, (post-norm); the same around
    fc1 -> activation -> fc2. `dropout` applies to both outputs."""
    desc, pre = ctx.desc, f"model.decoder.layers.{i}"
    drop = ctx.module_p(desc.hidden_dropout)
    h = _ln(rec, ctx, x, f"{pre}.self_attn_layer_norm", "attn_norm") if desc.pre_norm else x
    h = rec.dropout(opt_attention(rec, ctx, h, i, b, s), drop, "attn/resid_dropout")
    x = rec.add(x, h, name="attn_residual")
    if not desc.pre_norm:
        x = _ln(rec, ctx, x, f"{pre}.self_attn_layer_norm", "attn_norm")
    h = _ln(rec, ctx, x, f"{pre}.final_layer_norm", "mlp_norm") if desc.pre_norm else x
    h = lin(rec, ctx, h, f"{pre}.fc1", "mlp/fc")
    h = lin(rec, ctx, mlp_act(rec, h, desc.hidden_act), f"{pre}.fc2", "mlp/proj")
    x = rec.add(x, rec.dropout(h, drop, "mlp/dropout"), name="mlp_residual")
    return x if desc.pre_norm else _ln(rec, ctx, x, f"{pre}.final_layer_norm", "mlp_norm")


def opt_attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """OPTAttention: q_proj(x) * scaling (a new tensor), k and v projections, each viewed
    (b, a, s, d); the attention interface with scaling 1; out_proj."""
    desc, pre = ctx.desc, f"model.decoder.layers.{i}.self_attn"
    a, d = desc.num_heads, desc.head_dim
    q = rec.scale(lin(rec, ctx, x, f"{pre}.q_proj", "attn/q"), "attn/q_scaled")
    q, k, v = (rec.view(t, (b, a, s, d)) for t in
               (q, lin(rec, ctx, x, f"{pre}.k_proj", "attn/k"), lin(rec, ctx, x, f"{pre}.v_proj", "attn/v")))
    if ctx.attention == "eager":
        out = eager_attention(rec, ctx, q, k, v, "attn/core")
    else:
        out = attention_core(rec, ctx, q, k, v, "attn/core")
    return lin(rec, ctx, rec.view(out, (b, s, a * d)), f"{pre}.out_proj", "attn/o")


def opt_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """OPTDecoder.forward: embed_tokens, project_in, + embed_positions(cumsum positions + 2);
    both embeddings save their (b, s) int64 indices; no embedding dropout."""
    d = "model.decoder."
    x = rec.embedding(ids, ctx.p(d + "embed_tokens.weight"), "embed/tokens")
    pos = rec.new("position_ids", ids.shape, "int64", False)
    xp = rec.embedding(pos, ctx.p(d + "embed_positions.weight"), "embed/positions")
    if d + "project_in.weight" in ctx.params:
        x = lin(rec, ctx, x, d + "project_in", "embed/project_in")
    return rec.add(x, xp, name="embed/sum")


def opt_head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    d = "model.decoder."
    if d + "final_layer_norm.weight" in ctx.params:
        x = _ln(rec, ctx, x, d + "final_layer_norm", "final_norm")
    if d + "project_out.weight" in ctx.params:
        x = lin(rec, ctx, x, d + "project_out", "project_out")
    head = ctx.params.get("lm_head.weight") or ctx.p(d + "embed_tokens.weight")
    return rec.linear(x, head, name="logits")


# --- Qwen-1: Qwen/Qwen-7B modeling_qwen.py (remote code), on the Llama forward ----------------
def qwen_block(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """QWenBlock, modelled as LlamaDecoderLayer (arch.llama_layer) with Qwen-1's names:
    RMSNorm ln_1, fused c_attn (q, k, v views), rotary, attention, c_proj; RMSNorm ln_2,
    w1 * silu(w2), c_proj. Not measured: transformers has no Qwen-1 class, and the remote
    code's attention path (flash-attn, its own softmax, or SDPA by version) is assumed
    to save what transformers' SDPA saves."""
    desc, pre = ctx.desc, f"transformer.h.{i}"
    a, d = desc.num_heads, desc.head_dim
    h = rms_norm(rec, ctx, x, f"{pre}.ln_1", "attn_norm")
    qkv = lin(rec, ctx, h, f"{pre}.attn.c_attn", "attn/qkv")
    q, k, v = (rec.view(qkv, (b, a, s, d), f"attn/{n}") for n in "qkv")
    cos, sin = partial_rotary(rec, ctx, s)
    q = apply_partial_rope(rec, q, cos, sin, "attn/q_rope")
    k = apply_partial_rope(rec, k, cos, sin, "attn/k_rope")
    out = attention_core(rec, ctx, q, k, v, "attn/core")
    h = lin(rec, ctx, rec.view(out, (b, s, a * d)), f"{pre}.attn.c_proj", "attn/o")
    x = rec.add(x, h, name="attn_residual")
    h = rms_norm(rec, ctx, x, f"{pre}.ln_2", "mlp_norm")
    up = lin(rec, ctx, h, f"{pre}.mlp.w1", "mlp/up")
    act = activation(rec, lin(rec, ctx, h, f"{pre}.mlp.w2", "mlp/gate"), "silu", "mlp/act")
    prod = rec.mul(up, act, name="mlp/act_times_up")
    return rec.add(x, lin(rec, ctx, prod, f"{pre}.mlp.c_proj", "mlp/down"), name="mlp_residual")


def qwen_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    x = rec.embedding(ids, ctx.p("transformer.wte.weight"), "embed/tokens")
    return rec.dropout(x, ctx.module_p(ctx.desc.embedding_dropout), "embed/dropout")


def qwen_head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rms_norm(rec, ctx, x, "transformer.ln_f", "final_norm")
    head = ctx.params.get("lm_head.weight") or ctx.p("transformer.wte.weight")
    return rec.linear(h, head, name="logits")


# --- Falcon: models/falcon/modeling_falcon.py (rotary; alibi=False) ---------------------------
def falcon_layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """FalconDecoderLayer: attention and MLP off one norm (Falcon-7B), off ln_attn / ln_mlp
    (new decoder architecture), or sequential with dropout_add between; the MLP output
    gets the attention output added in place, then dropout_add(residual)."""
    desc, pre = ctx.desc, f"transformer.h.{i}"
    two = desc.parallel_residual and desc.num_layer_norms == 2
    attn_in = _ln(rec, ctx, x, f"{pre}.{'ln_attn' if two else 'input_layernorm'}", "attn_norm")
    attn = falcon_attention(rec, ctx, attn_in, i, b, s)
    if not desc.parallel_residual:
        x = rec.add(rec.dropout(attn, ctx.module_p(desc.attention_dropout), "attn/resid_dropout"), x,
                    name="attn_residual")
        mlp_in = _ln(rec, ctx, x, f"{pre}.post_attention_layernorm", "mlp_norm")
    else:
        mlp_in = _ln(rec, ctx, x, f"{pre}.ln_mlp", "mlp_norm") if two else attn_in
    h = lin(rec, ctx, mlp_in, f"{pre}.mlp.dense_h_to_4h", "mlp/fc")
    h = lin(rec, ctx, mlp_act(rec, h, desc.hidden_act), f"{pre}.mlp.dense_4h_to_h", "mlp/proj")
    h = rec.dropout(h, ctx.module_p(desc.hidden_dropout), "mlp/dropout")  # `+= attn` is in place
    return rec.add(h, x, name="mlp_residual")


def falcon_attention(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """FalconAttention: _split_heads then `transpose(1, 2).reshape` copy q, k and v to
    contiguous (b, heads, s, d) (multi-query k, v have one head; the new architecture
    broadcasts k, v to all heads); llama rotary on q and k; then attention, whose output
    _merge_heads' reshape copies to (b, s, h) for dense."""
    desc, pre = ctx.desc, f"transformer.h.{i}.self_attention"
    a, d = desc.num_heads, desc.head_dim
    kv = 1 if desc.num_kv_heads == 1 else a
    qkv = lin(rec, ctx, x, f"{pre}.query_key_value", "attn/qkv")
    q, k, v = (rec.new(f"attn/{n}", (b, heads, s, d), qkv.dtype, qkv.requires_grad)
               for n, heads in (("q", a), ("k", kv), ("v", kv)))
    mha = kv == a and not desc.grouped_qkv
    if mha:  # (b, s, a, 3, d) views: `reshape` to the same shape keeps them views of qkv
        q, k, v = (rec.view(qkv, (b, a, s, d), f"attn/{n}") for n in "qkv")
    cos, sin = partial_rotary(rec, ctx, s)
    q = apply_partial_rope(rec, q, cos, sin, "attn/q_rope")
    k = apply_partial_rope(rec, k, cos, sin, "attn/k_rope")
    if kv == 1 or ctx.attention == "eager":
        out = falcon_broadcast_attention(rec, ctx, q, k, v)
    else:
        # FalconModel always materializes the causal mask (allow_is_causal_skip=False)
        if mha:  # measured: this path saves a (b, 1, s, s) float mask per layer
            rec.save(rec.new("attn/mask", (b, 1, s, s), rec.autocast or q.dtype, False))
        out = rec.sdpa(q, k, v, (b, s, a, d), "attn/core")
    merged = (rec.view(out, (b, s, a * d)) if mha and kv != 1 and ctx.attention != "eager"
              else rec.new("attn/merged", (b, s, a * d), out.dtype, out.requires_grad))
    return lin(rec, ctx, merged, f"{pre}.dense", "attn/o")


def falcon_broadcast_attention(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym) -> Sym:
    """Eager (q @ k^T, softmax in the hidden dtype, @ v), or SDPA with one k/v head: without
    enable_gqa torch takes the math path (aten _scaled_dot_product_attention_math), which on
    CPU computes bf16/fp16 in fp32 and saves scaled q, k, the softmax and v. Either way
    matmul broadcasts the one-head k and v by an expand + reshape that copies them to all
    a heads, and those copies are what is saved (seen with the exact CPU meter)."""
    b, a, s, d = q.shape
    dtype = q.dtype
    if ctx.attention != "eager" and rec.backend == "cpu" and dtype in ("bf16", "fp16"):
        dtype = "fp32"
    full = (b, a, s, d)
    rec.save(rec.new("attn/q_used", full, dtype, True) if dtype != q.dtype or ctx.attention != "eager" else q,
             rec.new("attn/k_broadcast", full, dtype, True), rec.new("attn/v_broadcast", full, dtype, True))
    rec.save(rec.new("attn/softmax", (b, a, s, s), dtype, True))
    return rec.new("attn/out", full, q.dtype, True)


def falcon_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """FalconModel.forward: word_embeddings, no dropout."""
    return rec.embedding(ids, ctx.p("transformer.word_embeddings.weight"), "embed/tokens")


MORE_LAYERS = {"gpt_neox": gpt_neox_layer, "bloom": bloom_block, "opt": opt_layer, "qwen": qwen_block,
               "falcon": falcon_layer}
MORE_EMBEDS = {"gpt_neox": gpt_neox_embed, "bloom": bloom_embed, "opt": opt_embed, "qwen": qwen_embed,
               "falcon": falcon_embed}
MORE_HEADS = {"gpt_neox": gpt_neox_head, "bloom": bloom_head, "opt": opt_head, "qwen": qwen_head,
              "falcon": bloom_head}
