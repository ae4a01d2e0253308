"""Checks of a job against its model: what cannot run is a SpecError naming the field; what
runs but is suspicious is a note (Estimate.notes, printed as `note:` by the CLI).

Each refusal is one the real library makes when the job starts (cited at each check), so
vramplan never prints a number for a job that cannot run. Pure: spec and model in, no I/O.
"""
from __future__ import annotations

from vramplan.i18n import Msg
from vramplan.model import ModelDesc, PositionKind
from vramplan.spec import DEFAULT_SEQ_LEN, JobSpec, Method, SpecError, Task
from vramplan.spec.grpo import GROUP_TASKS
from vramplan.spec.tasks import needs_several_models

MAX_DEVICE_BYTES = 2**50
"""1 PiB: thousands of times any GPU's memory; an estimate beyond it is a unit slip."""
LARGE_TOKENS = 2**22
"""Tokens per GPU per micro-step beyond which a note asks whether the size is meant."""


def check_job(desc: ModelDesc, spec: JobSpec) -> list[str]:
    """Raise SpecError for a job the libraries refuse; return notes for suspicious ones."""
    notes: list[str] = []
    notes += _positions(desc, spec)
    notes += _repository_code(desc, spec)
    notes += _trainable(desc, spec)
    if not spec.parallel.is_trivial or spec.num_gpus > 1:
        notes += _parallel(desc, spec)
    if spec.backend.value == "cpu" and spec.optimizer.value.startswith("paged-"):
        notes.append(Msg("optimizer: bitsandbytes has no paged optimizers on CPU (it warns and keeps the "
                         "states as plain tensors); {name} is counted unpaged", name=spec.optimizer.value))
    if spec.parallel.sp and spec.parallel.tp == 1:
        notes.append(Msg("parallel.sp: sequence parallelism splits activations over the tp group, and tp is 1; "
                         "Megatron turns it off (arguments.py), so it saves nothing here: set parallel.tp >= 2"))
    notes += lengths_unreplayed(spec)
    tokens = spec.micro_batch_size * spec.seq_len // (spec.parallel.cp * spec.parallel.ulysses)
    if tokens > LARGE_TOKENS:
        notes.append(Msg("absurd size? micro_batch_size x seq_len = {tokens:,} tokens per GPU per "
                         "micro-step; check the units of micro_batch_size and seq_len", tokens=tokens))
    return notes


def lengths_unreplayed(spec: JobSpec) -> list:
    """The padded-lengths replay runs on the single-model step only (estimation.py): a job of
    several models (or a VLM) is estimated with every row at seq_len, the longest a batch is
    padded to, whose step is the peak; the note says so."""
    if spec.lengths is None or not needs_several_models(spec):
        return []
    return [Msg("lengths: the padded-lengths replay covers single-model language jobs; this one is "
                "estimated with every row at seq_len {seq_len}, the longest a batch is padded to", seq_len=spec.seq_len)]


def check_size(device_bytes: int, spec: JobSpec) -> None:
    """An estimate past MAX_DEVICE_BYTES is refused: no GPU holds it, and such sizes come
    from a slip (seq_len 1e12) rather than a plan."""
    if device_bytes <= MAX_DEVICE_BYTES:
        return
    field = "seq_len" if spec.seq_len >= spec.micro_batch_size else "micro_batch_size"
    if spec.task is Task.DIFFUSION and spec.micro_batch_size <= 2**20:  # it blamed `model` and seq_len
        raise SpecError("diffusion", f"this job needs {device_bytes / 2**50:,.0f} PiB per GPU, beyond any GPU "
                        "(the largest hold a few hundred GB); lower diffusion.height, width or num_frames")
    if spec.seq_len * spec.micro_batch_size <= 2**20:
        field = "model" if spec.model is not None else "num_params"
        if spec.num_labels > 2**20 and spec.task is Task.SEQUENCE_CLASSIFICATION:
            field = "num_labels"
        elif spec.lora is not None and spec.method in (Method.LORA, Method.QLORA) and spec.lora.r > 2**16:
            field = "lora.r"
        elif spec.generation is not None and (spec.generation.generation_batch_size or 0) > 2**20:
            field = "generation.generation_batch_size"
        elif (spec.max_new_tokens or 0) > 2**20:  # the completion's KV cache and logits (was `model`)
            field = "max_new_tokens"
        elif spec.lengths is not None and (spec.lengths.pad_to_multiple_of or 0) > 2**20:  # fuzz: was `model`
            field = "lengths.pad_to_multiple_of"
        elif spec.task in GROUP_TASKS and spec.micro_batch_size * spec.grad_accum_steps > 2**20:
            field = "grad_accum_steps"  # GRPO/RLOO generate micro_batch_size x grad_accum_steps rows (was `model`)
    fix = ("lower it" if field in ("num_labels", "lora.r", "generation.generation_batch_size", "max_new_tokens",
                                   "lengths.pad_to_multiple_of", "grad_accum_steps")
           else "lower micro_batch_size or seq_len, or shard more")
    raise SpecError(field, f"this job needs {device_bytes / 2**50:,.0f} PiB per GPU, beyond any GPU "
                    f"(the largest hold a few hundred GB); {fix}")


def assume_seq_len(desc: ModelDesc, spec: JobSpec) -> JobSpec:
    """A seq_len the user did not give (DEFAULT_SEQ_LEN) capped at the model's learned
    positions, which no row can pass (see _positions); rotary models keep the default."""
    room = desc.max_position_embeddings - (spec.max_new_tokens or 0)
    if (spec.seq_len_given or desc.position is not PositionKind.LEARNED or spec.model is None
            or not desc.max_position_embeddings or not 1 <= room < spec.seq_len):
        return spec
    from dataclasses import replace
    return replace(spec, seq_len=room)


def _positions(desc: ModelDesc, spec: JobSpec) -> list[str]:
    limit = desc.max_position_embeddings
    length = spec.seq_len + (spec.max_new_tokens or 0)
    if not spec.seq_len_given and spec.seq_len < DEFAULT_SEQ_LEN and length == limit and spec.model is not None:
        # assume_seq_len capped the default: say which length the answer is for, and why
        return [Msg("seq_len: not given; assumed {n:,}, as {model}'s {limit:,} learned positions "
                    "(max_position_embeddings) do not reach the default {default:,}; pass seq_len to choose",
                    n=spec.seq_len, model=desc.name, limit=limit, default=DEFAULT_SEQ_LEN)]
    if not limit or length <= limit or spec.model is None:  # a raw size has no position table
        return []
    what = (Msg("{n:,} tokens", n=length) if not spec.max_new_tokens
            else Msg("seq_len + max_new_tokens = {n:,}", n=length))
    if desc.position is PositionKind.LEARNED:
        # GPT-2's wpe / BERT's position_embeddings are nn.Embedding(max_positions, h): a
        # position past the table is an index error (a device-side assert on CUDA).
        room = limit - (spec.max_new_tokens or 0)  # was "use seq_len <= 1,024" for a 512-token prompt
        field, use = ("seq_len", f"seq_len <= {room:,}") if room >= 1 else (
            "max_new_tokens", f"max_new_tokens <= {limit - spec.seq_len:,}" if limit > spec.seq_len
            else f"seq_len + max_new_tokens <= {limit:,}")
        raise SpecError(field, f"{what} are past {desc.name}'s {limit:,} learned "
                        f"positions (max_position_embeddings); use {use}")
    return [Msg("seq_len: {what} are past {model}'s max_position_embeddings {limit:,}: "
                "rotary positions run, but the model was not trained that long (rope_scaling?)",
                what=what, model=desc.name, limit=limit)]


def _repository_code(desc: ModelDesc, spec: JobSpec) -> list[str]:
    """What the repository code of InternLM2 and Baichuan 2 (families/internlm2, baichuan)
    decides itself, whatever the job says."""
    own = getattr(desc, "attn_implementation", "")
    if desc.model_type == "internlm2" and own and own != spec.attention.value:
        # modeling_internlm2.py: INTERNLM2_ATTENTION_CLASSES[config.attn_implementation]
        return [Msg("attention: {model} runs the attention its config.json names (attn_implementation: "
                    "{own}), not {job}; set attn_implementation there to change it",
                    model=desc.name, own=own, job=spec.attention.value)]
    if desc.model_type == "baichuan" and getattr(desc, "alibi", False):
        # modeling_baichuan.py (13B) BaichuanAttention: xops.memory_efficient_attention when
        # xformers imports, else torch matmuls that keep two (b, a, s, s) matrices per layer
        return [Msg("attention: {model} is estimated on its path without xformers (two batch x heads x "
                    "seq_len x seq_len matrices kept per layer); with xformers installed its code uses "
                    "memory_efficient_attention, which is not modelled yet", model=desc.name)]
    return []


def _trainable(desc: ModelDesc, spec: JobSpec) -> list[str]:
    if spec.low_rank is not None and spec.task is not Task.INFERENCE:
        _low_rank(desc, spec)
    if spec.method is Method.FREEZE and spec.freeze is not None and spec.task is not Task.INFERENCE:
        return _freeze(desc, spec)
    if spec.method in (Method.LORA, Method.QLORA) and spec.lora is not None:
        return _lora(desc, spec)
    return []


def _freeze(desc: ModelDesc, spec: JobSpec) -> list[str]:
    cfg, L = spec.freeze, desc.num_layers
    for i in cfg.trainable_layers:
        if not -L <= i < L:
            raise SpecError("freeze.trainable_layers", f"{i} is not a layer of {desc.name} "
                            f"(0..{L - 1}, or -{L}..-1 from the end)")
    notes = []
    for name in cfg.trainable_modules:
        if not any(name in p.name for p in desc.params):
            notes.append(Msg("freeze.trainable_modules {name} matches no parameter of {model}; it trains nothing",
                             name=repr(name), model=desc.name))
    if not cfg.trainable_layers and len(notes) == len(cfg.trainable_modules):
        # torch.optim.Optimizer.__init__: "optimizer got an empty parameter list".
        raise SpecError("freeze", f"trains nothing of {desc.name}: name trainable_layers, or "
                        "trainable_modules that are parts of parameter names (e.g. 'lm_head', 'norm')")
    return notes


def _low_rank(desc: ModelDesc, spec: JobSpec) -> None:
    """transformers/trainer_optimizer.py `_setup_low_rank_optimizer` raises "No target
    modules found for galore_adamw" when no nn.Linear matches optim_target_modules."""
    from vramplan.components.optimizer_projected import targets_linear
    from vramplan.components.trainable import is_linear
    targets = spec.low_rank.target_modules
    linears = [p.module for p in desc.params if is_linear(p)]
    if not any(targets_linear(targets, m) for m in linears):
        names = sorted({m.rsplit(".", 1)[-1] for m in linears})
        raise SpecError("low_rank.target_modules", f"{', '.join(targets)} match no linear module of {desc.name} "
                        f"(transformers refuses the optimizer); name some ({', '.join(names[:12])}) or all-linear")


def _lora(desc: ModelDesc, spec: JobSpec) -> list[str]:
    from vramplan.components.trainable import default_lora_targets, is_fused_experts, lora_targets
    hit, unmatched = lora_targets(desc, spec)
    assumed = spec.lora.target_modules is None and default_lora_targets(desc, spec)[1]
    if not hit:
        # peft tuners_utils.BaseTuner.inject_adapter raises "Target modules ... not found in
        # the base model" when no module matched; with no targets named and no default for the
        # model type, LoraModel._prepare_adapter_config raises "Please specify `target_modules`".
        names = sorted({p.module.rsplit(".", 1)[-1] for p in desc.params if p.layer is not None})
        if assumed:
            raise SpecError("lora.target_modules", f"PEFT has no default target modules for model type "
                            f"{desc.model_type!r} ({desc.name}); name some of its layer modules "
                            f"({', '.join(names[:12])}) or all-linear")
        raise SpecError("lora.target_modules", f"{', '.join(unmatched)} match no module of "
                        f"{desc.name}; name some of its layer modules ({', '.join(names[:12])}) or all-linear")
    refused = getattr(desc, "lora_refused_modules", ())
    bad = sorted({p.module.rsplit(".", 1)[-1] for p in hit if p.module.rsplit(".", 1)[-1] in refused}
                 if refused else ())  # most models refuse none: no walk over every target
    if bad and getattr(desc, "lora_refusal", "") == "mamba":
        # peft/tuners/tuners_utils.py _check_lora_target_modules_mamba raises ValueError for
        # out_proj and conv1d of Mamba-based model types (seen on CPU with Mamba2ForCausalLM)
        raise SpecError("lora.target_modules", f"PEFT refuses LoRA on {desc.name}'s {', '.join(bad)} "
                        f"(Mamba-based models); name the modules to adapt without {', '.join(bad)}, e.g. in_proj")
    if bad:
        # Llama4Router subclasses nn.Linear but returns (scores, logits): PEFT's lora.Linear
        # .forward reads `result.dtype` and fails (peft/tuners/lora/layer.py, seen on CPU)
        raise SpecError("lora.target_modules", f"PEFT cannot wrap {desc.name}'s {', '.join(bad)} with LoRA "
                        f"(its forward returns a tuple); name the modules to adapt instead of all-linear, "
                        f"without {', '.join(bad)}")
    notes = []
    if getattr(desc, "moe", None) is not None and any(is_fused_experts(p) for p in hit):
        # components/moe_lora.py: peft/utils/transformers_weight_conversion.py _convert_peft_config_moe
        notes.append(Msg("lora.target_modules: PEFT puts the expert projections on {family}'s fused expert weights "
                         "(transformers 5), a rank of r x experts each, and every MoE layer's forward keeps a "
                         "folded copy of its expert weights for backward (counted here). Name only the attention "
                         "modules to avoid it", family=desc.model_type))
    if assumed:
        return notes + [Msg("lora.target_modules: PEFT has no default for model type {mtype} (it would ask for "
                    "target_modules); the estimate assumes q_proj, v_proj. Name the modules you adapt, "
                    "or all-linear", mtype=repr(desc.model_type))]
    return notes  # partly unmatched targets: estimation's note (PEFT ignores them)


def _parallel(desc: ModelDesc, spec: JobSpec) -> list[str]:
    par, n = spec.parallel, spec.num_gpus
    mp = par.model_parallel
    if n % mp:
        axes = "tp x pp x cp x ulysses" if par.ulysses > 1 else "tp x pp x cp"
        raise SpecError("num_gpus", f"{n} GPUs do not split into {axes} = {mp}; "
                        f"use a multiple of {mp}")
    _tensor(desc, spec)
    if par.pp > desc.num_layers:
        raise SpecError("parallel.pp", f"{par.pp} pipeline stages for {desc.name}'s {desc.num_layers} "
                        "layers: every stage needs a layer; use pp <= num_layers")
    v = par.extras.get("virtual_stages")
    if par.pp > 1 and par.pp_schedule == "interleaved" and isinstance(v, int) and par.pp * v > desc.num_layers:
        # Megatron (core/transformer/transformer_block.py get_num_layers_to_build) and
        # torch.distributed.pipelining build pp x v model chunks, each of whole layers.
        raise SpecError("parallel.extras.virtual_stages", f"pp {par.pp} x {v} virtual stages = {par.pp * v} model "
                        f"chunks for {desc.name}'s {desc.num_layers} layers: every chunk needs a layer; use "
                        f"virtual_stages <= {max(desc.num_layers // par.pp, 1)}")
    group = par.extras.get("shard_group_size")
    ranks = n // mp * par.cp * par.ulysses
    if par.fsdp == "hybrid-shard" and isinstance(group, int) and group < ranks and ranks % group:
        # torch FSDP HYBRID_SHARD / HSDP: init_device_mesh((replicate, shard)) needs
        # replicate x shard = the data-parallel ranks.
        raise SpecError("parallel.extras.shard_group_size", f"{group} does not divide {ranks}, the data-parallel ranks "
                        "hybrid-shard splits into (replicate, shard) groups; use a shard group size that divides "
                        "it, e.g. the GPUs per node")
    _experts(desc, spec, n // mp)
    hpz = par.extras.get("zero_hpz_partition_size", 1)
    if par.zero_stage == 3 and isinstance(hpz, int) and hpz > 1 and n % min(hpz, n):
        # deepspeed/utils/groups.py _create_zero_param_parallel_group: min(size, world) must
        # divide the world size (_ensure_divisibility)
        raise SpecError("parallel.extras.zero_hpz_partition_size", f"{hpz} does not divide the {n} GPUs; ZeRO++ "
                        "hpZ groups must split them evenly (use e.g. the GPUs per node)")
    for name in ("cp", "ulysses"):
        if getattr(par, name) > 1 and desc.model_type == "mamba2":
            # ring attention (torch context_parallel, Megatron CP) and DeepSpeed Ulysses split
            # the attention over sequence ranks; a Mamba2 stack has none, and its SSM scan runs
            # over the whole sequence. The estimate would count attention traffic it never has.
            raise SpecError(f"parallel.{name}", f"{desc.name} has no attention layers for {name} to split "
                            f"the sequence over; use {name} 1 (shard it with zero_stage, fsdp or tp)")
    if par.cp > 1 and spec.seq_len % (2 * par.cp):
        # megatron/core/utils.py get_batch_on_this_cp_rank views the sequence as 2 * cp chunks
        # (load balancing for causal attention).
        raise SpecError("parallel.cp", f"seq_len {spec.seq_len} does not split into 2 x cp = {2 * par.cp} "
                        f"equal chunks; use a seq_len that is a multiple of {2 * par.cp}")
    _ulysses(desc, spec)
    return _offload(spec)


def check_roles(descs: dict[str, ModelDesc], spec: JobSpec) -> None:
    """The other models of a multi-model job (reference, teacher, reward, critic, a models
    list) are cut by the same tp, pp and Ulysses groups as the trained one (jobs/sharding.py:
    Megatron builds them with the policy's parallel state; Ulysses patches every model's
    attention), so each must take them as check_job asks of the trained model."""
    if spec.parallel.model_parallel == 1:
        return
    for role, desc in descs.items():
        if role == "policy":
            continue
        try:
            _tensor(desc, spec)
            if spec.parallel.pp > desc.num_layers:
                raise SpecError("parallel.pp", f"{spec.parallel.pp} pipeline stages for {desc.name}'s "
                                f"{desc.num_layers} layers: every stage needs a layer; use pp <= {desc.num_layers}")
            _ulysses(desc, spec)
        except SpecError as exc:
            raise SpecError(exc.field, f"{str(exc)[len(exc.field) + 2:]} (the {role} model)") from None


def _ulysses(desc: ModelDesc, spec: JobSpec) -> None:
    u = spec.parallel.ulysses
    if u == 1:
        return
    # deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF.__init__ and
    # register_with_transformers: heads split over u ranks, KV heads split or replicated, no
    # eager attention (it materialises the full mask); the adapter shards the sequence evenly.
    if desc.num_heads % u:
        raise SpecError("parallel.ulysses", f"{u} does not divide {desc.name}'s {desc.num_heads} attention "
                        f"heads; use a ulysses size that divides {desc.num_heads}")
    kv = desc.num_kv_heads
    if kv % u and u % kv:
        raise SpecError("parallel.ulysses", f"{u} and {desc.name}'s {kv} KV heads do not divide one "
                        "another; use a ulysses size that divides or is a multiple of the KV heads")
    if spec.seq_len % (u * spec.parallel.cp):
        raise SpecError("parallel.ulysses", f"seq_len {spec.seq_len} does not split over "
                        f"{u * spec.parallel.cp} sequence ranks; use a multiple of {u * spec.parallel.cp}")
    if spec.attention.value == "eager":
        raise SpecError("attention", "DeepSpeed Ulysses runs with sdpa or flash attention, not eager; "
                        "set attention: sdpa")


def _tensor(desc: ModelDesc, spec: JobSpec) -> None:
    tp, s = spec.parallel.tp, spec.seq_len
    if tp == 1:
        return
    # megatron/core/transformer/attention.py: divide(num_attention_heads, tp) and
    # divide(num_query_groups, tp); torchtitan shards q/k/v heads colwise the same way.
    for what, count in (("attention heads", desc.num_heads), ("KV heads", desc.num_kv_heads)):
        if count % tp:
            raise SpecError("parallel.tp", f"{tp} does not divide {desc.name}'s {count} {what}; "
                            f"use a tp that divides {count}")
    if spec.parallel.sp and s % tp:
        # sequence parallelism scatters the sequence dimension over the tp ranks
        # (megatron/core/tensor_parallel/mappings.py _split_along_first_dim).
        raise SpecError("parallel.sp", f"seq_len {s} does not split over tp = {tp} ranks; "
                        f"use a multiple of {tp}")


def _experts(desc: ModelDesc, spec: JobSpec, dp: int) -> None:
    ep = spec.parallel.ep
    if ep == 1:
        return
    moe = desc.moe
    if moe is None or not moe.num_experts:
        raise SpecError("parallel.ep", f"{desc.name} is a dense model (no experts); use ep 1")
    if moe.num_experts % ep:
        # megatron/core/transformer/moe/moe_layer.py: num_local_experts = num_moe_experts // ep,
        # asserted to divide.
        raise SpecError("parallel.ep", f"{ep} does not divide {desc.name}'s {moe.num_experts} experts; "
                        f"use an ep that divides {moe.num_experts}")
    if (dp * spec.parallel.cp * spec.parallel.ulysses) % ep:
        # megatron parallel_state.initialize_model_parallel: expert ranks are carved out of
        # the data-parallel (x context-parallel) ranks.
        raise SpecError("parallel.ep", f"{ep} does not divide the {dp * spec.parallel.cp * spec.parallel.ulysses} data-parallel "
                        "ranks the experts are spread over; raise num_gpus or lower ep")


def _offload(spec: JobSpec) -> list[str]:
    par = spec.parallel
    engine = par.zero_stage > 0 or par.fsdp != "none"
    for name in ("offload_optimizer", "offload_params"):
        if getattr(par, name) != "none" and not engine:
            raise SpecError(f"parallel.{name}", f"{getattr(par, name)} offload needs an engine that "
                            "offloads: set zero_stage (DeepSpeed ZeRO-Offload) or fsdp; plain "
                            "data parallelism keeps everything on the GPU")
    if par.offload_params != "none" and par.zero_stage in (1, 2):
        # deepspeed/runtime/zero/config.py: offload_param is a ZeRO stage 3 setting.
        raise SpecError("parallel.offload_params", f"DeepSpeed offloads parameters only under ZeRO-3; "
                        f"use zero_stage 3 or drop offload_params (stage {par.zero_stage})")
    if par.fsdp != "none" and "nvme" in (par.offload_optimizer, par.offload_params):
        raise SpecError("parallel.offload_optimizer", "FSDP offloads to cpu only (torch CPUOffload); "
                        "use cpu, or DeepSpeed ZeRO-3 for nvme")
    return []

def resolve_attention(desc: ModelDesc, spec: JobSpec) -> JobSpec:
    """The attention transformers runs: a family whose modeling has no SDPA path
    (catalog/attention_support.json: `_supports_sdpa` false, PreTrainedModel's default: Gemma 2,
    BLOOM, Mamba, ...) runs eager when none is named (modeling_utils `_check_and_adjust_attn_implementation`), so the
    spec's sdpa (its default) is estimated as eager, with a note (attention_note)."""
    from vramplan.catalog.runtime import no_sdpa_model_types
    from vramplan.spec import Attention
    from vramplan.spec.job import copy_with
    if spec.attention is Attention.SDPA and desc.model_type in no_sdpa_model_types():
        return copy_with(spec, attention=Attention.EAGER)
    return spec


# transformers families with no attention layer at all (state-space and recurrent): eager or
# sdpa names nothing they run, so the switch to eager needs no note
_ATTENTION_FREE = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})


def attention_note(desc: ModelDesc, given: JobSpec, spec: JobSpec) -> list:
    if given.attention is spec.attention or desc.model_type in _ATTENTION_FREE:
        return []
    return [Msg("attention: transformers has no SDPA path for {family} (_supports_sdpa is False for its models) "
                "and runs it with eager attention, estimated here; it refuses attn_implementation='sdpa'. "
                "attention: flash runs FlashAttention-2 instead", family=desc.model_type)]
