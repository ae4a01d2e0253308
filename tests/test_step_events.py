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
    # the setup holds the weights; the optimizer states, one tensor per parameter, are made
    # by the first step where its optimizer phase begins (torch.optim `_init_group`)
    n_trainable = sum(1 for p in params.params if p.trainable)
    assert sum(1 for e in events.setup if e[3].startswith("weights/")) == len(params.params)
    assert not any(e[3].startswith("optimizer/") for e in events.setup)
    states = [(e, at) for e, at in zip(events.lazy, events.lazy_at) if e[3].startswith("optimizer/")]
    assert sum(1 for e, _ in states if e[3] == "optimizer/exp_avg") == n_trainable
    assert all(e[0] is ALLOC and e[4] == "optimizer" for e, _ in states)
    (at,) = {at for _, at in states}  # where the optimizer phase begins
    assert events.step[at][4] == "optimizer" and events.step[at - 1][4] == "backward"
    first = events.first_step()
    assert len(first) == len(events.step) + len(events.lazy)
    assert set(first) >= {(e[1], e[2]) for e in events.lazy}


def test_each_cublas_handle_makes_its_workspace_at_its_first_matmul():
    spec = vramplan.load_spec({**JOBS["full"], "backend": "cuda", "gpu": "h100-80gb"})
    from vramplan.device import step_events
    from vramplan.components.runtime import blas_workspace_terms
    events = step_events(spec)
    assert not any(e[3].startswith("runtime/") for e in events.setup)
    ws = [(e, at) for e, at in zip(events.lazy, events.lazy_at) if e[3] == "runtime/cublas_workspace"]
    total = dict(blas_workspace_terms("h100-80gb"))["runtime/cublas_workspace"]
    assert [e[2] for e, _ in ws] == [total // 2, total // 2]  # two handles, 32 MiB each on sm90
    (fwd, at_f), (bwd, at_b) = sorted(ws, key=lambda x: x[1])
    assert fwd[4] == "forward" and at_f == 0
    assert bwd[4] == "backward" and events.step[at_b][4] == "backward"
    assert events.step[at_b - 1][4] == "backward" and events.step[at_b - 1][3].startswith("logits/")


def test_the_backward_workspace_follows_the_head_s_first_matmul_output():
    # the H100 traces (bench/allocator/traces): the upcast's backward frees the fp32 logits'
    # gradient, the head's first backward matmul makes its output, and only then does the
    # autograd thread's cuBLAS handle make its 32 MiB workspace
    from vramplan.device import step_events
    spec = vramplan.load_spec({**JOBS["lora"], "precision": "bf16", "backend": "cuda", "gpu": "h100-80gb"})
    events = step_events(spec)
    (at_b,) = [at for e, at in zip(events.lazy, events.lazy_at)
               if e[3] == "runtime/cublas_workspace" and e[4] == "backward"]
    order = [(e[0], e[3]) for e in events.step]
    assert order.index((FREE, "logits/grad_logits_fp32")) < at_b
    assert events.step[at_b - 1][0] is ALLOC and events.step[at_b - 1][3].startswith("logits/")
    # the fp32 gradient goes once the 16-bit one exists, before the head's next tensors
    assert order.index((ALLOC, "logits/grad_logits")) < order.index((FREE, "logits/grad_logits_fp32"))


def test_sgd_makes_its_momentum_buffers_from_the_weight_decayed_gradients():
    # torch/optim/sgd.py: the weight-decayed gradients are allocated first, then each missing
    # momentum buffer is cloned from them; AdamW's states come first (_init_group)
    from vramplan.device import step_events
    base = {**JOBS["full"], "precision": "bf16", "backend": "cuda", "gpu": "h100-80gb"}
    sgd = step_events(vramplan.load_spec({**base, "optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.01}))
    at = {e[3]: i for e, i in zip(sgd.lazy, sgd.lazy_at)}
    temps = [i for i, e in enumerate(sgd.step) if e[3] == "temporaries/optimizer/weight_decay_grads"]
    made = [i for i in temps if sgd.step[i][0] is ALLOC]
    freed = [i for i in temps if sgd.step[i][0] is FREE]
    assert max(made) < at["optimizer/momentum_buffer"] <= min(freed)
    assert all(e[4] == "optimizer" for e in sgd.lazy if e[3] == "optimizer/momentum_buffer")
    adamw = step_events(vramplan.load_spec(base))
    at = {e[3]: i for e, i in zip(adamw.lazy, adamw.lazy_at)}
    first_temp = next(i for i, e in enumerate(adamw.step) if e[3].startswith("temporaries/optimizer/"))
    assert at["optimizer/exp_avg"] <= first_temp


def test_sharded_and_unsplit_plans_keep_their_states_at_setup():
    # without per-parameter pieces (sharded plans: ZeRO engines make their states at
    # initialization) the states stay in the setup
    _, _, plan = _plan(JOBS["full"])
    events = build_events(plan)
    assert not events.lazy and any(e[3] == "optimizer/exp_avg" for e in events.setup)


def test_gated_mlp_gradients_are_three_tensors():
    desc, params, plan = _plan(JOBS["full"])
    events = build_events(plan, tensor_pieces(desc, params, plan))
    (total,) = {v for bd in plan.stage_backward_transient for t, v in bd if t == "backward/grad_mlp"}
    made = [e[2] for e in events.step if e[0] is ALLOC and e[3] == "backward/grad_mlp"]
    layers = desc.num_layers
    assert len(made) == 3 * layers and set(made) == {total // 3}


def test_a_checkpointed_layer_makes_its_recompute_tensors_in_forward_and_keeps_none():
    desc, params, plan = _plan(JOBS["checkpointing"])
    events = build_events(plan, tensor_pieces(desc, params, plan))
    fwd = [e for e in events.step if e[4] == "forward" and e[3].startswith("activations/recomputed_layer/")]
    assert fwd, "no forward churn for a checkpointed layer"
    born = {e[1] for e in fwd if e[0] is ALLOC}
    assert born == {e[1] for e in fwd if e[0] is FREE}  # every one freed within the forward
    # a chain: never more than two of them alive at once
    alive = peak = 0
    for e in fwd:
        alive += 1 if e[0] is ALLOC else -1
        peak = max(peak, alive)
    assert peak == 2


def test_the_head_goes_on_with_the_loss_backward_s_logits_gradient():
    # log_softmax's backward output is the upcast's input gradient: one tensor, freed once
    # the 16-bit logits' gradient exists, never freed and made again
    desc, params, plan = _plan(JOBS["full"])
    events = build_events(plan, tensor_pieces(desc, params, plan))
    made = [e for e in events.step if e[3] == "logits/grad_logits_fp32"]
    assert [e[0] for e in made] == [ALLOC, FREE]
    order = [(e[0], e[3]) for e in events.step]
    assert order.index((ALLOC, "logits/grad_logits")) < order.index((FREE, "logits/grad_logits_fp32"))


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
