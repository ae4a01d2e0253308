"""Distillation: a trained student and a frozen teacher on the same rows.

Source: trl/trainer/gkd_trainer.py `compute_loss` (student forward, then the teacher under
torch.no_grad()) and `generalized_jsd_loss` with beta = 0, the forward KL:
`F.kl_div(log_softmax(student / T), log_softmax(teacher / T), log_target=True)`, each
side upcast to fp32. torch's kl_div with log_target (aten/src/ATen/native/Loss.cpp
`kl_div`) is `exp(target) * (target - input)`: exp(target) is saved for the student's
gradient, and at the product both logits, both log-probs and three fp32 (T, v) tensors
are alive: the teacher's and the student's logits meet in the loss, which is the peak.
Legend: T = b * s tokens, v vocabulary, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.frozen import frozen_weights, no_grad_forward_peak
from vramplan.components.dtypes import dtypes_of
from vramplan.jobs.trained import LossTerms, compute_dtype, prefixed, trained_plan
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec
from vramplan.units import nbytes


def kd_loss(t: int, v: int, c: str) -> LossTerms:
    """Student side of the KD loss (names under student/logits/)."""
    tv32 = nbytes(t * v, "fp32")
    saved = Breakdown().add("logits/log_probs", tv32).add("logits/exp_teacher_log_probs", tv32)
    # Backward (the engine frees each node's saved tensors once it has run): MulBackward
    # makes grad * exp(target) while both saved tensors are alive; SubBackward negates it
    # for the student; log_softmax's backward makes an fp32 gradient beside that, then the
    # division's, then the cast back to c.
    start = Breakdown().add("logits/grad_product", tv32)
    head = Breakdown().add("logits/grad_log_softmax_input", tv32).add("logits/grad_logits_fp32", tv32)
    return LossTerms(saved, Breakdown().add("logits/logits", nbytes(t * v, c)), start, head)


def distill_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    student, teacher = descs["policy"], descs["teacher"]
    b, s = spec.micro_batch_size, spec.seq_len
    t, c = b * s, compute_dtype(spec)
    if teacher.vocab_size != student.vocab_size:
        raise ValueError(f"teacher: vocabulary {teacher.vocab_size} differs from the student's "
                         f"{student.vocab_size}; logit distillation needs one tokenizer")
    v = student.vocab_size
    trained = trained_plan(student, spec, b, kd_loss(t, v, c))
    step = Step(prefixed(trained.plan, "student"))
    step.plan.static.add("batch/input_ids", nbytes(t, "int64")).add("batch/labels", nbytes(t, "int64"))
    step.plan.static.merge(frozen_weights(teacher, dtypes_of(spec).weights), prefix="teacher/")
    student_logits = Breakdown().add("student/logits/logits", nbytes(t * v, c))
    teacher_head = Breakdown().add("logits/logits", nbytes(t * v, c))
    fwd = no_grad_forward_peak(teacher, b, s, c, teacher_head)
    step.after_forward.append(("forward", "teacher forward (no_grad)",
                               Breakdown().merge(student_logits).merge(fwd, prefix="teacher/"), False))
    tv32 = nbytes(t * v, "fp32")
    loss = (Breakdown().merge(student_logits).add("teacher/logits/logits", nbytes(t * v, c))
            .add("teacher/logits/log_probs", tv32).add("loss/target_minus_input", tv32)
            .add("loss/product", tv32))
    step.after_forward.append(("forward", "distillation loss (student and teacher logits)", loss, True))
    step.plan.forward_end_transient = Breakdown()
    return finish(spec, student, step, num_params={"student": student.num_params(), "teacher": teacher.num_params()},
                  trainable_params=trained.params.numel(trainable=True), gpu=gpu)
