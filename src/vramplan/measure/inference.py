"""Measure an inference job: transformers' own no-grad forward, or `generate` with its KV cache.

Without `max_new_tokens` the step is `model(input_ids, attention_mask)` under
`torch.inference_mode`, its output (every position's logits) kept until the step ends, as
a user's evaluation loop holds it. With `max_new_tokens` it is
`model.generate(..., max_new_tokens=n, min_new_tokens=n, do_sample=False)`: the prompt's
prefill, then n - 1 one-token decoding steps over transformers' DynamicCache, and the
returned sequences. Each step is metered as one forward phase (`s1.fwd`, `s2.fwd`).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import MeasureResult, phase_kinds
from .build import DTYPES, build_model, job_dict, job_dtypes
from .meter import MemoryMeter
from .run_modes import _live_tensors


def _inputs(job: dict, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 512))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    return ids, torch.ones_like(ids)


def measure_inference(job: Any, steps: int = 2, trace: bool = False) -> MeasureResult:
    job = job_dict(job)
    if job.get("method", "full") != "full" or job.get("quantization"):
        raise ValueError("method: inference is measured for plain (unquantized, no adapter) models")
    dt = job_dtypes(job)
    torch.manual_seed(0)
    # the same causal-LM class training builds (build_model takes only the measured training tasks)
    model = build_model(dict(job, task="sft"), "cpu", DTYPES[dt.weights])
    model.eval().requires_grad_(False)
    model.config.use_cache = True
    new = int(job.get("max_new_tokens") or 0)
    ids, mask = _inputs(job, model.config.vocab_size)
    autocast = (torch.autocast("cpu", dtype=DTYPES[dt.autocast]) if dt.autocast else contextlib.nullcontext())
    meter = MemoryMeter(trace=trace)
    meter.register(model.parameters(), "parameter")
    meter.register(model.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    if trace:
        meter.track_modules(model)
    try:
        with meter:
            for i in range(steps):
                with meter.phase(f"s{i + 1}.fwd"), torch.inference_mode(), autocast:
                    if new:
                        # eos_token_id=None and min_new_tokens: every row generates n tokens
                        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                             min_new_tokens=new, do_sample=False, eos_token_id=None,
                                             pad_token_id=0)
                    else:
                        out = model(input_ids=ids, attention_mask=mask)
                    del out
    finally:
        meter.close()
    import transformers

    result = MeasureResult(
        device="cpu", peak_allocated_bytes=meter.peak, phases=phase_kinds(meter.phase_peaks),
        params_bytes=sum(p.numel() * p.element_size() for p in model.parameters()), grad_bytes=0,
        optimizer_state_bytes=0, activation_bytes_end_of_forward=0, peak_phase=meter.peak_label,
        phase_peaks=dict(meter.phase_peaks))
    result.runner = {"library": "transformers", "version": transformers.__version__,
                     "entry": "GenerationMixin.generate" if new else "PreTrainedModel.forward (inference_mode)"}
    if trace:
        from .trace import Trace

        result.trace = Trace.from_meter(meter)
    return result


__all__ = ["measure_inference"]
