"""A model from a raw parameter count, as older calculators take it.

The shape is a Llama-style decoder (gated MLP, RMSNorm, untied 32000-token vocabulary,
multi-head attention). Layers and hidden size come from the user or from the nearest row
of GPT-3's model-size table (Brown et al. 2020, Table 2.1); the MLP width is then solved so
the parameter count equals the one given (to within one MLP column per layer).
"""
from __future__ import annotations

from vramplan.model import MAX_LAYERS, MlpKind, ModelDesc, NormKind, ParamEntry, PositionKind
from vramplan.spec import SpecError

# (parameters, hidden size, layers, heads): Brown et al. 2020, Table 2.1.
_GPT3_SIZES = (
    (125e6, 768, 12, 12), (350e6, 1024, 24, 16), (760e6, 1536, 24, 16), (1.3e9, 2048, 24, 16),
    (2.7e9, 2560, 32, 32), (6.7e9, 4096, 32, 32), (13e9, 5120, 40, 40), (175e9, 12288, 96, 96),
)
_VOCAB = 32000


def model_from_size(num_params: int, *, num_layers: int | None = None, hidden_size: int | None = None) -> ModelDesc:
    # past the table the largest row (float distances to a huge count tie, and min takes the first)
    row = _GPT3_SIZES[-1] if num_params >= _GPT3_SIZES[-1][0] else min(_GPT3_SIZES, key=lambda r: abs(r[0] - num_params))
    h = hidden_size or row[1]
    layers = num_layers or row[2]
    heads = max(1, h // 128) if hidden_size else row[3]
    while h % heads:
        heads -= 1
    per_layer_fixed = 4 * h * h + 2 * h
    rest = num_params - 2 * _VOCAB * h - h - layers * per_layer_fixed
    if layers > MAX_LAYERS:
        raise SpecError("num_layers", f"is past any published model ({layers:,} layers); use at most {MAX_LAYERS:,}")
    f = rest // (3 * h * layers)
    if f < 1:
        raise SpecError("num_params", f"{num_params:,} is too small for {layers} layers of hidden size {h}; "
                        "give smaller --num-layers/--hidden-size")
    if f > 64 * h and (hidden_size or num_layers):
        # a shape the user gave that no model has: the widest published MLP is T5-11B's,
        # 64 x its hidden size (d_ff 65536, d_model 1024)
        raise SpecError("hidden_size", f"an MLP {f // h:,} x as wide as the hidden size would hold {num_params:,} "
                        f"parameters in {layers} layers of hidden size {h}; give a larger --hidden-size or more --num-layers")
    params = [ParamEntry("model.embed_tokens.weight", (_VOCAB, h))]
    for i in range(layers):
        pre = f"model.layers.{i}"
        params += [ParamEntry(f"{pre}.self_attn.{n}.weight", (h, h), i) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        params += [ParamEntry(f"{pre}.mlp.gate_proj.weight", (f, h), i), ParamEntry(f"{pre}.mlp.up_proj.weight", (f, h), i),
                   ParamEntry(f"{pre}.mlp.down_proj.weight", (h, f), i),
                   ParamEntry(f"{pre}.input_layernorm.weight", (h,), i),
                   ParamEntry(f"{pre}.post_attention_layernorm.weight", (h,), i)]
    params += [ParamEntry("model.norm.weight", (h,)), ParamEntry("lm_head.weight", (_VOCAB, h))]
    return ModelDesc(name=f"raw-{num_params / 1e9:.3g}b", model_type="llama", num_layers=layers, hidden_size=h,
                     num_heads=heads, num_kv_heads=heads, head_dim=h // heads, intermediate_size=f,
                     vocab_size=_VOCAB, mlp=MlpKind.GATED, hidden_act="silu", norm=NormKind.RMSNORM,
                     position=PositionKind.ROPE, max_position_embeddings=4096, tie_word_embeddings=False,
                     params=tuple(params))
