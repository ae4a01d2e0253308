"""The trained model of a multi-model job: the core's single-model plan with the job's
rows and its own loss terms.

Legend: r rows through the model (2b for chosen + rejected), s sequence, h hidden,
v vocabulary, c the compute dtype; T = r * s tokens, T' = r * (s - 1) shifted tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from vramplan.breakdown import Breakdown
from vramplan.components import qlora_prep
from vramplan.components.dtypes import dtypes_of
from vramplan.components.activations import ActivationPlan, plan_activations
from vramplan.components.trainable import ParamSet, param_set
from vramplan.components.weights import output_head_trainable
from vramplan.spec.stack import loss_detached_before_step
from vramplan.jobs.chunked_nll import ChunkedNll
from vramplan.jobs.divergence import Divergence
from vramplan.jobs.logprob import Chunked
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, Task
from vramplan.spec.stack import Framework
from vramplan.timeline import StepPlan
from vramplan.units import nbytes


@dataclass(slots=True)
class LossTerms:
    """What a loss adds on top of the layers' saved activations (see timeline.StepPlan)."""

    saved: Breakdown
    forward_end: Breakdown
    backward_start: Breakdown
    head_backward: Breakdown
    head_freed: tuple[str, ...] = ()
    """Names of the head stage's saved tensors already released at its backward peak."""
    unless_saved: tuple[tuple[str, str], ...] = ()
    """(forward_end term, head-stage saved name): a tensor alive at forward_end that is
    counted there only when the head stage did not save it (then it is a transient)."""


# TRL configs whose `disable_dropout` defaults to True (trl/trainer/dpo_config.py, kto_config.py,
# reward_config.py; trl/experimental gkd, orpo and cpo configs); SFTConfig has no such field and
# GRPOConfig's default is False
DROPOUT_OFF_TASKS = frozenset({Task.DPO, Task.IPO, Task.KTO, Task.REWARD_MODEL, Task.DISTILL, Task.ORPO, Task.SIMPO})
LLAMA_FACTORY_DROPOUT_OFF_TASKS = frozenset({Task.DPO, Task.IPO, Task.KTO, Task.ORPO, Task.SIMPO})


def trainer_disables_dropout(spec: JobSpec) -> bool:
    """The trainer's __init__ runs trl/trainer/utils.py `disable_dropout_in_model` (every
    nn.Dropout's p = 0, PEFT's lora_dropout included), and at::dropout returns its input when
    p == 0 (aten/src/ATen/native/Dropout.cpp `_dropout_impl`): no mask, no dropped copy.
    These tasks run TRL's trainers under the HF Trainer and TRL stacks, and when no framework is named.
    Llama-family attention dropout is a float handed to the attention function
    (LlamaAttention `dropout=0.0 if not self.training else self.attention_dropout`), no
    nn.Dropout: it stays (bench/trainers `eager/attn-dropout0.1`)."""
    if spec.disable_dropout is not None:  # the TRL config's disable_dropout, as the user set it
        return spec.disable_dropout
    # no framework named (PLAIN): these tasks are the TRL trainers' (what `vramplan measure`
    # runs, and spec/stack.py loss_detached_before_step reads them the same way)
    if spec.stack.framework is Framework.LLAMA_FACTORY:
        # its CustomDPOTrainer (DPO, IPO, ORPO, SimPO) and CustomKTOTrainer call TRL's
        # disable_dropout_in_model on the policy and the reference (`disable_dropout=True`,
        # which its workflows never override: llamafactory/train/dpo/trainer.py, kto/trainer.py)
        return spec.task in LLAMA_FACTORY_DROPOUT_OFF_TASKS
    if spec.stack.framework is Framework.MS_SWIFT:
        # its RLHFTrainerMixin runs it when the config's disable_dropout is set, which its DPO
        # and reward configs inherit from TRL's (True): swift/rlhf_trainers/rlhf_mixin.py
        return spec.task in (Task.DPO, Task.IPO, Task.REWARD_MODEL)
    return (spec.stack.framework in (Framework.TRL, Framework.HF_TRAINER, Framework.PLAIN)
            and spec.task in DROPOUT_OFF_TASKS)


def single_spec(spec: JobSpec, rows: int, seq_len: int | None = None, **changes) -> JobSpec:
    """The job as the core sees one trained model: task sft, `rows` rows, no job fields; the
    dropout modules off where the job's TRL trainer turns them off (components/forward_ctx.py)."""
    changes.setdefault("disable_dropout", trainer_disables_dropout(spec))
    spec = qlora_prep.resolved(spec)   # the job's trainer prepares a quantized base its way
    return replace(spec, task=changes.pop("task", Task.SFT), micro_batch_size=rows,
                   seq_len=seq_len or spec.seq_len, reference_model=None, teacher=None,
                   reward_model=None, critic_model=None, num_generations=None,
                   max_new_tokens=None, generation=None, models=(), vision=None,
                   diffusion=None, **changes)


def compute_dtype(spec: JobSpec) -> str:
    """The dtype of the model's output head, so of its logits. On a quantized base the head
    is one of the parameters the quantizer leaves (transformers' bitsandbytes, GPTQ and AWQ
    skip the output embedding), in the dtype the stack's preparation gave it: fp32 after
    PEFT's prepare_model_for_kbit_training (the final norm's output is fp32 too)."""
    if spec.method.value != "qlora":
        return dtypes_of(spec).compute
    return qlora_prep.rest_dtype(spec, "lm_head", dtypes_of(spec).weights)


def trainer_logits_dtype(spec: JobSpec) -> str:
    """The dtype of the logits a trainer's own loss receives from `model(...)`. When the
    trainer autocasts, accelerate wraps each prepared model's forward in
    `convert_outputs_to_fp32` (accelerate/accelerator.py `prepare_model`, native_amp; the
    frozen models prepared with `evaluation_mode=True` too), so the loss gets fp32 copies;
    otherwise the head's dtype (transformers 5 does not upcast the logits)."""
    return "fp32" if dtypes_of(spec).autocast else compute_dtype(spec)


def logps_loss(rows: int, s: int, v: int, h: int, c: str) -> LossTerms:
    """Per-sequence log-probs of the labels, as trl DPOTrainer.get_batch_logps computes them:
    `logits[:, :-1].float().log_softmax(-1)` then `torch.gather(..., labels[:, 1:])`.
    log_softmax saves its fp32 output; gather saves the (cloned, shifted) labels.
    Backward: gather's zeros-and-scatter gradient, log_softmax's gradient, the cast back
    to c, and SliceBackward's full-size zeros (aten slice_backward)."""
    t, t1 = rows * s, rows * (s - 1)
    saved = Breakdown().add("logits/log_softmax", nbytes(t1 * v, "fp32")).add("logits/labels", nbytes(t1, "int64"))
    fwd = Breakdown().add("logits/logits", nbytes(t * v, c))
    if c != "fp32":
        fwd.add("logits/logits_fp32", nbytes(t1 * v, "fp32"))
    bwd0 = Breakdown().add("logits/grad_log_softmax", nbytes(t1 * v, "fp32")).add(
        "logits/grad_logits_fp32", nbytes(t1 * v, "fp32"))
    head = Breakdown()
    if c != "fp32":
        head.add("logits/grad_logits_fp32", nbytes(t1 * v, "fp32")).add("logits/grad_logits", nbytes(t1 * v, c))
    else:
        head.add("logits/grad_logits_shifted", nbytes(t1 * v, c)).add("logits/grad_logits", nbytes(t * v, c))
    return LossTerms(saved, fwd, bwd0, head)


def cast_first_logps_loss(rows: int, s: int, v: int, c: str) -> LossTerms:
    """LLaMA-Factory's per-sequence log-probs: the whole logits cast to fp32 first
    (llamafactory/train/dpo/trainer.py `concatenated_forward`: `model(...).logits.to(
    torch.float32)`; under autocast accelerate's convert_outputs_to_fp32 has already made
    that copy), then its get_batch_logps (train/trainer_utils.py): `labels[:, 1:].clone()`,
    `logits[:, :-1, :].log_softmax(-1)` and a gather. log_softmax saves its fp32 output and
    the fp32 logits stay alive to the end of the forward (at the cast, the c logits beside
    them: smaller than the log_softmax stage). Backward: gather's zeros-and-scatter gradient
    and log_softmax's, then SliceBackward's full fp32 zeros (aten slice_backward) beside the
    shifted gradient; the cast back to c (t v fp32 + t v c) comes after and is smaller."""
    t, t1 = rows * s, rows * (s - 1)
    saved = Breakdown().add("logits/log_softmax", nbytes(t1 * v, "fp32")).add("logits/labels", nbytes(t1, "int64"))
    fwd = Breakdown().add("logits/logits_fp32", nbytes(t * v, "fp32"))
    bwd0 = Breakdown().add("logits/grad_log_softmax", nbytes(t1 * v, "fp32")).add(
        "logits/grad_logits_shifted", nbytes(t1 * v, "fp32"))
    head = Breakdown().add("logits/grad_logits_shifted", nbytes(t1 * v, "fp32")).add(
        "logits/grad_logits_fp32", nbytes(t * v, "fp32"))
    return LossTerms(saved, fwd, bwd0, head)


def score_loss(rows: int, s: int, h: int, c: str, norm_dtype: str | None = None,
               embeds_saved: bool = False) -> LossTerms:
    """A one-output score head on every position (transformers
    LlamaForSequenceClassification: `score(hidden_states)` then the last token's value):
    (r, s, 1) scores, (r,) pooled; the pairwise loss is on r values. With `norm_dtype` (the
    residual stream's dtype) the final RMSNorm's own moments are modelled too
    (final_norm_moments): with logits this small they, not the head, set the forward peak
    and the head stage's backward peak."""
    t = rows * s
    fwd = Breakdown().add("head/scores", nbytes(t, c))
    head = Breakdown().add("head/grad_scores", nbytes(t, c)).add("head/grad_hidden", nbytes(t * h, c))
    terms = LossTerms(Breakdown(), fwd, Breakdown().add("head/grad_pooled", nbytes(rows, c)), head)
    if norm_dtype is not None:
        final_norm_moments(terms, t, h, norm_dtype, embeds_saved)
    return terms


def final_norm_moments(terms: LossTerms, t: int, h: int, res: str, embeds_saved: bool) -> None:
    """The final norm's forward and backward moments, kept where larger than the head's.
    transformers models/llama/modeling_llama.py LlamaRMSNorm.forward: `x.to(float32)`,
    `x.pow(2).mean(-1)`, `x * rsqrt(var + eps)`, `weight * xhat.to(input_dtype)`.
    Forward, at the weight multiply (LlamaModel.forward is still running): the layers'
    output x (not saved when the upcast is a copy), `inputs_embeds` (a local of
    LlamaModel.forward, alive to its return; saved only when layer 0's norm upcast is a no-op
    or a checkpoint keeps it) and the fp32 xhat are alive, with the variance, beside xhat's
    .to(input_dtype) copy and the product: saved when the norm weight trains (the copy) and
    when the head's weight does (the product, its input), else alive only here
    (`unless_saved`: a frozen norm under LoRA). With fp32 weights all are saved already.
    Backward, at pow's backward (torch/csrc/autograd/FunctionsManual.cpp pow_backward:
    `grad * (exponent * self.pow(exponent - 1))`): the mul path's fp32 gradient of x waiting
    to be accumulated, MeanBackward's expanded gradient, self.pow(1), 2 * it and the product,
    five (T, h) fp32 tensors; the norm output (score's input), xhat's cast (or xhat) and
    rstd are freed by then (their users' backward ran), and so are the head's gradients."""
    th, f32 = t * h, "fp32"
    if res != f32:
        at_norm = Breakdown().add("head/final_norm_input", nbytes(th, res)).add(
            "head/final_norm_xhat_fp32", nbytes(th, f32)).add("head/final_norm_variance", nbytes(t, f32))
        if not embeds_saved:
            at_norm.add("head/inputs_embeds", nbytes(th, res))
        at_norm.add("head/final_norm_xhat_cast", nbytes(th, res)).add("head/final_norm_output", nbytes(th, res))
        if at_norm.total() > terms.forward_end.total():
            terms.forward_end = at_norm
            terms.unless_saved = (("head/final_norm_xhat_cast", "final_norm.xhat_cast"),
                                  ("head/final_norm_output", "final_norm"))
    freed = 2 * nbytes(th, res) + nbytes(t, f32)
    at_pow = Breakdown().add("head/final_norm_grad_fp32", 5 * nbytes(th, f32))
    if at_pow.total() - freed > terms.head_backward.total():
        terms.head_backward = at_pow
        terms.head_freed = ("final_norm", "final_norm.xhat_cast", "final_norm.xhat", "final_norm.rstd")


@dataclass(slots=True)
class Trained:
    desc: ModelDesc
    spec: JobSpec
    params: ParamSet
    plan: StepPlan




def _bypass_head(acts: ActivationPlan, head: Chunked | ChunkedNll | Divergence) -> Breakdown:
    """What every head that takes the last hidden state itself shares: the model's head module
    is bypassed, so what its linear saved goes and the head's own saved tensors join the head
    stage; at the forward's end, the stage's non-logits terms, the last hidden state and the
    head's forward fold (the caller adds its own)."""
    name, size = acts.head_input
    stage = acts.stages[-1]
    stage.saved = [x for x in stage.saved if x[0] not in acts.head_linear_saved] + head.saved(size)
    fwd = Breakdown()
    for key, value in acts.forward_end_transient.terms.items():
        if not key.startswith("logits/"):
            fwd.add(key, value)
    return fwd.add("logits/head_input", size).merge(head.forward_fold())


def chunked_loss(acts: ActivationPlan, head: Chunked, trainable: bool) -> LossTerms:
    """TRL 1.x's chunked log-prob head on a trained model (jobs/logprob.py for the sources).
    The head module is bypassed, so what its linear saved goes; the function saves its own
    shifted hidden copy, targets and log_z (in the head stage, freed by the head's backward).
    Forward: the last hidden state and the fold's live set; the autocast weight cache stays.
    Loss: the per-token outputs of N and the label mask; backward: backward_fold."""
    fwd = _bypass_head(acts, head)
    n = head.tokens
    saved = Breakdown().add("logprob/log_probs", nbytes(n, "fp32")).add("logprob/label_mask", nbytes(n, "bool"))
    bwd0 = Breakdown().add("logprob/grad_log_probs", 2 * nbytes(n, "fp32"))
    return LossTerms(saved, fwd, bwd0, head.backward_fold(trainable))


def divergence_loss(acts: ActivationPlan, head: Divergence, trainable: bool) -> LossTerms:
    """TRL's chunked student-teacher divergence on the trained student (jobs/divergence.py):
    the head module is bypassed; both hidden states (and the log-normalizers, the per-token
    divergence) are saved in the head stage; at the forward's end the student's last hidden
    state, the teacher's (the slice keeps it, r > 1) and the fold's live set; `masked_fill`'s
    bool mask is what the loss keeps; backward: backward_fold."""
    fwd = _bypass_head(acts, head)
    n = head.tokens
    if head.rows > 1:
        fwd.add("divergence/teacher_last_hidden_state", head.teacher_input)
    saved = Breakdown().add("divergence/valid_mask", nbytes(n, "bool"))
    bwd0 = Breakdown().add("divergence/grad_per_token", 2 * nbytes(n, "fp32"))
    return LossTerms(saved, fwd, bwd0, head.backward_fold(trainable))


def chunked_nll_loss(acts: ActivationPlan, head: ChunkedNll, trainable: bool) -> LossTerms:
    """TRL 1.7-1.14's chunked_nll head on a trained model (jobs/chunked_nll.py): the head
    module is bypassed; the gathered hidden states are saved; the last hidden state and a
    chunk's live set at the forward's end; the chunk's backward, with the hidden states'
    gradient accumulating, at the loss's backward."""
    fwd = _bypass_head(acts, head)
    grad_hidden = nbytes(head.tokens * head.hidden, head.hidden_dtype)
    back = Breakdown().add("chunked_nll/grad_hidden", grad_hidden).merge(head.backward_fold(trainable))
    return LossTerms(Breakdown(), fwd, Breakdown(), back)


def with_loss(acts: ActivationPlan, loss: LossTerms | Chunked | ChunkedNll | Divergence, params: ParamSet) -> bool:
    """Put `loss` in place of causal-LM cross-entropy in the activation plan (a Chunked head
    first becomes its LossTerms against the model's own plan); True for a chunked head."""
    chunked = isinstance(loss, (Chunked, ChunkedNll, Divergence))
    if isinstance(loss, ChunkedNll):
        loss = chunked_nll_loss(acts, loss, output_head_trainable(params))
    elif isinstance(loss, Divergence):
        loss = divergence_loss(acts, loss, output_head_trainable(params))
    elif chunked:
        loss = chunked_loss(acts, loss, output_head_trainable(params))
    forward_end = loss.forward_end
    if loss.unless_saved:
        saved = {name for name, _ in acts.stages[-1].saved}
        dropped = {term for term, name in loss.unless_saved if name in saved}
        forward_end = Breakdown()
        for key, value in loss.forward_end.terms.items():
            if key not in dropped:
                forward_end.add(key, value)
    acts.loss_saved, acts.forward_end_transient = loss.saved, forward_end
    acts.loss_backward_transient, acts.head_backward_transient = loss.backward_start, loss.head_backward
    if loss.head_freed:
        acts.stages[-1].freed_before_peak = loss.head_freed
    return chunked


def head_grads_after_fold(plan: StepPlan) -> None:
    """The head stage's gradients (lm_head, final norm) are made after the chunked head's
    backward returns, so none exists at its fold (the fp32 accumulators stand in): count
    them from the stage before on (new lists: the plan's are memoized)."""
    if len(plan.grads_by_stage) < 2:
        return
    grads = [Breakdown().merge(g) for g in plan.grads_by_stage]
    grads[-2].merge(grads[-1])
    grads[-1] = Breakdown()
    plan.grads_by_stage = grads
    if plan.stage_grads_at_peak is not None:  # the same for what a stage's peak sees
        at_peak = [Breakdown().merge(g) for g in plan.stage_grads_at_peak]
        at_peak[-2].merge(at_peak[-1])
        at_peak[-1] = Breakdown()
        plan.stage_grads_at_peak = at_peak


def trained_plan(desc: ModelDesc, spec: JobSpec, rows: int, loss: LossTerms | Chunked,
                 seq_len: int | None = None) -> Trained:
    """The core's step plan for the trained model with `loss` in place of causal-LM
    cross-entropy (LossTerms, or a Chunked head whose terms need the model's own plan);
    the batch is left to the job (it is shared by its models)."""
    from vramplan.step.build import rank_step
    one = single_spec(spec, rows, seq_len)
    params = param_set(desc, one)
    acts: ActivationPlan = plan_activations(desc, one, params)
    chunked = with_loss(acts, loss, params)
    # the job's task decides the loop: a TRL trainer's step frees the loss before the optimizer
    # step whatever the stack (spec/stack.py TRL_TRAINER_TASKS); `one` says task sft
    plan = rank_step(desc, one, params, acts, loss_detached=loss_detached_before_step(spec))
    if chunked:
        head_grads_after_fold(plan)
    plan.static.terms.pop("batch/input_ids", None)
    return Trained(desc, one, params, plan)


def prefixed(plan: StepPlan, prefix: str) -> StepPlan:
    """Every term of the plan under `prefix/` (the per-model section of the breakdown)."""
    p = prefix + "/"
    re = lambda b: Breakdown().merge(b, prefix=p)  # noqa: E731
    each = lambda bs: None if bs is None else [re(b) for b in bs]  # noqa: E731
    return StepPlan(static=re(plan.static), grads_by_stage=each(plan.grads_by_stage),
                    stage_acts=each(plan.stage_acts), loss_saved=re(plan.loss_saved),
                    forward_end_transient=re(plan.forward_end_transient),
                    loss_backward_transient=re(plan.loss_backward_transient),
                    stage_backward_transient=each(plan.stage_backward_transient),
                    optimizer_temporaries=re(plan.optimizer_temporaries),
                    stage_acts_at_peak=each(plan.stage_acts_at_peak),
                    stage_grads_at_peak=each(plan.stage_grads_at_peak),
                    grads_alive_in_forward=plan.grads_alive_in_forward,
                    labels=[f"{prefix} {label}" for label in plan.labels],
                    sharded_prefixes=tuple(p + x for x in plan.sharded_prefixes), parallel=plan.parallel,
                    in_backward=each(plan.in_backward),
                    stage_forward_transient=each(plan.stage_forward_transient),
                    step_grads=None if plan.step_grads is None else re(plan.step_grads))
