"""The optimizer step fused into backward: `optimizer_in_backward`, LOMO and AdaLomo.

torchtune (training/memory.py `register_optim_in_bwd_hooks`) and the PyTorch tutorial "How
to save memory by fusing the optimizer step into the backward pass" build one optimizer
per parameter and step it from `Tensor.register_post_accumulate_grad_hook`, then set the
gradient to None: the full set of gradients never exists, and `optimizer.step()` after
backward has nothing to do. lomo_optim's Lomo/AdaLomo (lomo.py, adalomo.py) register
`p.register_hook` on every parameter: when a parameter's gradient arrives, the hook updates
every parameter whose `.grad` is set (the one accumulated just before) and frees that
`.grad`; `fused_backward` updates the last one after `loss.backward()`.

So at a stage's backward peak one parameter's gradient is alive with that parameter's step
temporaries; the optimizer phase holds weights and states only. Not modelled: LOMO and
AdaLomo step a parameter inside the next parameter's hook, so that parameter's incoming
gradient (the hook's argument) and what its stage's backward has not yet freed are alive
too. Where the head's step carries the peak this is the final norm's saved tensors and the
hidden gradient (bench/accuracy: -0.43% to -0.53%); where a decoder layer's weight does (a
wide MLP, a short batch) it is the next MLP weight's gradient and most of the layer's
activations: -10.8% to -13.1% on a tiny Llama (h 64, f 1024, b1 s16) against lomo_optim 0.1.1.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.trainable import HeldParam, ParamSet, grad_dtype
from vramplan.spec import JobSpec, Optimizer
from vramplan.spec.optimizers import FUSED_IN_BACKWARD, steps_in_backward
from vramplan.units import nbytes

__all__ = ["steps_in_backward", "stage_step_terms", "lomo_step_terms", "lomo_step_temporary"]


def lomo_step_terms(spec: JobSpec, p: HeldParam) -> dict[str, int]:
    """lomo.py `fuse_update`, one parameter: `grad_fp32 = p.grad.to(float32)`, then
    `p.grad = None`, then `p_fp32 = p.data.to(float32)`. For an fp32 parameter both are the
    tensors themselves (the gradient stays alive as `grad_fp32`); for a 16-bit one they are
    fp32 copies and the 16-bit gradient is gone."""
    n, w = p.numel, grad_dtype(spec, p)
    out = {"gradients/stepping_in_backward": nbytes(n, "fp32")}
    if spec.optimizer is Optimizer.ADALOMO:
        # lomo_optim 0.1.1 adalomo.py `fuse_update`, beside grad_fp32, all fp32 of p's shape:
        # `update = (grad_fp32**2) + eps[0]` holds the square and the sum at once; the
        # factored `update = self._approx_sq_grad(row, col)` (or `exp_avg_sq.rsqrt()` for a
        # vector) is made while the sum is alive; `p_fp32 = p.data.to(float32)` (a copy for a
        # 16-bit p) comes after the sum is freed, beside the one update. Two at most.
        out["temporaries/optimizer/adalomo_update"] = 2 * nbytes(n, "fp32")
    elif w != "fp32":
        out["temporaries/optimizer/lomo_fp32_param"] = nbytes(n, "fp32")
    return out


def lomo_step_temporary(spec: JobSpec, p: HeldParam) -> int:
    """LOMO's step temporaries beyond the gradient (for the summary of step_temporaries)."""
    return sum(v for k, v in lomo_step_terms(spec, p).items() if k.startswith("temporaries/"))


def stage_step_terms(spec: JobSpec, params: tuple[HeldParam, ...]) -> Breakdown:
    """While the largest parameter of a stage owning `params` steps in its hook: its
    gradient and the step's temporaries (its own optimizer stepping it alone). The hook
    runs between autograd nodes, after the node that made the gradient has released its
    inputs' gradients and this stage's saved tensors."""
    from vramplan.components.optimizer import step_temporaries

    train = [p for p in params if p.trainable]
    out = Breakdown()
    if not train:
        return out
    largest = max(train, key=lambda p: p.numel)
    if spec.optimizer in FUSED_IN_BACKWARD:
        for key, value in lomo_step_terms(spec, largest).items():
            out.add(key, value)
        return out
    out.add("gradients/stepping_in_backward", nbytes(largest.numel, grad_dtype(spec, largest)))
    return out.merge(step_temporaries(spec, ParamSet((largest,))))
