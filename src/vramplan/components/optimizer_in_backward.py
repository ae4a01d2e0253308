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
temporaries; the optimizer phase holds weights and states only. LOMO and AdaLomo step a
parameter inside the next parameter's hook, so that parameter's incoming gradient and what
its stage's backward has not freed yet are alive too (`lomo_alive`).
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.dtypes import dtypes_of
from vramplan.components.trainable import HeldParam, ParamSet, grad_dtype
from vramplan.spec import JobSpec, Optimizer
from vramplan.spec.optimizers import FUSED_IN_BACKWARD, steps_in_backward
from vramplan.units import nbytes

__all__ = ["steps_in_backward", "stage_step_terms", "lomo_step_terms", "lomo_step_temporary", "lomo_alive"]


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
        if len(p.shape) >= 2:
            # `_approx_sq_grad`: r_factor (m) and c_factor (n), fp32, alive with both
            out["temporaries/optimizer/adalomo_factors"] = nbytes(p.shape[0] + p.shape[-1], "fp32")
    elif w != "fp32":
        out["temporaries/optimizer/lomo_fp32_param"] = nbytes(n, "fp32")
    return out


def lomo_step_temporary(spec: JobSpec, p: HeldParam) -> int:
    """LOMO's step temporaries beyond the gradient (for the summary of step_temporaries)."""
    return sum(v for k, v in lomo_step_terms(spec, p).items() if k.startswith("temporaries/"))


def stage_step_terms(spec: JobSpec, params: tuple[HeldParam, ...], alive=None) -> Breakdown:
    """While the largest parameter of a stage owning `params` steps in its hook: its
    gradient and the step's temporaries (its own optimizer stepping it alone). The hook
    runs between autograd nodes, after the node that made the gradient has released its
    inputs' gradients and this stage's saved tensors. LOMO/AdaLomo: `alive(largest, next)`
    gives what the stage's backward still holds when the next parameter's hook steps it
    (lomo_alive), None where that moment is not modelled."""
    from vramplan.components.optimizer import step_temporaries

    train = [p for p in params if p.trainable]
    out = Breakdown()
    if not train:
        return out
    largest = max(train, key=lambda p: p.numel)
    if spec.optimizer in FUSED_IN_BACKWARD:
        for key, value in lomo_step_terms(spec, largest).items():
            out.add(key, value)
        rest = [p for p in train if p is not largest]
        held = alive(largest, max(rest, key=lambda p: p.numel) if rest else None) if alive else None
        if held is None:
            return out
        at_hook, before_hook = held
        # just before the hook the node that made q's gradient still holds its input's
        # gradient, and p's gradient waits in p.grad (grad_dtype): larger where the step
        # itself allocates little (LOMO on an fp32 parameter updates in place)
        before = {**at_hook, **before_hook,
                  "gradients/pending_in_hook": nbytes(largest.numel, grad_dtype(spec, largest))}
        if sum(before.values()) > sum(at_hook.values()) + out.total():
            return Breakdown(before)
        for key, value in at_hook.items():
            out.add(key, value)
        return out
    out.add("gradients/stepping_in_backward", nbytes(largest.numel, grad_dtype(spec, largest)))
    return out.merge(step_temporaries(spec, ParamSet((largest,))))


_MUL_SAVED = ("mlp/act", "mlp/up")
"""A gated MLP's `act * up` (MulBackward0) saves both operands (the recorder's names)."""


def lomo_alive(spec: JobSpec, label: str, saved, freed: tuple[str, ...], head_saved: tuple[str, ...],
               layer_bwd: Breakdown, tokens_hidden: int):
    """What autograd holds when lomo_optim steps a stage's largest parameter `p`: its hook
    (`p.register_hook`, before accumulation) only sets `p.grad`; the update runs in the hook of
    the next parameter whose gradient arrives, `q`, whose incoming gradient is alive then.
    Measured with the CPU meter on a Llama (tiny, lomo_optim 0.1.1):
      * a layer whose largest weight is an MLP projection: down_proj is stepped in up_proj's
        hook, after `act * up`'s backward has freed its operands (mlp/act, mlp/up) and
        down_proj's input (freed before the layer's peak): the rest of the layer's saved
        tensors, the hidden-state gradient, one (T x f) gradient of the MLP, up_proj's input
        gradient (T x h) and q's gradient (under checkpointing `saved` holds what the layer
        recomputed);
      * the head (lm_head, then the final norm's weight): the norm's saved tensors but its
        output (lm_head's input) and the weight product's operand (`*.xhat_cast`/`*.xhat`), the
        gradient of the normalized hidden state (T x h) and the norm weight's gradient.
    Returns fun(p, q) -> (terms at the hook, what the node making q's gradient adds just
    before it), or None where the moment is not modelled (the step's own terms only)."""
    c = dtypes_of(spec).compute
    names = {n for n, _ in saved}
    if label.startswith("layer") and all(n in names for n in _MUL_SAVED) and spec.method.value == "full":
        kept = sum(v for n, v in saved if n not in freed and n not in _MUL_SAVED)
        grad_mlp = layer_bwd.terms.get("backward/grad_mlp", 0)

        def layer(p: HeldParam, q: HeldParam | None):
            if ".mlp." not in p.name or q is None or ".mlp." not in q.name:
                return None
            return ({"activations/layers/unfreed_at_step": kept,
                     "backward/grad_hidden": layer_bwd.terms.get("backward/grad_hidden", 0),
                     "backward/grad_mlp": grad_mlp // 3,
                     "backward/grad_next_input": nbytes(tokens_hidden, c),
                     "gradients/next_param_incoming": nbytes(q.numel, grad_dtype(spec, q))},
                    {"backward/grad_mlp_up": grad_mlp // 3})  # up's output gradient, its node's input
        return layer
    if label == "head" and head_saved:
        # the weight product's operand: the normalized state cast to the weight's dtype, or
        # the normalized state itself where no cast is made (fp32)
        operand = ([n for n in names if n.endswith(".xhat_cast")] or [n for n in names if n.endswith(".xhat")])[:1]
        kept = sum(v for n, v in saved if n not in head_saved and n not in operand)
        cast = sum(v for n, v in saved if n in operand)

        def head(p: HeldParam, q: HeldParam | None):
            if q is None or len(q.shape) != 1:
                return None
            return ({"activations/head/unfreed_at_step": kept,
                     "backward/grad_hidden": nbytes(tokens_hidden, c),
                     "gradients/next_param_incoming": nbytes(q.numel, grad_dtype(spec, q))},
                    # the weight product's node: its saved operand and its input gradient
                    {"activations/head/weight_product_operand": cast,
                     "backward/grad_head_output": nbytes(tokens_hidden, c)})
        return head
    return None
