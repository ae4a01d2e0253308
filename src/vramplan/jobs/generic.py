"""A job no preset covers: the trained `model` plus a list of models, each with its own
method (frozen / full / lora), precision and placement (this GPU, CPU-offloaded, another GPU).

Each model is its own section of the breakdown (`policy/...`, `<role>/...`).
* The spec's `model` is trained with the job's method and a causal-LM loss (the core's plan).
* A trained role (full / lora) is another trained model in the same step, its graph built
  before the policy's (as PPO's PolicyAndValueWrapper does): its activations stay alive
  through the policy's backward, its gradients and optimizer states are this GPU's.
* A frozen role on this GPU holds its weights for the whole step; its forward runs under
  torch.no_grad() after the policy's forward (the reference / teacher position, the
  policy's saved activations alive) and peaks at one layer's working set or its logits
  (jobs/frozen.py).
* placement `cpu`: the weights live on the host and visit the GPU only for their forward
  (diffusers' enable_model_cpu_offload: `cpu_offload_with_hook` moves a model in at its
  forward and the next model's hook moves it out), so they count only in that event.
* placement `other-gpu`: nothing on this GPU.
Legend: b micro-batch, s sequence, v vocabulary, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.activations import plan_activations
from vramplan.components.trainable import param_set
from vramplan.i18n import Msg
from vramplan.jobs.compose import Step, finish, merge_trained
from vramplan.jobs.frozen import frozen_weights, no_grad_forward_peak
from vramplan.jobs.trained import compute_dtype, prefixed, single_spec
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, Method
from vramplan.timeline import StepPlan
from vramplan.units import nbytes


def core_plan(desc: ModelDesc, one: JobSpec) -> tuple[StepPlan, int]:
    """The single-model plan of estimation.py (causal-LM loss) and its trainable count."""
    from vramplan.step.build import rank_step
    params = param_set(desc, one)
    return rank_step(desc, one, params, plan_activations(desc, one, params)), params.numel(trainable=True)


def generic_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    desc = descs["policy"]
    b, s = spec.micro_batch_size, spec.seq_len
    c = compute_dtype(spec)
    plan, trainable = core_plan(desc, single_spec(spec, b))
    step = Step(prefixed(plan, "policy"))
    total, notes = {"policy": desc.num_params()}, []
    for role in spec.models:
        if role.model == "precomputed":
            notes.append(Msg("{role}: precomputed, holds nothing", role=role.role))
            continue
        d = descs[role.role]
        precision = role.precision or spec.precision
        total[role.role] = d.num_params()
        if role.placement == "other-gpu":
            notes.append(Msg("{role}: on another GPU, not counted here", role=role.role))
            continue
        if role.method in ("full", "lora"):
            if role.placement == "cpu":
                raise ValueError(f"models.{role.role}: a trained model cannot be CPU-offloaded here; "
                                 "use placement gpu or other-gpu")
            # a role with its own precision word is loaded as that word says, not in the
            # job's resolved load dtype
            one = single_spec(spec, b, precision=precision, method=Method(role.method),
                              lora=spec.lora if role.method == "lora" else None,
                              load_dtype=spec.load_dtype if role.precision is None else None)
            other, n_train = core_plan(d, one)
            merge_trained(step.plan, prefixed(other, role.role), role.role)
            trainable += n_train
            continue
        weights = frozen_weights(d, precision.weight_dtype)
        head = Breakdown().add("logits/logits", nbytes(b * s * d.vocab_size, c))
        fwd = Breakdown().merge(no_grad_forward_peak(d, b, s, c, head))
        if role.placement == "cpu":
            fwd.merge(weights)
            notes.append(Msg("{role}: CPU-offloaded, on the GPU only during its forward", role=role.role))
        else:
            step.plan.static.merge(weights, prefix=f"{role.role}/")
        step.after_forward.append(("forward", f"{role.role} forward (no_grad)",
                                   Breakdown().merge(fwd, prefix=f"{role.role}/"), True))
    return finish(spec, desc, step, num_params=total, trainable_params=trainable, gpu=gpu, notes=notes)


__all__ = ["core_plan", "generic_estimate"]
