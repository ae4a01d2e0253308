"""GRPO's and RLOO's batch as TRL 1.16 takes it (trl/trainer/grpo_config.py GRPOConfig,
rloo_config.py RLOOConfig and transformers TrainingArguments): the defaults of a job that
names no batch, and the rule that the completions a step generates are whole groups of
num_generations (both configs' `__post_init__` check it the same way)."""
from __future__ import annotations

from vramplan.spec.enums import SpecError, Task

GRPO_NUM_GENERATIONS = 8
"""trl GRPOConfig.num_generations default (trl/trainer/grpo_config.py)."""
GRPO_MAX_COMPLETION = 512
"""trl GRPOConfig.max_completion_length default."""
GRPO_BETA_ZERO_SINCE = (0, 19)
"""GRPOConfig.beta defaults to 0.0 from TRL 0.19 (0.04 before; read from 0.18.2 and 0.19.1
grpo_config.py): at beta 0 GRPOTrainer builds no reference model and runs none."""
RLOO_NUM_GENERATIONS = 2
"""trl RLOOConfig.num_generations default (trl/trainer/rloo_config.py; its
max_completion_length defaults to 512 as GRPO's)."""
GROUP_TASKS = (Task.GRPO, Task.RLOO)
"""Tasks whose trainer generates num_generations completions per prompt and scores them as a group."""
TRAINER = {Task.GRPO: "GRPO", Task.RLOO: "RLOO"}
GRPO_MICRO_BATCH = 8
"""per_device_train_batch_size's default (transformers TrainingArguments, kept by GRPOConfig):
with num_generations 8, TRL's default job generates one whole group per GPU."""


def default_generations(task: Task) -> int:
    """num_generations of a spec that names none: the task's TRL config default."""
    return RLOO_NUM_GENERATIONS if task is Task.RLOO else GRPO_NUM_GENERATIONS


def default_micro_batch(task: Task) -> int:
    """micro_batch_size of a spec that gives none: TRL's per_device_train_batch_size under
    GRPO and RLOO, so that the default job is one TRL accepts (check_generation_batch); else 1."""
    return GRPO_MICRO_BATCH if task in GROUP_TASKS else 1


def check_generation_batch(spec) -> None:
    """TRL's GRPO and RLOO batch rules (trl/trainer/grpo_config.py GRPOConfig.__post_init__,
    rloo_config.py the same), on the
    spec's layout: the generation batch of all processes (per_device_train_batch_size x
    num_processes x steps_per_generation, steps_per_generation defaulting to
    gradient_accumulation_steps) holds whole prompt groups, so num_generations divides it;
    and a generation batch given explicitly is a whole number of training batches. Here a
    GPU generates `generation.generation_batch_size` rows, else micro_batch_size x
    grad_accum_steps, and the data-parallel GPUs are its processes."""
    if spec.task not in GROUP_TASKS:
        return
    mb, ga = spec.micro_batch_size, spec.grad_accum_steps
    dp = max(1, spec.num_gpus // spec.parallel.model_parallel)
    given = spec.generation.generation_batch_size if spec.generation is not None else None
    if given is not None and given % mb:
        raise SpecError("generation.generation_batch_size",
                        f"{given} is not a whole number of micro-batches of {mb}; TRL refuses it "
                        f"({TRAINER[spec.task]}Config: generation_batch_size divisible by the global batch); "
                        f"use a multiple of {mb}")
    per_gpu = given if given is not None else mb * ga
    rows, gens = per_gpu * dp, spec.num_generations or default_generations(spec.task)
    if rows % gens:
        what = (f"generation_batch_size {given}" if given is not None
                else f"micro_batch_size {mb} x grad_accum_steps {ga}")
        named = "num_generations" if spec.num_generations else "num_generations, TRL's default"
        head = (f"TRL's {TRAINER[spec.task]} generates whole groups of {gens} completions per prompt ({named}), "
                f"but a step generates {rows} ({what} x {dp} data-parallel GPUs)")
        if rows < 2:
            raise SpecError("num_generations", f"{head}; raise micro_batch_size or grad_accum_steps to generate "
                                               f"a multiple of {gens} per step")
        raise SpecError("num_generations", f"{head}; set num_generations to a divisor of {rows} (at least 2), or "
                                           f"raise micro_batch_size or grad_accum_steps to generate a multiple "
                                           f"of {gens} per step")


def batch_step(spec) -> int:
    """The step between the micro-batch sizes check_generation_batch accepts on this layout
    (their generation batches are whole groups): 1 outside GRPO and RLOO or with a generation batch
    given (which the micro-batch must divide instead)."""
    import math
    if spec.task not in GROUP_TASKS or (spec.generation is not None and spec.generation.generation_batch_size):
        return 1
    gens = spec.num_generations or default_generations(spec.task)
    dp = max(1, spec.num_gpus // spec.parallel.model_parallel)
    return gens // math.gcd(gens, spec.grad_accum_steps * dp)


__all__ = ["GRPO_BETA_ZERO_SINCE", "GRPO_MAX_COMPLETION", "GROUP_TASKS", "RLOO_NUM_GENERATIONS", "TRAINER", "batch_step", "GRPO_MICRO_BATCH",
           "GRPO_NUM_GENERATIONS", "check_generation_batch", "default_generations", "default_micro_batch"]
