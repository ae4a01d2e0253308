"""Real library trainers on CPU, measured under the exact meter and estimated.

    python bench/trainers/run.py [--only SUBSTRING] [--estimate-only]

Each case runs in a fresh process through vramplan.measure.trainers.measure_trainer: TRL
1.16's DPOTrainer (a separate reference; a LoRA policy with its adapter disabled as the
reference), KTOTrainer, RewardTrainer, GRPOTrainer (HF generate) and the transformers
Trainer (SFT) and TRL's SFTTrainer (SFT under stack trl); from trl.experimental GKDTrainer
(distillation), ORPOTrainer and CPOTrainer (SimPO), RLOOTrainer, two optimizer steps on tiny random-init
Llama models, tiny in-memory datasets.
The estimate takes the spec as it is (logprob_head auto = TRL 1.16's chunked head for
DPO/IPO/KTO). Results go to bench/trainers/results-cpu.json with the library versions, and
are printed with the error of the peak and of each phase (targets: 2% peak, 5% phase).
README.md in this folder says which trainer runs each task and gives the before/after table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(SRC))

# Small enough that a case runs in minutes on a shared 2-core machine under the meter.
LLAMA = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 344,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "tie_word_embeddings": False}
# A vocabulary wider than one 32768-column tile: the chunked head folds two tiles per token chunk.
LLAMA_WIDE = dict(LLAMA, vocab_size=40000, hidden_size=64, intermediate_size=176)
BASE = {"model": LLAMA, "stack": "trl", "micro_batch_size": 2, "seq_len": 128, "optimizer": "adamw",
        "optimizer_impl": "foreach", "attention": "sdpa", "backend": "cpu"}
LORA = {"method": "lora", "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}}
NF4 = {"type": "nf4", "double_quant": True, "compute_dtype": "bf16"}
QLORA = {"method": "qlora", "lora": LORA["lora"], "quantization": NF4}
QLORA_ALL_LINEAR = {"method": "qlora", "lora": {"r": 16, "target_modules": "all-linear"}, "quantization": NF4}
# the all-linear LoRA recipe with full checkpointing that the reward and DPO rows share
ALL_LINEAR_GC = {"method": "lora", "lora": {"r": 16, "target_modules": "all-linear"}, "gradient_checkpointing": "full"}
# A wider, deeper teacher on the student's vocabulary (GKD compares full distributions).
TEACHER = dict(LLAMA, hidden_size=256, intermediate_size=688, num_hidden_layers=3)
QWEN2 = {"model_type": "qwen2", "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 344,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 1024, "tie_word_embeddings": True}
DISTILL = {"task": "distill", "teacher": TEACHER}
# Other families at the same size: Qwen3 (q/k RMSNorm), Mistral (a sliding window shorter than
# seq_len), Gemma (tied, scaled embeddings, GELU-tanh), Gemma 2 (logit soft-capping).
QWEN3 = dict(QWEN2, model_type="qwen3", head_dim=32, tie_word_embeddings=False)
MISTRAL = dict(LLAMA, model_type="mistral", sliding_window=64)
GEMMA = dict(LLAMA, model_type="gemma", head_dim=32, tie_word_embeddings=True,
             hidden_act="gelu_pytorch_tanh")
GEMMA2 = dict(GEMMA, model_type="gemma2", hidden_activation="gelu_pytorch_tanh", sliding_window=64,
              final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
# Gemma 3's text model (q/k RMSNorm, sliding layers 5:1: one global layer of two here);
# Phi-3 (fused qkv_proj / gate_up_proj; PEFT has no default target for it); Qwen3-MoE
QWEN3_MOE = dict(QWEN3, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                 decoder_sparse_step=1, norm_topk_prob=True)
GEMMA3 = dict(GEMMA, model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", sliding_window=64,
              layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32)
PHI3 = dict(LLAMA, model_type="phi3", num_key_value_heads=4, pad_token_id=0)  # its default 32000 > vocab
# GPT-2: its dropouts are nn.Dropout modules (embedding, attention probabilities, residuals at
# 0.1), which TRL's disable_dropout reaches; pad_token_id for the classifier's last-token pick
GPT2 = {"model_type": "gpt2", "vocab_size": 8192, "n_embd": 128, "n_layer": 2, "n_head": 4,
        "n_positions": 1024, "pad_token_id": 0}
# Phi (NewGELUActivation, partial rotary, parallel attention and MLP; its dropouts as modules
# where set) and GPT-NeoX (parallel residual, untied embed_out), at the same size
PHI = {"model_type": "phi", "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 512,
       "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 1024,
       "resid_pdrop": 0.1, "embd_pdrop": 0.1, "pad_token_id": 0}
GPT_NEOX = {"model_type": "gpt_neox", "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 1024,
            "pad_token_id": 0}
GRPO = {"task": "grpo", "micro_batch_size": 8, "seq_len": 32, "num_generations": 4, "max_new_tokens": 32}
RLOO = dict(GRPO, task="rloo")
ONPOLICY = dict(DISTILL, micro_batch_size=4, seq_len=32, max_new_tokens=32)


def case(name: str, **fields) -> tuple[str, dict]:
    return name, {**BASE, **fields}


CASES = dict([
    case("dpo/bf16/full/ref-separate", task="dpo", precision="bf16"),
    case("dpo/fp32/full/ref-separate", task="dpo", precision="fp32"),
    case("dpo/bf16/lora/adapter-disabled", task="dpo", precision="bf16", **LORA),
    case("dpo/amp-bf16/full/ref-separate", task="dpo", precision="amp-bf16"),
    case("dpo/bf16/full/gc/vocab40k", task="dpo", precision="bf16", model=LLAMA_WIDE,
         gradient_checkpointing="full"),
    case("kto/bf16/full/ref-separate", task="kto", precision="bf16"),
    case("reward-model/bf16/full", task="reward-model", precision="bf16"),
    case("grpo/bf16/full/g4-c32", **GRPO, precision="bf16"),
    case("sft/bf16/full/hf-trainer", task="sft", precision="bf16", stack="hf-trainer"),
    # TRL's SFTTrainer (stack trl): the chunked head in place of the model's cross-entropy
    case("sft/bf16/full/sft-trainer", task="sft", precision="bf16"),
    case("sft/fp32/full/sft-trainer", task="sft", precision="fp32"),
    case("sft/bf16/lora/sft-trainer", task="sft", precision="bf16", **LORA),
    case("sft/amp-bf16/full/sft-trainer/gc/vocab40k", task="sft", precision="amp-bf16", model=LLAMA_WIDE,
         gradient_checkpointing="full"),
    # trl.experimental.gkd.GKDTrainer, lmbda 0, beta 0.5 (measure/trl_experimental.py)
    case("distill/bf16/full/gkd", **DISTILL, precision="bf16"),
    case("distill/bf16-plain/full/gkd", **DISTILL, precision="bf16", stack="plain"),
    case("distill/fp32/full/gkd", **DISTILL, precision="fp32"),
    case("distill/amp-bf16/full/gkd", **DISTILL, precision="amp-bf16"),
    case("distill/bf16/lora/gkd", **DISTILL, precision="bf16", **LORA),
    case("distill/bf16/full/gc/qwen2-tied", task="distill", teacher=dict(QWEN2, num_hidden_layers=3),
         model=QWEN2, precision="bf16", gradient_checkpointing="full"),
    # trl.experimental.orpo.ORPOTrainer and cpo.CPOTrainer (loss_type simpo, cpo_alpha 0)
    case("orpo/bf16/full", task="orpo", precision="bf16"),
    case("orpo/fp32/full", task="orpo", precision="fp32"),
    case("simpo/bf16/full/cpo", task="simpo", precision="bf16"),
    case("simpo/fp32/full/cpo", task="simpo", precision="fp32"),
    # LoRA + gradient checkpointing (transformers 5 default: non-reentrant; PEFT and Trainer
    # call enable_input_require_grads), the Trainer's own bf16 autocast on a bf16 model
    case("sft/bf16/lora/hf-trainer", task="sft", precision="bf16", stack="hf-trainer", **LORA),
    case("sft/bf16/lora/hf-trainer/gc", task="sft", precision="bf16", stack="hf-trainer", **LORA,
         gradient_checkpointing="full"),
    case("sft/amp-bf16/lora/hf-trainer/gc", task="sft", precision="amp-bf16", stack="hf-trainer", **LORA,
         gradient_checkpointing="full"),
    case("sft/bf16/lora/sft-trainer/gc", task="sft", precision="bf16", **LORA, gradient_checkpointing="full"),
    case("sft/bf16/lora/sft-trainer/gc/reentrant", task="sft", precision="bf16", **LORA,
         gradient_checkpointing="full"),
    case("sft/amp-bf16/lora/sft-trainer/gc", task="sft", precision="amp-bf16", **LORA,
         gradient_checkpointing="full"),
    # SFTTrainer's packing (BFD, padding-free) and padding_free alone: the micro-batch is one row
    case("sft/bf16/full/sft-trainer/packing", task="sft", precision="bf16", packing=True),
    case("sft/bf16/full/sft-trainer/padding-free", task="sft", precision="bf16", packing=True),
    case("sft/bf16/full/hf-trainer/packing", task="sft", precision="bf16", stack="hf-trainer", packing=True),
    # optimizers and gradient accumulation under the HF Trainer
    case("sft/bf16/full/hf-trainer/ga4", task="sft", precision="bf16", stack="hf-trainer", grad_accum_steps=4),
    case("sft/fp32/full/hf-trainer/adamw-fused", task="sft", precision="fp32", stack="hf-trainer",
         optimizer_impl="fused"),
    case("sft/fp32/full/hf-trainer/adafactor", task="sft", precision="fp32", stack="hf-trainer",
         optimizer="adafactor"),
    case("sft/fp32/full/hf-trainer/sgd", task="sft", precision="fp32", stack="hf-trainer", optimizer="sgd"),
    case("sft/fp32/full/hf-trainer/sgd-momentum", task="sft", precision="fp32", stack="hf-trainer",
         optimizer="sgd", momentum=0.9),
    # DPO / GRPO with LoRA and checkpointing
    case("dpo/bf16/lora/adapter-disabled/gc", task="dpo", precision="bf16", **LORA, gradient_checkpointing="full"),
    case("ipo/bf16/full/ref-separate", task="ipo", precision="bf16"),
    case("dpo/bf16/full/ref-precomputed", task="dpo", precision="bf16", reference_model="precomputed"),
    case("kto/bf16/full/ref-precomputed", task="kto", precision="bf16", reference_model="precomputed"),
    case("kto/fp32/lora/ref-precomputed", task="kto", precision="fp32", reference_model="precomputed", **LORA),
    case("grpo/bf16/lora/g4-c32", **GRPO, precision="bf16", **LORA),
    case("grpo/bf16/full/g8-c32/gc", **dict(GRPO, num_generations=8), precision="bf16",
         gradient_checkpointing="full"),
    # The HF Trainer building its own optimizer from TrainingArguments.optim (trainer_args
    # below; no optimizers= handed in); the job is what importers/hf_args.py makes of it
    case("sft/fp32/full/hf-trainer/optim-adamw_torch", task="sft", precision="fp32", stack="hf-trainer",
         optimizer_impl=None),
    case("sft/fp32/full/hf-trainer/optim-adamw_torch_fused", task="sft", precision="fp32", stack="hf-trainer",
         optimizer_impl="fused"),
    case("sft/fp32/full/hf-trainer/optim-adafactor", task="sft", precision="fp32", stack="hf-trainer",
         optimizer="adafactor", optimizer_impl=None),
    case("sft/fp32/full/hf-trainer/optim-sgd", task="sft", precision="fp32", stack="hf-trainer",
         optimizer="sgd", optimizer_impl=None),
    case("sft/bf16/full/hf-trainer/optim-adamw_torch", task="sft", precision="bf16", stack="hf-trainer",
         optimizer_impl=None),
    # a Trainer option with no spec word: gradient clipping off; label smoothing (LabelSmoother)
    case("sft/fp32/full/hf-trainer/max-grad-norm-0", task="sft", precision="fp32", stack="hf-trainer"),
    case("sft/bf16/full/hf-trainer/label-smoothing", task="sft", precision="bf16", stack="hf-trainer",
         label_smoothing=0.1),
    case("sft/fp32/full/hf-trainer/label-smoothing", task="sft", precision="fp32", stack="hf-trainer",
         label_smoothing=0.1),
    # PEFT variations through the Trainer
    case("sft/bf16/lora/hf-trainer/ga4", task="sft", precision="bf16", stack="hf-trainer", **LORA,
         grad_accum_steps=4),
    case("sft/bf16/lora/hf-trainer/save-lm-head/dropout0.1", task="sft", precision="bf16", stack="hf-trainer",
         method="lora", lora={"r": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"],
                              "modules_to_save": ["lm_head"]}),
    case("sft/bf16/lora/hf-trainer/all-linear/dropout0.05/gc", task="sft", precision="bf16", stack="hf-trainer",
         method="lora", lora={"r": 16, "dropout": 0.05, "target_modules": "all-linear"},
         gradient_checkpointing="full"),
    case("sft/bf16/lora/sft-trainer/all-linear/dropout0.05", task="sft", precision="bf16",
         method="lora", lora={"r": 16, "dropout": 0.05, "target_modules": "all-linear"}),
    # trainers4: families, PEFT under the other TRL trainers, accumulation under SFTTrainer
    case("sft/bf16/lora/sft-trainer/qwen3/gc", task="sft", precision="bf16", model=QWEN3, **LORA,
         gradient_checkpointing="full"),
    case("sft/bf16/full/hf-trainer/mistral-swa", task="sft", precision="bf16", stack="hf-trainer", model=MISTRAL),
    case("sft/bf16/lora/hf-trainer/gemma", task="sft", precision="bf16", stack="hf-trainer", model=GEMMA, **LORA),
    # Gemma 2 runs eager attention (transformers refuses SDPA for it)
    case("sft/bf16/full/sft-trainer/gemma2", task="sft", precision="bf16", model=GEMMA2, attention="eager"),
    case("sft/bf16/full/hf-trainer/qwen2-tied", task="sft", precision="bf16", stack="hf-trainer", model=QWEN2),
    case("reward-model/bf16/lora", task="reward-model", precision="bf16", **LORA),
    case("kto/bf16/lora/adapter-disabled", task="kto", precision="bf16", **LORA),
    case("grpo/bf16/lora/g4-c32/gc", **GRPO, precision="bf16", **LORA, gradient_checkpointing="full"),
    case("sft/bf16/lora/sft-trainer/ga4", task="sft", precision="bf16", **LORA, grad_accum_steps=4),
    case("dpo/bf16/full/ref-separate/ga2", task="dpo", precision="bf16", grad_accum_steps=2),
    case("sft/fp32/lora/hf-trainer", task="sft", precision="fp32", stack="hf-trainer", **LORA),
    case("sft/bf16/lora/hf-trainer/dora", task="sft", precision="bf16", stack="hf-trainer",
         method="lora", lora={"r": 8, "use_dora": True, "target_modules": ["q_proj", "v_proj"]}),
    # trainers4, second round: the model's own loss with soft-capping, other families, LoRA
    # with checkpointing under the other trainers, GRPO with TRL 1.x's default beta 0, NEFTune
    case("sft/bf16/full/hf-trainer/gemma2", task="sft", precision="bf16", stack="hf-trainer", model=GEMMA2,
         attention="eager"),
    case("sft/bf16/lora/hf-trainer/gemma3", task="sft", precision="bf16", stack="hf-trainer", model=GEMMA3, **LORA),
    case("sft/bf16/lora/sft-trainer/phi3/qkv-o", task="sft", precision="bf16", model=PHI3,
         method="lora", lora={"r": 8, "target_modules": ["qkv_proj", "o_proj"]}),
    case("sft/bf16/full/hf-trainer/qwen3-moe", task="sft", precision="bf16", stack="hf-trainer", model=QWEN3_MOE),
    case("reward-model/bf16/lora/gc", task="reward-model", precision="bf16", **LORA, gradient_checkpointing="full"),
    case("kto/bf16/lora/adapter-disabled/gc", task="kto", precision="bf16", **LORA, gradient_checkpointing="full"),
    case("grpo/bf16/full/g4-c32/beta0", **GRPO, precision="bf16", reference_model="precomputed"),
    case("sft/bf16/lora/sft-trainer/packing/gc", task="sft", precision="bf16", **LORA, packing=True,
         gradient_checkpointing="full"),
    case("sft/bf16/full/sft-trainer/neftune", task="sft", precision="bf16", neftune_noise_alpha=5.0),
    case("reward-model/bf16/full/gc", task="reward-model", precision="bf16", gradient_checkpointing="full"),
    case("reward-model/fp32/lora", task="reward-model", precision="fp32", **LORA),
    case("dpo/bf16/full/ref-separate/gemma2", task="dpo", precision="bf16", model=GEMMA2, attention="eager"),
    case("sft/bf16/lora/sft-trainer/qwen2/gc", task="sft", precision="bf16", model=QWEN2, **LORA,
         gradient_checkpointing="full"),
    case("orpo/bf16/lora", task="orpo", precision="bf16", **LORA),
    case("dpo/bf16/lora/ref-precomputed", task="dpo", precision="bf16", reference_model="precomputed", **LORA),
    case("reward-model/bf16/lora/qwen2", task="reward-model", precision="bf16", model=QWEN2, **LORA),
    case("reward-model/bf16/lora/gemma", task="reward-model", precision="bf16", model=GEMMA, **LORA),
    case("reward-model/fp32/lora/gemma", task="reward-model", precision="fp32", model=GEMMA, **LORA),
    case("sft/bf16/full/hf-trainer/gc", task="sft", precision="bf16", stack="hf-trainer",
         gradient_checkpointing="full"),
    case("sft/bf16/lora/hf-trainer/eager", task="sft", precision="bf16", stack="hf-trainer", attention="eager", **LORA),
    case("kto/fp32/lora/adapter-disabled", task="kto", precision="fp32", **LORA),
    # more tokens than one of the chunked head's 4096-token tiles (trl/kernels/chunked_logprob.py
    # TOKEN_CHUNK_SIZE): the fold loops over two token chunks
    case("sft/bf16/full/sft-trainer/b4-s1280", task="sft", precision="bf16", micro_batch_size=4, seq_len=1280),
    case("dpo/bf16/lora/adapter-disabled/b2-s1280/gc", task="dpo", precision="bf16", **LORA, seq_len=1280,
         gradient_checkpointing="full"),
    case("sft/bf16/lora/hf-trainer/qwen3-moe", task="sft", precision="bf16", stack="hf-trainer", model=QWEN3_MOE,
         **LORA),
    case("grpo/bf16/full/g4-c32/gemma2", **GRPO, precision="bf16", model=GEMMA2, attention="eager"),
    case("kto/bf16/full/ref-separate/gemma2", task="kto", precision="bf16", model=GEMMA2, attention="eager"),
    case("sft/bf16/lora/sft-trainer/gemma3/gc", task="sft", precision="bf16", model=GEMMA3, **LORA,
         gradient_checkpointing="full"),
    case("reward-model/bf16/full/qwen3-moe/gc", task="reward-model", precision="bf16", model=QWEN3_MOE,
         gradient_checkpointing="full"),
    # all-linear LoRA recipes and GRPO's TRL 1.x default (beta 0) with LoRA
    case("grpo/bf16/lora/g4-c32/beta0", **GRPO, precision="bf16", reference_model="precomputed", **LORA),
    case("sft/bf16/lora/sft-trainer/mistral/all-linear/gc", task="sft", precision="bf16", model=MISTRAL,
         **ALL_LINEAR_GC),
    case("dpo/bf16/lora/adapter-disabled/qwen3/all-linear/gc", task="dpo", precision="bf16", model=QWEN3,
         **ALL_LINEAR_GC),
    case("reward-model/bf16/lora/all-linear/gc", task="reward-model", precision="bf16",
         **ALL_LINEAR_GC),
    # trainers5: the recomputation's early stop inside down_proj's LoRA branch across families,
    # dtypes (fp32; pure bf16 with fp32 adapters, no autocast), dropout and reentrant checkpointing
    case("reward-model/bf16/lora/all-linear/gc/qwen3", task="reward-model", precision="bf16", model=QWEN3,
         **ALL_LINEAR_GC),
    case("reward-model/bf16/lora/all-linear/gc/gemma", task="reward-model", precision="bf16", model=GEMMA,
         **ALL_LINEAR_GC),
    case("reward-model/bf16/lora/all-linear/gc/phi3", task="reward-model", precision="bf16", model=PHI3,
         **ALL_LINEAR_GC),
    case("reward-model/fp32/lora/all-linear/gc", task="reward-model", precision="fp32",
         **ALL_LINEAR_GC),
    case("reward-model/bf16/lora/all-linear/dropout0.1/gc", task="reward-model", precision="bf16",
         method="lora", lora={"r": 16, "dropout": 0.1, "target_modules": "all-linear"}, gradient_checkpointing="full"),
    case("reward-model/bf16/lora/all-linear/gc/reentrant", task="reward-model", precision="bf16",
         **ALL_LINEAR_GC),
    case("reward-model/bf16/lora/down/gc", task="reward-model", precision="bf16",
         method="lora", lora={"r": 16, "target_modules": ["down_proj"]}, gradient_checkpointing="full"),
    case("sft/bf16/full/hf-trainer/gc/reentrant", task="sft", precision="bf16", stack="hf-trainer",
         gradient_checkpointing="full"),
    case("sft/bf16/full/hf-trainer/llama-tied", task="sft", precision="bf16", stack="hf-trainer",
         model=dict(LLAMA, tie_word_embeddings=True)),
    case("grpo/bf16/full/g4-c32/iter2", **GRPO, precision="bf16"),
    case("kto/bf16/lora/adapter-disabled/all-linear/gc", task="kto", precision="bf16",
         **ALL_LINEAR_GC),
    # DPOConfig's disable_dropout (True) under a LoRA dropout; GRPOConfig's is False
    case("dpo/bf16/lora/adapter-disabled/all-linear/dropout0.1", task="dpo", precision="bf16",
         method="lora", lora={"r": 16, "dropout": 0.1, "target_modules": "all-linear"}),
    case("reward-model/bf16/lora/eager/attn-dropout0.1", task="reward-model", precision="bf16", **LORA,
         model=dict(LLAMA, attention_dropout=0.1), attention="eager"),
    case("dpo/bf16/full/ref-separate/eager/attn-dropout0.1", task="dpo", precision="bf16",
         model=dict(LLAMA, attention_dropout=0.1), attention="eager"),
    case("grpo/bf16/lora/g4-c32/dropout0.1", **GRPO, precision="bf16",
         method="lora", lora={"r": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}),
    # the spec's disable_dropout, passed to the TRL config: RewardConfig's default (True) with
    # GPT-2's own dropout modules, then False there and under a LoRA dropout
    case("reward-model/fp32/full/gpt2/eager", task="reward-model", precision="fp32", model=GPT2, attention="eager"),
    case("reward-model/fp32/full/gpt2/eager/keep-dropout", task="reward-model", precision="fp32", model=GPT2,
         attention="eager", disable_dropout=False),
    case("reward-model/bf16/lora/all-linear/dropout0.1/keep-dropout", task="reward-model", precision="bf16",
         method="lora", lora={"r": 16, "dropout": 0.1, "target_modules": "all-linear"}, disable_dropout=False),
    # GPT-2 under the other trainers: SDPA with its module dropout off, LoRA on the fused
    # c_attn with checkpointing, DPO's two models, SFTTrainer's chunked head on tied wte
    case("reward-model/fp32/full/gpt2", task="reward-model", precision="fp32", model=GPT2),
    case("reward-model/bf16/lora/gpt2/c_attn/gc", task="reward-model", precision="bf16", model=GPT2,
         method="lora", lora={"r": 8, "target_modules": ["c_attn"]}, gradient_checkpointing="full"),
    case("dpo/fp32/full/ref-separate/gpt2", task="dpo", precision="fp32", model=GPT2),
    case("sft/bf16/full/sft-trainer/gpt2", task="sft", precision="bf16", model=GPT2),
    case("sft/bf16/lora/sft-trainer/gpt2/dropout0.05", task="sft", precision="bf16", model=GPT2,
         method="lora", lora={"r": 8, "dropout": 0.05, "target_modules": ["c_attn", "c_fc"]}),
    case("kto/bf16/full/ref-separate/gpt2", task="kto", precision="bf16", model=GPT2),
    case("sft/bf16/full/sft-trainer/phi", task="sft", precision="bf16", model=PHI),
    case("reward-model/bf16/lora/phi/all-linear/gc", task="reward-model", precision="bf16", model=PHI,
         **ALL_LINEAR_GC),
    case("sft/bf16/full/hf-trainer/gpt-neox", task="sft", precision="bf16", stack="hf-trainer", model=GPT_NEOX),
    case("dpo/bf16/lora/adapter-disabled/gpt-neox", task="dpo", precision="bf16", model=GPT_NEOX,
         method="lora", lora={"r": 8, "target_modules": ["query_key_value"]}),
    # QLoRA (bitsandbytes nf4 on CPU) handed to the trainer as TRL documents it: the quantized
    # base with peft_config, so the trainer prepares it (TRL >= 0.26: no kbit preparation, the
    # adapters cast to bf16; experimental ORPO: kbit preparation, embeddings and head back to
    # bf16); under stack hf-trainer the script's prepare_model_for_kbit_training (PEFT's recipe)
    case("sft/bf16/qlora/sft-trainer", task="sft", precision="bf16", **QLORA),
    case("sft/bf16/qlora/sft-trainer/all-linear/gc", task="sft", precision="bf16", **QLORA_ALL_LINEAR,
         gradient_checkpointing="full"),
    case("sft/fp32/qlora/sft-trainer", task="sft", precision="fp32", **QLORA),
    case("sft/bf16/qlora/hf-trainer", task="sft", precision="bf16", stack="hf-trainer", **QLORA),
    case("dpo/bf16/qlora/adapter-disabled", task="dpo", precision="bf16", **QLORA),
    case("orpo/bf16/qlora", task="orpo", precision="bf16", **QLORA),
    case("distill/bf16/qlora/gkd", **DISTILL, precision="bf16", **QLORA),
    case("dpo/bf16/qlora/adapter-disabled/all-linear/gc", task="dpo", precision="bf16", **QLORA_ALL_LINEAR,
         gradient_checkpointing="full"),
    case("kto/bf16/qlora/adapter-disabled", task="kto", precision="bf16", **QLORA),
    case("grpo/bf16/qlora/g4-c32", **GRPO, precision="bf16", **QLORA),
    case("sft/bf16/qlora/sft-trainer/packing/gc", task="sft", precision="bf16", **QLORA, packing=True,
         gradient_checkpointing="full"),
    case("sft/bf16/qlora/hf-trainer/all-linear/gc", task="sft", precision="bf16", stack="hf-trainer",
         **QLORA_ALL_LINEAR, gradient_checkpointing="full"),
    # other families under PEFT's preparation and the Trainer's autocast: Qwen2 (tied embeddings,
    # q/k/v biases the preparation upcasts), Gemma (tied, scaled embeddings), and TRL's SFT on them
    case("sft/bf16/qlora/hf-trainer/qwen2", task="sft", precision="bf16", stack="hf-trainer", model=QWEN2,
         **QLORA_ALL_LINEAR),
    case("sft/bf16/qlora/hf-trainer/gemma/gc", task="sft", precision="bf16", stack="hf-trainer", model=GEMMA,
         **QLORA_ALL_LINEAR, gradient_checkpointing="full"),
    case("sft/bf16/qlora/sft-trainer/qwen2", task="sft", precision="bf16", model=QWEN2, **QLORA_ALL_LINEAR),
    case("dpo/bf16/qlora/adapter-disabled/gemma", task="dpo", precision="bf16", model=GEMMA, **QLORA),
    # bitsandbytes 8-bit (Linear8bitLt) under the Trainer's autocast and under TRL's SFT
    case("sft/bf16/qlora-int8/hf-trainer", task="sft", precision="bf16", stack="hf-trainer",
         **dict(QLORA, quantization={"type": "int8"})),
    case("sft/bf16/qlora-int8/sft-trainer", task="sft", precision="bf16", **dict(QLORA, quantization={"type": "int8"})),
    case("reward-model/bf16/qlora", task="reward-model", precision="bf16", **QLORA),
    case("reward-model/bf16/qlora/all-linear/gc", task="reward-model", precision="bf16", **QLORA_ALL_LINEAR,
         gradient_checkpointing="full"),
    # TRL's RLOOTrainer: GRPO's layout, its default beta 0.05 (a reference), the policy's own
    # old log-probs scored after generation, the KL in the reward
    case("rloo/bf16/full/g4-c32", **RLOO, precision="bf16"),
    case("rloo/bf16/lora/g4-c32", **RLOO, precision="bf16", **LORA),
    case("rloo/bf16/full/g4-c32/beta0", **RLOO, precision="bf16", reference_model="precomputed"),
    case("rloo/bf16/lora/g4-c32/gc", **RLOO, precision="bf16", **LORA, gradient_checkpointing="full"),
    case("rloo/fp32/full/g2-c48", **dict(RLOO, num_generations=2, max_new_tokens=48), precision="fp32"),
    case("rloo/bf16/qlora/g4-c32", **RLOO, precision="bf16", **QLORA),
    case("rloo/bf16/full/g4-c32/qwen2-tied", **RLOO, precision="bf16", model=QWEN2),
    # TRL's on-policy DistillationTrainer (distill with max_new_tokens): the student generates,
    # the teacher scores, the chunked divergence (beta 1.0) over the completion
    case("distill/bf16/full/on-policy/c32", **ONPOLICY, precision="bf16"),
    case("distill/fp32/full/on-policy/c32", **ONPOLICY, precision="fp32"),
    case("distill/bf16/lora/on-policy/c32", **ONPOLICY, precision="bf16", **LORA),
    case("distill/amp-bf16/full/on-policy/c32", **ONPOLICY, precision="amp-bf16"),
    case("distill/bf16/full/on-policy/c32/gc", **ONPOLICY, precision="bf16", gradient_checkpointing="full"),
    case("distill/bf16/full/on-policy/b1-c48/ga2", **dict(ONPOLICY, micro_batch_size=1, max_new_tokens=48),
         precision="bf16", grad_accum_steps=2),
    case("distill/bf16/full/on-policy/c32/vocab40k", **dict(ONPOLICY, teacher=dict(LLAMA_WIDE, hidden_size=96,
         intermediate_size=256)), precision="bf16", model=LLAMA_WIDE),
    case("distill/bf16/lora/on-policy/c32/qwen2-tied", **ONPOLICY, precision="bf16", model=QWEN2, **LORA),
    # generation and the reference's scoring at the accumulation cycle's first micro-step
    case("grpo/bf16/full/g4-c32/ga2", **dict(GRPO, micro_batch_size=4), precision="bf16", grad_accum_steps=2),
])
# A job without optimizer_impl: the spec's default, as the importer leaves it for adamw_torch;
# the Trainer's own optimizer takes TrainingArguments' weight_decay default, 0.0
for _name, _job in CASES.items():
    if _job.get("optimizer_impl", "") is None:
        del _job["optimizer_impl"]
    if "/optim-" in _name:
        _job["weight_decay"] = 0.0
# Trainer config fields the spec has no word for (measure_trainer's trainer_args).
TRAINER_ARGS = {
    "sft/fp32/full/hf-trainer/optim-adamw_torch": {"optim": "adamw_torch"},
    "sft/fp32/full/hf-trainer/optim-adamw_torch_fused": {"optim": "adamw_torch_fused"},
    "sft/fp32/full/hf-trainer/optim-adafactor": {"optim": "adafactor"},
    "sft/fp32/full/hf-trainer/optim-sgd": {"optim": "sgd"},
    "sft/bf16/full/hf-trainer/optim-adamw_torch": {"optim": "adamw_torch"},
    "sft/fp32/full/hf-trainer/max-grad-norm-0": {"max_grad_norm": 0.0},
    "sft/bf16/lora/sft-trainer/gc/reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    "sft/bf16/full/sft-trainer/padding-free": {"packing": False, "padding_free": True, "max_length": None},
    "reward-model/bf16/lora/all-linear/gc/reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    "sft/bf16/full/hf-trainer/gc/reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
    # GRPOConfig.num_iterations (no spec word): old_per_token_logps scored after generation;
    # a completion batch serves two steps, so a third step generates again in steady state
    "grpo/bf16/full/g4-c32/iter2": {"num_iterations": 2, "max_steps": 3},
}


def measure(job: dict, trainer_args: dict | None = None) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from vramplan.measure.trainers import measure_trainer; "
            "print(json.dumps(measure_trainer(json.loads(sys.argv[2]), "
            "trainer_args=json.loads(sys.argv[3])).to_dict()))")
    proc = subprocess.run([sys.executable, "-c", code, str(SRC), json.dumps(job), json.dumps(trainer_args or {})],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def errors(est, measured: dict) -> dict:
    out = {"peak": est.peak_allocated_bytes / measured["peak_allocated_bytes"] - 1}
    for k, v in measured["phases"].items():
        if v and k in est.phases:
            out[k] = est.phases[k] / v - 1
    return out


def main(argv=None) -> int:
    import vramplan
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="a case name, or a substring of the names")
    ap.add_argument("--estimate-only", action="store_true")
    args = ap.parse_args(argv)
    path = HERE / "results-cpu.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    out = dict(old)
    for name, job in CASES.items():
        # a case's full name runs that case alone; anything else is a substring
        if name != args.only and (args.only in CASES or args.only not in name):
            continue
        est = vramplan.estimate(job)
        extra = TRAINER_ARGS.get(name)
        row = {"job": job} | ({"trainer_args": extra} if extra else {}) | {"estimate": {"peak_allocated_bytes": est.peak_allocated_bytes,
                                        "peak_event": est.peak_event, "phases": est.phases}}
        try:
            row["measured"] = old.get(name, {}).get("measured") if args.estimate_only else measure(job, extra)
        except RuntimeError as exc:
            print(f"{name}: measurement failed: {str(exc).strip().splitlines()[-1]}", flush=True)
            continue
        m = row["measured"]
        if m:
            row["error"] = errors(est, m)
            print(f"{name:34} {m['runner']['entry']:14} measured {m['peak_allocated_bytes']:>12} "
                  f"({m['peak_phase']:6}) estimated {est.peak_allocated_bytes:>12} {row['error']['peak']:+7.3%}"
                  f"  [{est.peak_event}]", flush=True)
            phases = {k: f"{v:+.2%}" for k, v in row["error"].items() if k != "peak"}
            print(f"{'':34} per phase: {phases}", flush=True)
        out[name] = row
    path.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
