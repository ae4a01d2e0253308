"""Pipeline parallelism's runtime buffers on one stage: the receive buffers and, for
torch.distributed.pipelining, the last stage's kept outputs."""
from __future__ import annotations

from vramplan.breakdown import Breakdown, shared
from vramplan.components.dtypes import dtypes_of
from vramplan.model import ModelDesc
from vramplan.parallel.layout import Layout
from vramplan.spec import JobSpec
from vramplan.spec.stack import Framework
from vramplan.timeline import StepPlan
from vramplan.units import nbytes


def pipeline_buffers(desc: ModelDesc, spec: JobSpec, lay: Layout, out: StepPlan, stage: int) -> None:
    """The pipeline runtime's buffers. Megatron and DeepSpeed allocate one send and one
    receive tensor per transfer (megatron/core/pipeline_parallel/p2p_communication.py
    _communicate: torch.empty per recv); torch.distributed.pipelining (torchtitan, plain
    PyTorch) keeps one receive buffer per micro-batch and the last stage's outputs
    (torch_pipelining below)."""
    terms = _terms(desc, spec, lay, stage)
    out.static.merge(terms["static"])
    if "current" not in terms:
        return
    last = stage == lay.pp - 1
    for t in shared([out.loss_backward_transient, *out.stage_backward_transient]):
        t.merge(terms["current"])
    # a fresh breakdown: the step's temporaries are memoized on the parameter set
    out.optimizer_temporaries = Breakdown().merge(out.optimizer_temporaries).merge(terms["current"])
    if last:
        out.backward_end_transient = Breakdown().merge(terms["current"]).merge(terms["merged"])


def _terms(desc: ModelDesc, spec: JobSpec, lay: Layout, stage: int) -> dict:
    """The framework's terms: {"static"} (Megatron, DeepSpeed) or torch_pipelining's."""
    compute = dtypes_of(spec).compute
    tokens = spec.micro_batch_size * (spec.seq_len // lay.seq_shards)
    act = nbytes(tokens * desc.hidden_size, compute) // (lay.tp if lay.sp else 1)
    if spec.stack.framework in (Framework.MEGATRON, Framework.DEEPSPEED):
        return {"static": Breakdown().add("pp/p2p_buffers", 2 * act)}
    logits = nbytes(tokens * -(-desc.vocab_size // lay.tp), compute)
    return torch_pipelining(stage == 0, stage == lay.pp - 1, spec.grad_accum_steps, act, logits)


def pipeline_static_bytes(desc: ModelDesc, spec: JobSpec, lay: Layout, stage: int) -> int:
    """The bytes `pipeline_buffers` adds to a stage's static part (every event holds them)."""
    return _terms(desc, spec, lay, stage)["static"].total()


def torch_pipelining(first: bool, last: bool, micro_batches: int, act_bytes: int, logits_bytes: int) -> dict:
    """What torch.distributed.pipelining keeps on a stage (torch/distributed/pipelining/
    stage.py, checked against the real schedules in bench/parallel/pp_cpu.py):
    * `_setup_forward_recv_info` gives every non-first stage one activation receive buffer
      per micro-batch (`args_recv_info[chunk_id]`, `_make_tensor_from_meta`), and
      `_setup_backward_recv_info` every non-last stage one gradient receive buffer per
      micro-batch; they are made at the first step and kept by the stage.
    * the last stage appends each micro-batch's output (the logits) to `output_chunks`
      (`forward_one_chunk`, for the schedule's merged return value) and clears them only at
      the next step's start: all of them are alive in the optimizer step, and the other
      micro-batches' while one runs its loss.
    * after the last backward the schedule concatenates them into the value `step()`
      returns (schedules.py _PipelineSchedule._merge_outputs -> microbatch.merge_chunks,
      torch.cat), with every gradient alive.
    Returns {"static": resident terms, "current": the running micro-batch's output chunk,
    alive after its forward (at its forward end it is the head's own logits), "merged": the
    concatenated outputs}."""
    static = Breakdown()
    recv = (0 if first else micro_batches) + (0 if last else micro_batches)
    static.add("pp/recv_buffers", recv * act_bytes)
    current, merged = Breakdown(), Breakdown()
    if last:
        merged.add("pp/merged_outputs", micro_batches * logits_bytes)
        static.add("pp/output_chunks", (micro_batches - 1) * logits_bytes)
        current.add("pp/output_chunks", logits_bytes)
    return {"static": static, "current": current, "merged": merged}
