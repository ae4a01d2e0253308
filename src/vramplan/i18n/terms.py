"""Display labels for the estimate's term keys, phase names and peak events.

The core's keys (`activations/layers`, `optimizer/exp_avg`) are English identifiers and
stay so in every language (JSON, tests and docs grep them); a translated report shows a
label beside the key. Parts not listed here (a role's own name, a text encoder's slug)
are shown as they are.
"""
from __future__ import annotations

import re

from vramplan.i18n import DEFAULT_LANGUAGE, N_, _, get_language

TERM_PARTS = {
    # groups
    "weights": N_("weights"), "gradients": N_("gradients"), "optimizer": N_("optimizer states"),
    "activations": N_("activations"), "logits": N_("logits"), "temporaries": N_("temporaries"),
    "transient": N_("transient tensors"), "batch": N_("input batch"), "runtime": N_("runtime"),
    "backward": N_("backward temporaries"), "loss": N_("loss"), "ddp": N_("DDP"), "zero": N_("ZeRO"),
    "pp": N_("pipeline parallelism"), "tp": N_("tensor parallelism"),
    # roles of multi-model jobs
    "policy": N_("policy model"), "reference": N_("reference model"), "actor": N_("actor model"),
    "critic": N_("critic model"), "reward_model": N_("reward model"), "student": N_("student model"),
    "teacher": N_("teacher model"), "denoiser": N_("denoiser"), "vae": N_("VAE"),
    # items
    "layers": N_("layers"), "head": N_("LM head"), "embedding": N_("embedding"),
    "decoder_embedding": N_("decoder embedding"), "encoder_embedding": N_("encoder embedding"),
    "encoder_final_norm": N_("encoder final norm"), "trainable": N_("trainable"), "frozen": N_("frozen"),
    "lora_adapters": N_("LoRA adapters"), "quantized": N_("quantized weights"),
    "quant_state": N_("quantization state"), "exp_avg": N_("first moment"),
    "exp_avg_sq": N_("second moment"), "state1": N_("state 1"), "state2": N_("state 2"),
    "absmax": N_("quantization scales"), "dequantized_weight": N_("dequantized weights"),
    "dequantized_absmax": N_("dequantized quantization scales"), "step": N_("step count"), "log_softmax": N_("log-softmax"),
    "grad_log_softmax": N_("log-softmax gradient"), "grad_logits": N_("logits gradient"),
    "grad_logits_fp32": N_("logits gradient (fp32)"), "labels": N_("labels"),
    "input_ids": N_("token ids"), "attention_mask": N_("attention mask"),
    "kept_by_the_loop": N_("kept by the training loop"), "kept_input_leaf": N_("kept input leaf"),
    "checkpointed_forward": N_("a checkpointed layer's forward"),
    "completion_mask": N_("completion mask"), "advantages": N_("advantages"), "latents": N_("latents"),
    "noise": N_("noise"), "noisy_latents": N_("noisy latents"), "pixels": N_("pixels"),
    "prompt_completion_ids": N_("prompt and completion ids"),
    "ref_per_token_logps": N_("reference per-token log-probs"), "rollout_scores": N_("rollout scores"),
    "old_logps": N_("old log-probs per sequence"), "scoring": N_("scoring pass"),
    "cublas_workspace": N_("cuBLAS workspace"), "cublaslt_workspace": N_("cuBLASLt workspace"), "gradient_buckets": N_("gradient buckets"),
    "gathered_params": N_("gathered parameters"), "ipg_bucket_flat_buffer": N_("gradient reduce bucket"),
    "p2p_buffers": N_("point-to-point buffers"), "grad_hidden": N_("hidden-state gradient"),
    "grad_mlp": N_("MLP gradient"), "product": N_("product"), "target_minus_input": N_("target minus input"),
    # the log-prob head of preference/RL jobs (jobs/logprob.py)
    "logprob": N_("log-prob head"), "log_probs": N_("log-probs"), "label_mask": N_("label mask"),
    "grad_log_probs": N_("log-prob gradient"), "last_hidden_state": N_("last hidden state"),
    "head_input": N_("head input"), "scratch_tile": N_("scratch tile"), "running_stats": N_("running statistics"),
    "grad_hidden_fp32": N_("hidden-state gradient (fp32)"), "grad_weight_fp32": N_("head weight gradient (fp32)"),
    "grad_weight": N_("head weight gradient"), "tile_fp32_temporaries": N_("tile fp32 temporaries"),
    "hidden_chunk_cast": N_("hidden chunk cast"), "weight_chunk_cast": N_("weight chunk cast"),
    "tile_top1_mask": N_("tile top-1 mask"), "tile_target_mask": N_("tile target mask"),
    # what nvidia-smi counts beyond the allocator (estimation.outside_allocator)
    "cuda_context": N_("CUDA context"), "nccl": N_("NCCL communicators"), "managed": N_("managed memory"),
    "optimizer_paged": N_("paged optimizer states"),
}

PHASES = {"forward": N_("forward"), "backward": N_("backward"), "optimizer": N_("optimizer step"),
          "generation": N_("generation")}

_EVENTS = {
    "loss backward (logits gradient)": N_("loss backward (logits gradient)"),
    "end of forward (logits and loss)": N_("end of forward (logits and loss)"),
    "optimizer step": N_("optimizer step"),
    "no-grad forward": N_("no-grad forward"),
    "reference forward (no_grad log-probs)": N_("reference forward (no_grad log-probs)"),
    "policy forward (no_grad old log-probs)": N_("policy forward (no_grad old log-probs)"),
    "reference / KL-batch forward (no_grad log-probs)": N_("reference / KL-batch forward (no_grad log-probs)"),
    "policy head backward": N_("policy head backward"),
    "critic backward": N_("critic backward"),
    "distillation loss (student and teacher logits)": N_("distillation loss (student and teacher logits)"),
    "DPO metrics (entropy, mean logits)": N_("DPO metrics (entropy, mean logits)"),
    "KTO metrics (entropy, mean logits)": N_("KTO metrics (entropy, mean logits)"),
}
_LAYER_EVENT = re.compile(r"(?:(?P<role>\w+) )?layer (?P<n>\d+) (?P<pass>backward|forward)")


def term_label(key: str) -> str:
    """'activations/layers' -> the translated parts joined by '/'; unknown parts unchanged."""
    return "/".join(_(TERM_PARTS[p]) if p in TERM_PARTS else p for p in key.split("/"))


def phase_name(phase: str) -> str:
    return _(PHASES[phase]) if phase in PHASES else phase


def event_label(event: str) -> str:
    """A peak event's label in the current language, where its shape is known."""
    if event in _EVENTS:
        return _(_EVENTS[event])
    m = _LAYER_EVENT.fullmatch(event)
    if m is None or get_language() == DEFAULT_LANGUAGE:  # English keeps the core's own words
        return event
    where = _("layer {n} backward") if m["pass"] == "backward" else _("layer {n} forward")
    where = where.format(n=m["n"])
    return f"{term_label(m['role'])} {where}" if m["role"] else where


# compare's built-in strategy names (plan/compare.py) are composed of these parts, joined by
# " + " and ", "; a user's own strategy names pass through unchanged.
STRATEGY_PARTS = {
    "baseline": N_("baseline"), "checkpointing": N_("checkpointing"),
    "selective checkpointing": N_("selective checkpointing"), "cpu offload": N_("cpu offload"),
    "8-bit optimizer": N_("8-bit optimizer"), "half sequence": N_("half sequence"),
    "expandable segments": N_("expandable segments"),
}
_GPUS = re.compile(r"(?P<n>\d+) GPUs")
_MAX_SPLIT = re.compile(r"max_split_size_mb (?P<mb>\d+)")
"""compare's allocator row (plan/compare.py): the PYTORCH_CUDA_ALLOC_CONF option's own name stays."""
TIERS = {"80 GB and up": N_("80 GB and up"), "40-80 GB": N_("40-80 GB"), "24-40 GB": N_("24-40 GB"),
         "under 24 GB": N_("under 24 GB")}


def _strategy_part(part: str) -> str:
    if part in STRATEGY_PARTS:
        return _(STRATEGY_PARTS[part])
    m = _GPUS.fullmatch(part)
    if m:
        return _("{n} GPUs").format(n=m["n"])
    m = _MAX_SPLIT.fullmatch(part)
    return _("max_split_size_mb {mb}").format(mb=m["mb"]) if m else part


def strategy_label(name: str) -> str:
    """'zero-2 + cpu offload + checkpointing' with its known parts translated."""
    return ", ".join(" + ".join(_strategy_part(p) for p in chunk.split(" + ")) for chunk in name.split(", "))


def tier_label(tier: str) -> str:
    return _(TIERS[tier]) if tier in TIERS else tier


# the fit verdicts of vramplan.bounds.verdict (Estimate.verdict); JSON keeps the English word
VERDICTS = {"fits": N_("fits"), "fits only at the low end": N_("fits only at the low end"),
            "does not fit": N_("does not fit")}


def verdict_label(verdict: str | None) -> str:
    return _(VERDICTS[verdict]) if verdict in VERDICTS else str(verdict)
