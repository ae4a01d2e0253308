"""The step's ordered tensor events (vramplan.step) against timeline.walk's peak."""
import pytest

import vramplan
from vramplan.components.activations import plan_activations
from vramplan.components.trainable import param_set
from vramplan.step.build import build_step
from vramplan.sources import resolve_model
from vramplan.step import ALLOC, FREE, build_events
from vramplan.step.pieces import tensor_pieces
from vramplan.timeline import peak_event, walk

JOBS = {
    "full": {"model": "llama-3.2-1b", "micro_batch_size": 2, "seq_len": 1024},
    "lora": {"model": "llama-3.2-1b", "method": "lora", "micro_batch_size": 2, "seq_len": 1024},
    "checkpointing": {"model": "qwen2.5-0.5b", "method": "lora", "gradient_checkpointing": "full",
                      "micro_batch_size": 4, "seq_len": 512},
    "selective": {"model": "gpt2", "gradient_checkpointing": "selective", "attention": "eager",
                  "micro_batch_size": 4, "seq_len": 512},
    "grad-accumulation": {"model": "qwen2.5-0.5b", "grad_accum_steps": 8, "micro_batch_size": 1, "seq_len": 256},
    "mixed-precision": {"model": "gemma-2-2b", "precision": "mixed-bf16", "micro_batch_size": 1, "seq_len": 512},
    "qlora": {"model": "llama-3.2-1b", "method": "qlora", "gradient_checkpointing": "full", "seq_len": 512},
    "classifier": {"model": "bert-base-uncased", "task": "sequence-classification", "precision": "fp32",
                   "attention": "eager", "micro_batch_size": 4, "seq_len": 128},
    "chunked-loss": {"model": "qwen2.5-0.5b", "loss_impl": "chunked", "micro_batch_size": 2, "seq_len": 512},
}


def _plan(job):
    spec = vramplan.load_spec(job)
    desc = resolve_model(spec)
    params = param_set(desc, spec)
    return desc, params, build_step(desc, spec, params, plan_activations(desc, spec, params))


@pytest.mark.parametrize("name", sorted(JOBS))
def test_live_peak_of_the_events_is_the_walked_peak(name):
    desc, params, plan = _plan(JOBS[name])
    walked = peak_event(walk(plan)).total
    for pieces in (None, tensor_pieces(desc, params, plan)):
        events = build_events(plan, pieces)
        assert events.live_peak()[0] == walked


@pytest.mark.parametrize("name", ["full", "grad-accumulation"])
def test_every_step_tensor_is_freed_once_and_setup_stays(name):
    desc, params, plan = _plan(JOBS[name])
    events = build_events(plan, tensor_pieces(desc, params, plan))
    born, dead = {}, set()
    for kind, t, nbytes, term, phase in events.step:
        assert phase in ("forward", "backward", "optimizer") and term and nbytes > 0
        if kind is ALLOC:
            assert t not in born
            born[t] = nbytes
        else:
            assert kind is FREE and born[t] == nbytes and t not in dead
            dead.add(t)
    assert set(born) == dead
    assert all(kind is ALLOC and phase == "setup" for kind, *_, phase in events.setup)
    # the setup holds the persistent state, one tensor per parameter for the optimizer states
    n_trainable = sum(1 for p in params.params if p.trainable)
    assert sum(1 for e in events.setup if e[3] == "optimizer/exp_avg") == n_trainable


def test_order_follows_the_step():
    _, _, plan = _plan(JOBS["full"])
    step = build_events(plan).step
    phases = [e[4] for e in step]
    # forward, then backward, then the optimizer: each phase is one contiguous run
    runs = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert runs == ["forward", "backward", "optimizer"]
    first_grad = next(i for i, e in enumerate(step) if e[3].startswith("gradients/"))
    last_saved = max(i for i, e in enumerate(step) if e[0] is ALLOC and e[3].startswith("activations/layers/"))
    assert last_saved < first_grad  # every layer's saved tensors exist before any gradient
    logits = next(i for i, e in enumerate(step) if e[3] == "logits/logits")
    assert last_saved < logits < first_grad
