"""Backward moments of a layer's own ops: where the autograd engine, inside one node's backward,
holds more gradients than the MLP's moment the plan counts (components/layer_backward.py).

A forward records one GradMoment per such op (DoRA's `s * y_lora`, components/dora.py; a
mixture-of-experts block's routing-weight product, components/moe.py). At that node's
backward the engine has run every node recorded after it and released what they saved
(torch/csrc/autograd/engine.cpp: a node's SavedVariables go once it has run); alive are what
the layer saved up to the op, the residual stream's gradient, the op's own gradients and,
when a later op read the same input (up_proj after gate_proj, the shared experts after the
routed ones), that one's gradient of it, waiting in the input's buffer.
"""
from __future__ import annotations

from typing import NamedTuple

from vramplan.breakdown import Breakdown


class GradMoment(NamedTuple):
    last_saved: str
    """Name of the last tensor the layer saved before the op's node runs (the op's own saves
    included): what the layer keeps at the moment is its saved list up to it."""
    term: str
    """Breakdown term of the op's gradients."""
    grads: int
    """Bytes of the gradients alive in the node's backward."""
    input_id: int
    """id() of the op's input storage: a later reader of it marks `sibling_after`."""
    input_grad: int
    """Bytes of the gradient of that input."""
    sibling_after: bool = False


def mark_readers(moments: list, x) -> None:
    """A new op reads `x`: an earlier moment on the same input waits for its gradient."""
    moments[:] = [m._replace(sibling_after=True) if m.input_id == id(x.storage) else m for m in moments]


def apply(plan, moments_at: dict, grad_hidden: int) -> None:
    """Per layer stage (`moments_at`: stage index -> its GradMoments), the largest moment that
    exceeds the backward peak the plan counts there becomes the stage's backward transient,
    with the saved tensors released before it."""
    shared: dict[tuple, tuple | None] = {}
    for j, moments in moments_at.items():
        st = plan.stages[j]
        saved = st.recompute or st.saved
        key = (id(saved), id(moments), st.freed_before_peak, id(st.backward_transient))
        if key not in shared:
            counted = (sum(v for n, v in saved if n not in st.freed_before_peak)
                       + (st.backward_transient or plan.layer_backward_transient).total())
            shared[key] = _largest(saved, moments, counted, grad_hidden)
        if shared[key] is not None:
            st.backward_transient, st.freed_before_peak = shared[key]


def _largest(saved: list[tuple[str, int]], moments, counted: int, grad_hidden: int) -> tuple | None:
    names, best = [n for n, _ in saved], None
    for m in moments:
        if m.last_saved not in names:
            continue
        at = len(names) - 1 - names[::-1].index(m.last_saved)
        out = Breakdown().add("backward/grad_hidden", grad_hidden).add(m.term, m.grads)
        if m.sibling_after:
            out.add("backward/grad_input_waiting", m.input_grad)
        moment = sum(v for _, v in saved[:at + 1]) + out.total()
        if moment > counted:
            kept = set(names[:at + 1])
            counted, best = moment, (out, tuple(n for n in names[at + 1:] if n not in kept))
    return best
