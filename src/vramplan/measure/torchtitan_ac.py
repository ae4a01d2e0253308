"""torchtitan's activation checkpointing applied to a transformers model's decoder layers.

* op-selective: torchtitan's own `SelectiveAC` (torchtitan 0.3.0,
  torchtitan/distributed/activation_checkpoint.py), imported and applied as torchtitan's
  trainer does, `SelectiveAC(SelectiveAC.Config()).apply(model)`: it wraps every child of
  `model.layers` in torch's checkpoint_wrapper with its per-op save policy. A transformers
  `LlamaModel` (and its relatives) keeps its decoder layers in `.layers` as torchtitan's
  models do, so the policy is torchtitan's code running on the transformers layer.
* every N-th layer (`checkpoint_every`): torchtitan <= 0.2's layer-selective mode
  (`_apply_layer_sac`: `ptd_checkpoint_wrapper(module, ...)` when the global block count is
  a multiple of `selective_ac_option`), which torchtitan 0.3 no longer ships; the same torch
  wrapper, non-reentrant, on layers N, 2N, ... (counted from 1).

torchtitan is installed without its dependencies (it pins datasets < 4.8; the policy needs
only tyro and spmd_types besides torch): pyproject.toml's `torchtitan` extra says how.
"""
from __future__ import annotations

import torch


def layers_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose `.layers` ModuleList holds the decoder layers (LlamaModel under
    LlamaForCausalLM, under PEFT's wrappers too)."""
    for module in model.modules():
        if isinstance(getattr(module, "layers", None), torch.nn.ModuleList):
            return module
    raise ValueError("gradient_checkpointing: this model has no `.layers` list of decoder layers to wrap")


def apply_op_selective(model: torch.nn.Module) -> None:
    try:
        from torchtitan.distributed.activation_checkpoint import SelectiveAC
    except ImportError as exc:
        raise ValueError("gradient_checkpointing: op-selective is measured with torchtitan's own policy; "
                         "install it (pyproject.toml, extra `torchtitan`): " + str(exc)) from None
    SelectiveAC(SelectiveAC.Config()).apply(layers_owner(model))


def apply_every_nth(model: torch.nn.Module, every: int) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    owner = layers_owner(model)
    for count, (name, layer) in enumerate(list(owner.layers.named_children()), start=1):
        if count % every == 0:
            owner.layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=True))

