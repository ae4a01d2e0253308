"""The real optimizers beyond torch's AdamW/SGD, built from the job as their libraries
and HF Trainer build them (transformers/trainer_optimizer.py), imported lazily.

  * GaLore / APOLLO (galore-torch, apollo-torch): Trainer's ``_setup_low_rank_optimizer``
    puts the weights of the targeted ``nn.Linear`` modules in a group with ``rank``,
    ``update_proj_gap``, ``scale``, ``proj_type``; everything else in a plain group.
  * Muon (torch.optim.Muon): the class takes only 2-D parameters; the usual recipe
    (Keller Jordan's muon.py, Moonlight) steps the hidden layers' matrices with Muon and
    the embeddings, head and 1-D parameters with AdamW: two optimizers stepped in turn.
  * Adam-mini (adam-mini): ``Adam_mini(named_parameters, dim, n_heads, n_kv_heads)``.
  * Schedule-free AdamW (schedulefree): ``AdamWScheduleFree``, put in train mode
    (``optimizer.train()``) before the first step as Trainer does.
  * torchao AdamW8bit / AdamW4bit (torchao.optim).
  * LOMO / AdaLomo (lomo-optim): ``Lomo(model, lr)`` registers its update as gradient
    hooks; the step runs in ``fused_backward``.
  * optimizer_in_backward: one optimizer per parameter stepped in a
    ``register_post_accumulate_grad_hook`` (torchtune training/memory.py
    ``register_optim_in_bwd_hooks``; PyTorch tutorial "How to save memory by fusing the
    optimizer step into the backward pass"); ``step``/``zero_grad`` are then no-ops.
"""
from __future__ import annotations

import importlib
import re

import torch

_LAYER = re.compile(r"\.(layers|h|blocks|layer)\.(\d+)\.")

# pip names of the libraries (pinned in pyproject's `measure` extra)
_PACKAGES = {"galore_torch": "galore-torch", "apollo_torch": "apollo-torch", "adam_mini": "adam-mini",
             "schedulefree": "schedulefree", "torchao.optim": "torchao", "lomo_optim": "lomo-optim"}


def _import(module: str, optimizer: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"optimizer: {optimizer} is measured with the {_PACKAGES[module]} package; "
                         f"install it (pip install 'vramplan[measure]')") from None


class Chain:
    """Several optimizers stepped in turn (Muon + AdamW), or none at all (in-backward)."""

    def __init__(self, optimizers: list, step_in_backward: bool = False):
        self.optimizers = optimizers
        self.step_in_backward = step_in_backward

    @property
    def state(self) -> dict:
        out = {}
        for opt in self.optimizers:
            out.update(opt.state)
        return out

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        if not self.step_in_backward:
            for opt in self.optimizers:
                opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.step_in_backward:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=set_to_none)


def in_backward(make, params: list[torch.Tensor]) -> Chain:
    """One optimizer per parameter, stepped and its gradient freed as soon as backward has
    accumulated that gradient (torch.Tensor.register_post_accumulate_grad_hook)."""
    per_param = {p: make([p]) for p in params}

    def hook(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad(set_to_none=True)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return Chain(list(per_param.values()), step_in_backward=True)


def _target_weights(model, targets) -> set[str]:
    """transformers' _setup_low_rank_optimizer: weights of nn.Linear modules whose name
    matches a target ('all-linear': every nn.Linear)."""
    from transformers.trainer_utils import check_target_module_exists

    all_linear = isinstance(targets, str) and targets.replace("_", "-") == "all-linear"
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (
                all_linear or check_target_module_exists(targets, module_name)):
            names.add(module_name + ".weight")
    if not names:
        raise ValueError(f"low_rank.target_modules: no nn.Linear module matches {targets!r}")
    return names


def _low_rank(name: str, model, job: dict, lr: float, wd: float):
    low = dict(job.get("low_rank") or {})
    targets = low.get("target_modules") or "all-linear"
    chosen = _target_weights(model, targets if isinstance(targets, str) else list(targets))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n not in chosen]},
              {"params": [p for n, p in named if n in chosen], "rank": int(low["rank"]),
               "update_proj_gap": int(low.get("update_proj_gap", 200)),
               "scale": float(low.get("scale", 0.25 if name == "galore-adamw" else 1.0)),
               "proj_type": low.get("proj_type", "std")}]
    if name == "galore-adamw":
        return _import("galore_torch", name).GaLoreAdamW(groups, lr=lr, weight_decay=wd)
    groups[1].update(proj="random", scale_type="channel")
    return _import("apollo_torch", name).APOLLOAdamW(groups, lr=lr, weight_decay=wd)


def _eager_steps(opt):
    """torchao's step calls `torch.compile(single_param_adam, fullgraph=True)` per parameter;
    dynamo refuses to trace under the meter's (non-infra) TorchDispatchMode, so during the
    step `torch.compile` returns the library's function unchanged and it runs eagerly: the
    unfused temporaries of the library's own update (inductor's fused kernel needs fewer,
    and allocates them outside the dispatcher)."""
    from unittest import mock

    step = opt.step

    def eager_step(*args, **kwargs):
        with mock.patch.object(torch, "compile", lambda fn, **_: fn):
            return step(*args, **kwargs)

    opt.step = eager_step
    return opt


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside a hidden layer (not the embeddings or the head)."""
    return p.ndim == 2 and _LAYER.search(name) is not None


def build_named(name: str, model, params: list[torch.Tensor], job: dict, lr: float, wd: float):
    """The optimizer `name` over the trainable `params` of `model`; None if not one of these."""
    if name in ("galore-adamw", "apollo-adamw"):
        if model is None:
            raise ValueError(f"optimizer: {name} needs the model (its target modules)")
        return _low_rank(name, model, job, lr, wd)
    if name == "muon":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        muon = [p for n, p in named if is_muon_matrix(n, p)]
        rest = [p for n, p in named if not is_muon_matrix(n, p)]
        opts = [torch.optim.Muon(muon, lr=lr, weight_decay=wd)] if muon else []
        if rest:
            opts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=wd, foreach=job.get("optimizer_impl") == "foreach"))
        return Chain(opts)
    if name == "adam-mini":
        cfg = model.config
        heads = int(cfg.num_attention_heads)
        return _import("adam_mini", name).Adam_mini(
            [(n, p) for n, p in model.named_parameters() if p.requires_grad], lr=lr, weight_decay=wd,
            dim=int(cfg.hidden_size), n_heads=heads,
            n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads), verbose=False)
    if name == "schedule-free-adamw":
        sf = _import("schedulefree", name)
        opt = sf.AdamWScheduleFree(params, lr=lr, weight_decay=wd,
                                   foreach=job.get("optimizer_impl") == "foreach")
        opt.train()
        return opt
    if name in ("torchao-adamw-8bit", "torchao-adamw-4bit"):
        ao = _import("torchao.optim", name)
        cls = ao.AdamW8bit if name.endswith("8bit") else ao.AdamW4bit
        return _eager_steps(cls(params, lr=lr, weight_decay=wd))
    if name == "lomo":
        return _import("lomo_optim", name).Lomo(model, lr=lr, weight_decay=wd)
    if name == "adalomo":
        return _states_on_model_device(_import("lomo_optim", name).AdaLomo, model, lr=lr, weight_decay=wd)
    return None


def _stay(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """`Tensor.cuda` for a CPU measurement: the tensor itself, where it already is."""
    return self


def _states_on_model_device(cls, model, **kwargs):
    """lomo_optim/adalomo.py `AdaLomo.__init__` makes each state as
    `torch.zeros(shape, dtype=torch.float32).cuda()`: an fp32 tensor built on the host, then
    copied to the GPU; that `.cuda()` is its only device move (`fuse_update` computes on the
    parameters' and states' device). For a CPU measurement `Tensor.cuda` is redirected, only
    while the constructor runs, to return the tensor itself: the state is the library's own
    `torch.zeros` allocation, kept on the CPU. No byte changes: on a GPU the device holds
    exactly that fp32 tensor (the host copy is freed and never counted as device memory); on
    the CPU the meter sees the same shape and dtype, once."""
    from unittest import mock

    if next(model.parameters()).device.type != "cpu":
        return cls(model, **kwargs)
    with mock.patch.object(torch.Tensor, "cuda", _stay):
        return cls(model, **kwargs)
