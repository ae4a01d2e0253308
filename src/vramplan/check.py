"""check: will this job fit on the local GPU right now? An edge module (reads the device).

Reads the device through NVML (nvidia-ml-py) or, failing that, torch.cuda; compares the
estimate's device bytes (what nvidia-smi would show, CUDA context included) with the free
memory of the chosen device. If this process already holds a CUDA context, free memory
already excludes it, so the verdict errs on the safe side by the context's size.

    import vramplan
    vramplan.check({"model": "llama-3.1-8b", "micro_batch_size": 4})   # raises if it won't fit
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.i18n import Msg
from vramplan.spec import JobSpec, SpecError, load_spec
from vramplan.units import GiB

CHECK_SCHEMA_VERSION = 1


class NoGPUError(SpecError):
    """No local GPU to check against (and no catalog GPU named): bad input of the `device`
    field (a SpecError, as every refusal of the Python API; it was a RuntimeError)."""

    def __init__(self, message: str):
        super().__init__("device", message)
        self.detail = message
        """The message without the field, as the command line prints it after `device: `."""


class DoesNotFitError(RuntimeError):
    """The job's estimate exceeds the device's free memory; carries the suggestions."""

    def __init__(self, result: "CheckResult"):
        self.result = result
        super().__init__(result.message())


@dataclass(frozen=True, slots=True)
class LocalGPU:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    source: str
    """nvml | torch | catalog (no local device: the catalog GPU's total memory)."""


def _nvml_gpus() -> list[LocalGPU]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: no usable GPU
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            out.append(LocalGPU(i, name, int(info.total), int(info.free), "nvml"))
        return out
    finally:
        pynvml.nvmlShutdown()


def _torch_gpus() -> list[LocalGPU]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(LocalGPU(i, torch.cuda.get_device_name(i), int(total), int(free), "torch"))
    return out


def local_gpus() -> list[LocalGPU]:
    """Visible GPUs with their free memory now; [] when there are none."""
    return _nvml_gpus() or _torch_gpus()


def catalog_gpu_for(local: LocalGPU):
    """The catalog entry for a local device name (aliases hold the driver's names), or a
    bare description holding only its memory when the catalog does not know it."""
    from vramplan.catalog import GPU, UnknownNameError, find_gpu
    try:
        return find_gpu(local.name)
    except UnknownNameError:
        return GPU(name=local.name, vendor="unknown", memory_bytes=local.total_bytes,
                   memory_marketed=f"{local.total_bytes / 1e9:.0f} GB",
                   memory_unit_note="local device, total as the driver reports it",
                   bf16_tflops=None, fp16_tflops=1.0, fp32_tflops=1.0,
                   memory_bandwidth_gbps=1.0, interconnect="pcie", interconnect_gbps=1.0)


@dataclass(slots=True)
class CheckResult:
    device: LocalGPU
    estimate: object
    headroom_bytes: int
    suggestions: list = field(default_factory=list)

    @property
    def needed_bytes(self) -> int:
        return self.estimate.device_bytes + self.headroom_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.device.free_bytes

    def message(self) -> str:
        """English; a `Msg`, so the CLI can print it translated (vramplan.i18n.tr)."""
        values = dict(model=self.estimate.model.name, needed=self.estimate.device_bytes / GiB,
                      headroom=self.headroom_bytes / GiB, free=self.device.free_bytes / GiB,
                      where=Msg("device {index} ({name})", index=self.device.index, name=self.device.name),
                      kind=Msg("total") if self.device.source == "catalog" else Msg("free"))
        head = (Msg("{model} needs {needed:.2f} GiB + {headroom:.2f} GiB headroom on {where}, which has "
                    "{free:.2f} GiB {kind}", **values) if self.headroom_bytes else
                Msg("{model} needs {needed:.2f} GiB on {where}, which has {free:.2f} GiB {kind}", **values))
        if self.fits:
            return Msg("{head}: fits ({spare:.2f} GiB to spare)", head=head,
                       spare=(self.device.free_bytes - self.needed_bytes) / GiB)
        tips = (Msg.join("; ", [s.message() for s in self.suggestions]) if self.suggestions
                else Msg("no single change found; see `vramplan fit`"))
        return Msg("{head}: does not fit. Try: {tips}", head=head, tips=tips)

    def to_dict(self) -> dict:
        return {"schema_version": CHECK_SCHEMA_VERSION,
                "device": {"index": self.device.index, "name": self.device.name,
                           "total_bytes": self.device.total_bytes, "free_bytes": self.device.free_bytes,
                           "source": self.device.source},
                "fits": self.fits, "needed_bytes": self.needed_bytes,
                "headroom_bytes": self.headroom_bytes, "estimate": self.estimate.to_dict(),
                "suggestions": [s.to_dict() for s in self.suggestions], "message": self.message()}


def _pick(spec: JobSpec, device: int | None, gpus: list[LocalGPU] | None) -> LocalGPU:
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise SpecError("device", f"expected a local GPU index >= 0 (as nvidia-smi numbers them), got {device!r}")
    found = local_gpus() if gpus is None else gpus
    if found:
        index = 0 if device is None else device
        for g in found:
            if g.index == index:
                return g
        raise NoGPUError(f"no GPU {index}: visible devices are {', '.join(str(g.index) for g in found)}")
    if spec.gpu:
        if device:  # the answer would say "device 0": the catalog GPU stands in for no local one
            raise NoGPUError(f"no GPU {device}: there is no local GPU here; drop --device to check "
                             f"against the catalog {spec.gpu}'s total memory")
        from vramplan.catalog import find_gpu
        cat = find_gpu(spec.gpu)
        return LocalGPU(0, cat.name, cat.memory_bytes, cat.memory_bytes, "catalog")
    raise NoGPUError("no local GPU (NVML and torch.cuda found none); pass a catalog GPU "
                     "(--gpu / gpu=) to check against its total memory")


def check(spec, *, device: int | None = None, headroom_bytes: int = 0, raise_error: bool = True,
          gpus: list[LocalGPU] | None = None) -> CheckResult:
    """Compare the job's estimate with the free memory of a local GPU.

    Raises DoesNotFitError (with suggestions) when it won't fit and `raise_error`, and
    NoGPUError when there is no GPU to check against. `gpus` replaces the device query.
    """
    from vramplan.plan.evaluate import Evaluator
    from vramplan.plan.suggest import suggestions
    from vramplan.plan.evaluate import trained_desc
    spec = load_spec(spec)
    if isinstance(headroom_bytes, bool) or not isinstance(headroom_bytes, int) or headroom_bytes < 0:
        raise SpecError("headroom", f"expected a number of bytes >= 0, got {headroom_bytes!r}")
    local = _pick(spec, device, gpus)
    gpu = catalog_gpu_for(local) if local.source != "catalog" else None
    if gpu is None:
        from vramplan.catalog import find_gpu
        gpu = find_gpu(spec.gpu)
    ev = Evaluator(trained_desc(spec), gpu, headroom_bytes=headroom_bytes, capacity_bytes=local.free_bytes)
    result = CheckResult(device=local, estimate=ev.estimate(spec), headroom_bytes=headroom_bytes)
    if not result.fits:
        result.suggestions = suggestions(ev, spec)
        if raise_error:
            raise DoesNotFitError(result)
    return result
