"""Distillation: a trained student and a frozen teacher on the same rows.

The step of TRL 1.16's `trl.experimental.gkd.GKDTrainer` with `lmbda=0` (the teacher scores
the job's own rows; no generation) and GKDConfig's default `beta=0.5`:
trl/experimental/gkd/gkd_trainer.py `compute_loss` runs the student, then the teacher under
torch.no_grad(), and hands both shifted logits to `generalized_jsd_loss`:

    S = student[:, :-1] / T;  Te = teacher[:, :-1] / T           # two new tensors (T = 1.0)
    LS, LT = log_softmax(S), log_softmax(Te)
    M = logsumexp(stack([LS + log(1 - beta), LT + log(beta)]), dim=0)
    kl_t = kl_div(M, LT, log_target=True); kl_s = kl_div(M, LS, log_target=True)
    jsd = beta * kl_t + (1 - beta) * kl_s;  jsd[labels != -100].sum() / num_items

torch's kl_div with log_target (aten/src/ATen/native/Loss.cpp `kl_div`) is
`exp(target) * (target - input)`. Every name above is a local of the function, alive until
it returns, so at the add that makes `jsd` the two logits and fifteen (T', v) tensors are
alive: that is the forward's peak. Autograd keeps LS (LogSoftmaxBackward's result), the
stack and M (LogsumexpBackward's input and result), exp(LT), exp(LS) and LS - M (the two
MulBackwards); the last three are released before LogsumexpBackward runs, where the
backward peaks (FunctionsManual.cpp `logsumexp_backward`: `grad * (self - result).exp()`,
three stack-sized temporaries, beside the gradients of LS and M).

The loss dtype is that of the logits as the trainer hands them over (fp32 copies under its
autocast, the teacher's too: jobs/trained.py `trainer_logits_dtype`).
`logprob_head: full` keeps the TRL 0.x step instead (`trl0_kd_loss`); the default, `auto`,
is TRL 1.16's.
Legend: b rows, s sequence, T = b * s, T' = b * (s - 1), v vocabulary, c compute dtype,
l loss dtype, U = T' * v elements in l.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.i18n import Msg
from vramplan.components.dtypes import dtypes_of
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.frozen import frozen_weights, no_grad_forward_peak
from vramplan.jobs.trained import LossTerms, compute_dtype, prefixed, trained_plan, trainer_logits_dtype
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, LogprobHead, SpecError
from vramplan.units import nbytes

DIVERGENCE_SINCE = (1, 15)
"""DistillationTrainer (trl/trainer from 1.10) computes its loss with trl/kernels/chunked_divergence.py
from 1.15 (read from 1.14.0 and 1.15.0)."""
BETA = 0.5
"""GKDConfig.beta's default (trl/experimental/gkd/gkd_config.py): the generalized JSD branch."""


def logits_terms(t: int, v: int, c: str, loss: str) -> Breakdown:
    """One model's logits as the loss sees them (with the c original while it is copied)."""
    out = Breakdown().add("logits/logits", nbytes(t * v, c))
    if loss != c:
        out.add("logits/logits_fp32", nbytes(t * v, loss))
    return out


def jsd_loss(t1: int, v: int, loss: str) -> LossTerms:
    """The student side of `generalized_jsd_loss` (names under student/)."""
    u = nbytes(t1 * v, loss)
    # kept by autograd up to LogsumexpBackward: LS, the stack (2U), M; the masked index saves
    # its (T', 2) int64 indices (aten `nonzero` of the bool mask)
    saved = (Breakdown().add("loss/student_log_probs", u).add("loss/stacked_log_probs", 2 * u)
             .add("loss/mixture_log_probs", u).add("loss/mask_indices", nbytes(2 * t1, "int64")))
    # LogsumexpBackward: the gradients of LS (accumulated so far) and of M, and
    # `(self - result)`, its exp and the product with grad, each stack-sized
    start = (Breakdown().add("loss/grad_student_log_probs", u).add("loss/grad_mixture_log_probs", u)
             .add("loss/logsumexp_backward_temporaries", 6 * u))
    # The head stage, at the accumulation of the stack's gradient into LS's: the old sum, the
    # stack-sized gradient its view keeps alive, the new sum, and LS (saved for its backward)
    head = (Breakdown().add("loss/grad_student_log_probs", 2 * u).add("loss/grad_stacked_log_probs", 2 * u)
            .add("loss/student_log_probs", u))
    return LossTerms(saved, Breakdown(), start, head)


def jsd_forward_peak(t1: int, v: int, loss: str) -> Breakdown:
    """At `jsd = beta * kl_t + (1 - beta) * kl_s`, besides what `jsd_loss` saves: S and Te,
    LT, exp(LT), exp(LS), LS - M, kl_t, kl_s, the two scaled terms and their sum."""
    u = nbytes(t1 * v, loss)
    return (Breakdown().add("loss/scaled_logits", 2 * u).add("loss/teacher_log_probs", u)
            .add("loss/exp_log_probs", 2 * u).add("loss/student_minus_mixture", u)
            .add("loss/kl_terms", 2 * u).add("loss/weighted_kl_terms", 2 * u).add("loss/jsd", u)
            .add("loss/label_mask", nbytes(t1, "bool")))


def trl0_kd_loss(t: int, v: int, c: str) -> LossTerms:
    """`logprob_head: full`: the TRL 0.x GKD step that measure/jobs.py writes out (forward
    KL, beta = 0: `F.kl_div(log_softmax(student.float() / T), log_softmax(teacher.float() / T),
    log_target=True)`), kept for the committed bench/jobs rows. exp(target) is saved for the
    student's gradient. Backward (the engine frees each node's saved tensors once it has
    run): MulBackward makes grad * exp(target) while both saved tensors are alive;
    SubBackward negates it for the student; log_softmax's backward makes an fp32 gradient
    beside that, then the division's, then the cast back to c."""
    tv32 = nbytes(t * v, "fp32")
    saved = Breakdown().add("logits/log_probs", tv32).add("logits/exp_teacher_log_probs", tv32)
    start = Breakdown().add("logits/grad_product", tv32)
    head = Breakdown().add("logits/grad_log_softmax_input", tv32).add("logits/grad_logits_fp32", tv32)
    return LossTerms(saved, Breakdown().add("logits/logits", nbytes(t * v, c)), start, head)


def trl0_at_loss(t: int, v: int) -> Breakdown:
    """At TRL 0.x's kl_div product: the teacher's fp32 log-probs, target - input, the product."""
    tv32 = nbytes(t * v, "fp32")
    return (Breakdown().add("teacher/logits/log_probs", tv32).add("loss/target_minus_input", tv32)
            .add("loss/product", tv32))


def _without_autocast(spec: JobSpec) -> JobSpec:
    """The job in its weights' dtype with no autocast (a quantized base keeps its spec)."""
    from vramplan.spec import Method, Precision
    from vramplan.spec.job import copy_with

    d = dtypes_of(spec)
    if not d.autocast or spec.method is Method.QLORA:
        return spec
    word = {"fp32": Precision.FP32, "bf16": Precision.PURE_BF16, "fp16": Precision.PURE_FP16}[d.weights]
    return copy_with(spec, precision=word)


def onpolicy_estimate(student: ModelDesc, teacher: ModelDesc, spec: JobSpec, gpu=None):
    """TRL 1.16's DistillationTrainer (trl/trainer/distillation_trainer.py), the job's
    `max_new_tokens` given: the student generates C tokens per prompt (HF generate, as GRPO's
    rollout: jobs/rl.py generation_peak, DistillationConfig's top_k 0), a whole generation
    batch of micro_batch_size x grad_accum_steps rows at once, buffered for the accumulation
    steps; each micro-step runs the student's backbone (`base_model`, no head) over prompt +
    completion, the teacher's under no_grad, and the chunked divergence over the C completion
    positions (jobs/divergence.py)."""
    from vramplan.jobs.divergence import Divergence
    from vramplan.jobs.logprob import chunked_head
    from vramplan.jobs.rl import generation_peak

    if spec.logprob_head is not LogprobHead.AUTO:
        raise SpecError("logprob_head", "on-policy distillation (max_new_tokens) runs DistillationTrainer's chunked "
                                        "divergence: use auto, or drop max_new_tokens for GKD's full logits")
    rows, prompt, new = spec.micro_batch_size, spec.seq_len, spec.max_new_tokens
    s, v, d = prompt + new, student.vocab_size, dtypes_of(spec)
    gen_rows = rows * spec.grad_accum_steps
    # `_get_last_hidden_state` calls the backbone (`base_model`) itself, past the autocast that
    # accelerate wraps around the model's top-level forward (accelerator.py `prepare_model`):
    # both backbones and the divergence run in the weights' dtype; only generate (through
    # that forward) runs under autocast (measured: amp-bf16 steps byte-identical to fp32's)
    plain = _without_autocast(spec)
    own = chunked_head(plain, rows, new + 1, student.hidden_size, v)  # the student's head dtypes
    t_hidden = d.weights
    teacher_input = nbytes(rows * s * teacher.hidden_size, t_hidden)
    head = Divergence(rows, new, student.hidden_size, teacher.hidden_size, v, own.c, own.hidden_dtype,
                      own.weight_dtype, t_hidden, teacher_input, torch_fold=own.torch_fold)
    trained = trained_plan(student, plain, rows, head, seq_len=s)
    step = Step(prefixed(trained.plan, "student"), before_gradients=True)
    # the buffered generation batch (`_prepare_inputs`: prompt and completion ids and masks)
    step.plan.static.add("batch/prompt_completion_ids", nbytes(gen_rows * s, "int64"))
    step.plan.static.add("batch/attention_mask", nbytes(gen_rows * s, "int64"))
    step.plan.static.merge(frozen_weights(teacher, d.weights), prefix="teacher/")
    gen = generation_peak(student, gen_rows, prompt, new, compute_dtype(spec))
    step.before.append(("generation", f"generation ({gen_rows} rows, KV cache to {s} tokens)",
                        Breakdown().merge(gen, prefix="student/")))
    # the teacher's backbone under no_grad after the student's: the student's last hidden
    # state (the divergence's input) is alive beside it
    t_head = Breakdown().add("logprob/last_hidden_state", teacher_input)
    fwd = no_grad_forward_peak(teacher, rows, s, t_hidden, t_head)
    student_input = Breakdown().add("student/logits/head_input", nbytes(rows * s * student.hidden_size,
                                                                         own.hidden_dtype))
    step.after_forward.append(("forward", "teacher forward (no_grad)",
                               Breakdown().merge(student_input).merge(fwd, prefix="teacher/"), False))
    notes = [Msg("on-policy distillation: TRL's DistillationTrainer ({gen} completions of {new} tokens generated "
                 "per generation batch, beta 1.0: reverse KL, chunked over the vocabulary)", gen=gen_rows, new=new)]
    release = spec.stack.minor("trl")
    if release is not None and release < DIVERGENCE_SINCE:
        notes.append(Msg("TRL {release}'s DistillationTrainer computes its loss without the chunked divergence "
                         "(1.15's); not modelled, the estimate takes TRL 1.16's", release=spec.stack.trl))
    return finish(spec, student, step, num_params={"student": student.num_params(), "teacher": teacher.num_params()},
                  trainable_params=trained.params.numel(trainable=True), gpu=gpu, notes=notes)


def distill_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    student, teacher = descs["policy"], descs["teacher"]
    b, s = spec.micro_batch_size, spec.seq_len
    t, t1, c = b * s, b * (s - 1), compute_dtype(spec)
    if teacher.vocab_size != student.vocab_size:
        raise ValueError(f"teacher: vocabulary {teacher.vocab_size} differs from the student's "
                         f"{student.vocab_size}; logit distillation needs one tokenizer")
    v = student.vocab_size
    if spec.max_new_tokens:
        return onpolicy_estimate(student, teacher, spec, gpu)
    if spec.logprob_head is LogprobHead.FULL:
        loss, terms, extra = c, trl0_kd_loss(t, v, c), trl0_at_loss(t, v)
    elif spec.logprob_head is LogprobHead.AUTO:
        loss = trainer_logits_dtype(spec)
        terms, extra = jsd_loss(t1, v, loss), Breakdown().merge(jsd_forward_peak(t1, v, loss), prefix="student/")
        terms.forward_end = logits_terms(t, v, c, loss)
    else:
        raise SpecError("logprob_head", "task distill runs GKDTrainer's full logits: use auto "
                                        "(TRL 1.16) or full (the TRL 0.x step)")
    trained = trained_plan(student, spec, b, terms)
    step = Step(prefixed(trained.plan, "student"))
    step.plan.static.add("batch/input_ids", nbytes(t, "int64")).add("batch/labels", nbytes(t, "int64"))
    d = dtypes_of(spec)
    step.plan.static.merge(frozen_weights(teacher, d.weights), prefix="teacher/")
    student_logits = Breakdown().add("student/logits/logits", nbytes(t * v, loss))
    teacher_head = logits_terms(t, v, c, loss)
    if spec.logprob_head is LogprobHead.AUTO:
        step.plan.static.add("batch/attention_mask", nbytes(t, "int64"))
        if d.autocast and d.weights != c:
            # a frozen weight is cast at each use (autocast caches only leaves that require grad)
            teacher_head.add("logits/head_weight_cast", nbytes(v * teacher.hidden_size, c))
    else:
        step.plan.forward_end_transient = Breakdown()
    fwd = no_grad_forward_peak(teacher, b, s, c, teacher_head)
    step.after_forward.append(("forward", "teacher forward (no_grad)",
                               Breakdown().merge(student_logits).merge(fwd, prefix="teacher/"), False))
    at_loss = Breakdown().merge(student_logits).add("teacher/logits/logits", nbytes(t * v, loss)).merge(extra)
    step.after_forward.append(("forward", "distillation loss (student and teacher logits)", at_loss, True))
    return finish(spec, student, step, num_params={"student": student.num_params(), "teacher": teacher.num_params()},
                  trainable_params=trained.params.numel(trainable=True), gpu=gpu)
