"""Typed sections for jobs with several models: preference, RL, distillation, multimodal,
diffusion, and a generic list of models.

JobSpec keeps the fields (`reference_model`, `teacher`, `reward_model`, `critic_model`,
`num_generations`, `max_new_tokens`, `generation`, `models`, `vision`, `diffusion`);
parsing and validation live here so job.py only delegates.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from collections.abc import Mapping

from vramplan.spec.enums import LossImpl, Precision, SpecError, Task
from vramplan.spec.grpo import GROUP_TASKS, TRAINER
from vramplan.spec.sections import boolean, fraction, positive_int
from vramplan.spec.stack import Framework

PRECOMPUTED = "precomputed"
"""A frozen model whose outputs were computed ahead of time (reference log-probs, text
embeddings, VAE latents): it holds no memory during training."""

REFERENCE_TASKS = (Task.DPO, Task.IPO, Task.KTO)
NO_REFERENCE_TASKS = (Task.ORPO, Task.SIMPO)
RL_TASKS = (Task.PPO, Task.GRPO, Task.RLOO)
MULTI_MODEL_TASKS = REFERENCE_TASKS + NO_REFERENCE_TASKS + RL_TASKS + (
    Task.REWARD_MODEL, Task.DISTILL, Task.DIFFUSION)

ROLE_METHODS = ("frozen", "full", "lora")
PLACEMENTS = ("gpu", "cpu", "other-gpu")


def model_ref(name: str, value: object, *, allow_precomputed: bool = True) -> str | dict | None:
    """A model field: catalog name / hub id / path, an inline HF config, or 'precomputed'."""
    if value is None:
        return None
    if isinstance(value, dict):
        if "model_type" not in value:
            raise SpecError(f"{name}.model_type", "an inline config needs model_type (e.g. 'llama')")
        return value
    if not isinstance(value, str) or not value.strip():
        raise SpecError(name, f"expected a model name, path, inline HF config or 'precomputed', got {value!r}")
    if value.strip().lower() in (PRECOMPUTED, "none"):
        if not allow_precomputed:
            raise SpecError(name, "cannot be precomputed here; name a model")
        return PRECOMPUTED
    return value.strip()


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRole:
    """One model of a job, for the generic `models` list."""

    role: str
    """Its name in the breakdown (`policy`, `reference`, `teacher`, `text_encoder`, ...)."""
    model: str | dict
    """Catalog name, hub id, config path or inline HF config; 'precomputed' holds nothing."""
    method: str = "frozen"
    """frozen (no_grad forward only) | full | lora (trained with the job's optimizer)."""
    precision: Precision | None = None
    """Weight dtype; None: the job's precision."""
    placement: str = "gpu"
    """gpu (this GPU) | cpu (offloaded; moved in for its forward, as diffusers'
    enable_model_cpu_offload) | other-gpu (not on this GPU)."""

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role.replace("_", "").replace("-", "").isalnum():
            raise SpecError("models.role", f"expected a short name like 'reference', got {self.role!r}")
        object.__setattr__(self, "model", model_ref(f"models.{self.role}.model", self.model))
        if not isinstance(self.method, str) or self.method not in ROLE_METHODS:
            raise SpecError(f"models.{self.role}.method", f"choose one of {', '.join(ROLE_METHODS)}")
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.parse(self.precision, f"models.{self.role}.precision"))
        if not isinstance(self.placement, str) or self.placement not in PLACEMENTS:
            raise SpecError(f"models.{self.role}.placement", f"choose one of {', '.join(PLACEMENTS)}")

    def to_dict(self) -> dict:
        out = {"role": self.role, "model": self.model, "method": self.method, "placement": self.placement}
        if self.precision is not None:
            out["precision"] = self.precision.value
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationConfig:
    """How PPO/GRPO rollouts are generated."""

    engine: str = "hf"
    """hf (model.generate with a dynamic KV cache on the training GPU) | vllm (a colocated
    vLLM engine that pre-allocates `gpu_memory_utilization` of the GPU)."""
    gpu_memory_utilization: float = 0.3
    """vLLM: fraction of the GPU's memory the engine takes (TRL GRPOConfig
    vllm_gpu_memory_utilization default 0.3)."""
    generation_batch_size: int | None = None
    """Completions one GPU generates at once; None: micro_batch_size x grad_accum_steps (TRL's
    generation batch per process: steps_per_generation defaults to gradient_accumulation_steps)."""
    ds3_gather_for_generation: bool = True
    """TRL GRPOConfig's switch (default True): under ZeRO-3, `unwrap_model_for_generation`
    gathers every policy parameter for the whole generation (trl/models/utils.py,
    deepspeed.zero.GatheredParameters(model.parameters()))."""

    def __post_init__(self):
        if not isinstance(self.engine, str) or self.engine not in ("hf", "vllm"):
            raise SpecError("generation.engine", "choose hf or vllm")
        object.__setattr__(self, "ds3_gather_for_generation",
                           boolean("generation.ds3_gather_for_generation", self.ds3_gather_for_generation))
        object.__setattr__(self, "gpu_memory_utilization",
                           fraction("generation.gpu_memory_utilization", self.gpu_memory_utilization))
        if self.engine == "vllm" and self.gpu_memory_utilization == 0:
            # vllm/config/cache.py CacheConfig: gpu_memory_utilization = Field(gt=0, le=1)
            raise SpecError("generation.gpu_memory_utilization", "vLLM needs a share of the GPU above 0 for its "
                                                                 "weights and KV cache; use e.g. 0.3 (TRL's default)")
        if self.generation_batch_size is not None:
            object.__setattr__(self, "generation_batch_size",
                               positive_int("generation.generation_batch_size", self.generation_batch_size))

    def to_dict(self) -> dict:
        out = {"engine": self.engine, "gpu_memory_utilization": self.gpu_memory_utilization}
        if self.generation_batch_size is not None:
            out["generation_batch_size"] = self.generation_batch_size
        if not self.ds3_gather_for_generation:
            out["ds3_gather_for_generation"] = False
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionConfig:
    """Images (and videos) of a vision-language job, per sample."""

    num_images: int = 1
    image_size: int = 336
    """Side of the (square) image in pixels: for fixed-size towers (CLIP, SigLIP) the
    processor's resize target; for native-resolution towers (Qwen2-VL) the image's size
    before the processor's smart_resize, unless image_height / image_width are given."""
    image_height: int | None = None
    image_width: int | None = None
    """A non-square image (native-resolution towers); each defaults to image_size."""
    min_pixels: int | None = None
    max_pixels: int | None = None
    """Qwen2-VL processor bounds on an image's resized area (None: the processor's
    defaults, 56*56 and 28*28*1280)."""
    max_tiles: int | None = None
    """InternVL dynamic tiling: most tiles per image (None: the processor's 12; 1: one
    resized tile, no thumbnail)."""
    num_videos: int = 0
    video_frames: int = 16
    """Frames sampled from each video (after fps sampling); padded to the temporal patch."""
    video_height: int | None = None
    video_width: int | None = None
    """A video frame's size before smart_resize (None: image_height / image_width)."""
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    """Per-frame area bounds of the video processor (None: 128*28*28 and 768*28*28)."""
    freeze_vision_tower: bool = True

    def __post_init__(self):
        object.__setattr__(self, "num_images", positive_int("vision.num_images", self.num_images, minimum=0))
        object.__setattr__(self, "num_videos", positive_int("vision.num_videos", self.num_videos, minimum=0))
        for name in ("image_size", "video_frames"):
            object.__setattr__(self, name, positive_int(f"vision.{name}", getattr(self, name)))
        for name in _OPTIONAL_SIZES:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, positive_int(f"vision.{name}", getattr(self, name)))
        if self.max_tiles is not None and self.max_tiles > MAX_TILES:
            # InternVL's processor enumerates every grid of up to max_tiles tiles (families/
            # internvl/vision.py tile_grid): 1e9 ran for minutes. Past this, the tiles' 256
            # tokens each are past any language model's positions anyway.
            raise SpecError("vision.max_tiles", f"{self.max_tiles:,} is too large (at most {MAX_TILES:,}; "
                                                "InternVL's default is 12, each tile 256 tokens)")
        for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise SpecError(f"vision.{low}", f"{lo} is above vision.{high} ({hi}); make it at most {hi}")
        object.__setattr__(self, "freeze_vision_tower", boolean("vision.freeze_vision_tower", self.freeze_vision_tower))

    @property
    def height(self) -> int:
        return self.image_height or self.image_size

    @property
    def width(self) -> int:
        return self.image_width or self.image_size

    def to_dict(self) -> dict:
        out = {"num_images": self.num_images, "image_size": self.image_size,
               "freeze_vision_tower": self.freeze_vision_tower}
        if self.num_videos:
            out.update(num_videos=self.num_videos, video_frames=self.video_frames)
        out.update({k: getattr(self, k) for k in _OPTIONAL_SIZES if getattr(self, k) is not None})
        return out


MAX_TILES = 100_000
"""The most tiles per image a spec takes: 25.6M tokens of 256-token tiles, past any model."""
_OPTIONAL_SIZES = ("image_height", "image_width", "min_pixels", "max_pixels", "max_tiles", "video_height", "video_width",
                   "video_min_pixels", "video_max_pixels")


@dataclass(frozen=True, kw_only=True, slots=True)
class DiffusionConfig:
    """Input of a diffusion/video denoiser training step."""

    height: int = 512
    width: int = 512
    num_frames: int = 1
    """Video frames in pixel space (1 for images)."""
    text_encoders: str = "frozen"
    """frozen (run under no_grad each step) | precomputed (embeddings read from disk)."""
    vae: str = "frozen"
    """frozen (encode pixels each step) | precomputed (latents read from disk)."""
    frozen_copy: bool = False
    """A frozen copy of the denoiser beside the trained one (unlearning, distillation)."""
    offload_frozen: bool = False
    """Frozen modules live on the CPU and visit the GPU one at a time for their forward
    (diffusers `enable_model_cpu_offload`)."""
    prior_preservation: bool = False
    """DreamBooth with prior preservation: the class images join the instance images in
    every batch, so the denoiser (and the encoders) see twice micro_batch_size samples."""
    vae_slicing: bool = False
    """Encode one sample at a time (diffusers `vae.enable_slicing()`)."""
    vae_tiling: bool = False
    """Encode in overlapping tiles of the VAE's tile size (diffusers `vae.enable_tiling()`)."""
    controlnet: bool = False
    """Train a ControlNet beside the frozen UNet (diffusers examples/controlnet/train_controlnet.py:
    `ControlNetModel.from_unet`, fp32, trained whole; its residuals feed the UNet's skips)."""
    set_grads_to_none: bool | None = None
    """The loop's `optimizer.zero_grad(set_to_none=...)`: false keeps the trained part's
    gradients allocated (zeroed) into the next step's forward. None: the script's default
    (jobs/diffusion_scripts.py `grads_kept`: false for train_dreambooth.py and the ControlNet
    scripts, whose `--set_grads_to_none` is a store_true flag; true, torch's default, elsewhere)."""

    def __post_init__(self):
        for name in ("height", "width", "num_frames"):
            object.__setattr__(self, name, positive_int(f"diffusion.{name}", getattr(self, name)))
        for name in ("frozen_copy", "offload_frozen", "prior_preservation", "vae_slicing", "vae_tiling", "controlnet"):
            object.__setattr__(self, name, boolean(f"diffusion.{name}", getattr(self, name)))
        if self.set_grads_to_none is not None:
            object.__setattr__(self, "set_grads_to_none", boolean("diffusion.set_grads_to_none", self.set_grads_to_none))
        for name in ("text_encoders", "vae"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in ("frozen", PRECOMPUTED):
                raise SpecError(f"diffusion.{name}", "choose frozen or precomputed")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


SECTIONS = {"generation": GenerationConfig, "vision": VisionConfig, "diffusion": DiffusionConfig}


def parse_section(name: str, value: object):
    cls = SECTIONS[name]
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(name, f"expected a mapping, got {value!r}")
    known = {f.name for f in fields(cls)}
    for key in value:
        if key not in known:
            raise SpecError(f"{name}.{key}", f"unknown key; known: {', '.join(sorted(known))}")
    return cls(**value)


def parse_models(value: object) -> tuple[ModelRole, ...]:
    if value in (None, (), []):
        return ()
    if not isinstance(value, (list, tuple)):
        raise SpecError("models", "expected a list of {role, model, method, precision, placement}")
    out = []
    for item in value:
        if isinstance(item, ModelRole):
            out.append(item)
            continue
        if not isinstance(item, Mapping) or "role" not in item or "model" not in item:
            raise SpecError("models", f"each entry needs role and model, got {item!r}")
        known = {f.name for f in fields(ModelRole)}
        for key in item:
            if key not in known:
                raise SpecError(f"models.{item.get('role')}.{key}", "unknown key")
        out.append(ModelRole(**item))
    roles = [m.role for m in out]
    if len(set(roles)) != len(roles):
        raise SpecError("models", f"roles must be unique, got {roles}")
    return tuple(out)


def drop_unread_sections(data: dict, changed) -> None:
    """A spec mapping whose method a plan changes (`changed`: the keys it sets) keeps only the
    sections the new method reads: a LoRA job tried as full fine-tuning loses its lora section
    (the spec refuses a section its method would ignore)."""
    method = data.get("method", "full")
    if "method" not in changed or not isinstance(method, str):
        return
    keep = {"lora": method in ("lora", "qlora"), "freeze": method == "freeze",
            "quantization": method == "qlora" or data.get("task") == "inference"}
    for name, kept in keep.items():
        if not kept and not any(k == name or k.startswith(name + ".") for k in changed):
            data.pop(name, None)


def check_task_fields(spec) -> dict[str, object]:
    """Validate the multi-model fields against the task; returns normalized values."""
    task = spec.task
    out: dict[str, object] = {}
    from vramplan.spec.enums import Method
    from vramplan.spec.unread import check_unread
    check_unread(spec)  # packing, and the sections and settings the task never reads
    if task is not Task.INFERENCE:  # a section the method never reads would be ignored, the number not the job's
        if spec.lora is not None and spec.method not in (Method.LORA, Method.QLORA):
            raise SpecError("lora", f"applies to method lora or qlora, not {spec.method.value}; set method lora "
                            "(TRL: --use_peft) or drop the lora settings")
        if spec.freeze is not None and spec.method is not Method.FREEZE:
            raise SpecError("freeze", f"applies to method freeze, not {spec.method.value}; set method freeze or "
                            "drop the freeze section")
    out["label_smoothing"] = smooth = fraction("label_smoothing", spec.label_smoothing, high=0.999)
    if smooth and (task is not Task.SFT or spec.stack.framework is not Framework.HF_TRAINER
                   or spec.loss_impl is not LossImpl.STANDARD):
        raise SpecError("label_smoothing", "is modelled for the HF Trainer's LabelSmoother (task sft, stack "
                        "hf-trainer, loss_impl standard); use those or drop label_smoothing")
    for name in ("reference_model", "teacher", "reward_model", "critic_model"):
        out[name] = model_ref(name, getattr(spec, name), allow_precomputed=name == "reference_model")
    if out["reference_model"] is not None and task not in REFERENCE_TASKS + RL_TASKS:
        raise SpecError("reference_model", f"task {task.value} keeps no reference model; "
                        f"use task {', '.join(t.value for t in REFERENCE_TASKS)}")
    if task is Task.DISTILL and out["teacher"] is None:
        raise SpecError("teacher", "task distill needs a teacher model")
    if out["teacher"] is not None and task is not Task.DISTILL:
        raise SpecError("teacher", "only task distill takes a teacher")
    for name in ("reward_model", "critic_model"):
        if out[name] is not None and task not in RL_TASKS:
            raise SpecError(name, "only tasks ppo, grpo and rloo take it")
    for name in ("num_generations", "max_new_tokens"):
        value = getattr(spec, name)
        if value is not None:
            # distill + max_new_tokens: TRL's on-policy DistillationTrainer (jobs/distill.py)
            if task not in RL_TASKS and not (name == "max_new_tokens" and task in (Task.INFERENCE, Task.DISTILL)):
                raise SpecError(name, "only tasks ppo, grpo, rloo, distill (max_new_tokens: on-policy) and "
                                      "inference (max_new_tokens) generate")
            out[name] = positive_int(name, value)
            if name == "num_generations" and task in GROUP_TASKS and out[name] < 2:  # GRPOConfig.__post_init__
                raise SpecError(name, f"{TRAINER[task]} needs at least 2 completions per prompt to compute its "
                                      f"advantages (trl {TRAINER[task]}Config); use num_generations >= 2")
    out["models"] = parse_models(spec.models)
    # jobs/__init__.py resolve_models: a listed role replaces the task's model of that name
    for m in out["models"]:
        if m.role == "policy":  # the trained model: a gpt2 job was estimated as the listed model
            raise SpecError("models.policy", "the trained model is the spec's `model`; give this entry "
                            "another role name, or set `model` to it")
        field = {"reference": "reference_model", "teacher": "teacher", "reward": "reward_model",
                 "critic": "critic_model"}.get(m.role)
        if field and out[field] is not None:
            raise SpecError(f"models.{m.role}", f"and {field} both name the {m.role} model; keep one")
    for name in SECTIONS:
        out[name] = parse_section(name, getattr(spec, name))
    if out["diffusion"] is not None and task is not Task.DIFFUSION:
        raise SpecError("diffusion", "set task diffusion to train a denoiser")
    if task is Task.DIFFUSION and out["diffusion"] is None:
        out["diffusion"] = DiffusionConfig()
    if spec.model is None:  # a raw size (num_params) describes a language model's layers, nothing else
        if task is Task.DIFFUSION:
            raise SpecError("num_params", "describes a language model by its size; task diffusion needs a "
                            "pipeline as `model` (see `vramplan models --kind diffusion`, e.g. flux.1-dev)")
        if out["vision"] is not None:
            raise SpecError("vision", "a model given by num_params has no vision tower; drop the vision "
                            "settings or name a vision-language model (see `vramplan models --kind vlm`)")
        if task in MULTI_MODEL_TASKS or out["models"]:
            # jobs/__init__.py resolve_models builds each role from a named model
            what = f"task {task.value}" if task in MULTI_MODEL_TASKS else "a models list"
            raise SpecError("num_params", f"a raw size estimates one model; {what} builds its models "
                            "(policy, reference, ...) from `model`: name the model (a catalog name, hub id "
                            "or config.json) instead")
    if spec.keep_logits:
        check_keep_logits(spec)
    return out


KEEP_LOGITS_TASKS = (Task.SFT, Task.PRETRAIN, Task.SEQUENCE_CLASSIFICATION)


def check_keep_logits(spec) -> None:
    """keep_logits needs a step whose model returns the logits: a single model's
    (preference, RL and distillation trainers hold their logits in their own terms, jobs/);
    Liger's fused loss never builds them, nor does Megatron's GPTModel given labels (it
    returns the per-token loss, megatron/core/models/gpt/gpt_model.py)."""
    if spec.task not in KEEP_LOGITS_TASKS:
        raise SpecError("keep_logits", f"is modelled for tasks sft, pretrain and sequence-classification, "
                        f"not {spec.task.value}; drop keep_logits")
    if spec.loss_impl is LossImpl.FUSED_LINEAR_CROSS_ENTROPY:
        raise SpecError("keep_logits", "the fused linear cross-entropy never builds the logits; drop keep_logits "
                        "or use loss_impl standard")
    if spec.stack.framework is Framework.MEGATRON:
        raise SpecError("keep_logits", "Megatron's GPTModel returns the per-token loss, not the logits, when "
                        "given labels; drop keep_logits")


def needs_several_models(spec) -> bool:
    return spec.task in MULTI_MODEL_TASKS or bool(spec.models) or spec.vision is not None


__all__ = ["DiffusionConfig", "GenerationConfig", "ModelRole", "PRECOMPUTED", "VisionConfig",
           "check_task_fields", "model_ref", "needs_several_models", "parse_models", "parse_section"]

