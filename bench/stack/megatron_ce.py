"""Megatron-Core's own vocab-parallel cross-entropy (megatron-core 0.16.1, installed from
PyPI: `tensor_parallel.vocab_parallel_cross_entropy`, and with `--fused` the jit-fused
`fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy`), run on CPU with a one-rank
gloo group, as GPTModel calls it: the output layer (a frozen linear, the hidden states
requiring grad; both, and the labels, made before the meter and not counted) makes [s, b, v] logits inside a function that returns only the loss, so the
logits die when it returns, as GPTModel.forward's local does. The exact meter counts every
storage made inside; its forward and backward peaks are put next to vramplan's loss terms
(components/megatron_loss.py) for the same shapes:

    forward  = logits' saved set + what is alive at the end of forward (+ hidden states)
    backward = max(saved + loss backward, head backward)

    PYTHONPATH=src python bench/stack/megatron_ce.py            # -> bench/stack/results-megatron-ce.json
    PYTHONPATH=src python bench/stack/megatron_ce.py --check    # print, write nothing
    PYTHONPATH=src python bench/stack/megatron_ce.py --fused    # also the fused one (bf16 rows)
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

from vramplan.components.megatron_loss import megatron_ce_terms
from vramplan.measure.meter import MemoryMeter
from vramplan.units import nbytes

HERE = Path(__file__).resolve().parent
SHAPES = [  # (s, b, h, v, dtype)
    (256, 2, 256, 8000, "bf16"),
    (512, 1, 512, 32000, "bf16"),
    (128, 4, 256, 16000, "fp32"),
    (256, 2, 256, 50257, "fp16"),
]
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def init() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def run(s: int, b: int, h: int, v: int, dtype: str, fused: bool) -> dict:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    torch.manual_seed(0)
    dt = TORCH[dtype]
    hidden = torch.randn(s, b, h, dtype=dt, requires_grad=True)
    weight = torch.randn(v, h, dtype=dt) * 0.02
    labels = torch.randint(0, v, (b, s))
    tp = parallel_state.get_tensor_model_parallel_group()

    def forward() -> torch.Tensor:
        logits = hidden @ weight.t()                       # the output layer, [s, b, v]
        target = labels.transpose(0, 1).contiguous()       # compute_language_model_loss
        if fused:
            loss = fused_vocab_parallel_cross_entropy(logits, target, tp)
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target)
        return loss.transpose(0, 1).contiguous()

    meter = MemoryMeter()
    with meter:
        # the inputs exist before the loss (a view made inside would count them): registered,
        # and taken off every figure below
        meter.register([hidden, weight, labels], "inputs")
        base = meter.current
        with meter.phase("forward"):
            loss = forward()
            end_of_forward = meter.current - base
        with meter.phase("backward"):
            loss.sum().backward()
    saved, fwd, bwd0, head = megatron_ce_terms(s * b, v, dtype, nbytes(s * b * h, dtype))
    est_fwd = saved.total() + fwd.total()
    est_bwd = max(saved.total() + bwd0.total(), head.total())
    fwd_peak, bwd_peak = meter.phase_peaks["forward"] - base, meter.phase_peaks["backward"] - base
    return {"s": s, "b": b, "h": h, "v": v, "dtype": dtype, "fused": fused,
            "measured": {"forward_peak": fwd_peak, "end_of_forward": end_of_forward, "backward_peak": bwd_peak},
            "estimated": {"forward_peak": est_fwd, "backward_peak": est_bwd},
            "error": {"forward": (est_fwd - fwd_peak) / fwd_peak, "backward": (est_bwd - bwd_peak) / bwd_peak}}


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    init()
    # the fused variant (torch.compile'd on CPU: minutes of compiling on 2 cores) on request
    fused = [False, True] if "--fused" in argv else [False]
    rows = [run(*shape, fused=f) for shape in SHAPES for f in fused if not (f and shape[-1] != "bf16")]
    out = {"what": "megatron-core vocab_parallel_cross_entropy (with --fused also the fused one, bf16) on CPU, one gloo rank, "
                   "under vramplan's exact meter, against components/megatron_loss.py",
           "versions": {"megatron-core": version("megatron-core"), "torch": torch.__version__},
           "command": "PYTHONPATH=src python bench/stack/megatron_ce.py", "rows": rows}
    for r in rows:
        print(f"s{r['s']} b{r['b']} v{r['v']} {r['dtype']:>4} fused={r['fused']!s:5}  "
              f"fwd {r['measured']['forward_peak']:>11} est {r['estimated']['forward_peak']:>11} "
              f"({r['error']['forward']:+.2%})  bwd {r['measured']['backward_peak']:>11} "
              f"est {r['estimated']['backward_peak']:>11} ({r['error']['backward']:+.2%})")
    if "--check" not in argv:
        (HERE / "results-megatron-ce.json").write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
