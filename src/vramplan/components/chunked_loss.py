"""torchtune's chunked cross-entropy: what it saves and what its backward holds.

torchtune 0.6 (torchtune/modules/transformer.py TransformerDecoder.chunked_output and
torchtune/modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss): the final norm's
output is split into `n` chunks along the sequence (`h.chunk(n, dim=1)`, views), the output
projection runs once per chunk (16-bit logits, the whole set kept by the recipe until after
the loss: `del logits` in `_loss_step`), and each chunk goes through
`F.cross_entropy(logits.float(), labels, reduction="sum")` on its own. So:
  * saved: every chunk's fp32 log-softmax output (log_softmax saves its result): all n
    chunks together are the full T x v fp32, as with the unchunked loss;
  * forward: the 16-bit logits (T x v) and ONE chunk's fp32 upcast at a time;
  * backward: one chunk's d(log_softmax) and d(logits) in fp32 at a time, then the n
    output projections' backward over the n 16-bit logits gradients.
Legend: T tokens, v vocabulary, h hidden, n chunks, c the logits' dtype.
"""
from __future__ import annotations

from vramplan.breakdown import Breakdown
from vramplan.units import nbytes

NUM_OUTPUT_CHUNKS = 8
"""CEWithChunkedOutputLoss(num_output_chunks=8), the default of every torchtune config."""


def chunked_loss_terms(tokens: int, v: int, h: int, c: str, hidden_dtype: str, head_trains: bool,
                       n: int = NUM_OUTPUT_CHUNKS) -> tuple[Breakdown, Breakdown, Breakdown, Breakdown]:
    """(saved, forward_end, backward_start, head_backward) for T=`tokens` rows."""
    rows = -(-tokens // n)
    full32, chunk32 = nbytes(tokens * v, "fp32"), nbytes(rows * v, "fp32")
    saved = Breakdown().add("logits/log_softmax", full32).add("logits/labels", nbytes(tokens, "int64"))
    fwd = Breakdown().add("logits/logits", nbytes(tokens * v, c)).add("logits/fp32_chunk", chunk32)
    # Backward runs the n cross-entropies first (their nodes were created after all n
    # output projections, and the engine takes the highest sequence number first), last
    # chunk first: at the first of them all n log-softmax chunks are still saved, with
    # nll_loss's gradient and log_softmax's, both fp32, of one chunk. Each leaves its 16-bit
    # logits gradient for its projection.
    bwd0 = Breakdown().add("logits/grad_log_softmax_chunk", chunk32).add("logits/grad_logits_fp32_chunk", chunk32)
    # Then the n output projections' backward: all n 16-bit logits gradients exist at the
    # first; each makes a v x h weight gradient that is added into the head weight's input
    # buffer (a second one while it is added), and a T/n x h gradient that the split's
    # backward holds until all n have arrived, then concatenates.
    head = Breakdown().add("logits/grad_logits", nbytes(tokens * v, c))
    if head_trains:
        head.add("logits/grad_head_weight_chunk", nbytes(v * h, c))
    head.add("logits/grad_hidden_chunks", nbytes(tokens * h, hidden_dtype))
    return saved, fwd, bwd0, head
