"""Activation offloading to CPU (torchtune's OffloadActivations).

torchtune 0.6 torchtune/training/_activation_offloading.py: a `saved_tensors_hooks` pair
around the model's forward (the recipe's `with self.activations_handling_ctx:`). Its pack
hook copies every saved tensor of at least `min_offload_size` (1024) bytes that is not an
nn.Parameter or nn.Buffer into pinned CPU memory, and the device tensor goes when nothing
else holds it; smaller tensors stay as they are. The output head runs under NoOpManager
(get_act_offloading_ctx_manager hooks `model.output`), and the loss runs outside the
context, so what the head's linear and the loss save stays on the device. In backward the
unpack hook copies each tensor back just before the node that needs it: a stage's saved
tensors are on the device again at that stage's backward, and not before.
"""
from __future__ import annotations

MIN_OFFLOAD_BYTES = 1024
"""OffloadActivations(min_offload_size=1024): smaller saved tensors are not moved."""


def device_resident(items: list[tuple[str, int]], keep: tuple[str, ...] = ()) -> list[tuple[str, int]]:
    """What of a stage's saved tensors (name, bytes) stays on the device between its forward
    and its backward: those under MIN_OFFLOAD_BYTES and those named in `keep` (saved outside
    the offloading context: the output head's linear)."""
    return [(name, size) for name, size in items if size < MIN_OFFLOAD_BYTES or name in keep]


MAX_FWD_STASH = 5
"""OffloadActivations(max_fwd_stash_size=5): with streams (the default) the device tensor of
each offloaded save is held until 5 more tensors have been packed, so the last ones packed
in forward are still on the device when forward ends; the first backward node's hook drops
them."""


def forward_stash(stages: list[list[tuple[str, int]]], keep: tuple[str, ...] = ()) -> int:
    """Bytes of the offloaded saves still held at the end of forward: those among the last
    MAX_FWD_STASH saves (forward order, the head's own excepted) that were offloaded."""
    saves = [(name, size) for items in stages for name, size in items if name not in keep]
    return sum(size for _, size in saves[-MAX_FWD_STASH:] if size >= MIN_OFFLOAD_BYTES)
