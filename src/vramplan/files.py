"""Reading YAML/JSON files into mappings: one reader for spec files and engine configs."""
from __future__ import annotations

import json
import os


class FileReadError(ValueError):
    """One line naming the file and what is wrong with it."""


def read_mapping(path: str) -> dict:
    """A JSON (by extension) or YAML file holding a mapping."""
    if not os.path.isfile(path):
        raise FileReadError(f"{path}: file not found")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text)
    except Exception as exc:  # both parsers' errors become one line naming the file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FileReadError(f"{path}: not valid JSON/YAML ({first})") from None
    if not isinstance(data, dict):
        raise FileReadError(f"{path}: expected a mapping at the top level")
    return data
