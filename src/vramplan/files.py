"""Reading YAML/JSON files into mappings: one reader for spec files and engine configs.

Input is untrusted: a file is read only up to MAX_BYTES, YAML goes through the safe loader
with duplicate keys refused and alias expansion bounded (a "billion laughs" document,
a few hundred bytes of nested `*alias` references, otherwise expands to billions of nodes
in whatever walks it), and JSON objects refuse duplicate keys too.
"""
from __future__ import annotations

import json
import os

MAX_BYTES = 4 * 2**20
"""Largest spec or engine config read (4 MiB); real ones are a few KiB."""
MAX_NODES = 100_000
"""Largest YAML document, counted with every alias expanded."""


class FileReadError(ValueError):
    """One line naming the file and what is wrong with it."""


def read_document(path: str, *, json_only: bool = False):
    """What a JSON (by extension, or always with `json_only`) or YAML file holds."""
    text = _read_text(path)
    return _json(path, text) if json_only or path.endswith(".json") else _yaml(path, text)


def read_text(path: str) -> str:
    """A text file (UTF-8, at most MAX_BYTES): a shell script holding a training command."""
    return _read_text(path)


def read_mapping(path: str, *, json_only: bool = False) -> dict:
    """A JSON (by extension, or always with `json_only`) or YAML file holding a mapping."""
    data = read_document(path, json_only=json_only)
    if not isinstance(data, dict):
        kind = "nothing" if data is None else f"a {type(data).__name__}"
        raise FileReadError(f"{path}: expected a mapping (key: value lines) at the top level, found {kind}")
    return data


def _read_text(path: str) -> str:
    if os.path.isdir(path):
        raise FileReadError(f"{path}: is a folder; pass the YAML/JSON file inside it")
    if not os.path.isfile(path):
        if path == "-" or os.path.exists(path):  # stdin is not read; /dev/null, a pipe, a socket
            raise FileReadError(f"{path}: not a regular file; pass the path of a YAML/JSON file")
        raise FileReadError(f"{path}: file not found")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise FileReadError(f"{path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > MAX_BYTES:
        raise FileReadError(f"{path}: larger than {MAX_BYTES // 2**20} MiB; a spec or engine config is a few KiB")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FileReadError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML or JSON") from None


def _no_duplicates(path: str):
    def hook(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise FileReadError(f"{path}: duplicate key {key!r}; keep one")
            out[key] = value
        return out
    return hook


def _json(path: str, text: str):
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(path))
    except FileReadError:
        raise
    except (ValueError, RecursionError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FileReadError(f"{path}: not valid JSON ({first})") from None


def _yaml(path: str, text: str):
    import yaml
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # its reader refuses control characters already
        node = loader.get_single_node()
        if node is None:
            return None
        _check_node(path, node)
        return loader.construct_document(node)
    except FileReadError:
        raise
    except RecursionError:
        raise FileReadError(f"{path}: nested too deeply to be a spec or engine config") from None
    except (yaml.YAMLError, ValueError, TypeError) as exc:
        # the parser's errors, and the constructor's on e.g. an unhashable key
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        where = f"line {mark.line + 1}: {problem}" if mark is not None and problem else first
        raise FileReadError(f"{path}: not valid YAML ({where})") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_node(path: str, root) -> None:
    """Refuse duplicate keys, self-referencing aliases and documents that expand past
    MAX_NODES (sizes memoised per node, so the check itself stays linear)."""
    import yaml
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise FileReadError(f"{path}: an alias refers to itself (a recursive document); write the value out")
        open_.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in seen:
                        raise FileReadError(f"{path}: duplicate key {k.value!r} (line {k.start_mark.line + 1}); keep one")
                    seen.add(k.value)
                total += size(k) + size(v)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(v) for v in node.value)
        open_.discard(key)
        if total > MAX_NODES:
            raise FileReadError(f"{path}: expands to more than {MAX_NODES:,} values (YAML aliases nested "
                                "too deep?); write the values out")
        sizes[key] = total
        return total

    size(root)
