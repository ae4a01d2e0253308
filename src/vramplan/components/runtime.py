"""Device-level terms: what CUDA and the caching allocator add beyond live tensors."""
from __future__ import annotations

from vramplan.units import MiB, round_up

# PyTorch's caching allocator rounds every request up to a multiple of 512 bytes
# (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize = 512): under 1 MB for a model's few
# hundred parameter and state tensors, so not a separate term. Requests above 1 MiB are
# served from segments rounded to 2 MiB (kRoundLarge), smaller ones from 2 MiB pools.
LARGE_SEGMENT_ROUND = 2 * MiB

# cuBLAS workspace, allocated through the caching allocator once per handle/stream
# (aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize): ":4096:2:16:8" =
# 2 x 4 MiB + 8 x 16 KiB before Hopper, ":4096:8" = 8 x 4 MiB = 32 MiB on Hopper (sm90+).
def cublas_workspace_bytes(gpu_name: str | None) -> int:
    hopper = bool(gpu_name) and any(k in gpu_name.lower() for k in ("h100", "h200", "h800", "gh200", "b200", "b100"))
    return 32 * MiB if hopper else 2 * 4 * MiB + 8 * 16 * 1024


# CUDA context: driver state plus PyTorch's kernels, outside the caching allocator, so it
# shows in nvidia-smi but not in max_memory_reserved. Measured figures: 0.3-1.3 GiB depending
# on GPU, driver and CUDA version (../shared/validation/README.md); transformers'
# perf_train_gpu_one guide measured 1343 MiB on a V100 before CUDA lazy module loading.
# With lazy loading (CUDA >= 11.7, PyTorch's default) about 500 MiB is typical.
CUDA_CONTEXT_DEFAULT = 500 * MiB


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
