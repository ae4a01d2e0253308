"""The meter against hand arithmetic on one nn.Linear, and against MemTracker.

Legend for the arithmetic below (fp32, 4 bytes per element):
  W = Linear(64, 32).weight: 32*64*4 = 8192 B;  bias: 32*4 = 128 B;  P = 8320
  x = input [8, 64]: 2048 B;  y = output [8, 32]: 1024 B;  loss = y.sum(): 4 B
  seed = the ones_like(loss) autograd starts backward with: 4 B
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vramplan.measure.meter import MemoryMeter  # noqa: E402

P, X, Y, LOSS, SEED, STEP = 8320, 2048, 1024, 4, 4, 4


def run_linear(make_optimizer, steps: int = 2) -> MemoryMeter:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    opt = make_optimizer(lin.parameters())
    meter = MemoryMeter()
    meter.register(lin.parameters(), "parameter")
    with meter:
        x = torch.randn(8, 64)
        for s in range(1, steps + 1):
            with meter.phase(f"s{s}.fwd"):
                loss = lin(x).sum()
            with meter.phase(f"s{s}.bwd"):
                loss.backward()
            with meter.phase(f"s{s}.opt"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss
        del x
    return meter


def test_forward_backward_by_hand():
    m = run_linear(lambda p: torch.optim.SGD(p, lr=0.1))
    # forward: addmm output y is alive until sum has produced the loss
    assert m.phase_peaks["s1.fwd"] == P + X + Y + LOSS
    # backward: grads of W and b (stolen by AccumulateGrad, torch/csrc/autograd/
    # functions/accumulate_grad.h) while loss and seed are alive; y was freed
    assert m.phase_peaks["s1.bwd"] == P + X + LOSS + SEED + P


def test_sgd_plain_and_momentum_by_hand():
    plain = run_linear(lambda p: torch.optim.SGD(p, lr=0.1, foreach=True))
    assert plain.phase_peaks["s2.opt"] == P + X + LOSS + P  # in-place _foreach_add_
    mom = run_linear(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True))
    # step 1 clones each grad into its momentum buffer (torch/optim/sgd.py)
    assert mom.phase_peaks["s1.opt"] == P + X + LOSS + P + P
    assert mom.phase_peaks["s2.opt"] == P + X + LOSS + P + P
    decay = run_linear(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01,
                                                 foreach=True))
    # weight decay: grads = torch._foreach_add(grads, params, alpha=wd), a new list
    assert decay.phase_peaks["s2.opt"] == P + X + LOSS + P + P + P


@pytest.mark.parametrize("impl, temporaries", [
    # _multi_tensor_adamw: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs), one per param
    ("foreach", P),
    # _fused_adamw: one kernel, no temporaries
    ("fused", 0),
    # _single_tensor_adamw: denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps): the
    # sqrt and the div of the largest parameter (W) are alive together
    ("forloop", 8192 + 8192),
])
def test_adamw_by_hand(impl, temporaries):
    flags = {"foreach": impl == "foreach", "fused": impl == "fused"}
    m = run_linear(lambda p: torch.optim.AdamW(p, **flags))
    state = 2 * P + 2 * STEP  # exp_avg, exp_avg_sq, and one fp32 step scalar per param
    for s in ("s1.opt", "s2.opt"):
        assert m.phase_peaks[s] == P + X + LOSS + P + state + temporaries
    # step 2's backward runs with the optimizer state alive
    assert m.phase_peaks["s2.bwd"] == P + X + LOSS + SEED + P + state
    assert m.current == 0  # model and optimizer died with run_linear: all released


def test_views_count_once_and_free_exactly():
    m = MemoryMeter()
    with m:
        a = torch.zeros(100)
        b = a[10:].view(9, 10)
        assert m.current == 400
        del a
        assert m.current == 400  # b keeps the storage
        del b
        assert m.current == 0
    assert m.peak == 400


def test_registered_tensors_and_phase_contexts():
    w = torch.zeros(10)
    m = MemoryMeter()
    m.register([w, w[2:]], "parameter")
    assert m.current == 40
    with m, m.phase("p1"):
        t = torch.ones(5)
        assert m.phase_peaks["p1"] == 60
        del t
    assert m.peak == 60 and m.peak_label == "p1"


def test_matches_memtracker_on_cpu():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(lin.parameters(), foreach=True)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(lin, opt)
    with tracker:  # MemTracker supports one iteration only
        x = torch.randn(8, 64)
        loss = lin(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, x
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    ours = run_linear(lambda p: torch.optim.AdamW(p, foreach=True), steps=1).peak
    assert ours == theirs == P + X + LOSS + P + 2 * P + 2 * STEP + P


def test_wrapper_subclass_counted_by_its_inner_tensors():
    """torchao's NF4Tensor keeps its bytes in inner tensors; the meter counts those, not the
    placeholder storage of the logical (bf16) shape."""
    import torch
    nf4 = None
    for path in ("torchao.dtypes.nf4tensor", "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"):
        try:
            nf4 = __import__(path, fromlist=["to_nf4"])
            break
        except ImportError:
            continue
    if nf4 is None:
        pytest.skip("torchao with NF4Tensor is not installed")
    from vramplan.measure.meter import MemoryMeter
    t = nf4.to_nf4(torch.randn(512, 256, dtype=torch.bfloat16))
    meter = MemoryMeter()
    meter.register([t], "parameter")
    inner = sum(getattr(t, a).untyped_storage().nbytes() for a in t.__tensor_flatten__()[0])
    assert meter.current == inner < 512 * 256 * 2
