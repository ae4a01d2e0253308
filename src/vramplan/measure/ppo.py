"""A real PPO step, as TRL's PPOTrainer (trl/trainer/ppo_trainer.py, TRL 0.12 - 0.2x, the
PolicyAndValueWrapper trainer) runs it, under the exact CPU meter.

    from vramplan.measure.ppo import measure_ppo
    result = measure_ppo({"task": "ppo", "model": {...HF config...}, "reward_model": {...},
                          "micro_batch_size": 4, "seq_len": 16, "max_new_tokens": 16, ...})

Models: the policy (causal LM) and the value model (sequence classification, one label: a
backbone plus ``score``) trained by one optimizer (TRL prepares ``PolicyAndValueWrapper``
and its parameters together); the reference (causal LM, ``reference_model`` or the policy's
architecture) and the reward model (sequence classification) frozen.
One update with ``local_rollout_forward_batch_size = per_device_train_batch_size =
micro_batch_size``, one PPO epoch, one mini-batch, one micro-batch. What runs, in order:

* rollout, all under ``torch.no_grad()``:
  ``batch_generation`` -> ``generate``: ``policy.generate(..., return_dict_in_generate=True,
  output_scores=True)`` with ``GenerationConfig(max_new_tokens=response_length,
  temperature=0.7 + 1e-7, top_k=0, top_p=1.0, do_sample=True)``; ``logits =
  torch.stack(output.scores, 1)`` (the processed fp32 scores, rows x C x v), the
  query_response ``torch.cat``; ``pad`` of the one-chunk lists (copies). No EOS: every row
  runs to ``max_new_tokens``. Phase ``gen``.
  ``logprob = selective_log_softmax(logits, response)``; the reference through trl's
  ``forward`` (``output_hidden_states=True``), ``ref_logits = logits[:, P - 1:-1]``,
  ``ref_logits /= temperature + 1e-7`` (in place, on the view), ``selective_log_softmax``.
  Phase ``ref``. ``logitss`` is never deleted by the trainer: it stays alive to the end of
  the update.
  ``get_reward(value_model)``: the backbone with ``output_hidden_states=True,
  use_cache=False``, ``score(hidden_states[-1])``. Phase ``value``. ``get_reward(reward_model)``.
  Phase ``reward``. Then rewards (the k1 KL times ``kl_coef``, the score on the last
  token), GAE advantages and returns, ``masked_whiten``.
* training: ``forward(model, ...)`` = ``PolicyAndValueWrapper.forward``: the critic backbone
  (``output_hidden_states=True``), ``value_model.score(hidden_states[-1])``, then the
  policy; ``logits = output.logits[:, P - 1:-1]; logits /= temperature + 1e-7``;
  ``selective_log_softmax``; the clipped value loss and the clipped surrogate. Phase
  ``fwd``. ``backward`` (``bwd``), ``optimizer.step(); optimizer.zero_grad()`` (``opt``),
  then under no_grad the statistics: ``softmax(logits)`` and the entropy (``stats``).
"""
from __future__ import annotations

import torch

from vramplan.spec.grpo import GRPO_MAX_COMPLETION

from . import MeasureResult
from .build import build_model, build_optimizer, hf_config_dict
from .jobs import _build_frozen, _build_trained, _live_tensors, _model_job
from .meter import MemoryMeter
from .result import metered_result
from .rl import _selective_log_softmax
from .run import unique_bytes

PHASES = {"gen": "generation", "ref": "forward", "value": "forward", "reward": "forward",
          "fwd": "forward", "bwd": "backward", "opt": "optimizer", "stats": "optimizer"}
TEMPERATURE, KL_COEF, CLIPRANGE, CLIPRANGE_VALUE, VF_COEF, GAMMA, LAM = 0.7, 0.05, 0.2, 0.2, 0.1, 1.0, 0.95
"""trl PPOConfig defaults (temperature, kl_coef, cliprange, cliprange_value, vf_coef, gamma, lam)."""


def _forward(model, query_responses, pad_token_id: int, **kw):
    """trl.trainer.utils.forward."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 return_dict=True, output_hidden_states=True, **kw)


def _get_reward(model, query_responses, pad_token_id: int, context_length: int):
    """trl.trainer.utils.get_reward: the backbone, ``score`` on the last hidden state."""
    backbone = getattr(model, model.base_model_prefix)
    output = _forward(backbone, query_responses, pad_token_id, use_cache=False)
    reward_logits = model.score(output.hidden_states[-1])
    seq_len = torch.full((query_responses.shape[0],), query_responses.shape[1] - 1, dtype=torch.long)
    return reward_logits, reward_logits[torch.arange(reward_logits.size(0)), seq_len].squeeze(-1)


class PolicyAndValueWrapper(torch.nn.Module):
    """trl/trainer/ppo_trainer.py PolicyAndValueWrapper."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy, self.value_model = policy, value_model
        self.critic_backbone = getattr(value_model, value_model.base_model_prefix)

    def forward(self, **kwargs):
        output = self.critic_backbone(**kwargs)
        logits = self.value_model.score(output.hidden_states[-1])
        return self.policy(**kwargs), logits


def _masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def _masked_whiten(values, mask):
    mean = _masked_mean(values, mask)
    var = _masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + 1e-8)  # shift_mean=True: the mean is not added back


def measure_ppo(job: dict, steps: int = 2, trace: bool = False) -> MeasureResult:
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    job.setdefault("precision", "fp32")
    torch.manual_seed(0)
    policy, _, dtype = _build_trained(job)
    # a catalog name, hub id or path as well as an inline config (dict("gpt2") was a ValueError)
    critic_cfg = dict(hf_config_dict(job.get("critic_model") or job["model"])) | {"num_labels": 1}
    critic = build_model(_model_job(job, critic_cfg, "sequence-classification"), "cpu", dtype)
    critic.train()
    model = PolicyAndValueWrapper(policy, critic)
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    ref = _build_frozen(job, job.get("reference_model") or job["model"], dtype)
    reward_cfg = dict(hf_config_dict(job.get("reward_model") or job["model"])) | {"num_labels": 1}
    reward = build_model(_model_job(job, reward_cfg, "sequence-classification"), "cpu", dtype)
    reward.eval()
    reward.requires_grad_(False)
    rows, prompt_len, new = int(job.get("micro_batch_size", 4)), int(job.get("seq_len", 64)), int(job.get("max_new_tokens") or GRPO_MAX_COMPLETION)
    vocab, pad = int(policy.config.vocab_size), 0
    sls = _selective_log_softmax()
    meter = MemoryMeter(trace=trace)
    meter.register(model.parameters(), "parameter")
    meter.register(model.buffers(), "buffer")
    for frozen in (ref, reward):
        meter.register(frozen.parameters(), "frozen_parameter")
        meter.register(frozen.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    from transformers import GenerationConfig
    gen_cfg = GenerationConfig(max_new_tokens=new, temperature=TEMPERATURE + 1e-7, top_k=0, top_p=1.0,
                               do_sample=True, pad_token_id=pad, eos_token_id=None, bos_token_id=None,
                               use_cache=True)
    g = torch.Generator().manual_seed(0)
    grads = 0
    logitss = None
    with meter:
        queries = torch.randint(1, vocab, (rows, prompt_len), generator=g)
        meter.register([queries], "batch")
        ctx = prompt_len
        for step in range(1, steps + 1):
            with torch.no_grad():
                with meter.phase(f"s{step}.gen"):
                    # batch_generation -> generate (one chunk of local_rollout_forward_batch_size)
                    attention_mask = queries != pad
                    input_ids = torch.masked_fill(queries, ~attention_mask, 0)
                    output = policy.generate(input_ids=input_ids, attention_mask=attention_mask,
                                             generation_config=gen_cfg, return_dict_in_generate=True,
                                             output_scores=True)
                    logits = torch.stack(output.scores, 1)
                    query_response = torch.cat((queries, output.sequences[:, ctx:]), dim=1)
                    del output, attention_mask, input_ids
                    # trl.trainer.utils.pad of the one-element lists: new tensors
                    query_responses = torch.zeros_like(query_response).copy_(query_response)
                    logitss = torch.zeros_like(logits).copy_(logits)
                    del query_response, logits
                with meter.phase(f"s{step}.ref"):
                    response = query_responses[:, ctx:]
                    logprob = sls(logitss, response)
                    ref_output = _forward(ref, query_responses, pad)
                    ref_logits = ref_output.logits[:, ctx - 1:-1]
                    ref_logits /= TEMPERATURE + 1e-7
                    ref_logprob = sls(ref_logits, response)
                    del ref_output, ref_logits
                with meter.phase(f"s{step}.value"):
                    full_value, _ = _get_reward(critic, query_responses, pad, ctx)
                    values = full_value[:, ctx - 1:-1].squeeze(-1)
                    del full_value
                with meter.phase(f"s{step}.reward"):
                    _, scores = _get_reward(reward, query_responses, pad, ctx)
                responses, logprobs, ref_logprobs = response, logprob, ref_logprob
                del response, logprob, ref_logprob
                padding_mask = torch.zeros_like(responses, dtype=torch.bool)
                padding_mask_p1 = torch.zeros_like(responses, dtype=torch.bool)
                kl = logprobs - ref_logprobs
                non_score_reward = -KL_COEF * kl
                rewards = non_score_reward.clone()
                rewards[:, -1] += scores
                lastgaelam, rev = 0, []
                for t in reversed(range(new)):
                    nextvalues = values[:, t + 1] if t < new - 1 else 0.0
                    delta = rewards[:, t] + GAMMA * nextvalues - values[:, t]
                    lastgaelam = delta + GAMMA * LAM * lastgaelam
                    rev.append(lastgaelam)
                advantages = torch.stack(rev[::-1], axis=1)
                del rev, lastgaelam, delta, nextvalues
                returns = advantages + values
                advantages = _masked_whiten(advantages, ~padding_mask)
                advantages = torch.masked_fill(advantages, padding_mask, 0)
            with meter.phase(f"s{step}.fwd"):
                output, vpred_temp = _forward(model, query_responses, pad)
                logits = output.logits[:, ctx - 1:-1]
                logits /= TEMPERATURE + 1e-7
                new_logprobs = sls(logits, responses)
                new_logprobs = torch.masked_fill(new_logprobs, padding_mask, -1.0)
                vpred = vpred_temp[:, ctx - 1:-1].squeeze(-1)
                vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
                vpredclipped = torch.clamp(vpred, values - CLIPRANGE_VALUE, values + CLIPRANGE_VALUE)
                vf_losses1 = torch.square(vpred - returns)
                vf_losses2 = torch.square(vpredclipped - returns)
                vf_loss = 0.5 * _masked_mean(torch.max(vf_losses1, vf_losses2), ~padding_mask_p1)
                logprobs_diff = new_logprobs - logprobs
                ratio = torch.exp(logprobs_diff)
                pg_losses = -advantages * ratio
                pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - CLIPRANGE, 1.0 + CLIPRANGE)
                pg_loss = _masked_mean(torch.max(pg_losses, pg_losses2), ~padding_mask)
                loss = pg_loss + VF_COEF * vf_loss
            with meter.phase(f"s{step}.bwd"):
                loss.backward()
            grads = unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            with meter.phase(f"s{step}.opt"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            with meter.phase(f"s{step}.stats"), torch.no_grad():
                prob_dist = torch.nn.functional.softmax(logits, dim=-1)
                entropy = torch.logsumexp(logits, dim=-1) - torch.sum(prob_dist * logits, dim=-1)
                approxkl = 0.5 * (logprobs_diff ** 2).mean()
            del (output, vpred_temp, logits, new_logprobs, vpred, vpredclipped, vf_losses1, vf_losses2, vf_loss,
                 logprobs_diff, ratio, pg_losses, pg_losses2, pg_loss, loss, prob_dist, entropy, approxkl)
            del kl, non_score_reward, scores
            del (query_responses, responses, logprobs, ref_logprobs, values, padding_mask, padding_mask_p1,
                 rewards, advantages, returns)
            # `logitss` is rebound by the next update's batch_generation, as in the trainer
    return metered_result(meter, model, opt, grads, PHASES, trace=trace,
                          phase_names=("generation", "forward", "backward", "optimizer"))


__all__ = ["measure_ppo", "PolicyAndValueWrapper"]
