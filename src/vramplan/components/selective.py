"""Selective activation recomputation as Megatron-LM does it (`--recompute-granularity
selective`): the attention core is recomputed in backward, the rest of the layer is saved."""
from __future__ import annotations

_CORE_WORDS = ("scores", "softmax", "probs", "dropped", "softcap", "core.dropout")


def split_attention_core(saved: list[tuple[str, int]]) -> tuple[list, list]:
    """Selective recomputation (Korthikanti et al. 2022, section 4.2; Megatron-LM
    `--recompute-granularity selective`): the attention core's (b, a, s, s) tensors --
    scores, softmax, its dropout mask and output -- are recomputed in backward instead of
    kept; everything else is saved as without checkpointing. Fused attention (sdpa, flash)
    saves no such tensor, so there it changes nothing."""
    core = [(n, v) for n, v in saved if n.startswith("attn/") and any(w in n for w in _CORE_WORDS)]
    names = {n for n, _ in core}
    return [(n, v) for n, v in saved if n not in names], core
