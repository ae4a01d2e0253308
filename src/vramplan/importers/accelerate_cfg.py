"""accelerate config YAML (`accelerate config` output: accelerate/commands/config/
cluster.py ClusterConfig fields) -> spec overrides."""
from __future__ import annotations

from vramplan.importers.fp8 import accelerate_fp8
from vramplan.importers.report import ImportError_, ImportReport, need_bool, need_int, need_mapping

_STRATEGIES = {"FULL_SHARD": "full-shard", "SHARD_GRAD_OP": "shard-grad-op", "HYBRID_SHARD": "hybrid-shard",
               "NO_SHARD": "no-shard", "HYBRID_SHARD_ZERO2": "hybrid-shard", "1": "full-shard",
               "2": "shard-grad-op", "3": "no-shard", "4": "hybrid-shard"}
_NO_MEMORY = {"compute_environment", "debug", "machine_rank", "main_training_function", "rdzv_backend",
              "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "main_process_ip",
              "main_process_port", "num_machines", "downcast_bf16", "enable_cpu_affinity", "gpu_ids"}


def from_accelerate(cfg: dict, source: str = "accelerate-config") -> tuple[dict, ImportReport]:
    if not isinstance(cfg, dict):
        raise ImportError_(source, "config", "expected a mapping at the top level")
    rep = ImportReport(source)
    out: dict = {}
    par: dict = {}
    dist = cfg.get("distributed_type", "NO")
    if not isinstance(dist, str):
        raise ImportError_(source, "distributed_type", f"expected NO, MULTI_GPU, FSDP or DEEPSPEED, got {dist!r}")
    dist = dist.upper()
    if "num_processes" in cfg:
        out["num_gpus"] = need_int(rep, "num_processes", cfg["num_processes"])
        rep.use("num_processes", "num_gpus")
    if "mixed_precision" in cfg:
        # accelerate writes 'no' quoted; unquoted YAML `no` reads as false.
        raw = cfg["mixed_precision"]
        mp = "no" if raw is False or raw is None else raw.lower() if isinstance(raw, str) else None
        if mp in ("bf16", "fp16"):
            # accelerate's autocast over the weights as loaded (components/dtypes.py)
            out["precision"] = mp
        elif mp in ("no", "none"):
            out["precision"] = "fp32"
        elif mp == "fp8":
            # torchao through accelerate's AO backend; TE and MS-AMP are refused (importers/fp8.py)
            out.update(accelerate_fp8(cfg, dist, rep))
        else:
            raise ImportError_(source, "mixed_precision", f"expected no, fp16, bf16 or fp8, got {raw!r}")
        if mp != "fp8":
            rep.use("mixed_precision", "precision")
    if dist == "FSDP":
        out["stack"] = "accelerate-fsdp"
        _fsdp(need_mapping(rep, "fsdp_config", cfg.get("fsdp_config")), par, rep)
    elif dist == "DEEPSPEED":
        ds = need_mapping(rep, "deepspeed_config", cfg.get("deepspeed_config"))
        if "deepspeed_config_file" in ds:
            out["__deepspeed__"] = ds["deepspeed_config_file"]
            rep.use("deepspeed_config.deepspeed_config_file", "DeepSpeed config (imported separately)")
        if "zero_stage" in ds:
            par["zero_stage"] = need_int(rep, "deepspeed_config.zero_stage", ds["zero_stage"], minimum=0)
            if par["zero_stage"] > 3:
                raise ImportError_(source, "deepspeed_config.zero_stage", f"must be 0-3, got {par['zero_stage']}")
            rep.use("deepspeed_config.zero_stage", "parallel.zero_stage")
        for k, key in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_params")):
            if ds.get(k) not in (None, "none"):
                if ds[k] not in ("cpu", "nvme"):
                    raise ImportError_(source, f"deepspeed_config.{k}", f"expected none, cpu or nvme, got {ds[k]!r}")
                par[key] = ds[k]
                rep.use(f"deepspeed_config.{k}", f"parallel.{key}")
        if "gradient_accumulation_steps" in ds:
            out["grad_accum_steps"] = need_int(rep, "deepspeed_config.gradient_accumulation_steps",
                                               ds["gradient_accumulation_steps"])
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
    if isinstance(version, bool) or str(version) not in ("1", "2"):
        raise ImportError_(rep.source, "fsdp_config.fsdp_version", f"must be 1 or 2, got {version!r}")
    par["fsdp_version"] = int(version)
    rep.use("fsdp_config.fsdp_version", "parallel.fsdp_version")
    strategy = fc.get("fsdp_sharding_strategy")
    if version == 2 or str(version) == "2":
        # accelerate FSDP2: fsdp_reshard_after_forward true = full-shard, false = shard-grad-op.
        reshard = fc.get("fsdp_reshard_after_forward", True)
        if reshard not in (True, False, "FULL_SHARD", "SHARD_GRAD_OP"):
            raise ImportError_(rep.source, "fsdp_config.fsdp_reshard_after_forward",
                               f"expected true or false, got {reshard!r}")
        par["fsdp"] = "full-shard" if reshard in (True, "FULL_SHARD") else "shard-grad-op"
        rep.use("fsdp_config.fsdp_reshard_after_forward", "parallel.fsdp")
    elif strategy is not None:
        mode = _STRATEGIES.get(str(strategy).upper())
        if mode is None:
            raise ImportError_(rep.source, "fsdp_config.fsdp_sharding_strategy",
                               f"unknown {strategy!r}; use FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD")
        par["fsdp"] = mode
        rep.use("fsdp_config.fsdp_sharding_strategy", "parallel.fsdp")
    else:
        par["fsdp"] = "full-shard"
    if need_bool(rep, "fsdp_config.fsdp_offload_params", fc.get("fsdp_offload_params", False)):
        par["offload_params"] = "cpu"
        par["offload_optimizer"] = "cpu"
        rep.use("fsdp_config.fsdp_offload_params", "parallel.offload_params")
    if need_bool(rep, "fsdp_config.fsdp_activation_checkpointing", fc.get("fsdp_activation_checkpointing", False)):
        rep.use("fsdp_config.fsdp_activation_checkpointing", "gradient_checkpointing")
        par["__gc__"] = True
