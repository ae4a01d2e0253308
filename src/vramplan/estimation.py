"""estimate(spec) -> Estimate: one GPU's memory through a training step, in named terms."""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components import kept_logits, qlora_prep, trl_sft_metrics
from vramplan.components.activations import plan_activations
from vramplan.catalog.quant_config import input_dtype_compute, resolve as resolve_quantization
from vramplan.components.dtypes import resolve_load_dtype
from vramplan.components.memo import by_key, spec_key
from vramplan.components.runtime import blas_workspace_terms
from vramplan.components.trainable import ParamSet, param_set
from vramplan.components.weights import weight_terms
from vramplan.device import (  # noqa: F401 (re-exported: the device levels lived here)
    allocator_replayer, device_levels, outside_allocator, replay_capacity, reserve_is_replayed, reserved_bytes,
    step_events,
)
from vramplan.i18n import Msg
from vramplan.jobs.logprob import head_note, resolve_head, sft_head
from vramplan.jobs.trained import head_grads_after_fold, with_loss
from vramplan.model import ModelDesc
from vramplan.result import SCHEMA_VERSION, Estimate  # noqa: F401 (re-exported: Estimate lived here)
from vramplan.spec import Backend, JobSpec, LogprobHead, SpecError, Task
from vramplan.step.build import rank_step
from vramplan.timeline import Event, peak_event, phase_peaks, walk
from vramplan.units import nbytes


def estimate(spec: JobSpec) -> Estimate:
    """Resolve the model and GPU (edges: catalog, file or cache), then the pure core."""
    from vramplan.catalog import find_gpu
    from vramplan.spec.tasks import needs_several_models
    from vramplan.spec import SpecError
    from vramplan.validity import check_size
    try:
        gpu = find_gpu(spec.gpu) if spec.gpu else None
    except KeyError as exc:  # catalog.UnknownNameError: its message suggests the nearest name
        raise SpecError("gpu", str(exc)) from None
    if needs_several_models(spec):  # several models: per-model sections (vramplan.jobs)
        from vramplan.jobs import estimate_job
        est = estimate_job(spec, gpu)
    else:
        from vramplan.parallel.host import resolve_local
        from vramplan.sources import resolve_model
        from vramplan.importers.lengths import resolve_lengths
        spec = resolve_local(spec)  # parallel.extras.host_memory_bytes: "local" -> this machine's RAM
        spec = resolve_lengths(spec)  # lengths.lengths_file: read and summarised here, at the edge
        est = estimate_model(resolve_model(spec), spec, gpu)
    check_size(max(est.device_bytes, est.peak_allocated_bytes), est.spec)
    return est


def model_spec(desc: ModelDesc, spec: JobSpec) -> JobSpec:
    """The spec as the estimate of `desc` reads it: the checkpoint's quantization and load
    dtype filled in, and a seq_len not given capped at its learned positions (what
    estimate_model estimates)."""
    from vramplan.validity import assume_seq_len, resolve_attention
    spec = resolve_attention(desc, assume_seq_len(desc, spec))
    spec = input_dtype_compute(resolve_quantization(spec, desc.checkpoint_quantization, desc.checkpoint_dtype))
    return resolve_load_dtype(spec, desc.checkpoint_dtype)


def estimate_model(desc: ModelDesc, spec: JobSpec, gpu=None) -> Estimate:
    given, spec = spec, model_spec(desc, spec)
    from vramplan.validity import attention_note, check_job
    checked = check_job(desc, spec) + attention_note(desc, given, spec)  # SpecError for a job the libraries refuse
    params = param_set(desc, spec)
    managed = Breakdown()
    par = None
    if spec.task is Task.INFERENCE:
        events = _inference_events(desc, spec, params, gpu)
    else:
        acts = plan_activations(desc, spec, params)
        head = sft_head(spec, desc.hidden_size, desc.vocab_size, bool(desc.final_logit_softcapping))
        if head is not None:  # TRL's SFTTrainer: the chunked log-prob head, not the model's loss
            if spec.keep_logits:
                raise SpecError("keep_logits", "TRL's SFTTrainer computes its loss in a fused log-prob head that "
                                "never builds the logits; drop keep_logits")
            with_loss(acts, head, params)
        plan = rank_step(desc, spec, params, acts, managed)
        if head is not None:
            head_grads_after_fold(plan)
            for key in ("batch/labels", "batch/attention_mask"):  # its collator's (sft_trainer.py)
                plan.static.add(key, nbytes(spec.micro_batch_size * spec.seq_len, "int64"))
        par = plan.parallel
        if spec.backend is Backend.CUDA:
            for key, value in blas_workspace_terms(gpu.name if gpu else None):
                plan.static.add(key, value)
        events = walk(plan)
    top = peak_event(events)
    components = top.live
    peak = components.total()
    phases = phase_peaks(events)
    phases[top.phase] = peak
    replayer, conf_delta, replayed = None, 0, None
    if spec.backend is Backend.CUDA and spec.task is not Task.INFERENCE:
        replayer = allocator_replayer(spec, gpu, plan, desc, params if par is None else None, managed.total())
        if reserve_is_replayed(spec):
            # the caching allocator model's replay of the step's per-parameter tensor events
            # (device.reserved_bytes says why, with figures)
            replayed = _replayed_reserve(spec, gpu, replayer)
        elif _changes_placement(spec.alloc_conf):
            conf_delta = replayer().reserved_bytes - replayer(default=True).reserved_bytes
    lengths = None
    if replayer is not None and spec.lengths is not None:
        lengths = _lengths_replay(spec, gpu, desc, params, par is None, managed.total())
    reserved, device = device_levels(spec, gpu, events, top, managed.total(), conf_delta, replayed)
    if lengths is not None:
        extra = lengths.applied(reserved, replay_capacity(spec, gpu, managed.total()), replayed is not None)
        reserved, device = reserved + extra, device + extra
    if spec.task is Task.SFT and resolve_head(spec) is LogprobHead.CHUNKED:
        checked = checked + [head_note(spec)]
    notes = checked + [Msg("LoRA target or modules_to_save {target} matches no module of {model}; PEFT would ignore it",
                           target=repr(t), model=desc.name) for t in params.unmatched_targets]
    notes += qlora_prep.notes(spec) + trl_sft_metrics.notes(spec) + kept_logits.notes(spec, desc)
    if spec.lengths is not None:
        from vramplan.step.lengths import lengths_notes
        notes += lengths_notes(spec, lengths)
    if spec.compile:
        notes.append(Msg("compile: torch.compile's fusion is not modelled; it saves fewer activations and "
                         "temporaries, so this estimate is likely high for a compiled run"))
    if spec.alloc_conf and "cudaMallocAsync" in spec.alloc_conf:
        notes.append(Msg("alloc_conf backend:cudaMallocAsync: the driver's memory pool is not modelled; "
                         "reserved memory is estimated as for PyTorch's caching allocator"))
    return Estimate(spec=spec, model=desc, num_params=desc.num_params(),
                    trainable_params=params.numel(trainable=True), peak_allocated_bytes=peak,
                    peak_phase=top.phase, peak_event=top.label, phases=phases,
                    components=components, reserved_bytes=reserved, device_bytes=device,
                    events=events, gpu=gpu, notes=notes + (par.notes if par else []), parallel=par,
                    managed_bytes=managed.total(), replay=replayer, lengths=lengths)


def _replayed_reserve(spec: JobSpec, gpu, replayer) -> int:
    """max_memory_reserved of the replay, memoized per spec and GPU (components/memo.py, which
    memo.clear() forgets): the same job estimated again (a notebook's loop, a search's
    repeated probe) replays once."""
    fields = spec_key(spec, frozenset())
    if fields is None:
        return replayer().reserved_bytes
    return by_key(("replayed_reserve", fields, gpu.name if gpu else None), lambda: replayer().reserved_bytes)


def _changes_placement(alloc_conf: str | None) -> bool:
    """Whether alloc_conf moves blocks in the caching allocator (the pinned-memory and
    locking options do not; backend:cudaMallocAsync bypasses it and is not modelled)."""
    from vramplan.spec.alloc_conf import AllocConf, parse_alloc_conf
    conf = parse_alloc_conf(alloc_conf)
    return conf.backend == "native" and conf != AllocConf()


def _lengths_replay(spec: JobSpec, gpu, desc: ModelDesc, params: ParamSet, split: bool, outside: int):
    """Dynamic padding (spec.lengths): the run's steps of different lengths through one
    allocator (vramplan.step.lengths); its extra_bytes joins the reserve like conf_delta."""
    from vramplan.spec import SpecError
    from vramplan.spec.alloc_conf import parse_alloc_conf
    from vramplan.step.lengths import length_ops, replay_lengths
    if not spec.lengths.resolved:
        raise SpecError("lengths.lengths_file", "not read yet: vramplan.estimate and the CLI read it "
                        "(vramplan.importers.lengths.resolve_lengths)")
    setup, ops_for = length_ops(desc, spec, params, split, blas_workspace_terms(gpu.name if gpu else None))
    return replay_lengths(spec.lengths, spec.micro_batch_size, spec.seq_len, setup, ops_for,
                          parse_alloc_conf(spec.alloc_conf), replay_capacity(spec, gpu, outside))


def _inference_events(desc: ModelDesc, spec: JobSpec, params: ParamSet, gpu) -> list[Event]:
    from vramplan.components.inference import inference_terms
    persistent, transient = inference_terms(desc, spec, spec.max_new_tokens or 0)
    live = weight_terms(spec, params).merge(persistent).merge(transient)
    live.add("batch/input_ids", nbytes(spec.micro_batch_size * spec.seq_len, "int64"))
    if spec.backend is Backend.CUDA:
        for key, value in blas_workspace_terms(gpu.name if gpu else None, training=False):
            live.add(key, value)
    return [Event("forward", "no-grad forward", live)]
