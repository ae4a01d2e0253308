"""Baichuan 2 config -> ModelDesc (BaichuanForCausalLM of the baichuan-inc/Baichuan2-*
repositories' modeling_baichuan.py; transformers has no class for it, and vramplan never
runs repository code: names and shapes are read from that file).

Both sizes: BaichuanAttention `W_pack` = Linear(h, 3h, bias=False) and `o_proj`; MLP
gate_proj, up_proj, down_proj (no bias); RMSNorm input_layernorm, post_attention_layernorm,
model.norm; embed_tokens; `lm_head` a NormHead (one (v, h) weight, normalized in every
training forward). head_dim = h // a, no grouped KV heads.
The 7B and 13B repositories ship different modeling files under one model_type: the 7B's
rotates q and k (RotaryEmbedding, base 10000, cos/sin cached per layer for
max_position_embeddings), the 13B's adds ALiBi biases. A config does not name its file, so
`position_embedding_type` ("rope" | "alibi", as Baichuan's later models name it) decides
when present, else the rule vLLM uses for these checkpoints (vllm/model_executor/models/
baichuan.py BaichuanForCausalLM: hidden_size 4096 is Baichuan2-7B with RoPE, others ALiBi).
Legend: h hidden, a heads, d head_dim, f MLP width, v vocab.
"""
from __future__ import annotations

from vramplan.families.common import Cfg, FamilyDesc, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, NormKind, ParamEntry, PositionKind

# BaichuanConfig fields and defaults (configuration_baichuan.py of the same repositories).
DEFAULTS = {"vocab_size": 125696, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 4096,
            "model_max_length": 4096, "tie_word_embeddings": False, "z_loss_weight": 0.0}


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    if num_labels:
        raise ValueError("baichuan: only BaichuanForCausalLM is modelled (the repositories ship no "
                         "sequence-classification class)")
    c = Cfg(config, "baichuan", DEFAULTS)
    h, L, a, f = (c.int(key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "intermediate_size"))
    if h % a:
        raise ValueError(f"baichuan config: hidden_size {h} must divide by num_attention_heads {a} "
                         "(BaichuanAttention refuses it)")
    kind = c.get("position_embedding_type") or ("rope" if h == 4096 else "alibi")
    if kind not in ("rope", "alibi"):
        raise ValueError(f"baichuan config field 'position_embedding_type' must be 'rope' or 'alibi', got {kind!r}")
    d, alibi = h // a, kind == "alibi"
    # 7B RotaryEmbedding.__init__: inv_freq (d/2) and cos_cached, sin_cached (1, 1, P, d), all
    # fp32 plain attributes of every layer's attention (no buffers: `.to(dtype)` leaves them fp32)
    pos = c.int("model_max_length" if alibi else "max_position_embeddings")
    rotary_bytes = 0 if alibi else L * 4 * (d // 2 + 2 * pos * d)
    desc = FamilyDesc(
        name=name, model_type="baichuan", num_layers=L, hidden_size=h, num_heads=a, num_kv_heads=a, head_dim=d,
        intermediate_size=f, vocab_size=c.int("vocab_size"), mlp=MlpKind.GATED, hidden_act=c["hidden_act"],
        norm=NormKind.RMSNORM, position=PositionKind.LEARNED if alibi else PositionKind.ROPE,
        # ALiBi has no position table (training builds the bias for any length): no limit
        max_position_embeddings=0 if alibi else pos, tie_word_embeddings=False, fused_qkv=True, alibi=alibi,
        hub_id=c.raw.get("_name_or_path"), buffer_bytes=rotary_bytes,
        z_loss_weight=float(c["z_loss_weight"]))
    out = [ParamEntry("model.embed_tokens.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += linear(p + "self_attn.W_pack", 3 * h, h, False, i) + linear(p + "self_attn.o_proj", h, h, False, i)
        for proj, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
            out += linear(p + "mlp." + proj, *shape, False, i)
        out += norm(p + "input_layernorm", h, False, i) + norm(p + "post_attention_layernorm", h, False, i)
    out += norm("model.norm", h, False, None) + linear("lm_head", desc.vocab_size, h, False, None)
    return with_params(desc, out)
