"""Vision-language jobs (LLaVA-style): vision tower + projector + language model.

Source: transformers 5.x models/llava/modeling_llava.py. LlavaModel.forward embeds the
token ids, runs `get_image_features` (vision tower, `hidden_states[vision_feature_layer]`,
`[:, 1:]` under the default strategy, LlavaMultiModalProjector), and writes the features
into the embeddings with `masked_scatter` at the image-token positions (the processor
has expanded each `<image>` into one token per visual feature). The language model then
runs on s + images * visual_tokens positions with the ordinary causal-LM loss.

Estimate = the core's plan for the language model at that sequence length, with the
projector (trained) and, when `vision.freeze_vision_tower` is false, the vision tower's
layers as extra stages before it (their saved tensors replayed on the recorder,
components/arch_vit.py); a frozen tower holds its weights and a no-grad-like forward
transient (nothing requires grad, so autograd saves nothing).
Legend: b micro-batch, s text tokens, S = s + m * t_v, m images per sample, n = b * m,
t tokens per image in the tower, t_v visual tokens per image, e vision hidden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from vramplan.breakdown import Breakdown
from vramplan.components.activations import plan_activations
from vramplan.components.arch_vit import VisionDesc, VitCtx, projector, vit_embed, vit_layer
from vramplan.components.graph import Param, Recorder
from vramplan.components.optimizer import optimizer_states, step_temporaries
from vramplan.components.trainable import LLAMA_TARGETS, HeldParam, ParamSet, param_set, targets_module
from vramplan.components.weights import weight_terms
from vramplan.i18n import Msg
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.trained import prefixed, single_spec
from vramplan.model import ModelDesc
from vramplan.spec import Checkpointing, JobSpec, Method, SpecError
from vramplan.timeline import StepPlan
from vramplan.units import nbytes

# transformers CLIPVisionConfig defaults (configuration_clip.py), for inline configs
_CLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                  "hidden_act": "quick_gelu"}


def vision_from_llava_config(cfg: dict) -> VisionDesc:
    """VisionDesc of an inline HF LLaVA config (model_type llava, vision_config of CLIP or
    SigLIP: SigLIP has no class token and no pre-norm)."""
    v = {**_CLIP_DEFAULTS, **cfg.get("vision_config", {})}
    siglip = v.get("model_type", "clip_vision_model").startswith("siglip")
    text_h = cfg["text_config"]["hidden_size"]
    fl = cfg.get("vision_feature_layer", -2)
    if not isinstance(fl, int):
        raise ValueError("vision_feature_layer: a list of layers is not modelled yet")
    return VisionDesc(hidden_size=v["hidden_size"], num_layers=v["num_hidden_layers"],
                      num_heads=v["num_attention_heads"], intermediate_size=v["intermediate_size"],
                      image_size=v["image_size"], patch_size=v["patch_size"], num_channels=v["num_channels"],
                      hidden_act=v.get("hidden_act", "gelu_pytorch_tanh" if siglip else "quick_gelu"),
                      class_token=not siglip, pre_norm=not siglip, patch_bias=siglip, feature_layer=fl,
                      select_strategy=cfg.get("vision_feature_select_strategy", "default"),
                      projector=((v["hidden_size"], text_h), (text_h, text_h)),
                      projector_bias=cfg.get("multimodal_projector_bias", True),
                      projector_act=cfg.get("projector_hidden_act", "gelu"))


def vision_from_catalog(entry: dict) -> VisionDesc:
    v = entry["vision"]
    return VisionDesc(hidden_size=v["hidden_size"], num_layers=v["num_layers"], num_heads=v["num_heads"],
                      intermediate_size=v["intermediate_size"], image_size=v.get("image_size"),
                      patch_size=v["patch_size"], hidden_act=v.get("hidden_act", "quick_gelu"),
                      class_token=entry["kind"] == "llava", pre_norm=entry["kind"] == "llava",
                      fused_qkv=entry["kind"] == "qwen2-vl", spatial_merge=v.get("spatial_merge", 1),
                      feature_layer=v.get("vision_feature_layer", -1),
                      select_strategy=v.get("vision_feature_select_strategy", "full"),
                      projector=tuple(tuple(x) for x in entry["projector"]["layers"]))


def _held(vis: VisionDesc, spec: JobSpec, train_tower: bool) -> ParamSet:
    """Vision tower (`vision_tower.`) and projector (`projector.`) parameters. Layers past
    the feature layer run but feed nothing: they get no gradient and (torch.optim creates
    state lazily) no optimizer state, so they count as frozen."""
    w = spec.precision.weight_dtype
    out: list[HeldParam] = []
    lora = train_tower and spec.method in (Method.LORA, Method.QLORA)
    for name, shape, layer in vis.params():
        used = layer is None or layer < vis.used_layers
        trains = train_tower and used and not lora and not name.startswith("post_layernorm")
        out.append(HeldParam("vision_tower." + name, shape, w, trains, "base", layer))
        module = name.rsplit(".", 1)[0]
        if lora and used and layer is not None and name.endswith(".weight") and len(shape) == 2 and \
                targets_module(module, spec.lora.target_modules or LLAMA_TARGETS):
            out.append(HeldParam(f"vision_tower.{module}.lora_A", (spec.lora.r, shape[1]), "fp32", True, "lora", layer))
            out.append(HeldParam(f"vision_tower.{module}.lora_B", (shape[0], spec.lora.r), "fp32", True, "lora", layer))
    out += [HeldParam("projector." + n, s, w, True, "base", None) for n, s in vis.projector_params()]
    return ParamSet(tuple(out))


def _vit_ctx(vis: VisionDesc, held: ParamSet) -> VitCtx:
    params, lora = {}, {}
    for p in held.params:
        name = p.name.split(".", 1)[1]
        if p.kind == "lora":
            lora.setdefault(name.rsplit(".", 1)[0], []).append(Param(p.name, p.shape, p.dtype, True))
        else:
            params[name] = Param(p.name, p.shape, p.dtype, p.trainable)
    return VitCtx(vis, params, {m: (ab[0], ab[1]) for m, ab in lora.items()})


def grads_where(held: ParamSet, pick, key: str = "vision_tower/gradients") -> Breakdown:
    return Breakdown().add(key, sum(nbytes(p.numel, p.dtype) for p in held.params if p.trainable and pick(p)))


def _extra_stages(vis, spec, held, n, side, rows, S):
    """(label, saved Breakdown, grads Breakdown) for the tower (trained) and projector, in forward order."""
    ctx = _vit_ctx(vis, held)
    seen: set[int] = set()
    rec = Recorder(backend=spec.backend.value, seen=seen)
    pixels = rec.new("batch/pixel_values", (n, vis.num_channels, side, side), spec.precision.weight_dtype, False)
    seen.add(id(pixels.storage))  # the batch's own tensor, counted under batch/
    out, alive = [], [rec]  # recorders kept alive: `seen` holds id()s of their storages
    x = vit_embed(rec, ctx, pixels)
    out.append(("vision embeddings", saved_items(rec, "vision_tower/activations/embeddings"),
                grads_where(held, lambda p: p.layer is None and p.name.startswith("vision_tower."))))
    for i in range(vis.used_layers):
        rec = Recorder(backend=spec.backend.value, seen=seen)
        alive.append(rec)
        x = vit_layer(rec, ctx, x, i)
        out.append((f"vision layer {i}", saved_items(rec, "vision_tower/activations/layers"),
                    grads_where(held, lambda p, i=i: p.layer == i)))
    rec = Recorder(backend=spec.backend.value, seen=seen)
    alive.append(rec)
    projector(rec, ctx, x, side)
    saved = saved_items(rec, "projector/activations")
    # masked_scatter saves its bool mask (b, S, 1) for the backward (derivatives.yaml).
    saved.add("projector/activations/image_token_mask", nbytes(rows * S, "bool"))
    out.append(("projector", saved, grads_where(held, lambda p: p.name.startswith("projector."), "projector/gradients")))
    return out


def saved_items(rec: Recorder, group: str) -> Breakdown:
    out = Breakdown()
    for name, size in rec.saved_items():
        out.add(f"{group}/{name.replace('/', '.')}", size)
    return out


def frozen_tower_transient(vis: VisionDesc, n: int, t: int, c: str) -> Breakdown:
    """A frozen tower's forward (nothing requires grad, nothing saved): LLaVA asks for every
    layer's hidden state (t x e each, kept in the output until get_image_features returns)
    and one MLP's working set at a time: ln2 output, fc1 output and the activation's
    intermediates (QuickGELU: the scaled input, its sigmoid, the product)."""
    e, f = vis.hidden_size, vis.intermediate_size
    acts = 3 if vis.hidden_act == "quick_gelu" else 1
    return (Breakdown().add("vision_tower/forward/hidden_states", (vis.num_layers + 1) * nbytes(n * t * e, c))
            .add("vision_tower/forward/mlp", nbytes(n * t * e, c) + (1 + acts) * nbytes(n * t * f, c)))


@dataclass(slots=True)
class TowerPlan:
    """What a VLM's vision side adds to its language model's step."""

    held: ParamSet
    """Tower (`vision_tower.`) and projector (`projector.`) parameters."""
    stages: list[tuple[str, Breakdown, Breakdown]]
    """(label, saved, gradients) of the tower's and projector's stages, forward order."""
    frozen: Breakdown | None
    """A frozen tower's forward working set (an event before the trained forward)."""
    batch: Breakdown
    forward_end: Breakdown = field(default_factory=Breakdown)
    """Held by the model's output until the end of forward (the tower's outputs)."""
    lm_embedding: Breakdown = field(default_factory=Breakdown)
    """Saved in the language model's embedding stage beyond its own (M-RoPE's per-row cos/sin)."""
    layer_inputs: dict[str, int] = field(default_factory=dict)
    """Stage label of each tower layer (a GradientCheckpointingLayer) -> bytes of its input."""
    layer_forward: Breakdown | None = None
    """One tower layer's forward working set beyond its input (a checkpointed layer saves nothing)."""
    layer_backward: Breakdown = field(default_factory=Breakdown)
    """Alive in each tower layer's backward beyond what it saved."""


def checkpointed(tower: TowerPlan) -> list[Breakdown]:
    """Full gradient checkpointing reaches the tower too: transformers'
    gradient_checkpointing_enable sets every GradientCheckpointingLayer (CLIPEncoderLayer,
    Qwen2VLVisionBlock, InternVLVisionLayer) to run under torch.utils.checkpoint, which keeps
    only the layer's inputs and recomputes what it saves during its backward. Each tower
    layer's stage then saves its input; what it saved becomes its backward transient.
    Returns the per-stage transients (forward order)."""
    out = []
    for j, (label, saved, grads) in enumerate(tower.stages):
        if label in tower.layer_inputs:
            kept = Breakdown().add("vision_tower/activations/layers/checkpoint_input", tower.layer_inputs[label])
            tower.stages[j] = (label, kept, grads)
            out.append(Breakdown().merge(saved, prefix="recomputed/"))
        else:
            out.append(Breakdown())
    return out


def llava_tokens(vis: VisionDesc, spec: JobSpec) -> int:
    """Visual tokens per sample of a fixed-size tower."""
    if spec.vision.num_videos:
        raise SpecError("vision.num_videos", "this model's vision tower takes images only; set it to 0")
    return spec.vision.num_images * vis.visual_tokens(vis.image_size or spec.vision.image_size)


def llava_tower(vis: VisionDesc, spec: JobSpec, S: int) -> TowerPlan:
    b, m = spec.micro_batch_size, spec.vision.num_images
    side = vis.image_size or spec.vision.image_size
    n, t = b * m, vis.tokens_per_image(side)
    train_tower = not spec.vision.freeze_vision_tower
    held = _held(vis, spec, train_tower)
    stages = _extra_stages(vis, spec, held, n, side, b, S)
    inputs = {f"vision layer {i}": nbytes(n * t * vis.hidden_size, spec.precision.weight_dtype)
              for i in range(vis.used_layers)}
    batch = Breakdown().add("batch/pixel_values", nbytes(n * vis.num_channels * side * side, spec.precision.weight_dtype))
    frozen = None if train_tower else frozen_tower_transient(vis, n, t, spec.precision.compute_dtype)
    return TowerPlan(held, stages if train_tower else stages[-1:], frozen, batch, layer_inputs=inputs)


def vlm_estimate(vis, lm: ModelDesc, spec: JobSpec, gpu=None):
    """The language model's plan at its longer sequence with the tower's stages before it."""
    from vramplan.step.build import rank_step
    if isinstance(vis, VisionDesc):
        S = spec.seq_len + within_positions(llava_tokens(vis, spec), spec, lm)  # as the families' towers
        tower = llava_tower(vis, spec, S)
    else:  # a family's own tower: Qwen2-VL / Qwen2.5-VL, InternVL, Gemma 3, LLaVA-OneVision
        import importlib
        module = importlib.import_module("vramplan.jobs." + _TOWER_JOBS[type(vis).__name__])
        if hasattr(module, "language_model"):  # what the images change in it (Gemma 3's masks)
            lm = module.language_model(lm, spec)
        S = spec.seq_len + module.visual_tokens(vis, spec, lm)
        tower = module.tower_plan(vis, spec, S, lm)
    b = spec.micro_batch_size
    one = single_spec(spec, b, S)
    params = param_set(lm, one)
    held = tower.held
    # inputs_embeds requires grad when the projector trains (masked_scatter of its output),
    # even with a frozen embedding (LoRA): replay with the embedding seen as trained, then
    # drop what a trained embedding alone would save (its ids).
    embed_frozen = any(p.name.endswith("embed_tokens.weight") and not p.trainable for p in params.params)
    act_params = ParamSet(tuple(p._replace(trainable=True) if p.name.endswith("embed_tokens.weight") else p
                                for p in params.params)) if embed_frozen else params
    acts = plan_activations(lm, one, act_params)
    if embed_frozen:
        acts.stages[0].saved = [x for x in acts.stages[0].saved if x[0] != "input_ids"]
    plan = prefixed(rank_step(lm, one, params, acts), "language_model")
    plan.stage_acts[0].merge(tower.lm_embedding)
    full_gc = tower.frozen is None and spec.gradient_checkpointing is Checkpointing.FULL
    transients = checkpointed(tower) if full_gc else [Breakdown() for _ in tower.stages]
    for j, (label, _, _) in enumerate(tower.stages):
        if label in tower.layer_inputs:
            transients[j] = Breakdown().merge(transients[j]).merge(tower.layer_backward)
    _prepend(plan, tower.stages, transients)
    plan.forward_end_transient.merge(tower.forward_end)
    tower_w = Breakdown().merge(weight_terms(spec, ParamSet(tuple(p for p in held.params if p.name.startswith("vision_tower.")))),
                                prefix="vision_tower/")
    proj = Breakdown().merge(weight_terms(spec, ParamSet(tuple(p for p in held.params if p.name.startswith("projector.")))),
                             prefix="projector/")
    plan.static.merge(tower_w).merge(proj).merge(optimizer_states(spec, held), prefix="vision_and_projector/")  # noqa
    plan.static.merge(tower.batch)
    union = ParamSet(params.params + held.params)
    plan.optimizer_temporaries = Breakdown().merge(step_temporaries(spec, union), prefix="language_model/")
    step = Step(plan)
    if tower.frozen is not None:
        step.before.append(("forward", "vision tower forward (frozen)", tower.frozen))
    elif full_gc and tower.layer_forward is not None:  # the last layer runs with every checkpoint input kept
        kept = Breakdown().merge(tower.layer_forward)
        for _, saved, _ in tower.stages[:-1]:
            kept.merge(saved)
        step.before.append(("forward", "vision tower forward (checkpointed)", kept))
    notes = [Msg("{images} image(s) and {videos} video(s) per sample -> {visual} visual tokens; "
                 "language model at seq_len {seq_len}", images=spec.vision.num_images,
                 videos=spec.vision.num_videos, visual=S - spec.seq_len, seq_len=S)]
    if tower.frozen is None and spec.gradient_checkpointing is Checkpointing.SELECTIVE:
        notes.append(Msg("gradient checkpointing covers the language model here; the trained vision tower's "
                         "layers are counted with all their activations kept, so its share is an upper bound"))
    return finish(spec, lm, step, num_params=lm.num_params() + sum(p.numel for p in held.params if p.kind == "base"),
                  trainable_params=union.numel(trainable=True), gpu=gpu, notes=notes)


def _prepend(plan: StepPlan, extra, transients=None) -> None:
    """Put the tower/projector stages before the language model's (forward order)."""
    labels = [f"{label} backward" for label, _, _ in extra]
    acts = [a for _, a, _ in extra]
    grads = [g for _, _, g in extra]
    plan.stage_acts[:0] = acts
    plan.grads_by_stage[:0] = grads
    plan.stage_backward_transient[:0] = transients or [Breakdown() for _ in extra]
    plan.labels[:0] = labels
    if plan.stage_acts_at_peak is not None:
        plan.stage_acts_at_peak[:0] = acts
    if plan.stage_grads_at_peak is not None:
        plan.stage_grads_at_peak[:0] = grads


QWEN_VL = ("qwen2_vl", "qwen2_5_vl")
_TOWER_JOBS = {"QwenVisionDesc": "qwen_vl", "InternVisionDesc": "internvl", "Gemma3VisionDesc": "gemma3_vl", "OnevisionDesc": "llava_onevision"}
_OWN_CONFIG = {"gemma3": "gemma3_vl", "llava_onevision": "llava_onevision"}
"""model_type -> the jobs module whose `resolve(config, name)` reads it."""


def _from_config(cfg: dict, name: str | None = None):
    from vramplan.catalog.hf_check import check_vlm_config
    mt = check_vlm_config(cfg)  # sub-configs and tower sizes, before any is read
    if mt in QWEN_VL:
        return _qwen_vl(cfg, name)
    if mt == "internvl":
        return _internvl(cfg, name)
    if mt in _OWN_CONFIG:
        import importlib
        return importlib.import_module("vramplan.jobs." + _OWN_CONFIG[mt]).resolve(cfg, name)
    return None


def resolve_vlm(model):
    """An edge: the VLM's vision description and its language model's ModelDesc."""
    from vramplan.sources import model_from_hf_config
    if isinstance(model, dict):
        own = _from_config(model)
        if own is not None:
            return own
        if model.get("model_type") != "llava":
            raise SpecError("model", f"inline vision-language configs of model_type llava, qwen2_vl, qwen2_5_vl, internvl, gemma3 or "
                             f"llava_onevision are modelled, got {model.get('model_type')!r}")
        text = dict(model["text_config"])
        return vision_from_llava_config(model), model_from_hf_config(text, name=text.get("model_type", "llm"))
    from vramplan.catalog.pipelines import find_vlm
    from vramplan.jobs import _desc
    try:
        entry = find_vlm(model)
    except KeyError:  # a config.json path, hub id or language-model catalog entry of a VLM
        from vramplan.sources import resolve_hf_config
        name, cfg = resolve_hf_config(model)
        own = _from_config(cfg, name)
        if own is None:  # a text model given a vision section (a typo failed in resolve_hf_config)
            raise SpecError("vision", f"{model!r} is not a vision-language model; drop the vision section, or "
                            "use a model from `vramplan models` that takes images") from None
        return own
    if "config" in entry:  # the published config.json fields, read like an inline config
        return _from_config(entry["config"], entry["name"])
    return vision_from_catalog(entry), _desc(entry["language_model"])


def vlm_num_params(entry: dict) -> int:
    """A catalog VLM's parameters: language model + tower + projector (a published-config
    entry counted from its description; an older entry from its recorded part counts)."""
    if "config" not in entry:
        from vramplan.sources import model_desc
        return model_desc(entry["language_model"]).num_params() + entry["vision"]["num_params"] + \
            entry["projector"]["num_params"]
    vis, lm = resolve_vlm(entry["name"])
    proj = vis.merger_params() if hasattr(vis, "merger_params") else vis.projector_params()
    return lm.num_params() + sum(math.prod(s) for _, s, _ in vis.params()) + sum(math.prod(s) for _, s in proj)


def _internvl(cfg: dict, name: str | None = None):
    """InternVL: InternViT + projector, and the language model of its text_config (Qwen2
    by default, InternVLConfig's sub-config default); tie_word_embeddings is the outer
    config's (InternVLConfig, default true)."""
    from vramplan.sources import model_from_hf_config
    from vramplan.families.internvl.vision import vision_from_config
    text = {"model_type": "qwen2", **cfg.get("text_config", {}),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}
    lm = model_from_hf_config(text, name=name or "internvl")
    return vision_from_config(cfg, lm.hidden_size), lm


def _qwen_vl(cfg: dict, name: str | None = None):
    """Qwen2-VL / Qwen2.5-VL: the vision tower, and the language model as Qwen2's layout
    (Qwen2VLTextConfig defaults; M-RoPE changes only cos/sin, not the parameters). The
    published configs keep the text fields at the top level; transformers moves them into
    text_config (Qwen2VLConfig.__post_init__), and so does this."""
    from vramplan.sources import model_from_hf_config
    from vramplan.families.qwen2_vl.vision import TEXT_DEFAULTS, vision_from_config
    text = {k: v for k, v in cfg.items() if k in TEXT_DEFAULTS}
    text = {**TEXT_DEFAULTS, **text, **cfg.get("text_config", {}), "model_type": "qwen2",
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)
                                        or cfg.get("text_config", {}).get("tie_word_embeddings", False))}
    text.pop("rope_parameters", None)  # mrope_section: not a Qwen2 rope type; rotary keeps its size
    return vision_from_config(cfg), model_from_hf_config(text, name=name or cfg["model_type"])


__all__ = ["TowerPlan", "frozen_tower_transient", "grads_where", "llava_tokens", "llava_tower", "resolve_vlm", "saved_items",
           "vision_from_catalog", "vision_from_llava_config", "vlm_estimate", "vlm_num_params"]


def within_positions(total: int, spec: JobSpec, lm: ModelDesc) -> int:
    """`total` visual tokens per sample, refused when with seq_len they pass the language
    model's positions (max_position_embeddings)."""
    limit = lm.max_position_embeddings
    if limit and spec.seq_len + total > limit:
        raise SpecError("vision", f"{total} visual tokens + seq_len {spec.seq_len} = {spec.seq_len + total} tokens, "
                        f"over the language model's {limit} positions; lower vision.max_pixels, the image "
                        "size or the number of images/frames")
    return total


def refuse_trained_tower_with_lora(spec: JobSpec, train_tower: bool) -> None:
    """LoRA adapts the language model only; a trained tower beside it is not modelled."""
    if train_tower and spec.method in (Method.LORA, Method.QLORA):
        raise SpecError("vision.freeze_vision_tower", "with LoRA the adapters go on the language model only and "
                        "the vision tower stays frozen; set it to true, or use method full")
