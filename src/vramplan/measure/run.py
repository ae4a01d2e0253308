"""Real training steps under a meter, the way HF Trainer runs them.

One optimizer step (transformers/trainer.py ``_inner_training_loop`` and
``training_step``):
  for each of ``grad_accum_steps`` micro-steps:
      forward with ``labels=input_ids`` (the model computes the loss;
      transformers/loss/loss_utils.py ``ForCausalLMLoss`` upcasts logits to
      fp32), under ``torch.autocast`` for amp-*; the output object is dropped
      before backward; ``loss.backward()``.
  ``optimizer.step()`` then ``optimizer.zero_grad(set_to_none=True)``.
Phases: ``s{step}.fwd``, ``s{step}.bwd``, ``s{step}.opt`` (zero_grad inside opt).
The loss tensor, *with its graph*, stays alive through the optimizer step, as
in a plain ``loss = model(**batch).loss; loss.backward(); opt.step()`` loop
(the reference meter's semantics).  The graph's AccumulateGrad nodes keep
their leaf variables: with gradient checkpointing, transformers'
``_activation_checkpointing_enable`` calls ``enable_input_require_grads``
(modeling_utils.py), which on a frozen embedding (LoRA, freeze) makes the
embedding output a *leaf* that requires grad; it and its ``.grad``
(2 x b*s*h in the model dtype) then stay alive into the optimizer step.  This
reproduces the dev-truth mistral LoRA+gc optimizer peak to the byte; HF
Trainer itself returns ``loss.detach()`` from ``training_step`` and would
free them before the step.  The batch stays alive for the whole step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .build import Built
from .meter import MemoryMeter


@dataclass
class StepStats:
    """What the runner records besides the meter's phase peaks."""

    params_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    activation_bytes_end_of_forward: int = 0
    end_of_forward_bytes: int = 0
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------- tensor groups
def unique_bytes(tensors) -> int:
    """Bytes of the unique storages behind ``tensors`` (tied weights once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def param_tensors(built: Built):
    return list(built.model.parameters())


def grad_tensors(built: Built):
    return [p.grad for p in built.model.parameters() if p.grad is not None]


def _inner(v) -> list:
    """The plain tensors behind an optimizer state value: a tensor, a tensor subclass's
    inner tensors (torchao's quantized states: codes, scale, qmap), a projector object's
    matrix (GaLore/APOLLO `ortho_matrix`)."""
    if isinstance(v, torch.Tensor):
        if hasattr(v, "__tensor_flatten__") and type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter):
            names, _ = v.__tensor_flatten__()
            return [t for n in names for t in _inner(getattr(v, n))]
        return [v]
    matrix = getattr(v, "ortho_matrix", None)
    if matrix is not None:
        return [m for m in (matrix if isinstance(matrix, (list, tuple)) else [matrix])]
    return []


def state_tensors(built: Built):
    out = [m for m, _ in built.master_pairs]
    for state in built.optimizer.state.values():
        for v in state.values():
            out += _inner(v)
    for name in ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"):  # AdaLomo keeps them by name
        table = getattr(built.optimizer, name, None)
        if isinstance(table, dict):
            out += [v for v in table.values() if isinstance(v, torch.Tensor)]
    return out


def categories(built: Built) -> dict[int, str]:
    """Storage key -> category, for trace snapshots."""
    cats = {}
    for t in built.model.buffers():
        cats[MemoryMeter.key_of(t)] = "buffer"
    for t in param_tensors(built):
        cats[MemoryMeter.key_of(t)] = "parameter"
    for t in grad_tensors(built):
        cats[MemoryMeter.key_of(t)] = "gradient"
    for t in state_tensors(built):
        cats[MemoryMeter.key_of(t)] = "optimizer_state"
    return cats


# -------------------------------------------------------------------- inputs
def make_inputs(job: dict, vocab_size: int, device: str) -> dict:
    """Random token ids [micro_batch_size, seq_len] and their labels.

    Labels are a separate copy, as transformers' DataCollatorForLanguageModeling
    builds them (``labels = batch["input_ids"].clone()``); the reference meter
    counts both (2 x b*s*8 bytes, visible in every dev-truth row)."""
    b, s = int(job.get("micro_batch_size", 1)), int(job.get("seq_len", 128))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (b, s), generator=g).to(device)
    if job.get("task") == "sequence-classification":
        return {"input_ids": ids, "labels": torch.zeros(b, dtype=torch.long, device=device)}
    if job.get("packing"):
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": packed_position_ids(b, s).to(device)}
    return {"input_ids": ids, "labels": ids.clone()}


def packed_position_ids(b: int, s: int) -> torch.Tensor:
    """Position ids of rows packed with several documents and no attention mask, as TRL's
    padding-free batches and transformers' DataCollatorWithFlattening give them (positions
    restart at 0 at each document; transformers masking_utils.find_packed_sequence_indices
    reads the boundaries from them). Documents of s/4 tokens (at least one per row); only
    the boundaries' places, not the memory, depend on the lengths."""
    doc = max(1, s // 4)
    return (torch.arange(s) % doc).unsqueeze(0).repeat(b, 1)


# --------------------------------------------------------------------- steps
def _autocast(built: Built, device: str):
    if built.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=built.autocast_dtype)


def _forward(built: Built, batch: dict, device: str, scale: float):
    """(loss, the model's output object); the caller drops the output before backward, as
    Trainer does, unless the job keeps its logits."""
    with _autocast(built, device):
        out = built.model(**batch)
        loss = out.loss
    return (loss / scale if scale != 1 else loss), out


def _optimizer_step(built: Built) -> None:
    if built.master_pairs:  # mixed-*: fp32 grads onto the masters, step, copy back
        for master, p in built.master_pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None
    if not hasattr(built.optimizer, "fused_backward"):  # LOMO stepped inside backward
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for master, p in built.master_pairs:
            p.copy_(master)


def _backward(built: Built, loss: torch.Tensor) -> None:
    """loss.backward(); LOMO/AdaLomo run it through `fused_backward`, which then updates the
    last parameter (lomo_optim/lomo.py), as HF Trainer's training_step does for them."""
    fused = getattr(built.optimizer, "fused_backward", None)
    if fused is None:
        loss.backward()
    else:
        fused(loss, built.optimizer.lr)


def train_steps(built: Built, job: dict, meter, device: str, steps: int = 2) -> StepStats:
    """Run ``steps`` optimizer steps; ``meter`` has ``phase(name)`` and ``current``."""
    stats = StepStats()
    vocab = int(getattr(built.model.config, "vocab_size", 32000))
    accum = max(1, int(job.get("grad_accum_steps", 1) or 1))
    batch = make_inputs(job, vocab, device)
    keep, outputs = bool(job.get("keep_logits")), None
    for step in range(1, steps + 1):
        for micro in range(accum):
            with meter.phase(f"s{step}.fwd"):
                loss, out = _forward(built, batch, device, float(accum))
                if keep:  # a plain loop's `outputs = model(**batch)`: the last step's go only now
                    outputs = out
                del out  # Trainer drops the output object before backward
            if step == steps and micro == accum - 1:
                _record_end_of_forward(built, meter, stats, batch)
            with meter.phase(f"s{step}.bwd"):
                _backward(built, loss)
        stats.grad_bytes = unique_bytes(grad_tensors(built))
        with meter.phase(f"s{step}.opt"):
            _optimizer_step(built)
        del loss
    del outputs
    stats.params_bytes = unique_bytes(param_tensors(built))
    stats.optimizer_state_bytes = unique_bytes(state_tensors(built))
    return stats


def _record_end_of_forward(built: Built, meter, stats: StepStats, batch: dict) -> None:
    """Activations = live bytes after forward+loss minus model/optimizer state,
    minus the batch (input_ids, labels) and minus whatever was alive before
    metering started (``built.resident``)."""
    if hasattr(meter, "mark"):
        meter.mark("end_of_forward")
    model_state = unique_bytes(param_tensors(built) + grad_tensors(built) + state_tensors(built)
                               + list(built.model.buffers()) + list(batch.values())
                               + built.resident)
    stats.end_of_forward_bytes = meter.current
    stats.activation_bytes_end_of_forward = meter.current - model_state
