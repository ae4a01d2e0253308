"""Command lines and the shell scripts that hold them -> the arguments a program parses.

`swift sft --model X --target_modules q_proj v_proj` -> {"model": "X", "target_modules":
["q_proj", "v_proj"]}: continuation lines joined, comments dropped, `export X=...` and
`X=... swift ...` kept as the launcher's environment, and each value read as transformers'
HfArgumentParser reads a field's text (true/false, numbers, None). Used by the ms-swift
importer (importers/ms_swift.py), whose `swift` command is the one looked for.
"""
from __future__ import annotations

import os
import re
import shlex

from vramplan.importers.report import ImportError_

COMMANDS = ("sft", "pt", "rlhf")
"""The `swift` subcommands that train."""

_SWIFT = re.compile(r"(?:^|/)swift$")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def looks_like_command(text: str) -> bool:
    """A shell script or command line that runs `swift sft|pt|rlhf`."""
    return re.search(r"(?:^|[\s/])swift\s+(?:sft|pt|rlhf)\b", text) is not None


def parse_command(text: str, source: str = "command", *, base_dir: str | None = None,
                  read_file=None) -> tuple[dict, str, dict]:
    """(the arguments as swift parses them, the subcommand, the launcher's environment) of
    the `swift` command in a shell command line or script. Continuation lines are joined,
    `export X=...` and `X=... swift ...` set the environment, and a leading config file
    (`swift sft config.yaml --lora_rank 16`) is read with `read_file`, its keys first and
    the command line's after them, as swift/cli/main.py `parse_yaml_args` orders them."""
    env: dict = {}
    for line in _logical_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            raise ImportError_(source, "command", f"cannot split the line ({exc}): {line[:80]!r}") from None
        if words[:1] == ["export"]:
            words = words[1:]
        at = next((i for i, w in enumerate(words) if _SWIFT.search(w)), None)
        head = words if at is None else words[:at]
        env.update(m.groups() for m in map(_ASSIGN.match, head) if m)
        if at is None or at + 1 >= len(words) or words[at + 1] not in COMMANDS:
            continue
        args = words[at + 2:]
        cfg: dict = {}
        if args and args[0].endswith((".yaml", ".yml", ".json")):
            if read_file is None:
                raise ImportError_(source, "command", f"{args[0]}: a config file named on the command line; "
                                   "pass it with --recipe")
            path = args[0] if os.path.isabs(args[0]) or base_dir is None else os.path.join(base_dir, args[0])
            cfg.update(read_file(path))
            args = args[1:]
        cfg.update(_flags(args, source))
        return cfg, words[at + 1], env
    raise ImportError_(source, "command", "no `swift sft`, `swift pt` or `swift rlhf` command in it")


def _logical_lines(text: str) -> list[str]:
    return [ln for ln in re.sub(r"\\\r?\n", " ", text).splitlines() if ln.strip()]


def _flags(args: list[str], source: str) -> dict:
    """`--key v1 v2 --flag --other v` -> {key: [v1, v2], flag: True, other: v}, each value
    read as HfArgumentParser would read the field's text (true/false, numbers, None)."""
    out: dict = {}
    key = None
    for word in args:
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            key = name.replace("-", "_")
            if not key:
                raise ImportError_(source, "command", f"an empty option name in {word!r}")
            out[key] = [_value(value)] if eq else []
        elif key is None:
            raise ImportError_(source, "command", f"{word!r} comes before any --option")
        else:
            out[key].append(_value(word))
    return {k: True if not v else v[0] if len(v) == 1 else v for k, v in out.items()}


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][+-]?\d+)", text):
        return float(text)
    return text
