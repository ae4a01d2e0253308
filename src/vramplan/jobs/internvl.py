"""InternVL jobs: tiles from the image size, InternViT's stages and the pixel-shuffle
projector before the language model's.

Source: transformers 5.24 models/internvl/modeling_internvl.py InternVLModel.forward: the
token embeddings; `get_image_features` runs InternViT on every tile of the batch
((tiles, 3, side, side) pixel_values), drops the class token, pixel-shuffles 2x2 patches
into one and projects them (256 tokens per 448 px tile); `masked_scatter` writes them into
the embeddings (saving its bool mask). The model's output keeps the tower's
last_hidden_state and the projector's output until the end of forward.
The processor (GotOcr2ImageProcessor, crop_to_patches) cuts each image into the tile grid
closest to its aspect ratio, plus a thumbnail when there are several tiles.
Legend: b micro-batch, m images per sample, T tiles per image, n = b m T, t tokens per tile.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.graph import Param, Recorder
from vramplan.families.internvl import forward
from vramplan.families.internvl.vision import MAX_TILES, InternVisionDesc, num_tiles
from vramplan.jobs.vit_tower import held_tower
from vramplan.jobs.vlm import (
    TowerPlan, grads_where, saved_items, within_positions,
)
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, SpecError
from vramplan.units import nbytes


def tiles_per_image(vis: InternVisionDesc, spec: JobSpec) -> int:
    v = spec.vision
    if v.num_videos:
        raise SpecError("vision.num_videos", "this model's vision tower takes images only; set it to 0")
    return num_tiles(vis, v.height, v.width, max_tiles=v.max_tiles or MAX_TILES)


def visual_tokens(vis: InternVisionDesc, spec: JobSpec, lm: ModelDesc) -> int:
    total = spec.vision.num_images * tiles_per_image(vis, spec) * vis.tokens_per_tile
    return within_positions(total, spec, lm)



def tower_plan(vis: InternVisionDesc, spec: JobSpec, S: int, lm: ModelDesc) -> TowerPlan:
    b, c, w = spec.micro_batch_size, spec.precision.compute_dtype, spec.precision.weight_dtype
    train = not spec.vision.freeze_vision_tower
    held = held_tower(vis, spec, train)
    n = b * spec.vision.num_images * tiles_per_image(vis, spec)
    t, side = vis.patches + 1, vis.image_size
    ctx = forward.TowerCtx(vis, {p.name.split(".", 1)[1]: Param(p.name, p.shape, p.dtype, p.trainable)
                                 for p in held.params})
    seen: set[int] = set()
    recs = [Recorder(backend=spec.backend.value, seen=seen)]
    pixels = recs[0].new("batch/pixel_values", (n, vis.num_channels, side, side), w, False)
    seen.add(id(pixels.storage))  # the batch's own tensor, counted under batch/
    stages = []
    if train:
        x = forward.embed(recs[0], ctx, pixels)
        stages.append(("vision embeddings", saved_items(recs[0], "vision_tower/activations/embeddings"),
                       grads_where(held, lambda p: p.layer is None and p.name.startswith("vision_tower."))))
        for i in range(vis.num_layers):
            recs.append(Recorder(backend=spec.backend.value, seen=seen))
            x = forward.layer(recs[-1], ctx, x, i)
            stages.append((f"vision layer {i}", saved_items(recs[-1], "vision_tower/activations/layers"),
                           grads_where(held, lambda p, i=i: p.layer == i)))
    else:
        x = recs[0].new("vision/last_hidden", (n, t, vis.hidden_size), w, False)
    recs.append(Recorder(backend=spec.backend.value, seen=seen))
    out = forward.projector(recs[-1], ctx, x)
    saved = saved_items(recs[-1], "projector/activations")
    # masked_scatter saves its bool mask (b, S, 1) for the backward (derivatives.yaml).
    saved.add("projector/activations/image_token_mask", nbytes(b * S, "bool"))
    stages.append(("projector", saved, grads_where(held, lambda p: p.name.startswith("projector."),
                                                   "projector/gradients")))
    batch = Breakdown().add("batch/pixel_values", nbytes(n * vis.num_channels * side * side, w))
    # InternVLModel returns image_outputs: the tower's last_hidden_state (not saved by any
    # op: the shuffle copies it) and the projector's output, until the end of forward.
    end = Breakdown().add("vision_tower/forward/last_hidden_state", nbytes(n * t * vis.hidden_size, c)) \
        .add("projector/forward/outputs", nbytes(out.numel, c))
    frozen = None if train else forward.frozen_transient(vis, n, c)
    inputs = {f"vision layer {i}": nbytes(n * t * vis.hidden_size, w) for i in range(vis.num_layers)}
    return TowerPlan(held, stages, frozen, batch, end, layer_inputs=inputs)


__all__ = ["tiles_per_image", "tower_plan", "visual_tokens"]
