"""build(): precisions, methods, optimizers and honest errors, on tiny models."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramplan.measure import measure  # noqa: E402
from vramplan.measure.build import build, precision_dtypes  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "tie_word_embeddings": False}


def job(**overrides):
    j = {"model": copy.deepcopy(LLAMA), "task": "sft", "method": "full", "precision": "fp32",
         "optimizer": "adamw", "optimizer_impl": "foreach", "micro_batch_size": 1, "seq_len": 16,
         "gradient_checkpointing": "none", "attention": "sdpa", "backend": "cpu"}
    j.update(overrides)
    return j


@pytest.mark.parametrize("precision, model_dtype, autocast", [
    ("fp32", torch.float32, None), ("pure-bf16", torch.bfloat16, None),
    ("amp-bf16", torch.float32, torch.bfloat16), ("mixed-bf16", torch.bfloat16, None),
])
def test_precision_dtypes(precision, model_dtype, autocast):
    assert precision_dtypes(precision) == (model_dtype, autocast)
    built = build(job(precision=precision))
    assert {p.dtype for p in built.model.parameters()} == {model_dtype}
    assert built.autocast_dtype == autocast
    # rotary inv_freq stays fp32 when the dtype is given to from_config (as measured)
    assert all(b.dtype == torch.float32 for b in built.model.buffers())


def test_mixed_precision_keeps_fp32_masters():
    built = build(job(precision="mixed-bf16"))
    masters = [m for m, _ in built.master_pairs]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    assert built.optimizer.param_groups[0]["params"][0] is masters[0]
    r = measure(job(precision="mixed-bf16"), fake=True)
    # masters (4 B/param) + AdamW moments (8 B/param) count as optimizer state
    assert r.optimizer_state_bytes >= 12 * (r.params_bytes // 2)


def test_lora_trains_only_adapters():
    built = build(job(method="lora", lora={"r": 2, "alpha": 4, "dropout": 0.0,
                                           "target_modules": ["q_proj"]}))
    names = [n for n, p in built.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)


def test_freeze_trains_named_layers():
    built = build(job(method="freeze", freeze={"trainable_layers": [-1],
                                               "trainable_modules": ["lm_head"]}))
    names = {n for n, p in built.model.named_parameters() if p.requires_grad}
    assert any("layers.1." in n for n in names) and any("lm_head" in n for n in names)
    assert not any("layers.0." in n or "embed_tokens" in n for n in names)


@pytest.mark.parametrize("optimizer, impl, expected", [
    ("adamw", "fused", torch.optim.AdamW), ("adam", "forloop", torch.optim.Adam),
    ("sgd", "foreach", torch.optim.SGD),
])
def test_optimizer_classes(optimizer, impl, expected):
    # momentum is SGD's alone (the spec refuses it with another optimizer)
    extra = {"momentum": 0.9} if optimizer == "sgd" else {}
    opt = build(job(optimizer=optimizer, optimizer_impl=impl, **extra)).optimizer
    assert type(opt) is expected
    group = opt.param_groups[0]
    assert group.get("fused") is (True if impl == "fused" else group.get("fused"))
    assert group["foreach"] is (impl == "foreach") or impl == "fused"


def test_adafactor_is_the_one_trainer_uses():
    from transformers.optimization import Adafactor

    opt = build(job(optimizer="adafactor")).optimizer
    assert isinstance(opt, Adafactor)
    assert opt.defaults["relative_step"] is False and opt.defaults["scale_parameter"] is False


def test_clear_errors_on_cpu():
    # bitsandbytes, GPTQModel and torchao bases are measured on CPU (measure/quantized.py);
    # AWQ's kernels are CUDA-only
    with pytest.raises(ValueError, match="awq"):
        build(job(method="qlora", quantization={"type": "awq"}, backend="cuda"))
    with pytest.raises(ValueError, match="flash"):
        build(job(attention="flash"))


def test_gradient_checkpointing_is_non_reentrant():
    model = build(job(gradient_checkpointing="full")).model
    assert model.is_gradient_checkpointing
    func = model.model.layers[0]._gradient_checkpointing_func
    assert func.keywords.get("use_reentrant") is False  # Trainer's default in transformers 5


@pytest.mark.parametrize("extra, model_dtype, autocast", [
    # no stack named: bf16 is pure bf16 (spec/stack.py `plain`)
    ({}, torch.bfloat16, None),
    # HF Trainer's bf16=True: autocast over the weights as loaded; the config states no
    # dtype, so they are loaded in the dtype the word names
    ({"stack": "hf-trainer"}, torch.bfloat16, torch.bfloat16),
    ({"load_dtype": "float32"}, torch.float32, torch.bfloat16),
    ({"stack": "torchtune"}, torch.bfloat16, None),
])
def test_build_follows_the_stack(extra, model_dtype, autocast):
    built = build(job(precision="bf16", **extra))
    assert {p.dtype for p in built.model.parameters()} == {model_dtype}
    assert built.autocast_dtype == autocast


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_raw_job_without_optimizer_impl_steps_as_the_spec_assumes(backend):
    # bench/parallel passes plain dicts: the optimizer built for a job that names no
    # optimizer_impl must be the one the estimate resolves (spec/job.py), not foreach on CPU.
    from vramplan.measure.build import build_optimizer
    from vramplan.spec import load_spec
    raw = {k: v for k, v in job(backend=backend).items() if k != "optimizer_impl"}
    resolved = load_spec(raw).optimizer_impl.value
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(4))], raw)
    assert ("foreach" if opt.defaults["foreach"] else "forloop") == resolved
