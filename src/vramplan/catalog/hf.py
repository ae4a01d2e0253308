"""The Hugging Face adapter of the Llama-layout decoders, GPT-2 and BERT: a `config.json`
dict -> ModelDesc (vramplan.sources.model_from_hf_config dispatches every config).

Every field is read from an explicit config key or from the default that the
transformers config class declares for that key (catalog/hf_config.py, copied from
`transformers/models/<family>/configuration_<family>.py`, transformers 5.23). Nothing
is inferred from ratios: a gated MLP comes from the family, never from
`intermediate_size / hidden_size`.

`params` lists every tensor that `AutoModelForCausalLM.from_config(cfg).named_parameters()`
yields (or `AutoModelForSequenceClassification` when `num_labels` is given; BERT is always
a classification model), with the exact module path and shape. Tied embeddings appear
once, under the input embedding, as PyTorch's named_parameters dedups shared tensors.

Shapes: nn.Linear(in, out).weight is (out, in); GPT-2's Conv1D weight is (in, out).
Legend: h hidden, a heads, k KV heads, d head_dim, f MLP width, v vocab, E experts.
"""
from __future__ import annotations

from dataclasses import replace
from vramplan.catalog.hf_config import CLASS_DEFAULTS, HFCfg, gpt2_names
from vramplan.model import MlpKind, ModelDesc, MoEDesc, NormKind, ParamEntry, PositionKind

_ROPE_DECODERS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                  "gemma", "gemma2", "gemma3_text", "phi3", "phi")
_MORE = ("gpt_neox", "bloom", "opt", "qwen", "falcon", "t5", "mt5")
"""Families built by `vramplan.catalog.hf_extended` (same rules; kept apart for file size)."""
BUILTIN_MODEL_TYPES = (*_ROPE_DECODERS, "gpt2", "bert", "gemma3", *_MORE)
"""The model types this module and hf_extended build (`gemma3`, multimodal, is read
through its `text_config`: the language model only). vramplan.sources.model_from_hf_config
dispatches every config, these and the families under vramplan/families."""

def builds(model_type: str) -> bool:
    """Whether `builtin_desc` builds this model type (the text model of a multimodal
    config is read by the dispatcher, vramplan.sources.model_from_hf_config)."""
    return model_type in _MORE or model_type in CLASS_DEFAULTS


def builtin_desc(config: dict, model_type: str, name: str, num_labels: int | None) -> ModelDesc:
    """The ModelDesc of a model type this module (or hf_extended) builds (`builds`)."""
    if model_type in _MORE:
        from vramplan.catalog.hf_extended import model_from_more
        return model_from_more(config, name, num_labels)
    if model_type == "gpt2":
        return _gpt2(HFCfg(gpt2_names(config), "gpt2"), name, num_labels)
    if model_type == "bert":
        return _bert(HFCfg(config, "bert"), name, num_labels)
    return _decoder(HFCfg(config, model_type), name, num_labels)


# ---------------------------------------------------------------- RoPE decoders
def _decoder(c: HFCfg, name: str, num_labels: int | None) -> ModelDesc:
    mt = c.model_type
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    k = c["num_key_value_heads"] or a
    # Each family's attention: `getattr(config, "head_dim", h // a)`; Mixtral/Mistral
    # treat an explicit None as absent.
    d = c["head_dim"] or h // a
    f, v = c.int("intermediate_size"), c.int("vocab_size")
    moe, moe_layers = _moe(c, L, f)
    softcap = mt in ("gemma2", "gemma3_text")
    desc = dict(
        name=name, model_type=mt, num_layers=L, hidden_size=h, num_heads=a,
        num_kv_heads=k, head_dim=d, intermediate_size=f, vocab_size=v,
        mlp=MlpKind.PLAIN if mt == "phi" else MlpKind.GATED,
        hidden_act=_activation(c), norm=NormKind.LAYERNORM if mt == "phi" else NormKind.RMSNORM,
        position=PositionKind.ROPE, max_position_embeddings=c.int("max_position_embeddings"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        qkv_bias=_qkv_bias(c), o_bias=mt == "phi" or (mt in _ATTN_BIAS_ALL and c["attention_bias"]),
        mlp_bias=mt == "phi" or (mt == "llama" and bool(c["mlp_bias"])),
        fused_qkv=mt == "phi3", fused_gate_up=mt == "phi3",
        qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text") or (mt == "phi" and c["qk_layernorm"]),
        sandwich_norm=mt in ("gemma2", "gemma3_text"),
        embed_scale=mt in ("gemma", "gemma2", "gemma3_text"),
        # Gemma2/3 only: tanh(x / cap) * cap on the final logits and on attention scores.
        final_logit_softcapping=c["final_logit_softcapping"] if softcap else None,
        attn_logit_softcapping=c["attn_logit_softcapping"] if softcap else None,
        attention_dropout=float(c["attention_dropout"]),
        hidden_dropout=float(c["resid_pdrop"]) if mt in ("phi3", "phi") else 0.0,
        # Phi3Model has no embedding dropout in transformers 5 (embd_pdrop is unused).
        embedding_dropout=float(c["embd_pdrop"]) if mt == "phi" else 0.0,
        num_labels=num_labels or 0, moe=moe, moe_layers=moe_layers,
        hub_id=c.raw.get("_name_or_path"),
    )
    desc["sliding_window"], desc["sliding_window_layers"] = _sliding(c, L)
    partial = ModelDesc(**desc)
    return _with_params(partial, _decoder_params(partial, c))


_ATTN_BIAS_ALL = ("llama", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text")
"""Families whose q/k/v/o projections all take `bias=config.attention_bias`."""


def _qkv_bias(c: HFCfg) -> bool:
    mt = c.model_type
    if mt in ("qwen2", "phi"):
        return True  # Qwen2Attention / PhiAttention: bias=True on q, k, v unconditionally
    if mt == "qwen2_moe":
        return bool(c["qkv_bias"])
    return mt in _ATTN_BIAS_ALL and bool(c["attention_bias"])


def _activation(c: HFCfg) -> str:
    if c.model_type in ("gemma2", "gemma3_text"):
        return c["hidden_activation"] or "gelu_pytorch_tanh"
    act = c["hidden_act"]
    # GemmaConfig.__post_init__ rewrites the legacy "gelu" to the tanh approximation.
    return "gelu_pytorch_tanh" if c.model_type == "gemma" and act == "gelu" else act


def _sliding(c: HFCfg, L: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers it applies to, as each config class decides."""
    mt = c.model_type
    types = c.raw.get("layer_types")
    if mt in ("qwen2", "qwen3"):
        window = c["sliding_window"] if c["use_sliding_window"] else None
        if window is None:
            return None, ()
        first = c["max_window_layers"]
        layers = tuple(i for i in range(L) if i >= first)
    elif mt in ("mistral", "mixtral", "phi3"):
        window = c["sliding_window"]
        layers = tuple(range(L)) if window else ()
    elif mt == "gemma2":
        window, layers = c["sliding_window"], tuple(i for i in range(L) if i % 2 == 0)
    elif mt == "gemma3_text":
        pattern = c["sliding_window_pattern"]
        window, layers = c["sliding_window"], tuple(i for i in range(L) if (i + 1) % pattern)
    else:
        return None, ()
    if types is not None and window:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return (window, layers) if window and layers else (None, ())


def _moe(c: HFCfg, L: int, f: int) -> tuple[MoEDesc | None, tuple[int, ...]]:
    mt = c.model_type
    if mt == "mixtral":
        # MixtralTopKRouter: softmax over all experts, top-k, renormalized to sum 1.
        moe = MoEDesc(num_experts=c.int("num_local_experts"), top_k=c.int("num_experts_per_tok"),
                      expert_intermediate_size=f, norm_topk_prob=True)
        return moe, tuple(range(L))
    if mt not in ("qwen2_moe", "qwen3_moe"):
        return None, ()
    shared = c["shared_expert_intermediate_size"] if mt == "qwen2_moe" else 0
    moe = MoEDesc(num_experts=c["num_experts"], top_k=c.int("num_experts_per_tok"),
                  expert_intermediate_size=c.int("moe_intermediate_size"),
                  num_shared_experts=1 if shared else 0, shared_intermediate_size=shared or 0,
                  norm_topk_prob=bool(c["norm_topk_prob"]))
    # Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer: which layers get a sparse block.
    only_dense, step = set(c["mlp_only_layers"] or ()), c.int("decoder_sparse_step")
    layers = tuple(i for i in range(L)
                   if i not in only_dense and moe.num_experts > 0 and (i + 1) % step == 0)
    return moe, layers


def _linear(name: str, out: int, inp: int, bias: bool, layer: int | None) -> list[ParamEntry]:
    weight = [ParamEntry(f"{name}.weight", (out, inp), layer)]
    return weight + ([ParamEntry(f"{name}.bias", (out,), layer)] if bias else [])


def _norm(name: str, dim: int, layernorm: bool, layer: int | None) -> list[ParamEntry]:
    entries = [ParamEntry(f"{name}.weight", (dim,), layer)]
    return entries + ([ParamEntry(f"{name}.bias", (dim,), layer)] if layernorm else [])


def _decoder_params(m: ModelDesc, c: HFCfg) -> list[ParamEntry]:
    ln = m.norm is NormKind.LAYERNORM
    out = [ParamEntry("model.embed_tokens.weight", (m.vocab_size, m.hidden_size))]
    for i in range(m.num_layers):
        out += _attention_params(m, c, i) + _mlp_params(m, i)
        p = f"model.layers.{i}."
        out += _norm(p + "input_layernorm", m.hidden_size, ln, i)
        if m.model_type != "phi":  # Phi runs attention and MLP in parallel off one norm
            out += _norm(p + "post_attention_layernorm", m.hidden_size, ln, i)
        if m.sandwich_norm:
            out += _norm(p + "pre_feedforward_layernorm", m.hidden_size, ln, i)
            out += _norm(p + "post_feedforward_layernorm", m.hidden_size, ln, i)
    out += _norm("model.final_layernorm" if m.model_type == "phi" else "model.norm",
                 m.hidden_size, ln, None)
    return out + _head(m, "lm_head", bias=m.model_type == "phi")


def _attention_params(m: ModelDesc, c: HFCfg, i: int) -> list[ParamEntry]:
    p, h, d = f"model.layers.{i}.self_attn.", m.hidden_size, m.head_dim
    q, kv = m.num_heads * d, m.num_kv_heads * d
    if m.fused_qkv:  # Phi3Attention: o_proj is declared before qkv_proj
        return (_linear(p + "o_proj", h, q, m.o_bias, i)
                + _linear(p + "qkv_proj", q + 2 * kv, h, m.qkv_bias, i))
    out = (_linear(p + "q_proj", q, h, m.qkv_bias, i) + _linear(p + "k_proj", kv, h, m.qkv_bias, i)
           + _linear(p + "v_proj", kv, h, m.qkv_bias, i)
           + _linear(p + ("dense" if m.model_type == "phi" else "o_proj"), h, q, m.o_bias, i))
    if m.qk_norm and m.model_type == "phi":  # PhiAttention: LayerNorm over h // a
        out += _norm(p + "q_layernorm", h // m.num_heads, True, i)
        out += _norm(p + "k_layernorm", h // m.num_heads, True, i)
    elif m.qk_norm:
        out += _norm(p + "q_norm", d, False, i) + _norm(p + "k_norm", d, False, i)
    return out


def _mlp_params(m: ModelDesc, i: int) -> list[ParamEntry]:
    p, h, f = f"model.layers.{i}.mlp.", m.hidden_size, m.intermediate_size
    if m.moe is not None and i in m.moe_layers:
        return _moe_params(m, p, i)
    if m.mlp is MlpKind.PLAIN:  # PhiMLP
        return _linear(p + "fc1", f, h, True, i) + _linear(p + "fc2", h, f, True, i)
    if m.fused_gate_up:  # Phi3MLP
        return _linear(p + "gate_up_proj", 2 * f, h, False, i) + _linear(p + "down_proj", h, f, False, i)
    return _gated(p, h, f, m.mlp_bias, i)


def _gated(p: str, h: int, f: int, bias: bool, i: int) -> list[ParamEntry]:
    return (_linear(p + "gate_proj", f, h, bias, i) + _linear(p + "up_proj", f, h, bias, i)
            + _linear(p + "down_proj", h, f, bias, i))


def _moe_params(m: ModelDesc, p: str, i: int) -> list[ParamEntry]:
    """Router `gate.weight` (E, h); experts stored as two 3-D tensors (not nn.Linear)."""
    moe, h = m.moe, m.hidden_size
    E, f = moe.num_experts, moe.expert_intermediate_size
    out = [ParamEntry(p + "gate.weight", (E, h), i),
           ParamEntry(p + "experts.gate_up_proj", (E, 2 * f, h), i),
           ParamEntry(p + "experts.down_proj", (E, h, f), i)]
    if moe.num_shared_experts:  # Qwen2MoeSparseMoeBlock: one shared SwiGLU + sigmoid gate
        out += _gated(p + "shared_expert.", h, moe.shared_intermediate_size, False, i)
        out += _linear(p + "shared_expert_gate", 1, h, False, i)
    return out


def _head(m: ModelDesc, lm_head: str, bias: bool) -> list[ParamEntry]:
    """`score` (no bias) for sequence classification, else the LM head when untied."""
    if m.num_labels:
        return _linear("score", m.num_labels, m.hidden_size, False, None)
    if m.tie_word_embeddings:
        return []
    return _linear(lm_head, m.vocab_size, m.hidden_size, bias, None)


# ---------------------------------------------------------------- GPT-2, BERT
def _gpt2(c: HFCfg, name: str, num_labels: int | None) -> ModelDesc:
    h, L, a = c.int("n_embd"), c.int("n_layer"), c.int("n_head")
    f = c["n_inner"] or 4 * h  # GPT2MLP: inner_dim = n_inner if set else 4 * n_embd
    desc = ModelDesc(
        name=name, model_type="gpt2", num_layers=L, hidden_size=h, num_heads=a, num_kv_heads=a,
        head_dim=h // a, intermediate_size=f, vocab_size=c.int("vocab_size"), mlp=MlpKind.PLAIN,
        hidden_act=c["activation_function"], norm=NormKind.LAYERNORM,
        position=PositionKind.LEARNED, max_position_embeddings=c.int("n_positions"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), qkv_bias=True, o_bias=True,
        mlp_bias=True, fused_qkv=True, attention_dropout=float(c["attn_pdrop"]), attention_dropout_module=True,
        hidden_dropout=float(c["resid_pdrop"]), embedding_dropout=float(c["embd_pdrop"]),
        num_labels=num_labels or 0, hub_id=c.raw.get("_name_or_path"))
    out = [ParamEntry("transformer.wte.weight", (desc.vocab_size, h)),
           ParamEntry("transformer.wpe.weight", (desc.max_position_embeddings, h))]
    for i in range(L):
        p = f"transformer.h.{i}."
        out += _norm(p + "ln_1", h, True, i) + _conv1d(p + "attn.c_attn", h, 3 * h, i)
        out += _conv1d(p + "attn.c_proj", h, h, i) + _norm(p + "ln_2", h, True, i)
        out += _conv1d(p + "mlp.c_fc", h, f, i) + _conv1d(p + "mlp.c_proj", f, h, i)
    out += _norm("transformer.ln_f", h, True, None) + _head(desc, "lm_head", bias=False)
    return _with_params(desc, out)


def _conv1d(name: str, inp: int, out: int, layer: int) -> list[ParamEntry]:
    """transformers.pytorch_utils.Conv1D: weight (in, out), i.e. transposed vs nn.Linear."""
    return [ParamEntry(f"{name}.weight", (inp, out), layer), ParamEntry(f"{name}.bias", (out,), layer)]


def _bert(c: HFCfg, name: str, num_labels: int | None) -> ModelDesc:
    """BertForSequenceClassification: encoder + pooler + `classifier` (with bias)."""
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    f, v = c.int("intermediate_size"), c.int("vocab_size")
    labels = num_labels or c.raw.get("num_labels") or len(c.raw.get("id2label") or {}) or c["num_labels"]
    drop = float(c["hidden_dropout_prob"])
    desc = ModelDesc(
        name=name, model_type="bert", is_encoder=True, num_layers=L, hidden_size=h, num_heads=a,
        num_kv_heads=a, head_dim=h // a, intermediate_size=f, vocab_size=v, mlp=MlpKind.PLAIN,
        hidden_act=c["hidden_act"], norm=NormKind.LAYERNORM, position=PositionKind.LEARNED,
        max_position_embeddings=c.int("max_position_embeddings"), tie_word_embeddings=False,
        qkv_bias=True, o_bias=True, mlp_bias=True,
        attention_dropout=float(c["attention_probs_dropout_prob"]), hidden_dropout=drop,
        embedding_dropout=drop, num_labels=labels, hub_id=c.raw.get("_name_or_path"))
    e = "bert.embeddings."
    out = [ParamEntry(e + "word_embeddings.weight", (v, h)),
           ParamEntry(e + "position_embeddings.weight", (desc.max_position_embeddings, h)),
           ParamEntry(e + "token_type_embeddings.weight", (c.int("type_vocab_size"), h))]
    out += _norm(e + "LayerNorm", h, True, None)
    for i in range(L):
        p = f"bert.encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            out += _linear(f"{p}attention.self.{proj}", h, h, True, i)
        out += _linear(p + "attention.output.dense", h, h, True, i)
        out += _norm(p + "attention.output.LayerNorm", h, True, i)
        out += _linear(p + "intermediate.dense", f, h, True, i)
        out += _linear(p + "output.dense", h, f, True, i) + _norm(p + "output.LayerNorm", h, True, i)
    out += _linear("bert.pooler.dense", h, h, True, None)
    return _with_params(desc, out + _linear("classifier", labels, h, True, None))


def _with_params(desc: ModelDesc, params: list[ParamEntry]) -> ModelDesc:
    return replace(desc, params=tuple(params))


# Public name for the family adapters under vramplan/families that start from the Llama-layout
# decoder (families/phi/adapter.py): the decoder's ModelDesc.
decoder_desc = _decoder
