"""Layout: the parallel degrees of one job and which ranks shard the model states.

Legend: n_gpu = num_gpus, t = tp, p = pp, c = cp, u = ulysses, e = ep, d = data-parallel degree.
DeepSpeed Ulysses (ALST) ranks hold the same model replica and split each sample's sequence:
transformers/trainer.py get_dp_world_size = world // (tp * cp * sp), while ZeRO partitions over
every rank (deepspeed/runtime/engine.py: the sequence-data-parallel group of dp * sp).
Megatron's rank grid (megatron/core/parallel_state.py, initialize_model_parallel):
world = t * c * p * d; experts are split over e ranks carved out of d * c
(expert-data-parallel degree = d * c / e when expert-TP equals 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.spec import JobSpec

# DeepSpeed ZeRO defaults (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig fields),
# in elements, not bytes.
DS_REDUCE_BUCKET = 500_000_000
DS_ALLGATHER_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
DS_PARAM_PERSISTENCE_THRESHOLD = 100_000
# torch/nn/parallel/distributed.py DistributedDataParallel.__init__: bucket_cap_mb=25.
DDP_BUCKET_BYTES = 25 * 2**20
GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class Layout:
    num_gpus: int
    dp: int
    tp: int
    pp: int
    cp: int
    ulysses: int
    ep: int
    sp: bool
    zero_stage: int
    fsdp: str
    fsdp_version: int
    offload_optimizer: str
    offload_params: str
    pp_schedule: str
    extras: dict
    dtensor_tp: bool = True
    """Tensor parallelism through torch DTensor (torchtitan, plain PyTorch); False under
    Megatron, whose layers all-gather and save differently (parallel/activations.py)."""

    @classmethod
    def of(cls, spec: JobSpec, hidden_size: int | None = None) -> "Layout":
        par = spec.parallel
        extras = dict(par.extras)
        if hidden_size:
            # transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig
            # trainer_config_finalize: "auto" buckets from the model's hidden size.
            h = hidden_size
            for key, value in (("reduce_bucket_size", h * h),
                               ("stage3_prefetch_bucket_size", int(0.9 * h * h)),
                               ("stage3_param_persistence_threshold", 10 * h)):
                if extras.get(key) == "auto":
                    extras[key] = value
        mp = par.model_parallel
        if spec.num_gpus % mp:
            raise ValueError(f"num_gpus: {spec.num_gpus} is not divisible by tp*pp*cp*ulysses = {mp}")
        dp = spec.num_gpus // mp
        return cls(num_gpus=spec.num_gpus, dp=dp, tp=par.tp, pp=par.pp, cp=par.cp, ulysses=par.ulysses, ep=par.ep,
                   sp=par.sp, zero_stage=par.zero_stage, fsdp=par.fsdp, fsdp_version=par.fsdp_version,
                   offload_optimizer=par.offload_optimizer, offload_params=par.offload_params,
                   pp_schedule=par.pp_schedule, extras=extras,
                   dtensor_tp=spec.stack.framework.value != "megatron")

    @property
    def engine(self) -> str:
        """ddp | zero | fsdp | single."""
        if self.fsdp != "none":
            return "fsdp"
        if self.zero_stage:
            return "zero"
        return "ddp" if self.data_ranks > 1 else "single"

    @property
    def seq_shards(self) -> int:
        """Ranks one sample's sequence is split over: ring context parallelism x Ulysses."""
        return self.cp * self.ulysses

    @property
    def data_ranks(self) -> int:
        """Ranks that hold the same model slice and reduce gradients together (d * c * u)."""
        return self.dp * self.cp * self.ulysses

    @property
    def shard_group(self) -> int:
        """Ranks over which ZeRO / FSDP partition model states.
        Megatron's distributed optimizer and torchtitan's FSDP mesh shard over d * c
        (parallel_state.py: data_parallel_group_with_cp); hybrid-shard shards within a node
        (torch FSDP ShardingStrategy.HYBRID_SHARD / HSDP mesh (replicate, shard))."""
        group = self.data_ranks
        if self.fsdp == "hybrid-shard":
            return min(group, int(self.extras.get("shard_group_size", GPUS_PER_NODE)))
        if self.fsdp == "no-shard":
            return 1
        return group

    def knob(self, name: str, default):
        value = self.extras.get(name, default)
        return default if value in (None, "auto") else value

    @property
    def gpus_per_node(self) -> int:
        return min(self.num_gpus, int(self.extras.get("gpus_per_node", GPUS_PER_NODE)))

    def to_dict(self) -> dict:
        return {"num_gpus": self.num_gpus, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "cp": self.cp, "ulysses": self.ulysses, "ep": self.ep, "sp": self.sp, "engine": self.engine,
                "shard_group": self.shard_group}
