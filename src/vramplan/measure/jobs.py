"""Real multi-model training steps (DPO, distillation, reward model) under the exact meter.

    from vramplan.measure.jobs import measure_job
    result = measure_job({"task": "dpo", "model": {...HF config...}, ...})

Each step is written as the HF TRL trainers of the full-logits generation write it
(TRL 0.x, before the fused/chunked heads of TRL 1.x):

* DPO (trl/trainer/dpo_trainer.py ``concatenated_forward`` + ``get_batch_logps``):
  chosen and rejected rows are concatenated into one batch of ``2b`` rows; the policy's
  logits are upcast to fp32 and ``log_softmax`` runs over the whole vocabulary, the label
  log-prob is gathered and summed per row.  The reference runs the same under
  ``torch.no_grad()`` (``compute_ref_log_probs``) *after* the policy forward, so the
  policy's saved activations are alive during it; with a LoRA policy and no reference
  model the adapter is disabled instead (``null_ref_context`` -> ``disable_adapter``).
  ``reference_model: precomputed`` reads reference log-probs from the batch.
  Loss: ``-logsigmoid(beta * (chosen_logratios - rejected_logratios))``.
* Distillation (trl/trainer/gkd_trainer.py ``compute_loss``, beta=0 branch of
  ``generalized_jsd_loss``): student forward, then the teacher under no_grad; both
  logits (fp32, divided by the temperature) go through ``log_softmax`` and
  ``F.kl_div(student_log_probs, teacher_log_probs, log_target=True)``.
* Reward model (trl/trainer/reward_trainer.py ``compute_loss``): a one-output
  sequence-classification model on chosen and rejected rows concatenated;
  ``-logsigmoid(r_chosen - r_rejected).mean()``.

The logits upcast (``.float()``) is explicit here: transformers 5 returns logits in the
model dtype when no labels are passed (transformers < 4.45 upcast inside the model).
Steps, phases and registration follow ``measure/run.py`` (two optimizer steps; phases
``s{n}.fwd`` / ``s{n}.ref`` / ``s{n}.bwd`` / ``s{n}.opt``).
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from . import MeasureResult
from .build import (
    apply_checkpointing, apply_method, build_model, build_optimizer, norm_precision,
    precision_dtypes,
)
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes

PHASES = {"fwd": "forward", "ref": "forward", "bwd": "backward", "opt": "optimizer"}
PAIRWISE = ("dpo", "ipo", "reward-model")


def _model_job(job: dict, model_field: Any, task: str | None = None) -> dict:
    out = dict(job)
    out["model"] = model_field
    out["task"] = task or "sft"
    return out


def _build_trained(job: dict):
    precision = norm_precision(job.get("precision", "fp32"))
    dtype, _ = precision_dtypes(precision)
    if job["task"] == "reward-model":
        cfg = dict(job["model"]) | {"num_labels": 1}
        model = build_model(_model_job(job, cfg, "sequence-classification"), "cpu", dtype)
    else:
        model = build_model(_model_job(job, job["model"]), "cpu", dtype)
    model = apply_method(model, job, "cpu")
    apply_checkpointing(model, job)
    model.train()
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    return model, opt, dtype


def _build_frozen(job: dict, model_field: Any, dtype):
    model = build_model(_model_job(job, model_field), "cpu", dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def _frozen_model(job: dict, model, dtype):
    """The second model of the job, or None (LoRA policy: adapter disabled; precomputed)."""
    task = job["task"]
    if task == "distill":
        return _build_frozen(job, job["teacher"], dtype)
    if task in ("dpo", "ipo"):
        ref = job.get("reference_model")
        if ref == "precomputed":
            return None
        if ref is None and job.get("method", "full") == "lora":
            return None
        return _build_frozen(job, ref or job["model"], dtype)
    return None


# ---------------------------------------------------------------------- losses
def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """trl get_batch_logps: shift, fp32 log_softmax over the vocabulary, gather, sum."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    per_token = torch.gather(logits.float().log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return per_token.sum(-1)


def _dpo_loss(job, model, ref, batch, meter, step) -> torch.Tensor:
    ids, labels = batch["input_ids"], batch["labels"]
    logits = model(input_ids=ids).logits
    logps = sequence_logps(logits, labels)
    del logits
    with meter.phase(f"s{step}.ref"):
        if "ref_logps" in batch:
            ref_logps = batch["ref_logps"]
        else:
            ctx = model.disable_adapter() if ref is None else contextlib.nullcontext()
            with torch.no_grad(), ctx:
                ref_logits = (ref or model)(input_ids=ids).logits
                ref_logps = sequence_logps(ref_logits, labels)
                del ref_logits
    pc, pr = logps.chunk(2)
    rc, rr = ref_logps.chunk(2)
    delta = (pc - rc) - (pr - rr)
    if job["task"] == "ipo":
        return ((delta - 1 / (2 * 0.1)) ** 2).mean()
    return -F.logsigmoid(0.1 * delta).mean()


def _distill_loss(job, model, teacher, batch, meter, step, temperature: float = 2.0) -> torch.Tensor:
    ids = batch["input_ids"]
    student_logits = model(input_ids=ids).logits
    with meter.phase(f"s{step}.ref"):
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids).logits
    student_lp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher_lp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    loss = F.kl_div(student_lp, teacher_lp, reduction="batchmean", log_target=True) * temperature ** 2
    return loss


def _reward_loss(job, model, _none, batch, meter, step) -> torch.Tensor:
    rewards = model(input_ids=batch["input_ids"]).logits.squeeze(-1)
    chosen, rejected = rewards.chunk(2)
    return -F.logsigmoid(chosen - rejected).mean()


LOSSES = {"dpo": _dpo_loss, "ipo": _dpo_loss, "distill": _distill_loss, "reward-model": _reward_loss}


# ---------------------------------------------------------------------- inputs
def make_batch(job: dict, vocab: int) -> dict:
    """Token ids; pairwise tasks hold chosen and rejected rows concatenated (2b rows)."""
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 128))
    rows = 2 * b if job["task"] in PAIRWISE else b
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, s), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if job.get("reference_model") == "precomputed":
        batch["ref_logps"] = torch.zeros(rows)
    return batch


# ----------------------------------------------------------------------- steps
def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def measure_job(job: dict, steps: int = 2, trace: bool = False) -> MeasureResult:
    """Build the job's models and run ``steps`` optimizer steps under the exact CPU meter."""
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    job.setdefault("precision", "fp32")
    torch.manual_seed(0)
    model, opt, dtype = _build_trained(job)
    other = _frozen_model(job, model, dtype)
    vocab = int(model.config.vocab_size)
    meter = MemoryMeter(trace=trace)
    meter.register(model.parameters(), "parameter")
    meter.register(model.buffers(), "buffer")
    if other is not None:
        meter.register(other.parameters(), "frozen_parameter")
        meter.register(other.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    loss_fn = LOSSES[job["task"]]
    with meter:
        batch = make_batch(job, vocab)
        meter.register(batch.values(), "batch")
        for step in range(1, steps + 1):
            with meter.phase(f"s{step}.fwd"):
                loss = loss_fn(job, model, other, batch, meter, step)
            if step == steps:
                meter.mark("end_of_forward")
                end_fwd = meter.current
            with meter.phase(f"s{step}.bwd"):
                loss.backward()
            grads = unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            with meter.phase(f"s{step}.opt"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss
    states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    model_state = unique_bytes(list(model.parameters())) + unique_bytes(states)
    return metered_result(meter, model, opt, grads, PHASES, trace=trace,
                          activation_bytes_end_of_forward=end_fwd - model_state)


__all__ = ["measure_job", "make_batch", "sequence_logps"]
