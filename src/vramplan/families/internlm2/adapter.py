"""InternLM2 config -> ModelDesc (InternLM2ForCausalLM of the internlm/internlm2-* and
internlm2_5-* repositories' modeling_internlm2.py; transformers has no class for it, and
vramplan never runs repository code: the names and shapes below are read from that file).

InternLM2Attention: one `wqkv` = Linear(h, (a + 2k) * d, bias=config.bias), laid out per KV
group as (k, a/k + 2, d): the group's a/k query heads, then its key, then its value
(`rearrange(qkv, "b q (h gs d) -> b q h gs d", gs=2 + groups)`); `wo` = Linear(a * d, h,
bias=config.bias); head_dim = h // a. InternLM2MLP: w1 (gate), w3 (up), w2 (down), no bias.
RMSNorms attention_norm, ffn_norm, model.norm; tok_embeddings; untied `output` head.
Parameter count and shapes equal LlamaForCausalLM's with q/k/v merged (tests/test_families_remote.py).
Legend: h hidden, a heads, k KV heads, d head_dim, f MLP width, v vocab.
"""
from __future__ import annotations

from vramplan.families.common import Cfg, FamilyDesc, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, NormKind, ParamEntry, PositionKind

# InternLM2Config fields and defaults (configuration_internlm2.py of the same repositories).
DEFAULTS = {"vocab_size": 103168, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "bias": True,
            "rope_theta": 10000, "rope_scaling": None, "attn_implementation": None}
# InternLM2DecoderLayer takes INTERNLM2_ATTENTION_CLASSES[config.attn_implementation], and
# InternLM2Config sets "eager" when it is None: the config, not from_pretrained's
# attn_implementation argument, decides (the published configs say "eager").
ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash"}


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    if num_labels:
        raise ValueError("internlm2: only InternLM2ForCausalLM is modelled (sequence classification "
                         "uses the repository's InternLM2ForSequenceClassification)")
    c = Cfg(config, "internlm2", DEFAULTS)
    h, L, a = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    k, f = c.get("num_key_value_heads") or a, c.int("intermediate_size")
    if h % a or a % k:
        raise ValueError(f"internlm2 config: hidden_size {h} must divide by num_attention_heads {a}, "
                         f"and the heads by num_key_value_heads {k} (InternLM2Attention refuses it)")
    _check_rope_scaling(c["rope_scaling"])
    named = c.get("attn_implementation") or "eager"
    attn = ATTENTION.get(named) if isinstance(named, str) else None
    if attn is None:
        raise ValueError(f"internlm2 config field 'attn_implementation' must be one of {', '.join(ATTENTION)}, "
                         f"got {c.get('attn_implementation')!r} (INTERNLM2_ATTENTION_CLASSES)")
    d, bias = h // a, bool(c["bias"])
    desc = FamilyDesc(
        name=name, model_type="internlm2", num_layers=L, hidden_size=h, num_heads=a, num_kv_heads=k,
        head_dim=d, intermediate_size=f, vocab_size=c.int("vocab_size"), mlp=MlpKind.GATED,
        hidden_act=c["hidden_act"], norm=NormKind.RMSNORM, position=PositionKind.ROPE,
        max_position_embeddings=c.int("max_position_embeddings"),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), qkv_bias=bias, o_bias=bias, fused_qkv=True,
        hub_id=c.raw.get("_name_or_path"), attn_implementation=attn,
        # InternLM2Attention._init_rope: every layer holds its own rotary module and its
        # `inv_freq` buffer (d/2 fp32, register_buffer(persistent=False)).
        buffer_bytes=L * (d // 2) * 4)
    out = [ParamEntry("model.tok_embeddings.weight", (desc.vocab_size, h))]
    for i in range(L):
        p = f"model.layers.{i}."
        out += linear(p + "attention.wqkv", (a + 2 * k) * d, h, bias, i)
        out += linear(p + "attention.wo", h, a * d, bias, i)
        for proj, shape in (("w1", (f, h)), ("w3", (f, h)), ("w2", (h, f))):
            out += linear(p + "feed_forward." + proj, *shape, False, i)
        out += norm(p + "attention_norm", h, False, i) + norm(p + "ffn_norm", h, False, i)
    out += norm("model.norm", h, False, None)
    if not desc.tie_word_embeddings:
        out += linear("output", desc.vocab_size, h, False, None)
    return with_params(desc, out)


def _check_rope_scaling(rope: object) -> None:
    """InternLM2Config._rope_scaling_validation: None, or {"type": "linear" | "dynamic",
    "factor": float >= 1}. Either keeps the training step's memory: dynamic NTK recomputes
    `inv_freq` only past max_position_embeddings, linear divides the positions."""
    if rope is None:
        return
    if not isinstance(rope, dict) or rope.get("type", rope.get("rope_type")) not in ("linear", "dynamic"):
        raise ValueError(f"internlm2 config field 'rope_scaling' must be null or {{'type': 'linear' | 'dynamic', "
                         f"'factor': ...}} (InternLM2Config), got {rope!r}")
