"""fp8 training named in a config file.

accelerate (1.15, accelerator.py `Accelerator.__init__` / `_prepare_ao`) trains in fp8 through
one of three backends:

  * AO (torchao): `convert_model_to_fp8_ao` (utils/ao.py) runs torchao's
    `convert_to_float8_training` with `AORecipeKwargs().config`, a default
    `Float8LinearConfig` (dynamic tensorwise scaling) with `pad_inner_dim` and
    `enable_fsdp_float8_all_gather` from `fp8_config` (both default true), over every
    nn.Linear whose sides are multiples of 16 except the first and the last nn.Linear of
    the model (`filter_linear_layers`: for a causal LM, layer 0's first projection and
    `lm_head`); the forward runs under bf16 autocast (`native_amp`, utils/modeling.py
    `get_mixed_precision_context_manager`). That is the spec's `float8: tensorwise` with
    precision bf16 (components/float8.py).
  * TE (TransformerEngine): `apply_fp8_autowrap` swaps nn.Linear for `te.Linear` and runs
    the forward in `te.fp8_autocast` with a delayed-scaling recipe (amax history per tensor,
    fp8 weight caches). Its kernels exist only on NVIDIA GPUs, so no CPU measurement can
    check a model of it: refused.
  * MSAMP (MS-AMP): fp8 weights, gradients and optimizer states through `msamp.initialize`
    (or its DeepSpeed fork): GPU-only as well: refused.

With no backend named, accelerate picks AO, TE or MS-AMP by which package is installed, which
a config file does not say: refused until the file names one.
"""
from __future__ import annotations

from vramplan.importers.report import ImportError_, ImportReport, need_bool, need_mapping

GPU_ONLY = ("TransformerEngine and MS-AMP fp8 are not modelled: their kernels run on NVIDIA GPUs only, "
            "so no CPU measurement can check an estimate")

_BACKENDS = {"ao": "AO", "torchao": "AO", "te": "TE", "transformer_engine": "TE", "msamp": "MSAMP"}


def accelerate_fp8(cfg: dict, dist: str, rep: ImportReport) -> dict:
    """`mixed_precision: fp8` of an accelerate config -> spec overrides (precision, float8)."""
    fc = need_mapping(rep, "fp8_config", cfg.get("fp8_config"))
    raw = fc.get("backend")
    if raw is None:
        raise ImportError_(rep.source, "fp8_config.backend", "not set: accelerate then picks torchao, "
                           "TransformerEngine or MS-AMP by what is installed; set fp8_config.backend: AO "
                           "(torchao float8, modelled) or mixed_precision: bf16")
    backend = _BACKENDS.get(str(raw).lower())
    if backend is None:
        raise ImportError_(rep.source, "fp8_config.backend", f"expected AO, TE or MSAMP, got {raw!r}")
    if backend != "AO":
        raise ImportError_(rep.source, "fp8_config.backend", f"{backend}: {GPU_ONLY}; use fp8_config.backend: "
                           "AO (torchao float8) or mixed_precision: bf16")
    if dist not in ("NO", "MULTI_GPU", "FSDP"):
        # utils/modeling.py: bf16 autocast for fp8 only under these distributed types
        raise ImportError_(rep.source, "mixed_precision", f"fp8 with distributed_type {dist} is not modelled; "
                           "use NO, MULTI_GPU or FSDP, or mixed_precision: bf16")
    float8: dict = {"recipe": "tensorwise", "convert_lm_head": False}
    gather = need_bool(rep, "fp8_config.enable_fsdp_float8_all_gather",
                       fc.get("enable_fsdp_float8_all_gather", True))
    fsdp2 = dist == "FSDP" and str(need_mapping(rep, "fsdp_config", cfg.get("fsdp_config"))
                                   .get("fsdp_version", 1)) == "2"
    if gather and fsdp2:
        # torchao/float8/fsdp_utils.py: only FSDP2's fully_shard calls the float8 all-gather hooks
        float8["fsdp_float8_all_gather"] = True
        rep.use("fp8_config.enable_fsdp_float8_all_gather", "float8.fsdp_float8_all_gather")
    elif "enable_fsdp_float8_all_gather" in fc:
        rep.ignored.append("fp8_config.enable_fsdp_float8_all_gather (acts under FSDP2 only)")
    if "pad_inner_dim" in fc:
        # torchao/float8/float8_ops.py: pads (F.pad: a float8 copy) each scaled mm's operands;
        # accelerate's default conversion, padded, measured the same bytes at every phase
        # peak as `float8: tensorwise` (tests/test_importers.py), so it is no separate term
        need_bool(rep, "fp8_config.pad_inner_dim", fc["pad_inner_dim"])
        rep.use("fp8_config.pad_inner_dim", "float8 (the padded copies are float8 transients)")
    rep.use("fp8_config.backend", "float8 (torchao, first and last nn.Linear kept in high precision)")
    # accelerate runs fp8 under the bf16 autocast of `mixed_precision: bf16`, so the same word
    rep.use("mixed_precision", "precision bf16 (as for mixed_precision: bf16) + float8 tensorwise")
    return {"precision": "bf16", "float8": float8}


def refuse_fp8_switch(rep: ImportReport, name: str, value, backend=None) -> None:
    """A recipe's fp8 switch (LLaMA-Factory `fp8`/`fp8_backend`, axolotl `fp8`, torchtune
    `enable_fp8_training`): these builds choose their torchao recipe and layer filter in
    code that changes between versions, or pick TransformerEngine; one line with the fix
    instead of an estimate that leaves the fp8 casts out."""
    if not value:
        return
    if backend is not None and str(backend).lower() in ("te", "msamp", "transformer_engine"):
        raise ImportError_(rep.source, "fp8_backend", f"{backend}: {GPU_ONLY}; use torchao (give --float8) or bf16")
    raise ImportError_(rep.source, name, "fp8 training is read from the spec, not from this recipe: drop "
                       f"{name} here and give the torchao recipe it runs with --float8 (tensorwise, rowwise or "
                       "rowwise-with-gw-hp)")
