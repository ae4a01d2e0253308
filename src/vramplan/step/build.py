"""One trained model's step as the timeline walks it (timeline.StepPlan), for every task.

`build_step` turns what the components computed (weights, optimizer states, gradients per
stage, saved activations per stage, the loss's terms, the optimizer's temporaries) into a
StepPlan; `rank_step` then hands it to the parallel layer (parallel.rank_plan), so a
single-model SFT job and every trained role of a multi-model job (DPO's policy, a PPO
critic, a VLM's language model) are sharded by the same code.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.activation_plan import INPUT_LEAF
from vramplan.components.activations import ActivationPlan
from vramplan.components.dtypes import dtypes_of
from vramplan.components.memo import cached
from vramplan.components.offloading import device_resident, forward_stash
from vramplan.components.optimizer import (adafactor_sequence, heads_of, optimizer_states, state_key,
                                           step_temporaries)
from vramplan.components.optimizer_in_backward import lomo_alive, stage_step_terms, steps_in_backward
from vramplan.components.trainable import ParamSet
from vramplan.families import step_buffers
from vramplan.components.weights import (
    gradient_stages, gradient_stages_at_peak, num_stages, stage_of, tied_embedding_grad_temp, tied_head_grad_pending,
    weight_terms,
)
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec
from vramplan.spec.optimizers import FUSED_IN_BACKWARD
from vramplan.spec.stack import loss_detached_before_step
from vramplan.timeline import StepPlan
from vramplan.units import nbytes


def rank_step(desc: ModelDesc, spec: JobSpec, params: ParamSet, acts: ActivationPlan,
              managed: Breakdown | None = None, loss_detached: bool | None = None) -> StepPlan:
    """The step of one rank: `build_step`, then the parallel layer when the layout is not a
    single GPU (the plan's `parallel` then holds the ParallelReport)."""
    plan = build_step(desc, spec, params, acts, managed, loss_detached)
    if not spec.parallel.is_trivial or spec.num_gpus > 1:
        from vramplan.parallel import rank_plan
        plan, report = rank_plan(desc, spec, params, plan)
        plan.parallel = report
    return plan


def _optimizer_extras(spec: JobSpec, params: ParamSet, acts: ActivationPlan, loss_detached: bool | None) -> Breakdown:
    out = cached(params, ("temporaries",) + state_key(spec), lambda: step_temporaries(spec, params))
    if loss_detached is None:
        loss_detached = loss_detached_before_step(spec)
    if acts.input_leaf_bytes and not loss_detached:
        # the loss (and so its graph, holding the input leaf and its gradient) is kept until
        # after optimizer.step() in a plain training loop; HF Trainer's (and TRL's)
        # `training_step` returns `loss.detach()` (transformers/trainer.py), so the graph and
        # the leaf are gone before the optimizer step (bench/trainers `*/lora/*/gc`; a reward
        # model, TRL's RewardTrainer, whatever the stack: the CPU grid's mistral LoRA gc row).
        out.add("activations/input_leaf", acts.input_leaf_bytes).add("gradients/input_leaf", acts.input_leaf_bytes)
    return out


_STAGES: dict[tuple, dict[str, int]] = {}


def _stage_breakdown(items: list[tuple[str, int]], prefix: str) -> Breakdown:
    """The saved (name, bytes) list as terms under `prefix`; memoized on the list's content
    (a search builds the same layers' lists for every layout), a fresh Breakdown each call."""
    key = (prefix, tuple(items))
    hit = _STAGES.get(key)
    if hit is None:
        out = Breakdown()
        for name, size in items:
            out.add(f"{prefix}/{name}", size)
        if len(_STAGES) >= 1024:
            _STAGES.clear()
        hit = _STAGES[key] = out.terms
    return Breakdown(dict(hit))


def build_step(desc: ModelDesc, spec: JobSpec, params: ParamSet, acts: ActivationPlan,
               managed: Breakdown | None = None, loss_detached: bool | None = None) -> StepPlan:
    """`managed` receives paged optimizer state (outside the allocator); without it, that
    state stays with the rest (multi-model jobs). `loss_detached`: whether the job's step
    frees the loss before the optimizer step (spec.stack.loss_detached_before_step of the job,
    when `spec` is one model's single spec); None: read it from `spec`."""
    opt_key = ("states",) + state_key(spec)
    static = cached(params, ("weights", spec.quantization), lambda: weight_terms(spec, params))
    for key, value in cached(params, opt_key, lambda: optimizer_states(spec, params, heads_of(desc))):
        # paged optimizer state is CUDA managed memory, outside the caching allocator
        (managed if managed is not None and key.startswith("optimizer_paged") else static).add(key, value)
    static.add("batch/input_ids", nbytes(spec.micro_batch_size * spec.seq_len, "int64"))
    if spec.packing:  # padding-free rows carry position_ids (DataCollatorWithFlattening)
        static.add("batch/position_ids", nbytes(spec.micro_batch_size * spec.seq_len, "int64"))
    # registered buffers that are no parameters (GPTBigCode's causal-mask table)
    static.add("weights/buffers", getattr(desc, "buffer_bytes", 0))
    static.add("weights/family_step_buffers", step_buffers(desc, spec))
    grads = cached(params, ("grads", dtypes_of(spec)), lambda: gradient_stages(desc, spec, params))
    grads_at_peak = cached(params, ("grads_at_peak", dtypes_of(spec)),
                           lambda: gradient_stages_at_peak(desc, spec, params))
    stage_acts, at_peak, transients, labels = [], [], [], []
    n = len(acts.stages)
    # Layers with one signature share their saved list; build each list's breakdowns once
    # (the timeline only reads them).
    built: dict[tuple, tuple[Breakdown, Breakdown]] = {}
    offloading = spec.activation_offloading
    pending = tied_head_grad_pending(desc, spec, params)
    for i, st in enumerate(acts.stages):
        layer = st.label.startswith("layer")
        group = "activations/layers" if layer else f"activations/{st.label}"
        key = (id(st.saved), group, st.freed_before_peak)
        pair = built.get(key)
        if pair is None:
            pair = built[key] = (_stage_breakdown(st.saved, group),
                                 _stage_breakdown([x for x in st.saved if x[0] not in st.freed_before_peak], group))
        stage_acts.append(pair[0])
        at_peak.append(pair[1])
        if offloading:
            # between its forward and its backward a stage keeps on the device only what
            # OffloadActivations leaves there (components/offloading.py)
            keep = acts.head_linear_saved if i == n - 1 else ()
            stage_acts[-1] = _stage_breakdown(device_resident(st.saved, keep), group)
        if layer:
            # a layer's transients: one Breakdown per signature, shared by its layers (what
            # the parallel layer adds to one layer alone goes to a copy: breakdown.own)
            tkey = (id(st.recompute) if st.recompute else None, "transient", st.freed_before_peak,
                    id(st.backward_transient))
            template = built.get(tkey)
            if template is None:
                template = built[tkey] = (_transient(acts, st).merge(pending), Breakdown())
            transients.append(template[0])
            labels.append(st.label + " backward")
            continue
        # the head's own fresh gradient is its stage_grads_in_flight; the tied one then waits
        t = _transient(acts, st).merge(pending if i < n - 1 else Breakdown())
        if i == n - 1:
            t.merge(acts.head_backward_transient)
        elif i == 0:
            t.merge(tied_embedding_grad_temp(desc, spec, params))
            if acts.input_leaf_bytes:  # the leaf itself, unless the embedding stage keeps it
                if all(name != INPUT_LEAF for name, _ in st.saved):
                    t.add("activations/input_leaf", acts.input_leaf_bytes)
                t.add("gradients/input_leaf", acts.input_leaf_bytes)
        transients.append(t)
        labels.append(f"{st.label} backward")
    fwd_end, loss_bwd = acts.forward_end_transient, acts.loss_backward_transient
    if spec.keep_logits:
        static, fwd_end = _kept_output(static, fwd_end, acts)
    if spec.activation_offloading:
        stash = forward_stash([st.saved for st in acts.stages], acts.head_linear_saved)
        fwd_end = Breakdown().merge(fwd_end).add("activations/offload_stash", stash)
        loss_bwd = Breakdown().merge(loss_bwd).add("activations/offload_stash", stash)
    return StepPlan(static=static, grads_by_stage=grads, stage_acts=stage_acts,
                    loss_saved=acts.loss_saved, forward_end_transient=fwd_end,
                    loss_backward_transient=loss_bwd,
                    stage_backward_transient=transients, stage_acts_at_peak=at_peak,
                    stage_grads_at_peak=grads_at_peak,
                    stage_grads_in_flight=_in_flight(grads_at_peak) if spec.grad_accum_steps > 1 else None,
                    optimizer_temporaries=_optimizer_extras(spec, params, acts, loss_detached),
                    optimizer_sequence=adafactor_sequence(spec, params),
                    grads_alive_in_forward=spec.grad_accum_steps > 1, labels=labels,
                    in_backward=_in_backward(desc, spec, params, acts),
                    stage_forward_transient=acts.stage_forward_transient)


def _kept_output(static: Breakdown, fwd_end: Breakdown, acts: ActivationPlan) -> tuple[Breakdown, Breakdown]:
    """keep_logits: the loop holds the model's output, `outputs = model(**batch); loss =
    outputs.loss; loss.backward(); optimizer.step()` (accelerate's examples/nlp_example.py, the
    plain PyTorch loops of the transformers docs), which transformers' Trainer.training_step
    does not (compute_loss returns the loss only; trainer.py). `outputs.logits` is the head's
    output (transformers loss/loss_utils.py ForCausalLMLoss upcasts a copy of it inside the
    loss), or the fp32 logits where the model upcasts them itself (torchtune, Mamba-2). It lives
    through backward and the optimizer step, and until the next `model(**batch)` returns, so
    in the steady state one copy is alive in every phase and two at the end of forward. Its
    `loss` keeps the autograd graph's nodes, whose AccumulateGrad holds enable_input_require_grads'
    input leaf and its .grad: with checkpointing and frozen embeddings, the last step's are
    alive until the new forward returns too."""
    end = fwd_end.terms
    kept = end.get("logits/logits") or end.get("logits/logits_fp32", 0)
    static = Breakdown(dict(static.terms)).add("logits/kept_by_the_loop", kept)
    if acts.input_leaf_bytes:
        fwd_end = (Breakdown(dict(fwd_end.terms)).add("activations/kept_input_leaf", acts.input_leaf_bytes)
                   .add("gradients/kept_input_leaf", acts.input_leaf_bytes))
    return static, fwd_end
def _in_flight(grads_at_peak: list[Breakdown]) -> list[Breakdown]:
    """A later micro-step's gradients at each stage's backward peak: the ones the op there has
    just made (stage_grads_at_peak) are fresh tensors beside the `.grad` they go into
    (timeline.StepPlan.stage_grads_in_flight). Measured: the CPU grid's phi3 b1 s64 Adafactor,
    two micro-steps, whose backward peaks at the untied embedding's fresh gradient."""
    return [Breakdown({f"backward/incoming_{k.split('/', 1)[-1]}": v for k, v in g}) for g in grads_at_peak]


def _transient(acts: ActivationPlan, st) -> Breakdown:
    """A stage's backward transients from its saved list: what checkpointing recomputes,
    then (a layer's) the backward's own temporaries."""
    t = Breakdown()
    if st.recompute:
        t.merge(_stage_breakdown([x for x in st.recompute if x[0] not in st.freed_before_peak],
                                 "activations/recomputed_layer"))
    if st.label.startswith("layer"):
        t.merge(acts.layer_backward_transient if st.backward_transient is None else st.backward_transient)
    return t


def _in_backward(desc: ModelDesc, spec: JobSpec, params: ParamSet, acts: ActivationPlan) -> list[Breakdown] | None:
    """Per stage, the fused step's terms at its backward peak (None: the step runs after)."""
    if not steps_in_backward(spec):
        return None
    by_stage: list[list] = [[] for _ in range(num_stages(desc))]
    for p in params.trainable():
        by_stage[stage_of(desc, p)].append(p)
    alive = [None] * len(by_stage)
    if spec.optimizer in FUSED_IN_BACKWARD and len(acts.stages) == len(by_stage):
        th = spec.micro_batch_size * spec.seq_len * desc.hidden_size
        # a checkpointed layer holds its input and, in its backward, what it recomputes
        alive = [lomo_alive(spec, st.label, [*st.saved, *(st.recompute or ())], st.freed_before_peak,
                            acts.head_linear_saved, acts.layer_backward_transient, th) for st in acts.stages]
    return [stage_step_terms(spec, tuple(ps), a) for ps, a in zip(by_stage, alive)]
