"""The global-memory staging buffer of PyTorch's CUDA reductions.

A reduction over a dimension that is not the fastest-varying one (a column mean of a
row-major matrix, `x.mean(dim=-2)`) with few outputs and many inputs per output is split
across thread blocks, and the blocks' partial results go through a buffer the kernel takes
from the caching allocator for the call (aten/src/ATen/native/cuda/Reduce.cuh,
`gpu_reduce_kernel` -> `setReduceConfig`, `ReduceConfig::global_memory_size`). Its size
follows from the launch configuration, computed here as setReduceConfig computes it:

- outputs are vectorised by 4 (2, 1 where the column count is not a multiple;
  `get_output_vec_size`), the block's x dimension maps the outputs / 4 and the thread limit is
  512 / 4 (`mnt_wrapper<float>::MAX_NUM_THREADS / output_vec_size`);
- `set_block_dimension`: width = min(pow2(outputs / 4), 32), height = min(pow2(rows),
  limit / width), width = min(pow2(outputs / 4), limit / height);
- the rows split across the block's height when that leaves 16 values per thread (or 256);
- then across `ctas_per_output` blocks when 256 or more values per thread remain and the
  grid is under `target_grid_size = SMs x (threads per SM / threads per block)`:
  max(min(ceil(target / grid.x), ceil(values / 16)), ceil(values / 256));
- the buffer: 4 bytes (float accumulation) x outputs x ctas_per_output x block width x 4.

Measured on an H200 (torch 2.11, bench/cuda: the allocation traces of transformers'
Adafactor steps, `exp_avg_sq_col...add_(update.mean(dim=-2))`): (32000, 512) -> 131,072,000
bytes, (1536, 512) -> 6,291,456, (2752, 512) -> 11,272,192, and none for (512, 1536) and
(512, 512), each as computed here.
"""
from __future__ import annotations

from vramplan.catalog.runtime import cuda_runtime, gpu_arch

_MAX_THREADS = 512          # mnt_wrapper<scalar_t>::MAX_NUM_THREADS for 4-byte types
_WARP = 32
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
_ACC_BYTES = 4              # float accumulation (fp32, bf16 and fp16 inputs alike)
_THREADS_PER_SM = 2048      # an architecture the catalog has no figure for: sm70/80/90/100's


def _pow2_floor(n: int) -> int:
    """last_pow2 in Reduce.cuh: the largest power of two not above n (1 for n < 1)."""
    return 1 << max(n.bit_length() - 1, 0)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _grid_target(gpu_name: str | None, threads_per_block: int) -> int:
    """multiProcessorCount x (maxThreadsPerMultiProcessor / threads per block) of the GPU
    (catalog/cuda_runtime.json "multiprocessors"; a job naming none takes the default card)."""
    table = cuda_runtime()["multiprocessors"]
    name = gpu_name if gpu_name in table["sm_count"] else table["default"]["gpu"]
    threads = table["threads_per_sm"].get(gpu_arch(name) or "", _THREADS_PER_SM)
    return table["sm_count"][name] * (threads // threads_per_block)


def column_reduce_buffer(rows: int, cols: int, gpu_name: str | None = None) -> int:
    """Bytes the staging buffer of a reduction over `rows` (dim -2) of a contiguous
    (rows, cols) tensor takes on an NVIDIA GPU; 0 where the reduction stays in one block."""
    vec = 4
    while cols % vec:
        vec //= 2
    limit = _MAX_THREADS // vec
    dim0, dim1 = cols // vec, rows
    dim0_pow2 = _pow2_floor(dim0) if dim0 < limit else limit
    dim1_pow2 = _pow2_floor(dim1) if dim1 < limit else limit
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, limit // width)
    width = min(dim0_pow2, limit // height)
    values = rows
    if not (values >= height * _MIN_VALUES_PER_THREAD or values >= _MAX_VALUES_PER_THREAD):
        return 0                # each warp takes its own outputs: no split of the rows at all
    values = _div_up(rows, height)
    grid_x = _div_up(dim0, width)
    target = _grid_target(gpu_name, width * height)
    if values < _MAX_VALUES_PER_THREAD or grid_x > target:
        return 0
    ctas = max(min(_div_up(target, grid_x), _div_up(values, _MIN_VALUES_PER_THREAD)),
               _div_up(values, _MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0
    return _ACC_BYTES * cols * ctas * width * vec
