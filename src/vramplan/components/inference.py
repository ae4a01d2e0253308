"""Inference (no gradients): weights, the KV cache of generation, and the largest transient.

Under torch.no_grad nothing is saved for backward, so each layer's intermediates are freed
as soon as the next op has consumed them; the forward's peak is the weights plus the KV
cache plus the largest set of intermediates alive together inside one layer, or the logits.
Legend: b batch, s prompt length, n new tokens, h hidden, f MLP width, k KV heads,
d head_dim, L layers, v vocabulary.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.dtypes import dtypes_of
from vramplan.model import MlpKind, ModelDesc
from vramplan.spec import Attention, JobSpec
from vramplan.units import nbytes


def kv_cache_bytes(desc: ModelDesc, batch: int, tokens: int, dtype: str) -> int:
    """transformers DynamicCache: a key and a value tensor (b, k, tokens, d) per layer."""
    return 2 * desc.num_layers * nbytes(batch * desc.num_kv_heads * tokens * desc.head_dim, dtype)


def layer_transient(desc: ModelDesc, batch: int, tokens: int, dtype: str, attention: Attention) -> Breakdown:
    """Inside one layer without grad: the residual, the normed input and, in the MLP, gate,
    up and their product (gated; fc output and activation for plain MLPs); in attention,
    q, k, v and the output, plus the (b, a, s, s) scores and fp32 probabilities for eager."""
    t = batch * tokens
    out = Breakdown()
    out.add("transient/hidden", 2 * nbytes(t * desc.hidden_size, dtype))
    width = desc.moe.expert_intermediate_size * desc.moe.top_k if desc.moe else desc.intermediate_size
    n = 3 if desc.mlp is MlpKind.GATED else 2
    mlp = n * nbytes(t * width, dtype)
    attn = nbytes(t * (2 * desc.num_heads + 2 * desc.num_kv_heads) * desc.head_dim, dtype)
    if attention is Attention.EAGER:
        scores = batch * desc.num_heads * tokens * tokens
        attn += nbytes(scores, dtype) + nbytes(scores, "fp32")
    out.add("transient/layer", max(mlp, attn))
    return out


def inference_terms(desc: ModelDesc, spec: JobSpec, new_tokens: int) -> tuple[Breakdown, Breakdown]:
    """(persistent, transient at the peak) for a forward over the prompt, then generation."""
    b, s = spec.micro_batch_size, spec.seq_len
    c = dtypes_of(spec).compute if spec.quantization is None else spec.quantization.compute_dtype
    persistent = Breakdown()
    if new_tokens:
        persistent.add("kv_cache", kv_cache_bytes(desc, b, s + new_tokens, c))
    transient = layer_transient(desc, b, s, c, spec.attention)
    # generate() keeps only the last position's logits (logits_to_keep=1) and upcasts them;
    # a plain forward returns logits for every position in the compute dtype.
    rows = b if new_tokens else b * s
    logits = nbytes(rows * desc.vocab_size, c) + (nbytes(rows * desc.vocab_size, "fp32") if new_tokens else 0)
    if logits > transient.total():
        transient = Breakdown().add("transient/logits", logits)
    return persistent, transient
