"""A trained ViT/SigLIP tower's forward as a VLM job's stages: the patch embeddings, then one
stage per encoder layer, each with the saved activations its recorder kept and the gradients
of its own parameters (Gemma 3 and LLaVA-OneVision run the same SigLIP encoder)."""
from __future__ import annotations

from vramplan.components.arch_vit import VitCtx, vit_embed, vit_layer
from vramplan.components.graph import Recorder, Sym
from vramplan.components.trainable import ParamSet
from vramplan.jobs.vlm import grads_where, saved_items


def trained_tower(recs: list[Recorder], vit: VitCtx, pixels: Sym, num_layers: int, held: ParamSet,
                  backend: str, seen: set[int], stages: list) -> Sym:
    """Record the tower on `pixels` (recs[0] holds the embeddings; one new recorder per
    layer), append its stages, and return the last layer's output."""
    x = vit_embed(recs[0], vit, pixels)
    stages.append(("vision embeddings", saved_items(recs[0], "vision_tower/activations/embeddings"),
                   grads_where(held, lambda p: p.layer is None and p.name.startswith("vision_tower."))))
    for i in range(num_layers):
        recs.append(Recorder(backend=backend, seen=seen))
        x = vit_layer(recs[-1], vit, x, i)
        stages.append((f"vision layer {i}", saved_items(recs[-1], "vision_tower/activations/layers"),
                       grads_where(held, lambda p, i=i: p.layer == i)))
    return x
