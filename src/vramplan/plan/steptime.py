"""Step time: a FLOPs model at a stated utilization plus communication over the interconnect.

Pure arithmetic on (ModelDesc, JobSpec, GPU); every term is named, in seconds, like the
memory Breakdown. It ranks layouts against each other; it is not a benchmark.

Legend: N parameters used per token, T tokens per optimizer step (global batch x s),
L layers, h hidden, s sequence, b micro-batch, t tensor-parallel, p pipeline, d data parallel,
m micro-batches per step per pipeline (gradient accumulation).

Assumptions, each stated once:
- MFU (model FLOPs utilization) DEFAULT_MFU = 0.40. PaLM (Chowdhery et al. 2022, Table 3)
  reports 46.2% MFU for 540B on TPU v4; Megatron-LM (Narayanan et al. 2021, section 5.1)
  reports 52% of peak for a 1T model on 3072 A100s. Fine-tuning at small batch runs lower, so
  we take 40%. Pass `mfu=` to change it.
- Communication is not overlapped with compute (a conservative upper bound on step time).
- Collectives are ring algorithms: an all-reduce moves 2(n-1)/n x the buffer per GPU,
  reduce-scatter and all-gather (n-1)/n each (Patarasuk & Yuan 2009; NCCL's own docs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.model import ModelDesc
from vramplan.spec import Checkpointing, JobSpec, Method, Precision
from vramplan.units import dtype_bits

DEFAULT_MFU = 0.40

# Host link for CPU offload: PCIe Gen4 x16 is 32 GB/s per direction on paper; ~25 GB/s is
# what pinned-memory copies reach in practice (assumed, not measured here).
PCIE_HOST_GBPS = 25.0
# CPU optimizer throughput for offloaded states: DeepSpeed CPU-Adam (Ren et al. 2021,
# ZeRO-Offload) updates on the order of 1e9 parameters per second on a server CPU.
# Assumed, order of magnitude; it only has to rank offload behind on-GPU steps.
CPU_ADAM_PARAMS_PER_S = 1.0e9


@dataclass(slots=True)
class StepTime:
    """Seconds per optimizer step, by named term ('compute/forward', 'comm/dp_grads', ...)."""

    terms: dict[str, float] = field(default_factory=dict)
    mfu: float = DEFAULT_MFU
    flops: float = 0.0
    """Model FLOPs per optimizer step, all GPUs together (recompute included)."""
    comm_bytes: float = 0.0
    """Bytes each GPU sends per optimizer step."""

    @property
    def total_s(self) -> float:
        return sum(self.terms.values())

    @property
    def modelled(self) -> bool:
        """False where no FLOPs model covers the model (diffusion and video pipelines: the
        evaluator has no transformer description to count): no term, and no time to report."""
        return bool(self.terms)

    def to_dict(self) -> dict:
        return {"total_s": self.total_s if self.modelled else None, "mfu": self.mfu, "flops": self.flops,
                "comm_bytes": self.comm_bytes, "terms": dict(self.terms)}


@dataclass(frozen=True, slots=True)
class ModelCounts:
    """What the FLOPs model reads from a ModelDesc; computed once per model in a search."""

    num_params: int
    active_params: int
    """Parameters a token passes through (MoE: only top-k experts)."""
    embedding_params: int
    num_layers: int
    hidden_size: int
    attn_width: int
    """num_heads x head_dim."""

    @classmethod
    def of(cls, desc: ModelDesc) -> "ModelCounts":
        total = desc.num_params()
        active = total
        if desc.moe is not None:
            expert = sum(p.numel for p in desc.params if ".experts." in p.name)
            active = total - expert + expert * desc.moe.top_k // desc.moe.num_experts
        embed = sum(p.numel for p in desc.params if "embed" in p.name or p.name.endswith("wpe.weight"))
        return cls(num_params=total, active_params=active, embedding_params=embed,
                   num_layers=desc.num_layers, hidden_size=desc.hidden_size,
                   attn_width=desc.num_heads * desc.head_dim)


def data_parallel(spec: JobSpec) -> int:
    return max(1, spec.num_gpus // spec.parallel.model_parallel)


def global_batch(spec: JobSpec) -> int:
    """Rows per optimizer step over all GPUs."""
    return spec.micro_batch_size * spec.grad_accum_steps * data_parallel(spec)


def peak_tflops(gpu, precision: Precision) -> float:
    if precision is Precision.FP32:
        return gpu.fp32_tflops
    if precision.compute_dtype == "bf16" and gpu.bf16_tflops:
        return gpu.bf16_tflops
    return gpu.fp16_tflops


def step_time(counts: ModelCounts, spec: JobSpec, gpu, *, mfu: float = DEFAULT_MFU,
              trainable_params: int | None = None, communication: dict | None = None) -> StepTime:
    """Seconds per optimizer step on `gpu` for `spec` (one GPU's view of the whole job)."""
    return LayoutTime(counts, spec, gpu, mfu=mfu, trainable_params=trainable_params).at(
        spec.micro_batch_size, spec.grad_accum_steps, communication)


class LayoutTime:
    """step_time of one layout at any batch split (micro-batch, accumulation steps): what
    does not depend on the split is read once, the rest computed by `at` with the same
    operations in the same order, so `at(b, m)` equals step_time of the spec with that split
    to the last bit. A search evaluates thousands of splits of a few hundred layouts."""

    __slots__ = ("spec", "d", "s", "L", "n_matmul", "attn_width", "full", "ckpt", "every", "pp", "tp",
                 "rate", "mfu", "gpu", "counts", "trainable", "offload", "link")

    def __init__(self, counts: ModelCounts, spec: JobSpec, gpu, *, mfu: float = DEFAULT_MFU,
                 trainable_params: int | None = None):
        self.spec, self.gpu, self.counts, self.mfu = spec, gpu, counts, mfu
        self.trainable = trainable_params
        self.d = data_parallel(spec)
        self.s, self.L = spec.seq_len, counts.num_layers
        self.n_matmul = counts.active_params - counts.embedding_params
        self.attn_width = counts.attn_width
        self.full = spec.method in (Method.FULL, Method.FREEZE)
        self.ckpt, self.every = spec.gradient_checkpointing, spec.checkpoint_every
        self.pp, self.tp = spec.parallel.pp, spec.parallel.tp
        self.rate = peak_tflops(gpu, spec.precision) * 1e12 * mfu * spec.num_gpus
        self.link = gpu.interconnect_gbps * 1e9
        # the offload terms' split-free part, the same operations in the same order
        self.offload = _offload_parts(spec, trainable_params if trainable_params is not None else counts.num_params)

    def at(self, micro_batch_size: int, grad_accum_steps: int, communication: dict | None = None, *,
           comm: bool = True) -> StepTime:
        """StepTime at this split; `communication`: the estimator's own volumes, if any.
        comm=False leaves the comm/ terms out (no other term reads them)."""
        spec, mb, ga = self.spec, micro_batch_size, grad_accum_steps
        out = StepTime(mfu=self.mfu)
        T = mb * ga * self.d * self.s          # global_batch x s
        s, L = self.s, self.L
        # Kaplan et al. 2020 / PaLM appendix B: 2N FLOPs per token forward, 4N backward; a frozen
        # base (LoRA) still needs the 2N activation-gradient half of backward, not the 2N weight half.
        fwd = 2 * self.n_matmul * T
        # PaLM (Chowdhery et al. 2022) appendix B: attention adds 12·L·(a·d)·s FLOPs per token in
        # training, 4·L·(a·d)·s of them forward (QK^T and AV); no causal discount, as in PaLM.
        attn_fwd = 2 * 2 * L * self.attn_width * s * T
        bwd = (2 * fwd if self.full else fwd) + 2 * attn_fwd
        recompute = 0
        if self.ckpt is Checkpointing.FULL:
            # one more forward in backward for the wrapped layers (one in checkpoint_every)
            recompute = (fwd + attn_fwd) // self.every
        elif self.ckpt is Checkpointing.OP_SELECTIVE:
            # torchtitan SelectiveAC: every second matmul is recomputed, attention kept on CUDA
            recompute = fwd // 2
        elif self.ckpt is Checkpointing.SELECTIVE:
            recompute = attn_fwd                # Korthikanti et al. 2022: attention core only
        out.flops = fwd + attn_fwd + bwd + recompute
        rate = self.rate
        out.terms["compute/forward"] = (fwd + attn_fwd) / rate
        out.terms["compute/backward"] = bwd / rate
        if recompute:
            out.terms["compute/recompute"] = recompute / rate
        if self.pp > 1:
            # Narayanan et al. 2021 eq. (1): 1F1B bubble fraction (p-1)/m of the ideal time.
            compute = (out.flops / rate)
            out.terms["pipeline/bubble"] = compute * (self.pp - 1) / ga
        comm = _communication(self.counts, spec, self.d, self.trainable, communication, mb, ga) if comm else {}
        link = self.link
        for name, nbytes in comm.items():
            out.terms[f"comm/{name}"] = nbytes / link
            out.comm_bytes += nbytes
        optimizer, params = self.offload
        if optimizer is not None:
            out.terms["offload/pcie"], out.terms["offload/cpu_optimizer"] = optimizer
        if params is not None:
            out.terms["offload/params_pcie"] = params * ga / (PCIE_HOST_GBPS * 1e9)
        return out


def _grad_bytes_per_elem(spec: JobSpec) -> float:
    return dtype_bits(spec.precision.weight_dtype) / 8


def _communication(counts: ModelCounts, spec: JobSpec, d: int, trainable: int | None,
                   reported: dict | None, mb: int, ga: int) -> dict[str, float]:
    """Bytes per GPU per optimizer step, by collective (`mb`, `ga`: the batch split)."""
    if reported:
        # The estimator's own volumes, one term per collective group (dp, tp, pp, ...).
        per_group = {name: _reported_bytes(v) for name, v in reported.items() if isinstance(v, dict)}
        if per_group and all(v is not None for v in per_group.values()):
            return per_group
        total = _reported_bytes(reported)
        if total is not None:
            return {"reported": total}
    par = spec.parallel
    out: dict[str, float] = {}
    trainable = counts.num_params if trainable is None else trainable
    shard = par.tp * par.pp
    grad_bytes = trainable * _grad_bytes_per_elem(spec) / shard
    if d > 1:
        ring = 2 * (d - 1) / d
        # ZeRO-1/2 swap the all-reduce for reduce-scatter + all-gather: same volume;
        # ZeRO-3 / FSDP full-shard add a parameter all-gather in backward: 1.5x
        # (Rajbhandari et al. 2020, ZeRO, section 7).
        factor = 1.5 if (par.zero_stage == 3 or par.fsdp in ("full-shard", "hybrid-shard")) else 1.0
        out["dp_grads"] = ring * grad_bytes * factor
    if par.tp > 1:
        # Megatron-LM (Korthikanti et al. 2022, section 4.1): per layer 2 all-reduces in
        # forward and 2 in backward of a b·s·h activation; +2 with full recompute.
        act = mb * spec.seq_len * counts.hidden_size * dtype_bits(spec.precision.compute_dtype) / 8
        per_layer = 6 if spec.gradient_checkpointing is Checkpointing.FULL else 4
        layers = counts.num_layers // par.pp
        out["tp_activations"] = 2 * (par.tp - 1) / par.tp * act * per_layer * layers * ga
    if par.pp > 1:
        act = mb * spec.seq_len * counts.hidden_size * dtype_bits(spec.precision.compute_dtype) / 8
        # One send forward and one backward per micro-batch at each stage boundary.
        out["pp_activations"] = 2 * act * ga / par.tp
    return out


def _reported_bytes(comm: dict) -> float | None:
    """Total bytes per step from the estimator's own `communication` section, if it has one."""
    for key in ("total_bytes", "bytes_per_step", "total_bytes_per_step"):
        if isinstance(comm.get(key), (int, float)):
            return float(comm[key])
    values = [v for k, v in comm.items() if k.endswith("bytes") and isinstance(v, (int, float))]
    if values:
        return float(sum(values))
    nested = [_reported_bytes(v) for v in comm.values() if isinstance(v, dict)]
    nested = [v for v in nested if v is not None]
    return float(sum(nested)) if nested else None


def _offload_parts(spec: JobSpec, trainable: int) -> tuple[tuple[float, float] | None, float | None]:
    """The offload terms of a layout, read once per LayoutTime: the optimizer offload's two
    terms (seconds), and the parameter offload's bytes per accumulation step (`at` multiplies
    by the steps and divides by the link, in that order, as the one expression did)."""
    par = spec.parallel
    shard = max(1, spec.num_gpus // (par.tp * par.pp)) if par.zero_stage or par.fsdp != "none" else 1
    local = trainable / shard
    optimizer = params = None
    if par.offload_optimizer != "none":
        # Gradients down and updated weights up over the host link (ZeRO-Offload, fig. 2).
        moved = 2 * local * _grad_bytes_per_elem(spec)
        optimizer = (moved / (PCIE_HOST_GBPS * 1e9), local / CPU_ADAM_PARAMS_PER_S)
    if par.offload_params != "none":
        # Parameters fetched for forward and again for backward (ZeRO-Infinity): 2 * local *
        # bytes per element * accumulation steps, left to right
        params = 2 * local * _grad_bytes_per_elem(spec)
    return optimizer, params
