"""Which runner measures a job on CPU, and the `runner` record naming it.

Library trainers first (measure/trainers.py: TRL's DPOTrainer, KTOTrainer, RewardTrainer,
GRPOTrainer; measure/trl_experimental.py: GKDTrainer for distill, ORPOTrainer, CPOTrainer for
SimPO) and diffusers' example LoRA scripts (measure/diffusers_step.py); single-model jobs
through measure/run.py (a transformers model in a plain loop
in HF Trainer's order, the semantics of the committed CPU references); the hand-written
multi-model steps only where no library trainer runs here, each named with a note.
"""
from __future__ import annotations

from typing import Any

from . import MeasureResult

HAND_WRITTEN = {
    "distill": ("jobs", "measure_job", "TRL 0.x GKDTrainer's step written out (full logits); install "
                                       "trl to run trl.experimental.gkd.GKDTrainer"),
    "ppo": ("ppo", "measure_ppo", "TRL 0.x PPOTrainer's step written out (TRL 1.16 ships no PPOTrainer, "
                                  "neither in trl nor in trl.experimental)"),
    "grpo": ("rl", "measure_grpo", "TRL 0.x GRPO step written out (selective_log_softmax head); "
                                   "install trl to run GRPOTrainer"),
    "dpo": ("jobs", "measure_job", "TRL 0.x DPO step written out (full-logits get_batch_logps head)"),
    "ipo": ("jobs", "measure_job", "TRL 0.x DPO step written out (full-logits get_batch_logps head)"),
    "reward-model": ("jobs", "measure_job", "TRL RewardTrainer's loss written out; install trl to run it"),
    "diffusion": ("diffusion", "measure_diffusion", "diffusers example training step written out"),
}


def _vramplan_runner(entry: str, note: str) -> dict:
    from vramplan import __version__

    return {"library": "vramplan", "version": __version__, "entry": entry, "note": note}


def loop_runner(job: dict | None = None) -> dict:
    """The runner record of measure/run.py's single-model loop (a repository-code family's
    written-here stand-in named as such: measure/standin_remote.py)."""
    import transformers

    if job is not None:
        from .build import hf_config_dict
        from .standin_remote import STANDINS
        model_type = hf_config_dict(job["model"]).get("model_type")
        if model_type in STANDINS:
            return _vramplan_runner(f"vramplan.measure.standin_remote ({model_type})",
                                    "a stand-in of the repository's modules written from its modeling file "
                                    "(never its code), in measure/run.py's plain loop")

    return {"library": "transformers", "version": transformers.__version__,
            "entry": "PreTrainedModel.forward + loss.backward + torch.optim step",
            "note": "a plain loop in HF Trainer's order (measure/run.py); "
                    "measure.trainers runs transformers.Trainer itself"}


def _hand_written(job: dict, trace: bool, steps: int) -> MeasureResult:
    import importlib

    if job.get("vision"):
        module, fn, note = "vlm", "measure_vlm", ("vision-language step written out around the model's own transformers "
                                               "class (LLaVA, Qwen2-VL, Qwen2.5-VL, InternVL; no library trainer)")
    elif job.get("models"):
        module, fn, note = "generic", "measure_generic", "generic multi-model step written out"
    else:
        module, fn, note = HAND_WRITTEN[job["task"]]
    result = getattr(importlib.import_module(f"vramplan.measure.{module}"), fn)(job, steps=steps, trace=trace)
    result.runner = _vramplan_runner(f"vramplan.measure.{module}.{fn}", note)
    return result


def _library_ok(job: dict) -> bool:
    from .trainers import TRL_TASKS, runs_library, trl_sft

    # label smoothing is the HF Trainer's LabelSmoother (trainer.py `compute_loss` pops the labels
    # and smooths the model's logits), which measure/run.py's loop does not run: the Trainer itself
    smoothed = job["task"] == "sft" and float(job.get("label_smoothing") or 0.0) > 0
    if (job["task"] not in TRL_TASKS and not trl_sft(job) and not smoothed) or job.get("vision") or job.get("models"):
        return False
    # reference_model precomputed: the builders set TRL's precompute_ref_log_probs (DPO, KTO;
    # GRPO's beta 0), which scores the dataset in the trainer's __init__, before the metered steps
    if job.get("logprob_head") == "full" and job["task"] in ("dpo", "ipo", "distill"):
        return False  # TRL 0.x's full-logits step: TRL 1.16 runs none; the written-out step does
    return runs_library("dpo" if trl_sft(job) else job["task"])  # SFTTrainer: whether trl is there


def _diffusers_script(job: dict) -> bool:
    """A LoRA job of `stack: diffusers-scripts` on a denoiser one of diffusers' example
    scripts trains runs that script's step (measure/diffusers_step.py)."""
    from .diffusers_step import runs_script

    stack = job.get("stack") or {}
    framework = stack.get("framework") if isinstance(stack, dict) else stack
    return framework == "diffusers-scripts" and runs_script(job)


def measure_cpu(job: Any, trace: bool = False, steps: int = 2) -> MeasureResult:
    """Measure ``job`` on CPU with the most faithful runner available."""
    from .build import MEASURED_TASKS, job_dict

    job = job_dict(job)
    if _library_ok(job):
        from .trainers import measure_trainer

        return measure_trainer(job, trace=trace)
    if job["task"] in MEASURED_TASKS and not job.get("vision") and not job.get("models"):
        from .run_modes import run_cpu

        result = run_cpu(job, trace=trace, steps=steps)
        result.runner = loop_runner(job)
        return result
    if job["task"] == "inference":
        from .inference import measure_inference

        return measure_inference(job, steps=steps, trace=trace)
    if job["task"] == "diffusion" and (job.get("diffusion") or {}).get("controlnet"):
        from .diffusers_controlnet import measure_controlnet_step

        return measure_controlnet_step(job, trace=trace, steps=steps)
    if job["task"] == "diffusion" and _diffusers_script(job):
        from .diffusers_step import measure_diffusers_step

        return measure_diffusers_step(job, trace=trace, steps=steps)
    if job["task"] in HAND_WRITTEN or job.get("vision") or job.get("models"):
        return _hand_written(job, trace, steps)
    from .trainers import TRL_TASKS
    if job["task"] in TRL_TASKS:  # no step written out here: only the library's trainer measures it
        raise ValueError(f"task: measuring {job['task']!r} runs TRL's {TRL_TASKS[job['task']]}; install the "
                         "measure extra (pip install 'vramplan[measure]') for trl")
    raise ValueError(f"task: measuring {job['task']!r} is not implemented yet")


__all__ = ["loop_runner", "measure_cpu"]
