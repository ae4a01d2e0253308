"""JobSpec and its loading and saving (YAML or JSON)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from collections.abc import Mapping

from vramplan.spec.enums import (
    Attention, Backend, Checkpointing, LogprobHead, LossImpl, Method, Optimizer, OptimizerImpl,
    Precision, SpecError, Task, USER_ERRORS, as_spec_error,
)
from vramplan.spec.lora import LoraConfig, check_dora
from vramplan.spec.sections import (FreezeConfig, ParallelConfig, QuantConfig, boolean, count_field,
                                    check_cpu_quant, did_you_mean, fraction, positive_int, quant_facts, required_keys,
                                    string_keys)
from vramplan.spec.low_rank import LowRankConfig
from vramplan.spec.float8 import Float8Config, check_float8_job, parse_float8, parse_neftune
from vramplan.spec import tasks as _tasks
from vramplan.spec.grpo import default_micro_batch
from vramplan.spec.prompt import parse_prompt_len
from vramplan.spec.stack import Framework, StackConfig, default_optimizer_impl, parse_cuda_version, parse_dtype, parse_stack

ENUM_FIELDS = {
    "task": Task, "method": Method, "precision": Precision, "optimizer": Optimizer,
    "optimizer_impl": OptimizerImpl, "gradient_checkpointing": Checkpointing,
    "attention": Attention, "backend": Backend, "loss_impl": LossImpl, "logprob_head": LogprobHead,
}
SECTION_TYPES = {"lora": LoraConfig, "quantization": QuantConfig, "freeze": FreezeConfig, "parallel": ParallelConfig, "low_rank": LowRankConfig}
SECTION_ALIASES = {"lora": {"lora_alpha": "alpha", "lora_dropout": "dropout", "rank": "r"}}
INT_FIELDS = ("micro_batch_size", "seq_len", "grad_accum_steps", "num_gpus", "num_labels", "checkpoint_every")
DEFAULT_SEQ_LEN = 2048
"""Tokens per row when the spec names none (a common fine-tuning max_length)."""
BOOL_FIELDS = ("packing", "trust_remote_code", "online", "activation_offloading", "optimizer_in_backward", "compile", "keep_logits")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training job, as one GPU of it sees it."""

    model: str | dict | None = None
    """Catalog name, HF hub id, path to config.json or a model folder, or an inline HF config."""
    num_params: int | None = None
    """Raw size instead of `model` (older calculators' input); layers/hidden refine it."""
    num_layers: int | None = None
    hidden_size: int | None = None
    task: Task = Task.SFT
    method: Method = Method.FULL
    lora: LoraConfig | None = None
    quantization: QuantConfig | None = None
    freeze: FreezeConfig | None = None
    precision: Precision = Precision.BF16
    """The precision word; bf16/fp16 mean what the stack's flag means (components/dtypes.py)."""
    stack: StackConfig = field(default_factory=StackConfig)
    """Framework and library releases (spec/stack.py); default HF Trainer + PEFT/TRL."""
    load_dtype: str | None = None
    """dtype the weights are loaded in (`dtype` of `from_pretrained`, TRL's
    `model_init_kwargs`): fp32 | bf16 | fp16 (torch words accepted); None: what the stack
    does (transformers 5: the checkpoint's own dtype)."""
    optimizer: Optimizer = Optimizer.ADAMW
    optimizer_impl: OptimizerImpl | None = None
    """None: what PyTorch picks for the backend (foreach on CUDA, forloop on CPU)."""
    low_rank: LowRankConfig | None = None
    """galore-adamw / apollo-adamw: rank, target modules and projection (spec/sections.py)."""
    optimizer_in_backward: bool = False
    """Step each parameter in a post-accumulate-grad hook during backward (torchtune's optimizer_in_bwd):
    no full set of gradients is ever alive (components/optimizer_in_backward.py). LOMO and AdaLomo do."""
    momentum: float = 0.0
    """SGD momentum; > 0 adds a momentum buffer per parameter."""
    weight_decay: float = 0.01
    """Decoupled/L2 weight decay, 0.01 as torch's AdamW default (and the measurement harness's). Only
    SGD's decay changes memory: torch's SGD adds it out of place (`_foreach_add(grads, params, ...)`)."""
    label_smoothing: float = 0.0
    """TrainingArguments.label_smoothing_factor: the HF Trainer's LabelSmoother loss (components/shifted_loss.py)."""
    micro_batch_size: int | None = None
    """Rows per micro-step; not given: 1, or under task grpo TRL's (spec/grpo.py default_micro_batch)."""
    seq_len: int | None = None
    """Tokens per row; not given: DEFAULT_SEQ_LEN, capped at a model's learned positions
    (validity.py assume_seq_len, whose answer notes it)."""
    seq_len_given: bool | None = field(default=None, compare=False)
    """Whether the user gave seq_len (None: whether seq_len is set). Not a spec key: kept by
    replace(), with_() and load_spec(spec) so that a default stays a default. Not compared:
    two specs of the same seq_len are the same job (to_dict writes the seq_len in effect, and
    loading it back gives a spec equal to this one)."""
    grad_accum_steps: int = 1
    prompt_len: int | None = None
    """Tokens before a row's first labelled one (spec/prompt.py); None: all after the first."""
    packing: bool = False
    """Rows packed to `seq_len` tokens, documents told apart by restarting `position_ids`
    and no attention mask (TRL `padding_free`, DataCollatorWithFlattening): flash attention
    runs varlen; SDPA and eager get a (b, 1, s, s) block-causal mask (masking_utils.py).
    Under stack hf-trainer and trl the collators flatten the micro-batch into one row of
    b*s tokens, so the mask is (1, 1, b*s, b*s) (components/arch.py model_rows)."""
    neftune_noise_alpha: float | None = None
    """NEFTune (TrainingArguments.neftune_noise_alpha): uniform noise added to the input
    embeddings in training (components/activations.py: a transient, nothing saved)."""
    float8: Float8Config | None = None
    """torchao float8 training of the linear layers (spec/float8.py); None: off."""
    loss_impl: LossImpl = LossImpl.STANDARD
    """standard | chunked (torchtune CEWithChunkedOutputLoss, components/chunked_loss.py) |
    fused-linear-cross-entropy (Liger)."""
    activation_offloading: bool = False
    """torchtune `enable_activation_offloading`: saved tensors of >= 1 KiB move to pinned CPU
    memory in forward and come back for their backward (components/offloading.py)."""
    compile: bool = False
    """torch.compile of model and loss: accepted, not modelled (fusion saves fewer; the answer says so)."""
    keep_logits: bool = False
    """The loop keeps `outputs = model(**batch)`: its logits live into the next forward (step/build.py)."""
    disable_dropout: bool | None = None
    """TRL's `disable_dropout` (every nn.Dropout at p = 0, lora_dropout too); None: the trainer's
    default for the task (jobs/trained.py trainer_disables_dropout)."""
    logprob_head: LogprobHead = LogprobHead.AUTO
    """Preference/RL log-prob head: auto (what TRL 1.16 does), full, selective or chunked."""
    gradient_checkpointing: Checkpointing = Checkpointing.NONE
    checkpoint_every: int = 1
    """With full checkpointing: wrap one layer in N, the N-th, 2N-th, ... (torchtitan's `selective_ac_option
    = "N"`, torchtitan <= 0.2 `_apply_layer_sac`); the others keep everything they save."""
    attention: Attention = Attention.SDPA
    backend: Backend = Backend.CUDA
    gpu: str | None = None
    num_gpus: int = 1
    cuda_version: str | None = None
    """CUDA runtime of the run, e.g. "12.4": before 11.7 every kernel loads into the CUDA
    context at start (about 1 GiB more in nvidia-smi). None: the newest published figure
    for the GPU (components/runtime.py)."""
    num_labels: int = 2
    """Classes of the head for task sequence-classification."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trust_remote_code: bool = False
    """Allow running code from a model repository; never implied, only a real boolean.
    The estimator itself never runs model-repository code (it reads config.json only)."""
    online: bool = False
    """Allow fetching a hub model's config.json that is not in the catalog or the local
    Hugging Face cache (the CLI's --online, or VRAMPLAN_ONLINE=1 read at the CLI edge)."""
    reference_model: str | dict | None = None
    """dpo/ipo/kto/ppo/grpo: the frozen reference; None: the trained model's architecture
    (or, with a LoRA policy, the same model with its adapter disabled); 'precomputed'."""
    teacher: str | dict | None = None
    """distill: the frozen teacher model."""
    reward_model: str | dict | None = None
    """ppo/grpo: a frozen reward model (sequence classifier); None: a reward function."""
    critic_model: str | dict | None = None
    """ppo: the trained critic (value model); None: the trained model's architecture."""
    num_generations: int | None = None
    """grpo/ppo: completions generated per prompt (TRL GRPOConfig default 8; PPO 1)."""
    max_new_tokens: int | None = None
    """grpo/ppo: completion length; `seq_len` is then the prompt length."""
    generation: _tasks.GenerationConfig | None = None
    models: tuple = ()
    """Generic form: a list of spec.tasks.ModelRole (role, model, method, precision, placement)."""
    vision: _tasks.VisionConfig | None = None
    diffusion: _tasks.DiffusionConfig | None = None
    alloc_conf: str | None = None
    """PYTORCH_CUDA_ALLOC_CONF of the run ('expandable_segments:True', 'max_split_size_mb:128');
    None: PyTorch's defaults. Validated as PyTorch parses it (spec/alloc_conf.py)."""
    lengths: object | None = None
    """Dynamic padding: the dataset's row lengths and the batching policy
    (spec/lengths.py LengthsConfig); None: every row padded to seq_len."""

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        for name in SECTION_TYPES:  # JobSpec(lora={...}) built directly, not through load_spec; parallel None: {}
            set_(name, _section(name, {} if name == "parallel" and self.parallel is None else getattr(self, name)))
        for name, enum_cls in ENUM_FIELDS.items():
            value = getattr(self, name)
            if value is not None or name != "optimizer_impl":
                set_(name, enum_cls.parse(value, name))
        for name in BOOL_FIELDS + (("disable_dropout",) if self.disable_dropout is not None else ()):
            set_(name, boolean(name, getattr(self, name)))
        if self.gpu is not None and (not isinstance(self.gpu, str) or not self.gpu.strip()):
            raise SpecError("gpu", f"expected a GPU name from `vramplan gpus` (e.g. h100), got {self.gpu!r}")
        set_("seq_len_given", self.seq_len is not None if self.seq_len_given is None else bool(self.seq_len_given))
        if self.seq_len is None:
            set_("seq_len", DEFAULT_SEQ_LEN)
        set_("micro_batch_size", default_micro_batch(self.task) if self.micro_batch_size is None else self.micro_batch_size)
        for name in INT_FIELDS:
            set_(name, count_field(name, getattr(self, name)))
        set_("stack", parse_stack(self.stack))
        self._resolve_checkpointing()
        set_("load_dtype", parse_dtype(self.load_dtype, "load_dtype"))
        set_("momentum", fraction("momentum", self.momentum, high=0.9999))
        if self.cuda_version is not None:
            set_("cuda_version", parse_cuda_version(self.cuda_version))
        set_("weight_decay", fraction("weight_decay", self.weight_decay, high=10.0))
        set_("float8", parse_float8(self.float8))
        set_("neftune_noise_alpha", parse_neftune(self.neftune_noise_alpha))
        self._check_model()
        if self.alloc_conf is not None:
            from vramplan.spec.alloc_conf import check_text, parse_alloc_conf
            check_text(self.alloc_conf)
            set_("alloc_conf", str(self.alloc_conf).strip() or None)
            parse_alloc_conf(self.alloc_conf)
        if self.lengths is not None:
            from vramplan.spec.lengths import parse_job_lengths
            set_("lengths", parse_job_lengths(self.lengths, self.seq_len, self.micro_batch_size, self.packing))
        set_("prompt_len", parse_prompt_len(self))
        for name, value in _tasks.check_task_fields(self).items():
            set_(name, value)
        self._fill_method_defaults()
        from vramplan.spec.variants import check_layout  # the checks that read parallel or the batch split
        check_layout(self)
        if self.optimizer_impl is None:
            set_("optimizer_impl", default_optimizer_impl(self))
        if self.attention is Attention.FLASH and self.backend is Backend.CPU:
            raise SpecError("attention", "flash attention needs backend cuda; use sdpa or eager on cpu")

    def _resolve_checkpointing(self):
        if self.gradient_checkpointing is Checkpointing.SELECTIVE and self.stack.framework is Framework.TORCHTITAN:
            # torchtitan's `mode = "selective"` is its per-op policy (`selective_ac_option = "op"`,
            # the default of its configs; SelectiveAC in 0.3), not Megatron's attention-core one.
            object.__setattr__(self, "gradient_checkpointing", Checkpointing.OP_SELECTIVE)
        if self.checkpoint_every > 1 and self.gradient_checkpointing is not Checkpointing.FULL:
            raise SpecError("checkpoint_every", "checkpointing one layer in N needs gradient_checkpointing full; "
                                                "set gradient_checkpointing: full or checkpoint_every: 1")

    def _check_model(self):
        if self.model is None and self.num_params is None:
            raise SpecError("model", "required: a catalog name, a config.json path, a hub id, "
                            "an inline HF config, or num_params")
        if self.model is not None and not isinstance(self.model, (str, dict)):
            raise SpecError("model", f"expected a name, path or HF config mapping, got {type(self.model).__name__}")
        if isinstance(self.model, str) and not self.model.strip():
            raise SpecError("model", "is empty")
        for name in ("num_params", "num_layers", "hidden_size") if self.model is not None else ():
            if getattr(self, name) is not None:  # read only for a model given by its size (sources.py)
                raise SpecError(name, "describes a model given by its size, not by `model`; drop one of them")
        if self.num_params is not None:
            from vramplan.units import parse_count
            if isinstance(self.num_params, bool) or not isinstance(self.num_params, (int, float, str)):
                raise SpecError("num_params", f"expected a count like 7e9 or '7B', got {self.num_params!r}")
            try:
                object.__setattr__(self, "num_params", parse_count(self.num_params))
            except ValueError as exc:
                raise SpecError("num_params", str(exc)) from None
        for name in ("num_layers", "hidden_size"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, positive_int(name, getattr(self, name)))

    def _fill_method_defaults(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if self.method in (Method.LORA, Method.QLORA) and self.lora is None:
            set_("lora", LoraConfig())
        if self.method is Method.QLORA and self.quantization is None:
            set_("quantization", QuantConfig())
        if self.method is Method.FREEZE and self.freeze is None:
            raise SpecError("freeze", "method freeze needs a freeze section naming trainable_layers "
                            "or trainable_modules")
        if self.quantization is not None and self.method is not Method.QLORA and self.task is not Task.INFERENCE:
            raise SpecError("method", f"{self.method.value} cannot train quantized weights; "
                            "use method qlora with quantization, or drop quantization")
        q = self.quantization
        if q is not None and self.task is not Task.INFERENCE and not quant_facts(q.type)[3]:
            raise SpecError("quantization.type", f"PEFT cannot train LoRA on {q.type.value} weights "
                            "(peft/tuners/lora/torchao.py supports int8 only); use torchao-int8 or torchao-fp8")
        if q is not None and self.task is not Task.INFERENCE and q.kernel not in quant_facts(q.type)[3]:
            raise SpecError("quantization.kernel", f"{q.kernel} has no backward (GPTQModel SUPPORTS_TRAINING); "
                            f"train on {', '.join(quant_facts(q.type)[3])}")
        check_dora(self.lora, q, self.stack.framework.value, self.task.value)
        if q is not None and self.backend is Backend.CPU:
            check_cpu_quant(q)

    def _check_float8(self):
        if self.float8 is None:
            return
        if self.method not in (Method.FULL, Method.FREEZE):
            raise SpecError("float8", f"float8 training converts the trained nn.Linear layers; with "
                            f"{self.method.value} it is not modelled; use method full or freeze")
        check_float8_job(self.float8, self.parallel, self.stack.framework)
        if self.precision.is_autocast and self.backend is Backend.CPU:
            # torchao Float8Linear.forward reads torch.is_autocast_enabled() (CUDA's state) only
            raise SpecError("float8", "torchao's Float8Linear follows CUDA autocast only; on cpu use "
                            "precision fp32 or bf16")

    def to_dict(self, *, as_given: bool = False) -> dict:
        """The fields as spec keys; as_given: without a seq_len the user did not give, so
        that load_spec of it keeps the default (capped again for the model)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if (value is None or f.name == "seq_len_given" or (f.name == "parallel" and value.is_trivial)
                    or (f.name == "models" and not value)
                    or (f.name in ("online", "optimizer_in_backward", "activation_offloading", "compile", "label_smoothing")
                        and not value) or (f.name == "checkpoint_every" and value == 1)):
                continue
            if f.name == "models":
                value = [m.to_dict() for m in value]
            elif hasattr(value, "to_dict"):
                value = value.to_dict()
            elif hasattr(value, "value"):
                value = value.value
            out[f.name] = value
        if as_given and not self.seq_len_given:
            del out["seq_len"]
        return out

    def with_(self, **changes) -> "JobSpec":
        """A copy with fields changed (validated again)."""
        data = self.to_dict(as_given=True)
        data.update(changes)
        return load_spec(data)


def _section(name: str, value: object):
    cls = SECTION_TYPES[name]
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(name, f"expected a mapping, got {value!r}")
    aliases = SECTION_ALIASES.get(name, {})
    data = {aliases.get(k, k): v for k, v in value.items()}
    string_keys(name + ".", data)
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            raise SpecError(f"{name}.{key}", f"unknown key{did_you_mean(key, known)}")
    required_keys(name, cls, data)
    try:
        return cls(**data)
    except TypeError as exc:
        raise SpecError(name, str(exc)) from None


def read_spec_file(path: str) -> dict:
    """A spec file (YAML or JSON) as a mapping; SpecError naming the file if unreadable."""
    from vramplan.files import FileReadError, read_mapping
    try:
        return read_mapping(path)
    except FileReadError as exc:
        raise SpecError("spec", str(exc)) from None


def load_spec(source: "JobSpec | Mapping | str | os.PathLike", **overrides) -> JobSpec:
    """A validated JobSpec from a mapping, a YAML/JSON file or a JobSpec; overrides win.
    Bad input raises SpecError (a ValueError) whose `field` names the spec field."""
    try:
        return _load(source, overrides)
    except USER_ERRORS as exc:
        raise as_spec_error(exc) from None


def _load(source, overrides: dict) -> JobSpec:
    if isinstance(source, JobSpec):
        data = source.to_dict(as_given=True)
    elif isinstance(source, Mapping):
        data = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        data = read_spec_file(os.fspath(source))
    else:
        raise SpecError("spec", f"expected a mapping or a file path, got {type(source).__name__}")
    data.update({k: v for k, v in overrides.items() if v is not None})
    string_keys("", data)
    if isinstance(data.get("gradient_checkpointing"), bool):
        data["gradient_checkpointing"] = "full" if data["gradient_checkpointing"] else "none"
    for key in ("seq_len", "micro_batch_size"):
        if key in data and data[key] is None:  # written null: a slip, not "the default"
            positive_int(key, None)
    known = {f.name for f in fields(JobSpec)} - {"seq_len_given"}
    for key in data:
        if key not in known:
            raise SpecError(key, f"unknown spec key{did_you_mean(key, known)}")
    for name in SECTION_TYPES:
        data[name] = _section(name, data.get(name))
    if data["parallel"] is None:
        data.pop("parallel")
    try:
        return JobSpec(**data)
    except TypeError as exc:
        raise SpecError("spec", str(exc)) from None


_FIELD_SET = frozenset(f.name for f in fields(JobSpec))


def copy_with(spec: JobSpec, **values) -> JobSpec:
    """A copy of `spec` with `values` set, not validated again: for values validated as
    __post_init__ would, that nothing else depends on (~2 us; dataclasses.replace ~0.1 ms).
    JobSpec keeps its fields in its instance dict (no __slots__) for this: a search copies
    specs hundreds of times, and one dict copy is several times faster than 54 slot writes."""
    out = object.__new__(JobSpec)
    state = out.__dict__
    state.update(spec.__dict__)
    for name, value in values.items():
        if name in _FIELD_SET:
            state[name] = value
    return out


def save_spec(spec: "JobSpec | Mapping | str", path: str) -> None:
    """Write the spec (a mapping or file is loaded and checked first) as YAML, or JSON when the path ends in .json."""
    data = (spec if isinstance(spec, JobSpec) else load_spec(spec)).to_dict(as_given=True)
    with open(path, "w", encoding="utf-8") as fh:
        if path.endswith(".json"):
            json.dump(data, fh, indent=2)
            fh.write("\n")
        else:
            import yaml
            yaml.safe_dump(data, fh, sort_keys=False)


__all__ = ["DEFAULT_SEQ_LEN", "JobSpec", "copy_with", "load_spec", "save_spec"]
