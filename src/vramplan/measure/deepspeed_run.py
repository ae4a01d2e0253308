"""DeepSpeed ZeRO 1-3 run for real on CPU through the HF Trainer, one meter per rank.

Each of `num_gpus` ranks is a spawned process with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR ...) and `DS_ACCELERATOR=cpu` (deepspeed/accelerator/
real_accelerator.py get_accelerator). It calls `deepspeed.init_distributed(
dist_backend="gloo")` before the model is built, builds the job's random-init model
(vramplan.measure.build.build_model), and trains it with `transformers.Trainer` and
`TrainingArguments(use_cpu=True, deepspeed=<config>)`: the Trainer builds its own torch
optimizer and accelerate hands it with the model to `deepspeed.initialize`, which wraps it
in ZeRO (DeepSpeedZeroOptimizer for stages 1-2, DeepSpeedZeroOptimizer_Stage3).

The meter is entered before `Trainer.train()`, so the engine's flat partitions and
buffers are counted when DeepSpeed allocates them (phase `init`, not part of the step
peak). Phases come from the engine itself: `DeepSpeedEngine.forward` is `s{n}.fwd`,
`.backward` `s{n}.bwd` and `.step` `s{n}.opt` (accelerate's DeepSpeedEngineWrapper.backward
calls engine.backward then engine.step; the Trainer's optimizer.step is then a no-op).
The reported figures are the worst rank's peak over the step phases.
"""
from __future__ import annotations

import gc
import os
import socket
import tempfile
from typing import Any

import torch

from . import MeasureResult, phase_kinds
from .build import apply_method, build_model, job_dict, precision_dtypes
from .meter import MemoryMeter
from .run import make_inputs

STEP_PHASE_KINDS = ("fwd", "bwd", "opt")


def deepspeed_version() -> str | None:
    try:
        import deepspeed
    except ImportError:
        return None
    return deepspeed.__version__


def ds_config(job: dict) -> dict:
    """The DeepSpeed config the job's parallel section says (ZeRO knobs from
    parallel.extras pass through; DeepSpeed's defaults otherwise)."""
    par = job.get("parallel") or {}
    zero = {"stage": int(par.get("zero_stage", 0))}
    knobs = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
             "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
             "stage3_param_persistence_threshold", "stage3_max_reuse_distance", "zero_hpz_partition_size",
             "sub_group_size")
    zero.update({k: v for k, v in (par.get("extras") or {}).items() if k in knobs})
    precision = str(job.get("precision", "fp32"))
    if precision not in ("fp32", "mixed-bf16", "mixed-fp16"):
        raise ValueError(f"precision: DeepSpeed runs are measured for fp32, mixed-bf16 and mixed-fp16, "
                         f"got {precision!r}")
    return {"train_micro_batch_size_per_gpu": int(job.get("micro_batch_size", 1)),
            "gradient_accumulation_steps": int(job.get("grad_accum_steps", 1)),
            "gradient_clipping": float(job.get("max_grad_norm", 1.0)),
            "zero_optimization": zero,
            "bf16": {"enabled": precision == "mixed-bf16"},
            "fp16": {"enabled": precision == "mixed-fp16"}}


def _optim_name(job: dict) -> str:
    """TrainingArguments.optim for the job's optimizer: torch AdamW; adamw_torch leaves
    foreach=None, which is the for-loop on CPU tensors (torch/optim/optimizer.py
    _default_to_fused_or_foreach)."""
    opt, impl = str(job.get("optimizer", "adamw")), str(job.get("optimizer_impl", "forloop"))
    if opt not in ("adamw", "adam"):
        raise ValueError(f"optimizer: DeepSpeed runs are measured with torch AdamW, got {opt!r}")
    return {"fused": "adamw_torch_fused"}.get(impl, "adamw_torch")


class _RankMeter(MemoryMeter):
    """MemoryMeter that also follows in-place storage resizes (UntypedStorage.resize_)."""

    def __enter__(self):
        meter, original = self, torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original(storage, size)
            info = meter.live.get(id(storage))
            if info is not None:
                meter.current += storage.nbytes() - info.nbytes
                info.nbytes = storage.nbytes()
            meter._after_op()
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def _track(self, t, op):
        # DeepSpeed builds meta-device twins of the parameters to plan its partitions
        # (stage_1_and_2.py __init__: torch.zeros_like(param.data, device="meta")): no memory.
        if t.device.type != "meta":
            super()._track(t, op)

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)


def _phase_engine(meter: MemoryMeter) -> None:
    """Name the meter's phases after the engine call running (see the module docstring)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    counter = {"n": 0}

    def wrap(name: str, kind: str):
        original = getattr(DeepSpeedEngine, name)

        def call(self, *args, **kwargs):
            counter["n"] += kind == "fwd"
            meter.set_phase(f"s{max(counter['n'], 1)}.{kind}")
            return original(self, *args, **kwargs)

        setattr(DeepSpeedEngine, name, call)

    for name, kind in (("forward", "fwd"), ("backward", "bwd"), ("step", "opt")):
        wrap(name, kind)


def _checkpointing(job: dict) -> bool:
    """TrainingArguments.gradient_checkpointing for the spec's word ('none' | 'full')."""
    word = str(job.get("gradient_checkpointing", "none") or "none")
    if word not in ("none", "full", "False", "True"):
        raise ValueError(f"gradient_checkpointing: DeepSpeed runs are measured with 'none' or 'full', got {word!r}")
    return word in ("full", "True")


def _sequence_parallel(job: dict):
    """DeepSpeed Ulysses (ALST) through accelerate's ParallelismConfig(sp_backend="deepspeed"),
    as TrainingArguments(parallelism_config=...) takes it (transformers/trainer.py compute_loss ->
    integrations/deepspeed.py deepspeed_sp_compute_loss; accelerate/accelerator.py registers
    deepspeed's UlyssesSPAttentionHF and wraps the dataloader in UlyssesSPDataLoaderAdapter)."""
    u = int((job.get("parallel") or {}).get("ulysses", 1))
    if u == 1:
        return None
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig
    return ParallelismConfig(sp_backend="deepspeed", sp_size=u, sp_handler=DeepSpeedSequenceParallelConfig(
        sp_seq_length=int(job.get("seq_len", 1)), sp_seq_length_is_variable=False,
        sp_attn_implementation=str(job.get("attention", "sdpa"))))


def _dataset(job: dict, vocab: int, n: int) -> list[dict]:
    batch = make_inputs({**job, "micro_batch_size": 1}, vocab, "cpu")
    if _sequence_parallel(job) is not None:
        # UlyssesSPDataLoaderAdapter shards position_ids with the rest and refuses batches
        # without them (deepspeed/runtime/sequence_parallel/ulysses_sp.py refill).
        batch["position_ids"] = torch.arange(int(job["seq_len"])).unsqueeze(0)
    return [{k: v[0].clone() for k, v in batch.items()} for _ in range(n)]


def _rank(rank: int, world: int, port: int, job: dict, steps: int, trace: bool, queue) -> None:
    try:
        queue.put((rank, _rank_run(rank, world, port, job, steps, trace)))
    except Exception as exc:  # report, do not hang the parent on queue.get
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def _rank_run(rank: int, world: int, port: int, job: dict, steps: int, trace: bool) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import deepspeed
    from transformers import Trainer, TrainingArguments

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    b = int(job.get("micro_batch_size", 1))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="vramplan-ds-"), use_cpu=True, deepspeed=ds_config(job),
        per_device_train_batch_size=b, gradient_accumulation_steps=int(job.get("grad_accum_steps", 1)),
        max_steps=steps, optim=_optim_name(job), learning_rate=1e-4, max_grad_norm=float(job.get("max_grad_norm", 1.0)),
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        gradient_checkpointing=_checkpointing(job), parallelism_config=_sequence_parallel(job))
    # The arguments first, as the HF and TRL scripts parse them: under ZeRO-3 transformers then
    # builds the model inside deepspeed.zero.Init (modeling_utils `_from_config`,
    # is_deepspeed_zero3_enabled), which also swaps F.linear for zero3_linear_wrap. The method
    # as the scripts apply it: get_peft_model on the built model, then the Trainer.
    model = apply_method(build_model(job, "cpu", torch.float32), job, "cpu")
    model.train()
    data = _dataset(job, model.config.vocab_size, b * world * steps)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    gc.collect()
    meter = _RankMeter(trace=trace)
    meter.register([o for o in gc.get_objects() if isinstance(o, torch.Tensor)], "preexisting")
    _phase_engine(meter)
    meter.set_phase("init")
    with meter:
        trainer.train()
    meter.close()
    phases = {k: v for k, v in meter.phase_peaks.items() if k.rsplit(".", 1)[-1] in STEP_PHASE_KINDS}
    label = max(phases, key=phases.get)
    out = {"peak": phases[label], "peak_phase": label, "phase_peaks": dict(meter.phase_peaks),
           "params_bytes": _unique(p.ds_tensor if hasattr(p, "ds_tensor") else p for p in model.parameters()),
           # ZeRO++ hpZ's secondary partitions (partition_parameters.py _partition_param_sec)
           "hpz_secondary_bytes": _unique(p.ds_secondary_tensor for p in model.parameters()
                                          if getattr(p, "ds_secondary_tensor", None) is not None),
           "optimizer": type(trainer.optimizer.optimizer).__name__ if hasattr(trainer.optimizer, "optimizer")
           else type(trainer.optimizer).__name__}
    if trace:
        from .trace import Trace
        tr = Trace.from_meter(meter)
        out["trace"] = {name: tr.render(name, limit=40) for name in tr.names() if name in phases}
    deepspeed.comm.barrier()
    torch.distributed.destroy_process_group()
    return out


def _unique(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(job: dict, world: int, steps: int = 2, trace: bool = False, timeout: float = 900) -> list[dict]:
    """Every rank's figures (see _rank_run), rank order; RuntimeError if a rank failed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, steps, trace, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    errors = [f"rank {r}: {row['error']}" for r, row in sorted(rows.items()) if "error" in row]
    if errors:
        raise RuntimeError("DeepSpeed run failed: " + "; ".join(errors))
    return [rows[r] for r in sorted(rows)]


def _worst_phases(ranks: list[dict]) -> dict[str, int]:
    """Each phase's peak on its worst rank: ranks own different partitions and peak apart."""
    per_rank = [phase_kinds(r["phase_peaks"]) for r in ranks]
    return {k: max(p[k] for p in per_rank) for k in per_rank[0]}


def run_deepspeed(job: Any, trace: bool = False, steps: int = 2) -> MeasureResult:
    """Measure a ZeRO job (parallel.zero_stage, num_gpus ranks) with the real DeepSpeed."""
    version = deepspeed_version()
    if version is None:
        raise RuntimeError("DeepSpeed is not installed: pip install 'vramplan[measure]' (deepspeed)")
    jd = job_dict(job)
    precision_dtypes(str(jd.get("precision", "fp32")))
    ranks = run_ranks(jd, int(jd.get("num_gpus", 1)), steps=steps, trace=trace)
    worst = max(ranks, key=lambda r: r["peak"])
    stage = int((jd.get("parallel") or {}).get("zero_stage", 0))
    result = MeasureResult(
        device="cpu", peak_allocated_bytes=worst["peak"], phases=_worst_phases(ranks),
        params_bytes=worst["params_bytes"], grad_bytes=0, optimizer_state_bytes=0,
        activation_bytes_end_of_forward=0, peak_phase=worst["peak_phase"],
        phase_peaks={k: v for k, v in worst["phase_peaks"].items()},
        runner={"library": "deepspeed", "version": version, "entry": f"Trainer+ZeRO-{stage}",
                     "ranks": [r["peak"] for r in ranks], "dist_backend": "gloo",
                     "optimizer": worst["optimizer"]})
    if trace and worst.get("trace"):
        result.runner["trace"] = worst["trace"]
    return result
