"""The frozen parts of a diffusers pipeline built from an inline pipeline with random weights:
the VAE (diffusers `AutoencoderKL`, `AutoencoderKLCogVideoX`) and the text encoders
(transformers `CLIPTextModel`, `CLIPTextModelWithProjection`, `T5EncoderModel`).

The pipeline's `vae` entry carries the VAE class's own `__init__` keys (block_out_channels,
layers_per_block, down_block_types, ...; the keys the class does not take are left out);
a text encoder entry uses the catalog's names (d_model, num_layers, num_heads, d_ff, d_kv,
max_tokens) plus `vocab_size`, mapped to the transformers config here. Each built model's
parameter count is checked against the entry's `num_params`, so the pipeline that is
estimated is the one that was run.
"""
from __future__ import annotations

import inspect

import torch


def _check_count(name: str, entry: dict, model: torch.nn.Module) -> None:
    built = sum(p.numel() for p in model.parameters())
    if entry.get("num_params") != built:
        raise ValueError(f"{name}.num_params: the pipeline says {entry.get('num_params')}, "
                         f"the built {entry.get('class')} has {built}")


def build_vae(pipe: dict) -> torch.nn.Module:
    """The pipeline's VAE class with the entry's keys; its compression must be the entry's."""
    import diffusers
    entry = pipe["vae"]
    cls = getattr(diffusers, entry.get("class", "AutoencoderKL"))
    accepted = inspect.signature(cls.__init__).parameters
    model = cls(**{k: v for k, v in entry.items() if k in accepted})
    levels = len(model.config.block_out_channels) - 1
    if 2 ** levels != entry["spatial_compression"]:
        raise ValueError(f"vae.spatial_compression: {entry['spatial_compression']}, but "
                         f"{len(model.config.block_out_channels)} levels downsample by {2 ** levels}")
    _check_count("vae", entry, model)
    return model


def text_config(entry: dict):
    """The transformers config of a text encoder entry."""
    cls = entry.get("class", "CLIPTextModel")
    if cls == "T5EncoderModel":
        from transformers import T5Config
        return T5Config(d_model=entry["d_model"], d_ff=entry["d_ff"], d_kv=entry.get("d_kv", 64),
                        num_layers=entry["num_layers"], num_heads=entry["num_heads"],
                        vocab_size=entry.get("vocab_size", 32128),
                        feed_forward_proj=entry.get("feed_forward_proj", "gated-gelu"))
    from transformers import CLIPTextConfig
    vocab = entry.get("vocab_size", 49408)
    return CLIPTextConfig(bos_token_id=min(49406, vocab - 2), eos_token_id=min(49407, vocab - 1),hidden_size=entry["d_model"], intermediate_size=entry["d_ff"],
                          num_hidden_layers=entry["num_layers"], num_attention_heads=entry["num_heads"],
                          max_position_embeddings=entry["max_tokens"], vocab_size=vocab,
                          projection_dim=entry.get("projection_dim", entry["d_model"]),
                          hidden_act=entry.get("hidden_act", "quick_gelu"))


def build_text_encoder(entry: dict) -> torch.nn.Module:
    import transformers
    cls = getattr(transformers, entry.get("class", "CLIPTextModel"))
    model = cls(text_config(entry))
    _check_count(f"text_encoders.{entry.get('role', 'text')}", entry, model)
    return model


def count_frozen(pipe: dict) -> dict[str, int]:
    """Parameter counts of the VAE and text encoders built on the meta device."""
    out = {}
    with torch.device("meta"):
        import diffusers
        entry = pipe["vae"]
        cls = getattr(diffusers, entry.get("class", "AutoencoderKL"))
        accepted = inspect.signature(cls.__init__).parameters
        out["vae"] = sum(p.numel() for p in cls(**{k: v for k, v in entry.items() if k in accepted}).parameters())
        import transformers
        for enc in pipe["text_encoders"]:
            model = getattr(transformers, enc.get("class", "CLIPTextModel"))(text_config(enc))
            out[f"text_encoder_{enc['role']}"] = sum(p.numel() for p in model.parameters())
    return out


__all__ = ["build_text_encoder", "build_vae", "count_frozen", "text_config"]
