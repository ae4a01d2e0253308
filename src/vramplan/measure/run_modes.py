"""The three ways to measure a job: exact CPU, fake (shapes only), CUDA."""
from __future__ import annotations

import contextlib
import gc
import os
import warnings
from typing import Any

import torch

from . import MeasureResult, phase_kinds
from .build import build, job_dict
from .meter import MemoryMeter
from .run import StepStats, categories, train_steps


def _result(device: str, meter_peak: int, peak_label: str, phase_peaks: dict,
            stats: StepStats, **extra) -> MeasureResult:
    return MeasureResult(
        device=device, peak_allocated_bytes=meter_peak, phases=phase_kinds(phase_peaks),
        params_bytes=stats.params_bytes, grad_bytes=stats.grad_bytes,
        optimizer_state_bytes=stats.optimizer_state_bytes,
        activation_bytes_end_of_forward=stats.activation_bytes_end_of_forward,
        peak_phase=peak_label, phase_peaks=dict(phase_peaks), **extra)


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector can see now.

    The reference meter counts all storages alive when metering starts, not
    only the model's: e.g. importing peft creates two int64 scalars
    (``scale=torch.tensor(1)`` defaults of peft/tuners/loha/layer.py
    HadaWeight.forward / HadaWeightCP.forward), the 16 bytes by which every
    LoRA row of cpu-dev-truth exceeds a params+buffers-only count.  So
    results depend on what the process imported: measure one job per process
    for reproducible bytes (bench/accuracy/reproduce_dev_truth.py does)."""
    gc.collect()  # unreachable tensors still in gc's lists are not alive
    with warnings.catch_warnings():  # isinstance() touches deprecated module attrs
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _metered(job: dict, built, trace: bool, steps: int, device: str) -> MeasureResult:
    meter = MemoryMeter(trace=trace)
    meter.register(built.model.parameters(), "parameter")
    meter.register(built.model.buffers(), "buffer")
    meter.register([m for m, _ in built.master_pairs], "master")
    built.resident = _live_tensors()
    meter.register(built.resident, "preexisting")
    meter.set_category_fn(lambda: categories(built))
    if trace:
        meter.track_modules(built.model)
    try:
        with meter:
            stats = train_steps(built, job, meter, "cpu", steps)
    finally:
        meter.close()
    result = _result(device, meter.peak, meter.peak_label, meter.phase_peaks, stats)
    if trace:
        from .trace import Trace

        result.trace = Trace.from_meter(meter)
    return result


def run_cpu(job: Any, trace: bool = False, steps: int = 2) -> MeasureResult:
    job = job_dict(job)
    torch.manual_seed(0)
    built = build(job, "cpu")
    return _metered(job, built, trace, steps, "cpu")


# ---------------------------------------------------------------------- fake
@contextlib.contextmanager
def _optimizer_scalars_patched():
    """torch.optim reads the step count with ``_get_value(step)`` ->
    ``step.item()`` (torch/optim/optimizer.py), which a FakeTensor cannot
    answer.  The value only scales the update, never a shape, so any number
    keeps the memory identical: answer 1.0 for fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensor
    import torch.optim.optimizer as base

    original = base._get_value

    def fake_aware(x):
        return 1.0 if isinstance(x, FakeTensor) else original(x)

    modules = [m for m in list(vars(torch.optim).values()) if hasattr(m, "_get_value")]
    modules += [base] + [getattr(torch.optim, n, None) for n in ("adam", "adamw", "sgd", "adafactor")]
    patched = {m for m in modules if m is not None and getattr(m, "_get_value", None) is original}
    for m in patched:
        m._get_value = fake_aware
    try:
        yield
    finally:
        for m in patched:
            m._get_value = original


@contextlib.contextmanager
def _transformers_sees_real_tensors():
    """transformers' ``is_tracing(t)`` (utils/import_utils.py) is True for a
    FakeTensor, and then masking_utils.py (``_ignore_causal_mask_sdpa``) builds
    an explicit causal mask and sdpa_attention.py repeats K/V for GQA instead
    of skipping the mask: a different, larger set of tensors than a real run.
    Hide fakeness from that check so the fake run takes the real run's path.

    The one data-dependent check this then reaches is
    ``masking_utils.find_packed_sequence_indices`` asking whether position ids
    restart (packed sequences).  Our batches are never packed, so the real
    answer is always None: run its ops (same allocations), answer None."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from transformers import masking_utils
    from transformers.utils import import_utils

    original_is_fake = import_utils.is_fake_tensor
    original_find = masking_utils.find_packed_sequence_indices

    def find_packed(position_ids):
        try:
            return original_find(position_ids)
        except DataDependentOutputException:
            return None  # arange positions: not packed

    import_utils.is_fake_tensor = lambda tensor: False
    masking_utils.find_packed_sequence_indices = find_packed
    try:
        yield
    finally:
        import_utils.is_fake_tensor = original_is_fake
        masking_utils.find_packed_sequence_indices = original_find


@contextlib.contextmanager
def _module_conversion_by_set_data():
    """``Module._apply`` (``.to()``, used by peft when it adds adapters) swaps
    FakeTensor parameters with ``torch.utils.swap_tensors``
    (torch/nn/modules/module.py), which refuses tensors that have weak
    references (FakeTensorMode keeps one).  Fall back to the classic
    ``param.data = new`` conversion, which gives the same storages."""
    original = torch.utils.swap_tensors

    def swap_or_set_data(t1, t2):
        try:
            return original(t1, t2)
        except RuntimeError:
            with torch.no_grad():
                t1.data = t2.data

    torch.utils.swap_tensors = swap_or_set_data
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def _import_outside_fake_mode(job: dict) -> None:
    """Import the libraries before FakeTensorMode starts: module-level tensors
    they create (peft's ``scale=torch.tensor(1)`` defaults) must be the real
    ones a real run has, not fakes that also keep a real constant inside."""
    import transformers  # noqa: F401

    if job.get("method") in ("lora", "qlora"):
        import peft  # noqa: F401


def run_fake(job: Any, trace: bool = False, steps: int = 2) -> MeasureResult:
    """Same steps on FakeTensors: shapes and storages, no memory, no math."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    job = job_dict(job)
    _import_outside_fake_mode(job)
    with (FakeTensorMode(allow_non_fake_inputs=True), _optimizer_scalars_patched(),
          _transformers_sees_real_tensors(), _module_conversion_by_set_data()):
        built = build(job, "cpu")
        return _metered(job, built, trace, steps, "fake")


# ---------------------------------------------------------------------- CUDA
class CudaPhaseMeter:
    """Same interface as MemoryMeter for the runner, read from the caching
    allocator (torch/cuda/memory.py): peak per phase via
    ``reset_peak_memory_stats`` + ``max_memory_allocated`` /
    ``max_memory_reserved``; NVML device-level usage read at each phase end
    (the caching allocator rarely returns memory, so the largest end-of-phase
    reading is the run's device-level peak to within one phase's growth)."""

    def __init__(self, marks: list[str] | None = None):
        self.phase_peaks: dict[str, int] = {}
        self.marks = marks
        """When a list: each phase's name is appended and its start marked in the allocator's
        trace (measure/cuda_trace.py)."""
        self.reserved_peak = 0
        self.device_peak: int | None = None
        self.process_peak: int | None = None
        self._nvml = _NvmlReader()

    @property
    def current(self) -> int:
        return torch.cuda.memory_allocated()

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.marks is not None:
            from .cuda_trace import mark
            self.marks.append(name)
            mark(torch, len(self.marks))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        try:
            yield self
        finally:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), peak)
            self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved())
            used = self._nvml.used_bytes()
            if used is not None:
                self.device_peak = max(self.device_peak or 0, used)
            mine = self._nvml.process_bytes()
            if mine is not None:
                self.process_peak = max(self.process_peak or 0, mine)

    def peak(self) -> tuple[int, str]:
        name = max(self.phase_peaks, key=self.phase_peaks.get)
        return self.phase_peaks[name], name

    def close(self) -> None:
        self._nvml.close()


class _NvmlReader:
    """Used bytes of the current CUDA device via nvidia-ml-py (``pynvml``), or
    None when it is not installed or not permitted.  Includes the CUDA context
    and every other process on the device."""

    def __init__(self):
        self.handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.pynvml = pynvml
            self.handle = self._handle(pynvml)
        except Exception:  # ImportError, NVMLError: no device-level figure
            self.handle = None

    @staticmethod
    def _handle(pynvml):
        # CUDA_VISIBLE_DEVICES renumbers devices for torch but not for NVML:
        # match by UUID (torch.cuda.get_device_properties(i).uuid).
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            text = str(uuid)
            text = text if text.startswith("GPU-") else f"GPU-{text}"
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(text)
            except Exception:
                pass
        return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def used_bytes(self) -> int | None:
        if self.handle is None:
            return None
        try:
            return int(self.pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        except Exception:
            return None

    def process_bytes(self) -> int | None:
        """This process's used memory on the device (nvidia-smi's per-process column:
        its CUDA context plus the allocator's segments), read from
        nvmlDeviceGetComputeRunningProcesses; unaffected by other processes on the GPU,
        so cases can run side by side. None where NVML does not report it."""
        if self.handle is None:
            return None
        try:
            procs = self.pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return None
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory]
        return int(mine[0]) if mine else None

    def close(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(Exception):
                self.pynvml.nvmlShutdown()
            self.handle = None


def apply_alloc_conf(conf: str | None) -> None:
    """The job's PYTORCH_CUDA_ALLOC_CONF for this process's caching allocator: through the
    environment before CUDA starts (c10/cuda/CUDAAllocatorConfig reads it then), else
    through torch.cuda.memory._set_allocator_settings (same syntax)."""
    if not conf or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == conf:
        return
    if torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings(conf)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf


def run_cuda(job: Any, steps: int = 2, trace: bool = False) -> MeasureResult:
    """The CUDA step; `trace`: with PyTorch's own allocation trace of it, from the model's
    build on (MeasureResult.allocator_trace, measure/cuda_trace.py)."""
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda requested but torch.cuda.is_available() is False")
    job = job_dict(job)
    apply_alloc_conf(job.get("alloc_conf"))
    from .cuda_trace import compact, recording
    marks: list[str] | None = [] if trace else None
    with recording(torch) if trace else contextlib.nullcontext():
        torch.manual_seed(0)
        built = build(job, "cuda")
        meter = CudaPhaseMeter(marks)
        try:
            stats = train_steps(built, job, meter, "cuda", steps)
        finally:
            meter.close()
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()] if trace else None
    peak, name = meter.peak()
    return _result("cuda", peak, name, meter.phase_peaks, stats,
                   peak_reserved_bytes=meter.reserved_peak, device_bytes=meter.device_peak,
                   process_bytes=meter.process_peak,
                   allocator_trace=None if events is None else compact(events, marks))
