"""Enums of the job spec: one frozen, validated description of a training job.

Keys are the public names tools script against (`micro_batch_size`, `seq_len`, ...); CLI
flags are the same names with dashes. `load_spec` accepts a mapping, a YAML/JSON path or a
JobSpec; `JobSpec.to_dict()` writes the same keys back. Validation raises `SpecError`
(a ValueError) whose message names the field and the fix.
"""
from __future__ import annotations

import enum

class SpecError(ValueError):
    """Bad job spec input: the message names the field and the fix."""

    def __init__(self, field_name: str, message: str):
        field_name = str(field_name)
        if not field_name or not field_name.isprintable() or field_name != field_name.strip():
            field_name = repr(field_name)  # an empty or odd key, shown as typed
        super().__init__(f"{field_name}: {' '.join(str(message).split())}")
        self.field = field_name
        """The spec field (dotted for sections: `parallel.tp`) or file the message is about."""


USER_ERRORS = (ValueError, KeyError, LookupError, NotImplementedError, ArithmeticError)
"""What the estimator raises on input it cannot take (catalog lookups, unmodelled options)."""


def as_spec_error(exc: BaseException) -> SpecError:
    """One SpecError for any user-input error, keeping a leading `field: ` of its message."""
    if isinstance(exc, SpecError):
        return exc
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str) else str(exc)
    text = " ".join(text.split()) or type(exc).__name__
    if isinstance(exc, KeyError) and " " not in text:  # a bare key: our lookup failed, not the input
        return SpecError("spec", f"vramplan has no entry {text!r} for this job (a bug in vramplan; "
                         "please report it with the spec)")
    head, sep, rest = text.partition(": ")
    if sep and head.replace(".", "").replace("_", "").isalnum() and " " not in head:
        return SpecError(head, rest)
    return SpecError("spec", text)


def user_error_line(exc: BaseException) -> str:
    """The one line bad input gets, in the current language: what the CLI prints before
    exit 2 and what the web API answers with HTTP 400 (`vramplan: error: field: message`)."""
    from vramplan.i18n.errors import error_line
    message = as_spec_error(exc) if isinstance(exc, KeyError) else exc
    return error_line(" ".join(str(message).split()))


def internal_error_line(exc: BaseException) -> str:
    """The one line a bug gets (CLI exit 70, web HTTP 500): never a traceback."""
    from vramplan.i18n import _
    return "vramplan: " + _("internal error: {kind}: {detail} (a bug; please report it with the command; "
                            "VRAMPLAN_DEBUG=1 shows the traceback)").format(
        kind=type(exc).__name__, detail=" ".join(str(exc).split()))


class _Choice(str, enum.Enum):
    """An enum whose values are the spec's spelling; parse() accepts _ for - and any case."""

    @classmethod
    def parse(cls, value: object, field_name: str):
        if isinstance(value, cls):
            return value
        if isinstance(value, str):   # the usual case, without listing the choices
            member = cls._value2member_map_.get(value.strip().lower().replace("_", "-"))
            if member is not None:
                return member
        choices = [m.value for m in cls]
        if not isinstance(value, str):
            kind = "nothing" if value is None else f"{value!r} (a {type(value).__name__})"
            raise SpecError(field_name, f"expected one of {', '.join(choices)}; got {kind}")
        text = value.strip().lower().replace("_", "-")
        if not text:
            raise SpecError(field_name, f"is empty; choose one of {', '.join(choices)}")
        for member in cls:
            if member.value == text:
                return member
        import difflib
        hint = difflib.get_close_matches(text, choices, n=1)
        extra = f" Did you mean {hint[0]!r}?" if hint else ""
        raise SpecError(field_name, f"unknown value {value!r}; choose one of {', '.join(choices)}.{extra}")


class Task(_Choice):
    SFT = "sft"
    """Causal-LM fine-tuning on (prompt, response) rows; loss over the sequence."""
    PRETRAIN = "pretrain"
    """Causal-LM next-token training; same memory shape as sft."""
    SEQUENCE_CLASSIFICATION = "sequence-classification"
    """A classification head (`num_labels` outputs) on the last token or pooled output."""
    INFERENCE = "inference"
    """No training: weights, a no-grad forward and, with max_new_tokens, the KV cache."""
    DPO = "dpo"
    """Direct preference optimization: trained policy plus a frozen reference (or precomputed
    reference log-probs); chosen and rejected rows go through each model (2x rows)."""
    IPO = "ipo"
    """DPO's memory shape with the IPO loss."""
    KTO = "kto"
    """Unpaired preference rows plus a mismatched KL batch through policy and reference."""
    ORPO = "orpo"
    """Odds-ratio preference optimization: chosen and rejected rows, no reference model."""
    SIMPO = "simpo"
    """Length-normalized preference loss: chosen and rejected rows, no reference model."""
    REWARD_MODEL = "reward-model"
    """Pairwise training of a one-output sequence-classification model (value head)."""
    PPO = "ppo"
    """Actor and critic trained; reference and reward frozen; rollouts with a KV cache."""
    GRPO = "grpo"
    """Policy trained, reference frozen, num_generations completions per prompt."""
    RLOO = "rloo"
    """TRL's RLOOTrainer (0.22 on): GRPO's step with a leave-one-out baseline, the KL to the
    reference in the reward (beta 0.05 by default), and the policy's own old log-probs
    scored after generation."""
    DISTILL = "distill"
    """A trained student and a frozen teacher whose logits meet the student's in the loss."""
    DIFFUSION = "diffusion"
    """A denoiser (UNet, DiT, MMDiT) trained on VAE latents with frozen text encoders."""


class Method(_Choice):
    FULL = "full"
    """All parameters trained."""
    LORA = "lora"
    """Frozen base in the job's precision plus trainable low-rank adapters (PEFT)."""
    QLORA = "qlora"
    """LoRA on a 4/8-bit quantized frozen base (bitsandbytes), per `quantization`."""
    FREEZE = "freeze"
    """Full training of the layers named in `freeze`; the rest frozen."""


class Precision(_Choice):
    FP32 = "fp32"
    """Weights, gradients, optimizer states and compute all fp32."""
    BF16 = "bf16"
    """What the stack's bf16 flag does (spec.stack; components/dtypes.py): autocast over the
    load dtype (HF Trainer, TRL, accelerate), 16-bit weights over an fp32 master
    (DeepSpeed, Megatron) or pure bf16 (torchtune, litgpt)."""
    FP16 = "fp16"
    """What the stack's fp16 flag does, as bf16."""
    PURE_BF16 = "pure-bf16"
    """Pure bf16 on every stack: weights, gradients and optimizer states bf16, no autocast,
    no fp32 master copy."""
    PURE_FP16 = "pure-fp16"
    """Pure fp16, as pure-bf16."""
    AMP_BF16 = "amp-bf16"
    """fp32 weights, gradients and states; bf16 compute under torch.autocast."""
    AMP_FP16 = "amp-fp16"
    """fp32 weights, gradients and states; fp16 autocast compute with a grad scaler."""
    MIXED_BF16 = "mixed-bf16"
    """bf16 weights and gradients plus fp32 master weights and states (DeepSpeed, Megatron)."""
    MIXED_FP16 = "mixed-fp16"
    """fp16 weights and gradients plus fp32 master weights and states."""

    @property
    def weight_dtype(self) -> str:
        return {"fp32": "fp32", "amp-bf16": "fp32", "amp-fp16": "fp32"}.get(self.value, self.value.split("-")[-1])

    @property
    def compute_dtype(self) -> str:
        return "fp32" if self is Precision.FP32 else self.value.split("-")[-1]

    @property
    def is_autocast(self) -> bool:
        return self in (Precision.AMP_BF16, Precision.AMP_FP16)

    @property
    def has_master_weights(self) -> bool:
        return self in (Precision.MIXED_BF16, Precision.MIXED_FP16)


class Optimizer(_Choice):
    ADAMW = "adamw"
    """torch.optim.AdamW: exp_avg and exp_avg_sq per parameter, plus a scalar step."""
    ADAM = "adam"
    """torch.optim.Adam: the same states as AdamW."""
    SGD = "sgd"
    """torch.optim.SGD; a momentum buffer per parameter when momentum > 0."""
    ADAFACTOR = "adafactor"
    """Factored second moment (row and column statistics) for matrices (Shazeer & Stern 2018)."""
    LION = "lion"
    """One momentum buffer per parameter (Chen et al. 2023)."""
    ADAMW_8BIT = "adamw-8bit"
    """bitsandbytes AdamW8bit: two 8-bit states plus blockwise fp32 absmax."""
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"
    """bitsandbytes PagedAdamW8bit: the 8-bit states in CUDA managed (paged) memory."""
    PAGED_ADAMW_32BIT = "paged-adamw-32bit"
    """bitsandbytes PagedAdamW32bit: fp32 states in CUDA managed (paged) memory."""
    GALORE_ADAMW = "galore-adamw"
    """galore-torch GaLoreAdamW (Zhao et al. 2024): Adam states of the `low_rank` target
    matrices in a rank-r projected space, plus each one's projection matrix."""
    APOLLO_ADAMW = "apollo-adamw"
    """apollo-torch APOLLOAdamW (Zhu et al. 2024): Adam states of a random rank-r projection
    of the `low_rank` target matrices, used only to scale the raw gradient per channel."""
    MUON = "muon"
    """torch.optim.Muon (Jordan et al. 2024) for the hidden layers' matrices: one momentum
    buffer and bf16 Newton-Schulz temporaries; AdamW for embeddings, head and vectors."""
    ADAM_MINI = "adam-mini"
    """adam-mini Adam_mini (Zhang et al. 2024): a full first moment and one second-moment
    value per block (head of q/k, output row of the other matrices, one per norm)."""
    SCHEDULE_FREE_ADAMW = "schedule-free-adamw"
    """schedulefree AdamWScheduleFree (Defazio et al. 2024): z and exp_avg_sq per parameter."""
    TORCHAO_ADAMW_8BIT = "torchao-adamw-8bit"
    """torchao.optim AdamW8bit: two 8-bit block-quantized states with one fp32 scale per block."""
    TORCHAO_ADAMW_4BIT = "torchao-adamw-4bit"
    """torchao.optim AdamW4bit: two 4-bit block-quantized states with one fp32 scale per block."""
    LOMO = "lomo"
    """lomo-optim Lomo (Lv et al. 2023): SGD fused into backward, no state, gradients freed as
    they are made."""
    ADALOMO = "adalomo"
    """lomo-optim AdaLomo (Lv et al. 2023): LOMO with a factored fp32 second moment."""


class OptimizerImpl(_Choice):
    FOREACH = "foreach"
    """Multi-tensor kernels over the parameter list (torch default on CUDA)."""
    FUSED = "fused"
    """One fused kernel per dtype/device group; no parameter-sized temporaries."""
    FORLOOP = "forloop"
    """One parameter at a time (torch default on CPU)."""


class Checkpointing(_Choice):
    NONE = "none"
    """Every saved activation is kept until backward."""
    FULL = "full"
    """Only each layer's input is kept; the layer is recomputed in backward."""
    SELECTIVE = "selective"
    """Attention's core is recomputed (Korthikanti et al. 2022), the rest kept. With
    `stack: torchtitan` it means torchtitan's own selective mode, op-selective."""
    OP_SELECTIVE = "op-selective"
    """torchtitan's per-op selective checkpointing (`SelectiveAC`): each layer keeps its
    input and the outputs of the ops on its save list (every other matmul, the fused
    attention kernels); the rest is recomputed in backward (components/op_checkpoint.py)."""


class Attention(_Choice):
    EAGER = "eager"
    """Explicit softmax(QK^T)V: saves the b*a*s*s scores and probabilities."""
    SDPA = "sdpa"
    """torch scaled_dot_product_attention (flash / memory-efficient kernel on CUDA)."""
    FLASH = "flash"
    """flash-attn 2: saves output and log-sum-exp only."""


class Backend(_Choice):
    CUDA = "cuda"
    """NVIDIA GPUs: CUDA kernels, autocast rules and the caching allocator."""
    CPU = "cpu"
    """CPU kernels: exists so estimates can be checked exactly against CPU measurements."""


class LossImpl(_Choice):
    STANDARD = "standard"
    """Full fp32 logits then cross-entropy (transformers ForCausalLMLoss)."""
    CHUNKED = "chunked"
    """Cross-entropy over chunks of the sequence (torchtune); fp32 logits per chunk."""
    FUSED_LINEAR_CROSS_ENTROPY = "fused-linear-cross-entropy"
    """lm_head and loss fused (Liger kernel): logits never materialized."""


class QuantType(_Choice):
    """How the frozen base's linear weights are stored (components/quant.py has each layout)."""

    NF4 = "nf4"
    """bitsandbytes 4-bit NormalFloat (Params4bit, Linear4bit)."""
    FP4 = "fp4"
    """bitsandbytes 4-bit float (Params4bit, Linear4bit)."""
    INT8 = "int8"
    """bitsandbytes LLM.int8 (Int8Params: int8 CB and one fp32 SCB per output row)."""
    GPTQ = "gptq"
    """GPTQ checkpoints (AutoGPTQ / GPTQModel / transformers+optimum): packed int32 qweight,
    qzeros, fp16 scales, int32 g_idx."""
    AWQ = "awq"
    """AutoAWQ GEMM layout: int32 qweight (in, out/8), qzeros, fp16 scales."""
    HQQ = "hqq"
    """Half-Quadratic Quantization (hqq HQQLinear): uint8 packed W_q, per-group scale and zero."""
    TORCHAO_INT8 = "torchao-int8"
    """torchao Int8WeightOnlyConfig: int8 weight, one scale per output row."""
    TORCHAO_INT4 = "torchao-int4"
    """torchao Int4WeightOnlyConfig: 4-bit tinygemm-packed weight, bf16 scales_and_zeros."""
    TORCHAO_FP8 = "torchao-fp8"
    """torchao Float8WeightOnlyConfig: float8_e4m3 weight, one scale per output row."""

    @property
    def is_bitsandbytes(self) -> bool:
        return self in (QuantType.NF4, QuantType.FP4, QuantType.INT8)


class LogprobHead(_Choice):
    """How per-token log-probabilities of the labels are computed (preference and RL tasks)."""

    AUTO = "auto"
    """What TRL 1.16 does for the task on the spec's backend: the chunked head for the trainers
    that call the model with `fused_lm_head=True` (DPO/IPO/KTO, GRPO/PPO), the full head elsewhere."""
    FULL = "full"
    """TRL 0.x `get_batch_logps`: the whole logits, upcast to fp32, `log_softmax`, `gather`."""
    SELECTIVE = "selective"
    """TRL 0.13-0.2x `selective_log_softmax` (trl/trainer/utils.py): fp32 logits gather minus a
    per-row `logsumexp`; 16-bit logits a row loop of `log_softmax`."""
    CHUNKED = "chunked"
    """TRL 1.x `add_fused_lm_head` + trl/kernels/chunked_logprob.py `ChunkedLogProbFunction`:
    the head projected in token-by-32768 tiles, never the full logits (Triton on CUDA, torch
    ops elsewhere)."""
