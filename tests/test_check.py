"""check: local GPU verdicts, with the device query replaced by fixed devices."""
from __future__ import annotations

import sys

import pytest

import vramplan
from vramplan.check import DoesNotFitError, LocalGPU, NoGPUError, catalog_gpu_for, check, local_gpus
from vramplan.units import GiB

JOB = {"model": "qwen2.5-1.5b", "micro_batch_size": 4, "seq_len": 2048}


def a4090(free_gib: float) -> list[LocalGPU]:
    return [LocalGPU(0, "NVIDIA GeForce RTX 4090", int(23.99 * GiB), int(free_gib * GiB), "nvml")]


def test_package_exposes_check_function():
    assert vramplan.check is check and vramplan.DoesNotFitError is DoesNotFitError


def test_fits_when_free_memory_covers_estimate_and_headroom():
    res = check({**JOB, "micro_batch_size": 1, "seq_len": 256, "method": "lora"}, gpus=a4090(23.0))
    assert res.fits and res.needed_bytes <= res.device.free_bytes
    assert "fits" in res.message()
    tight = check({**JOB, "micro_batch_size": 1, "seq_len": 256, "method": "lora"}, gpus=a4090(23.0),
                  headroom_bytes=res.device.free_bytes - res.estimate.device_bytes + 1, raise_error=False)
    assert not tight.fits                      # one byte of headroom too many


def test_does_not_fit_raises_with_suggestions_that_fit():
    with pytest.raises(DoesNotFitError) as info:
        check(JOB, gpus=a4090(20.0))
    result = info.value.result
    assert not result.fits and result.suggestions
    assert "does not fit" in str(info.value) and "Try:" in str(info.value)
    for s in result.suggestions:
        limit = result.device.free_bytes if s.gpu is None else vramplan.catalog.find_gpu(s.gpu).memory_bytes
        assert s.estimate.device_bytes <= limit


def test_free_memory_not_total_is_the_limit():
    ok = check(JOB | {"micro_batch_size": 1, "method": "lora"}, gpus=a4090(23.0), raise_error=False)
    busy = check(JOB | {"micro_batch_size": 1, "method": "lora"}, gpus=a4090(1.0), raise_error=False)
    assert ok.fits and not busy.fits


def test_no_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(sys.modules["vramplan.check"], "_nvml_gpus", lambda: [])
    monkeypatch.setattr(sys.modules["vramplan.check"], "_torch_gpus", lambda: [])
    assert local_gpus() == []
    with pytest.raises(NoGPUError, match="no local GPU"):
        check(JOB)
    res = check({**JOB, "gpu": "h100-80gb"}, raise_error=False)   # falls back to the catalog GPU
    assert res.device.source == "catalog" and res.device.free_bytes == res.device.total_bytes


def test_unknown_device_index_and_unknown_model_name():
    with pytest.raises(NoGPUError, match="no GPU 3"):
        check(JOB, device=3, gpus=a4090(20.0))
    bare = catalog_gpu_for(LocalGPU(0, "Some Future GPU", 96 * GiB, 90 * GiB, "nvml"))
    assert bare.memory_bytes == 96 * GiB
    assert catalog_gpu_for(a4090(1)[0]).name == "rtx-4090"
