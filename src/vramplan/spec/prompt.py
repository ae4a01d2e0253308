"""`prompt_len`: how many tokens of a row come before its first labelled one (the prompt and
the chat template's prefix), for the stacks whose head computes logits only from there on.

ms-swift (4.x; swift/trainers/mixin.py `prepare_logits_to_keep`, on by default for text
models) passes `logits_to_keep` to the model: with one row per micro-batch the positions
whose next token is labelled, with more rows every position from the earliest first label
on (components/kept_logits.py). Other stacks compute logits at every position, so there it
changes nothing, and the answer says so. None means every token after the first is labelled
(pre-training, or the most a row can hold); the first token never is (labels are shifted).
"""
from __future__ import annotations

from vramplan.spec.enums import SpecError, Task
from vramplan.spec.sections import positive_int

PROMPT_TASKS = (Task.SFT, Task.PRETRAIN, Task.DPO, Task.IPO)
"""The tasks whose rows are a prompt and a labelled answer in one sequence (DPO's chosen and
rejected rows each; the RL tasks give their prompt and completion lengths apart)."""


def parse_prompt_len(spec) -> int | None:
    value = spec.prompt_len
    if value is None:
        return None
    if spec.task not in PROMPT_TASKS:
        raise SpecError("prompt_len", f"task {spec.task.value} does not read it (sft, pretrain, dpo and ipo rows "
                        "are prompt and answer in one sequence); drop prompt_len")
    if spec.packing:
        raise SpecError("prompt_len", "packed rows hold many prompts; drop prompt_len or packing")
    n = positive_int("prompt_len", value)
    if n >= spec.seq_len:
        raise SpecError("prompt_len", f"{n} leaves no labelled token in a row of seq_len {spec.seq_len}; "
                        f"give a prompt_len below {spec.seq_len}")
    return n


__all__ = ["PROMPT_TASKS", "parse_prompt_len"]
