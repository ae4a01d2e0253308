"""Online RL: GRPO (policy + frozen reference, num_generations completions per prompt)
and PPO (actor and critic trained, reference and reward frozen).

What is alive when (trl/trainer/grpo_trainer.py, `_generate_and_score_completions` then
`compute_loss`; trl/trainer/ppo_trainer.py `train`, TRL 0.x):
1. Generation, under torch.no_grad() with the trained model itself
   (`unwrapped_model.generate`): the step's weights and optimizer states are alive, the
   gradients are not (zero_grad(set_to_none=True) ran). transformers' DynamicCache holds a
   key and a value tensor (rows, k, S, d) per layer and grows each by torch.cat, so one
   layer's K or V exists twice at the last step; the prefill runs one no_grad forward over
   the prompts. With a colocated vLLM engine (`vllm_mode="colocate"`) the engine instead
   holds `vllm_gpu_memory_utilization` of the GPU for the whole job (weights and a
   pre-allocated paged KV cache), outside PyTorch's allocator.
2. Reference (and PPO: critic, reward) forwards under no_grad on the generated rows:
   `_get_per_token_logps`: logits for the completion positions plus one, divided by the
   temperature (a copy), `selective_log_softmax` row by row.
3. The policy's training forward on prompt + completion (the core's plan with seq_len =
   prompt + completion) and the same log-prob head with gradients; then backward and the
   optimizer step. PPO's PolicyAndValueWrapper runs the critic backbone then the policy
   in one graph: the critic's activations stay alive through the policy's backward.
Legend: r rows (completions per micro-step), P prompt length, C completion length,
S = P + C, L layers, k KV heads, d head_dim, v vocabulary, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.frozen import frozen_weights, layer_working_set, no_grad_forward_peak
from vramplan.jobs.trained import (
    LossTerms, compute_dtype, prefixed, score_loss, trained_plan,
)
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, Method, Task
from vramplan.spec.tasks import PRECOMPUTED
from vramplan.timeline import StepPlan
from vramplan.units import nbytes

GRPO_NUM_GENERATIONS = 8
"""trl GRPOConfig.num_generations default."""
GRPO_MAX_COMPLETION = 512
"""trl GRPOConfig.max_completion_length default."""


def kv_cache(desc: ModelDesc, rows: int, length: int, c: str) -> Breakdown:
    """transformers DynamicCache: per layer a key and a value (rows, k, length, d) in c;
    the last torch.cat holds one layer's K (or V) twice."""
    per = nbytes(rows * desc.num_kv_heads * length * desc.head_dim, c)
    return Breakdown().add("generation/kv_cache", 2 * desc.num_layers * per).add("generation/kv_cat_copy", per)


def generation_peak(desc: ModelDesc, rows: int, prompt: int, new: int, c: str) -> Breakdown:
    """The larger of the prefill (prompt KV plus one no_grad layer over the prompts) and the
    last decoding step (full KV, the fp32 next-token logits `logits[:, -1].float()`)."""
    prefill = kv_cache(desc, rows, prompt, c).merge(layer_working_set(desc, rows, prompt, c))
    last = kv_cache(desc, rows, prompt + new, c).add("generation/next_token_logits",
                                                     nbytes(rows * desc.vocab_size, "fp32"))
    return prefill if prefill.total() > last.total() else last


def completion_logps_head(rows: int, new: int, v: int, c: str) -> Breakdown:
    """_get_per_token_logps under no_grad: logits for C + 1 positions, their division by
    the temperature (C positions), one row's log_softmax in selective_log_softmax."""
    return (Breakdown().add("logits/logits", nbytes(rows * (new + 1) * v, c))
            .add("logits/scaled", nbytes(rows * new * v, c)).add("logits/row_log_softmax", nbytes(new * v, c)))


def completion_logps_loss(rows: int, new: int, v: int, c: str) -> LossTerms:
    """The same head with gradients: every row's log_softmax output is saved (c); backward
    makes the scaled logits' gradient, then SliceBackward's full-size zeros."""
    saved = Breakdown().add("logits/log_softmax", nbytes(rows * new * v, c))
    fwd = Breakdown().add("logits/logits", nbytes(rows * (new + 1) * v, c)).add("logits/scaled", nbytes(rows * new * v, c))
    start = Breakdown().add("logits/grad_log_softmax", nbytes(rows * new * v, c))
    head = (Breakdown().add("logits/grad_scaled", nbytes(rows * new * v, c))
            .add("logits/grad_logits", nbytes(rows * (new + 1) * v, c)))
    return LossTerms(saved, fwd, start, head)


def _with_critic(plan: StepPlan, critic: StepPlan) -> StepPlan:
    """PPO: the critic's graph is built first, so its backward runs after the policy's."""
    def total(parts):
        out = Breakdown()
        for p in parts:
            out.merge(p)
        return out
    plan.static.merge(critic.static)
    plan.stage_acts.insert(0, total(critic.stage_acts))
    plan.grads_by_stage.insert(0, total(critic.grads_by_stage))
    plan.stage_backward_transient.insert(0, critic.stage_backward_transient[-1])
    plan.labels.insert(0, "critic backward")
    plan.loss_saved.merge(critic.loss_saved)
    plan.optimizer_temporaries.merge(critic.optimizer_temporaries)
    return plan


def rl_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    desc = descs["policy"]
    ppo = spec.task is Task.PPO
    rows, prompt = spec.micro_batch_size, spec.seq_len
    new = spec.max_new_tokens or GRPO_MAX_COMPLETION
    gens = spec.num_generations or (1 if ppo else GRPO_NUM_GENERATIONS)
    total_len, c, v = prompt + new, compute_dtype(spec), desc.vocab_size
    gen_rows = (spec.generation.generation_batch_size if spec.generation and spec.generation.generation_batch_size
                else rows * spec.grad_accum_steps)
    notes = [f"{gens} completions per prompt; {gen_rows} generated per generation batch, "
             f"{rows} trained per micro-step; completion length {new}"]
    actor = "actor" if ppo else "policy"
    trained = trained_plan(desc, spec, rows, completion_logps_loss(rows, new, v, c), seq_len=total_len)
    plan = prefixed(trained.plan, actor)
    total, trainable = desc.num_params(), trained.params.numel(trainable=True)
    if ppo:
        critic_desc = descs.get("critic", desc)
        critic = trained_plan(critic_desc, spec, rows, score_loss(rows, total_len, critic_desc.hidden_size, c),
                              seq_len=total_len)
        plan = _with_critic(plan, prefixed(critic.plan, "critic"))
        total += critic_desc.num_params()
        trainable += critic.params.numel(trainable=True)
    step = Step(plan)
    step.plan.static.add("batch/prompt_completion_ids", nbytes(gen_rows * total_len, "int64"))
    step.plan.static.add("batch/completion_mask", nbytes(gen_rows * new, "int64"))
    step.plan.static.add("batch/ref_per_token_logps", nbytes(gen_rows * new, "fp32"))
    floor = Breakdown()
    if spec.generation and spec.generation.engine == "vllm":
        if gpu is None:
            notes.append("generation.engine vllm: name a gpu to count the engine's reserved fraction")
        else:
            floor.add("generation/vllm_engine", int(spec.generation.gpu_memory_utilization * gpu.memory_bytes))
    else:
        gen = generation_peak(desc, gen_rows, prompt, new, c)
        step.before.append(("generation", f"generation ({gen_rows} rows, KV cache to {total_len} tokens)",
                            Breakdown().merge(gen, prefix=f"{actor}/")))
    # Frozen models: the reference (or the LoRA policy with its adapter disabled), reward.
    ref = spec.reference_model
    if ref != PRECOMPUTED:
        shares_base = ref is None and spec.method in (Method.LORA, Method.QLORA)
        ref_desc = desc if shares_base else descs.get("reference", desc)
        if not shares_base:
            step.plan.static.merge(frozen_weights(ref_desc, spec.precision.weight_dtype), prefix="reference/")
            total += ref_desc.num_params()
        head = completion_logps_head(rows, new, ref_desc.vocab_size, c)
        peak = no_grad_forward_peak(ref_desc, rows, total_len, c, head)
        step.before.append(("forward", "reference forward (no_grad log-probs)",
                            Breakdown().merge(peak, prefix="reference/")))
    if "reward" in descs:
        rm = descs["reward"]
        step.plan.static.merge(frozen_weights(rm, spec.precision.weight_dtype), prefix="reward/")
        total += rm.num_params()
        scores = Breakdown().add("head/scores", nbytes(rows * total_len, c))
        step.before.append(("forward", "reward model forward (no_grad)",
                            Breakdown().merge(no_grad_forward_peak(rm, rows, total_len, c, scores), prefix="reward/")))
    return finish(spec, desc, step, num_params=total, trainable_params=trainable, gpu=gpu, notes=notes,
                  floor=floor)
