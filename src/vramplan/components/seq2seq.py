"""Activations of an encoder-decoder (T5, mT5) training step, stage by stage.

Forward order of the stages (transformers 5.23 `models/t5/modeling_t5.py`,
T5ForConditionalGeneration.forward and T5Stack.forward):
  0            encoder embedding (`shared`) and its dropout
  1 .. Le      encoder blocks
  Le + 1       encoder final_layer_norm and dropout: the encoder output
  Le + 2       decoder embedding of the labels shifted right (`_shift_right`) and dropout
  Le + 3 ..    decoder blocks; each cross-attention's k and v projections read the encoder
               output, which is saved once (shared by every decoder block, attributed to
               the first one, whose backward is the last to need it)
  last         decoder final_layer_norm, dropout, the h**-0.5 rescale, lm_head
Backward walks them in reverse: the head, the decoder blocks, the decoder embedding, then
the encoder (its output's gradient has accumulated from every decoder block's k and v).
`weights.stage_of` maps parameters to the same indices.

Length assumption: the target (decoder) length equals `seq_len`, as when the labels are the
same length as the inputs; the exact CPU meter's jobs are built that way.
The loss is T5's own `CrossEntropyLoss()(lm_logits.view(-1, v), labels.view(-1))`: no fp32
upcast of the logits (unlike ForCausalLMLoss), no shift (the decoder input is shifted).
Legend: b micro-batch, s sequence, h d_model, v vocabulary, T = b * s.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components import activations
from vramplan.components.activations import _MLP_OUT_INPUTS, ActivationPlan, Stage
from vramplan.components.forward_ctx import build_ctx
from vramplan.components.arch import lin
from vramplan.components.arch_t5 import t5_block, t5_norm
from vramplan.components.graph import Recorder, Sym
from vramplan.components.layer_backward import layer_backward
from vramplan.components.trainable import ParamSet
from vramplan.model import ModelDesc
from vramplan.spec import Checkpointing, JobSpec, LossImpl
from vramplan.units import nbytes



def _ff_out_inputs(ctx) -> tuple[str, ...]:
    """The input of each feed-forward block's last linear (wo), released by the first node of
    the block's backward (see activations._MLP_OUT_INPUTS); with T5's FF dropout, the dropout's
    output is that input."""
    return ("mlp/dropout",) if _p(ctx) > 0 else _MLP_OUT_INPUTS[ctx.desc.mlp]


def plan_seq2seq(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> ActivationPlan:
    if spec.attention.value == "flash":
        raise ValueError(f"{desc.model_type}: transformers has no flash-attention path for T5 "
                         "(its position bias is an additive mask); use sdpa or eager")
    if spec.loss_impl is not LossImpl.STANDARD:
        raise ValueError(f"{desc.model_type}: loss_impl {spec.loss_impl.value!r} is not modelled for "
                         "encoder-decoder models (T5 computes its own CrossEntropyLoss)")
    ctx = build_ctx(desc, spec, params)
    Le = desc.num_encoder_layers
    gc = spec.gradient_checkpointing is Checkpointing.FULL
    seen: set[int] = set()
    stages: list[Stage] = []
    x, leaf_enc = _embed(ctx, spec, seen, "input_ids", "encoder", stages, gc)
    for j in range(Le):
        x = _block(ctx, spec, seen, stages, x, "encoder", j, None, gc)
    rec = _recorder(ctx, spec, seen)
    enc_out = rec.dropout(t5_norm(rec, ctx, x, "encoder.final_layer_norm", "final_norm"),
                          _p(ctx), "encoder_output")
    stages.append(Stage("encoder_final_norm", rec.saved_items(), []))
    y, leaf_dec = _embed(ctx, spec, seen, "decoder_input_ids", "decoder", stages, gc)
    for j in range(desc.num_layers - Le):
        y = _block(ctx, spec, seen, stages, y, "decoder", j, enc_out, gc)
    rec = _recorder(ctx, spec, seen)
    logits = _head(rec, ctx, y)
    stages.append(Stage("head", rec.saved_items(), []))
    plan = _with_t5_loss(desc, spec, stages, logits, y)
    plan.input_leaf_bytes = leaf_enc + leaf_dec
    return plan


def _recorder(ctx, spec: JobSpec, seen: set[int]) -> Recorder:
    """A recorder kept alive (in the per-forward ctx) until the plan is built: `seen` holds
    storage ids, which Python would reuse for new storages once a finished recorder's died."""
    rec = activations._recorder(spec, seen)
    ctx.shared_keys.setdefault("recorders", []).append(rec)
    return rec


def _p(ctx) -> float:
    return ctx.module_p(ctx.desc.hidden_dropout)


def _embed(ctx, spec: JobSpec, seen: set[int], ids_name: str, stack: str, stages: list[Stage],
           gc: bool) -> tuple[Sym, int]:
    """T5Stack.forward: embed_tokens (= shared) then dropout. Under checkpointing with a
    frozen embedding, enable_input_require_grads' hook marks `shared`'s output (each stack's)
    as requiring a gradient (see activations.plan_activations)."""
    rec = _recorder(ctx, spec, seen)
    ids = rec.new(ids_name, (spec.micro_batch_size, spec.seq_len), "int64", False)
    x = rec.embedding(ids, ctx.p("shared.weight"), f"{stack}/embed/tokens")
    leaf = 0
    if gc and not x.requires_grad:
        x = Sym(x.name, x.shape, x.dtype, True, x.storage)
        leaf = x.storage.nbytes
    x = rec.dropout(x, _p(ctx), f"{stack}/embed/dropout")
    stages.append(Stage(f"{stack}_embedding", rec.saved_items(), []))
    return x, leaf


def _block(ctx, spec: JobSpec, seen: set[int], stages: list[Stage], x: Sym, stack: str, j: int,
           enc_out: Sym | None, gc: bool) -> Sym:
    """One T5Block. Under full checkpointing (non-reentrant) the block keeps its tensor inputs:
    the hidden state, and, shared by the stack's later blocks, the position bias the first
    block made (the decoder's also the encoder output); what it saves comes back in backward."""
    rec = _recorder(ctx, spec, seen)
    if gc:
        kept = [("checkpoint/layer_input", x.storage.nbytes)]
        if enc_out is not None and id(enc_out.storage) not in seen:
            seen.add(id(enc_out.storage))
            kept.append(("checkpoint/encoder_output", enc_out.storage.nbytes))
        inner = _recorder(ctx, spec, set(seen))
        out = t5_block(inner, ctx, x, stack, j, spec.micro_batch_size, spec.seq_len, enc_out)
        if j == 0:  # the position bias (1, a, s, s) is an output of block 0, kept by the others
            bias = ctx.shared[f"{stack}/position_bias"]
            kept.append((f"checkpoint/{stack}_position_bias", bias.storage.nbytes))
        label = f"layer {stack} {j}"
        stages.append(Stage(label, kept, inner.saved_items(), _ff_out_inputs(ctx)))
    else:
        out = t5_block(rec, ctx, x, stack, j, spec.micro_batch_size, spec.seq_len, enc_out)
        stages.append(Stage(f"layer {stack} {j}", rec.saved_items(), [], _ff_out_inputs(ctx)))
    return out


def _head(rec: Recorder, ctx, y: Sym) -> Sym:
    """final_layer_norm, dropout, `sequence_output * model_dim**-0.5` (T5 when tied), lm_head
    (the shared embedding: transformers 5.23 always ties it)."""
    h = rec.dropout(t5_norm(rec, ctx, y, "decoder.final_layer_norm", "final_norm"), _p(ctx), "final_dropout")
    if ctx.desc.scale_decoder_outputs:
        h = rec.scale(h, "rescaled")
    if "lm_head.weight" in ctx.params:
        return lin(rec, ctx, h, "lm_head", "logits")
    return rec.linear(h, ctx.p("shared.weight"), name="logits")


def _with_t5_loss(desc: ModelDesc, spec: JobSpec, stages: list[Stage], logits: Sym, hidden: Sym) -> ActivationPlan:
    """CrossEntropyLoss on the logits in their own dtype: log_softmax (saved, logits dtype),
    nll_loss (saves the labels, the batch's own tensor). Loss backward: nll_loss's gradient and
    log_softmax's, both logits-sized; the head's backward then the logits gradient and the
    decoder output's."""
    T, v, c = spec.micro_batch_size * spec.seq_len, logits.shape[-1], logits.dtype
    full = nbytes(T * v, c)
    grad_hidden = nbytes(T * desc.hidden_size, hidden.dtype)
    saved = Breakdown().add("logits/log_softmax", full).add("logits/labels", nbytes(T, "int64"))
    fwd = Breakdown().add("logits/logits", full)
    bwd0 = Breakdown().add("logits/grad_log_softmax", full).add("logits/grad_logits", full)
    head = Breakdown().add("logits/grad_logits", full).add("logits/grad_hidden", grad_hidden)
    return ActivationPlan(stages, saved, fwd, bwd0, head, layer_backward(desc, spec))
