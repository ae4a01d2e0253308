"""An activation plan's types, the saved tensors of a step stage by stage
(components/activations.py builds them), and the copy each caller of the memoized plan gets."""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.breakdown import Breakdown

INPUT_LEAF = "embed/input_leaf"
"""The embedding stage's name for enable_input_require_grads' leaf where it is no layer's
input (GPT-2's, BERT's word embeddings: arch.input_hook)."""


@dataclass(slots=True)
class Stage:
    label: str
    saved: list[tuple[str, int]]
    """(tensor name, bytes) saved until this stage's backward."""
    recompute: list[tuple[str, int]]
    """Under checkpointing: what the recomputation saves again during backward."""
    freed_before_peak: tuple[str, ...] = ()
    """Names of this stage's saved tensors already released at its backward peak."""
    backward_transient: Breakdown | None = None
    """This layer's own backward-peak temporaries when its family says where that peak is
    (families/<name>/forward.py `backward_peak`); None: the plan's layer_backward_transient."""


@dataclass(slots=True)
class ActivationPlan:
    stages: list[Stage]
    loss_saved: Breakdown
    forward_end_transient: Breakdown
    loss_backward_transient: Breakdown
    head_backward_transient: Breakdown
    layer_backward_transient: Breakdown
    input_leaf_bytes: int = 0
    """enable_input_require_grads' embedding output (a leaf that requires grad) under
    checkpointing with frozen embeddings: it and its .grad stay alive while the loss graph
    lives, which in a plain loop (loss kept until after optimizer.step()) spans the step."""
    head_input: tuple[str, int] = ("", 0)
    """(name, bytes) of the output head's input (the final norm's output): what a log-prob
    head that bypasses the head module (jobs/logprob.py) reads instead."""
    head_linear_saved: tuple[str, ...] = ()
    """Names of what the output head's linear saved (its input, an autocast copy)."""
    stage_forward_transient: list[Breakdown] | None = None
    """Per stage: held only while its forward runs (float8 casts, components/float8.py)."""



def copy_plan(plan: ActivationPlan) -> ActivationPlan:
    """Fresh Breakdowns and Stages (callers extend the one and reassign the other's fields,
    jobs/trained.py, jobs/vlm.py); the saved lists are shared, as no caller changes a list
    in place, so layers that shared one still do (step.build keys its breakdowns by it)."""
    def bd(b: Breakdown) -> Breakdown:
        return Breakdown(dict(b.terms))
    return ActivationPlan([Stage(st.label, st.saved, st.recompute, st.freed_before_peak, st.backward_transient)
                           for st in plan.stages], bd(plan.loss_saved), bd(plan.forward_end_transient),
                          bd(plan.loss_backward_transient), bd(plan.head_backward_transient),
                          bd(plan.layer_backward_transient), plan.input_leaf_bytes, plan.head_input,
                          plan.head_linear_saved, None if plan.stage_forward_transient is None
                          else _copy_shared(plan.stage_forward_transient))


def _copy_shared(parts: list[Breakdown]) -> list[Breakdown]:
    """A fresh Breakdown per distinct one of `parts`, shared where the original shared
    one (equal layers' forward moments: the timeline and the parallel plans treat a shared
    part once; whoever adds to one stage alone copies it first, breakdown.own)."""
    fresh: dict[int, Breakdown] = {}
    for b in parts:
        if id(b) not in fresh:
            fresh[id(b)] = Breakdown(dict(b.terms))
    return [fresh[id(b)] for b in parts]
