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
from vramplan.components.dtypes import dtypes_of
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.frozen import frozen_weights, no_grad_forward_peak
from vramplan.jobs.trained import LossTerms, compute_dtype, prefixed, trained_plan, trainer_logits_dtype
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, LogprobHead, SpecError
from vramplan.units import nbytes

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


def distill_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    student, teacher = descs["policy"], descs["teacher"]
    b, s = spec.micro_batch_size, spec.seq_len
    t, t1, c = b * s, b * (s - 1), compute_dtype(spec)
    if teacher.vocab_size != student.vocab_size:
        raise ValueError(f"teacher: vocabulary {teacher.vocab_size} differs from the student's "
                         f"{student.vocab_size}; logit distillation needs one tokenizer")
    v = student.vocab_size
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
