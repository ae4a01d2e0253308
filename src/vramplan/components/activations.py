"""Activations: the tensors autograd saves in forward, listed per stage, and what the
logits, the loss and backward add on top.

Stages are the embedding, each decoder layer, and the head (final norm, lm_head, loss).
Each layer's list comes from replaying the architecture's forward on the symbolic
recorder (components/arch.py); layers with the same signature (MoE or not, which
parameters train, whether the input needs a gradient) are replayed once.
Legend: b micro-batch, s sequence, h hidden, f MLP width, v vocabulary, T = b * s.
"""
from __future__ import annotations

from functools import partial

from vramplan.breakdown import Breakdown
from vramplan.components.weights import output_head_trainable
from vramplan.components.activation_plan import INPUT_LEAF, ActivationPlan, Stage, copy_plan
from vramplan.components.arch import Ctx, local_window, model_rows, norm
from vramplan.components.kept_logits import Kept, kept_input, kept_positions
from vramplan.components.checkpoint_moments import CACHE_TERM, apply_stops, cache_before, layer_stop
from vramplan.components.chunked_loss import chunked_loss_terms
from vramplan.components.megatron_loss import megatron_ce_terms
from vramplan.components.arch_gpt2_bert import family_forward, is_other, layer_fn, layer_prefix, other_embed, other_head
from vramplan.components.dora import apply as linear_transients_apply
from vramplan.components.grad_moments import apply as grad_moments_apply
from vramplan.components.eager_attention import (CAUSAL_MASK_OTHERS, backward_moment as eager_backward,
                                                 eager_masks, place_masks)
from vramplan.components.dtypes import dtypes_of
from vramplan.components.forward_ctx import build_ctx
from vramplan.components.graph import Recorder, Storage, Sym
from vramplan.components.layer_backward import layer_backward
from vramplan.components.memo import cached_plan, spec_key
from vramplan.components.op_checkpoint import split_layer
from vramplan.components.selective import split_attention_core
from vramplan.components.shifted_loss import label_smoother_terms, loss_kind, shifted_loss_terms
from vramplan.components.quant import SAVED, dequant_modes, dequant_peak, kernel_saves_input
from vramplan.components.trainable import ParamSet
from vramplan.components.trl_sft_metrics import metrics_moment
from vramplan.model import MlpKind, ModelDesc
from vramplan.spec import Checkpointing, JobSpec, LossImpl, Task
from vramplan.spec.stack import Framework
from vramplan.units import nbytes


# The input of each feed-forward block's last linear: saved by it, released when its
# MmBackward has run, which is the first node of the layer's backward. In a gated MLP that
# is act * up (the activation itself is still needed by the product's backward); in a
# plain MLP it is the activation's output.
_MLP_OUT_INPUTS = {MlpKind.GATED: ("mlp/act_times_up", "moe/expert_act_times_up"), MlpKind.PLAIN: ("mlp/act",)}


def _recorder(spec: JobSpec, seen: set[int]) -> Recorder:
    q = spec.quantization
    saved = q.compute_dtype if q is not None and dequant_modes(q)[0] == SAVED else None
    f8 = (True, spec.float8.convert_lm_head) if spec.float8 is not None else None
    peak = partial(dequant_peak, q) if q is not None and dequant_peak(q, 1) else None
    return Recorder(autocast=dtypes_of(spec).autocast, backend=spec.backend.value, seen=seen, dequant_saved=saved,
                    linear_saves_input=zero3_linear_wrap(spec),
                    float8=f8, quant_input_saved=kernel_saves_input(q), dequant_peak=peak)


def zero3_linear_wrap(spec: JobSpec) -> bool:
    """Whether linears run DeepSpeed's zero3_linear_wrap: ZeRO-3, whose models the HF, TRL
    and accelerate (zero3_init_flag) scripts build inside deepspeed.zero.Init (graph.Recorder
    `linear_saves_input`). Measured: bench/parallel/deepspeed_cpu.py --set reuse (LoRA)."""
    par = spec.parallel
    return par is not None and par.zero_stage == 3


def plan_activations(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> ActivationPlan:
    """The saved tensors of one model's step, memoized on the model, its parameter set and the
    spec's fields but the layout's (memo.py LAYOUT_FIELDS). Callers get a copy."""
    return copy_plan(shared_plan(desc, spec, params))


def shared_plan(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> ActivationPlan:
    """plan_activations' memoized plan itself, uncopied: for callers that only read it."""
    key = spec_key(spec)
    if key is None:
        return _plan_activations(desc, spec, params)
    key = (key, zero3_linear_wrap(spec))  # the one layout setting that changes what is saved
    return cached_plan(desc, params, key, lambda: _plan_activations(desc, spec, params))


def _plan_activations(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> ActivationPlan:
    if getattr(desc, "num_encoder_layers", 0):  # encoder-decoder (T5): its own stages
        from vramplan.components.seq2seq import plan_seq2seq
        return plan_seq2seq(desc, spec, params)
    ctx = build_ctx(desc, spec, params)
    b, s = model_rows(spec)
    seen: set[int] = set()
    rec = _recorder(spec, seen)
    ids = rec.new("input_ids", (b, s), "int64", False)
    ctx.input_hook = spec.gradient_checkpointing is not Checkpointing.NONE  # arch.input_hook: GPT-2's, BERT's
    x = _embed(rec, ctx, ids)
    hook_leaf, embed_dtype = ctx.shared_keys.pop("input_leaf", 0), x.dtype
    input_leaf = hook_leaf
    model_locals = ctx.shared_keys.pop("model_locals", [])  # the embedding's, where a family names them
    if spec.gradient_checkpointing is not Checkpointing.NONE and not x.requires_grad:
        # transformers' enable_input_require_grads (used with checkpointing when the
        # embeddings are frozen: LoRA, freeze): a forward hook calls
        # output.requires_grad_(True) on the embedding output, so layer 0 sees an input
        # that needs a gradient.
        x = Sym(x.name, x.shape, x.dtype, True, x.storage)
        input_leaf = x.storage.nbytes
    # the hooked leaf of GPT-2's and BERT's embeddings (arch.input_hook) is no layer's input:
    # the graph's AccumulateGrad holds it until the embedding's backward, as a saved tensor
    stages = [Stage("embedding", rec.saved_items() + ([(INPUT_LEAF, hook_leaf)] if hook_leaf else []), [])]
    cache: dict[tuple, tuple[list, bool, tuple | None, str, tuple, list, tuple]] = {}
    parts: dict[tuple, tuple] = {}   # one stage's lists per signature (shared, never changed in place)
    gc, f8_layer, fwd_peaks, mlp_out, dora_at, stops, moments_at = (spec.gradient_checkpointing, (), {}, _MLP_OUT_INPUTS[desc.mlp],
                                                                  {}, {}, {})
    hook = getattr(family_forward(desc), "backward_peak", None)
    eager, mlp_bwd, attn_bwd = ctx.attention == "eager" and not is_other(desc), layer_backward(desc, spec), {}
    for i in range(desc.num_layers):
        key = _signature(ctx, i, x)
        if key not in cache:
            cache[key] = _layer(ctx, spec, i, x, b, s, seen, gc is Checkpointing.OP_SELECTIVE)
        saved, out_rg, op_split, out_dtype, f8_layer, (fwd_peak, unsaved_peak, input_saved, own_input), (dora, grads), \
            stop = cache[key]
        if i == 0:
            # LlamaModel.forward keeps `inputs_embeds` (layer 0's input) as a local to its
            # return: alive through every layer's forward unless a layer saved it
            embeds = model_locals or ([] if input_saved else [("inputs_embeds", x.storage.nbytes)])
        # torchtitan <= 0.2 `_apply_layer_sac`: with selective_ac_option = N only every N-th
        # block (a global count from 1) is wrapped; checkpoint_every = 1 wraps them all.
        wrapped = gc is Checkpointing.FULL and (i + 1) % spec.checkpoint_every == 0
        at = (key, wrapped, x.storage.nbytes)
        if at not in parts:
            if wrapped:
                # torch.utils.checkpoint (non-reentrant, transformers 5's default) keeps the
                # layer's inputs for the recomputation and nothing the layer saves; the
                # recomputation runs on those inputs, so an input the layer saves itself (fp32
                # RMSNorm's pow, LayerNorm) is that same storage, not a second one
                redo = [it for it in saved if it[0] != own_input] if own_input else saved
                parts[at] = ([("checkpoint/layer_input", x.storage.nbytes)], redo, mlp_out)
            elif gc is Checkpointing.OP_SELECTIVE:
                keep, redo, dropped = op_split
                parts[at] = (keep, redo, mlp_out + dropped)
            elif gc is Checkpointing.SELECTIVE:
                parts[at] = split_attention_core(saved) + (mlp_out,)
            else:
                parts[at] = (saved, [], mlp_out)
        stages.append(Stage(f"layer {i}", *parts[at]))
        if wrapped:
            # what its forward holds, none of it saved, beside the model forward's own locals
            # (GPT-2's inputs_embeds and position_embeds; Llama's is layer 0's kept input)
            fwd_peaks[len(stages) - 1] = fwd_peak + model_locals
            if stop is not None:
                stops[len(stages) - 1] = stop
        elif unsaved_peak:
            # what its forward holds beyond what it saves (a frozen down_proj's input)
            fwd_peaks[len(stages) - 1] = unsaved_peak + embeds
        dora_at[len(stages) - 1] = (dora, wrapped)  # DoRA's linears (components/dora.py)
        if grads:
            moments_at[len(stages) - 1] = grads  # its ops' backward moments (grad_moments.py)
        # a family's own backward peak (Jamba's Mamba scan): its temporaries, what it releases
        peak = hook(desc, spec, params, i, stages[-1].recompute or stages[-1].saved) if hook else None
        if peak is None and (eager or ctx.attention == "sdpa"):  # a softmax's backward (eager_attention.py)
            if at not in attn_bwd:
                attn_bwd[at] = eager_backward(desc, spec, params, i, stages[-1].recompute or stages[-1].saved,
                                              stages[-1].freed_before_peak, mlp_bwd, x.name if wrapped else None)
            peak = attn_bwd[at]
        if peak is not None:
            stages[-1].backward_transient, stages[-1].freed_before_peak = peak
        # the layer's output dtype: Mamba's fp32 residual stream (residual_in_fp32) widens it
        x = Sym(f"layer{i}.out", x.shape, out_dtype, out_rg, Storage(nbytes(x.numel, out_dtype)))
    _shared_rotary(ctx, stages)
    masked = eager or (ctx.attention == "eager" and desc.model_type in CAUSAL_MASK_OTHERS)
    if masked and gc in (Checkpointing.NONE, Checkpointing.FULL):
        place_masks(eager_masks(desc, b, s, embed_dtype), gc is Checkpointing.FULL, stages[0].saved, fwd_peaks,
                    range(1, len(stages)))
    head_rec = _recorder(spec, seen)
    # ms-swift's logits_to_keep (kept_logits.py); a score head (a reward model) takes none
    kept = None if "score.weight" in ctx.params else kept_positions(spec, desc)
    logits = _head(head_rec, ctx, x, kept)
    stages.append(Stage("head", head_rec.saved_items(), []))
    plan = _with_loss(desc, spec, stages, logits, x, output_head_trainable(params), kept)
    plan.input_leaf_bytes = input_leaf
    casts = None
    if dtypes_of(spec).autocast and gc is not Checkpointing.NONE:
        trained = {p.name.split("#", 1)[0] for p in params.trainable()}
        casts = cache_before([st.recompute for st in stages], trained)
        # a checkpointed layer's forward also holds the autocast casts of the trained weights
        # the earlier layers made (components/checkpoint_moments.py)
        fwd_peaks = {j: [*m, (CACHE_TERM.rsplit("/", 1)[1], casts[j])] if dora_at[j][1] and casts[j] else m
                     for j, m in fwd_peaks.items()}
    if any(fwd_peaks.values()):
        # one Breakdown per distinct moment, shared by the layers that have it (the timeline
        # and the parallel plans sum and scale a shared part once)
        shared_moments: dict[tuple, Breakdown] = {}
        keys = [tuple(fwd_peaks.get(j, ())) for j in range(len(stages))]
        for key in set(keys):
            shared_moments[key] = Breakdown({f"activations/checkpointed_forward/{n}": v for n, v in key})
        plan.stage_forward_transient = [shared_moments[key] for key in keys]
    if any(linears for linears, _ in dora_at.values()):
        linear_transients_apply(plan, dora_at, nbytes(x.numel, x.dtype), "dora" if ctx.dora else "dequant")
    if moments_at:
        grad_moments_apply(plan, moments_at, nbytes(x.numel, x.dtype))
    if spec.float8 is not None:
        from vramplan.components.float8 import apply
        res = dtypes_of(spec).weights
        apply(plan, spec, f8_layer, head_rec.float8_linears, desc.hidden_size, res, mlp_out,
              dtypes_of(spec).gradients)
    if dtypes_of(spec).autocast and spec.gradient_checkpointing is not Checkpointing.NONE:
        # autocast caches the low-precision copy of a weight only when it is a leaf that
        # requires grad (aten/src/ATen/autocast_mode.cpp `cached_cast`: `arg.is_leaf() &&
        # arg.requires_grad()`), until the region exits; so under checkpointing, where the
        # layers keep none of them, the casts of the trained weights made in forward are
        # still alive while the loss is computed. Frozen weights are cast at each use and
        # freed with it.
        if casts[-1]:
            plan.forward_end_transient.add(CACHE_TERM, casts[-1])
    if stops:
        apply_stops(plan, stops)
    head_in = head_rec.last_linear_input
    if head_in is not None:
        plan.head_input = (head_in.name, head_in.storage.nbytes)
        plan.head_linear_saved = ctx.shared_keys.pop("head_linear_saved", ())
    if head_in is not None and id(head_in.storage) not in seen:
        # The output head's input is a local of the model's forward, alive while the loss
        # is computed even when the head does not save it (frozen head, autocast copy).
        plan.forward_end_transient.add("logits/head_input", head_in.storage.nbytes)
    return plan


def _signature(ctx: Ctx, i: int, x: Sym) -> tuple:
    """What makes one layer's saved set differ from another's."""
    if "layer_keys" not in ctx.shared_keys:
        ctx.shared_keys["layer_keys"] = _layer_keys_memo(ctx)
    return ctx.shared_keys["layer_keys"][i] + (x.requires_grad, x.dtype)


_LAYER_KEYS: dict[int, tuple[object, list]] = {}


def _layer_keys_memo(ctx: Ctx) -> list[tuple]:
    """Per layer, what of its signature the input does not change: whether it is MoE, its
    parameters' _layer_keys, its local window and its family's variant (Llama-4's NoPE
    layers). These depend only on the model and the parameter set, which param_set memoizes."""
    owner = ctx.shared_keys.get("param_set")
    hit = _LAYER_KEYS.get(id(owner))
    if owner is not None and hit is not None and hit[0] is owner:
        return hit[1]
    desc, flags = ctx.desc, _layer_keys(ctx)
    kind = getattr(desc, "layer_kind", None)
    keys = [(i in desc.moe_layers, flags.get(i), local_window(desc, i), kind(i) if kind else None)
            for i in range(desc.num_layers)]
    if owner is not None:
        if len(_LAYER_KEYS) >= 64:
            _LAYER_KEYS.pop(next(iter(_LAYER_KEYS)))
        _LAYER_KEYS[id(owner)] = (owner, keys)
    return keys


def _layer_keys(ctx: Ctx) -> dict[int, tuple]:
    """Per layer: which of its parameters train (by suffix) and which modules carry LoRA."""
    prefix = layer_prefix(ctx.desc) + "."
    flags: dict[int, list] = {}
    for name, p in ctx.params.items():
        if name.startswith(prefix):
            idx, rest = name[len(prefix):].split(".", 1)
            flags.setdefault(int(idx), []).append((rest, p.trainable))
    for module in ctx.lora:
        if module.startswith(prefix):
            idx, rest = module[len(prefix):].split(".", 1)
            flags.setdefault(int(idx), []).append((rest, "lora"))
    return {i: tuple(sorted(v, key=str)) for i, v in flags.items()}


def _layer(ctx: Ctx, spec: JobSpec, i: int, x: Sym, b: int, s: int, seen: set[int], op_selective: bool = False):
    """Replay one layer; returns (saved items, output requires_grad, under op-selective
    checkpointing what the layer keeps and recomputes (op_checkpoint.split_layer), output dtype,
    the linears torchao's float8 converts).
    Rotary cos/sin are shared by all layers: reported once, under the embedding stage."""
    rec = _recorder(spec, set(seen))
    if op_selective:
        rec.ops = []
    out = layer_fn(ctx.desc)(rec, ctx, x, i, b, s)
    items = [(name, st.nbytes) for name, st in rec.saved.values() if not name.startswith("rotary/")]
    return (items, out.requires_grad, split_layer(rec, x) if op_selective else None, out.dtype,
            tuple(rec.float8_linears), (rec.forward_peak, rec.unsaved_peak(), id(x.storage) in rec.seen,
                                        rec.saved.get(id(x.storage), (None,))[0]),
            (tuple(rec.linear_transients), tuple(rec.grad_moments)), layer_stop(rec))


def _shared_rotary(ctx: Ctx, stages: list[Stage]) -> None:
    if "cos" in ctx.shared and any(st.saved or st.recompute for st in stages[1:]):
        # cos and sin (Llama); one complex freqs_cis (Llama-4) is kept under "cos" alone
        shared = [ctx.shared[key] for key in ("cos", "sin") if key in ctx.shared]
        stages[0].saved.extend((t.name, t.storage.nbytes) for t in shared)


def _embed(rec: Recorder, ctx: Ctx, ids: Sym) -> Sym:
    desc = ctx.desc
    if is_other(desc):
        return other_embed(rec, ctx, ids)
    x = rec.embedding(ids, ctx.p("model.embed_tokens.weight"), "embed/tokens")
    if desc.embed_scale:
        # Gemma: hidden * normalizer, a 0-d tensor in the hidden dtype.
        x = rec.scale(x, "embed/scaled")
    return x


def _head(rec: Recorder, ctx: Ctx, x: Sym, kept: Kept | None = None) -> Sym:
    desc = ctx.desc
    if is_other(desc):
        return other_head(rec, ctx, x)
    h = norm(rec, ctx, x, "model.norm", "final_norm")
    h = kept_input(rec, h, kept) if kept else h
    head = (ctx.params.get("lm_head.weight") or ctx.params.get("score.weight")
            or ctx.p("model.embed_tokens.weight"))
    before = set(rec.saved)
    logits = rec.linear(h, head, name="logits")
    ctx.shared_keys["head_linear_saved"] = tuple(rec.saved[k][0] for k in rec.saved if k not in before)
    return logits


def _with_loss(desc: ModelDesc, spec: JobSpec, stages: list[Stage], logits: Sym, hidden: Sym,
               head_trains: bool = False, kept: Kept | None = None) -> ActivationPlan:
    """Logits, cross-entropy and their gradients (transformers loss/loss_utils.py
    ForCausalLMLoss: `logits.float()`, then F.cross_entropy = log_softmax + nll_loss; the
    log-softmax output is saved in fp32, and nll_loss saves the shifted labels). With `kept`,
    the logits of K positions per row, and the kept part's hidden gradient beside the whole's."""
    b, s = spec.micro_batch_size, kept.positions if kept else spec.seq_len
    # sequence classification pools one row per sequence before the loss
    tokens = b if spec.task is Task.SEQUENCE_CLASSIFICATION else b * s
    v, c = logits.shape[-1], logits.dtype
    full_c, full32 = nbytes(tokens * v, c), nbytes(tokens * v, "fp32")
    grad_hidden = nbytes(b * spec.seq_len * desc.hidden_size, hidden.dtype)
    saved, fwd, bwd0, head = Breakdown(), Breakdown(), Breakdown(), Breakdown()
    if spec.loss_impl is LossImpl.FUSED_LINEAR_CROSS_ENTROPY:
        # Liger's fused linear cross-entropy computes the hidden-state gradient in forward
        # chunk by chunk (chunk = next_pow2(T / ceil(v / h)) rows) and keeps it until backward.
        chunk = _liger_chunk(tokens, v, desc.hidden_size)
        saved.add("logits/flce_grad_input", grad_hidden)
        fwd.add("logits/flce_chunk_logits", 2 * nbytes(chunk * v, "fp32"))
        return ActivationPlan(stages, saved, fwd, Breakdown(), Breakdown().add("logits/grad_hidden", grad_hidden),
                              layer_backward(desc, spec))
    if spec.loss_impl is LossImpl.CHUNKED and not desc.final_logit_softcapping:
        # torchtune CEWithChunkedOutputLoss (components/chunked_loss.py)
        saved, fwd, bwd0, head = chunked_loss_terms(tokens, v, desc.hidden_size, c, hidden.dtype, head_trains)
        return ActivationPlan(stages, saved, fwd, bwd0, head, layer_backward(desc, spec))
    if (spec.stack.framework is Framework.MEGATRON and spec.loss_impl is LossImpl.STANDARD
            and spec.task is not Task.SEQUENCE_CLASSIFICATION and not desc.final_logit_softcapping):
        # Megatron-Core's vocab_parallel_cross_entropy (components/megatron_loss.py)
        saved, fwd, bwd0, head = megatron_ce_terms(tokens, v, c, grad_hidden)
        return ActivationPlan(stages, saved, fwd, bwd0, head, layer_backward(desc, spec))
    if loss_kind(desc, spec) or spec.label_smoothing:  # repository code's own loss, the Trainer's LabelSmoother
        autocast = dtypes_of(spec).autocast is not None
        terms = (label_smoother_terms(*model_rows(spec), v, c, grad_hidden, autocast) if spec.label_smoothing else
                 shifted_loss_terms(desc, spec, v, c, autocast, grad_hidden, head_trains))
        return ActivationPlan(stages, *terms, layer_backward(desc, spec))
    saved.add("logits/log_softmax", full32).add("logits/labels", nbytes(tokens, "int64"))
    if desc.final_logit_softcapping:
        # Gemma 2 (modeling_gemma2.py Gemma2ForCausalLM.forward): logits / cap, tanh, * cap;
        # tanh saves its output, and its backward adds one more logits-sized gradient.
        saved.add("logits/softcap_tanh", full_c)
        head.add("logits/grad_softcap", full_c)
    if spec.loss_impl is LossImpl.CHUNKED:
        # chunks with Gemma 2's softcap in front: 8 chunks, each upcast to fp32 on its own.
        fwd.add("logits/logits", full_c).add("logits/fp32_chunk", nbytes(-(-tokens // 8) * v, "fp32"))
    elif c != "fp32" and (spec.stack.framework is Framework.TORCHTUNE or spec.stack.fp32_logits
                          or getattr(desc, "logits_float_in_forward", False)):
        # torchtune TransformerDecoder.forward: `output = self.output(h).float()`; the 16-bit
        # logits are dropped as soon as the fp32 copy exists. Mamba2ForCausalLM.forward does
        # the same (`self.lm_head(...).float()`), and LLaMA-Factory's upcast_lmhead_output hook.
        fwd.add("logits/logits_fp32", full32)
    else:
        fwd.add("logits/logits", full_c)
        if c != "fp32":
            fwd.add("logits/logits_fp32", full32)
    fwd.add("logits/padded_labels", nbytes(b * (s + 1), "int64"))
    # TRL's SFTTrainer before its fused head scores metrics over the logits after the loss
    metrics = metrics_moment(spec, *model_rows(spec), v, "fp32" if dtypes_of(spec).autocast else c)
    if metrics is not None and metrics.total() > fwd.total():
        fwd = metrics
    # nll_loss backward writes d(log_softmax) (T x v, fp32); log_softmax backward makes
    # d(logits) in fp32 while the first is still alive.
    bwd0.add("logits/grad_log_softmax", full32).add("logits/grad_logits_fp32", full32)
    if c != "fp32":
        head.add("logits/grad_logits_fp32", full32).add("logits/grad_logits", full_c)
    else:
        head.add("logits/grad_logits", full32)
    head.add("logits/grad_hidden", grad_hidden)
    if kept:
        head.add("logits/grad_hidden_kept", nbytes(b * s * desc.hidden_size, hidden.dtype))
    return ActivationPlan(stages, saved, fwd, bwd0, head, layer_backward(desc, spec))


def _liger_chunk(tokens: int, v: int, h: int) -> int:
    inc = -(-v // h)
    rows = -(-tokens // inc)
    return 1 << (rows - 1).bit_length()
