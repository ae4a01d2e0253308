"""LLaVA-OneVision jobs: AnyRes tiles and tokens from the image size, the SigLIP tower's
stages and the projector before the Qwen2 language model's.

Source: transformers 5.24 models/llava_onevision/modeling_llava_onevision.py
LlavaOnevisionModel.forward: the token embeddings; `get_image_features` keeps each image's
tiles of the (images, most tiles, 3, side, side) pixel_values and concatenates them (a copy,
which the patch Conv2d saves when it trains), runs the tower (hidden_states[-1] captured),
projects every tile's patches and packs them per image; `torch.cat` of the packed features
is written into the embeddings with `masked_scatter` (saving its bool mask). One image per
sample is what the spec gives; with several, transformers tiles them all the same way
unless `batch_num_images` says otherwise.
Legend: b micro-batch, m images per sample, P tower inputs per image, n = b m P, t = g^2.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.components.arch_vit import VitCtx
from vramplan.components.graph import Param, Recorder
from vramplan.families.llava_onevision import forward
from vramplan.families.llava_onevision.vision import OnevisionDesc, image_tokens, tiles
from vramplan.jobs.vit_tower import held_tower, trained_tower
from vramplan.jobs.vlm import TowerPlan, grads_where, saved_items, within_positions
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, SpecError
from vramplan.units import nbytes


def visual_tokens(vis: OnevisionDesc, spec: JobSpec, lm: ModelDesc) -> int:
    v = spec.vision
    if v.num_videos:
        raise SpecError("vision.num_videos", "videos of LLaVA-OneVision are not modelled yet; set it to 0")
    return within_positions(v.num_images * image_tokens(vis, v.height, v.width), spec, lm)



def tower_plan(vis: OnevisionDesc, spec: JobSpec, S: int, lm: ModelDesc) -> TowerPlan:
    b, c, w = spec.micro_batch_size, spec.precision.compute_dtype, spec.precision.weight_dtype
    v, train = spec.vision, not spec.vision.freeze_vision_tower
    held = held_tower(vis, spec, train, untrained=("post_layernorm",))  # features taken before it
    per, side, ch = tiles(vis, v.height, v.width), vis.tower.image_size, vis.tower.num_channels
    n, t, e = b * v.num_images * per, vis.side ** 2, vis.tower.hidden_size
    ctx = VitCtx(vis.tower, {p.name.split(".", 1)[1]: Param(p.name, p.shape, p.dtype, p.trainable)
                             for p in held.params}, {})
    seen: set[int] = set()
    recs = [Recorder(backend=spec.backend.value, seen=seen)]
    pixels = recs[0].new("vision/pixel_values_cat", (n, ch, side, side), w, False)  # torch.cat of the tiles: a copy
    stages = []
    if train:
        recs[0].save(pixels)  # the patch Conv2d's input
        x = trained_tower(recs, ctx, pixels, vis.tower.num_layers, held, spec.backend.value, seen, stages)
    else:
        x = recs[0].new("vision/last_layer", (n, t, e), w, False)
    recs.append(Recorder(backend=spec.backend.value, seen=seen))
    forward.projector(recs[-1], ctx, x)
    saved = saved_items(recs[-1], "projector/activations")
    # masked_scatter saves its bool mask (b, S, 1) for the backward (derivatives.yaml).
    saved.add("projector/activations/image_token_mask", nbytes(b * S, "bool"))
    stages.append(("projector", saved, grads_where(held, lambda p: p.name.startswith("projector."),
                                                   "projector/gradients")))
    batch = Breakdown().add("batch/pixel_values", nbytes(b * v.num_images * per * ch * side * side, w)) \
        .add("batch/image_sizes", nbytes(b * v.num_images * 2, "int64"))
    tokens = b * v.num_images * image_tokens(vis, v.height, v.width)
    end = forward.forward_end(vis, n, tokens, train, c)
    frozen = None
    if not train:  # the tiles' copy, the embeddings' output and the layer's input stay alive meanwhile
        frozen = forward.layer_forward(vis, n, c).add("vision_tower/forward/pixel_values_cat", pixels.storage.nbytes) \
            .add("vision_tower/forward/held", (2 if vis.tower.num_layers > 1 else 1) * nbytes(n * t * e, c)) \
            .add("language_model/forward/inputs_embeds", nbytes(b * S * lm.hidden_size, c))
    inputs = {f"vision layer {i}": nbytes(n * t * e, w) for i in range(vis.tower.num_layers)}
    return TowerPlan(held, stages, frozen, batch, end, layer_inputs=inputs,
                     layer_forward=forward.layer_forward(vis, n, c), layer_backward=forward.layer_backward(vis, n, c))


def resolve(cfg: dict, name: str | None = None) -> tuple[OnevisionDesc, ModelDesc]:
    """LLaVA-OneVision: the SigLIP side, and the language model of its text_config (Qwen2
    by default); lm_head is tied when the outer or the text config says so
    (LlavaOnevisionConfig.__post_init__ copies the text config's flag)."""
    from vramplan.sources import model_from_hf_config
    from vramplan.families.llava_onevision.vision import vision_from_config
    text = {"model_type": "qwen2", **cfg.get("text_config", {})}
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))
    lm = model_from_hf_config(text, name=name or "llava_onevision")
    return vision_from_config(cfg, lm.hidden_size), lm


__all__ = ["resolve", "tower_plan", "visual_tokens"]
