"""Tiny in-memory data for the library trainers: a word-level tokenizer whose words are the
token ids, and datasets (``datasets.Dataset.from_dict``) whose rows tokenize to exactly the
spec's lengths, so every batch is ``micro_batch_size`` rows of ``seq_len`` tokens with no
padding (the worst case the estimate describes). Nothing is downloaded or saved.
"""
from __future__ import annotations

EOS, PAD, UNK = 1, 2, 0
FIRST = 3  # first id used for text


def tokenizer(vocab_size: int):
    """A ``PreTrainedTokenizerFast`` over words ``t3 .. t{V-1}`` and ``<unk>``, ``<eos>``,
    ``<pad>`` (ids 0-2; WordLevel, no special tokens added): ``"t5 t9<eos>"`` is ``[5, 9, 1]``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Special tokens are matched anywhere in the text, so they must not be prefixes of words.
    vocab = {f"t{i}": i for i in range(FIRST, vocab_size)} | {"<unk>": UNK, "<eos>": EOS, "<pad>": PAD}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Split on whitespace, then each "t<digits>" on its own: TRL appends the EOS text to a
    # completion with no separator ("t5 t6" + "<eos>").
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("t[0-9]+"), "isolated")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def words(n: int, seed: int, vocab_size: int) -> str:
    """``n`` text tokens (never the special ids), varied by ``seed``."""
    span = vocab_size - FIRST
    return " ".join(f"t{FIRST + (seed * 7919 + i * 31) % span}" for i in range(n))


def prompt_split(seq_len: int) -> int:
    """Prompt tokens of a preference row of ``seq_len`` tokens (half, at least one)."""
    return max(1, seq_len // 2)


def preference_rows(n: int, seq_len: int, vocab_size: int) -> dict:
    """``prompt`` + ``chosen``/``rejected`` (+ the EOS TRL appends: dpo_trainer.py
    ``_prepare_dataset`` ``add_eos``) = ``seq_len`` tokens each."""
    p = prompt_split(seq_len)
    c = seq_len - p - 1
    # TRL tokenizes prompt + completion as one string: completions start with the separator.
    return {"prompt": [words(p, i, vocab_size) for i in range(n)],
            "chosen": [" " + words(c, 1000 + i, vocab_size) for i in range(n)],
            "rejected": [" " + words(c, 2000 + i, vocab_size) for i in range(n)]}


def unpaired_rows(n: int, seq_len: int, vocab_size: int) -> dict:
    """KTO: ``prompt``, ``completion`` and a ``label`` per row (half desirable)."""
    rows = preference_rows(n, seq_len, vocab_size)
    return {"prompt": rows["prompt"], "completion": rows["chosen"],
            "label": [i % 2 == 0 for i in range(n)]}


def reward_rows(n: int, seq_len: int, vocab_size: int) -> dict:
    """Implicit-prompt preference rows for RewardTrainer (``chosen``/``rejected`` of
    ``seq_len`` tokens with the EOS it appends: reward_trainer.py ``_prepare_dataset``)."""
    c = seq_len - 1
    return {"chosen": [words(c, 1000 + i, vocab_size) for i in range(n)],
            "rejected": [words(c, 2000 + i, vocab_size) for i in range(n)]}


def prompt_rows(n: int, seq_len: int, vocab_size: int) -> dict:
    """GRPO: ``prompt`` of ``seq_len`` tokens."""
    return {"prompt": [words(seq_len, i, vocab_size) for i in range(n)]}


def lm_rows(n: int, seq_len: int, vocab_size: int) -> dict:
    """HF Trainer causal-LM rows: token ids and their labels (a copy), ``seq_len`` each."""
    ids = [[FIRST + (i * 7919 + j * 31) % (vocab_size - FIRST) for j in range(seq_len)] for i in range(n)]
    return {"input_ids": ids, "labels": [list(r) for r in ids]}


def dataset(rows: dict):
    from datasets import Dataset

    return Dataset.from_dict(rows)


def distill_rows(n: int, seq_len: int, vocab_size: int) -> dict:
    """GKD (lmbda 0): token ids, a full attention mask and labels on every token (no prompt
    masked: the most tokens the divergence is taken over)."""
    rows = lm_rows(n, seq_len, vocab_size)
    return rows | {"attention_mask": [[1] * seq_len for _ in range(n)]}
