"""Online RL: GRPO (policy + frozen reference, num_generations completions per prompt),
RLOO (GRPO's step as trl/trainer/rloo_trainer.py runs it) and PPO (actor and critic
trained, reference and reward frozen).

What is alive when (trl/trainer/grpo_trainer.py, `_generate_and_score_completions` then
`compute_loss`; trl/trainer/ppo_trainer.py `train`, TRL 0.x):
1. Generation, under torch.no_grad() with the trained model itself
   (`unwrapped_model.generate`, gradient checkpointing disabled around it by
   trl.models.utils.disable_gradient_checkpointing so the cache is used): the step's
   weights and optimizer states are alive, the gradients are not
   (zero_grad(set_to_none=True) ran). transformers' DynamicCache holds a key and a value
   (rows, k, S, d) per layer, grown by torch.cat; the cache peaks at P + C - 1 positions
   (the last sampled token is not fed back). With a colocated vLLM engine
   (`vllm_mode="colocate"`) the engine instead holds `vllm_gpu_memory_utilization` of the
   GPU for the whole job (weights and a pre-allocated paged KV cache), outside PyTorch's
   allocator.
2. Reference (and PPO: critic, reward) forwards under no_grad on the generated rows:
   TRL 0.x `_get_per_token_logps`: logits for the completion positions plus one,
   `selective_log_softmax` (trl/trainer/utils.py) row by row (bf16) or gather + per-row
   logsumexp (fp32); temperature 1.0 (the default) makes no scaled copy. TRL 1.x's fused
   chunked head (`add_fused_lm_head`, logprob_head chunked, auto for GRPO): jobs/logprob.py;
   the releases between, 0.16 to 1.14: jobs/grpo_head.py.
3. The policy's training forward on prompt + completion (the core's plan with seq_len =
   prompt + completion) and the same log-prob head with gradients; then backward and the
   optimizer step. PPO's PolicyAndValueWrapper runs the critic backbone then the policy
   in one graph: the critic's activations stay alive through the policy's backward.
RLOO (TRL 0.22 on, GRPOTrainer's layout): `_generate_and_score_completions` always scores
the policy's own old log-probs under no_grad after generation (GRPO only with
num_iterations > 1), then the reference's when beta != 0 (RLOOConfig's default 0.05: a
reference by default), and hands the loss per-sequence sums (`old_logps`, fp32) instead of
per-token log-probs; its KL is a reward term, its loss per sequence.
GRPO measured against vramplan.measure.rl (bench/jobs: every phase within 0.5%); PPO
against vramplan.measure.ppo (TRL PPOTrainer's update; every phase within 1%).
Legend: r rows (completions per micro-step), P prompt length, C completion length,
S = P + C, L layers, k KV heads, d head_dim, v vocabulary, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.i18n import Msg
from vramplan.jobs.compose import Step, finish, merge_trained
from vramplan.jobs.frozen import frozen_weights, layer_working_set, no_grad_forward_peak
from vramplan.components.dtypes import dtypes_of
from vramplan.jobs.logprob import chunked_head, head_note, resolve_head
from vramplan.jobs.grpo_head import grpo_head
from vramplan.jobs.selective import completion_logps_head, completion_logps_loss
from vramplan.jobs.trained import compute_dtype, prefixed, score_loss, trained_plan, trainer_logits_dtype
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, LogprobHead, Method, Task
from vramplan.spec.grpo import GRPO_BETA_ZERO_SINCE, GRPO_MAX_COMPLETION, GROUP_TASKS, default_generations
from vramplan.spec.tasks import PRECOMPUTED
from vramplan.timeline import StepPlan
from vramplan.units import nbytes



def kv_cache(desc: ModelDesc, rows: int, length: int, c: str) -> Breakdown:
    """transformers DynamicCache (cache_utils.py DynamicLayer.update: `torch.cat` of the
    new key/value onto the old per layer): a key and a value (rows, k, length, d) in c
    per layer."""
    per = nbytes(rows * desc.num_kv_heads * length * desc.head_dim, c)
    return Breakdown().add("generation/kv_cache", 2 * desc.num_layers * per)


TOP_K_ZERO_SINCE = (0, 27)
"""GRPOConfig.top_k (RLOOConfig's too) defaults to 0 (no top-k: transformers adds
TopKLogitsWarper only for a top_k neither None nor 0, generation/utils.py
`_get_logits_processor`) from TRL 0.27 (read from 0.26.2 and 0.27.2); before, None, which
leaves transformers' GenerationConfig default of 50 in force (a TopKLogitsWarper while
sampling)."""


def sampling_temporaries(rows: int, v: int, c: str, top_k: bool = False) -> Breakdown:
    """One sampling step of transformers GenerationMixin._sample: the model's last-position
    logits (rows, 1, v) in c (`outputs` is alive until `del outputs`), their fp32 copy
    `outputs.logits[:, -1].to(copy=True, dtype=torch.float32)`, `softmax` probabilities
    (fp32), and torch.multinomial's fp32 working copy of them (the second aten._to_copy
    the meter sees). TRL's GenerationConfig adds no logits processor at temperature 1.0,
    top_k 0, top_p 1.0. `top_k`: transformers' TopKLogitsWarper (generation/logits_process.py)
    adds its bool mask `scores < topk(...)[..., -1, None]` and the `masked_fill` output in
    fp32 (measured with TRL 0.19.1's GRPOTrainer on CPU)."""
    out = (Breakdown().add("generation/next_token_logits", nbytes(rows * v, c))
           .add("generation/next_token_fp32", 3 * nbytes(rows * v, "fp32")))
    if top_k:
        out.add("generation/top_k_mask", nbytes(rows * v, "bool")).add(
            "generation/top_k_filled", nbytes(rows * v, "fp32"))
    return out


def generation_peak(desc: ModelDesc, rows: int, prompt: int, new: int, c: str, top_k: bool = False) -> Breakdown:
    """The larger of the prefill (the prompts' KV plus one no_grad layer over them) and the
    last decoding forward. The last sampled token is never fed back, so the cache peaks at
    prompt + new - 1 positions; at that step either one layer's torch.cat holds its old K
    (or V) beside the new one, or the sampling temporaries are alive, whichever is larger.
    The growing `input_ids` is cat'ed too (old and new int64 rows x length)."""
    v, s = desc.vocab_size, prompt + new - 1
    ids = Breakdown().add("generation/input_ids", 2 * nbytes(rows * s, "int64"))
    sample = sampling_temporaries(rows, v, c, top_k)
    layer = layer_working_set(desc, rows, prompt, c)
    prefill = kv_cache(desc, rows, prompt, c).merge(layer if layer.total() > sample.total() else sample)
    copy = Breakdown().add("generation/kv_cat_copy", nbytes(rows * desc.num_kv_heads * (s - 1) * desc.head_dim, c))
    last = kv_cache(desc, rows, s, c).merge(ids).merge(sample if sample.total() > copy.total() else copy)
    return prefill if prefill.total() > last.total() else last


def _one_label(model) -> ModelDesc:
    from vramplan.jobs import _desc
    return _desc(model, 1)


def zero3_generation_gather(desc: ModelDesc, spec: JobSpec, sharded_weights: int) -> int:
    """Bytes a rank adds when TRL gathers the ZeRO-3 policy for generation
    (trl/models/utils.py `_unwrap_model_for_generation`: `deepspeed.zero.GatheredParameters(
    model.parameters())` around `generate`, unless `ds3_gather_for_generation` is false):
    every parameter's full 16-bit tensor beside the rank's partition, which stays. Adapters
    are not in the base's parameter list and are a rounding error beside it."""
    if spec.task not in GROUP_TASKS or spec.parallel.zero_stage != 3 or spec.num_gpus < 2:
        return 0
    if spec.generation is not None and not spec.generation.ds3_gather_for_generation:
        return 0
    full = frozen_weights(desc, dtypes_of(spec).weights).total()
    return max(0, full - sharded_weights)


def rl_estimate(descs: dict[str, ModelDesc], spec: JobSpec, gpu=None):
    desc = descs["policy"]
    ppo = spec.task is Task.PPO
    rows, prompt = spec.micro_batch_size, spec.seq_len
    new = spec.max_new_tokens or GRPO_MAX_COMPLETION
    rloo = spec.task is Task.RLOO
    gens = spec.num_generations or (1 if ppo else default_generations(spec.task))
    total_len, c, v = prompt + new, compute_dtype(spec), desc.vocab_size
    gen_rows = (spec.generation.generation_batch_size if spec.generation and spec.generation.generation_batch_size
                else rows * spec.grad_accum_steps)
    notes = [f"{gens} completions per prompt; {gen_rows} generated per generation batch, "
             f"{rows} trained per micro-step; completion length {new}"]
    release = spec.stack.minor("trl")
    if spec.task is Task.GRPO and spec.reference_model is None and (release is None or
                                                                   release >= GRPO_BETA_ZERO_SINCE):
        # (the reference's weights, or a LoRA policy's adapter-disabled pass, and its forward)
        notes.append(Msg("a reference is counted (GRPOConfig beta > 0); TRL's default beta is 0.0 from 0.19, "
                         "which loads and runs none: set reference_model precomputed for that"))
    actor = "actor" if ppo else "policy"
    # TRL 1.x GRPO (grpo_trainer.py `_get_per_token_logps_and_entropies`): the fused chunked
    # head over prompt + completion with the prompt's labels at -100 (all S - 1 positions
    # scored off Triton), outputs ("log_probs", "entropy") for the policy, log_probs only
    # for the reference. Otherwise TRL 0.x's selective_log_softmax head (below).
    chunked = not ppo and resolve_head(spec) is LogprobHead.CHUNKED  # full: modelled as selective
    # GRPOTrainer's own head of TRL 0.16 to 1.14, by release (jobs/grpo_head.py)
    own = None
    if not ppo and spec.logprob_head is LogprobHead.AUTO and resolve_head(spec) is LogprobHead.SELECTIVE:
        # (RLOOTrainer's of 0.22 to 1.14 is the same head, jobs/logprob.py RLOO_GROUP_SINCE)
        own = grpo_head(spec, rows, new, v)
    if chunked or own:
        notes.append(head_note(spec))
    softcap = bool(desc.final_logit_softcapping)
    loss = (chunked_head(spec, rows, total_len, desc.hidden_size, v, entropy=True, softcap=softcap) if chunked
            else own.terms if own else completion_logps_loss(rows, new, v, c, total_len if ppo else None))
    trained = trained_plan(desc, spec, rows, loss, seq_len=total_len)
    plan = prefixed(trained.plan, actor)
    total, trainable = {actor: desc.num_params()}, trained.params.numel(trainable=True)
    if ppo:
        # No critic_model: TRL's value model is AutoModelForSequenceClassification with
        # num_labels=1 from the policy's checkpoint (a backbone plus `score`, no LM head).
        critic_desc = descs.get("critic") or _one_label(spec.model)
        critic = trained_plan(critic_desc, spec, rows, score_loss(rows, total_len, critic_desc.hidden_size, c),
                              seq_len=total_len)
        merge_trained(plan, prefixed(critic.plan, "critic"), "critic")
        # trl ppo_trainer.py: the training forward's `output` (and `logits`, its view) are
        # deleted only after `optimizer.step(); optimizer.zero_grad()` and the no_grad stats:
        # the policy's full (rows, S, v) logits are alive at the optimizer step.
        kept = Breakdown().add(f"{actor}/logits/output_kept", nbytes(rows * total_len * v, c))
        plan.optimizer_temporaries.merge(kept)
        # ... and through every layer's backward (the loss backward counts them as saved).
        for extra in plan.stage_backward_transient:
            extra.merge(kept)
        total["critic"] = critic_desc.num_params()
        trainable += critic.params.numel(trainable=True)
    step = Step(plan, before_gradients=True)  # generation and scoring, at the cycle's first micro-step
    # What _generate_and_score_completions hands the loss: prompt + completion ids and their
    # attention mask, the completion mask (int64), the reference's per-token log-probs (in
    # c: selective_log_softmax returns the logits' dtype), the advantages (fp32). RLOO hands
    # the old log-probs summed per sequence instead (`old_logps`, fp32, rloo_trainer.py).
    step.plan.static.add("batch/prompt_completion_ids", nbytes(gen_rows * total_len, "int64"))
    step.plan.static.add("batch/attention_mask", nbytes(gen_rows * total_len, "int64"))
    step.plan.static.add("batch/completion_mask", nbytes(gen_rows * new, "int64"))
    if rloo:
        step.plan.static.add("batch/old_logps", nbytes(gen_rows, "fp32"))
    else:
        logps_dtype = "fp32" if chunked else trainer_logits_dtype(spec) if own else c
        step.plan.static.add("batch/ref_per_token_logps", nbytes(gen_rows * new, logps_dtype))
    step.plan.static.add("batch/advantages", nbytes(gen_rows, "fp32"))
    if ppo:
        # trl ppo_trainer.py `generate`: `lm_backbone.generate(..., return_dict_in_generate=True,
        # output_scores=True)`, `logits = torch.stack(output.scores, 1)`: the processed fp32
        # scores (transformers casts the last-position logits to fp32), one (rows, v) per new
        # token. `batch_generation` returns them as `logitss`, which the trainer never deletes:
        # alive from the rollout to the end of the update.
        step.plan.static.add("batch/rollout_scores", nbytes(gen_rows * new * v, "fp32"))
    floor = Breakdown()
    if spec.generation and spec.generation.engine == "vllm":
        if gpu is None:
            notes.append(Msg("generation.engine vllm: name a gpu to count the engine's reserved fraction"))
        else:
            floor.add("generation/vllm_engine", int(spec.generation.gpu_memory_utilization * gpu.memory_bytes))
    else:
        top_k = not ppo and release is not None and release < TOP_K_ZERO_SINCE
        gen = generation_peak(desc, gen_rows, prompt, new, c, top_k)
        gathered = zero3_generation_gather(desc, spec, step.plan.static.total(f"{actor}/weights/"))
        if gathered:
            gen.add("generation/zero3_gathered_weights", gathered)
            notes.append(Msg("ZeRO-3: the whole policy is gathered for generation "
                             "(TRL ds3_gather_for_generation=True; set it false to generate layer by layer)"))
        step.before.append(("generation", f"generation ({gen_rows} rows, KV cache to {total_len} tokens)",
                            Breakdown().merge(gen, prefix=f"{actor}/")))
        if ppo:
            # trl ppo_trainer.py `generate`: `torch.stack(output.scores, 1)` while `output`
            # (return_dict_in_generate) still holds the per-token scores (C x (rows, v) fp32,
            # TemperatureLogitsWarper's outputs), the sequences and past_key_values (the cache
            # at P + C - 1 positions).
            stack = (kv_cache(desc, gen_rows, total_len - 1, c)
                     .add("generation/sequences", nbytes(gen_rows * total_len, "int64"))
                     .add("generation/output_scores", nbytes(gen_rows * new * v, "fp32"))
                     .add("generation/scores_stacked", nbytes(gen_rows * new * v, "fp32")))
            step.before.append(("generation", "generation scores stacked (output_scores)",
                                Breakdown().merge(stack, prefix=f"{actor}/")))
    def scoring(d: ModelDesc) -> Breakdown:
        """A no_grad log-prob forward of `d` over `rows` generated rows (the trainers score the
        generation batch in chunks of per_device_train_batch_size)."""
        if chunked:
            fused = chunked_head(spec, rows, total_len, d.hidden_size, d.vocab_size,
                                 softcap=bool(d.final_logit_softcapping))
            head = fused.frozen_peak(nbytes(rows * total_len * d.hidden_size, fused.hidden_dtype))
        elif own:
            head = own.reference
        else:
            head = completion_logps_head(rows, new, d.vocab_size, c)
        return no_grad_forward_peak(d, rows, total_len, c, head)

    if rloo:
        # rloo_trainer.py `_generate_and_score_completions`: `old_per_token_logps` of the
        # policy itself under no_grad (gradient checkpointing disabled), whatever beta
        step.before.append(("forward", "policy forward (no_grad old log-probs)",
                            Breakdown().merge(scoring(desc), prefix=f"{actor}/scoring/")))
    # Frozen models: the reference (or the LoRA policy with its adapter disabled), reward.
    ref = spec.reference_model
    if ref != PRECOMPUTED:
        shares_base = ref is None and spec.method in (Method.LORA, Method.QLORA)
        ref_desc = desc if shares_base else descs.get("reference", desc)
        if not shares_base:
            step.plan.static.merge(frozen_weights(ref_desc, dtypes_of(spec).weights), prefix="reference/")
            total["reference"] = ref_desc.num_params()
        step.before.append(("forward", "reference forward (no_grad log-probs)",
                            Breakdown().merge(scoring(ref_desc), prefix="reference/")))
    if "reward" in descs:
        rm = descs["reward"]
        step.plan.static.merge(frozen_weights(rm, dtypes_of(spec).weights), prefix="reward/")
        total["reward"] = rm.num_params()
        scores = Breakdown().add("head/scores", nbytes(rows * total_len, c))
        step.before.append(("forward", "reward model forward (no_grad)",
                            Breakdown().merge(no_grad_forward_peak(rm, rows, total_len, c, scores), prefix="reward/")))
    return finish(spec, desc, step, num_params=total, trainable_params=trainable, gpu=gpu, notes=notes,
                  floor=floor)
