"""TRL's chunked student-teacher divergence (trl/kernels/chunked_divergence.py
`ChunkedDivergenceFunction`, TRL 1.16's DistillationTrainer `_chunked_divergence_loss`).

The two models' last hidden states over the completion (N = r * C positions; off Triton every
position, `compact` is false) go through their own heads in tiles of TOKEN_CHUNK_SIZE = 4096
tokens by VOCAB_CHUNK_SIZE = 32768 columns; neither model's logits exist in full. Forward,
per tile: `_project` fills the student's tile (`torch.mm(hidden_chunk.float(),
weight[start:end].to(dtype).t().float(), out=tile)`: fp32 copies of both operands where they
are not fp32, and a cast of the weight slice where it is not in the compute dtype), then the
teacher's, then `_stats_tile` folds both into nine fp32 running statistics of N. At
DistillationConfig's default beta 1.0 (reverse KL) there is no second (JSD) pass. Saved for
backward: both hidden states as the function received them (`reshape(-1, h)` of the
completion's slice: a copy for r > 1, a view of the whole last hidden state for one row),
s_log_z, t_log_z and the divergence (aux), N fp32 each. Backward re-projects both tiles and
runs `_backward_tile` (MODE 1), accumulating fp32 `grad_hidden` (N x h) and, for a trained
head, `grad_weight` (v x h) with `_addmm_fp32` (fp32 copies of both operands).

How many fp32 tiles `_stats_tile` and `_backward_tile` hold at once is read from their
statements (Python keeps every local alive to the function's return; each binary op makes a
new tile while its operands live): `_stats_tile` six (zs, zt, gap, es, et and the product
summed last), `_backward_tile` nine (y, zs, zt, log_ps, log_pt, ps, grad and the two
products of `grad * grad_divergence * inv_t`). Measured against the real trainer on CPU
(bench/trainers/run.py, the `distill/.../on-policy` cases).
Legend: r rows, C completion tokens, N = r * C, n = min(N, 4096), V = min(v, 32768),
W = 32768 (the buffers' width), h the student's hidden size, ht the teacher's.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.breakdown import Breakdown
from vramplan.units import nbytes

TOKEN_CHUNK = 4096
"""trl/kernels/chunked_divergence.py TOKEN_CHUNK_SIZE."""
VOCAB_CHUNK = 32768
"""trl/kernels/chunked_divergence.py VOCAB_CHUNK_SIZE: the width of s_buf and t_buf."""
STATS = 9
"""fp32 vectors of N the forward keeps: s_max, t_max, s_sum, s_x_sum, t_sum, t_weighted_gap,
s_weighted_gap, jsd, kl_student."""
STATS_TILES, BACKWARD_TILES = 6, 9
"""fp32 tiles alive at once in `_stats_tile` and in `_backward_tile` (module docstring)."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """One call of ChunkedDivergenceFunction over N completion positions."""

    rows: int
    completion: int
    hidden: int
    teacher_hidden: int
    vocab: int
    c: str
    """The student's compute dtype: the autocast dtype, else its hidden state's."""
    hidden_dtype: str
    weight_dtype: str
    teacher_dtype: str
    """The teacher's weights, hidden state and compute dtype alike: DistillationTrainer runs
    its backbone past the trainer's autocast (jobs/distill.py onpolicy_estimate)."""
    teacher_input: int
    """Bytes of the teacher's whole last hidden state (r x S x ht), which the completion's
    slice keeps alive until `_compute_loss` returns."""
    torch_fold: bool = True
    """Off Triton (CPU): every position projected, the tiles folded with torch ops. On CUDA
    (`_use_triton`) only the valid positions, gathered (`h[valid]`, a copy), folded by the
    kernels in registers, and the 16-bit matmuls write fp32 directly (`out_dtype`): modelled
    from the source, not measured here."""

    @property
    def tokens(self) -> int:
        return self.rows * self.completion

    @property
    def n(self) -> int:
        return min(self.tokens, TOKEN_CHUNK)

    @property
    def tile(self) -> int:
        """Bytes of one fp32 tile n x V."""
        return nbytes(self.n * min(self.vocab, VOCAB_CHUNK), "fp32")

    def buffers(self) -> Breakdown:
        """s_buf and t_buf, (n, W) fp32 each, whatever the vocabulary."""
        return Breakdown().add("divergence/tile_buffers", 2 * nbytes(self.n * VOCAB_CHUNK, "fp32"))

    def _side(self, hidden: int, wdt: str, c: str, key: str) -> Breakdown:
        """`_project`'s operand copies during a model's mm: `hidden_chunk.float()`, the weight
        slice cast to c and its `.float()` (the chunk's own cast to c: _chunk_casts)."""
        v, out = min(self.vocab, VOCAB_CHUNK), Breakdown()
        if not self.torch_fold:  # `torch.mm(..., out_dtype=torch.float32)`: the weight's cast only
            if wdt != c:
                out.add(f"divergence/{key}_weight_cast", nbytes(v * hidden, c))
            return out
        if c != "fp32":
            out.add(f"divergence/{key}_hidden_fp32", nbytes(self.n * hidden, "fp32"))
        if wdt != c:
            out.add(f"divergence/{key}_weight_cast", nbytes(v * hidden, c))
        if c != "fp32" or wdt != "fp32":
            out.add(f"divergence/{key}_weight_fp32", nbytes(v * hidden, "fp32"))
        return out

    def _chunk_casts(self) -> Breakdown:
        """`student_hidden[sl].to(s_dtype)`, alive through the token chunk (the teacher's hidden
        state is already in its compute dtype)."""
        out = Breakdown()
        if self.hidden_dtype != self.c:
            out.add("divergence/student_hidden_cast", nbytes(self.n * self.hidden, self.c))
        return out

    def _projections(self) -> Breakdown:
        """The larger of the two `_project` calls (the tiles they fill are views of the buffers)."""
        s = self._side(self.hidden, self.weight_dtype, self.c, "student")
        t = self._side(self.teacher_hidden, self.teacher_dtype, self.teacher_dtype, "teacher")
        return max((s, t), key=Breakdown.total)

    def saved(self, head_input: int) -> list[tuple[str, int]]:
        """`ctx.save_for_backward`: both hidden states as received (a reshape copy of the
        completion's slice for r > 1; for one row the view keeps the whole last hidden state),
        s_log_z, t_log_z and aux (the divergence itself at beta 1.0)."""
        n = self.tokens
        one = self.rows == 1 and self.torch_fold  # CUDA gathers the valid rows: a copy
        return [("divergence/student_hidden", head_input if one else nbytes(n * self.hidden, self.hidden_dtype)),
                ("divergence/teacher_hidden",
                 self.teacher_input if one else nbytes(n * self.teacher_hidden, self.teacher_dtype)),
                ("divergence/log_z", 2 * nbytes(n, "fp32")), ("divergence/per_token", nbytes(n, "fp32"))]

    def forward_fold(self) -> Breakdown:
        """Inside the forward's tile loop, besides what is saved: the buffers, the running
        statistics, the chunk's casts, and the larger of a projection's operand copies and
        `_stats_tile`'s six fp32 tiles."""
        out = self.buffers().add("divergence/running_stats", STATS * nbytes(self.tokens, "fp32"))
        out.merge(self._chunk_casts())
        fold = Breakdown().add("divergence/tile_fp32_temporaries", STATS_TILES * self.tile if self.torch_fold else 0)
        return out.merge(max((self._projections(), fold), key=Breakdown.total))

    def backward_fold(self, head_trainable: bool) -> Breakdown:
        """The backward's larger moment. Always alive: the fp32 accumulators `grad_hidden`
        (N x h) and, for a trained head, `grad_weight` (v x h), and the buffers. In the loop:
        `_backward_tile`'s nine fp32 tiles, or a projection's copies, or `_addmm_fp32`'s
        (the gradient tile cast to c and its fp32 copy, the weight slice's copies). After the
        loop: `grad_hidden.to(hidden.dtype)` and `grad_weight.to(weight.dtype)` copies."""
        acc = Breakdown().add("divergence/grad_hidden_fp32", nbytes(self.tokens * self.hidden, "fp32"))
        if head_trainable:
            acc.add("divergence/grad_weight_fp32", nbytes(self.vocab * self.hidden, "fp32"))
        v = min(self.vocab, VOCAB_CHUNK)
        addmm = Breakdown()
        if self.c != "fp32":
            addmm.add("divergence/grad_tile_cast", nbytes(self.n * v, self.c))
        if self.torch_fold:  # `acc.addmm_(a.float(), b.float())`
            addmm.add("divergence/grad_tile_fp32", self.tile)
        addmm.merge(self._side(self.hidden, self.weight_dtype, self.c, "student"))
        tile = Breakdown().add("divergence/tile_fp32_temporaries", BACKWARD_TILES * self.tile if self.torch_fold else 0)
        inner = max((tile, self._projections(), addmm), key=Breakdown.total)
        fold = Breakdown().merge(acc).merge(self.buffers()).merge(self._chunk_casts()).merge(inner)
        end = Breakdown().merge(acc)
        if self.hidden_dtype != "fp32":
            end.add("divergence/grad_hidden", nbytes(self.tokens * self.hidden, self.hidden_dtype))
        if head_trainable and self.weight_dtype != "fp32":
            end.add("divergence/grad_weight", nbytes(self.vocab * self.hidden, self.weight_dtype))
        return fold if fold.total() >= end.total() else end


__all__ = ["Divergence", "TOKEN_CHUNK", "VOCAB_CHUNK"]
