"""parallel.extras: engine knobs read from config files (DeepSpeed, FSDP, Megatron), each
checked with its field so the engines (vramplan.parallel) read validated values."""
from __future__ import annotations

from vramplan.spec.enums import SpecError
from vramplan.spec.sections import _show, boolean, did_you_mean, positive_int

_EXTRA_COUNTS = ("shard_group_size", "gpus_per_node", "virtual_stages", "expert_tp", "buffer_count",
                 "buffer_size", "reduce_bucket_size", "allgather_bucket_size", "sub_group_size")
_EXTRA_SIZES = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_param_persistence_threshold")
"""DeepSpeed ZeRO-3 knobs where 0 is meaningful (no prefetch, nothing persistent)."""
_EXTRA_FLAGS = ("overlap_comm", "contiguous_gradients", "distributed_optimizer", "gradient_as_bucket_view")
_EXTRA_OTHER = ("pp_layers", "host_memory_bytes", "dist_backend", "zero_hpz_partition_size")
_EXTRA_KNOWN = _EXTRA_COUNTS + _EXTRA_SIZES + _EXTRA_FLAGS + _EXTRA_OTHER


def check_extras(extras: object) -> dict:
    """parallel.extras: engine knobs read from config files; counts are positive integers
    (or "auto", resolved from the model), switches are booleans."""
    if not isinstance(extras, dict):
        raise SpecError("parallel.extras", f"expected a mapping of engine settings, got {_show(extras)}")
    out = dict(extras)
    for key, value in extras.items():
        name = f"parallel.extras.{key}"
        hint = "" if key in _EXTRA_KNOWN else did_you_mean(str(key), _EXTRA_KNOWN, 0.85)
        if hint:  # a near miss of a knob read here (reduce_bucket_sise) would be dropped unread
            raise SpecError(name, f"unknown engine setting{hint}")
        if key in _EXTRA_COUNTS and value != "auto":
            out[key] = positive_int(name, value)
        elif key in _EXTRA_FLAGS:
            out[key] = boolean(name, value)
        elif key in _EXTRA_SIZES and value != "auto":
            out[key] = positive_int(name, value, minimum=0)
        elif key == "pp_layers" and not (isinstance(value, (list, tuple)) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
            raise SpecError(name, f"expected a list of layer counts per pipeline stage, got {_show(value)}")
        elif key == "zero_hpz_partition_size":  # engines.py int()s it: 'abc' or [2] failed there
            out[key] = positive_int(name, value, minimum=0)  # DeepSpeed's Field(1, ge=0); 0 and 1: off
        elif key == "host_memory_bytes" and not (isinstance(value, str) and value.lower() in ("local", "auto")):
            if isinstance(value, str) and not value.strip().isdigit():  # parallel/host.py int()s it
                raise SpecError(name, f"expected the host's RAM in bytes (e.g. 549755813888) or 'local', got {_show(value)}")
            out[key] = positive_int(name, value)
        elif key == "dist_backend" and (not isinstance(value, str) or value.lower() not in DIST_BACKENDS):
            raise SpecError(name, f"expected one of {', '.join(DIST_BACKENDS)} (torch.distributed), got {_show(value)}")
    return out


DIST_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "ccl")
"""torch.distributed backends (Backend.NCCL, GLOO, MPI, UCC, XCCL; hccl/ccl from the Ascend and oneCCL plugins)."""


__all__ = ["DIST_BACKENDS", "check_extras"]
