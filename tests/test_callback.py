"""VramplanCallback on CPU with a tiny Llama: spec from the Trainer, check, logged record."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vramplan.check import DoesNotFitError  # noqa: E402
from vramplan.integrations.hf_callback import VramplanCallback, spec_from_trainer  # noqa: E402

SEQ = 16


def tiny_model():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def rows(n=8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (n, SEQ), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def trainer(tmp_path, callback, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, report_to=[], logging_steps=1, save_strategy="no", optim="adamw_torch", **kw)
    return transformers.Trainer(model=tiny_model(), args=args, train_dataset=rows(), callbacks=[callback])


def test_spec_from_trainer_reads_model_and_arguments(tmp_path):
    fields = {f.name for f in __import__("dataclasses").fields(transformers.TrainingArguments)}
    flag = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    tr = trainer(tmp_path, VramplanCallback(seq_len=SEQ), **{flag: True})
    spec = spec_from_trainer(tr.model, tr.args, seq_len=SEQ)
    assert (spec.micro_batch_size, spec.grad_accum_steps, spec.seq_len) == (2, 2, SEQ)
    assert spec.backend.value == "cpu" and spec.precision.value == "fp32"
    assert spec.gradient_checkpointing.value == "full" and spec.optimizer.value == "adamw"
    from vramplan.sources import resolve_model
    assert resolve_model(spec).num_params() == sum(p.numel() for p in tr.model.parameters())


def test_callback_logs_estimate_and_skips_cuda_on_cpu(tmp_path):
    cb = VramplanCallback(seq_len=SEQ, measure_after_steps=2)
    tr = trainer(tmp_path, cb)
    tr.train()
    records = [r for r in tr.state.log_history if "vramplan/estimate_peak_allocated_bytes" in r]
    assert len(records) == 1 and records[0]["step"] == 2
    assert records[0]["vramplan/estimate_peak_allocated_bytes"] > 0
    assert records[0]["vramplan/measured_max_allocated_bytes"] is None      # no CUDA: skipped


def test_callback_refuses_before_the_first_step(tmp_path):
    # On a CPU machine `gpu=` checks against that catalog GPU: 64K tokens of a 128-word
    # vocabulary still need far more than a T4's 15 GiB in eager attention.
    cb = VramplanCallback(seq_len=65536, gpu="t4", attention="eager", micro_batch_size=64)
    tr = trainer(tmp_path, cb)
    with pytest.raises(DoesNotFitError, match="does not fit"):
        tr.train()
    assert tr.state.global_step == 0


def test_spec_from_a_trl_config_names_the_task_and_the_installed_releases(tmp_path):
    # TRL's configs subclass TrainingArguments: the callback reads which trainer runs the step
    # and the releases installed here, which decide TRL's heads (jobs/logprob.py)
    trl = pytest.importorskip("trl")
    from importlib.metadata import version
    model = tiny_model()
    common = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "per_device_train_batch_size": 2}
    installed = ".".join(version("trl").split(".")[:2])
    sft = spec_from_trainer(model, trl.SFTConfig(**common), seq_len=SEQ)
    assert (sft.task.value, sft.stack.framework.value, sft.stack.trl) == ("sft", "trl", installed)
    assert sft.stack.transformers == ".".join(transformers.__version__.split(".")[:2])
    ipo = spec_from_trainer(model, trl.DPOConfig(**common, loss_type="ipo", precompute_ref_log_probs=True))
    assert (ipo.task.value, ipo.seq_len, ipo.reference_model) == ("ipo", trl.DPOConfig(**common).max_length,
                                                                   "precomputed")
    grpo_args = trl.GRPOConfig(**common, num_generations=2, max_completion_length=24, beta=0.04)
    grpo = spec_from_trainer(model, grpo_args, seq_len=SEQ)
    assert (grpo.task.value, grpo.num_generations, grpo.max_new_tokens, grpo.reference_model) == ("grpo", 2, 24, None)
    # RLOOConfig: GRPO's fields; its default beta 0.05 keeps a reference, beta 0 drops it
    rloo = spec_from_trainer(model, trl.RLOOConfig(**common, max_completion_length=16), seq_len=SEQ)
    assert (rloo.task.value, rloo.num_generations, rloo.max_new_tokens, rloo.reference_model) == ("rloo", 2, 16, None)
    rloo0 = spec_from_trainer(model, trl.RLOOConfig(**common, beta=0.0), seq_len=SEQ)
    assert rloo0.reference_model == "precomputed"
    # DistillationConfig: on-policy distillation, the teacher passed as an override here
    dist = spec_from_trainer(model, trl.DistillationConfig(**common, max_completion_length=8), seq_len=SEQ,
                             teacher=model.config.to_dict())
    assert (dist.task.value, dist.max_new_tokens) == ("distill", 8)
    plain = spec_from_trainer(model, transformers.TrainingArguments(**common), seq_len=SEQ)
    assert (plain.task.value, plain.stack.framework.value) == ("sft", "hf-trainer")
