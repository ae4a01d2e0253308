"""GPT-2 and BERT on the symbolic recorder (transformers 5.x models/gpt2, models/bert).

GPT2Block is pre-norm with LayerNorm; c_attn is one Conv1D giving q, k and v as views of
one (T, 3h) output; dropout on embeddings (embd_pdrop), attention output and MLP output
(resid_pdrop); the MLP activation is NewGELUActivation written in Python ops.
"""
from __future__ import annotations

from vramplan.components.arch import Ctx, activation, attention_core, input_hook, lin, llama_layer
from vramplan.components.arch_extended import MORE_EMBEDS, MORE_HEADS, MORE_LAYER_PREFIX, MORE_LAYERS
from vramplan.components.graph import Recorder, Sym
from vramplan.model import ModelDesc


OTHER_MODEL_TYPES = frozenset({"gpt2", "bert", *MORE_LAYERS})
"""Families whose embedding and head are not Llama's (dispatched by other_embed/other_head)."""


def family_forward(desc: ModelDesc):
    """The forward module a family's description brings (LAYER_PREFIX, layer, embed, head,
    optionally backward_peak): a family with a folder under vramplan/families describes its
    model with a FamilyDesc, whose `family_forward` is that folder's forward.py (the family
    depends on components/, never the reverse). None for the architectures recorded here
    and in components/arch*.py."""
    return getattr(desc, "family_forward", None)


def is_other(desc: ModelDesc) -> bool:
    """Whether the embedding and head are not Llama's: other_embed / other_head record them."""
    return desc.model_type in OTHER_MODEL_TYPES or family_forward(desc) is not None


def layer_prefix(desc: ModelDesc) -> str:
    if family_forward(desc) is not None:
        return family_forward(desc).LAYER_PREFIX
    return {"gpt2": "transformer.h", "bert": "bert.encoder.layer", **MORE_LAYER_PREFIX}.get(desc.model_type, "model.layers")


def layer_fn(desc: ModelDesc):
    if family_forward(desc) is not None:
        return family_forward(desc).layer
    return {"gpt2": gpt2_block, "bert": bert_layer, **MORE_LAYERS}.get(desc.model_type, llama_layer)


def other_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    if family_forward(ctx.desc) is not None:
        return family_forward(ctx.desc).embed(rec, ctx, ids)
    if ctx.desc.model_type in MORE_EMBEDS:
        return MORE_EMBEDS[ctx.desc.model_type](rec, ctx, ids)
    return bert_embed(rec, ctx, ids) if ctx.desc.model_type == "bert" else gpt2_embed(rec, ctx, ids)


def other_head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    if family_forward(ctx.desc) is not None:
        return family_forward(ctx.desc).head(rec, ctx, x)
    if ctx.desc.model_type in MORE_HEADS:
        return MORE_HEADS[ctx.desc.model_type](rec, ctx, x)
    return bert_head(rec, ctx, x) if ctx.desc.model_type == "bert" else gpt2_head(rec, ctx, x)


def gpt2_block(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    desc = ctx.desc
    pre = f"transformer.h.{i}"
    drop = ctx.module_p(desc.hidden_dropout)
    h = rec.layer_norm(x, ctx.p(f"{pre}.ln_1.weight"), "attn_norm")
    qkv = lin(rec, ctx, h, f"{pre}.attn.c_attn", "attn/qkv")
    a, d = desc.num_heads, desc.head_dim
    q, k, v = (rec.view(qkv, (b, a, s, d), f"attn/{n}") for n in "qkv")
    out = attention_core(rec, ctx, q, k, v, "attn/core")
    out = lin(rec, ctx, rec.view(out, (b, s, a * d)), f"{pre}.attn.c_proj", "attn/o")
    out = rec.dropout(out, drop, "attn/resid_dropout")
    x = rec.add(out, x, name="attn_residual")
    normed = rec.layer_norm(x, ctx.p(f"{pre}.ln_2.weight"), "mlp_norm")
    rec.frame += [out, x, normed]  # GPT2Block.forward's locals through the MLP
    h = lin(rec, ctx, normed, f"{pre}.mlp.c_fc", "mlp/fc")
    h = activation(rec, h, desc.hidden_act, "mlp/act")
    h = lin(rec, ctx, h, f"{pre}.mlp.c_proj", "mlp/proj")
    del rec.frame[-3:]
    h = rec.dropout(h, drop, "mlp/dropout")
    y = rec.add(x, h, name="mlp_residual")
    # GPT2Block.forward's locals live to its return: `attn_output`, the residual, ln_2's output
    # (rebound only by the last add) and `feed_forward_hidden_states`, beside the new sum
    rec.forward_moment(out, x, normed, h, y)
    return y


def gpt2_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    tok = rec.embedding(ids, ctx.p("transformer.wte.weight"), "embed/tokens")
    x = input_hook(ctx, tok)
    pos = rec.new("position_ids", (1, ids.shape[1]), "int64", False)
    xp = rec.embedding(pos, ctx.p("transformer.wpe.weight"), "embed/positions")
    # GPT2Model.forward keeps `inputs_embeds` and `position_embeds` as locals while the blocks
    # run (modeling_gpt2.py: `hidden_states = inputs_embeds + position_embeds`); a hooked leaf
    # is counted as the embedding stage keeps it (components/activations.py)
    ctx.shared_keys["model_locals"] = [(t.name, t.storage.nbytes) for t in ((xp,) if x is not tok else (x, xp))]
    x = rec.add(x, xp, name="embed/sum")
    return rec.dropout(x, ctx.module_p(ctx.desc.embedding_dropout), "embed/dropout")


def gpt2_head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    h = rec.layer_norm(x, ctx.p("transformer.ln_f.weight"), "final_norm")
    head = ctx.params.get("lm_head.weight") or ctx.p("transformer.wte.weight")
    return rec.linear(h, head, name="logits")


# --- BERT (transformers 5.x models/bert/modeling_bert.py), post-norm encoder -----------------

def bert_layer(rec: Recorder, ctx: Ctx, x: Sym, i: int, b: int, s: int) -> Sym:
    """BertLayer: self-attention, dense + dropout + LayerNorm(h + x), then the
    intermediate dense + GELU and output dense + dropout + LayerNorm(h + attn_out)."""
    desc = ctx.desc
    pre = f"bert.encoder.layer.{i}"
    drop = ctx.module_p(desc.hidden_dropout)
    a, d = desc.num_heads, desc.head_dim
    q, k, v = (rec.view(lin(rec, ctx, x, f"{pre}.attention.self.{n}", f"attn/{n}"), (b, a, s, d))
               for n in ("query", "key", "value"))
    if ctx.attention == "eager":
        out = bert_eager_attention(rec, ctx, q, k, v)
    else:
        out = attention_core(rec, ctx, q, k, v, "attn/core")
    h = lin(rec, ctx, rec.view(out, (b, s, a * d)), f"{pre}.attention.output.dense", "attn/o")
    h = rec.dropout(h, drop, "attn/dropout")
    x = rec.layer_norm(rec.add(h, x, name="attn_residual"), ctx.p(f"{pre}.attention.output.LayerNorm.weight"),
                       "attn_norm")
    h = lin(rec, ctx, x, f"{pre}.intermediate.dense", "mlp/fc")
    act = activation(rec, h, desc.hidden_act, "mlp/act")
    h = lin(rec, ctx, act, f"{pre}.output.dense", "mlp/proj")
    h = rec.dropout(h, drop, "mlp/dropout")
    summed = rec.add(h, x, name="mlp_residual")
    y = rec.layer_norm(summed, ctx.p(f"{pre}.output.LayerNorm.weight"), "mlp_norm")
    # BertLayer.feed_forward_chunk holds `attention_output` and `intermediate_output` to its
    # return, BertOutput.forward its dropped dense output until the LayerNorm returns (with a
    # frozen output.dense nothing saves the intermediate output: CPU meter, a LoRA classifier's
    # last layer holds its GELU output at the forward's peak)
    rec.forward_moment(x, act, h, summed, y)
    return y


def bert_eager_attention(rec: Recorder, ctx: Ctx, q: Sym, k: Sym, v: Sym) -> Sym:
    """matmul(q, k^T) * scaling (+ mask), softmax (fp32 under CUDA autocast: softmax is on
    autocast's fp32 list), dropout, matmul with v, transpose(1, 2).contiguous()."""
    b, a, s, d = q.shape
    mm_dtype = rec.autocast or q.dtype
    q, k, v = (rec._autocast_input(t) for t in (q, k, v))
    rec.save(q, k)
    scores = rec.scale(rec.new("attn/scores", (b, a, s, s), mm_dtype, True), "attn/scaled")
    soft_dtype = "fp32" if rec.autocast and rec.backend == "cuda" else scores.dtype
    probs = rec.unary_saving_output(rec.to(scores, soft_dtype), "attn/softmax", soft_dtype)
    probs = rec.dropout(probs, ctx.module_p(ctx.desc.attention_dropout), "attn/probs_dropout")
    probs = rec._autocast_input(probs)
    rec.save(probs, v)
    rec.new("attn/out", (b, a, s, d), mm_dtype, True)
    return rec.new("attn/out_t", (b, s, a, d), mm_dtype, True)


def bert_embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    """word + token_type + position embeddings, LayerNorm, dropout."""
    pre = "bert.embeddings"
    x = input_hook(ctx, rec.embedding(ids, ctx.p(f"{pre}.word_embeddings.weight"), "embed/tokens"))
    tt = rec.new("token_type_ids", ids.shape, "int64", False)
    x = rec.add(x, rec.embedding(tt, ctx.p(f"{pre}.token_type_embeddings.weight"), "embed/token_types"), name="embed/sum")
    pos = rec.new("position_ids", (1, ids.shape[1]), "int64", False)
    x = rec.add(x, rec.embedding(pos, ctx.p(f"{pre}.position_embeddings.weight"), "embed/positions"), name="embed/sum2")
    x = rec.layer_norm(x, ctx.p(f"{pre}.LayerNorm.weight"), "embed/norm")
    return rec.dropout(x, ctx.module_p(ctx.desc.hidden_dropout), "embed/dropout")


def bert_head(rec: Recorder, ctx: Ctx, x: Sym) -> Sym:
    """BertPooler (dense + tanh on the first token), dropout, classifier."""
    b, h = x.shape[0], x.shape[-1]
    first = rec.new("pool/first_token", (b, h), x.dtype, x.requires_grad)
    pooled = rec.unary_saving_output(lin(rec, ctx, first, "bert.pooler.dense", "pool/dense"), "pool/tanh")
    pooled = rec.dropout(pooled, ctx.module_p(ctx.desc.hidden_dropout), "pool/dropout")
    return lin(rec, ctx, pooled, "classifier", "logits")
