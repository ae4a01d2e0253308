"""The backward of a trained DiTTransformer2DModel block (diffusers
models/transformers/dit_transformer_2d.py, BasicTransformerBlock with `ada_norm_zero`), as
the exact CPU meter sees it at the peak of the real step (bench/jobs dit-tiny rows).

A block's backward peaks at its first op with weights, ff.net.2's AddmmBackward0: the
gate's MulBackward0 has already run (and freed ff.net.2's output, which only it saved),
and the addmm's backward has just made the gradient of ff.net.2's input (b x n x f) and
ff.net.2's weight and bias gradients, beside the residual stream's gradient and the
gate's (b x n x h each). The weight gradients then go to AccumulateGrad: without `.grad`
they become it (stage_grads_at_peak), with `.grad` kept (accumulation) they are in flight
beside it until the in-place add (timeline.StepPlan.stage_grads_in_flight).

DiTTransformer2DModel.forward calls block 0's conditioning embedding a second time for the
output (`conditioning = self.transformer_blocks[0].norm1.emb(timestep, class_labels, ...)`),
so its parameters' AccumulateGrad nodes receive two gradients per backward: the engine
holds the first one, made in the output's backward, in the node's InputBuffer until the
second arrives in block 0's backward (torch/csrc/autograd/input_buffer.h `InputBuffer::add`:
"adding an input twice will accumulate the result"; the node runs once both producers have
run). It is alive at every block's backward peak (seen in the meter's trace: the
[1001, 128] embedding_dense_backward and the two Linears' mm results, one more of each than
there are `.grad`s).
Legend: b batch, n image tokens, h hidden, f feed-forward width, c compute dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.trainable import HeldParam
from vramplan.spec import Checkpointing, JobSpec, Method
from vramplan.units import nbytes

DIT = "DiTTransformer2DModel"
_FF_OUT = "denoiser/activations/blocks/ff.video_out"


def trained_dit(den: dict, spec: JobSpec) -> bool:
    """A fully trained DiT without full checkpointing: the block backward modelled here."""
    return (den.get("class") == DIT and spec.method is Method.FULL
            and spec.gradient_checkpointing is not Checkpointing.FULL)


def _hf(den: dict) -> tuple[int, int]:
    h = den["num_attention_heads"] * den["attention_head_dim"]
    return h, den.get("ff_mult", 4) * h


def ff_out_numel(den: dict) -> int:
    """ff.net.2's weight and bias (f -> h)."""
    h, f = _hf(den)
    return f * h + h


def conditioning_numel(den: dict) -> int:
    """Block 0's CombinedTimestepLabelEmbeddings (diffusers embeddings.py): the timestep
    embedder (linear_1 from Timesteps' 256 channels, linear_2 h -> h) and LabelEmbedding's
    table of num_embeds_ada_norm classes plus the dropped-label row (class_dropout_prob
    0.1 > 0: `use_cfg_embedding`)."""
    h, _ = _hf(den)
    return (256 * h + h) + (h * h + h) + (den.get("num_embeds_ada_norm", 1000) + 1) * h


def block_params(den: dict, per: int, w: str, i: int) -> list[HeldParam]:
    """Block i's weights: ff.net.2's, counted in stage i (they exist at its peak), and the
    rest, made after the peak, counted with the stage before it in backward order."""
    ff = ff_out_numel(den)
    return [HeldParam(f"blocks.{i}.ff.net.2", (ff,), w, True, "base", i),
            HeldParam(f"blocks.{i}", (per - ff,), w, True, "base", max(i - 1, 0))]


def acts_at_peak(stages: list[Breakdown]) -> list[Breakdown]:
    """Each block's saved tensors less ff.net.2's output (freed by the gate's MulBackward0)."""
    out = [Breakdown(terms={k: v for k, v in s.terms.items() if k != _FF_OUT}) for s in stages[:-1]]
    return out + stages[-1:]


def block_backward(den: dict, spec: JobSpec, b: int, n: int) -> Breakdown:
    """Above the block's saved tensors at ff.net.2's AddmmBackward0: the residual stream's
    and the gate's gradients (b x n x h), ff.net.2's input gradient (b x n x f), and block 0's
    conditioning-embedding gradients held in AccumulateGrad's InputBuffer (weight dtype)."""
    h, f = _hf(den)
    c, w = spec.precision.compute_dtype, spec.precision.weight_dtype
    return (Breakdown().add("denoiser/backward/grad_hidden", 2 * nbytes(b * n * h, c))
            .add("denoiser/backward/grad_ff", nbytes(b * n * f, c))
            .add("denoiser/backward/grad_conditioning_pending", nbytes(conditioning_numel(den), w)))


def grads_in_flight(den: dict, spec: JobSpec, n_stages: int) -> list[Breakdown]:
    """ff.net.2's incoming weight and bias gradients at each block's peak (none at the
    output stage), before AccumulateGrad adds them into `.grad`."""
    g = Breakdown().add("denoiser/backward/incoming_grad", nbytes(ff_out_numel(den), spec.precision.weight_dtype))
    return [g for _ in range(n_stages - 1)] + [Breakdown()]


__all__ = ["DIT", "acts_at_peak", "block_backward", "block_params", "conditioning_numel", "ff_out_numel",
           "grads_in_flight", "trained_dit"]
