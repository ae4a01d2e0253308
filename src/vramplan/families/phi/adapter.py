"""Phi (phi-1, phi-1.5, phi-2) config -> ModelDesc.

The parameter list is catalog/hf.py's (PhiForCausalLM: q/k/v/dense with bias, fc1/fc2,
one input_layernorm per layer, final_layernorm, biased lm_head), checked against the
real model in tests/test_catalog.py. What that list cannot say is how much of each head
rotates: PhiAttention.rotary_ndims = int(head_dim * partial_rotary_factor), with
PhiConfig.__post_init__ defaulting the factor to 0.5 (transformers 5.24,
models/phi/configuration_phi.py).
"""
from __future__ import annotations

from dataclasses import fields, replace

from vramplan.catalog.hf import decoder_desc
from vramplan.catalog.hf_config import HFCfg
from vramplan.families import rotary_factor
from vramplan.families.common import FamilyDesc
from vramplan.model import ModelDesc, ParamEntry


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    base = decoder_desc(HFCfg(config, "phi"), name, num_labels)
    rotary = int(base.head_dim * rotary_factor(config, 0.5))
    if base.tie_word_embeddings and not num_labels:
        # PhiForCausalLM.lm_head is Linear(h, v, bias=True): tying shares only the weight.
        base = replace(base, params=base.params + (ParamEntry("lm_head.bias", (base.vocab_size,)),))
    # PhiModel applies its residual dropout (resid_pdrop) to attention and MLP outputs, and
    # embd_pdrop after the embedding; the base desc carries both.
    # a FamilyDesc: it brings this folder's forward.py (FamilyDesc.family_forward)
    return FamilyDesc(**{f.name: getattr(base, f.name) for f in fields(ModelDesc)},
                      rotary_dim=rotary, parallel_residual=True, num_layer_norms=1)
