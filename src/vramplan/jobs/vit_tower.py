"""A VLM's vision tower in a job: its parameters and projector as held (`held_tower`: InternVL,
Gemma 3, LLaVA-OneVision), and a trained ViT/SigLIP tower's forward as stages: the patch
embeddings, then one stage per encoder layer, each with the saved activations its recorder
kept and the gradients of its own parameters (Gemma 3 and LLaVA-OneVision run the same
SigLIP encoder)."""
from __future__ import annotations

from vramplan.components.arch_vit import VitCtx, vit_embed, vit_layer
from vramplan.components.graph import Recorder, Sym
from vramplan.components.trainable import HeldParam, ParamSet
from vramplan.jobs.vlm import grads_where, refuse_trained_tower_with_lora, saved_items
from vramplan.spec import JobSpec


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


def held_tower(vis, spec: JobSpec, train_tower: bool, untrained: tuple[str, ...] = ()) -> ParamSet:
    """The tower's parameters (trained with it, except those named by a prefix in `untrained`)
    and the projector's, always trained, in the weights' dtype."""
    refuse_trained_tower_with_lora(spec, train_tower)
    w = spec.precision.weight_dtype
    out = [HeldParam("vision_tower." + n, s, w, train_tower and not n.startswith(untrained), "base", layer)
           for n, s, layer in vis.params()]
    out += [HeldParam("projector." + n, s, w, True, "base", None) for n, s in vis.projector_params()]
    return ParamSet(tuple(out))
