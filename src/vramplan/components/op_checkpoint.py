"""torchtitan's per-op selective activation checkpointing: what a layer keeps in forward.

torchtitan wraps each transformer block in torch's checkpoint_wrapper with
`context_fn = create_selective_checkpoint_contexts(policy)` (torchtitan 0.3.0
torchtitan/distributed/activation_checkpoint.py `SelectiveAC._wrap_block`; earlier
releases `_apply_op_sac`, and in 2024 torchtitan/parallelisms/parallelize_llama.py with its
`_save_list`). Under it the block's autograd graph saves nothing; instead torch's SAC
(torch/utils/checkpoint.py `_CachingTorchDispatchMode`) keeps the outputs of the ops the
policy marks MUST_SAVE, and checkpoint keeps the block's inputs for the recomputation. In
backward the block is run again; a kept output is handed back instead of recomputed, so it
is the same storage as the one the recomputed graph saves, and a kept output the graph does
not save is dropped once the recomputation is over.

The policy (`_get_custom_policy`), as it reaches the ops a decoder layer runs:
* `aten.mm` (every Linear without bias: aten::linear is CompositeImplicit and runs mm under
  autograd): counted per block and per pass; odd-numbered ones are kept, "every second mm"
  is recomputed;
* the fused attention kernels `_scaled_dot_product_flash_attention`, `_efficient_attention`
  and cuDNN's: kept (all outputs: the attention output and its log-sum-exp). CPU's
  `_scaled_dot_product_flash_attention_for_cpu` is on no list, so on CPU attention is
  recomputed;
* torch's `get_default_op_list().compute_intensive_ops` (torchtitan 0.3.0 adds them to its
  list): `addmm` (a Linear with bias) and `bmm` (eager attention's matmuls, fused experts)
  are kept, uncounted. torchtitan <= 0.2 kept mm and the attention kernels only;
* everything else (norms, rotary, activations, casts, views): recomputed.
Collectives (reduce_scatter, all_to_all) and `max` (float8 scaling) are on the list too;
single-device layers run none.
"""
from __future__ import annotations

from vramplan.components.graph import Recorder, Sym

# ops kept whatever their position; "mm" is kept when its count in the block is odd
KEPT_OPS = frozenset({"addmm", "bmm", "sdpa_flash", "sdpa_efficient"})
"""torchtitan 0.3.0 `_get_default_save_ops` as the recorder names the ops it logs."""


def kept_outputs(rec: Recorder) -> dict[int, Sym]:
    """The outputs SAC keeps in forward, by storage, from the recorder's op log."""
    kept: dict[int, Sym] = {}
    mm_count = 0
    for op, outputs in rec.ops or ():
        if op == "mm":
            mm_count += 1
            if mm_count % 2 == 0:  # `func in mm_ops and meta[mm_count_key] % 2 == 0`: recompute
                continue
        elif op not in KEPT_OPS:
            continue
        for t in outputs:
            kept.setdefault(id(t.storage), t)
    return kept


def split_layer(rec: Recorder, layer_input: Sym) -> tuple[list, list, tuple]:
    """(kept in forward, saved again by the recomputation, names gone at the layer's backward
    peak) for one block replayed on `rec` (with its op log) from `layer_input`."""
    kept = kept_outputs(rec)
    inp = id(layer_input.storage)
    keep = [("checkpoint/layer_input", layer_input.storage.nbytes)]
    keep += [(f"op_saved/{t.name}", t.storage.nbytes) for key, t in kept.items() if key != inp]
    redo = [(name, st.nbytes) for key, (name, st) in rec.saved.items()
            if key not in kept and key != inp and not name.startswith("rotary/")]
    # a kept output the recomputed graph does not save (q_proj's output before rotary, the
    # MLP's down projection) is dropped when the recomputation has handed it on
    dropped = tuple(f"op_saved/{t.name}" for key, t in kept.items() if key != inp and key not in rec.saved)
    return keep, redo, dropped
