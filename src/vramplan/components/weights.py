"""Weights and gradients, grouped by the backward stage that produces each gradient."""
from __future__ import annotations

import math

from vramplan.breakdown import Breakdown
from vramplan.components.trainable import HeldParam, ParamSet, grad_dtype
from vramplan.model import ModelDesc
from vramplan.components.dtypes import dtypes_of
from vramplan.components.quant import QUANT_DTYPES, storage, torchao_nf4
from vramplan.spec import JobSpec, SpecError, QuantType
from vramplan.spec.stack import Framework
from vramplan.units import nbytes


def weight_terms(spec: JobSpec, params: ParamSet) -> Breakdown:
    # each distinct kind of tensor (what _weight_terms reads of it) once, times its count, in
    # order of first place: the same terms in the same order as adding every parameter's
    counts: dict[tuple, list] = {}
    for p in params.params:
        key = (p.kind, p.dtype, p.trainable, p.shape, p.full_shape, p.name.endswith("gate_up_proj"))
        hit = counts.get(key)
        if hit is None:
            counts[key] = [p, 1]
        else:
            hit[1] += 1
    out = Breakdown()
    for p, n in counts.values():
        for name, size in _weight_terms(spec, p):
            out.add(name, size * n)
    return out


def _weight_terms(spec: JobSpec, p: HeldParam) -> tuple[tuple[str, int], ...]:
    if p.kind == "base" and p.dtype in QUANT_DTYPES and spec.quantization is not None:
        codes, state = quantized_linear_bytes(spec, p)
        return ("weights/quantized", codes), ("weights/quant_state", state)
    if p.kind == "lora":
        return (("weights/lora_adapters", nbytes(p.numel, p.dtype)),)
    if p.kind == "saved_copy":
        return (("weights/modules_to_save", nbytes(p.numel, p.dtype)),)
    return (("weights/trainable" if p.trainable else "weights/frozen", nbytes(p.numel, p.dtype)),)


def quantized_linear_bytes(spec: JobSpec, p: HeldParam) -> tuple[int, int]:
    """(codes, scales/zeros/indices) of one quantized linear weight (m, n), per its library's
    layout (components/quant.py). AWQ packs whole groups of in_features and HQQ whole groups
    of the flattened weight, so a group size that does not divide them cannot be stored."""
    q = spec.quantization
    full = p.full_shape or p.shape
    if full != p.shape:
        # one rank's flat partition of the layer's storage (ZeRO-3 / FSDP1 flatten the packed
        # weight with the rest: bnb_4bit_quant_storage), its share of every tensor
        codes, state = storage(q, full[0], full[-1])
        share = p.numel / math.prod(full)
        return math.ceil(codes * share), math.ceil(state * share)
    if len(p.shape) == 3:
        # fused experts (E, m, n) quantized as the E experts' own linears (transformers 4.x
        # layout: components/trainable.py per_expert_linears); a fused gate_up_proj (E, 2f, h)
        # was two of them per expert (Mixtral w1 and w3, Qwen-MoE gate_proj and up_proj)
        parts = 2 if p.name.endswith("gate_up_proj") else 1
        codes, state = storage(q, p.shape[1] // parts, p.shape[2])
        return p.shape[0] * parts * codes, p.shape[0] * parts * state
    m, n = p.shape[0], p.shape[-1]
    if spec.stack.framework is Framework.TORCHTUNE and q.type is QuantType.NF4:
        # torchtune's QLoRA builders quantize with torchao, not bitsandbytes
        return torchao_nf4(m * n, dtypes_of(spec).weights)
    if q.type is QuantType.AWQ and n % q.group_size:
        raise SpecError("quantization.group_size", f"{q.group_size} does not divide in_features {n} of "
                        f"{p.name}; AWQ needs whole groups (use a divisor of {n})")
    if q.type is QuantType.HQQ and (m * n) % q.group_size:
        raise SpecError("quantization.group_size", f"{q.group_size} does not divide the {m * n} weights of "
                        f"{p.name}; HQQ needs whole groups")
    return storage(q, m, n)


# Token embedding tables (Llama/Qwen embed_tokens, GPT-2/Qwen-1 wte, BERT/BLOOM
# word_embeddings, GPT-NeoX embed_in) and other input-side embeddings.
_TOKEN_EMBED = ("embed_tokens", "tok_embeddings", "wte", "word_embeddings", "embed_in")
# Classification heads (AutoModelForSequenceClassification's `score`, BERT's `classifier`).
_CLASS_HEADS = ("score.", "classifier.")


# Output projections of their own (GPT-NeoX's embed_out, InternLM2's output); without one the
# head is the tied token embedding
_OUTPUT_HEADS = ("lm_head.weight", "embed_out.weight", "output.weight")


def output_head_trainable(params) -> bool:
    """Whether the output head's weight trains: its own projection, else the token embedding
    it is tied to (Llama's embed_tokens, GPT-2's wte, ...)."""
    trains = {p.name: p.trainable for p in params.params}
    own = next((n for n in _OUTPUT_HEADS if n in trains), None)
    if own is not None:
        return trains[own]
    return any(t for n, t in trains.items() if n.endswith(".weight") and n[:-7].rsplit(".", 1)[-1] in _TOKEN_EMBED)


def head_is_embedding(desc: ModelDesc) -> bool:
    """Whether the output head is the tied token embedding: tie_word_embeddings ties lm_head,
    which a sequence classifier (reward model) does not have; its `score` is its own weight
    (e.g. models/qwen3/modeling_qwen3.py Qwen3ForSequenceClassification)."""
    return bool(desc.tie_word_embeddings) and not any(p.name.startswith(_CLASS_HEADS) for p in desc.params)
_EMBED = _TOKEN_EMBED + ("wpe", "embed_positions", "embeddings")


def num_stages(desc: ModelDesc) -> int:
    """Embedding, layers, head; an encoder-decoder adds the encoder's final norm and the
    decoder's embedding (components/seq2seq.py)."""
    return desc.num_layers + (4 if getattr(desc, "num_encoder_layers", 0) else 2)


def stage_of(desc: ModelDesc, p: HeldParam) -> int:
    """Index of the forward stage (0 embedding, 1..L layers, L+1 head) owning a gradient.
    A tied embedding's gradient is first written by the output head's backward."""
    Le = getattr(desc, "num_encoder_layers", 0)
    if Le:  # T5: encoder blocks 1..Le, its final norm Le+1, decoder blocks after Le+2
        if p.layer is not None:
            return p.layer + 1 if p.layer < Le else p.layer + 3
        return Le + 1 if p.name.startswith("encoder.final_layer_norm") else desc.num_layers + 3
    if p.layer is not None:
        return p.layer + 1
    base = p.name.split("#", 1)[0]
    is_embedding = any(w in base for w in _EMBED)
    if is_embedding and not (head_is_embedding(desc) and any(w in base for w in _TOKEN_EMBED)):
        return 0
    return desc.num_layers + 1


def gradient_stages(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> list[Breakdown]:
    """Each forward stage's gradients (stage_of), by kind: what Breakdown.add of every
    trainable parameter's gradient gives, summed in plain dicts (a search asks this of
    every rank's parameter set)."""
    stages = [Breakdown() for _ in range(num_stages(desc))]
    for p in params.trainable():
        size = nbytes(p.numel, grad_dtype(spec, p))
        if size:
            key = "gradients/lora_adapters" if p.kind == "lora" else "gradients/trainable"
            terms = stages[stage_of(desc, p)].terms
            terms[key] = terms.get(key, 0) + size
    return stages


# The last linear of each feed-forward block, whose weight gradient backward makes first.
_MLP_OUT = (".mlp.down_proj", ".mlp.c_proj", ".output.dense", ".experts.down_proj", ".shared_expert.down_proj",
            ".mlp.dense_4h_to_h", ".fc2", ".DenseReluDense.wo")


def is_mlp_out(name: str) -> bool:
    """A layer's MLP output projection: the gradient a layer holds at its MLP-backward peak."""
    return any(m in name.split("#")[0] for m in _MLP_OUT)


def gradient_stages_at_peak(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> list[Breakdown]:
    """Gradients of each stage that exist at that stage's backward peak: for a layer, the
    MLP's backward (the first part of the layer to run backward) has produced only the
    output projection's weight gradient; other stages hold all of theirs."""
    stages = [Breakdown() for _ in range(num_stages(desc))]
    for p in params.trainable():
        if p.layer is not None and not is_mlp_out(p.name):
            continue
        key = "gradients/lora_adapters" if p.kind == "lora" else "gradients/trainable"
        stages[stage_of(desc, p)].add(key, nbytes(p.numel, grad_dtype(spec, p)))
    return stages


def is_token_embedding(p) -> bool:
    """The input token embedding's weight (not a position embedding, not a shard's piece)."""
    return any(w in p.name for w in _TOKEN_EMBED) and "#" not in p.name


def tied_head_grad_pending(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> Breakdown:
    """With gradient accumulation, a later micro-step's lm_head backward makes a fresh (v, h)
    gradient of the tied weight that waits in its AccumulateGrad input buffer until the
    embedding's backward (tied_embedding_grad_temp) while the weight's .grad already exists:
    one more (v, h) through every stage's backward. Measured: the CPU grid's tied qwen2, amp,
    b1 s160, two micro-steps (the embedding's backward holds .grad and three more)."""
    if spec.grad_accum_steps <= 1:
        return Breakdown()
    g = tied_embedding_grad_temp(desc, spec, params).terms.get("backward/tied_embedding_grad", 0)
    return Breakdown().add("backward/tied_head_grad_pending", g)


def tied_embedding_grad_temp(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> Breakdown:
    """The tied weight's two gradients meet in its AccumulateGrad node's input buffer: the
    lm_head backward's (held there since the head's backward, counted as the weight's
    gradient) and embedding_dense_backward's fresh (v, h) one, which the engine sums out of
    place (torch/csrc/autograd/input_buffer.cpp `accumulate`: `old_var + var` when neither
    buffer can be reused) before AccumulateGrad takes the sum: two more (v, h) for a moment.
    Seen both on the CPU meter (tied qwen2, b1 s128, where this moment is the step's peak)
    and in the H100 allocation traces (bench/allocator/traces: qwen2.5-0.5b and llama-3.2-1b
    hold three embedding-sized blocks at the embedding's backward, then free two)."""
    out = Breakdown()
    if not head_is_embedding(desc):
        return out
    for p in params.trainable():
        if p.layer is None and is_token_embedding(p):
            g = nbytes(p.numel, grad_dtype(spec, p))
            out.add("backward/tied_embedding_grad", g).add("backward/tied_embedding_grad_sum", g)
    return out
