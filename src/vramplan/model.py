"""ModelDesc: the normalized architecture every estimator component reads.

One dispatcher (`vramplan.sources.model_from_hf_config`) builds it from a Hugging Face
config with explicit fields; nothing here guesses from ratios. Parameters are listed by their real module path
(the names `model.named_parameters()` yields in transformers), so LoRA targets,
`modules_to_save` and frozen layers are matched against the same names PEFT matches.

Legend for formulas elsewhere: b micro-batch, s sequence, h hidden, a heads, k KV heads,
d head_dim, f MLP width, L layers, v vocabulary.
"""
from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field

MAX_LAYERS = 2048
"""The most layers a model description may have: twice the deepest published transformer
(DeepNet, arXiv 2203.00555, 1,000 layers). A description lists every layer's tensors, so a
slip like 1e9 layers would otherwise run for hours rather than answer."""


class MlpKind(str, enum.Enum):
    """Shape of the feed-forward block."""

    GATED = "gated"
    """act(gate(x)) * up(x) -> down (SwiGLU / GeGLU: Llama, Qwen, Mistral, Gemma, Phi-3)."""
    PLAIN = "plain"
    """act(fc1(x)) -> fc2 (GPT-2, BERT)."""


class NormKind(str, enum.Enum):
    RMSNORM = "rmsnorm"
    """x * rsqrt(mean(x^2) + eps) * w; HF computes it in fp32 (LlamaRMSNorm.forward)."""
    LAYERNORM = "layernorm"
    """torch.nn.LayerNorm with weight and bias."""


class PositionKind(str, enum.Enum):
    ROPE = "rope"
    LEARNED = "learned"
    """A learned absolute position table (GPT-2 wpe, BERT position_embeddings)."""


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One parameter tensor of the real model."""

    name: str
    """Full name as in `model.named_parameters()`, e.g. `model.layers.0.self_attn.q_proj.weight`."""
    shape: tuple[int, ...]
    layer: int | None = None
    """Decoder/encoder layer index, None for embeddings, final norm and heads."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        """The owning module path (name without the trailing `.weight` / `.bias`)."""
        return self.name.rsplit(".", 1)[0]

    @property
    def is_linear_weight(self) -> bool:
        return self.name.endswith(".weight") and len(self.shape) == 2


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEDesc:
    """Mixture-of-experts feed-forward, as in Mixtral / Qwen-MoE."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    """Width of the shared expert (Qwen2-MoE `shared_expert_intermediate_size`)."""
    norm_topk_prob: bool = False


_NUM_PARAMS: dict[int, tuple[object, int]] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelDesc:
    """A transformer, normalized. Sizes are element counts; dtypes come from the job."""

    name: str
    model_type: str
    """Hugging Face `model_type` (llama, qwen2, mistral, gemma2, phi3, gpt2, bert, ...)."""
    is_encoder: bool = False
    """Bidirectional encoder (BERT): no causal LM head; trained with a classification head."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Per-head width; may differ from hidden_size / num_heads (Gemma, Qwen3)."""
    intermediate_size: int
    vocab_size: int
    mlp: MlpKind
    hidden_act: str
    """Activation name as in the HF config (silu, gelu_pytorch_tanh, gelu_new, gelu, relu)."""
    norm: NormKind
    position: PositionKind
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused_qkv: bool = False
    """One `qkv_proj` (Phi-3) or `c_attn` (GPT-2) instead of q/k/v projections."""
    fused_gate_up: bool = False
    """One `gate_up_proj` (Phi-3)."""
    qk_norm: bool = False
    """RMSNorm on each head's q and k (Qwen3, Gemma 3)."""
    sandwich_norm: bool = False
    """Extra post-attention and post-feedforward norms (Gemma 2/3: 4 norms per layer)."""
    embed_scale: bool = False
    """Embeddings multiplied by sqrt(h) (Gemma)."""
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    """Layers that attend within `sliding_window` (all for Mistral; alternate for Gemma 2;
    5 of every 6 for Gemma 3); the others attend to the full sequence."""
    mask_every_layer: bool = False
    """Every layer's SDPA gets an explicit (b, 1, s, s) mask, the global ones too (Gemma 3
    with image tokens: token_type_ids make them attend both ways, so is_causal cannot stand in)."""
    attention_dropout: float = 0.0
    attention_dropout_module: bool = False
    """The attention dropout is an nn.Dropout whose p the attention reads (GPT-2's
    `attn_dropout`: modeling_gpt2.py `dropout=self.attn_dropout.p`), so TRL's disable_dropout
    reaches it; most families pass the config's float (`self.attention_dropout`), which it does not."""
    hidden_dropout: float = 0.0
    """Residual dropout (GPT-2 resid_pdrop, BERT hidden_dropout_prob)."""
    embedding_dropout: float = 0.0
    num_labels: int = 0
    """Classification head width for sequence-classification; 0 for causal LMs."""
    moe: MoEDesc | None = None
    moe_layers: tuple[int, ...] = ()
    """Indices of layers whose MLP is an MoE block (all layers for Mixtral)."""
    params: tuple[ParamEntry, ...] = field(default=())
    hub_id: str | None = None
    checkpoint_dtype: str | None = None
    """dtype the checkpoint is stored in (config `dtype` / `torch_dtype`), None if unstated:
    what transformers 5 `from_pretrained` loads by default."""
    checkpoint_quantization: tuple[tuple[str, object], ...] = ()
    """The checkpoint's `quantization_config` as quantization spec fields (sorted items;
    catalog/quant_config.py), empty for an unquantized checkpoint."""

    def num_params(self) -> int:
        """Unique parameter elements (tied embeddings counted once, as PyTorch does);
        counted once per description (it is frozen), as every estimate reports it."""
        hit = _NUM_PARAMS.get(id(self))
        if hit is not None and hit[0] is self:
            return hit[1]
        n = sum(p.numel for p in self.params)
        if len(_NUM_PARAMS) >= 64:
            _NUM_PARAMS.pop(next(iter(_NUM_PARAMS)))
        _NUM_PARAMS[id(self)] = (self, n)
        return n

    def params_matching(self, pattern: str) -> tuple[ParamEntry, ...]:
        rx = re.compile(pattern)
        return tuple(p for p in self.params if rx.search(p.name))

    def layer_params(self, layer: int) -> tuple[ParamEntry, ...]:
        return tuple(p for p in self.params if p.layer == layer)

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def largest_param(self) -> ParamEntry:
        return max(self.params, key=lambda p: p.numel)
