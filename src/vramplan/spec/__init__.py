"""The job spec: one frozen, validated description of a training job."""
from vramplan.spec.enums import (
    Attention, Backend, Checkpointing, LogprobHead, LossImpl, Method, Optimizer, OptimizerImpl, Precision,
    QuantType, SpecError, Task,
)
from vramplan.spec.job import DEFAULT_SEQ_LEN, JobSpec, load_spec, save_spec
from vramplan.spec.lora import LoraConfig
from vramplan.spec.sections import FreezeConfig, ParallelConfig, QuantConfig

__all__ = [
    "DEFAULT_SEQ_LEN", "Attention", "Backend", "Checkpointing", "FreezeConfig", "JobSpec", "LoraConfig",
    "LogprobHead", "LossImpl", "Method", "Optimizer", "OptimizerImpl", "ParallelConfig", "Precision",
    "QuantConfig", "QuantType", "SpecError", "Task", "load_spec", "save_spec",
]
