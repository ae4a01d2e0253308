"""A real diffusion-transformer training step under the exact CPU meter.

    from vramplan.measure.diffusion import measure_diffusion
    result = measure_diffusion({"task": "diffusion", "model": {inline pipeline}, "diffusion": {...}, ...})

The denoiser is the diffusers class the inline pipeline names (``denoiser.class``, e.g.
``CogVideoXTransformer3DModel``) built from the pipeline's fields with random weights
(the keys its ``__init__`` takes; ``sample_*`` set from the job's resolution so the
positional embedding matches). Text embeddings and latents are precomputed (the job must
say ``text_encoders: precomputed`` and ``vae: precomputed``): ``(b, m, text_embed_dim)``
embeddings and ``(b, F, C, H, W)`` latents in the weight dtype (CogVideoX's layout).

The step follows diffusers' training scripts (examples/cogvideo/train_cogvideox_lora.py,
examples/dreambooth/train_dreambooth_lora_sd3.py): noise and timesteps drawn, the noisy
latents ``sqrt(a) * x + sqrt(1 - a) * noise`` (DDPMScheduler.add_noise), the denoiser with
gradients, ``F.mse_loss(pred.float(), target.float())`` against the noise, backward,
optimizer step. With ``frozen_copy`` a deep copy of the denoiser (frozen) runs a
no_grad forward on the same inputs after the trained one and its prediction is the target
(distillation / unlearning toward the original).
LoRA: PEFT adapters on ``to_q, to_k, to_v, to_out.0`` (``transformer.add_adapter``).
Phases: ``s{n}.fwd``, ``s{n}.ref`` (the frozen copy), ``s{n}.bwd``, ``s{n}.opt``.
"""
from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F

from . import MeasureResult
from .diffusion_inputs import FLOW_MATCHING, call_denoiser, denoiser_inputs
from .build import build_optimizer, norm_precision, precision_dtypes
from .jobs import PHASES, _live_tensors
from .meter import MemoryMeter
from .result import metered_result
from .run import unique_bytes


def latent_dims(pipe: dict, diffusion: dict) -> tuple[int, int, int, int]:
    vae = pipe["vae"]
    s, t = vae["spatial_compression"], vae["temporal_compression"]
    frames = int(diffusion.get("num_frames", 1))
    f = 1 if frames == 1 or t == 1 else (frames - 1) // t + 1
    return f, vae["latent_channels"], int(diffusion.get("height", 512)) // s, int(diffusion.get("width", 512)) // s


def build_denoiser(pipe: dict, diffusion: dict, dtype: torch.dtype) -> torch.nn.Module:
    import diffusers
    den = dict(pipe["denoiser"])
    cls = getattr(diffusers, den["class"])
    accepted = inspect.signature(cls.__init__).parameters
    f, _, h, w = latent_dims(pipe, diffusion)
    if den["class"] == "CogVideoXTransformer3DModel":
        den.update(sample_height=h, sample_width=w,
                   sample_frames=(f - 1) * pipe["vae"]["temporal_compression"] + 1)
    elif den["class"] == "DiTTransformer2DModel":  # fixed sinusoidal positions for one latent side
        den["sample_size"] = h
    cfg = {k: v for k, v in den.items() if k in accepted}
    return cls(**cfg).to(dtype)


def count_params(pipe: dict, diffusion: dict | None = None) -> int:
    """The denoiser's parameter count, built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = build_denoiser(pipe, diffusion or {}, torch.float32)
    return sum(p.numel() for p in model.parameters())


def measure_diffusion(job: dict, steps: int = 2, trace: bool = False) -> MeasureResult:
    job = dict(job.to_dict() if hasattr(job, "to_dict") else job)
    pipe, diffusion = job["model"], dict(job.get("diffusion") or {})
    if diffusion.get("text_encoders") != "precomputed" or diffusion.get("vae") != "precomputed":
        raise ValueError("measure_diffusion runs the denoiser only: set diffusion.text_encoders and "
                         "diffusion.vae to precomputed")
    dtype, _ = precision_dtypes(norm_precision(job.get("precision", "fp32")))
    torch.manual_seed(0)
    model = build_denoiser(pipe, diffusion, dtype)
    built = sum(p.numel() for p in model.parameters())
    if pipe["denoiser"].get("num_params") != built:
        raise ValueError(f"denoiser.num_params: the pipeline says {pipe['denoiser'].get('num_params')}, "
                         f"the built {pipe['denoiser']['class']} has {built}")
    frozen = None
    if diffusion.get("frozen_copy"):
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
    if job.get("method", "full") == "lora":
        from peft import LoraConfig
        r = int((job.get("lora") or {}).get("r", 8))
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=r, lora_alpha=r, init_lora_weights=True,
                                     target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        for p in model.parameters():  # diffusers' scripts cast the adapters to fp32
            if p.requires_grad:
                p.data = p.data.float()
    elif job.get("method", "full") != "full":
        raise ValueError("method: full or lora")
    if job.get("gradient_checkpointing") in ("full", True):
        model.enable_gradient_checkpointing()
    model.train()
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    b = int(job.get("micro_batch_size", 1)) * (2 if diffusion.get("prior_preservation") else 1)
    flow = pipe["denoiser"]["class"] in FLOW_MATCHING
    meter = MemoryMeter(trace=trace)
    if trace:
        meter.track_modules(model)
    meter.register(model.parameters(), "parameter")
    meter.register(model.buffers(), "buffer")
    if frozen is not None:
        meter.register(frozen.parameters(), "frozen_parameter")
        meter.register(frozen.buffers(), "buffer")
    meter.register(_live_tensors(), "preexisting")
    g = torch.Generator().manual_seed(0)
    grads = 0
    # gradient accumulation: `accum` forward/backward passes into the same .grad, then one
    # step; zero_grad(set_to_none=...) as the spec's diffusion.set_grads_to_none resolves it
    # (False: train_dreambooth.py's default, `--set_grads_to_none` is store_true)
    accum = max(1, int(job.get("grad_accum_steps", 1) or 1))
    to_none = _grads_to_none(job)
    with meter:
        latents, kw, t = denoiser_inputs(pipe, b, latent_dims(pipe, diffusion), dtype, g)
        meter.register([latents, t] + [v for v in _leaves(kw)], "batch")
        for step in range(1, steps + 1):
            for micro in range(accum):
                with meter.phase(f"s{step}.fwd"):
                    noise = torch.randn(latents.shape, generator=g).to(dtype)
                    shape = (b,) + (1,) * (latents.dim() - 1)
                    alpha = torch.rand(b, generator=g).to(dtype).view(shape)
                    if flow:  # rectified flow (train_dreambooth_lora_flux.py / _sd3.py): x_s = (1 - s) x + s n
                        noisy = (1 - alpha) * latents + alpha * noise
                    else:  # DDPMScheduler.add_noise
                        noisy = alpha.sqrt() * latents + (1 - alpha).sqrt() * noise
                    pred = call_denoiser(model, pipe, noisy, kw, t)
                    target = noise - latents if flow else noise  # flow matching predicts n - x
                    if frozen is not None:  # the frozen copy's prediction is the target
                        with meter.phase(f"s{step}.ref"), torch.no_grad():
                            target = call_denoiser(frozen, pipe, noisy, kw, t)
                    loss = F.mse_loss(pred.float(), target.float())
                    del pred, target
                if step == steps and micro == accum - 1:
                    meter.mark("end_of_forward")
                with meter.phase(f"s{step}.bwd"):
                    loss.backward()
                if micro < accum - 1:
                    del loss, noise, noisy, alpha
            grads = unique_bytes([p.grad for p in model.parameters() if p.grad is not None])
            with meter.phase(f"s{step}.opt"):
                opt.step()
                opt.zero_grad(set_to_none=to_none)
            del loss, noise, noisy, alpha
    return metered_result(meter, model, opt, grads, PHASES, trace=trace)


def _grads_to_none(job: dict) -> bool:
    """The `set_to_none` of the loop's zero_grad: the spec's resolution (jobs/diffusion_scripts.py)."""
    from vramplan.jobs.diffusion_scripts import grads_kept
    from vramplan.spec import load_spec
    return not grads_kept(load_spec(job))


def _leaves(kw: dict) -> list:
    out = []
    for v in kw.values():
        out += _leaves(v) if isinstance(v, dict) else ([v] if isinstance(v, torch.Tensor) else [])
    return out


__all__ = ["build_denoiser", "count_params", "measure_diffusion"]
