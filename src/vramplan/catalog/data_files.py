"""The catalog's data files, read from the package folder with open() (importlib.resources
costs ~10 ms of imports at every CLI start) or, where the package is not a folder on disk
(the web page's static build imports vramplan from a zip, tests/test_web_api.py), through
importlib.resources."""
from __future__ import annotations

import json
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_ON_DISK = os.path.isdir(_HERE)


def _node(parts: tuple[str, ...]):
    from importlib import resources
    node = resources.files("vramplan.catalog")
    for part in parts:
        node = node.joinpath(part)
    return node


def read_json(*parts: str) -> object:
    """catalog/<parts...> parsed."""
    if _ON_DISK:
        with open(os.path.join(_HERE, *parts), encoding="utf-8") as fh:
            return json.load(fh)
    return json.loads(_node(parts).read_text(encoding="utf-8"))


def json_names(folder: str) -> list[str]:
    """The .json file names in catalog/<folder>, sorted."""
    if _ON_DISK:
        names = os.listdir(os.path.join(_HERE, folder))
    else:
        names = [entry.name for entry in _node((folder,)).iterdir()]
    return sorted(n for n in names if n.endswith(".json"))


def has_file(*parts: str) -> bool:
    """Whether catalog/<parts...> is a file."""
    if _ON_DISK:
        return os.path.isfile(os.path.join(_HERE, *parts))
    return _node(parts).is_file()


__all__ = ["has_file", "json_names", "read_json"]
