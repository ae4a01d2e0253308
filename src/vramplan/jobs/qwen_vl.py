"""Qwen2-VL / Qwen2.5-VL jobs: the native-resolution tower's patches and tokens from the
spec's image and video sizes, and its stages before the language model's.

Source: transformers 5.24 models/qwen2_vl/modeling_qwen2_vl.py Qwen2VLModel.forward (and
Qwen2.5-VL's, the same): the token embeddings; `get_image_features` runs the whole tower
on every image of the batch as one flat patch sequence, the merger makes one token per
merge^2 patches; `torch.cat` of the per-image splits (a copy) is written into the
embeddings with `masked_scatter` (which saves its bool mask); videos take a second pass
of the tower the same way. The model's output keeps each pass's `pooler_output` (the
merger's output) until the end of forward. The language model then runs on
S = s + visual tokens positions with M-RoPE: (3, b, S) position ids from `get_rope_index`,
cos and sin of (b, S, d) after the section recomposition, like Qwen2's otherwise.
Legend: b micro-batch, s text tokens, N patches of a pass, u = merge^2, H LM width.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.graph import Param, Recorder
from vramplan.components.trainable import HeldParam, ParamSet
from vramplan.families.qwen2_vl import forward
from vramplan.families.qwen2_vl.vision import (IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, VIDEO_MAX_PIXELS,
                                               VIDEO_MIN_PIXELS, QwenVisionDesc, grid_thw, lm_tokens)
from vramplan.jobs.vlm import (
    TowerPlan, grads_where, refuse_trained_tower_with_lora, saved_items, within_positions,
)
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, SpecError
from vramplan.units import nbytes


def grids(vis: QwenVisionDesc, spec: JobSpec) -> dict[str, tuple[int, tuple[int, int, int]]]:
    """{'image'|'video': (count per sample, (t, h, w) patches of one)} for what the spec holds."""
    v = spec.vision
    out = {}
    if v.num_images:
        out["image"] = (v.num_images, _grid(vis, "vision.image_size", v.height, v.width, 1,
                                            v.min_pixels or IMAGE_MIN_PIXELS, v.max_pixels or IMAGE_MAX_PIXELS))
    if v.num_videos:
        out["video"] = (v.num_videos, _grid(vis, "vision.video_height", v.video_height or v.height,
                                            v.video_width or v.width, v.video_frames,
                                            v.video_min_pixels or VIDEO_MIN_PIXELS, v.video_max_pixels or VIDEO_MAX_PIXELS))
    return out


def _grid(vis, field, height, width, frames, lo, hi):
    try:
        return grid_thw(vis, height, width, frames, lo, hi)
    except ValueError as exc:
        raise SpecError(field, f"{exc} ({height} x {width} pixels); the processor refuses such an image") from None


def visual_tokens(vis: QwenVisionDesc, spec: JobSpec, lm: ModelDesc) -> int:
    """Language-model tokens per sample from the images and videos; more than the language
    model's positions (max_position_embeddings) is refused."""
    total = sum(count * lm_tokens(vis, grid) for count, grid in grids(vis, spec).values())
    return within_positions(total, spec, lm)


def _held(vis: QwenVisionDesc, spec: JobSpec, train_tower: bool) -> ParamSet:
    """The tower's parameters (`vision_tower.` + name under `visual.`), trained only in full
    fine-tuning, and the merger's (`projector.`), always trained (the projector of every
    VLM recipe here)."""
    refuse_trained_tower_with_lora(spec, train_tower)
    w = spec.precision.weight_dtype
    out = [HeldParam("vision_tower." + n, s, w, train_tower, "base", layer) for n, s, layer in vis.params()]
    out += [HeldParam("projector." + n, s, w, True, "base", None) for n, s in vis.merger_params()]
    return ParamSet(tuple(out))


def _ctx(vis: QwenVisionDesc, held: ParamSet) -> forward.TowerCtx:
    return forward.TowerCtx(vis, {p.name.split(".", 1)[1]: Param(p.name, p.shape, p.dtype, p.trainable)
                                  for p in held.params})


def _pass(vis, spec, held, n: int, rows: int, S: int, kind: str, grads: bool):
    """(label, saved, grads) stages of one pass of the tower over n patches."""
    ctx, seen, train = _ctx(vis, held), set(), not spec.vision.freeze_vision_tower
    pick = (lambda f: f) if grads else (lambda f: (lambda p: False))
    recs = [Recorder(backend=spec.backend.value, seen=seen)]
    pixels = recs[0].new(f"batch/pixel_values_{kind}", (n, vis.patch_dim), spec.precision.weight_dtype, False)
    seen.add(id(pixels.storage))  # the batch's own tensor, counted under batch/
    x = forward.embed(recs[0], ctx, pixels)
    out = []
    if train:
        recs[0].save(ctx.shared["cos"], ctx.shared["sin"])  # saved by every block's rotary products
        out.append((f"{kind} vision embeddings", saved_items(recs[0], "vision_tower/activations/embeddings"),
                    grads_where(held, pick(lambda p: p.layer is None and p.name.startswith("vision_tower.")))))
        for i in range(vis.depth):
            recs.append(Recorder(backend=spec.backend.value, seen=seen))
            x = forward.block(recs[-1], ctx, x, i)
            out.append((f"{kind} vision layer {i}", saved_items(recs[-1], "vision_tower/activations/layers"),
                        grads_where(held, pick(lambda p, i=i: p.layer == i))))
    else:
        x = recs[0].new("vision/last_hidden", (n, vis.hidden_size), spec.precision.weight_dtype, False)
    recs.append(Recorder(backend=spec.backend.value, seen=seen))
    forward.merger(recs[-1], ctx, x)
    saved = saved_items(recs[-1], "projector/activations")
    # masked_scatter saves its bool mask (b, S, 1) for the backward (derivatives.yaml).
    saved.add(f"projector/activations/{kind}_token_mask", nbytes(rows * S, "bool"))
    out.append((f"{kind} projector", saved, grads_where(held, pick(lambda p: p.name.startswith("projector.")),
                                                         "projector/gradients")))
    return out


def tower_plan(vis: QwenVisionDesc, spec: JobSpec, S: int, lm: ModelDesc) -> TowerPlan:
    b, c, w = spec.micro_batch_size, spec.precision.compute_dtype, spec.precision.weight_dtype
    train = not spec.vision.freeze_vision_tower
    held = _held(vis, spec, train)
    passes = grids(vis, spec)
    batch = Breakdown().add("batch/mm_token_type_ids", nbytes(b * S, "int64"))
    stages, frozen, end, inputs = [], Breakdown(), Breakdown(), {}
    for j, (kind, (count, grid)) in enumerate(passes.items()):
        t, h, gw = grid
        n = b * count * t * h * gw
        batch.add(f"batch/pixel_values_{kind}", nbytes(n * vis.patch_dim, w))
        batch.add(f"batch/{kind}_grid_thw", nbytes(b * count * 3, "int64"))
        # the last pass's backward runs first: it makes the gradients
        stages += _pass(vis, spec, held, n, b, S, kind, grads=j == len(passes) - 1)
        inputs.update({f"{kind} vision layer {i}": nbytes(n * vis.hidden_size, w) for i in range(vis.depth)})
        end.add(f"projector/forward/{kind}_outputs", nbytes(n // vis.merge_unit * vis.out_hidden_size, c))
        if not train:
            tr = forward.frozen_transient(vis, n, c)
            if tr.total() > frozen.total():
                frozen = tr
    return TowerPlan(held, stages, None if train else frozen, batch, end, mrope_rows(lm, spec, S), inputs)


def mrope_rows(lm: ModelDesc, spec: JobSpec, S: int) -> Breakdown:
    """Qwen2VLRotaryEmbedding.forward expands the (3, b, S) position ids, so cos and sin are
    (b, S, d) (every row its own positions) where Llama's are (1, S, d): the language
    model's record holds one row of each; the other b - 1 rows are added here. They are
    saved by every layer's rotary products."""
    b, d = spec.micro_batch_size, lm.head_dim
    rows = nbytes((b - 1) * S * d, spec.precision.weight_dtype)  # `.to(x.dtype)`: the embeddings' dtype
    return Breakdown().add("language_model/activations/embedding/rotary/cos_mrope_rows", rows) \
        .add("language_model/activations/embedding/rotary/sin_mrope_rows", rows)


__all__ = ["grids", "mrope_rows", "tower_plan", "visual_tokens"]
