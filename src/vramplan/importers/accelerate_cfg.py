"""accelerate config YAML (`accelerate config` output: accelerate/commands/config/
cluster.py ClusterConfig fields) -> spec overrides."""
from __future__ import annotations

from vramplan.importers.report import ImportError_, ImportReport

_STRATEGIES = {"FULL_SHARD": "full-shard", "SHARD_GRAD_OP": "shard-grad-op", "HYBRID_SHARD": "hybrid-shard",
               "NO_SHARD": "no-shard", "HYBRID_SHARD_ZERO2": "hybrid-shard", "1": "full-shard",
               "2": "shard-grad-op", "3": "no-shard", "4": "hybrid-shard"}
_NO_MEMORY = {"compute_environment", "debug", "machine_rank", "main_training_function", "rdzv_backend",
              "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "main_process_ip",
              "main_process_port", "num_machines", "downcast_bf16", "enable_cpu_affinity", "gpu_ids"}


def from_accelerate(cfg: dict, source: str = "accelerate-config") -> tuple[dict, ImportReport]:
    if not isinstance(cfg, dict):
        raise ImportError_(f"{source}: expected a mapping")
    rep = ImportReport(source)
    out: dict = {}
    par: dict = {}
    dist = str(cfg.get("distributed_type", "NO")).upper()
    if "num_processes" in cfg:
        n = cfg["num_processes"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ImportError_(f"{source}: num_processes must be a positive integer, got {n!r}")
        out["num_gpus"] = n
        rep.use("num_processes", "num_gpus")
    if "mixed_precision" in cfg:
        mp = str(cfg["mixed_precision"]).lower()
        if mp in ("bf16", "fp16"):
            # accelerate's autocast over the weights as loaded (components/dtypes.py)
            out["precision"] = mp
        elif mp in ("no", "none"):
            out["precision"] = "fp32"
        else:
            rep.unresolved["mixed_precision"] = f"{mp!r} (fp8) is not modelled"
        if "mixed_precision" not in rep.unresolved:
            rep.use("mixed_precision", "precision")
    if dist == "FSDP":
        out["stack"] = "accelerate-fsdp"
        _fsdp(cfg.get("fsdp_config") or {}, par, rep)
    elif dist == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        if "deepspeed_config_file" in ds:
            out["__deepspeed__"] = ds["deepspeed_config_file"]
            rep.use("deepspeed_config.deepspeed_config_file", "DeepSpeed config (imported separately)")
        if "zero_stage" in ds:
            par["zero_stage"] = int(ds["zero_stage"])
            rep.use("deepspeed_config.zero_stage", "parallel.zero_stage")
        for k, key in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
            if ds.get(k) not in (None, "none"):
                par[key] = ds[k]
                rep.use(f"deepspeed_config.{k}", f"parallel.{key}")
        if "gradient_accumulation_steps" in ds:
            out["grad_accum_steps"] = int(ds["gradient_accumulation_steps"])
            rep.use("deepspeed_config.gradient_accumulation_steps", "grad_accum_steps")
    elif dist == "MULTI_GPU":
        rep.use("distributed_type", "data parallel (DDP)")
    for key in cfg:
        if key not in rep.used and not any(u.startswith(key + ".") for u in rep.used) and key != "distributed_type":
            rep.ignored.append(key)
    if dist in ("FSDP", "DEEPSPEED"):
        rep.use("distributed_type", dist.lower())
    if par:
        out["parallel"] = par
    return out, rep


def _fsdp(fc: dict, par: dict, rep: ImportReport) -> None:
    version = fc.get("fsdp_version", 1)
    par["fsdp_version"] = int(version)
    rep.use("fsdp_config.fsdp_version", "parallel.fsdp_version")
    strategy = fc.get("fsdp_sharding_strategy")
    if version == 2 or str(version) == "2":
        # accelerate FSDP2: fsdp_reshard_after_forward true = full-shard, false = shard-grad-op.
        reshard = fc.get("fsdp_reshard_after_forward", True)
        par["fsdp"] = "full-shard" if reshard in (True, "true", "FULL_SHARD") else "shard-grad-op"
        rep.use("fsdp_config.fsdp_reshard_after_forward", "parallel.fsdp")
    elif strategy is not None:
        mode = _STRATEGIES.get(str(strategy).upper())
        if mode is None:
            raise ImportError_(f"{rep.source}: fsdp_config.fsdp_sharding_strategy: unknown {strategy!r}")
        par["fsdp"] = mode
        rep.use("fsdp_config.fsdp_sharding_strategy", "parallel.fsdp")
    else:
        par["fsdp"] = "full-shard"
    if fc.get("fsdp_offload_params") in (True, "true"):
        par["offload_params"] = "cpu"
        par["offload_optimizer"] = "cpu"
        rep.use("fsdp_config.fsdp_offload_params", "parallel.offload_params")
    if fc.get("fsdp_activation_checkpointing") in (True, "true"):
        rep.use("fsdp_config.fsdp_activation_checkpointing", "gradient_checkpointing")
        par["__gc__"] = True
