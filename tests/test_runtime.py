"""CUDA's own memory (components/runtime.py, catalog/cuda_runtime.json) against hand
arithmetic from the cited sources, and where each term lands (allocated or nvidia-smi)."""
from __future__ import annotations

import pytest

import vramplan
from vramplan.components.runtime import (
    blas_workspace_terms, cublas_workspace_bytes, cublaslt_workspace_bytes, cuda_context_bytes,
    nccl_bytes_per_peer, nccl_terms, process_groups,
)
from vramplan.spec import SpecError
from vramplan.units import MiB


def test_cublas_workspaces_per_architecture():
    # CublasHandlePool.cpp: ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB; ":4096:8" on sm90;
    # cuBLASLt 1024 KiB; two handles in training (forward thread, autograd device thread)
    assert cublas_workspace_bytes("a100-80gb") == 2 * (2 * 4096 + 8 * 16) * 1024
    assert cublas_workspace_bytes("h100-80gb") == 2 * 8 * 4096 * 1024
    assert cublas_workspace_bytes("h100-80gb", training=False) == 32 * MiB
    assert cublaslt_workspace_bytes("l4") == 2 * MiB
    # ROCm: 128 MiB on gfx942 (MI300X), hipBLASLt 76 MiB
    assert cublas_workspace_bytes("mi300x", training=False) == 128 * MiB
    assert cublaslt_workspace_bytes("mi300x", training=False) == 76 * MiB
    assert [k for k, _ in blas_workspace_terms(None)] == ["runtime/cublas_workspace", "runtime/cublaslt_workspace"]


def test_cuda_context_by_architecture_and_module_loading():
    assert cuda_context_bytes("v100-16gb") == 1343 * MiB           # the only published V100 figure (eager)
    assert cuda_context_bytes("rtx-3090") == 256 * MiB             # lazy, torch 2.7 + CUDA 12.8
    assert cuda_context_bytes("rtx-3090", "11.6") == 1024 * MiB    # before lazy loading: generic eager
    assert cuda_context_bytes("a100-80gb", "12.4") == 400 * MiB    # no sm80 figure: generic lazy
    assert cuda_context_bytes("v100-16gb", "12.1") == 400 * MiB


def test_nccl_buffers_per_peer_and_channel():
    # Simple 4 MiB + LL 8*512*8*16 B + LL128 120*640*8*8 B = 9,633,792 B -> 10 MiB at the
    # 2 MiB cuMem granularity, plus 2 MiB send and 2 MiB receive control blocks
    assert nccl_bytes_per_peer() == 14 * MiB
    assert nccl_terms([("world", 1), ("ep_all_to_all", 3)], "nvlink") == [
        ("runtime/nccl/world", 32 * 14 * MiB), ("runtime/nccl/ep_all_to_all", 3 * 32 * 14 * MiB)]
    assert nccl_terms([("world", 1)], "pcie") == [("runtime/nccl/world", 2 * 14 * MiB)]


def test_process_groups_of_parallel_layouts():
    assert process_groups(1, dp=1) == []
    assert process_groups(8, dp=8) == [("world", 1)]
    assert process_groups(8, dp=4, tp=2) == [("world", 1), ("tp", 1), ("dp", 1)]
    assert process_groups(8, dp=2, pp=4) == [("world", 1), ("dp", 1), ("pp_peer0", 1), ("pp_peer1", 1)]
    assert process_groups(2, dp=1, pp=2) == [("world", 1), ("pp_peer0", 1)]
    assert process_groups(16, dp=16, shard_group=8) == [("world", 1), ("dp_shard", 1), ("dp_replicate", 1)]
    assert process_groups(8, dp=8, ep=4)[-1] == ("ep_all_to_all", 3)


def _est(**kw):
    job = {"model": "qwen2.5-0.5b", "method": "full", "micro_batch_size": 1, "seq_len": 512, "gpu": "a100-80gb"}
    return vramplan.estimate(vramplan.load_spec({**job, **kw}))


def test_device_level_adds_context_and_nccl_outside_allocated():
    one = _est()
    assert one.device_terms.to_dict() == {"runtime/cuda_context": 400 * MiB}
    assert one.device_bytes == one.reserved_bytes + 400 * MiB
    assert "runtime/cublas_workspace" in one.components.to_dict()      # through the caching allocator
    assert not any(k.startswith("runtime/cuda_context") for k in one.components.to_dict())
    eight = _est(num_gpus=8, parallel={"zero_stage": 3})
    terms = eight.device_terms.to_dict()
    assert terms["runtime/nccl/world"] == 32 * 14 * MiB                  # a100 over NVLink
    assert eight.device_bytes == eight.reserved_bytes + eight.device_terms.total()
    assert eight.to_dict()["device_terms"] == terms


def test_cpu_backend_has_no_device_terms():
    est = _est(backend="cpu", gpu=None)
    assert est.device_terms.total() == 0 and est.device_bytes == est.peak_allocated_bytes


def test_cuda_version_is_validated():
    assert vramplan.load_spec({"model": "gpt2", "cuda_version": 12.4}).cuda_version == "12.4"
    with pytest.raises(SpecError, match="cuda_version"):
        vramplan.load_spec({"model": "gpt2", "cuda_version": "twelve"})


def test_fused_attention_on_cuda_pads_logsumexp_and_keeps_rng_state():
    def saved(**kw):
        job = {"model": "gpt2", "seq_len": 500, "micro_batch_size": 2, "gpu": "a100-80gb", **kw}
        terms = vramplan.estimate(vramplan.load_spec(job)).components.to_dict()
        return terms.get("activations/layers/attn/core.lse"), terms.get("activations/layers/attn/core.rng_state")
    # gpt2: 12 layers x 12 heads; fp32 runs memory-efficient attention, lse padded to 32 queries
    assert saved(precision="fp32") == (12 * 2 * 12 * 512 * 4, None)
    # bf16 runs flash: lse (b, heads, s) fp32 and, with gpt2's attention dropout 0.1, 2 x int64
    assert saved(precision="bf16") == (12 * 2 * 12 * 500 * 4, 12 * 16)
    # qwen2.5-0.5b (24 layers x 14 heads, no attention dropout): the cpu backend's flash
    # kernel keeps one value per query
    assert saved(model="qwen2.5-0.5b", precision="fp32", backend="cpu", gpu=None) == (24 * 2 * 14 * 500 * 4, None)
    # on CUDA its grouped heads (14 / 2) in fp32 leave no fused kernel (flash and cuDNN take
    # 16-bit only, memory-efficient no grouped heads in torch <= 2.13): the math path keeps
    # the (b, a, s, s) softmax instead of a log-sum-exp (measured: tests/test_cuda_measured.py)
    assert saved(model="qwen2.5-0.5b", precision="fp32") == (None, None)
    job = {"model": "qwen2.5-0.5b", "seq_len": 500, "micro_batch_size": 2, "gpu": "a100-80gb", "precision": "fp32"}
    terms = vramplan.estimate(vramplan.load_spec(job)).components.to_dict()
    assert terms["activations/layers/attn/core.softmax"] == 24 * 2 * 14 * 500 * 500 * 4
    # the flash-attn package takes grouped heads itself
    terms = vramplan.estimate(vramplan.load_spec({**job, "precision": "bf16", "attention": "flash"})).components.to_dict()
    assert "activations/layers/attn/core.softmax" not in terms
