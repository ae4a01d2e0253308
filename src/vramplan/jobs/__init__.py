"""Jobs with several models: preference (DPO/IPO/KTO/ORPO/SimPO), reward models, PPO/GRPO,
distillation, vision-language and diffusion jobs, and a generic list of models.

`estimate_job(spec)` resolves every model the job names (an edge, like
estimation.estimate) and hands ModelDescs to the pure per-task functions. Each model is
its own section of the breakdown (`policy/...`, `reference/...`, `teacher/...`).
"""
from __future__ import annotations

from vramplan.components import qlora_prep
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, SpecError, Task
from vramplan.spec.enums import as_spec_error
from vramplan.spec.tasks import PRECOMPUTED, needs_several_models


def _desc(model, num_labels: int | None = None, field: str = "model") -> ModelDesc:
    """The ModelDesc of one role's model; a config the adapter refuses (ValueError, as
    sources._resolve_model turns it for `model`) is a SpecError naming `field`."""
    from vramplan.sources import model_from_hf_config, resolve_hf_config
    name, config = resolve_hf_config(model)
    try:
        return model_from_hf_config(config, name=name, num_labels=num_labels)
    except SpecError:
        raise
    except (ValueError, KeyError, TypeError) as exc:  # was "spec: gpt2 config is missing ..."
        text = str(exc)  # without the quotes KeyError puts around its message
        raise SpecError(field, text[1:-1] if isinstance(exc, KeyError) and text[:1] in "'\"" else text) from None


def resolve_models(spec: JobSpec) -> dict[str, ModelDesc]:
    """ModelDescs of the job's models by role (the trained one under 'policy')."""
    labels = 1 if spec.task is Task.REWARD_MODEL else None
    out = {"policy": _desc(spec.model, labels)}
    for role, field in (("reference", "reference_model"), ("teacher", "teacher"),
                        ("reward", "reward_model"), ("critic", "critic_model")):
        value = getattr(spec, field)
        if value is not None and value != PRECOMPUTED:
            try:
                out[role] = _desc(value, 1 if role in ("reward", "critic") else None)
            except SpecError as exc:  # name the spec field that holds this model
                raise SpecError(field, str(exc).split(": ", 1)[-1]) from None
    for m in spec.models:
        if m.model != PRECOMPUTED:
            out[m.role] = _desc(m.model, field=f"models.{m.role}.model")
    return out


def estimate_job(spec: JobSpec, gpu=None):
    if spec.vision is not None:  # the model is a VLM: vision tower + projector + LM
        from vramplan.jobs import vlm
        from vramplan.jobs.vision_fields import refuse_unread
        try:
            vis, lm = vlm.resolve_vlm(spec.model)
        except ValueError as exc:  # a config field (catalog/hf_check.py) the message does not lead with: `model`'s
            error = as_spec_error(exc)
            raise (SpecError("model", str(error).removeprefix("spec: ")) if error.field == "spec" else error) from None
        refuse_unread(spec, type(vis).__name__)  # a setting this tower never reads
        from vramplan.validity import lengths_unreplayed
        est = vlm.vlm_estimate(vis, lm, spec, gpu)
        est.notes[:0] = lengths_unreplayed(spec)
        return est
    if spec.task is Task.DIFFUSION:  # the model is a pipeline (catalog or inline)
        from vramplan.jobs import diffusion
        return diffusion.diffusion_estimate(diffusion.resolve_pipeline(spec.model), spec, gpu)
    from vramplan.validity import assume_seq_len, attention_note, check_job, check_roles, resolve_attention
    descs = resolve_models(spec)
    given = spec
    if "policy" in descs:  # and the attention transformers runs for it (estimation.model_spec does the same)
        spec = resolve_attention(descs["policy"], assume_seq_len(descs["policy"], spec))
    # SpecError for a job the libraries refuse
    notes = check_job(descs["policy"], spec) + attention_note(descs["policy"], given, spec) + qlora_prep.notes(spec)
    check_roles(descs, spec)
    est = estimate_descs(descs, spec, gpu)
    est.notes[:0] = notes
    return est


def estimate_descs(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    """The pure core: per-task step of several models -> Estimate."""
    from vramplan.components.dtypes import resolve_load_dtype
    spec = resolve_load_dtype(spec, descs["policy"].checkpoint_dtype if "policy" in descs else None)
    task = spec.task
    if task in (Task.DPO, Task.IPO, Task.KTO, Task.ORPO, Task.SIMPO, Task.REWARD_MODEL):
        from vramplan.jobs import preference
    if task in (Task.DPO, Task.IPO, Task.KTO, Task.ORPO, Task.SIMPO):
        return preference.preference_estimate(descs, spec, gpu)
    if task is Task.REWARD_MODEL:
        return preference.reward_model_estimate(descs, spec, gpu)
    if task is Task.DISTILL:
        from vramplan.jobs import distill
        return distill.distill_estimate(descs, spec, gpu)
    if task in (Task.PPO, Task.GRPO, Task.RLOO):
        from vramplan.jobs import rl
        return rl.rl_estimate(descs, spec, gpu)
    if spec.models:
        from vramplan.jobs import generic
        return generic.generic_estimate(descs, spec, gpu)
    raise NotImplementedError(f"task {task.value}: not modelled by vramplan.jobs yet")


__all__ = ["estimate_descs", "estimate_job", "needs_several_models", "resolve_models"]
