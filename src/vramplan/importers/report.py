"""What an importer did with each field of a config file: used, ignored, unresolved."""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.i18n import Msg
from vramplan.spec import SpecError


class ImportError_(SpecError):
    """A malformed config file: `source: field: what is wrong and the fix`; `field` is the
    config file's own key (e.g. `zero_optimization.stage`)."""

    def __init__(self, source: str, field_name: str | None = None, message: str | None = None):
        if message is None:  # one preformatted line naming the file
            ValueError.__init__(self, source)
            self.field = field_name or "config"
            return
        ValueError.__init__(self, f"{source}: {field_name}: {message}")
        self.field = field_name


def need_int(rep: "ImportReport", name: str, value, *, minimum: int = 1) -> int:
    """A count from a config file: an int (not a bool, string or float)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ImportError_(rep.source, name, f"expected an integer >= {minimum}, got {value!r}")
    return value


def need_bool(rep: "ImportReport", name: str, value) -> bool:
    """A switch from a config file: true or false, not the string "false" (which is true)."""
    if not isinstance(value, bool):
        hint = "; write true or false without quotes" if isinstance(value, str) else ""
        raise ImportError_(rep.source, name, f"expected true or false, got {value!r}{hint}")
    return value


def need_mapping(rep: "ImportReport", name: str, value) -> dict:
    """A nested section: a mapping (missing or null is an empty one)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ImportError_(rep.source, name, f"expected a mapping of settings, got {value!r}")
    return value


@dataclass(slots=True)
class ImportReport:
    source: str
    used: dict[str, str] = field(default_factory=dict)
    """field -> the spec key it set."""
    ignored: list[str] = field(default_factory=list)
    """Fields with no memory effect, or none vramplan models."""
    unresolved: dict[str, str] = field(default_factory=dict)
    """field -> why its value could not be turned into a spec value."""

    def use(self, name: str, target: str) -> None:
        self.used[name] = target

    def lines(self) -> list[str]:
        # Msg: English text the CLI can print translated (vramplan.i18n.tr)
        out = [Msg("{source}: used {used}, ignored {ignored}, unresolved {unresolved}", source=self.source,
                   used=len(self.used), ignored=len(self.ignored), unresolved=len(self.unresolved))]
        out += [Msg("  used {field} -> {key}", field=k, key=v) for k, v in self.used.items()]
        out += [Msg("  unresolved {field}: {why}", field=k, why=v) for k, v in self.unresolved.items()]
        if self.ignored:
            out.append(Msg("  ignored {fields}", fields=", ".join(self.ignored)))
        return out


def flatten(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def merge(into: dict, overrides: dict) -> dict:
    """Deep-merge spec overrides (the parallel / lora sections merge key by key)."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into
