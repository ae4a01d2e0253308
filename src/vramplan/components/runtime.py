"""Device-level terms: what CUDA, cuBLAS, NCCL and the caching allocator add beyond live
tensors. The figures and their sources are data (catalog/cuda_runtime.json)."""
from __future__ import annotations

from functools import lru_cache

from vramplan.units import MiB, round_up

# PyTorch's caching allocator rounds every request up to a multiple of 512 bytes
# (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize = 512): under 1 MB for a model's few
# hundred parameter and state tensors, so not a separate term. Requests above 1 MiB are
# served from segments rounded to 2 MiB (kRoundLarge), smaller ones from 2 MiB pools.
LARGE_SEGMENT_ROUND = 2 * MiB

def _data() -> dict:
    from vramplan.catalog.runtime import cuda_runtime
    return cuda_runtime()


def _arch(gpu_name: str | None) -> str | None:
    from vramplan.catalog.runtime import gpu_arch
    return gpu_arch(gpu_name)


def _by_arch(table: dict, arch: str | None) -> int:
    """The figure for this architecture, else ROCm's for AMD (gfx*), else the default."""
    if arch in table:
        return table[arch]
    if arch and arch.startswith("gfx") and "rocm" in table:
        return table["rocm"]
    return table["default"]


# cuBLAS and cuBLASLt workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp; sizes and
# sources in catalog/cuda_runtime.json "cublas"): one pair per (handle, stream), taken from
# the caching allocator (getNewWorkspace / getNewCUDABlasLtWorkspace), so they count in
# max_memory_allocated. Handles are thread-local: forward runs on the Python thread,
# backward on the autograd engine's device thread, hence two pairs in a training step.
def cublas_workspace_bytes(gpu_name: str | None, training: bool = True) -> int:
    """cuBLAS workspaces of every handle (parseChosenWorkspaceSize: 8 MiB + 128 KiB, 32 MiB
    on sm90 and newer)."""
    blas = _data()["cublas"]
    handles = blas["handles"]["training" if training else "inference"]
    return handles * _by_arch(blas["workspace_bytes"], _arch(gpu_name))


def cublaslt_workspace_bytes(gpu_name: str | None, training: bool = True) -> int:
    """cuBLASLt workspaces of every handle (parseCUDABlasLtWorkspaceSize: 1 MiB by default,
    not unified with cuBLAS's unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1)."""
    blas = _data()["cublas"]
    handles = blas["handles"]["training" if training else "inference"]
    return handles * _by_arch(blas["lt_workspace_bytes"], _arch(gpu_name))


def blas_workspace_terms(gpu_name: str | None, training: bool = True) -> list[tuple[str, int]]:
    """The named allocated terms: runtime/cublas_workspace and runtime/cublaslt_workspace."""
    return list(_blas_workspace_terms(gpu_name, training))


@lru_cache(maxsize=64)
def _blas_workspace_terms(gpu_name: str | None, training: bool) -> tuple[tuple[str, int], ...]:
    # catalog data read once and cached: the figures depend on the GPU name only
    return (("runtime/cublas_workspace", cublas_workspace_bytes(gpu_name, training)),
            ("runtime/cublaslt_workspace", cublaslt_workspace_bytes(gpu_name, training)))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def _loading(cuda_version: str | None) -> str | None:
    """"lazy" or "eager" module loading for a CUDA version (None: not given)."""
    if cuda_version is None:
        return None
    since = _data()["cuda_context"]["lazy_since_cuda"]
    return "lazy" if _version(cuda_version) >= _version(since) else "eager"


def _context_entry(gpu_name: str | None, cuda_version: str | None) -> dict | None:
    """catalog/cuda_runtime.json "cuda_context": the entry for the GPU's architecture and the
    module loading `cuda_version` implies (without a version the newest for the
    architecture), or None."""
    arch, loading = _arch(gpu_name), _loading(cuda_version)
    fits = [e for e in _data()["cuda_context"]["entries"] if e["arch"] == arch and loading in (None, e["loading"])]
    # an entry measured on this very GPU first: the driver's share grows with the card's
    # memory (H200 624 MiB, H100 489 MiB, same architecture and software)
    named = [e for e in fits if gpu_name in e.get("gpus", ())]
    return (named or [e for e in fits if "gpus" not in e] or [None])[-1]  # newest last


@lru_cache(maxsize=64)
def cuda_context_bytes(gpu_name: str | None, cuda_version: str | None = None) -> int:
    """The CUDA context (driver state and loaded kernels), outside the caching allocator so
    only in nvidia-smi. Published or measured figures per architecture and module loading
    (lazy since CUDA 11.7; catalog/cuda_runtime.json "cuda_context" with each source): the
    figure for the GPU's architecture and the loading `cuda_version` implies; without a
    version the newest figure for the architecture; else the generic figure."""
    entry = _context_entry(gpu_name, cuda_version)
    if entry is not None:
        return entry["bytes"]
    return _data()["cuda_context"]["generic"][_loading(cuda_version) or "lazy"]["bytes"]


def cuda_context_process_bytes(gpu_name: str | None, cuda_version: str | None = None) -> int:
    """The part of cuda_context_bytes that NVML charges to the process (nvidia-smi's process
    list): where a measurement separates it (the entry's "process_bytes"), else the whole."""
    entry = _context_entry(gpu_name, cuda_version)
    if entry is not None and "process_bytes" in entry:
        return entry["process_bytes"]
    return cuda_context_bytes(gpu_name, cuda_version)


def nccl_bytes_per_peer() -> int:
    """One connected peer on one channel: the Simple, LL and LL128 FIFO buffers as one cuMem
    allocation rounded to its granularity, plus a send and a receive control block
    (catalog/cuda_runtime.json "nccl": NCCL src/init.cc computeBuffSizes, NVIDIA/nccl#1685)."""
    n = _data()["nccl"]
    fifo = n["simple_bytes"] + n["ll_bytes"] + n["ll128_bytes"]
    return round_up(fifo, n["granularity_bytes"]) + 2 * n["control_bytes"]


def nccl_channels(interconnect: str | None) -> int:
    channels = _data()["nccl"]["channels"]
    return channels.get(interconnect or "nvlink", channels["nvlink"])


def process_groups(num_gpus: int, *, dp: int, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1,
                   shard_group: int | None = None) -> list[tuple[str, int]]:
    """(name, peers connected per channel) of every NCCL communicator one rank holds.
    The default (world) group always (init_process_group; barriers and DDP/FSDP when it is
    the only axis); one more per parallel axis whose group is neither a single rank nor the
    world (DeviceMesh / Megatron parallel_state create one group per mesh dimension);
    pipeline send/recv open a two-rank communicator per neighbouring stage
    (ProcessGroupNCCL keys point-to-point communicators by the rank pair); expert
    parallelism's all-to-all connects every peer of its group. Ring collectives connect one
    peer in and one out per channel."""
    if num_gpus <= 1:
        return []
    groups = [("world", 1)]
    data = dp * cp
    shard = data if shard_group is None else shard_group
    axes = [("tp", tp), ("cp", cp), ("dp_shard" if shard < data else "dp", shard)]
    if shard < data:
        axes.append(("dp_replicate", data // shard))
    groups += [(name, 1) for name, size in axes if 1 < size < num_gpus]
    groups += [(f"pp_peer{i}", 1) for i in range(min(2, pp - 1))]
    if ep > 1:
        groups.append(("ep_all_to_all", ep - 1))
    return groups


def nccl_terms(groups: list[tuple[str, int]], interconnect: str | None) -> list[tuple[str, int]]:
    """runtime/nccl/<group>: channels x connected peers x buffers per peer; outside the
    caching allocator (NCCL allocates with cuMem), so in nvidia-smi only."""
    per_peer = nccl_bytes_per_peer() * nccl_channels(interconnect)
    return [(f"runtime/nccl/{name}", peers * per_peer) for name, peers in groups]


# Activation blocks churn through the caching allocator (saved in forward, freed in
# backward while gradient temporaries of other sizes are requested), and it keeps freed
# segments cached instead of returning or merging them, so reserved memory exceeds the live
# peak by a share of the activations. Measured, not derived: on the transformers docs'
# BERT-large V100 runs (perf_train_gpu_one, nvidia-smi minus its stated 1343 MiB context)
# reserved minus live bytes was 0.27-0.4 of the activation bytes; the lower end is used.
ACTIVATION_FRAGMENTATION = 0.25


def reserved_from_allocated(peak_allocated: int, largest_transient: int, activations: int = 0) -> int:
    """max_memory_reserved >= max_memory_allocated: segments are rounded to 2 MiB, and a block
    freed by one phase can be too small for the next phase's largest request, so the
    allocator holds at least one more segment of that size (the caching allocator does
    not split and merge across segments; see PyTorch's CUDA memory management notes)."""
    slack = round_up(int(ACTIVATION_FRAGMENTATION * activations), LARGE_SEGMENT_ROUND)
    return round_up(peak_allocated, LARGE_SEGMENT_ROUND) + round_up(largest_transient, LARGE_SEGMENT_ROUND) + slack
