"""Which tasks pack rows (spec.packing): the trainers that have the option.

TRL 1.16: SFTConfig.packing / padding_free (GKDConfig, for distill, extends SFTConfig) and
DPOConfig.padding_free (dpo, ipo); GRPOConfig, PPOConfig, KTOConfig, ORPOConfig, CPOConfig
(simpo) and RewardConfig have neither, and refuse the keyword (TypeError: unexpected keyword
argument). Inference and diffusion train no token rows.
"""
from __future__ import annotations

from vramplan.spec.enums import SpecError, Task

PACKING_TASKS = (Task.SFT, Task.PRETRAIN, Task.DISTILL, Task.DPO, Task.IPO, Task.SEQUENCE_CLASSIFICATION)
"""Tasks whose trainer packs or flattens rows (sequence-classification: HF Trainer with
transformers' DataCollatorWithFlattening)."""


def check_packing(spec) -> None:
    if spec.packing and spec.task not in PACKING_TASKS:
        raise SpecError("packing", f"task {spec.task.value} does not pack rows (TRL's trainer for it has no "
                        f"packing or padding_free); drop packing, or use task "
                        f"{', '.join(t.value for t in PACKING_TASKS[:5])}")
