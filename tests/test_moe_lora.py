"""LoRA on transformers 5's fused MoE experts (components/moe_lora.py): the adapters vramplan
counts against the ones PEFT really adds, and the error PEFT raises, as a spec error."""
import pytest

import vramplan
from vramplan.spec import SpecError

TINY = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": False}
Q3M = {"model_type": "qwen3_moe", **TINY, "intermediate_size": 128, "moe_intermediate_size": 32, "head_dim": 16,
       "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1}
MIX = {"model_type": "mixtral", **TINY, "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}
DSV3 = {"model_type": "deepseek_v3", **TINY, "num_hidden_layers": 3, "intermediate_size": 128,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4}
QWEN2_MOE = {"model_type": "qwen2_moe", **TINY, "intermediate_size": 128, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
CASES = {
    "qwen3_moe/all-linear": (Q3M, "all-linear"),
    "qwen3_moe/experts": (Q3M, ["gate_proj", "up_proj", "down_proj"]),
    "qwen3_moe/attention+down": (Q3M, ["q_proj", "v_proj", "down_proj"]),
    "mixtral/w1-w3": (MIX, ["q_proj", "v_proj", "w1", "w2", "w3"]),
    "mixtral/all-linear": (MIX, "all-linear"),
    "deepseek_v3/all-linear": (DSV3, "all-linear"),       # dense layer 0 and shared experts lose theirs
    "deepseek_v3/mlp-names": (DSV3, ["gate_proj", "up_proj", "down_proj"]),
    "qwen2_moe/all-linear": (QWEN2_MOE, "all-linear"),    # not rewritten by PEFT: linears only
}


def _estimate(config, targets):
    return vramplan.estimate(vramplan.load_spec({
        "model": config, "method": "lora", "lora": {"r": 4, "target_modules": targets}, "backend": "cpu",
        "precision": "bf16", "micro_batch_size": 1, "seq_len": 16}))


@pytest.mark.parametrize("name", sorted(CASES))
def test_trainable_count_matches_peft(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config, targets = CASES[name]
    cfg = dict(config)
    hf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert _estimate(config, targets).trainable_params == real


def test_naming_part_of_a_fused_pair_is_refused():
    """PEFT: 'Cannot convert PEFT target(s) gate_proj without also targeting up_proj'."""
    with pytest.raises(SpecError, match=r"^lora\.target_modules: .*up_proj"):
        _estimate(Q3M, ["gate_proj", "down_proj"])


def test_the_estimate_says_why():
    noted = [str(n) for n in _estimate(Q3M, "all-linear").notes]
    assert any("fused expert weights" in n for n in noted)
    assert not any("fused expert weights" in str(n) for n in _estimate(Q3M, ["q_proj", "v_proj"]).notes)


def test_the_folded_copies_are_saved_per_layer():
    """Without checkpointing each MoE layer keeps its folded expert stack: the activations grow
    by at least the experts' weight bytes over the attention-only LoRA."""
    config = {**Q3M, "hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 16}
    experts = 2 * 16 * 3 * 256 * 256 * 2  # two layers, gate_up (2f x h) + down (h x f), bf16
    delta = (_estimate(config, "all-linear").phases["forward"]
             - _estimate(config, ["q_proj", "v_proj"]).phases["forward"])
    assert delta >= experts


@pytest.mark.parametrize("field, value", [("dropout", 0.05), ("use_dora", True)])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "gate_proj", "up_proj", "down_proj"]])
def test_what_peft_s_param_wrapper_refuses_is_refused(field, value, targets):
    """lora.ParamWrapper raises ValueError for a lora_dropout or DoRA (get_peft_model fails):
    the job cannot run, so the estimate is a one-line spec error naming the field; without the
    experts among the targets both are allowed, as in PEFT."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = dict(Q3M)
    hf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    peft_kw = {"dropout": "lora_dropout"}.get(field, field)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    with pytest.raises(ValueError, match="ParamWrapper"):
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, **{peft_kw: value}))
    spec = {"model": Q3M, "method": "lora", "backend": "cpu", "precision": "bf16", "micro_batch_size": 1,
            "seq_len": 16, "lora": {"r": 4, "target_modules": targets, field: value}}
    with pytest.raises(SpecError, match=rf"^lora\.{field}: .*ParamWrapper"):
        vramplan.estimate(vramplan.load_spec(spec))
    spec["lora"]["target_modules"] = ["q_proj", "v_proj"]
    assert vramplan.estimate(vramplan.load_spec(spec)).peak_allocated_bytes > 0
