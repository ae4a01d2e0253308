"""TRL 1.7-1.14 SFTTrainer's default `loss_type="chunked_nll"` (trl/trainer/sft_trainer.py
`_patch_chunked_ce_lm_head`, `_chunked_cross_entropy_loss`, `_chunk`; the same in 1.7.0 and
1.9.0): the model's forward stops at the last hidden state; the shifted hidden states of the
labelled tokens are gathered (`hidden[order]`, T' x h) and run through the head and the
cross-entropy in chunks of C = 256 tokens, each under non-reentrant checkpointing:

    logits = h.float() @ w.float().t()          # (C, v); the whole (v, h) head weight in fp32
    log_p = F.log_softmax(logits, -1)
    loss = F.nll_loss(log_p, lbl, reduction="sum")
    correct = (logits.argmax(-1) == lbl) ...;  entropy = -(log_p.exp() * log_p).sum(-1) ...

What is alive, per moment (a: the autocast dtype or none; T' = rows x (s - 1)):
* forward, at the matmul: `h.float()` and `w.float()` (fp32 copies of 16-bit tensors), under
  autocast their casts to a, and the logits (C x v in a, else fp32); at the entropy: logits,
  log_p, exp and their product. CUDA's autocast runs log_softmax in fp32 (its fp32 op list);
  CPU's runs it in a and casts log_p to fp32 for nll_loss (CPU autocast's fp32 list), which
  nll_loss saves (measured: TRL 1.9.0 on CPU).
* backward, per chunk: the recomputation keeps what the ops save (the matmul's cast weight,
  and its cast hidden for a trained head; log_p and exp, whose entropy nodes never run, so
  they stay until the chunk's backward ends; nll's fp32 input), its peak at the entropy line
  with the logits and the product alive too; then the gradients: nll's (C x v), log_softmax's,
  and for a trained head the (v, h) weight gradient in a, its fp32 cast and its cast to the
  weight's dtype (the `.float()` and autocast casts' backward).

TRL 1.14 projects in the hidden state's dtype and upcasts after (`logits = (h @
w.to(h.dtype).t()).float()`): no fp32 copy of the weight (its cast to the hidden dtype where
they differ), the matmul's output beside its fp32 copy, and log_softmax, exp and the product
in fp32 on either backend (`in_hidden_dtype`).

Measured on CPU with TRL 1.9.0, 1.12.0 and 1.14.0 (bench/trainers/results-trl-releases.json);
the CUDA op lists are read from aten/src/ATen/autocast_mode.cpp, not measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.breakdown import Breakdown
from vramplan.units import nbytes

CHUNK_TOKENS = 256
"""trl/trainer/sft_trainer.py `_CHUNKED_LM_HEAD_CHUNK_SIZE = 256` (1.7-1.14)."""
IN_HIDDEN_DTYPE_SINCE = (1, 14)
"""The release whose `_chunk` projects in the hidden dtype (`(h @ w.to(h.dtype).t()).float()`)."""


@dataclass(frozen=True, slots=True)
class ChunkedNll:
    rows: int
    seq_len: int
    hidden: int
    vocab: int
    hidden_dtype: str
    """The last hidden state's dtype."""
    weight_dtype: str
    autocast: str | None
    cuda: bool
    in_hidden_dtype: bool = False
    """TRL 1.14: `(h @ w.to(h.dtype).t()).float()` instead of `h.float() @ w.float().t()`."""

    @property
    def tokens(self) -> int:
        return self.rows * (self.seq_len - 1)

    @property
    def chunk(self) -> int:
        return min(self.tokens, CHUNK_TOKENS)

    def _cv(self, dtype: str) -> int:
        return nbytes(self.chunk * self.vocab, dtype)

    @property
    def _operand_dtype(self) -> str:
        """What `.float()` (or 1.14's `.to(h.dtype)`) makes the matmul's operands."""
        return self.hidden_dtype if self.in_hidden_dtype else "fp32"

    @property
    def mm_dtype(self) -> str:
        return self.autocast or self._operand_dtype

    @property
    def log_p_dtype(self) -> str:
        if self.in_hidden_dtype:
            return "fp32"   # log_softmax of the `.float()` logits
        return "fp32" if self.autocast and self.cuda else self.mm_dtype

    @property
    def nll_cast(self) -> bool:
        return bool(self.autocast) and not self.cuda and self.log_p_dtype != "fp32"

    def _weight_copies(self) -> tuple[int, int]:
        """(the weight in the operand dtype, its autocast cast), bytes; none where equal."""
        vh, op = self.vocab * self.hidden, self._operand_dtype
        return (nbytes(vh, op) if self.weight_dtype != op else 0,
                nbytes(vh, self.autocast) if self.autocast and self.autocast != op else 0)

    def _hidden_copies(self) -> tuple[int, int]:
        ch, op = self.chunk * self.hidden, self._operand_dtype
        return (nbytes(ch, op) if self.hidden_dtype != op else 0,
                nbytes(ch, self.autocast) if self.autocast and self.autocast != op else 0)

    def _upcast(self) -> int:
        """1.14's `.float()` of the matmul's output, beside it (none when already fp32)."""
        return self._cv("fp32") if self.in_hidden_dtype and self.mm_dtype != "fp32" else 0

    def saved(self, head_input: int) -> list[tuple[str, int]]:
        """The gathered hidden states (the checkpointed chunks' input, kept to the backward),
        the gather's indices and the gathered labels."""
        n = self.tokens
        return [("chunked_nll/hidden", nbytes(n * self.hidden, self.hidden_dtype)),
                ("chunked_nll/order", nbytes(n, "int64")), ("chunked_nll/labels", nbytes(n, "int64"))]

    def forward_fold(self) -> Breakdown:
        wf, wc = self._weight_copies()
        hf, hc = self._hidden_copies()
        logits, lp = self._cv(self.mm_dtype), self._cv(self.log_p_dtype)
        at_mm = (Breakdown().add("chunked_nll/weight_fp32", wf).add("chunked_nll/weight_cast", wc)
                 .add("chunked_nll/hidden_fp32", hf).add("chunked_nll/hidden_cast", hc)
                 .add("chunked_nll/logits", logits))
        if self._upcast():   # 1.14: the matmul's output, then its fp32 copy, the logits after
            at_float = Breakdown().add("chunked_nll/logits_mm", logits).add("chunked_nll/logits", self._upcast())
            logits = self._upcast()
        else:
            at_float = Breakdown()
        at_entropy = (Breakdown().add("chunked_nll/logits", logits).add("chunked_nll/log_p", lp)
                      .add("chunked_nll/exp", lp).add("chunked_nll/entropy_product", lp))
        at_nll = Breakdown().add("chunked_nll/logits", logits).add("chunked_nll/log_p", lp)
        if self.nll_cast:
            at_nll.add("chunked_nll/log_p_fp32", self._cv("fp32"))
        return max((at_mm, at_float, at_entropy, at_nll), key=Breakdown.total)

    def backward_fold(self, head_trainable: bool) -> Breakdown:
        """The chunk's backward: its recomputation at the matmul (the weight's fp32 copy and
        cast alive) and at the entropy line (with what the recomputed ops save), nll_loss's
        backward, and for a trained head the weight gradient through the casts' backward
        (the matmul's (v, h) gradient beside its fp32 cast, or the fp32 one beside its cast
        to the weight's dtype). Measured (TRL 1.9.0, CPU): the entropy line on a 128-wide
        model, the matmul on a 512-wide one."""
        wf, wc = self._weight_copies()
        hf, hc = self._hidden_copies()
        lp = self._cv(self.log_p_dtype)
        logits = self._cv(self.mm_dtype)
        at_mm = (Breakdown().add("chunked_nll/weight_fp32", wf).add("chunked_nll/weight_cast", wc)
                 .add("chunked_nll/hidden_fp32", hf).add("chunked_nll/hidden_cast", hc)
                 .add("chunked_nll/logits", logits))
        # what the recomputation saves: the matmul's weight operand (its cast, or w.float(),
        # or w itself), its hidden operand for a trained head; log_p and exp (entropy nodes)
        kept = Breakdown().add("chunked_nll/weight_saved", wc or wf)
        if head_trainable:
            kept.add("chunked_nll/hidden_saved", hc or hf)
        kept.add("chunked_nll/log_p", lp).add("chunked_nll/exp", lp)
        nll_in = self._cv("fp32") if self.nll_cast else 0
        at_float = Breakdown()
        if self._upcast():
            at_float = Breakdown().merge(at_mm).add("chunked_nll/logits_fp32", self._upcast())
            logits = self._upcast()
        at_entropy = (Breakdown().merge(kept).add("chunked_nll/log_p_fp32", nll_in)
                      .add("chunked_nll/logits", logits).add("chunked_nll/entropy_product", lp))
        # nll_loss's backward: its gradient (in its input's dtype) beside its saved input
        g1 = self._cv("fp32") if self.nll_cast else lp
        nll = Breakdown().merge(kept).add("chunked_nll/log_p_fp32", nll_in).add("chunked_nll/grad_nll", g1)
        moments = [at_mm, at_float, at_entropy, nll]
        if head_trainable:
            vh, op = self.vocab * self.hidden, self._operand_dtype
            grad = Breakdown().add("chunked_nll/grad_weight_mm", nbytes(vh, self.mm_dtype))
            if self.autocast and self.autocast != op:   # the autocast cast's backward
                grad.add("chunked_nll/grad_weight_operand", nbytes(vh, op))
            elif self.weight_dtype != op:   # `.float()` / `.to(h.dtype)`'s backward
                grad.add("chunked_nll/grad_weight", nbytes(vh, self.weight_dtype))
            moments.append(grad)
        return max(moments, key=Breakdown.total)


__all__ = ["ChunkedNll", "CHUNK_TOKENS", "IN_HIDDEN_DTYPE_SINCE"]
