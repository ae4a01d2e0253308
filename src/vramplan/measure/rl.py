"""A real GRPO step (generation with the KV cache, reference log-probs, policy loss,
backward, optimizer step) under the exact CPU meter.

    from vramplan.measure.rl import measure_grpo
    result = measure_grpo({"task": "grpo", "model": {...HF config...}, "micro_batch_size": 8,
                           "seq_len": 64, "num_generations": 4, "max_new_tokens": 128, ...})

What runs, in TRL's order (trl/trainer/grpo_trainer.py):

* ``_generate_single_turn`` (transformers path, ``use_vllm=False``): ``unwrapped_model.generate``
  under ``torch.no_grad()`` with the trained model itself; the step's weights and optimizer
  states are alive, the gradients are not (the previous ``optimizer.zero_grad`` set them to
  None). The generation batch holds ``micro_batch_size`` completions: ``micro_batch_size /
  num_generations`` prompts of ``seq_len`` tokens, each repeated ``num_generations`` times
  (TRL's RepeatSampler; here ``num_return_sequences``). Sampling as TRL's GenerationConfig
  sets it (do_sample, temperature 1.0, top_k 0, top_p 1.0); no EOS, so every row runs to
  ``max_new_tokens`` (the worst case the estimate describes).
* ``_generate_and_score_completions``: ``completion_mask`` and the attention mask over
  prompt + completion; the reference's per-token log-probs under ``torch.no_grad()``
  (``beta != 0``; a LoRA policy with no reference model runs with its adapter disabled,
  ``reference_model: precomputed`` skips it).
* ``_compute_loss`` (``loss_type="grpo"``): the policy's per-token log-probs with gradients,
  ``coef_1 = exp(logps - old_logps)`` with ``old_logps = logps.detach()`` (one iteration per
  generation), the clipped surrogate, the ``k3`` KL to the reference times ``beta`` (0.04),
  the per-sequence masked mean; backward; the optimizer step.

Per-token log-probs are the full-logits head of TRL 0.x ``_get_per_token_logps``
(``logits_to_keep = C + 1``, the last position dropped, ``selective_log_softmax`` from the
installed trl, temperature 1.0 so no scaled copy), not TRL 1.x's fused chunked head
(``add_fused_lm_head``), as measure/jobs.py does for DPO.
Phases: ``s{n}.gen`` (generation), ``s{n}.ref``, ``s{n}.fwd``, ``s{n}.bwd``, ``s{n}.opt``.
"""
from __future__ import annotations

import contextlib

import torch

from . import MeasureResult
from .jobs import _build_frozen, _build_trained, _live_tensors
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes

PHASES = {"gen": "generation", "ref": "forward", "fwd": "forward", "bwd": "backward", "opt": "optimizer"}
BETA, EPSILON = 0.04, 0.2
"""trl GRPOConfig beta (0.x default, KL to the reference on) and epsilon."""


def _selective_log_softmax():
    try:
        from trl.trainer.utils import selective_log_softmax
        return selective_log_softmax
    except Exception:  # pragma: no cover - trl absent: its fallback path, verbatim
        import torch.nn.functional as F

        def selective_log_softmax(logits, index):
            if logits.dtype in (torch.float32, torch.float64):
                selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
                lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
                return selected - lse
            return torch.stack([F.log_softmax(lg, dim=-1).gather(-1, ix.unsqueeze(-1)).squeeze(-1)
                                for lg, ix in zip(logits, index)])
        return selective_log_softmax


def per_token_logps(model, input_ids, attention_mask, logits_to_keep: int):
    """TRL 0.x ``_get_per_token_logps``: logits for the completion positions plus one, the
    last dropped, ``selective_log_softmax`` against the completion ids."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
    logits = logits[:, :-1, :]
    return _selective_log_softmax()(logits, input_ids[:, -logits_to_keep:])


@contextlib.contextmanager
def _no_checkpointing(model):
    """trl.models.utils.disable_gradient_checkpointing, which GRPOTrainer wraps around
    generation (unwrap_model_for_generation) and the no_grad log-prob forwards: without it
    transformers drops the KV cache under checkpointing."""
    was = bool(model.is_activation_checkpointing)
    if was:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if was:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _reference(job: dict, dtype):
    ref = job.get("reference_model")
    if ref == "precomputed":
        return None, False
    if ref is None and job.get("method", "full") == "lora":
        return None, True
    return _build_frozen(job, ref or job["model"], dtype), False


def measure_grpo(job: dict, steps: int = 2, trace: bool = False) -> MeasureResult:
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    job.setdefault("precision", "fp32")
    torch.manual_seed(0)
    model, opt, dtype = _build_trained(job)
    ref, adapter_off = _reference(job, dtype)
    rows, prompt_len = int(job.get("micro_batch_size", 8)), int(job.get("seq_len", 64))
    gens, new = int(job.get("num_generations") or 8), int(job.get("max_new_tokens") or 512)
    if rows % gens:
        raise ValueError("micro_batch_size must be a multiple of num_generations (TRL's rule)")
    vocab = int(model.config.vocab_size)
    meter = MemoryMeter(trace=trace)
    meter.register(model.parameters(), "parameter")
    meter.register(model.buffers(), "buffer")
    if ref is not None:
        meter.register(ref.parameters(), "frozen_parameter")
        meter.register(ref.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    from transformers import GenerationConfig
    gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, pad_token_id=0, eos_token_id=None, bos_token_id=None,
                               num_return_sequences=gens, use_cache=True)
    g = torch.Generator().manual_seed(0)
    grads = 0
    with meter:
        prompts = torch.randint(1, vocab, (rows // gens, prompt_len), generator=g)
        prompt_mask = torch.ones_like(prompts)
        meter.register([prompts, prompt_mask], "batch")
        for step in range(1, steps + 1):
            with meter.phase(f"s{step}.gen"), torch.no_grad(), _no_checkpointing(model):
                ids = model.generate(input_ids=prompts, attention_mask=prompt_mask, generation_config=gen_cfg)
            completion_ids = ids[:, prompt_len:]
            completion_mask = torch.ones_like(completion_ids)
            attention_mask = torch.cat([prompt_mask.repeat_interleave(gens, 0), completion_mask], dim=1)
            with meter.phase(f"s{step}.ref"):
                if ref is None and not adapter_off:
                    ref_logps = torch.zeros(rows, new)
                else:
                    ctx = model.disable_adapter() if adapter_off else contextlib.nullcontext()
                    with torch.no_grad(), ctx, _no_checkpointing(model):
                        ref_logps = per_token_logps(ref or model, ids, attention_mask, new)
            advantages = torch.randn(rows, generator=g)
            with meter.phase(f"s{step}.fwd"):
                logps = per_token_logps(model, ids, attention_mask, new)
                coef_1 = torch.exp(logps - logps.detach())
                coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
                loss1, loss2 = coef_1 * advantages.unsqueeze(1), coef_2 * advantages.unsqueeze(1)
                per_token_loss = -torch.min(loss1, loss2)
                kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
                per_token_loss = per_token_loss + BETA * kl
                loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
                del logps, coef_1, coef_2, loss1, loss2, per_token_loss, kl
            with meter.phase(f"s{step}.bwd"):
                loss.backward()
            grads = unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            with meter.phase(f"s{step}.opt"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss, ids, completion_ids, completion_mask, attention_mask, ref_logps, advantages
    return metered_result(meter, model, opt, grads, PHASES, trace=trace,
                          phase_names=("generation", "forward", "backward", "optimizer"))


__all__ = ["measure_grpo", "per_token_logps"]
