"""measure() on tiny models: fake == real, and the reported terms add up."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramplan.measure import measure  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "vocab_size": 512, "n_positions": 128, "n_embd": 64, "n_layer": 2,
        "n_head": 4, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
BASE = {"task": "sft", "method": "full", "precision": "fp32", "optimizer": "adamw",
        "optimizer_impl": "foreach", "micro_batch_size": 2, "seq_len": 32,
        "gradient_checkpointing": "none", "attention": "sdpa", "backend": "cpu"}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def job(model=LLAMA, **overrides):
    j = copy.deepcopy(BASE)
    j["model"] = copy.deepcopy(model)
    j.update(overrides)
    return j


FIELDS = ["peak_allocated_bytes", "phases", "params_bytes", "grad_bytes",
          "optimizer_state_bytes", "activation_bytes_end_of_forward", "peak_phase"]


@pytest.mark.parametrize("overrides", [
    {},
    {"gradient_checkpointing": "full"},
    {"precision": "bf16", "attention": "eager"},
    {"precision": "amp-bf16"},
    {"method": "lora", "lora": LORA, "gradient_checkpointing": "full", "precision": "bf16"},
    {"optimizer": "sgd", "momentum": 0.9, "grad_accum_steps": 2},
], ids=["fp32", "gc", "bf16-eager", "amp", "lora-gc-bf16", "sgd-accum"])
def test_fake_equals_real(overrides):
    real = measure(job(**overrides)).to_dict()
    fake = measure(job(**overrides), fake=True).to_dict()
    assert {k: fake[k] for k in FIELDS} == {k: real[k] for k in FIELDS}
    assert fake["phase_peaks"] == real["phase_peaks"]


def test_fake_equals_real_gpt2():
    real = measure(job(GPT2)).to_dict()
    fake = measure(job(GPT2), fake=True).to_dict()
    assert {k: fake[k] for k in FIELDS} == {k: real[k] for k in FIELDS}


def test_terms_by_hand_llama_fp32():
    r = measure(job())
    h, i, v, L, kv = 64, 128, 512, 2, 32  # kv = num_key_value_heads * head_dim
    params = 2 * v * h + L * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h
    assert r.params_bytes == 4 * params
    assert r.grad_bytes == 4 * params
    n_tensors = 2 + L * 9 + 1
    assert r.optimizer_state_bytes == 2 * 4 * params + 4 * n_tensors  # + fp32 step scalars
    # fp32 logits [b, s, v] and their log_softmax are both alive at the forward peak
    assert r.phases["forward"] >= r.params_bytes + r.optimizer_state_bytes + 2 * 2 * 32 * v * 4
    assert r.peak_allocated_bytes == max(r.phases.values())
    assert r.peak_phase in r.phase_peaks


def test_tied_embeddings_counted_once():
    tied = dict(LLAMA, tie_word_embeddings=True)
    a, b = measure(job(tied), fake=True), measure(job(LLAMA), fake=True)
    assert b.params_bytes - a.params_bytes == 512 * 64 * 4


def test_lora_adapters_fp32_on_bf16_base():
    r = measure(job(method="lora", lora=LORA, precision="bf16"), fake=True)
    h, i, kv, L, rank = 64, 128, 32, 2, 4
    lora = L * rank * ((h + h) + (h + kv) + (i + h))  # A: r x in, B: out x r
    assert r.grad_bytes == 4 * lora
    assert r.optimizer_state_bytes == 2 * 4 * lora + 4 * (L * 3 * 2)


def test_grad_accum_steps_change_phases_not_states():
    one = measure(job(), fake=True)
    two = measure(job(grad_accum_steps=2), fake=True)
    assert two.params_bytes == one.params_bytes and two.grad_bytes == one.grad_bytes
    # later micro-steps run their forward with the gradients already allocated
    assert two.phases["forward"] > one.phases["forward"]


def test_big_shapes_in_fake_mode_are_cheap():
    big = dict(LLAMA, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
               num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32)
    r = measure(job(big, precision="bf16", seq_len=2048, micro_batch_size=1), fake=True)
    assert r.params_bytes == 2 * (2 * 32000 * 4096 + 2 * (4 * 4096 ** 2 + 3 * 4096 * 11008
                                                          + 2 * 4096) + 4096)
    assert r.peak_allocated_bytes > 4 * r.params_bytes


DEV_TRUTH = "/work/shared/validation/cpu-dev-truth.jsonl"


@pytest.mark.parametrize("name", [
    "llama-60m/b2s512/fp32/full/adamw-foreach/sdpa/nogc",
    "mistral-85m/b2s1024/bf16/lora16-7t/adamw-foreach/sdpa/gc",
])
def test_fake_mode_reproduces_dev_truth_to_the_byte(name):
    """Fake mode in a fresh process (as a user runs it) gives the reference's bytes."""
    import json
    import os
    import subprocess
    import sys

    if not os.path.exists(DEV_TRUTH):
        pytest.skip("no shared dev truth here")
    row = next(r for r in map(json.loads, open(DEV_TRUTH)) if r["name"] == name)
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    # The reference ran without bitsandbytes; importing it (peft does, when it is installed)
    # makes its two 16-entry fp32 code tables, which a meter that counts every tensor alive
    # at its start would add (128 B). Hide it, as the reference's environment did.
    code = ("import json, sys; sys.modules['bitsandbytes'] = None; sys.path.insert(0, sys.argv[1]); "
            "from vramplan.measure import measure; "
            "print(json.dumps(measure(json.loads(sys.argv[2]), fake=True).to_dict()))")
    # the reference ran the model built in bf16 without autocast: pure bf16 (under the
    # default stack the word bf16 now means HF Trainer's autocast over the load dtype)
    job = {**row["job"], "precision": "pure-bf16"} if row["job"]["precision"] == "bf16" else row["job"]
    out = subprocess.run([sys.executable, "-c", code, src, json.dumps(job)],
                         capture_output=True, text=True, check=True).stdout
    ours = json.loads(out.strip().splitlines()[-1])
    assert {k: ours[k] for k in row["measured"]} == row["measured"]
