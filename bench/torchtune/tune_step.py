"""One torchtune recipe step on CPU under vramplan's exact meter (the measuring side of
bench/torchtune/run.py; run in its own process).

What runs is torchtune 0.6.1's own code:
  * recipes/full_finetune_single_device.py FullFinetuneRecipeSingleDevice._loss_step (the
    recipe method itself, called on a namespace holding the model, the loss and the
    activation-offloading context), then the recipe's train-loop lines: `loss * num_tokens`,
    backward, training.scale_grads, optimizer.step, zero_grad(set_to_none=True);
  * torchtune.modules.TransformerDecoder.chunked_output (the output projection per chunk)
    and torchtune.modules.loss.CEWithChunkedOutputLoss;
  * torchtune.training.get_act_offloading_ctx_manager / OffloadActivations (streams on, the
    recipe's default), with the output head under NoOpManager as torchtune sets it;
  * torchtune.training.register_optim_in_bwd_hooks with one optimizer per parameter, as the
    recipe's _setup_optimizer(optimizer_in_bwd=True) builds them.
The decoder is transformers' Llama (the architecture vramplan's estimator replays), wrapped
so that it answers like torchtune's TransformerDecoder: `output` is the head module and the
forward returns torchtune's chunked outputs (or `output(h).float()` without chunks,
torchtune/modules/transformer.py TransformerDecoder.forward).

Offloading on a CPU-only torch: OffloadActivations needs CUDA streams and a CUDA device.
`cpu_as_device` stands in: streams and events are no-ops (the stash bookkeeping that decides
which tensors stay alive runs unchanged), `torch.empty_like(..., device="cpu",
pin_memory=True)` makes a host tensor that the meter does not count (MemoryMeter.mark_host),
and `.to("cuda")` of a host tensor makes a counted device copy. So the meter sees exactly what
torchtune keeps on the device and what it brings back, with stream synchronisation taken as
immediate (the stash sizes are those of the code, not of timing).
"""
from __future__ import annotations

import contextlib
import json
import sys
import types

import torch


class _FakeStream:
    def wait_stream(self, other): pass
    def wait_event(self, event): pass
    def record_event(self, event=None): return object()


class _HostTensor(torch.Tensor):
    """A pinned host copy: `.to("cuda")` brings it back as a (counted) device tensor."""

    def to(self, *args, **kwargs):
        if (args and str(args[0]) == "cuda") or str(kwargs.get("device")) == "cuda":
            return self.as_subclass(torch.Tensor).clone()
        return super().to(*args, **kwargs)


@contextlib.contextmanager
def cpu_as_device(meter):
    """torch.cuda streams as no-ops; pinned host copies uncounted; `.to("cuda")` a device copy."""
    from torch.utils._python_dispatch import _disable_current_modes
    real_empty_like = torch.empty_like

    def empty_like(*args, **kwargs):
        if not kwargs.pop("pin_memory", False):
            return real_empty_like(*args, **kwargs)
        with _disable_current_modes():
            out = real_empty_like(*args, **kwargs).as_subclass(_HostTensor)
        meter.mark_host(out)
        return out

    saved = (torch.cuda.default_stream, torch.cuda.Stream, torch.cuda.stream, torch.Tensor.record_stream)
    torch.cuda.default_stream = lambda *a, **k: _FakeStream()
    torch.cuda.Stream = lambda *a, **k: _FakeStream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    torch.empty_like = empty_like
    try:
        yield
    finally:
        torch.cuda.default_stream, torch.cuda.Stream, torch.cuda.stream, torch.Tensor.record_stream = saved
        torch.empty_like = real_empty_like


class TuneShaped(torch.nn.Module):
    """transformers' causal LM answering like torchtune's TransformerDecoder."""

    def __init__(self, hf_model, num_output_chunks: int):
        super().__init__()
        self.decoder = hf_model.model
        self.output = hf_model.lm_head
        self.num_output_chunks = num_output_chunks

    def forward(self, tokens):
        from torchtune.modules import TransformerDecoder
        h = self.decoder(input_ids=tokens).last_hidden_state
        if self.num_output_chunks > 0:
            return TransformerDecoder.chunked_output(self, h)
        return self.output(h).float()


def _recipe_class():
    """The recipe file as installed with torchtune (recipes/__init__.py refuses package
    imports, so it is loaded by path, as `tune run` does)."""
    import importlib.util
    import os
    import torchtune
    path = os.path.join(os.path.dirname(os.path.dirname(torchtune.__file__)), "recipes",
                        "full_finetune_single_device.py")
    spec = importlib.util.spec_from_file_location("tune_recipe_full_single", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FullFinetuneRecipeSingleDevice


def _tune_lora(model, lora: dict, quantize_base: bool) -> None:
    """torchtune's LoRALinear (torchtune/modules/peft/lora.py) in place of each targeted
    projection, built in the model's dtype as torchtune's builders do (set_default_dtype),
    with an NF4 base when quantize_base; then torchtune's set_trainable_params(adapters)."""
    from torchtune import training
    from torchtune.modules.low_precision import FrozenNF4Linear
    from torchtune.modules.peft import LoRALinear, get_adapter_params, set_trainable_params
    for layer in model.decoder.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, old in list(parent.named_children()):
                if not isinstance(old, torch.nn.Linear):
                    continue
                with training.set_default_dtype(old.weight.dtype), torch.no_grad():
                    if name in lora["target_modules"]:
                        new = LoRALinear(old.in_features, old.out_features, rank=lora["r"], alpha=lora["alpha"],
                                         dropout=lora.get("dropout", 0.0), quantize_base=quantize_base)
                    elif quantize_base:  # the qlora builders' other linears (llama3/_component_builders.py)
                        new = FrozenNF4Linear(old.in_features, old.out_features, bias=False,
                                              dtype=old.weight.dtype)
                    else:
                        continue
                setattr(parent, name, new)
    set_trainable_params(model, get_adapter_params(model))


def measure(job: dict, tune: dict, steps: int = 2) -> dict:
    import torchtune
    FullFinetuneRecipeSingleDevice = _recipe_class()
    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from vramplan.measure.build import build, build_optimizer
    from vramplan.measure.meter import MemoryMeter
    from vramplan.measure.run import grad_tensors, make_inputs, param_tensors, state_tensors, unique_bytes

    torch.manual_seed(0)
    lora = job.get("lora") if job.get("method") in ("lora", "qlora") else None
    built = build({k: v for k, v in job.items() if k not in ("method", "lora", "quantization")}
                  if lora else job, "cpu")
    chunked = tune.get("chunked", False)
    model = TuneShaped(built.model, 8 if chunked else 0)
    if lora:
        _tune_lora(model, lora, job.get("method") == "qlora")
        built.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job)
    loss_fn = CEWithChunkedOutputLoss() if chunked else torch.nn.CrossEntropyLoss(ignore_index=-100)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if tune.get("optimizer_in_bwd"):
        optim_dict = {p: build_optimizer([p], job) for p in trainable}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        states = lambda: [t for o in optim_dict.values() for s in o.state.values()  # noqa: E731
                          for t in s.values() if isinstance(t, torch.Tensor)]
    else:
        states = lambda: state_tensors(built)  # noqa: E731
    meter = MemoryMeter()
    batch0 = make_inputs(job, built.model.config.vocab_size, "cpu")
    b = batch0["input_ids"].shape[0]
    with cpu_as_device(meter) if tune.get("offload") else contextlib.nullcontext():
        ctx = training.get_act_offloading_ctx_manager(model, bool(tune.get("offload")))
        recipe = types.SimpleNamespace(_model=model, activations_handling_ctx=ctx, _loss_fn=loss_fn,
                                       ignore_labels_cache=torch.full((b, 1), -100, dtype=torch.long))
        meter.register(model.parameters(), "parameter")
        meter.register(model.buffers(), "buffer")
        meter.register([recipe.ignore_labels_cache], "preexisting")
        meter.register(batch0.values(), "batch")
        with meter:
            for step in range(1, steps + 1):
                batch = {"tokens": batch0["input_ids"], "labels": batch0["labels"]}
                with meter.phase(f"s{step}.fwd"):
                    num_tokens = (batch["labels"] != loss_fn.ignore_index).sum()
                    current_loss = FullFinetuneRecipeSingleDevice._loss_step(recipe, batch) * num_tokens
                with meter.phase(f"s{step}.bwd"):
                    current_loss.backward()
                with meter.phase(f"s{step}.opt"):
                    if not tune.get("optimizer_in_bwd"):
                        training.scale_grads(model, 1 / num_tokens)
                        built.optimizer.step()
                        built.optimizer.zero_grad(set_to_none=True)
                del current_loss
    last = {k.split(".")[1]: v for k, v in meter.phase_peaks.items() if k.startswith(f"s{steps}.")}
    return {"peak_bytes": meter.peak, "peak_phase": meter.peak_label, "phase_peaks": last,
            "params_bytes": unique_bytes(param_tensors(built)),
            "optimizer_state_bytes": unique_bytes(states()),
            "runner": {"library": "torchtune", "version": torchtune.__version__,
                       "entry": "FullFinetuneRecipeSingleDevice._loss_step"},
            "torchao": __import__("torchao").__version__}


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    print(json.dumps(measure(json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
