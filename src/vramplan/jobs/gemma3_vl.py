"""Gemma 3 multimodal jobs: mm_tokens_per_image tokens per image, the SigLIP tower's stages
and the pooling projector before the language model's.

Source: transformers 5.24 models/gemma3/modeling_gemma3.py Gemma3Model.forward: the
(scaled) token embeddings; `get_image_features` runs the SigLIP tower on every image of the
batch ((images, 3, side, side) pixel_values, side = the tower's 896), its last_hidden_state
(after post_layernorm) through Gemma3MultiModalProjector (256 tokens per image);
`masked_scatter` writes them into the embeddings (saving its bool mask). The model's output
keeps the tower's last_hidden_state and the projector's output until the end of forward.
With the processor's `token_type_ids`, image tokens attend to each other both ways
(create_masks_for_vision_model), so every layer, the global ones too, gets an explicit
(b, 1, S, S) mask instead of SDPA's is_causal (components/arch.py sdpa_gets_mask).
Legend: b micro-batch, m images per sample, n = b m, t patches per image.
"""
from __future__ import annotations

from dataclasses import replace

from vramplan.breakdown import Breakdown
from vramplan.components.arch_vit import VitCtx
from vramplan.components.graph import Param, Recorder
from vramplan.families.common import TowerCtx
from vramplan.families.gemma3_vl import forward
from vramplan.families.gemma3_vl.vision import Gemma3VisionDesc
from vramplan.jobs.vit_tower import held_tower, trained_tower
from vramplan.jobs.vlm import TowerPlan, grads_where, saved_items, within_positions
from vramplan.model import ModelDesc
from vramplan.spec import JobSpec, SpecError
from vramplan.units import nbytes


def visual_tokens(vis: Gemma3VisionDesc, spec: JobSpec, lm: ModelDesc) -> int:
    if spec.vision.num_videos:
        raise SpecError("vision.num_videos", "this model's vision tower takes images only; set it to 0")
    return within_positions(spec.vision.num_images * vis.mm_tokens_per_image, spec, lm)



def tower_plan(vis: Gemma3VisionDesc, spec: JobSpec, S: int, lm: ModelDesc) -> TowerPlan:
    b, c, w = spec.micro_batch_size, spec.precision.compute_dtype, spec.precision.weight_dtype
    train = not spec.vision.freeze_vision_tower
    held = held_tower(vis, spec, train)
    n, t, e, side = b * spec.vision.num_images, vis.patches, vis.tower.hidden_size, vis.tower.image_size
    params = {p.name.split(".", 1)[1]: Param(p.name, p.shape, p.dtype, p.trainable) for p in held.params}
    vit, ctx = VitCtx(vis.tower, params, {}), TowerCtx(vis, params)
    seen: set[int] = set()
    recs = [Recorder(backend=spec.backend.value, seen=seen)]
    pixels = recs[0].new("batch/pixel_values", (n, vis.tower.num_channels, side, side), w, False)
    seen.add(id(pixels.storage))  # the batch's own tensor, counted under batch/
    stages = []
    if train:
        x = trained_tower(recs, vit, pixels, vis.tower.num_layers, held, spec.backend.value, seen, stages)
    else:
        x = recs[0].new("vision/last_layer", (n, t, e), w, False)
    recs.append(Recorder(backend=spec.backend.value, seen=seen))
    out = forward.projector(recs[-1], ctx, x)
    saved = saved_items(recs[-1], "projector/activations")
    # masked_scatter saves its bool mask (b, S, 1) for the backward (derivatives.yaml).
    saved.add("projector/activations/image_token_mask", nbytes(b * S, "bool"))
    stages.append(("projector", saved, grads_where(held, lambda p: p.name.startswith("projector."),
                                                   "projector/gradients")))
    batch = Breakdown().add("batch/pixel_values", nbytes(n * vis.tower.num_channels * side * side, w)) \
        .add("batch/token_type_ids", nbytes(b * S, "int64"))
    # Gemma3Model returns image_outputs: the tower's last_hidden_state (post_layernorm's
    # output) and the projector's output, until the end of forward.
    end = Breakdown().add("vision_tower/forward/last_hidden_state", nbytes(n * t * e, c)) \
        .add("projector/forward/outputs", nbytes(out.numel, c))
    frozen = None
    if not train:  # the token embeddings (scaled) are made first and alive meanwhile
        frozen = forward.frozen_transient(vis, n, c).add("language_model/forward/inputs_embeds",
                                                          nbytes(b * S * lm.hidden_size, c))
    inputs = {f"vision layer {i}": nbytes(n * t * e, w) for i in range(vis.tower.num_layers)}
    return TowerPlan(held, stages, frozen, batch, end, layer_inputs=inputs,
                     layer_forward=forward.layer_forward(vis, n, c), layer_backward=forward.layer_backward(vis, n, c))


def language_model(lm: ModelDesc, spec: JobSpec) -> ModelDesc:
    """The language model as the image tokens' mask makes it: an explicit mask on every
    layer. Flash attention would drop that mask, and transformers refuses it
    (Gemma3ForConditionalGeneration._supports_flash_attn = False)."""
    if spec.attention.value == "flash":
        raise SpecError("attention", "Gemma 3 with images needs the bidirectional image-token mask, which flash "
                        "attention drops (transformers refuses it); use sdpa or eager")
    return replace(lm, mask_every_layer=True)




def resolve(cfg: dict, name: str | None = None) -> tuple[Gemma3VisionDesc, ModelDesc]:
    """Gemma 3: the SigLIP side, and the language model of its text_config (catalog/hf.py
    reads a `gemma3` config that way); tie_word_embeddings is the outer config's
    (Gemma3Config, default true), which ties lm_head to the embeddings."""
    from vramplan.sources import model_from_hf_config
    text = {"model_type": "gemma3_text", **cfg.get("text_config", {}),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}
    lm = model_from_hf_config(text, name=name or "gemma3")
    from vramplan.families.gemma3_vl.vision import vision_from_config
    return vision_from_config(cfg, lm.hidden_size), lm


__all__ = ["language_model", "resolve", "tower_plan", "visual_tokens"]
