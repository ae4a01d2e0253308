"""Preference jobs: DPO, IPO, KTO (policy + reference), ORPO, SimPO (policy only), and
pairwise reward-model training.

Sources: trl/trainer/dpo_trainer.py (TRL 0.x `concatenated_forward`: chosen and rejected
rows concatenated into 2b rows; `get_batch_logps`; `compute_ref_log_probs` under
torch.no_grad() after the policy forward; `null_ref_context` disables a LoRA policy's
adapter instead of holding a reference), trl/trainer/kto_trainer.py (completions and a
mismatched KL batch of b rows each; the KL and reference forwards under no_grad),
trl/trainer/reward_trainer.py `compute_loss` (chosen and rejected rows through one
sequence-classification model with one output).
Legend: b micro-batch, r rows, s sequence, v vocabulary, h hidden, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.i18n import Msg
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.frozen import cast_first_logps_head, frozen_weights, logps_head, no_grad_forward_peak
from vramplan.components.dtypes import dtypes_of
from vramplan.components.kept_logits import kept_positions
from vramplan.jobs.dpo_head import DpoHead, dpo_head, reference_hidden_states
from vramplan.jobs.logprob import chunked_head, head_note, resolve_head
from vramplan.jobs.odds_ratio import odds_ratio_loss
from vramplan.jobs.selective import completion_logps_head, completion_logps_loss
from vramplan.jobs.trained import cast_first_logps_loss, compute_dtype, logps_loss, prefixed, score_loss, trained_plan
from vramplan.model import ModelDesc
from vramplan.spec import Checkpointing, JobSpec, LogprobHead, Method, Task
from vramplan.spec.stack import Framework
from vramplan.spec.tasks import PRECOMPUTED
from vramplan.units import nbytes


def _batch(rows: int, s: int) -> Breakdown:
    """Token ids and their labels (a separate copy, as the collators build them)."""
    return Breakdown().add("batch/input_ids", nbytes(rows * s, "int64")).add("batch/labels", nbytes(rows * s, "int64"))


def _dpo_head(spec: JobSpec, desc: ModelDesc, rows: int) -> DpoHead | None:
    """TRL DPOTrainer's selective head by release (jobs/dpo_head.py), for DPO and IPO, and
    KTOTrainer's of 1.9 to 1.14 (`auto` only: an explicit `selective` keeps the generic head)."""
    own = spec.task in (Task.DPO, Task.IPO) or (spec.task is Task.KTO and spec.logprob_head is LogprobHead.AUTO)
    if not own or resolve_head(spec) is not LogprobHead.SELECTIVE:
        return None
    kept = kept_positions(spec, desc)  # ms-swift's logits_to_keep: the head's positions
    return dpo_head(spec, rows, kept.positions if kept else spec.seq_len, desc.vocab_size,
                    spec.reference_model != PRECOMPUTED)


def _policy_head(spec: JobSpec, desc: ModelDesc, rows: int, chunked: bool):
    """The trained model's log-prob head (DPO's selective one: `_dpo_head`). Selective (KTO):
    the same mechanism as GRPO's completion head (jobs/selective.py), over s - 1 scored positions
    of s logits; modelled from the source, not measured. Chunked: TRL 1.16 asks the policy for
    ("log_probs", "entropy", "mean_logits", "is_top1") in DPO (dpo_trainer.py __init__,
    `add_fused_lm_head(..., outputs=outputs)`) and ("log_probs", "entropy", "mean_logits")
    in KTO (kto_trainer.py)."""
    s, v, h = spec.seq_len, desc.vocab_size, desc.hidden_size
    if resolve_head(spec) is LogprobHead.SELECTIVE and spec.task in (Task.ORPO, Task.SIMPO):
        return odds_ratio_loss(spec, rows, s, v)  # TRL 1.16's trl.experimental ORPO / CPO
    if resolve_head(spec) is LogprobHead.SELECTIVE:
        return completion_logps_loss(rows, s - 1, v, compute_dtype(spec))
    if not chunked and casts_logits_first(spec):
        return cast_first_logps_loss(rows, s, v, compute_dtype(spec))
    if not chunked:
        return logps_loss(rows, s, v, h, compute_dtype(spec))
    return chunked_head(spec, rows, s, h, v, top1=spec.task is not Task.KTO, entropy=True,
                        softcap=bool(desc.final_logit_softcapping))


def casts_logits_first(spec: JobSpec) -> bool:
    """LLaMA-Factory's DPO trainer (ORPO, SimPO: the same `concatenated_forward`) and its KTO
    trainer (`forward`) cast the whole logits to fp32 before their get_batch_logps
    (llamafactory/train/dpo/trainer.py, train/kto/trainer.py)."""
    return spec.stack.framework is Framework.LLAMA_FACTORY


def _reference_dtypes(spec: JobSpec, ref_desc: ModelDesc, c: str) -> tuple[str, str]:
    """(weights, compute) dtype of a separate reference. LLaMA-Factory loads it with
    `load_model(..., is_trainable=False)` (llamafactory/train/trainer_utils.py
    `create_ref_model`): torch_dtype="auto", the checkpoint's dtype, and no upcast of
    trainable parameters (model/adapter.py `init_adapter` casts only when is_trainable), so
    it stays 16-bit beside an fp32 policy; without autocast it computes in that dtype."""
    weights = dtypes_of(spec).weights
    if spec.stack.framework is Framework.LLAMA_FACTORY and ref_desc.checkpoint_dtype:
        weights = ref_desc.checkpoint_dtype
        return weights, c if dtypes_of(spec).autocast else weights
    return weights, c


def _held_logits(spec: JobSpec, extra: Breakdown, logits: int) -> None:
    """What LLaMA-Factory's preference trainers hold through the reference forward, which runs
    after the policy's (`get_batch_loss_metrics`), beside its own head.
    DPO (train/dpo/trainer.py `concatenated_forward`): chosen/rejected views of the policy's
    fp32 logits, returned and kept until get_batch_loss_metrics returns.
    KTO (train/kto/trainer.py `concatenated_forward`): `target_logits[kto_tags]` and
    `[~kto_tags]`, boolean-index copies of the policy's fp32 logits (all rows between them),
    and, through the reference's KL-batch forward, the reference's own target logits."""
    if spec.task is Task.KTO:
        extra.add("policy/logits/tagged_logits_fp32", logits)
        extra.add("reference/logits/target_logits_fp32", logits)
    else:
        extra.add("policy/logits/logits_fp32", logits)


def _frozen_head(spec: JobSpec, desc: ModelDesc, rows: int, chunked: bool) -> Breakdown:
    """A no_grad forward's head: the reference's `add_fused_lm_head(self.ref_model)` asks for
    log_probs only; the full head is get_batch_logps under no_grad."""
    s, v, h = spec.seq_len, desc.vocab_size, desc.hidden_size
    if resolve_head(spec) is LogprobHead.SELECTIVE:
        return completion_logps_head(rows, s - 1, v, compute_dtype(spec))
    if not chunked and casts_logits_first(spec):
        return cast_first_logps_head(rows, s, v)
    if not chunked:
        return logps_head(rows, s, v, compute_dtype(spec))
    head = chunked_head(spec, rows, s, h, v, softcap=bool(desc.final_logit_softcapping))
    return head.frozen_peak(nbytes(rows * s * h, head.hidden_dtype))


def preference_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    desc = descs["policy"]
    b, s = spec.micro_batch_size, spec.seq_len
    c = compute_dtype(spec)
    # KTO: unpaired completions, b rows; the others: chosen + rejected, 2b rows.
    rows = b if spec.task is Task.KTO else 2 * b
    chunked = resolve_head(spec) is LogprobHead.CHUNKED
    dpo = _dpo_head(spec, desc, rows)
    trained = trained_plan(desc, spec, rows, dpo.terms if dpo else _policy_head(spec, desc, rows, chunked))
    step = Step(prefixed(trained.plan, "policy"))
    step.plan.static.merge(_batch(rows, s))
    if chunked:
        # TRL 1.x DataCollatorForPreference also returns attention_mask and completion_mask;
        # the labels are input_ids.masked_fill(completion_mask == 0, -100) (_compute_loss).
        step.plan.static.add("batch/attention_mask", nbytes(rows * s, "int64"))
        step.plan.static.add("batch/completion_mask", nbytes(rows * s, "int64"))
    notes, total = [head_note(spec)], {"policy": desc.num_params()}
    ref = spec.reference_model
    if spec.task in (Task.ORPO, Task.SIMPO):
        pass
    elif ref == PRECOMPUTED:
        step.plan.static.add("batch/reference_logps", 2 * nbytes(rows, "fp32"))
    else:
        shares_base = ref is None and spec.method in (Method.LORA, Method.QLORA)
        ref_desc = desc if shares_base else descs.get("reference", desc)
        ref_c = c
        if shares_base:
            notes.append(Msg("reference: the LoRA policy with its adapter disabled (no second model)"))
        else:
            ref_weights, ref_c = _reference_dtypes(spec, ref_desc, c)
            step.plan.static.merge(frozen_weights(ref_desc, ref_weights), prefix="reference/")
            total["reference"] = ref_desc.num_params()
        head = (Breakdown().merge(dpo.reference).merge(reference_hidden_states(spec, ref_desc, rows, ref_c))
                if dpo else _frozen_head(spec, ref_desc, rows, chunked))
        peak = no_grad_forward_peak(ref_desc, rows, s, ref_c, head)
        extra = Breakdown().merge(peak, prefix="reference/").merge(dpo.held if dpo else Breakdown(), prefix="policy/")
        if not chunked and casts_logits_first(spec):
            _held_logits(spec, extra, nbytes(rows * s * desc.vocab_size, "fp32"))
        label = "reference forward (no_grad log-probs)"
        if spec.task is Task.KTO:
            # The policy's KL-batch forward runs under no_grad too, before the reference's.
            label = "reference / KL-batch forward (no_grad log-probs)"
        step.after_forward.append(("forward", label, extra, True))
    if dpo and dpo.metrics is not None:
        at_metrics = (Breakdown().merge(dpo.held, prefix="policy/").merge(dpo.reference_held)
                      .merge(dpo.metrics, prefix="policy/"))
        label = "KTO metrics (entropy, mean logits)" if spec.task is Task.KTO else "DPO metrics (entropy, mean logits)"
        step.after_forward.append(("forward", label, at_metrics, True))
    return finish(spec, desc, step, num_params=total, trainable_params=trained.params.numel(trainable=True),
                  gpu=gpu, notes=notes)


def reward_model_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    desc = descs["policy"]
    b, s = spec.micro_batch_size, spec.seq_len
    rows = 2 * b
    c = compute_dtype(spec)
    res = dtypes_of(spec).weights if spec.method is not Method.QLORA else c
    # The final norm's moments (trained.final_norm_moments); layer 0's input (the embedding
    # output) is kept by its checkpoint under full checkpointing.
    embeds_saved = spec.gradient_checkpointing is Checkpointing.FULL
    loss = score_loss(rows, s, desc.hidden_size, c, norm_dtype=res, embeds_saved=embeds_saved)
    trained = trained_plan(desc, spec, rows, loss)
    step = Step(prefixed(trained.plan, "reward_model"))
    step.plan.static.merge(_batch(rows, s))
    return finish(spec, desc, step, num_params=desc.num_params(),
                  trainable_params=trained.params.numel(trainable=True), gpu=gpu)
