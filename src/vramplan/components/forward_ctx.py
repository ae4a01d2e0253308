"""The context a decoder's symbolic forward replays with (components/arch.py Ctx): the
parameters by name as the forward sees them, the LoRA adapters by wrapped module, and the
run's settings (dropout, DoRA, dtypes, attention)."""
from __future__ import annotations

from vramplan.components.arch import Ctx
from vramplan.components.dtypes import dtypes_of
from vramplan.components.graph import Param
from vramplan.components.trainable import ParamSet
from vramplan.model import ModelDesc
from vramplan.spec import Checkpointing, JobSpec


def build_ctx(desc: ModelDesc, spec: JobSpec, params: ParamSet) -> Ctx:
    table, lora = _param_tables(params)
    # transformers: use_gqa_in_sdpa -> enable_gqa when there is no attention mask (no
    # padding, no packing) and head_dim <= 256 (integrations/sdpa_attention.py).
    gqa_native = not spec.packing and desc.head_dim <= 256
    # TRL's disable_dropout sets every nn.Dropout's p to 0: lora_dropout and the model's own
    # (trl/trainer/utils.py disable_dropout_in_model); F.dropout with p = 0 returns its input.
    # An attention dropout passed as a config float is no module and still drops (Ctx.module_dropout)
    off = spec.disable_dropout is True
    ctx = Ctx(desc=desc, params=table, lora=lora, module_dropout=not off,
               lora_dropout=spec.lora.dropout if spec.lora and not off else 0.0,
               lora_dropout_module=bool(spec.lora and spec.lora.dropout > 0),
               dora=bool(spec.lora and spec.lora.use_dora),
               act_dtype=dtypes_of(spec).weights if spec.method.value != "qlora"
               else spec.quantization.compute_dtype,
               attention=spec.attention.value, gqa_native=gqa_native, packed=spec.packing,
               checkpointed=spec.gradient_checkpointing is Checkpointing.FULL)
    ctx.shared_keys["param_set"] = params
    return ctx


_TABLES: dict[int, tuple[ParamSet, dict, dict]] = {}


def _param_tables(params: ParamSet) -> tuple[dict[str, Param], dict[str, tuple[Param, Param]]]:
    """Parameters by name as the forward sees them, and LoRA (A, B) by wrapped module; read
    only, so memoized per (immutable, memoized) ParamSet."""
    hit = _TABLES.get(id(params))
    if hit is not None and hit[0] is params:
        return hit[1], hit[2]
    table: dict[str, Param] = {}
    lora: dict[str, list[Param]] = {}
    for p in params.params:
        if p.kind == "lora":
            module, _ = p.name.rsplit(".", 1)
            lora.setdefault(module, []).append(Param(p.name, p.shape, p.dtype, True))
        elif p.kind == "saved_copy":
            name = p.name.split("#", 1)[0]
            table[name] = Param(name, p.shape, p.dtype, True)
        elif p.name not in table:
            table[p.name] = Param(p.name, p.shape, p.dtype, p.trainable)
    pairs = {m: (ab[0], ab[1]) for m, ab in lora.items()}
    if len(_TABLES) >= 64:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[id(params)] = (params, table, pairs)
    return table, pairs
