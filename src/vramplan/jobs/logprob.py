"""Per-token log-probability heads of the preference and RL trainers (the `logprob_head` choice).

* full: TRL 0.x `get_batch_logps` (whole logits, fp32 `log_softmax`, `gather`): trained.logps_loss
  and frozen.logps_head.
* selective: `selective_log_softmax` (trl/trainer/utils.py, TRL 0.13 onward): fp32 logits ->
  `gather` minus a per-row `logsumexp`; 16-bit logits -> a loop over rows of
  `log_softmax(row)` and `gather`. DPOTrainer's own, 0.15 to 1.14, by release: jobs/dpo_head.py.
* chunked: TRL 1.x `add_fused_lm_head` (trl/trainer/utils.py `_fused_forward`) and
  trl/kernels/chunked_logprob.py `ChunkedLogProbFunction`: the backbone's last hidden state,
  shifted, goes through the head in tiles of TOKEN_CHUNK_SIZE = 4096 tokens by chunk_size =
  32768 vocabulary columns (`_CHUNKED_LOGPROB_CHUNK_SIZE`), each folded into online-logsumexp
  statistics; the full logits never exist. On CUDA (Triton) the fold is a kernel working in
  registers; elsewhere `_forward_tile` / `_backward_tile` run torch ops on the whole tile,
  whose fp32 temporaries are what this module counts.

Legend: r rows, s sequence, h hidden, v vocabulary, c compute dtype, N = r * (s - 1) scored
tokens, n = min(N, 4096) tokens per tile, V = min(v, 32768) columns per tile, W = 32768.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramplan.breakdown import Breakdown
from vramplan.components.arch import model_rows
from vramplan.components import qlora_prep
from vramplan.components.dtypes import dtypes_of
from vramplan.components.trl_sft_metrics import CHUNKED_NLL_SINCE, FUSED_SINCE
from vramplan.jobs.chunked_nll import IN_HIDDEN_DTYPE_SINCE, ChunkedNll
from vramplan.i18n import Msg
from vramplan.spec import Backend, JobSpec, LogprobHead, LossImpl, Task
from vramplan.spec.stack import Framework
from vramplan.units import nbytes

TOKEN_CHUNK = 4096
"""trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE: tokens per projection tile."""
VOCAB_CHUNK = 32768
"""trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE: the scratch buffer's width."""
GRPO_ENTROPY_SINCE = (0, 21)
"""GRPOTrainer's policy adds an entropy pass over its scored logits from 0.21 (jobs/grpo_head.py)."""
RLOO_GROUP_SINCE = (0, 22)
"""RLOOTrainer is GRPOTrainer's layout from 0.22 (before, a PPO-style trainer with `rloo_k`);
its `_get_per_token_logps_and_entropies` divides by the temperature as GRPO's does in each
release through 1.14 (read from 0.22.2 to 1.14.0: the copy, `div_`, the bound `outputs`,
the joint kernel at the same releases), so jobs/grpo_head.py serves both."""
GRPO_SELECTIVE_SINCE = (0, 16)
"""GRPOTrainer's `_get_per_token_logps` divides by the temperature and scores
`selective_log_softmax` from 0.16 (jobs/grpo_head.py; 0.15 does not divide)."""
KTO_VIEW_SINCE = (1, 9)
"""KTOTrainer is back in trl/trainer with DPO 1.6's `_compute_loss` pattern from 1.9 (jobs/dpo_head.py)."""
SELECTIVE_SINCE = (0, 15)
"""DPOTrainer's concatenated_forward scores with trl/trainer/utils.py `selective_log_softmax`
from 0.15 (read from 0.13.0, 0.14.0 and 0.15.2)."""

# Trainers that call the model with fused_lm_head=True in TRL 1.16 (dpo_trainer.py, kto_trainer.py,
# grpo_trainer.py, rloo_trainer.py, sft_trainer.py `add_fused_lm_head`). ORPO and CPO/SimPO
# (trl/experimental/orpo, cpo) still build the full logits and score them with
# `selective_log_softmax` (their `get_batch_logps`); PPO is no longer in TRL 1.x.
_CHUNKED_TASKS = (Task.DPO, Task.IPO, Task.KTO, Task.GRPO, Task.RLOO)
_SELECTIVE_TASKS = (Task.ORPO, Task.SIMPO)


def resolve_head(spec: JobSpec) -> LogprobHead:
    """The head the spec asks for; `auto` is TRL 1.16's for the task (any backend: the
    chunked head has a Triton path on CUDA and a torch fallback elsewhere). SFT runs it only
    under TRL's SFTTrainer (`stack: trl`); the HF Trainer's SFT is the model's own loss."""
    head = spec.logprob_head
    if head is not LogprobHead.AUTO:
        return head
    if spec.stack.framework is Framework.LLAMA_FACTORY:
        # its DPO/KTO trainers' own concatenated_forward: logits.to(float32) + get_batch_logps
        # (src/llamafactory/train/dpo/trainer.py, train/trainer_utils.py)
        return LogprobHead.FULL
    if spec.stack.framework is Framework.MS_SWIFT and spec.task in (Task.DPO, Task.IPO):
        # its DPOTrainer's get_per_token_logps: selective_log_softmax (jobs/dpo_head.py SWIFT)
        return LogprobHead.SELECTIVE
    if spec.task is Task.SFT:
        # before 1.7 SFTTrainer calls the model's own loss (super().compute_loss), then its
        # metrics over the logits (components/trl_sft_metrics.py); 1.7 to 1.14 default to a
        # chunked_nll head (jobs/chunked_nll.py, sft_head); 1.15 and 1.16 run the fused head
        trl = spec.stack.minor("trl")
        fused = spec.stack.framework is Framework.TRL and (trl is None or trl >= FUSED_SINCE)
        return LogprobHead.CHUNKED if fused else LogprobHead.FULL
    if spec.task in _SELECTIVE_TASKS:
        return LogprobHead.SELECTIVE
    release = spec.stack.minor("trl")
    if spec.task is Task.GRPO and release is not None and GRPO_SELECTIVE_SINCE <= release < FUSED_SINCE:
        return LogprobHead.SELECTIVE  # GRPOTrainer's own head, 0.16 to 1.14 (jobs/grpo_head.py)
    if spec.task is Task.RLOO and release is not None and RLOO_GROUP_SINCE <= release < FUSED_SINCE:
        return LogprobHead.SELECTIVE  # RLOOTrainer's, GRPO's head of the same release
    if spec.task is Task.KTO and release is not None and KTO_VIEW_SINCE <= release < FUSED_SINCE:
        return LogprobHead.SELECTIVE  # KTOTrainer's own head, 1.9 to 1.14 (jobs/dpo_head.py)
    if spec.task in (Task.DPO, Task.IPO) and release is not None and release < FUSED_SINCE:
        # DPOTrainer's own heads before the fused one (jobs/dpo_head.py): selective_log_softmax
        # from 0.15, a log_softmax over the whole logits before
        return LogprobHead.SELECTIVE if release >= SELECTIVE_SINCE else LogprobHead.FULL
    return LogprobHead.CHUNKED if spec.task in _CHUNKED_TASKS else LogprobHead.FULL


def sft_head(spec: JobSpec, hidden: int, vocab: int, softcap: bool) -> "Chunked | ChunkedNll | None":
    """TRL 1.16 SFTTrainer's head, or None for the model's own cross-entropy: the trainer
    calls `add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))`
    (trl/trainer/sft_trainer.py __init__) and `compute_loss` takes `-log_probs` summed over
    the label mask; `full` (or `selective`, which SFT has no use for) is the model's loss.
    TRL 1.7-1.14's default chunked_nll head (jobs/chunked_nll.py) where that release runs."""
    if nll_chunked(spec) and not softcap:
        return _chunked_nll(spec, hidden, vocab)
    if spec.task is not Task.SFT or resolve_head(spec) is not LogprobHead.CHUNKED:
        return None
    # a padding-free batch is one row of b*s tokens (components/arch.py model_rows)
    return chunked_head(spec, *model_rows(spec), hidden, vocab, top1=True, entropy=True, softcap=softcap)


def head_note(spec: JobSpec) -> str:
    """What the answer assumed about the log-prob head, in words."""
    head = resolve_head(spec)
    # Msg: English text the report edge can print translated (vramplan.i18n.tr)
    release = spec.stack.minor("trl")
    if (head is LogprobHead.CHUNKED and spec.task is not Task.SFT and spec.logprob_head is LogprobHead.AUTO
            and release is not None and release < FUSED_SINCE):
        # KTO's heads before 1.9, GRPO's before 0.16 and RLOO's before 0.22 are not modelled
        # (DPO's are, and KTO's from 1.9: jobs/dpo_head.py; GRPO's from 0.16 and RLOO's from
        # 0.22: jobs/grpo_head.py)
        if spec.task is Task.RLOO:
            return Msg("TRL {release}'s RLOOTrainer is the PPO-style one that 0.22 replaced; not modelled, the "
                       "estimate takes TRL 1.16's RLOOTrainer", release=spec.stack.trl)
        return Msg("log-prob head: TRL {release}'s is not modelled; the estimate takes TRL 1.16's chunked head",
                   release=spec.stack.trl)
    if head is LogprobHead.SELECTIVE and spec.task is Task.KTO and spec.logprob_head is LogprobHead.AUTO:
        return Msg("log-prob head: TRL {release} KTOTrainer's selective_log_softmax over the full logits, "
                   "with its entropy and mean-logits metrics", release=spec.stack.trl)
    if head is LogprobHead.SELECTIVE and spec.task in (Task.DPO, Task.IPO) and spec.stack.framework is Framework.MS_SWIFT:
        return Msg("log-prob head: ms-swift DPOTrainer's selective_log_softmax over the positions its "
                   "logits_to_keep keeps (prompt_len), mean logits reduced before masking")
    if head is LogprobHead.SELECTIVE and spec.task in (Task.DPO, Task.IPO):
        # from 1.15 DPOTrainer runs the fused head only; `selective` there is 1.14's (jobs/dpo_head.py)
        named = spec.stack.trl if release is not None and release < FUSED_SINCE else "1.14"
        return Msg("log-prob head: TRL {release} DPOTrainer's selective_log_softmax over the full logits, "
                   "with its entropy and mean-logits metrics", release=named)
    if head is LogprobHead.CHUNKED:
        path = (Msg("Triton fold; every position counted, TRL scores only labels that are not -100")
                if spec.backend is Backend.CUDA else Msg("torch fallback with fp32 tile temporaries"))
        return Msg("log-prob head: chunked (TRL 1.16 fused_lm_head, {tokens} x {vocab} tiles, {path}); "
                   "TRL's configs default to gradient_checkpointing=True and bf16=True, the spec's values are used",
                   tokens=TOKEN_CHUNK, vocab=VOCAB_CHUNK, path=path)
    if head is LogprobHead.SELECTIVE and spec.task in (Task.GRPO, Task.RLOO) and spec.logprob_head is LogprobHead.AUTO:
        if release < GRPO_ENTROPY_SINCE:
            return Msg("log-prob head: TRL {release} GRPOTrainer's selective_log_softmax over the completion's "
                       "logits (no entropy pass before 0.21)", release=spec.stack.trl)
        return Msg("log-prob head: TRL {release} {trainer}'s selective_log_softmax over the completion's "
                   "logits, with its entropy", release=spec.stack.trl,
                   trainer="RLOOTrainer" if spec.task is Task.RLOO else "GRPOTrainer")
    if head is LogprobHead.SELECTIVE and spec.task in _SELECTIVE_TASKS:
        return Msg("log-prob head: selective_log_softmax over the full logits "
                   "(TRL 1.16 trl.experimental ORPO/CPO get_batch_logps)")
    if head is LogprobHead.SELECTIVE:
        return Msg("log-prob head: selective_log_softmax (TRL 0.13-0.2x)")
    return Msg("log-prob head: full fp32 log_softmax over the logits (TRL 0.x get_batch_logps)")


def nll_chunked(spec: JobSpec) -> bool:
    """TRL's SFTTrainer at a release whose SFTConfig defaults to loss_type chunked_nll (1.7
    to 1.14), on the model's own head (`auto`), with the standard loss."""
    release = spec.stack.minor("trl")
    return (spec.task is Task.SFT and spec.stack.framework is Framework.TRL and release is not None
            and CHUNKED_NLL_SINCE <= release < FUSED_SINCE and spec.logprob_head is LogprobHead.AUTO
            and spec.loss_impl is LossImpl.STANDARD)


def _chunked_nll(spec: JobSpec, hidden: int, vocab: int) -> ChunkedNll:
    dt = dtypes_of(spec)
    hidden_dtype = weight_dtype = dt.weights
    if spec.method.value == "qlora":
        hidden_dtype = qlora_prep.rest_dtype(spec, "model.norm", dt.weights)
        weight_dtype = qlora_prep.rest_dtype(spec, "lm_head", dt.weights)
    return ChunkedNll(*model_rows(spec), hidden, vocab, hidden_dtype, weight_dtype, dt.autocast,
                      spec.backend is Backend.CUDA, in_hidden_dtype=spec.stack.minor("trl") >= IN_HIDDEN_DTYPE_SINCE)


@dataclass(frozen=True, slots=True)
class Chunked:
    """One call of ChunkedLogProbFunction: N tokens of width h through a v x h head."""

    rows: int
    seq_len: int
    hidden: int
    vocab: int
    c: str
    """Compute dtype: the autocast dtype, else the hidden state's (`compute_dtype`)."""
    hidden_dtype: str
    """dtype of the backbone's last hidden state (fp32 under autocast)."""
    weight_dtype: str
    torch_fold: bool
    """True off Triton (CPU): the tile is folded with torch ops (`_forward_tile`)."""
    top1: bool = False
    """`is_top1` requested (DPO's metrics): a bool tile mask lives through the fold."""
    entropy: bool = False
    """`entropy` requested: saved for backward in log_z's second slot."""
    softcap: bool = False

    @property
    def tokens(self) -> int:
        return self.rows * (self.seq_len - 1)

    @property
    def tile(self) -> int:
        """Elements of one tile n x V."""
        return min(self.tokens, TOKEN_CHUNK) * min(self.vocab, VOCAB_CHUNK)

    def scratch(self) -> int:
        """`mm_buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), chunk_size), dtype=compute_dtype)`:
        always 32768 wide, also for a smaller vocabulary."""
        return nbytes(min(self.tokens, TOKEN_CHUNK) * VOCAB_CHUNK, self.c)

    def casts(self, weight: bool = True) -> Breakdown:
        """`hidden[...].to(compute_dtype)` and `weight[start:end].to(compute_dtype)` copies
        when the dtypes differ (autocast over fp32 weights). `weight=False`: the forward's
        weight cast is an argument of `torch.mm(hidden_chunk, weight[start:end].to(...).t(),
        out=tile)` (trl/kernels/chunked_logprob.py ChunkedLogProbFunction.forward), freed
        when the mm returns, before the tile is folded; backward keeps it as `w_chunk`."""
        out = Breakdown()
        if self.hidden_dtype != self.c:
            out.add("logprob/hidden_chunk_cast", nbytes(min(self.tokens, TOKEN_CHUNK) * self.hidden, self.c))
        if weight and self.weight_dtype != self.c:
            out.add("logprob/weight_chunk_cast", nbytes(min(self.vocab, VOCAB_CHUNK) * self.hidden, self.c))
        return out

    def saved(self, head_input: int) -> list[tuple[str, int]]:
        """`ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy-or-log_z)`.
        hidden: CPU `hidden_states.reshape(-1, h)` of the shifted view (a copy for r > 1; for
        one row the view keeps the whole last hidden state), CUDA `hidden_states[mask]`;
        targets: `labels.clamp(min=0)` (CPU) or `labels[mask]` (CUDA), int64."""
        n = self.tokens
        hidden = head_input if self.rows == 1 and self.torch_fold else nbytes(n * self.hidden, self.hidden_dtype)
        out = [("logprob/hidden", hidden), ("logprob/targets", nbytes(n, "int64")),
               ("logprob/log_z", nbytes(n, "fp32"))]
        if self.entropy:
            out.append(("logprob/entropy", nbytes(n, "fp32")))
        return out

    def forward_fold(self) -> Breakdown:
        """Live inside the forward tile loop besides what is saved: the scratch tile, seven
        fp32 running statistics of N (`running_max` .. `target_logit`) and, off Triton,
        `_forward_tile`'s temporaries. Its peak is three fp32 tiles at once: z, `z - new_m`
        and `e = exp(...)`. `_torch_transform(tile.float(), ...)` never holds more: the call
        moves its argument into the callee's frame, so each `z = ...` rebinding frees the
        tile before it; with softcapping `softcap * torch.tanh(z / softcap)` holds z, `z /
        softcap` and the tanh, three as well (the gemma2 SFTTrainer case's trace: two
        `mul` tiles and the `exp` at the forward peak). `is_top1` adds the bool
        `before_target` mask alive through the fold."""
        out = Breakdown().add("logprob/scratch_tile", self.scratch())
        out.add("logprob/running_stats", 7 * nbytes(self.tokens, "fp32")).merge(self.casts(weight=False))
        if self.torch_fold:
            out.add("logprob/tile_fp32_temporaries", 3 * nbytes(self.tile, "fp32"))
            if self.top1:
                out.add("logprob/tile_top1_mask", nbytes(self.tile, "bool"))
        return out

    def backward_fold(self, head_trainable: bool) -> Breakdown:
        """The backward's larger moment. Always alive: fp32 accumulators `grad_hidden` (N x h)
        and, for a trained head, `grad_weight` (v x h), and a new scratch tile. Off Triton,
        `_backward_tile` holds y, z, log_p, p, grad and the bool `is_target`, and at
        `grad += g * (is_target.float() - p)` two more fp32 tiles: seven fp32 tiles and one
        bool (eight with softcapping's tanh). After the loop: `grad_hidden.to(hidden.dtype)`
        and `grad_weight.to(weight.dtype)` copies beside the fp32 accumulators."""
        acc = Breakdown().add("logprob/grad_hidden_fp32", nbytes(self.tokens * self.hidden, "fp32"))
        if head_trainable:
            acc.add("logprob/grad_weight_fp32", nbytes(self.vocab * self.hidden, "fp32"))
        acc.add("logprob/scratch_tile", self.scratch())
        fold = Breakdown().merge(acc).merge(self.casts())
        if self.torch_fold:
            k = 8 if self.softcap else 7
            fold.add("logprob/tile_fp32_temporaries", k * nbytes(self.tile, "fp32"))
            fold.add("logprob/tile_target_mask", nbytes(self.tile, "bool"))
        end = Breakdown().merge(acc)
        if self.hidden_dtype != "fp32":
            end.add("logprob/grad_hidden", nbytes(self.tokens * self.hidden, self.hidden_dtype))
        if head_trainable and self.weight_dtype != "fp32":
            end.add("logprob/grad_weight", nbytes(self.vocab * self.hidden, self.weight_dtype))
        return fold if fold.total() >= end.total() else end

    def frozen_peak(self, head_input: int) -> Breakdown:
        """Under torch.no_grad() (a reference model): the last hidden state, the shifted
        copy and targets, the fold's live set."""
        out = Breakdown().add("logprob/last_hidden_state", head_input)
        for name, value in self.saved(head_input):
            if name == "logprob/hidden" and self.rows == 1 and self.torch_fold:
                continue  # a view of the last hidden state
            out.add(name, value)
        return out.merge(self.forward_fold())


def chunked_head(spec: JobSpec, rows: int, seq_len: int, hidden: int, vocab: int, *, top1: bool = False,
                 entropy: bool = False, softcap: bool = False) -> Chunked:
    """The chunked head of a model in `spec`'s precision and backend."""
    p = spec.precision
    c, hidden_dtype, weight_dtype = p.compute_dtype, p.weight_dtype, p.weight_dtype
    if spec.method.value == "qlora":
        # the head and the final norm are parameters the quantizer left, in the dtype the
        # stack's preparation gave them (qlora_prep.py); the kernel computes in the autocast
        # dtype, else the hidden state's (`compute_dtype = ... else hidden.dtype`)
        hidden_dtype = qlora_prep.rest_dtype(spec, "model.norm", p.weight_dtype)
        weight_dtype = qlora_prep.rest_dtype(spec, "lm_head", p.weight_dtype)
        c = dtypes_of(spec).autocast or hidden_dtype
    return Chunked(rows, seq_len, hidden, vocab, c, hidden_dtype, weight_dtype,
                   torch_fold=spec.backend is not Backend.CUDA, top1=top1, entropy=entropy, softcap=softcap)
