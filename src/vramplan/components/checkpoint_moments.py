"""Moments of a checkpointed layer that its saved list does not show.

torch.utils.checkpoint (non-reentrant, transformers 5's default) keeps a layer's input and
nothing it saves; two moments then hold more than the layer's saved tensors:

- in forward, autocast's cache: the low-precision copies of trained leaf weights made by
  every layer so far stay alive until the autocast region exits
  (aten/src/ATen/autocast_mode.cpp `cached_cast`), beside the layer's own forward moment;
- in backward, the recomputation's early stop: torch/utils/checkpoint.py `_recomputation_hook`
  raises `_StopRecomputationError` from the pack hook of the last saved tensor, so at that
  moment every recomputed tensor is alive and so are the locals of the frames the
  recomputation stops in, with the gradients the backward made before it needed a saved
  tensor. When the last save is the LoRA branch of the layer's output projection (LoRA on
  every linear), that is inside PEFT's lora.Linear.forward at `lora_B(...)`.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.grad_moments import GradMoment
from vramplan.components.graph import Recorder, Sym
from vramplan.units import nbytes

CACHE_TERM = "activations/autocast_weight_cache"


def record_dropout_moment(rec: Recorder, alive: tuple[Sym, ...], dropped: Sym, early: bool) -> None:
    """LoRA's dropout on CPU (aten/src/ATen/native/Dropout.cpp `_dropout_impl`: `noise =
    empty_like(input).bernoulli_(1 - p)`, then `input * noise`): at the product its input, the
    noise and the output are alive at once, beside `alive` (the caller's). A checkpointed layer
    keeps none of them, so its forward can peak there (CPU meter: Phi amp-bf16, LoRA dropout
    0.05 on fc2, whose fp32 cast of the MLP's output, noise and product are alive)."""
    noise = _saved_as(rec, f"{dropped.name}.mask", dropped)
    if noise is not None:
        _moment(rec, (*alive, noise, dropped), noise.name, early)


def record_lora_a_moment(rec: Recorder, alive: tuple[Sym, ...], xa: Sym, early: bool) -> None:
    """Under autocast lora_A runs on a low-precision copy of its input (saved by its mm): at
    lora_A's output the input, its cast, the dropped copy (saved by nothing else), that copy,
    the base result and lora_A's output (`alive`) are alive (the output projection's, in a kept
    layer, is the forward's peak of a classifier: CPU meter, TRL reward model, lora_dropout 0.1
    kept; in a checkpointed Phi layer's recomputation, the backward's peak)."""
    copy = _saved_as(rec, f"{xa.name}.autocast", xa, rec.autocast) if rec.autocast else None
    if copy is not None:
        _moment(rec, (*alive, copy), copy.name, early)


def _saved_as(rec: Recorder, name: str, like: Sym, dtype: str | None = None) -> Sym | None:
    return next((Sym(n, like.shape, dtype or like.dtype, False, st) for n, st in rec.saved.values() if n == name), None)


def _moment(rec: Recorder, alive: tuple[Sym, ...], last_saved: str, early: bool) -> None:
    """A forward moment; in a checkpointed layer (`early`) also the same moment of its
    recomputation in backward, with what it has recomputed so far (the saves up to
    `last_saved`) and the backward's incoming gradient: a GradMoment whose "gradients" are
    the moment's unsaved tensors (grad_moments.py)."""
    rec.forward_moment(*rec.frame, *rec.held, *alive, early=early)
    if early:
        unsaved = {id(t.storage): t.storage.nbytes for t in (*rec.frame, *rec.held, *alive)
                   if id(t.storage) not in rec.seen}
        rec.grad_moments.append(GradMoment(last_saved, "activations/recomputed_forward_moment",
                                           sum(unsaved.values()), 0, 0))


def record_lora_stop(rec: Recorder, alive: tuple[Sym, ...], out: Sym, yb: Sym) -> None:
    """Call after lora_B's linear has saved its input (peft/tuners/lora/layer.py Linear.forward
    `result + lora_B(lora_A(dropout(x))) * scaling`): mm packs its inputs before it computes
    (autograd's generated VariableType), so a stop there holds `alive` (the callers' locals,
    the input and its cast to the adapters' dtype, the base result, lora_A's output) without
    lora_B's output. The backward reached it through `* scaling` (MulBackward0 of a Python
    scalar keeps nothing, so it runs first and makes the scaled branch's gradient, out's shape
    in lora_B's dtype) and, when lora_B's dtype is not the base result's (no autocast, fp32
    adapters), through `.to(result dtype)` and the add, whose base-side gradient is a copy in
    the result's dtype. The layer's own incoming gradient is backward/grad_hidden."""
    alive_by_storage: dict[int, Sym] = {}
    for t in (*rec.frame, *rec.held, *alive):
        alive_by_storage.setdefault(id(t.storage), t)
    unsaved = [(t.name, t.storage.nbytes) for key, t in alive_by_storage.items() if key not in rec.seen]
    numel = out.numel
    grads = [(f"{yb.name}.grad", nbytes(numel, yb.dtype))]
    if yb.dtype != out.dtype:
        grads.append((f"{out.name}.grad", nbytes(numel, out.dtype)))
    rec.recompute_stop = (len(rec.saved), unsaved, grads)


def layer_stop(rec: Recorder) -> tuple | None:
    """The recorded stop when nothing was saved after it (it is then the layer's last pack)."""
    stop = rec.recompute_stop
    return stop[1:] if stop is not None and stop[0] == len(rec.saved) else None


def cache_before(stage_lists: list[list[tuple[str, int]]], trained: set[str]) -> list[int]:
    """Per stage: bytes of the trained weights' autocast casts the earlier stages made."""
    out, total = [], 0
    for items in stage_lists:
        out.append(total)
        total += sum(v for n, v in items if n.startswith("autocast_weight/") and n.split("/", 1)[1] in trained)
    out.append(total)
    return out


def apply_stops(plan, stops: dict[int, tuple]) -> None:
    """Each checkpointed layer with a recorded stop: its backward transient becomes the stop's
    terms when that moment holds more than the backward's own peak (one event per layer
    backward, the larger of its moments). At the stop every recomputed tensor is alive,
    those the later peak has released (`freed_before_peak`) included."""
    grad_hidden = plan.layer_backward_transient.terms.get("backward/grad_hidden", 0)
    for j, (unsaved, grads) in stops.items():
        st = plan.stages[j]
        base = plan.layer_backward_transient if st.backward_transient is None else st.backward_transient
        freed = sum(v for n, v in st.recompute if n in st.freed_before_peak)
        terms = Breakdown().add("backward/grad_hidden", grad_hidden)
        if freed:
            terms.add("activations/recompute_stop/freed_later", freed)
        for name, v in unsaved:
            terms.add(f"activations/recompute_stop/{name}", v)
        for name, v in grads:
            terms.add(f"backward/recompute_stop/{name}", v)
        if terms.total() > base.total():
            st.backward_transient = terms


__all__ = ["record_dropout_moment", "record_lora_a_moment", "record_lora_stop", "layer_stop", "cache_before",
           "apply_stops", "CACHE_TERM"]
