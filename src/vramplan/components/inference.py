"""Inference (no gradients): weights, transformers' KV cache, and what one moment holds.

Under torch.no_grad nothing is saved for backward: a tensor lives while a Python name or
the cache refers to it. The step is transformers' own decoder forward (LlamaModel.forward
and its kin, transformers 5) and, with `max_new_tokens`, GenerationMixin.generate over a
DynamicCache. Its peak is the largest of three moments, each read from that code:

* prefill, in the last layer's MLP: the whole prompt's cache (DynamicLayer.update writes
  each layer's keys and values before its MLP runs), `inputs_embeds` (a local of the model's
  forward for all of it), the layer's input (the model's loop variable), the residual and
  the normed input (the layer's locals), the rotary cos/sin, and the MLP's intermediates;
* the head: the final norm's output and the logits (every position for a plain forward,
  whose output keeps them; one position under generate, `logits_to_keep=1`, then its fp32
  copy `outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)`);
* the last decoding step: `torch.cat([self.keys, key_states], dim=-2)` (cache_utils.py
  DynamicLayer.update) builds a layer's grown keys while the old ones are still held.

A plain forward builds the cache too: `use_cache` defaults to the config's (True) and the
output carries it. Legend: b batch, s prompt, n new tokens, h hidden, f MLP width, k KV
heads, d head_dim, L layers, v vocabulary.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.dtypes import dtypes_of
from vramplan.model import MlpKind, ModelDesc, PositionKind
from vramplan.spec import Attention, JobSpec
from vramplan.units import nbytes


def kv_cache_bytes(desc: ModelDesc, batch: int, tokens: int, dtype: str, key_dtype: str | None = None) -> int:
    """transformers DynamicCache: a key and a value tensor (b, k, tokens, d) per layer."""
    one = batch * desc.num_kv_heads * tokens * desc.head_dim
    return desc.num_layers * (nbytes(one, key_dtype or dtype) + nbytes(one, dtype))


def _mlp(desc: ModelDesc, t: int, c: str, cast: int) -> int:
    """The most the MLP holds at once beyond its input. Gated (LlamaMLP.forward,
    `down_proj(act_fn(gate_proj(x)) * up_proj(x))`): the activation, the up projection and
    their product (3 f), then the product, the output and, under autocast, the cast weight;
    plain (fc1 -> act -> fc2): fc1's output and the activation's (2 f)."""
    width = desc.moe.expert_intermediate_size * desc.moe.top_k if desc.moe else desc.intermediate_size
    f, h = nbytes(t * width, c), nbytes(t * desc.hidden_size, c)
    if desc.mlp is MlpKind.GATED and desc.fused_gate_up:
        # Phi3MLP: gate_up_proj's output (2 f) is chunked into views; act(gate) and the
        # product come on top of it
        return max(4 * f, f + h + cast)
    if desc.mlp is MlpKind.GATED:
        return max(3 * f, 2 * f + cast, f + h + cast)
    return max(2 * f, f + h + cast)


def _attention(desc: ModelDesc, batch: int, s: int, c: str, attention: Attention) -> int:
    """q, k, v and the output projection's input (the kernel's output); eager attention
    (eager_attention_forward) also holds the masked scores, softmax's fp32 result and, in a
    16-bit dtype, its cast back, all (b, a, s, s)."""
    qkv = nbytes(batch * s * (2 * desc.num_heads + 2 * desc.num_kv_heads) * desc.head_dim, c)
    if attention is not Attention.EAGER:
        return qkv
    scores = batch * desc.num_heads * s * s
    return qkv + nbytes(scores, c) + nbytes(scores, "fp32") + (nbytes(scores, c) if c != "fp32" else 0)


def inference_terms(desc: ModelDesc, spec: JobSpec, new_tokens: int) -> tuple[Breakdown, Breakdown]:
    """(persistent, transient) at the step's peak: prefill layer, head or last decode step."""
    b, s = spec.micro_batch_size, spec.seq_len
    dt = dtypes_of(spec)
    c = dt.compute if spec.quantization is None else spec.quantization.compute_dtype
    w = c if spec.quantization is not None else dt.weights  # the embedding's (residual's) dtype
    t = b * s
    # autocast casts a frozen weight at each use (autocast_mode.cpp cached_cast caches only
    # leaves that require grad): the cast is alive while its matmul runs. Over fp32 weights
    # the rotary embedding (apply_rotary_pos_emb, cos/sin in the residual's fp32) promotes the
    # keys back to fp32; the values stay in the autocast dtype.
    autocast = dt.autocast is not None and dt.autocast != w
    key_dtype = w if autocast and desc.position is PositionKind.ROPE else c
    kv = kv_cache_bytes(desc, b, s, c, key_dtype)
    cast = nbytes(desc.hidden_size * desc.intermediate_size, c) if autocast else 0
    hid = nbytes(t * desc.hidden_size, w)
    layer = Breakdown().add("kv_cache", kv)
    layer.add("transient/hidden", (4 if desc.num_layers > 1 else 3) * hid)
    if desc.position is PositionKind.ROPE:
        layer.add("transient/rotary_cos_sin", 2 * nbytes(t * desc.head_dim, c))
    layer.add("transient/layer", max(_mlp(desc, t, c, cast), _attention(desc, b, s, c, spec.attention)))
    head = Breakdown().add("kv_cache", kv).add("transient/final_norm", hid)
    if new_tokens:
        head.add("transient/logits", nbytes(b * desc.vocab_size, c))
        decode = (Breakdown().add("kv_cache", kv_cache_bytes(desc, b, s + new_tokens - 1, c, key_dtype))
                  .add("transient/kv_cat", nbytes(b * desc.num_kv_heads * (s + new_tokens) * desc.head_dim, key_dtype))
                  .add("transient/logits", nbytes(b * desc.vocab_size, "fp32")))
    else:
        head.add("transient/logits", nbytes(t * desc.vocab_size, c))
        decode = Breakdown()
    if autocast:
        head.add("transient/autocast_lm_head", nbytes(desc.vocab_size * desc.hidden_size, c))
    best = max((layer, head, decode), key=lambda x: x.total())
    persistent = Breakdown(terms={k: v for k, v in best.terms.items() if k == "kv_cache"})
    transient = Breakdown(terms={k: v for k, v in best.terms.items() if k != "kv_cache"})
    return persistent, transient
