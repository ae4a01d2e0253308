"""What each stack does to a quantized base before adapter training (components/qlora_prep.py),
checked against the real libraries: the trainers of the installed TRL handed a bitsandbytes
nf4 base and a LoraConfig as TRL documents it, and PEFT's prepare_model_for_kbit_training.
The bytes of the parameters the quantizer left (frozen) and of the trained ones must be the
estimate's. The releases we cannot install are checked by their rule (the TRL source cited
in the module)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import vramplan
from vramplan import load_spec
from vramplan.components import qlora_prep
from vramplan.components.qlora_prep import Prep
from vramplan.spec import SpecError

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 176,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
NF4 = {"type": "nf4", "double_quant": True, "compute_dtype": "bf16"}
JOB = {"model": LLAMA, "method": "qlora", "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]},
       "quantization": NF4, "micro_batch_size": 1, "seq_len": 32, "optimizer": "adamw",
       "optimizer_impl": "foreach", "backend": "cpu", "attention": "sdpa"}


def _held_bytes(model) -> tuple[int, int]:
    """(frozen floating-point bytes, trained bytes) of a built model; quantized storage
    (bitsandbytes Params4bit, uint8) is left out."""
    frozen = trained = 0
    for p in model.parameters():
        if not p.dtype.is_floating_point:
            continue
        n = p.numel() * p.element_size()
        if p.requires_grad:
            trained += n
        else:
            frozen += n
    return frozen, trained


def _estimated(job: dict, prefix: str = "") -> tuple[int, int]:
    c = vramplan.estimate(job).components
    return c.total(prefix + "weights/frozen"), c.total(prefix + "weights/lora_adapters")


@pytest.mark.parametrize("task, stack, precision, prep", [
    ("sft", "trl", "bf16", Prep.TRL_BF16),       # SFTTrainer: no preparation, adapters cast to bf16
    ("sft", "trl", "fp32", Prep.TRL_BF16),       # an fp32 base: the rest stays fp32, adapters bf16
    ("dpo", "trl", "bf16", Prep.TRL_BF16),
    ("orpo", "trl", "bf16", Prep.TRL_KBIT),      # experimental ORPOTrainer: PEFT's preparation
    ("sft", "hf-trainer", "bf16", Prep.PEFT_KBIT),  # the PEFT recipe under the Trainer
])
def test_the_real_trainer_leaves_the_bytes_the_estimate_holds(task, stack, precision, prep):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes (test extra) is not installed")
    pytest.importorskip("trl", reason="trl (test extra) is not installed")
    from vramplan.measure import trainers
    from vramplan.measure.trl_experimental import BUILDERS, stack_precision

    job = dict(JOB, task=task, stack=stack, precision=precision)
    assert qlora_prep.preparation(load_spec(job)) is prep
    dtype, flags = stack_precision(job)
    build = BUILDERS.get(task) or (trainers._sft_trl if trainers.trl_sft(job) else trainers.BUILDERS[task])
    trainer, models, _ = build(job, dtype, flags)
    got = _held_bytes(trainer.model)
    assert got == _estimated(job, "" if task == "sft" else "policy/"), (task, stack, precision)


def test_the_trl_release_decides_the_preparation():
    spec = lambda **kw: load_spec(dict(JOB, **kw))  # noqa: E731
    trl = lambda release, **kw: spec(stack={"framework": "trl", "trl": release}, **kw)  # noqa: E731
    # trl#4577 (0.26): no prepare_model_for_kbit_training in the trainers
    assert qlora_prep.preparation(trl("0.25", task="sft", backend="cuda")) is Prep.TRL_KBIT
    assert qlora_prep.preparation(trl("0.26", task="sft")) is Prep.TRL_BF16
    assert qlora_prep.preparation(trl("1.16", task="dpo")) is Prep.TRL_BF16
    # before 0.26 a sharded base (FSDP, ZeRO-3) skipped it: `is_sharded_qlora`
    sharded = trl("0.25", task="sft", num_gpus=2, parallel={"zero_stage": 3}, backend="cuda")
    assert qlora_prep.preparation(sharded) is Prep.TRL_SHARDED
    # ... and a CPU run, whose Params4bit are on "cpu" (TRL 0.25.1 measured so on CPU: bf16
    # adapters and norms on a bf16 load)
    on_cpu = trl("0.25", task="sft")
    assert qlora_prep.preparation(on_cpu) is Prep.TRL_SHARDED
    assert qlora_prep.adapter_dtype(on_cpu, "fp32") == "bf16"
    assert qlora_prep.rest_dtype(on_cpu, "model.norm", "bf16") == "bf16"
    # the experimental ORPO and CPO trainers of 1.x still prepare
    assert qlora_prep.preparation(trl("1.16", task="orpo")) is Prep.TRL_KBIT
    assert qlora_prep.preparation(trl("1.16", task="simpo")) is Prep.TRL_KBIT
    # a TRL task runs TRL's trainer whatever the stack; SFT under the HF Trainer is PEFT's recipe
    assert qlora_prep.preparation(spec(task="dpo")) is Prep.TRL_BF16
    assert qlora_prep.preparation(spec(task="sft", stack="hf-trainer")) is Prep.PEFT_KBIT
    assert qlora_prep.preparation(spec(task="sft")) is Prep.PEFT_KBIT
    # axolotl: PEFT's preparation, then norms and embedding layers back to the load dtype
    ax = spec(task="sft", stack="axolotl")
    assert qlora_prep.preparation(ax) is Prep.AXOLOTL
    assert [qlora_prep.rest_dtype(ax, m, "bf16") for m in ("model.norm", "model.embed_tokens", "lm_head",
                                                            "model.layers.0.self_attn.q_proj")] == ["bf16"] * 3 + ["fp32"]
    assert qlora_prep.preparation(spec(task="sft", stack="axolotl", num_gpus=2,
                                       parallel={"fsdp": "full-shard"})) is Prep.NONE
    for framework in ("torchtune", "litgpt", "llama-factory", "ms-swift"):
        assert qlora_prep.preparation(spec(task="sft", stack=framework)) is Prep.NONE
    # the spec's word wins over the stack's
    said = spec(task="sft", stack="trl", quantization=dict(NF4, prepare="peft"))
    assert qlora_prep.preparation(said) is Prep.PEFT_KBIT


def test_the_older_trl_casts_embeddings_and_head_back_only_under_its_bf16_flag():
    # peft_module_casting_to_bf16: modules named lm_head/embed_tokens/wte/wpe back to bf16,
    # norms left in fp32, adapters fp32; only when the trainer's bf16 flag is set
    old = lambda precision: load_spec(dict(JOB, task="sft", precision=precision, backend="cuda",  # noqa: E731
                                           stack={"framework": "trl", "trl": "0.25"}))
    s = old("bf16")
    assert qlora_prep.rest_dtype(s, "model.embed_tokens", "bf16") == "bf16"
    assert qlora_prep.rest_dtype(s, "lm_head", "bf16") == "bf16"
    assert qlora_prep.rest_dtype(s, "model.norm", "bf16") == "fp32"
    assert qlora_prep.rest_dtype(s, "model.embed_in", "bf16") == "fp32"   # GPT-NeoX's name is not in its list
    assert qlora_prep.adapter_dtype(s, "fp32") == "fp32"
    assert qlora_prep.rest_dtype(old("fp32"), "model.embed_tokens", "fp32") == "fp32"
    new = load_spec(dict(JOB, task="sft", stack="trl", precision="bf16"))
    assert qlora_prep.rest_dtype(new, "model.embed_tokens", "bf16") == "bf16"
    assert qlora_prep.adapter_dtype(new, "fp32") == "bf16"
    # PEFT leaves a GPTQ, HQQ or torchao model's other parameters as they are
    gptq = load_spec(dict(JOB, task="sft", stack="hf-trainer", quantization={"type": "gptq", "bits": 4}))
    assert qlora_prep.rest_dtype(gptq, "model.norm", "bf16") == "bf16"
    assert "leaves" in str(qlora_prep.notes(gptq)[0])
    # no stack named: PEFT's preparation without a trainer's autocast, which the answer points out
    plain = load_spec(dict(JOB, task="sft", backend="cuda"))
    assert any("--stack" in str(n) for n in qlora_prep.notes(plain))
    assert not any("--stack" in str(n) for n in qlora_prep.notes(load_spec(dict(JOB, task="sft", stack="hf-trainer"))))


def test_a_role_seen_apart_from_its_trainer_keeps_the_preparation():
    # jobs/trained.py single_spec makes every model task sft; the resolved word keeps ORPO's
    from vramplan.jobs.trained import single_spec

    s = load_spec(dict(JOB, task="orpo", stack="trl", precision="bf16"))
    one = single_spec(s, 2)
    assert one.task.value == "sft" and one.quantization.prepare == "peft-bf16"
    assert qlora_prep.preparation(one) is Prep.TRL_KBIT


def test_a_preparation_word_not_known_is_one_line_naming_the_field():
    with pytest.raises(SpecError) as err:
        load_spec(dict(JOB, task="sft", quantization=dict(NF4, prepare="kbit")))
    assert err.value.field == "quantization.prepare" and "bf16-trainable" in str(err.value)
    spec = load_spec(dict(JOB, task="sft", quantization=dict(NF4, prepare="none")))
    assert spec.quantization.to_dict()["prepare"] == "none"
    assert "prepare" not in load_spec(dict(JOB, task="sft")).quantization.to_dict()


def test_cli_refuses_an_unknown_preparation_with_exit_2(tmp_path):
    import json
    import subprocess

    path = tmp_path / "job.json"
    path.write_text(json.dumps(dict(JOB, task="sft", quantization=dict(NF4, prepare="kbit"))))
    out = subprocess.run([sys.executable, "-m", "vramplan", "estimate", "--spec", str(path)], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "quantization.prepare" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
