"""A lower bound on a layout's device memory, known without estimating it.

`fit` rules a group of layouts out (those alike but for micro-batch) when the estimate of
its smallest micro-batch does not fit. On an 8B full fine-tune over 8 x 40 GB most groups
do not fit, and each estimate of an 8-GPU layout plans every pipeline stage
(parallel.rank_plan), 2-4 ms. This floor adds only terms the estimate itself adds, each
from the function the estimate takes it from, at events the estimate always has, so it
never exceeds the estimate:

  device_bytes = reserved + outside_allocator (+ managed >= 0)        (device.device_levels)
  reserved     = reserved_from_allocated(peak, largest logits block, activation churn),
                 monotone in each (components/runtime.py; no alloc_conf delta, no lengths);
                 on one GPU the allocator replay's reserve, which is >= the live peak;
  peak         = the largest event of the reported rank's plan, the pipeline stage with the
                 highest peak (parallel.plan.rank_plan), so >= every stage's "end of
                 forward" and "loss backward" events (timeline._walk always emits both) in
                 the plan parallel.plan._worst_backward builds first (k - 1 other
                 micro-batches in flight);
  those events = static + [gradients, without a pipeline when grad_accum_steps > 1] +
                 every saved activation of the stage + (last stage) the loss terms and
                 forward_end_transient or loss_backward_transient + the in-flight copies;
                 every term of a Breakdown is >= 0 (Breakdown.add), so any subset is a floor;
  static       >= the model states and the engines' persistent copies of the rank
                 (parallel.plan.stage_model_states: _model_states, DDP buckets, ZeRO's fp32
                 partition), the pipeline's resident buffers (parallel.pipeline
                 pipeline_static_bytes) and the cuBLAS workspaces (estimation.estimate_model);
  activations  = each stage's saved list as step.build.build_step names it, scaled by
                 parallel.activations.scale as parallel.plan._stage_plan scales it.

It declines (None) where another step adds to or changes those terms after planning:
several models, inference, a log-prob head folded in after planning (TRL's SFT head),
activation offloading, Ulysses, a dynamic-padding replay or an alloc_conf replay delta.
tests/test_fit_floor.py checks floor <= device_bytes over many layouts.
"""
from __future__ import annotations

from vramplan.components.activations import shared_plan, zero3_linear_wrap
from vramplan.components.memo import spec_key
from vramplan.components.optimizer import state_key
from vramplan.breakdown import Breakdown
from vramplan.components.runtime import blas_workspace_terms, reserved_from_allocated
from vramplan.components.trainable import param_set
from vramplan.device import outside_allocator, reserve_is_replayed
from vramplan.estimation import model_spec
from vramplan.jobs.logprob import sft_head
from vramplan.model import ModelDesc
from vramplan.parallel.activations import pipeline_in_flight as acts_in_flight
from vramplan.parallel.activations import scale
from vramplan.parallel.layout import Layout
from vramplan.parallel.pipeline import pipeline_static_bytes
from vramplan.parallel.plan import stage_model_states
from vramplan.parallel.shard import pp_layers
from vramplan.spec import Backend, JobSpec, SpecError, Task
from vramplan.spec.job import copy_with
from vramplan.spec.tasks import needs_several_models


class MemoryFloor:
    """Floors for one model on one GPU; the per-list sums are kept for the search."""

    def __init__(self, desc: ModelDesc | None, gpu):
        self.desc = desc
        self.gpu = gpu
        self._lists: dict[tuple, int] = {}   # (group, saved list's content, scaling) -> bytes
        self._by_id: dict[tuple, tuple] = {}  # (id of a saved list, group, scaling) -> (list, bytes)
        self._outside: dict[tuple, tuple[int, int]] = {}
        self._state_memo: dict[tuple, tuple] = {}
        self._acts: dict[tuple, tuple] = {}
        self._layouts: dict[int, tuple] = {}  # id of a layout spec -> (it, _head of it)

    def device_floor(self, spec: JobSpec, above: int | None = None, layout: JobSpec | None = None) -> int | None:
        """A lower bound on estimate_model(desc, spec, gpu).device_bytes (module docstring);
        None where none is claimed. With `above`, a weaker floor may be returned once it
        exceeds `above` (what a caller comparing with a limit needs). `layout`: `spec` at
        another batch split (plan/space.py Candidate.layout), whose model spec, layout and
        parameter set, which read no batch field, are kept for the splits a search asks."""
        desc = self.desc
        try:
            if layout is None:
                head = self._head(spec)
            else:
                hit = self._layouts.get(id(layout))
                if hit is None or hit[0] is not layout:
                    hit = self._layouts[id(layout)] = (layout, self._head(layout))
                head = hit[1]
            if head is None:
                return None
            mspec, lay, params = head
            if layout is not None:
                mspec = copy_with(mspec, micro_batch_size=spec.micro_batch_size, grad_accum_steps=spec.grad_accum_steps)
            exact = self._activations(mspec, lay, params) if above is None or mspec.micro_batch_size == 1 else None
            # plan/fit.py's fact 2: every saved activation, logit and input tensor is a
            # multiple of the micro-batch, so the plan at micro-batch 1 (every split list
            # has it, so a search plans it once) gives a floor for a larger one; the exact
            # plan is made only where that floor does not already exceed `above`
            small = exact or self._activations(copy_with(mspec, micro_batch_size=1), lay, params)
        except (SpecError, ValueError):
            return None                 # the estimate says why; claim nothing
        ranges = pp_layers(desc.num_layers, lay.pp, lay.extras.get("pp_layers"))
        if lay.pp > 1 and len(small[0]) != desc.num_layers + 2:
            return None                 # stages are embedding, layers..., head (parallel.plan._select)
        last = len(ranges) - 1
        accum = mspec.grad_accum_steps > 1   # build_step's grads_alive_in_forward (no pipeline)
        outside, workspaces = self._outside_bytes(mspec, lay)

        def floor(states: list[tuple[int, int]], acts: tuple[list[int], int, int]) -> int:
            per, loss, largest = acts
            best = 0
            for s, r in enumerate(ranges):   # (the workspaces: in every stage's static part)
                act = sum(per) if lay.pp == 1 else (sum(per[i + 1] for i in r) + (per[0] if s == 0 else 0)
                                                     + (per[-1] if s == last else 0))
                # the other micro-batches a pipeline stage holds: `int(others_n * one)` with
                # others_n = k - 1 in the plan parallel.plan._worst_backward builds first,
                # and `one` the stage's scaled saved activations, >= act
                others = acts_in_flight(lay, s, mspec.grad_accum_steps) - 1
                held, grads = states[s]
                if lay.pp > 1:          # the pipeline runtime's resident buffers (static)
                    held += pipeline_static_bytes(desc, mspec, lay, s)
                best = max(best, workspaces + held + (grads if accum else 0) + act + (loss if s == last else 0)
                           + (int(others * act) if others > 0 else 0))
            if mspec.backend is not Backend.CUDA:
                return best             # device.device_levels: the live peak itself
            if reserve_is_replayed(mspec):
                return best + outside   # the replay's reserve, never below the live peak
            if lay.pp > 1:              # which stage is reported, and so its reserve, is unknown
                return reserved_from_allocated(best, 0) + outside
            # one rank: its end-of-forward and loss-backward events hold these logits terms
            # (the largest block device.reserved_bytes reserves around is at least each)
            # and all its saved activations (the churn it takes a fraction of)
            return reserved_from_allocated(best, largest, sum(per)) + outside
        # without the model states first (still a floor): enough where it already exceeds
        # `above`, and the states need the rank's parameter sets
        def bound(acts: tuple[list[int], int, int]) -> int:
            partial = floor([(0, 0)] * len(ranges), acts)
            if (above is not None and partial > above) or (mspec.parallel.is_trivial and mspec.num_gpus <= 1):
                return partial
            return floor(self._states(mspec, lay, params), acts)
        if exact is None:
            weak = bound(small)
            if weak > above:
                return weak
            try:
                exact = self._activations(mspec, lay, params)
            except (SpecError, ValueError):
                return None
        return bound(exact)

    def _head(self, spec: JobSpec) -> tuple | None:
        """(model spec, Layout, parameter set) of `spec`, None where no floor is claimed:
        several models, inference, or where another step adds to or changes the terms
        after planning (module docstring). Reads no batch field."""
        desc = self.desc
        if desc is None or needs_several_models(spec) or spec.task is Task.INFERENCE:
            return None
        if spec.activation_offloading or spec.lengths is not None or spec.alloc_conf is not None:
            return None
        mspec = model_spec(desc, spec)
        if sft_head(mspec, desc.hidden_size, desc.vocab_size, bool(desc.final_logit_softcapping)) is not None:
            return None
        lay = Layout.of(mspec, desc.hidden_size)
        return None if lay.ulysses > 1 else (mspec, lay, param_set(desc, mspec))

    def _activations(self, spec: JobSpec, lay: Layout, params) -> tuple[list[int], int, int]:
        """From the step's activation plan (components/activations.py shared_plan,
        memoized on the model, the parameter set and spec_key, so kept here under the same
        key and what scale reads of the layout): each stage's saved activations on the rank;
        the last stage's loss terms (loss_saved and the larger of forward_end_transient and
        loss_backward_transient, scaled as parallel.plan._stage_plan scales them: the
        end-of-forward and loss-backward events hold one or the other); and the largest
        logits term among them (device.reserved_bytes reserves around the largest block)."""
        scaling = (lay.tp, lay.sp, lay.dtensor_tp, lay.seq_shards, lay.ulysses, self.desc.num_kv_heads)
        skey = spec_key(spec)
        key = None if skey is None else (id(params), skey, scaling, zero3_linear_wrap(spec))
        hit = self._acts.get(key) if key is not None else None
        if hit is not None and hit[0] is params:
            return hit[1]
        acts = shared_plan(self.desc, spec, params)     # read only
        per = [self._stage_total(st, lay, scaling) for st in acts.stages]
        parts = [scale(b, lay) for b in (acts.loss_saved, acts.forward_end_transient, acts.loss_backward_transient)]
        loss = parts[0].total() + max(parts[1].total(), parts[2].total())
        largest = max((v for part in parts for k, v in part.terms.items()
                       if k.startswith("logits/") or "/logits/" in k), default=0)
        if key is not None:
            self._acts[key] = (params, (per, loss, largest))
        return per, loss, largest

    def _stage_total(self, st, lay: Layout, scaling: tuple) -> int:
        """One stage's saved activations on the rank: step.build.build_step's breakdown of
        its saved list (the same names), scaled by parallel.activations.scale as
        parallel.plan._stage_plan scales it (`scaling`: what scale reads of the layout).
        Kept per content of the list (identical layers save alike; other micro-batches and
        layouts repeat lists) and scaling: the total reads nothing else."""
        group = "activations/layers" if st.label.startswith("layer") else f"activations/{st.label}"
        # first by the list's identity (layers and plans share lists, and the entry keeps
        # the list alive, so its id is not reused), then by its content
        hit = self._by_id.get((id(st.saved), group, scaling))
        if hit is not None:
            return hit[1]
        key = (group, tuple(st.saved), scaling)
        total = self._lists.get(key)
        if total is None:
            bd = Breakdown()
            for name, size in st.saved:
                bd.add(f"{group}/{name}", size)
            total = self._lists[key] = scale(bd, lay, scaling[-1]).total()
        self._by_id[(id(st.saved), group, scaling)] = (st.saved, total)
        return total

    def _states(self, spec: JobSpec, lay: Layout, params) -> list[int]:
        """parallel.plan.stage_model_states, kept per layout and parameter set."""
        key = (id(params), state_key(spec), spec.quantization, lay.tp, lay.pp, lay.dp, lay.ep,
               lay.cp, lay.shard_group, lay.engine, lay.zero_stage, lay.fsdp, lay.fsdp_version,
               lay.offload_optimizer, lay.offload_params, str(sorted(lay.extras.items())), lay.dtensor_tp)
        hit = self._state_memo.get(key)
        if hit is None or hit[0] is not params:
            hit = self._state_memo[key] = (params, stage_model_states(self.desc, spec, params))
        return hit[1]

    def _outside_bytes(self, spec: JobSpec, lay: Layout) -> tuple[int, int]:
        """(what nvidia-smi counts outside the allocator, the cuBLAS workspaces the
        estimate adds to the plan's static part), both as the estimate adds them (they
        depend on the GPU, the CUDA version and the process groups)."""
        key = (spec.backend, spec.cuda_version, spec.num_gpus, lay.dp, lay.tp, lay.cp, lay.pp, lay.ep,
               lay.shard_group, lay.engine)
        hit = self._outside.get(key)
        if hit is None:
            work = 0
            if spec.backend is Backend.CUDA:
                work = sum(v for _, v in blas_workspace_terms(self.gpu.name if self.gpu else None))
            hit = self._outside[key] = (outside_allocator(spec, self.gpu).total(), work)
        return hit
