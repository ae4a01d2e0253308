"""What an importer did with each field of a config file: used, ignored, unresolved."""
from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.i18n import Msg


class ImportError_(ValueError):
    """A malformed config file; the message names the file and the field."""


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
