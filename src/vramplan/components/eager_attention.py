"""Eager attention beyond what its layer saves: the model-level masks it reads and the moment
of its own backward at the softmax, which for a long sequence outgrows the MLP's.

Legend: b micro-batch, s sequence, a heads, d head width, T = b * s, N = b * a * s * s.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch import local_window
from vramplan.components.dtypes import dtypes_of
from vramplan.components.trainable import ParamSet, grad_dtype
from vramplan.components.weights import is_mlp_out
from vramplan.model import ModelDesc
from vramplan.spec import Backend, JobSpec
from vramplan.units import nbytes

SOFTMAX = "attn/core.softmax"
"""The name components/arch.py eager_attention gives the saved softmax output."""


# Families outside Llama's layer code whose model forward builds the same eager mask with
# masking_utils.create_causal_mask (modeling_gpt2.py, modeling_gpt_bigcode.py); seen with the
# exact CPU meter: a GPT-2 reward model's `aten.where` (4, 1, 128, 128) fp32 through the blocks
CAUSAL_MASK_OTHERS = frozenset({"gpt2", "gpt_bigcode"})


def eager_masks(desc: ModelDesc, b: int, s: int, dtype: str) -> list[tuple[str, int]]:
    """The 4-D masks the model's forward builds for eager attention: masking_utils'
    create_causal_mask (and create_sliding_window_causal_mask for a model with both kinds of
    layer, the `causal_mask_mapping` of Qwen2Model, Gemma2Model, Gemma3TextModel) returns,
    for `eager`, a (b, 1, s, s) float mask in the embeddings' dtype (`eager_mask`: where(mask,
    0, min)). One per kind of layer: global, and local (sliding) when some layers are.
    Seen with the exact CPU meter: Qwen2 eager, `aten.where` (2, 1, 1000, 1000) fp32."""
    kinds = {local_window(desc, i) is not None for i in range(desc.num_layers)}
    if desc.model_type in ("gemma2", "gemma3_text"):
        kinds = {True, False}  # both masks are built whatever the layers are
    return [(f"attention_mask/{'local' if k else 'global'}", nbytes(b * s * s, dtype)) for k in sorted(kinds)]


def place_masks(masks: list[tuple[str, int]], checkpointed: bool, embedding_saved: list, forward_moments: dict,
                layers) -> None:
    """The masks are locals of the model's forward, alive while the layers run forward (each
    layer's forward moment); under full checkpointing each layer's recomputation keeps them
    (modeling_layers.GradientCheckpointingLayer checkpoints `partial(forward, self, **kwargs)`,
    the mask among the kwargs) until the backward has passed the layers: with the embedding
    stage's saved tensors, as the rotary cos and sin the same partial holds."""
    if checkpointed:
        embedding_saved.extend(masks)
        return
    for j in layers:
        forward_moments[j] = [*forward_moments.get(j, ()), *masks]


def backward_moment(desc: ModelDesc, spec: JobSpec, params: ParamSet, i: int, saved: list[tuple[str, int]],
                    mlp_freed: tuple[str, ...], mlp_transient: Breakdown,
                    checkpoint_input: str | None = None) -> tuple[Breakdown, tuple[str, ...]] | None:
    """A layer's backward peak at eager attention's SoftmaxBackward when it exceeds the MLP's
    (mlp_freed, mlp_transient: layer_backward): the autograd engine has run every node
    recorded after the softmax and released what they saved (torch/csrc/autograd/engine.cpp
    releases a node's SavedVariables after it runs: the repeated v, the o_proj and MLP
    inputs); the softmax's own output is still saved. Beside it: the gradient of the probs
    (the bmm's, cast to the softmax's fp32 by ToCopyBackward), the softmax's input gradient
    (_softmax_backward_data), the repeated v's gradient (the same bmm's other output, waiting
    for the repeat's backward, which has a lower sequence number), the residual stream's
    gradient, and the gradients of every weight whose backward has run (the MLP's, o_proj's,
    the post-attention norm's). Seen with the exact CPU meter: Qwen2 eager, b2 s1000, where
    this moment is the step's peak. None when the layer has no eager softmax or the MLP's
    moment is larger. `checkpoint_input`: under checkpointing, the name the recomputation gives
    the layer's input, which its first norm saves: the tensor torch.utils.checkpoint keeps
    (non-reentrant: the recomputation runs on the same input, no copy), counted there, so
    not again here (the CPU meter holds it once)."""
    names = [n for n, _ in saved]
    if SOFTMAX not in names:
        return None
    at = names.index(SOFTMAX)
    probs = saved[at][1]
    b, s = spec.micro_batch_size, spec.seq_len
    t, c = b * s, dtypes_of(spec).compute
    out = (Breakdown().add("backward/grad_hidden", nbytes(t * desc.hidden_size, dtypes_of(spec).weights))
           .add("backward/grad_attn_probs", probs).add("backward/grad_attn_scores", probs)
           .add("backward/grad_attn_v", nbytes(t * desc.num_heads * (getattr(desc, "v_head_dim", 0) or desc.head_dim), c)))
    if spec.backend is Backend.CUDA:
        # aten/src/ATen/native/cuda/SoftMax.cu softmax_backward_cuda_out: `tmp = grad * output`
        # before the kernel, beside the input gradient it writes (the H200 trace of Qwen2
        # eager, b2 s1000: structured_mul_out inside structured_softmax_backward_cuda_out::impl,
        # a fourth (b, a, s, s) block; the CPU kernel makes none)
        out.add("backward/softmax_grad_times_output", probs)
    for p in params.trainable():
        if p.layer == i and not is_mlp_out(p.name) and _after_attention(p.name):
            out.add("backward/layer_grads_after_attention", nbytes(p.numel, grad_dtype(spec, p)))
    freed = tuple(names[at + 1:]) + ((checkpoint_input,) if checkpoint_input in names[:at] else ())
    kept = sum(v for n, v in saved[:at + 1] if n != checkpoint_input)
    mlp = sum(v for n, v in saved if n not in mlp_freed) + mlp_transient.total()
    return (out, freed) if kept + out.total() > mlp else None


def _after_attention(name: str) -> bool:
    """A layer weight whose gradient is made before the attention core's backward: everything
    but the input norm and the q, k, v projections (and their norms and adapters)."""
    base = name.split("#")[0]
    if "input_layernorm" in base:
        return False
    return ".self_attn." not in base or ".o_proj" in base
