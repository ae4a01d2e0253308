"""Which storages are live at a peak: grouped summaries and raw lists.

A ``Trace`` holds the meter's snapshots: ``peak`` (global peak), one per phase
(``s2.bwd`` ...: the live set when that phase peaked) and the marks
(``end_of_forward``).  Each storage carries its size, dtype, shape, creating
aten op, the nn.Module path active at creation and, in backward, the
autograd node that created it.  Grouping replaces layer indices by ``*``.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from .meter import MemoryMeter, Snapshot, StorageInfo

_LAYER = re.compile(r"\.(\d+)(?=\.|$)")


def module_pattern(path: str) -> str:
    """'base_model.model.model.layers.3.mlp.up_proj' -> '...layers.*.mlp.up_proj'."""
    return _LAYER.sub(".*", path)


def layer_index(path: str) -> str:
    m = re.search(r"layers?\.(\d+)|\.h\.(\d+)", path)
    return next((g for g in m.groups() if g is not None), "") if m else ""


def where(info: StorageInfo) -> str:
    """Module path, else the autograd node (backward), else the phase."""
    if info.module:
        return info.module + (f" <{info.node}>" if info.node else "")
    return f"<{info.node}>" if info.node else f"({info.phase or 'before phases'})"


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass
class Group:
    bytes: int = 0
    count: int = 0


@dataclass
class Trace:
    snapshots: dict[str, Snapshot]

    @classmethod
    def from_meter(cls, meter: MemoryMeter) -> "Trace":
        snaps = dict(meter.snapshots)
        snaps.update(meter.marks)
        return cls(snaps)

    def names(self) -> list[str]:
        return list(self.snapshots)

    # ------------------------------------------------------------- grouping
    def by_category(self, name: str) -> dict[str, Group]:
        snap = self.snapshots[name]
        out: dict[str, Group] = defaultdict(Group)
        for info in snap.storages:
            g = out[snap.category(info)]
            g.bytes += info.nbytes
            g.count += 1
        return dict(out)

    def grouped(self, name: str) -> list[tuple[tuple, Group]]:
        """(category, module pattern, op, dtype, shape) -> bytes, count; largest first."""
        snap = self.snapshots[name]
        out: dict[tuple, Group] = defaultdict(Group)
        for info in snap.storages:
            key = (snap.category(info), module_pattern(where(info)), info.op, info.dtype, info.shape)
            out[key].bytes += info.nbytes
            out[key].count += 1
        return sorted(out.items(), key=lambda kv: -kv[1].bytes)

    def by_layer(self, name: str, category: str = "other") -> dict[str, int]:
        """Bytes of one category per layer index ('' = outside any layer)."""
        snap = self.snapshots[name]
        out: dict[str, int] = defaultdict(int)
        for info in snap.storages:
            if snap.category(info) == category:
                out[layer_index(info.module)] += info.nbytes
        return dict(out)

    def raw(self, name: str) -> list[dict]:
        snap = self.snapshots[name]
        rows = [dict(nbytes=i.nbytes, dtype=i.dtype, shape=list(i.shape), op=i.op,
                     module=i.module, node=i.node, phase=i.phase, category=snap.category(i))
                for i in snap.storages]
        return sorted(rows, key=lambda r: -r["nbytes"])

    # ------------------------------------------------------------ rendering
    def render(self, name: str, limit: int = 60, min_bytes: int = 0) -> str:
        snap = self.snapshots[name]
        lines = [f"== {name} ({snap.label}): {snap.total_bytes} B = {fmt_bytes(snap.total_bytes)}, "
                 f"{len(snap.storages)} storages =="]
        for cat, g in sorted(self.by_category(name).items(), key=lambda kv: -kv[1].bytes):
            lines.append(f"  {cat:16s} {g.bytes:>14d}  {fmt_bytes(g.bytes):>11s}  x{g.count}")
        lines.append(f"  {'category':16s} {'where (module / <autograd node>)':58s} {'op':28s} "
                     f"{'dtype':9s} {'shape':22s} {'count':>5s} {'bytes':>13s}")
        shown = 0
        for (cat, mod, op, dtype, shape), g in self.grouped(name):
            if g.bytes < min_bytes or shown >= limit:
                continue
            shown += 1
            lines.append(f"  {cat:16s} {mod[-58:]:58s} {op[:28]:28s} {dtype:9s} "
                         f"{str(list(shape))[:22]:22s} {g.count:>5d} {g.bytes:>13d}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {n: {"label": s.label, "total_bytes": s.total_bytes, "storages": self.raw(n)}
                for n, s in self.snapshots.items()}
