"""The optimizer step fused into backward (torchtune `optimizer_in_bwd: True`).

torchtune 0.6 torchtune/training/memory.py register_optim_in_bwd_hooks: one optimizer per
parameter (recipes' `_setup_optimizer(optimizer_in_bwd=True)`: `{p: instantiate(cfg, [p])}`),
and a post-accumulate-grad hook on each trained parameter that calls `step()` then
`zero_grad()` (set_to_none) as soon as the parameter's gradient is complete. So no gradient
outlives its own hook: at any moment of backward there is at most the gradient being
stepped, with that one parameter's step temporaries, and `optimizer.step()` after backward
has nothing left to do. A weight used twice (tied input and output embeddings) gets its hook
only when its last use is done, so its gradient stays from the head's backward to the
embedding's.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.optimizer import step_temporaries
from vramplan.components.trainable import ParamSet
from vramplan.components.trainable import grad_dtype
from vramplan.components.weights import num_stages, stage_of
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec
from vramplan.units import nbytes


def in_backward_stages(desc: ModelDesc, spec: JobSpec, params: ParamSet
                       ) -> tuple[list[Breakdown], list[Breakdown], Breakdown]:
    """(gradients kept per stage: none, what one stage's backward adds at its peak, the tied
    embedding's gradient alive through every stage's backward). At its peak a stage holds
    its largest parameter's gradient and that parameter's step temporaries."""
    kept, tied = [Breakdown() for _ in range(num_stages(desc))], Breakdown()
    at_peak = [Breakdown() for _ in range(num_stages(desc))]
    best: dict[int, int] = {}
    for p in params.trainable():
        stage = stage_of(desc, p)
        size = nbytes(p.numel, grad_dtype(spec, p))
        if desc.tie_word_embeddings and p.name.split("#")[0] == "model.embed_tokens.weight":
            tied.add("gradients/tied_embedding", size)
            continue
        temps = step_temporaries(spec, ParamSet((p,))).total()
        best[stage] = max(best.get(stage, 0), size + temps)
    for stage, size in best.items():
        at_peak[stage].add("gradients/in_backward_step", size)
    return kept, at_peak, tied
