"""Mamba-2 config -> ModelDesc (Mamba2ForCausalLM, transformers 5.24).

Mamba2Block: norm (RMS, h) then Mamba2Mixer: in_proj (h -> I + conv_dim + H, `use_bias`),
a depthwise conv1d over conv_dim = I + 2*G*N channels (weight (conv_dim, 1, K), bias when
`use_conv_bias`), per-head dt_bias, A_log and D (H each), the gated group norm `norm`
(MambaRMSNormGated, weight I) and out_proj (I -> h, `use_bias`). Embeddings are
`backbone.embeddings`, the final norm `backbone.norm_f`; lm_head is tied to the embeddings
only when `tie_word_embeddings` (False by default). No attention: `num_heads` holds the
SSM heads H and `head_dim` P.
Legend: h hidden, I = expand*h = H*P inner width, H heads, P head_dim, N state_size,
G n_groups, K conv_kernel, v vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.families.common import Cfg, FamilyDesc, head, linear, norm, with_params
from vramplan.model import MlpKind, ModelDesc, NormKind, ParamEntry, PositionKind

# Mamba2Config fields and defaults (models/mamba2/configuration_mamba2.py).
DEFAULTS = {"num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
            "num_hidden_layers": 64, "expand": 2, "conv_kernel": 4, "n_groups": 8, "use_bias": False,
            "use_conv_bias": True, "hidden_act": "silu", "residual_in_fp32": True, "chunk_size": 256,
            "tie_word_embeddings": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class SSMDesc(FamilyDesc):
    """The state-space widths ModelDesc has no field for. `intermediate_size` holds I."""

    state_size: int = 0
    """N: the SSM state per head (and per group for B and C)."""
    n_groups: int = 1
    """G: groups sharing one B and one C."""
    conv_kernel: int = 4
    chunk_size: int = 256
    """Ls: the chunk of the SSD scan (mamba2_chunk_scan)."""
    residual_in_fp32: bool = True
    """Mamba2Block adds the mixer's output to an fp32 copy of the residual, so the residual
    stream is fp32 from the first block on whatever the model dtype."""
    logits_float_in_forward: bool = True
    """Mamba2ForCausalLM.forward returns `lm_head(...).float()`: the 16-bit logits are freed
    before the loss."""
    lora_refused_modules: tuple[str, ...] = ("out_proj",)
    """peft tuners_utils._check_lora_target_modules_mamba refuses LoRA on out_proj (and
    conv1d, which is no linear) of mamba, mamba2, falcon_mamba, falcon_h1 and nemotron_h."""
    lora_refusal: str = "mamba"

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


def build(config: dict, name: str, num_labels: int | None) -> ModelDesc:
    if num_labels:  # transformers' MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES has no mamba2
        raise ValueError("mamba2 has no sequence-classification model in transformers 5.24 "
                         "(no Mamba2ForSequenceClassification): no classifier or reward model of it; "
                         "use task sft")
    c = Cfg(config, "mamba2", DEFAULTS)
    h, L = c.int("hidden_size"), c.int("num_hidden_layers")
    H, P, N, G = c.int("num_heads"), c.int("head_dim"), c.int("state_size"), c.int("n_groups")
    inner = int(c["expand"] * h)
    if inner != H * P:
        # Mamba2Config.__post_init__ refuses the same config
        raise ValueError(f"mamba2 config: expand * hidden_size ({inner}) must equal num_heads * head_dim ({H * P})")
    if H % G:
        # modeling_mamba2.Mamba2Mixer repeats each group's B and C over num_heads // n_groups
        # heads (mamba_ssm ssd_combined asserts nheads % ngroups == 0)
        raise ValueError(f"mamba2 config: n_groups {G} does not divide num_heads {H}; each group must "
                         "serve a whole number of heads")
    desc = SSMDesc(
        name=name, model_type="mamba2", num_layers=L, hidden_size=h, num_heads=H, num_kv_heads=H, head_dim=P,
        intermediate_size=inner, vocab_size=c.int("vocab_size"), mlp=MlpKind.GATED, hidden_act=c["hidden_act"],
        norm=NormKind.RMSNORM, position=PositionKind.ROPE, max_position_embeddings=1 << 20,
        tie_word_embeddings=bool(c["tie_word_embeddings"]), num_labels=num_labels or 0,
        hub_id=c.raw.get("_name_or_path"), state_size=N, n_groups=G, conv_kernel=c.int("conv_kernel"),
        chunk_size=c.int("chunk_size"), residual_in_fp32=bool(c["residual_in_fp32"]))
    out = [ParamEntry("backbone.embeddings.weight", (desc.vocab_size, h))]
    for i in range(L):
        out += norm(f"backbone.layers.{i}.norm", h, False, i)
        out += mixer_params(desc, f"backbone.layers.{i}.mixer.", i, bool(c["use_bias"]), bool(c["use_conv_bias"]))
    out += norm("backbone.norm_f", h, False, None) + head(desc)
    return with_params(desc, out)


def mixer_params(d: SSMDesc, p: str, i: int, bias: bool, conv_bias: bool) -> list[ParamEntry]:
    """Mamba2Mixer.__init__'s parameters, in its order."""
    H, inner = d.num_heads, d.intermediate_size
    out = [ParamEntry(p + "conv1d.weight", (d.conv_dim, 1, d.conv_kernel), i)]
    out += [ParamEntry(p + "conv1d.bias", (d.conv_dim,), i)] if conv_bias else []
    out += linear(p + "in_proj", inner + d.conv_dim + H, d.hidden_size, bias, i)
    out += [ParamEntry(p + "dt_bias", (H,), i), ParamEntry(p + "A_log", (H,), i)]
    out += norm(p + "norm", inner, False, i) + [ParamEntry(p + "D", (H,), i)]
    return out + linear(p + "out_proj", d.hidden_size, inner, bias, i)
