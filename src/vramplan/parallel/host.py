"""Host (CPU RAM) check when anything is offloaded: the ranks of one node share its RAM.

The per-rank host terms come from plan._host (DeepSpeed offload_optimizer / offload_param,
FSDP CPUOffload). A node runs `gpus_per_node` ranks (parallel.extras.gpus_per_node, default
8, at most num_gpus), each holding its own partition in host memory, so the node needs
ranks_per_node x per-rank host bytes (DeepSpeed's own estimator multiplies the same way:
deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs, cpu_mem =
total_params * max(4 * num_gpus_per_node, 18 * ...) with cpu offload; stage_1_and_2.py
estimate_zero2_model_states_mem_needs: cpu_mem = total_params * max(4 * gpus_per_node, 16)).

The machine's RAM is the spec field parallel.extras.host_memory_bytes. The core never reads
the machine: `resolve_local` (called by the edge, vramplan.estimation.estimate) turns the
value "local" into this machine's physical memory via os.sysconf.
"""
from __future__ import annotations

import os
from dataclasses import replace

from vramplan.parallel.layout import Layout
from vramplan.i18n import Msg
from vramplan.units import GiB


def local_memory_bytes() -> int | None:
    """Physical RAM of this machine (POSIX sysconf SC_PHYS_PAGES x SC_PAGE_SIZE)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def resolve_local(spec):
    """The spec with parallel.extras.host_memory_bytes = "local" replaced by this machine's
    RAM (an edge: reads the machine). Other specs are returned unchanged."""
    extras = spec.parallel.extras
    if str(extras.get("host_memory_bytes", "")).lower() not in ("local", "auto"):
        return spec
    value = local_memory_bytes()
    new = {k: v for k, v in extras.items() if k != "host_memory_bytes"}
    if value is not None:
        new["host_memory_bytes"] = value
    return replace(spec, parallel=replace(spec.parallel, extras=new))


def offloaded(lay: Layout) -> bool:
    return lay.offload_optimizer != "none" or lay.offload_params != "none"


def host_per_node(lay: Layout, per_rank: int) -> int:
    return lay.gpus_per_node * per_rank


def host_notes(lay: Layout, per_rank: int) -> list[str]:
    """One note when anything is offloaded: the node's host need and whether the RAM suffices."""
    if not offloaded(lay):
        return []
    ranks = lay.gpus_per_node
    need = host_per_node(lay, per_rank)
    head = Msg("host memory: offload needs {per_rank:,.2f} GiB per rank x {ranks} ranks per node = {need:,.2f} GiB "
               "per node (offloaded states and buffers only; each process's own footprint comes on top)",
               per_rank=per_rank / GiB, ranks=ranks, need=need / GiB)
    ram = lay.extras.get("host_memory_bytes")
    if ram in (None, "", "local", "auto"):
        return [Msg("{head}; set parallel.extras.host_memory_bytes (or \"local\") to check it against the machine's RAM",
                    head=head)]
    ram = int(ram)
    if need <= ram:
        return [Msg("{head}; fits in {ram:,.2f} GiB of host RAM ({left:,.2f} GiB left)", head=head, ram=ram / GiB,
                    left=(ram - need) / GiB)]
    return [Msg("{head}; does NOT fit in {ram:,.2f} GiB of host RAM (short by {short:,.2f} GiB)", head=head,
                ram=ram / GiB, short=(need - ram) / GiB)]
