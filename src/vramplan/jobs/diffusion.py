"""Diffusion / video denoiser training (`task: diffusion`).

A step (diffusers examples/*/train_*.py, e.g. cogvideo/train_cogvideox_lora.py and
dreambooth/train_dreambooth_lora_sd3.py): encode the prompt with the frozen text
encoder(s) and the pixels with the frozen VAE under torch.no_grad() (or read precomputed
embeddings / latents), add noise, run the denoiser with gradients, MSE loss against the
target in fp32, backward, optimizer step. Optionally a frozen copy of the denoiser
(unlearning, distillation) runs a no_grad forward on the same input after the trained one.

The denoiser's activations: transformer denoisers replay one block on the recorder
(components/arch_dit.py) per layer over b x (text + video) tokens; a UNet sums its levels
(arch_dit.unet_level_saved). Frozen modules either stay on this GPU or, with
`offload_frozen` (diffusers enable_model_cpu_offload: one model on the GPU at a time, moved
in at its forward), count only in their own forward event.
Measured against vramplan.measure.diffusion (a tiny CogVideoXTransformer3DModel, full /
LoRA / frozen copy, fp32 / bf16; bench/jobs): peaks within 1.5%; LTX-Video, HunyuanVideo
and Mochi (jobs/diffusion_video.py; bench/video): peaks within 1.0%.
Legend: b batch, C latent channels, F latent frames, H, W latent side, n video tokens,
m text tokens, h hidden, c compute dtype.
"""
from __future__ import annotations

import os

from vramplan.breakdown import Breakdown
from vramplan.catalog.pipelines import check_shape, denoiser_tokens, latent_shape
from vramplan.components.arch_dit import DitCtx, joint_block
from vramplan.components.graph import Recorder
from vramplan.components.optimizer import optimizer_states, step_temporaries
from vramplan.components.trainable import HeldParam, ParamSet
from vramplan.i18n import Msg
from vramplan.jobs.compose import Step, finish
from vramplan.jobs.diffusion_dit import acts_at_peak as dit_acts_at_peak
from vramplan.jobs.diffusion_dit import DIT, block_backward, block_params, grads_in_flight, trained_dit
from vramplan.jobs.diffusion_frozen import frozen_modules
from vramplan.jobs.diffusion_unet import unet_lora_acts_at_peak, unet_lora_params, unet_lora_transients, unet_stages
from vramplan.jobs.diffusion_scripts import adapter_dtype, grads_kept, script_loss, scripts_stack
from vramplan.jobs.diffusion_video import VIDEO_CLASSES, checkpointed, checkpointed_backward_transient, first_block_grads
from vramplan.jobs.diffusion_blocks import (BLOCK_CLASSES, block_ctx, block_forward_transient, block_stages,
                                            block_transients, feed_forward_params, lora_targets,
                                            output_backward_transient)
from vramplan.jobs.diffusion_blocks import buffers as block_buffers
from vramplan.spec import Checkpointing, JobSpec, Method, SpecError
from vramplan.timeline import StepPlan
from vramplan.units import nbytes


def resolve_pipeline(model) -> dict:
    """An edge: a catalog pipeline by name / hub id, a diffusers pipeline folder (a path, or a
    hub id in the local Hugging Face cache: catalog/model_index.py), or an inline dict of the
    catalog's fields."""
    if isinstance(model, dict):
        if "denoiser" not in model or "kind" not in model:
            raise ValueError("an inline pipeline needs kind, denoiser, vae and text_encoders")
        return model
    from vramplan.catalog.model_index import not_cached, pipeline_at
    from vramplan.catalog.pipelines import find_pipeline
    try:
        return find_pipeline(model)
    except KeyError as exc:  # a diffusers folder, a language model (or a typo) under task diffusion
        local = pipeline_at(model)
        if local is not None:
            return local
        if os.path.isdir(os.path.expanduser(model)):
            raise SpecError("model", f"{model} has no model_index.json; task diffusion needs a diffusers pipeline "
                            "folder (model_index.json, transformer/ or unet/, vae/, text_encoder*/)") from None
        if _hub_id_outside_catalogs(model):
            raise not_cached(model) from None
        hint = str(exc.args[0]).partition("; did you mean")[1:]
        raise SpecError("model", f"{model!r} is not a diffusion pipeline; task diffusion needs one from "
                        f"`vramplan models` (e.g. flux.1-dev), or drop task diffusion for a language model"
                        + "".join(hint)) from None


def _hub_id_outside_catalogs(model: str) -> bool:
    """`owner/name` that is neither a path nor a catalog language model (whose message says
    to drop task diffusion)."""
    from vramplan import catalog
    if model.count("/") != 1 or model.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(model)):
        return False
    try:
        catalog.find_model(model)
    except (catalog.UnknownNameError, KeyError, ValueError):
        return True
    return False


def check_spec_shape(spec: JobSpec) -> None:
    """The spec's height, width and frames against its pipeline (catalog/pipelines.check_shape)."""
    cfg = spec.diffusion
    check_shape(resolve_pipeline(spec.model), cfg.height, cfg.width, cfg.num_frames)


def _hidden(den: dict) -> int:
    return den["num_attention_heads"] * den["attention_head_dim"]


def denoiser_params(pipe: dict, spec: JobSpec) -> ParamSet:
    """The denoiser's weights as one tensor per block (catalog `num_params`, evenly per
    block: memory depends on counts, not on the split), plus LoRA adapters on to_q, to_k,
    to_v, to_out.0 of every transformer block (r x h + h x r each)."""
    den = pipe["denoiser"]
    w = spec.precision.weight_dtype
    full = spec.method is Method.FULL
    if pipe["kind"] == "unet":
        return ParamSet((HeldParam("denoiser", (den["num_params"],), w, full, "base"),) + unet_lora_params(den, spec))
    layers = den["num_layers"] + den.get("num_single_layers", 0)
    per = den["num_params"] // layers
    out = []
    for i in range(layers):
        if trained_dit(den, spec):
            out += block_params(den, per, w, i)  # jobs/diffusion_dit.py: ff.net.2's at the peak
            continue
        ff = feed_forward_params(den, i) if full and den.get("class") in BLOCK_CLASSES else 0
        # A trained block's backward peaks in its feed-forward, its first op in backward: only
        # the feed-forward's weight gradients exist then; the rest come after (counted with
        # the next stage in backward order).
        if ff:
            out.append(HeldParam(f"blocks.{i}.ff", (ff,), w, full, "base", i))
        out.append(HeldParam(f"blocks.{i}", (per - ff,), w, full, "base", max(i - 1, 0) if ff else i))
    out.append(HeldParam("embeddings_and_head", (den["num_params"] - per * layers,), w, full, "base"))
    if spec.method in (Method.LORA, Method.QLORA):
        r = spec.lora.r
        for i in range(layers):
            out += [HeldParam(f"blocks.{i}.{m}.lora", (r * width,), adapter_dtype(spec), True, "lora", i)
                    for m, width in lora_targets(den, i)]
    return ParamSet(tuple(out))


def transformer_stages(pipe: dict, spec: JobSpec, b: int, n: int, m: int) -> list[Breakdown]:
    """Saved tensors per block (forward order), replayed once and repeated."""
    den = pipe["denoiser"]
    h, c = _hidden(den), spec.precision.compute_dtype
    full = spec.method is Method.FULL
    ctx = DitCtx(hidden=h, heads=den["num_attention_heads"], ff_mult=den.get("ff_mult", 4), dtype=c,
                 trainable=full, lora_rank=spec.lora.r if spec.lora and not full else 0,
                 qk_norm=den.get("qk_norm", True), lora_dtype=adapter_dtype(spec))
    rec = Recorder(backend=spec.backend.value)
    x = rec.new("hidden", (b, n, h), c, full)
    txt = rec.new("text", (b, m, h), c, full) if m else None
    emb = rec.new("temb", (b, 1, h), c, full)
    rec.seen.update({id(x.storage), id(emb.storage)} | ({id(txt.storage)} if txt is not None else set()))
    joint_block(rec, ctx, x, txt, emb)
    one = Breakdown()
    for name, size in rec.saved_items():
        one.add(f"denoiser/activations/blocks/{name.replace('/', '.')}", size)
    # the block's inputs are its predecessor's outputs: count them once per block
    one.add("denoiser/activations/blocks/input", nbytes(b * (n + m) * h, c) if full or ctx.lora_rank else 0)
    layers = den["num_layers"] + den.get("num_single_layers", 0)
    return [Breakdown().merge(one) for _ in range(layers)] + [output_stage(pipe, spec, b, n)]


def output_stage(pipe: dict, spec: JobSpec, b: int, n: int) -> Breakdown:
    """After the blocks (diffusers CogVideoXTransformer3DModel.forward, SD3Transformer2DModel
    / FluxTransformer2DModel: `norm_out` then `proj_out`, then the unpatchify reshape):
    the last block's video output (saved by the next LayerNorm), CogVideoX's `norm_final`
    output (its LayerNorm over the video tokens, before norm_out), AdaLayerNorm's LayerNorm
    output (saved by the `* (1 + scale)` product) and its modulated output (saved by
    proj_out), all (b, n, h); proj_out's output and the unpatchified prediction (a copy:
    the permute before the reshape makes it non-contiguous), latent-sized. Only when the
    blocks train (full); LoRA on attention leaves these unsaved."""
    den, c = pipe["denoiser"], spec.precision.compute_dtype
    bnh = nbytes(b * n * _hidden(den), c)
    video = pipe["kind"] == "video-dit"
    if spec.method is not Method.FULL:
        # frozen norm_out / proj_out: only the LayerNorms' inputs are saved (the hidden
        # states still require grad through the adapters); the frozen scale saves nothing.
        return Breakdown().add("denoiser/activations/output/hidden", (2 if video else 1) * bnh)
    p = den.get("patch_size", 1) * den.get("latent_packing", 1)
    out_elems = b * n * p * p * den.get("out_channels", den.get("in_channels", pipe["vae"]["latent_channels"]))
    return (Breakdown().add("denoiser/activations/output/hidden", (4 if video else 3) * bnh)
            .add("denoiser/activations/output/proj_out", 2 * nbytes(out_elems, c)))


_SCRIPT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
"""diffusers' training scripts' LoRA targets (train_dreambooth_lora*.py, train_text_to_image_lora.py)."""


def diffusion_estimate(pipe: dict, spec: JobSpec, gpu=None):
    cfg = spec.diffusion
    check_shape(pipe, cfg.height, cfg.width, cfg.num_frames)
    targets = spec.lora.target_modules if spec.lora is not None else None
    if targets is not None and tuple(targets) not in (("q_proj", "v_proj"), _SCRIPT_TARGETS):
        # the adapters are counted on the scripts' targets (diffusion_blocks.lora_targets); other
        # names would be ignored, and a number printed for a job not asked
        raise SpecError("lora.target_modules", f"diffusion LoRA is modelled on diffusers' training scripts' targets "
                        f"({', '.join(_SCRIPT_TARGETS)}); drop target_modules or name those, got {targets!r}")
    b, c, w = spec.micro_batch_size, spec.precision.compute_dtype, spec.precision.weight_dtype
    if cfg.prior_preservation:  # train_dreambooth*.py: torch.cat([instance, class]) in every batch
        b *= 2
    shape = latent_shape(pipe, b, cfg.height, cfg.width, cfg.num_frames)
    if cfg.controlnet:
        from vramplan.jobs.diffusion_controlnet import controlnet_estimate
        return controlnet_estimate(pipe, spec, shape, gpu)
    tokens = denoiser_tokens(pipe, cfg.height, cfg.width, cfg.num_frames)
    n, m = tokens["image"], tokens["text"]
    params = denoiser_params(pipe, spec)
    if pipe["kind"] == "unet":
        # SDXL concatenates CLIP-L's and CLIP-G's 77 states on the feature axis
        ctx_tokens = max(e["max_tokens"] for e in pipe["text_encoders"])
        stages = unet_stages(pipe, spec, b, shape[3], shape[4], ctx_tokens)
    elif pipe["denoiser"].get("class") in BLOCK_CLASSES:
        stages = block_stages(pipe, spec, b, n, m or tokens["context"])
    else:
        stages = transformer_stages(pipe, spec, b, n, m)
    latent_elems = 1
    for d in shape:
        latent_elems *= d
    static = Breakdown()
    trainable_keys = ParamSet(params.params)
    for p in params.params:
        key = "weights/lora_adapters" if p.kind == "lora" else ("weights/trainable" if p.trainable else "weights/frozen")
        static.add(f"denoiser/{key}", nbytes(p.numel, p.dtype))
    static.merge(optimizer_states(spec, trainable_keys), prefix="denoiser/")
    static.add("batch/latents", nbytes(latent_elems, w)).add("batch/noisy_latents", nbytes(latent_elems, w))
    den = pipe["denoiser"]
    if pipe["kind"] == "video-dit" and not den.get("use_rotary_positional_embeddings", False):
        # CogVideoXPatchEmbed (diffusers models/embeddings.py): without rotary embeddings
        # (CogVideoX-2b) a sinusoidal `pos_embedding` buffer over text + video tokens.
        static.add("denoiser/buffers/pos_embedding", nbytes((n + m) * _hidden(den), w))
    if den.get("class") in BLOCK_CLASSES + (DIT,):
        static.merge(block_buffers(den, spec))
    grads = _grads_by_stage(params, len(stages), spec)
    # loss: F.mse_loss(pred.float(), target.float()) (diffusers train_dreambooth_lora_sd3.py):
    # mse_loss saves both inputs (tools/autograd/derivatives.yaml); in fp32 .float() is a
    # no-op and they are the prediction and the noise themselves, otherwise two fp32 copies,
    # with the c prediction alive until the loss is taken. The noise (the target) is alive
    # through the step as the latents are.
    static.add("batch/noise", nbytes(latent_elems, w))
    if c == "fp32":
        loss_saved, fwd_end = Breakdown().add("loss/pred", nbytes(latent_elems, c)), Breakdown()
    else:
        loss_saved = (Breakdown().add("loss/pred_fp32", nbytes(latent_elems, "fp32"))
                      .add("loss/target_fp32", nbytes(latent_elems, "fp32")))
        fwd_end = Breakdown().add("loss/pred", nbytes(latent_elems, c))
    if scripts_stack(spec):
        named, loss_saved = script_loss(pipe, spec, latent_elems)
        static.merge(named)
        fwd_end = Breakdown()
    bwd0 = Breakdown().add("loss/grad_pred_fp32", nbytes(latent_elems, "fp32"))
    transient = [_block_backward_transient(pipe, spec, b, n + m, c) for _ in stages]
    if pipe["denoiser"].get("class") in BLOCK_CLASSES and spec.method is not Method.FULL:
        transient = block_transients(pipe, spec, b, n, m) + transient[-1:]
    if pipe["kind"] == "unet":
        unet_fwd, transient[-2] = unet_lora_transients(pipe, spec, b, shape[3], shape[4])
    if pipe["kind"] != "unet":  # the output stage (norm_out, proj_out) has no feed-forward
        transient[-1] = Breakdown().add("denoiser/backward/grad_hidden",
                                        2 * nbytes(b * (n + m) * _hidden(pipe["denoiser"]), c))
        if pipe["denoiser"].get("class") in BLOCK_CLASSES:
            transient[-1] = output_backward_transient(pipe["denoiser"], spec, b, n)
    if spec.gradient_checkpointing is Checkpointing.FULL and pipe["kind"] != "unet":
        # diffusers' gradient checkpointing (torch.utils.checkpoint per block): each block
        # keeps its inputs; its saved tensors come back only during its own backward.
        kept = nbytes(b * (n + m) * _hidden(pipe["denoiser"]), c)
        if pipe["denoiser"].get("class") in BLOCK_CLASSES:
            # the recomputed block saves its inputs again, but they are the kept ones
            stages = [Breakdown(terms={k: v for k, v in s.terms.items() if not k.endswith(("/hidden", "/text"))})
                      for s in stages]
        outside = [Breakdown() for _ in stages]
        if den.get("class") in BLOCK_CLASSES:
            # the rotary tables (made once per forward, passed to every checkpointed block)
            # and the output stage stay saved
            outside, stages = checkpointed(stages)
        if den.get("class") in VIDEO_CLASSES:
            own = checkpointed_backward_transient(den, block_ctx(den, spec), b, n)
            transient = [Breakdown().merge(own) for _ in stages[:-1]] + transient[-1:] if own else transient
        transient = [t.merge(s, prefix="recomputed/") for t, s in zip(transient, stages)]
        stages = [Breakdown().add("denoiser/activations/checkpoint/block_input", kept).merge(o) for o in outside]
    plan = StepPlan(static=static, grads_by_stage=grads, stage_acts=stages, loss_saved=loss_saved,
                    forward_end_transient=fwd_end, loss_backward_transient=bwd0,
                    stage_backward_transient=transient, optimizer_temporaries=step_temporaries(spec, params),
                    labels=[f"denoiser stage {i} backward" for i in range(len(stages))],
                    stage_grads_at_peak=first_block_grads(den, params, grads),
                    # accumulated gradients, or gradients zeroed in place, are alive in forward
                    grads_alive_in_forward=spec.grad_accum_steps > 1 or grads_kept(spec))
    if trained_dit(den, spec):
        # at ff.net.2's AddmmBackward0 (jobs/diffusion_dit.py); one Breakdown for every block
        plan.stage_backward_transient = [block_backward(den, spec, b, n)] * (len(stages) - 1) + transient[-1:]
        plan.stage_acts_at_peak = dit_acts_at_peak(stages)
        plan.stage_grads_in_flight = grads_in_flight(den, spec, len(stages))
    if pipe["kind"] == "unet" and unet_fwd.total():  # the last up level, before the output stage
        plan.stage_forward_transient = [Breakdown() for _ in stages]
        plan.stage_forward_transient[-2] = unet_fwd
        plan.stage_acts_at_peak = unet_lora_acts_at_peak(pipe, spec, stages, b, shape[3], shape[4])
    working = Breakdown()
    if den.get("class") in BLOCK_CLASSES:
        gc = spec.gradient_checkpointing is Checkpointing.FULL
        working = block_forward_transient(den, block_ctx(den, spec), b, n, m or tokens["context"], gc)
    if working.terms and den["class"] not in VIDEO_CLASSES:
        # Flux, SD3, Wan: inside the last block, before the output stage saves anything
        plan.stage_forward_transient = [Breakdown() for _ in stages]
        plan.stage_forward_transient[-2] = working
    step = Step(plan)
    if pipe["kind"] == "video-dit" and den.get("class") not in BLOCK_CLASSES and spec.method is not Method.FULL:
        step.after_forward.append(("forward", "last block feed-forward (frozen)", _frozen_ff_forward(den, b, n + m, c),
                                   False))
    if den.get("class") in VIDEO_CLASSES:
        step.after_forward.append(("forward", "a block's working set", working, False))
    total, notes = {"denoiser": pipe["denoiser"]["num_params"]}, [f"latents {shape}; tokens {tokens}"]
    if spec.seq_len_given:  # was dropped without a word (seq_len 1e12 gave the same answer)
        notes.append(Msg("seq_len: a diffusion job reads no seq_len (its tokens come from height, width and "
                         "num_frames, the text's from the pipeline's encoders); {n:,} is not used", n=spec.seq_len))
    if pipe["kind"] == "unet" and spec.gradient_checkpointing is Checkpointing.FULL:
        # diffusers checkpoints each UNet resnet and transformer (unet_2d_blocks.py
        # `_gradient_checkpointing_func`), which the UNet's stage model does not split
        notes.append(Msg("gradient checkpointing of a UNet is not modelled: this is the step without it, "
                         "an upper bound of the checkpointed one"))
    if spec.method is not Method.FULL and spec.lora is not None and spec.lora.dropout > 0:
        notes.append(Msg("lora.dropout {p:g} on a diffusion denoiser is not modelled: the dropped copies of the "
                         "adapters' inputs (and their masks) are not counted, so the estimate is low by them",
                         p=spec.lora.dropout))
    if grads_kept(spec) and spec.grad_accum_steps == 1:
        notes.append(Msg("gradients stay allocated into the next forward (zero_grad(set_to_none=False), the "
                         "script's default); the script's --set_grads_to_none (diffusion.set_grads_to_none: true) "
                         "frees {gib:.2f} GiB in forward", gib=sum(g.total() for g in grads) / 2**30))
    total.update(frozen_modules(pipe, spec, step, b, c, w, notes, n + m))
    return finish(spec, _desc_stub(pipe), step, num_params=total,
                  trainable_params=params.numel(trainable=True), gpu=gpu, notes=notes)


def _block_backward_transient(pipe: dict, spec: JobSpec, b: int, tokens: int, c: str) -> Breakdown:
    """Above a block's saved tensors during its backward: the incoming and outgoing hidden
    gradients (2 x b x tokens x h). With the feed-forward frozen (LoRA on attention), the
    GELU's output was not saved, so at GeluBackward its incoming gradient and its result
    (b x tokens x f each, diffusers FeedForward: ff.net.0.proj -> GELU -> ff.net.2) come on
    top of everything the block saved (measured with the exact CPU meter)."""
    if pipe["kind"] == "unet":
        return Breakdown()
    h = _hidden(pipe["denoiser"])
    out = Breakdown().add("denoiser/backward/grad_hidden", 2 * nbytes(b * tokens * h, c))
    if spec.method is not Method.FULL:
        f = pipe["denoiser"].get("ffn_dim") or pipe["denoiser"].get("ff_mult", 4) * h
        ff = 2 * nbytes(b * tokens * f, c)
        if ff > out.total():
            return Breakdown().add("denoiser/backward/grad_ff", ff)
    return out


def _frozen_ff_forward(den: dict, b: int, tokens: int, c: str) -> Breakdown:
    """The forward's own peak with a frozen feed-forward (LoRA on attention; measured with
    the exact CPU meter on CogVideoXTransformer3DModel): in the last block, ff.net.0's GELU
    output (b x tokens x f; not saved: ff.net.2's weight is frozen) is alive while ff.net.2
    writes its output (b x tokens x h), above everything the blocks saved."""
    h = _hidden(den)
    f = den.get("ffn_dim") or den.get("ff_mult", 4) * h
    return (Breakdown().add("denoiser/forward/gelu_out", nbytes(b * tokens * f, c))
            .add("denoiser/forward/ff_out", nbytes(b * tokens * h, c)))


def _grads_by_stage(params: ParamSet, n_stages: int, spec: JobSpec) -> list[Breakdown]:
    out = [Breakdown() for _ in range(n_stages)]
    for p in params.trainable():
        i = p.layer if p.layer is not None and p.layer < n_stages else 0
        out[i].add("denoiser/gradients", nbytes(p.numel, p.dtype))
    return out


def _desc_stub(pipe: dict):
    """Estimate.model for a pipeline: the one field reports read of it (its name)."""
    from types import SimpleNamespace
    return SimpleNamespace(name=pipe.get("name", "pipeline"))


__all__ = ["check_spec_shape", "denoiser_params", "diffusion_estimate", "resolve_pipeline", "transformer_stages"]
