"""A lower bound on a layout's device memory, known without estimating it.

`fit` rules a group of layouts out (those alike but for micro-batch) when the estimate of
its smallest micro-batch does not fit. On an 8B full fine-tune over 8 x 40 GB most groups
fail by their saved activations alone, and each such estimate of an 8-GPU layout plans
every pipeline stage (parallel.rank_plan), 2-4 ms. This floor reads only what the
estimate itself adds at one of its events, so it never exceeds the estimate:

  device_bytes = reserved + outside_allocator (+ managed, >= 0)        (device.device_levels)
  reserved    >= round_up(peak allocated) >= peak allocated      (runtime.reserved_from_allocated)
  peak         = the largest event of the reported rank's plan, and the reported rank is
                 the pipeline stage with the highest peak (parallel.plan.rank_plan), so
                 peak >= the "end of forward" event of every stage's plan;
  end of forward = static + [grads] + every saved activation of the stage + loss terms
                 (timeline._walk); every term of a Breakdown is >= 0 (Breakdown.add), so it
                 is >= the stage's saved activations plus the static cuBLAS workspaces the
                 estimate adds to the plan (estimation.estimate_model);
  a stage's saved activations = its stages' saved lists (step.build.build_step), each
                 term scaled by parallel.activations.scale: ceil-divided by tp, by the
                 sequence shards, or kept whole, so each is >= its value // (tp * shards).

The floor is `outside_allocator + workspaces + max over pipeline stages of the scaled-down
saved activations`; it declines (None) where another step adds to or changes those terms
after planning: several models, inference, a log-prob head folded in after planning
(TRL's SFT head), activation offloading, Ulysses (it reshapes k/v), a dynamic-padding
replay or an alloc_conf replay delta (either may lower the level).
tests/test_fit_floor.py checks floor <= device_bytes over many layouts.
"""
from __future__ import annotations

from vramplan.components.activations import plan_activations
from vramplan.components.optimizer import state_key
from vramplan.components.runtime import blas_workspace_terms
from vramplan.components.trainable import param_set
from vramplan.device import outside_allocator
from vramplan.estimation import model_spec
from vramplan.jobs.logprob import sft_head
from vramplan.model import ModelDesc
from vramplan.parallel.activations import LOSS_PARALLEL_NONE as DROPPED_UNDER_LOSS_PARALLEL
from vramplan.parallel.activations import pipeline_in_flight as acts_in_flight
from vramplan.parallel.layout import Layout
from vramplan.parallel.pipeline import pipeline_static_bytes
from vramplan.parallel.plan import stage_model_states
from vramplan.parallel.shard import pp_layers
from vramplan.spec import Backend, JobSpec, SpecError, Task
from vramplan.spec.tasks import needs_several_models


class MemoryFloor:
    """Floors for one model on one GPU; the per-list sums are kept for the search."""

    def __init__(self, desc: ModelDesc | None, gpu):
        self.desc = desc
        self.gpu = gpu
        self._lists: dict[tuple[int, int], tuple[list, int]] = {}   # (id(saved), k) -> (saved, floor)
        self._outside: dict[tuple, int] = {}
        self._state_memo: dict[tuple, tuple] = {}

    def device_floor(self, spec: JobSpec, above: int | None = None) -> int | None:
        """A lower bound on estimate_model(desc, spec, gpu).device_bytes (module docstring);
        None where none is claimed. With `above`, a weaker floor may be returned once it
        exceeds `above` (what a caller comparing with a limit needs)."""
        desc = self.desc
        if desc is None or needs_several_models(spec) or spec.task is Task.INFERENCE:
            return None
        if spec.activation_offloading or spec.lengths is not None or spec.alloc_conf is not None:
            return None
        try:
            mspec = model_spec(desc, spec)
            if sft_head(mspec, desc.hidden_size, desc.vocab_size, bool(desc.final_logit_softcapping)) is not None:
                return None
            lay = Layout.of(mspec, desc.hidden_size)
            if lay.ulysses > 1:
                return None
            params = param_set(desc, mspec)
            acts = plan_activations(desc, mspec, params)
        except (SpecError, ValueError):
            return None                 # the estimate says why; claim nothing
        k = lay.tp * lay.seq_shards
        per = [self._saved_floor(st.saved, k) for st in acts.stages]
        ranges = pp_layers(desc.num_layers, lay.pp, lay.extras.get("pp_layers"))
        if lay.pp > 1 and len(per) != desc.num_layers + 2:
            return None                 # stages are embedding, layers..., head (parallel.plan._select)
        last = len(ranges) - 1
        # the last stage's loss terms, as parallel.plan._stage_plan scales them; the loss
        # backward event holds loss_backward_transient instead of forward_end_transient
        loss = self._terms_floor(acts.loss_saved, k, lay) + max(self._terms_floor(acts.forward_end_transient, k, lay),
                                                                 self._terms_floor(acts.loss_backward_transient, k, lay))
        accum = mspec.grad_accum_steps > 1   # build_step's grads_alive_in_forward (no pipeline)
        outside = self._outside_bytes(mspec, lay)

        def floor(states: list[tuple[int, int]]) -> int:
            best = 0
            for s, r in enumerate(ranges):
                act = sum(per) if lay.pp == 1 else (sum(per[i + 1] for i in r) + (per[0] if s == 0 else 0)
                                                     + (per[-1] if s == last else 0))
                # the other micro-batches a pipeline stage holds: `int(others_n * one)` with
                # others_n = k - 1 in the plan parallel.plan._worst_backward builds first,
                # and `one` the stage's scaled saved activations, >= act
                others = acts_in_flight(lay, s, mspec.grad_accum_steps) - 1
                held, grads = states[s]
                if lay.pp > 1:          # the pipeline runtime's resident buffers (static)
                    held += pipeline_static_bytes(desc, mspec, lay, s)
                best = max(best, held + (grads if accum else 0) + act + (loss if s == last else 0)
                           + (int(others * act) if others > 0 else 0))
            return best + outside
        # without the model states first (still a floor): enough where it already exceeds
        # `above`, and the states need the rank's parameter sets
        partial = floor([(0, 0)] * len(ranges))
        if (above is not None and partial > above) or (mspec.parallel.is_trivial and mspec.num_gpus <= 1):
            return partial
        return floor(self._states(mspec, lay, params))

    @staticmethod
    def _terms_floor(bd, k: int, lay: Layout) -> int:
        """Each term // k, as parallel.activations.scale at least keeps it; the logits
        gradient vocab-parallel loss drops is left out."""
        return sum(v // k for name, v in bd.terms.items()
                   if not (lay.tp > 1 and lay.dtensor_tp and name.endswith(DROPPED_UNDER_LOSS_PARALLEL)))

    def _states(self, spec: JobSpec, lay: Layout, params) -> list[int]:
        """parallel.plan.stage_model_states, kept per layout and parameter set."""
        key = (id(params), state_key(spec), spec.quantization, lay.tp, lay.pp, lay.dp, lay.ep,
               lay.cp, lay.shard_group, lay.engine, lay.zero_stage, lay.fsdp, lay.fsdp_version,
               lay.offload_optimizer, lay.offload_params, str(sorted(lay.extras.items())), lay.dtensor_tp)
        hit = self._state_memo.get(key)
        if hit is None or hit[0] is not params:
            hit = self._state_memo[key] = (params, stage_model_states(self.desc, spec, params))
        return hit[1]

    def _saved_floor(self, saved: list, k: int) -> int:
        key = (id(saved), k)
        hit = self._lists.get(key)
        if hit is None or hit[0] is not saved:
            hit = self._lists[key] = (saved, sum(size // k for _, size in saved))
        return hit[1]

    def _outside_bytes(self, spec: JobSpec, lay: Layout) -> int:
        """What nvidia-smi counts outside the allocator plus the cuBLAS workspaces, both as
        the estimate adds them (they depend on the GPU, CUDA version and process groups)."""
        key = (spec.backend, spec.cuda_version, spec.num_gpus, lay.dp, lay.tp, lay.cp, lay.pp, lay.ep,
               lay.shard_group, lay.engine)
        hit = self._outside.get(key)
        if hit is None:
            hit = outside_allocator(spec, self.gpu).total()
            if spec.backend is Backend.CUDA:
                hit += sum(v for _, v in blas_workspace_terms(self.gpu.name if self.gpu else None))
            self._outside[key] = hit
        return hit
