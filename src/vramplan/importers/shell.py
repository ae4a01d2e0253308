"""Command lines and the shell scripts that hold them -> the arguments a program parses.

`swift sft --model X --target_modules q_proj v_proj` -> {"model": "X", "target_modules":
["q_proj", "v_proj"]}: continuation lines joined, comments dropped, `export X=...` and
`X=... swift ...` kept as the launcher's environment, and each value read as transformers'
HfArgumentParser reads a field's text (true/false, numbers, None). Used by the ms-swift
importer (importers/ms_swift.py), whose `swift` command is the one looked for.
"""
from __future__ import annotations

import ast
import os
import re
import shlex

from vramplan.importers.report import ImportError_

COMMANDS = ("sft", "pt", "rlhf")
"""The `swift` subcommands that train."""

_SWIFT = re.compile(r"(?:^|/)swift$")
_SCRIPT = re.compile(r"(?:^|/)swift/cli/([a-z_]+)\.py$")
"""The entry a launcher runs (`torchrun ... swift/cli/sft.py`, `accelerate launch ... swift/cli/sft.py`)."""
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
# launcher flags that set the number of processes: torchrun's and accelerate launch's
_LAUNCH = {"nproc_per_node": "NPROC_PER_NODE", "nnodes": "NNODES", "num_processes": "NPROC_PER_NODE",
           "num_machines": "NNODES"}


def looks_like_command(text: str) -> bool:
    """A shell script or command line that runs `swift` (or Megatron-SWIFT's `megatron`)."""
    return re.search(r"(?:^|[\s/])(?:swift|megatron)\s+(?:\\\s*)?[a-z_]+\b|swift/cli/[a-z_]+\.py", text) is not None


def parse_command(text: str, source: str = "command", *, base_dir: str | None = None,
                  read_file=None) -> tuple[dict, str, dict]:
    """(the arguments as swift parses them, the subcommand, the launcher's environment) of
    the `swift` command in a shell command line or script. Continuation lines are joined, a
    quoted value may span lines, `export X=...`, `X=...` and `X=... swift ...` set variables
    that `$X` / `${X}` later read, a launcher's process count (`torchrun --nproc_per_node`,
    `accelerate launch --num_processes`) is kept as NPROC_PER_NODE, and a leading config
    file (`swift sft config.yaml --lora_rank 16`) is read with `read_file`, its keys first
    and the command line's after them, as swift/cli/main.py `parse_yaml_args` orders them."""
    env: dict = {}
    others = []
    for line in _commands(text, source):
        words = shlex.split(_expand(line, env), comments=True)
        if not words:
            continue
        if words[:1] == ["export"]:
            words = words[1:]
        at = next((i for i, w in enumerate(words) if _SWIFT.search(w) or _SCRIPT.search(w)), None)
        head = words if at is None else words[:at]
        env.update(m.groups() for m in map(_ASSIGN.match, head) if m)
        if words[:1] == ["megatron"]:
            raise ImportError_(source, "command", "megatron (Megatron-SWIFT) runs Megatron-Core, which this importer "
                               "does not read; write the spec with stack megatron and its parallel section")
        if at is None:
            continue
        script = _SCRIPT.search(words[at])
        if script:  # a launcher runs swift/cli/<sub>.py
            sub, args = script.group(1), words[at + 1:]
        else:
            sub, args = (words[at + 1] if at + 1 < len(words) else ""), words[at + 2:]
        _launcher(head, env)
        if sub not in COMMANDS:
            others.append(sub)
            continue
        cfg: dict = {}
        if args and args[0].endswith((".yaml", ".yml", ".json")):
            if read_file is None:
                raise ImportError_(source, "command", f"{args[0]}: a config file named on the command line; "
                                   "pass it with --recipe")
            path = args[0] if os.path.isabs(args[0]) or base_dir is None else os.path.join(base_dir, args[0])
            cfg.update(read_file(path))
            args = args[1:]
        cfg.update(_flags(args, source))
        return cfg, sub, env
    found = f" (it runs swift {', '.join(sorted(set(others)))}, no training)" if others else ""
    raise ImportError_(source, "command", f"no `swift sft`, `swift pt` or `swift rlhf` command in it{found}")


def _commands(text: str, source: str) -> list[str]:
    """The script's commands: continuation lines joined, a line whose quote is still open
    joined with the next ones."""
    out, pending = [], ""
    for line in re.sub(r"\\\r?\n", " ", text).splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:
            continue  # an open quote: the value goes on in the next line
        out.append(pending)
        pending = ""
    if pending.strip():
        raise ImportError_(source, "command", f"a quote is never closed: {pending.strip()[:80]!r}")
    return out


_ARITH = re.compile(r"\$\(\((.*?)\)\)|\$\(expr ([^()]*)\)")
_INT_EXPR = re.compile(r"[\d\s+*/%()-]+")


def _expand(line: str, env: dict) -> str:
    """`$X` and `${X}` from the script's own assignments (an unknown one is left as written),
    then the integer arithmetic the examples use for accumulation (`$(expr 16 / $n)`,
    `$((16 / n))`), evaluated when every operand is a number."""
    line = _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), line)

    def arith(m):
        expr = m.group(1) if m.group(1) is not None else m.group(2).replace("\\*", "*")
        expr = re.sub(r"\b([A-Za-z_][A-Za-z0-9_]*)\b", lambda v: env.get(v.group(1), v.group(0)), expr)
        if not _INT_EXPR.fullmatch(expr):
            return m.group(0)
        try:  # shell arithmetic: integers, truncating division
            return str(_int_value(ast.parse(expr.replace("/", "//").strip(), mode="eval").body))
        except (SyntaxError, ZeroDivisionError, ValueError):
            return m.group(0)
    return _ARITH.sub(arith, line)


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def _int_value(node) -> int:
    """An integer expression's value (numbers, + - * // %, unary minus); anything else is a ValueError."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_int_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_int_value(node.left), _int_value(node.right))
    raise ValueError("not an integer expression")


def _launcher(head: list[str], env: dict) -> None:
    """torchrun / accelerate launch flags before the entry: the process count per node and nodes."""
    for k, word in enumerate(head):
        name, eq, value = word.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if word.startswith("--") and name in _LAUNCH:
            env[_LAUNCH[name]] = value if eq else (head[k + 1] if k + 1 < len(head) else "")


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
