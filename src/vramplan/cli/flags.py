"""Command-line words beyond the spec's own flags: the names users type in TRL and
TrainingArguments (aliases, trainer flags), the diffusion section's flags, option names with
underscores, `--strategy` in flag words, the output formats and shell completion.
Imported by cli/main.py; what needs its parser imports it at call time."""
from __future__ import annotations

import argparse

import re
import sys

from vramplan.i18n import N_, Msg, _, tr
from vramplan.spec import SpecError


def _flag_bool(value: str) -> bool:
    """A boolean flag's value: the usual words only (`--sp no` is false, `--sp maybe` an error)."""
    text = str(value).lower()
    if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return text in ("1", "true", "yes", "on")


def _bool_word(value: str, true: str, false: str) -> str:
    """TrainingArguments booleans (`--gradient_checkpointing true`) as the spec's words."""
    word = str(value).strip().lower()
    return true if word in ("1", "true", "yes", "on") else false if word in ("0", "false", "no", "off") else value


# transformers `attn_implementation` values -> the spec's attention words.
_ATTN_IMPL = {"flash_attention_2": "flash", "flash_attention_3": "flash", "flash-attention-2": "flash"}

# The names users already type elsewhere, as aliases of the spec's flags: TrainingArguments
# (per_device_train_batch_size, gradient_accumulation_steps), TRL SFT/DPO/GRPOConfig
# (max_length, max_seq_length, max_completion_length), transformers attn_implementation,
# DeepSpeed train_micro_batch_size_per_gpu, LLaMA-Factory cutoff_len, axolotl sequence_len,
# torchtune's recipe key batch_size (per device: recipes/full_finetune_single_device.py
# builds its DataLoader with cfg.batch_size), and the plain --batch.
_ALIASES = {
    "seq_len": ("max_length", "max_seq_length", "cutoff_len", "sequence_len"),
    "micro_batch_size": ("per_device_train_batch_size", "train_micro_batch_size_per_gpu", "micro_batch",
                         "batch_size", "batch"),
    "grad_accum_steps": ("gradient_accumulation_steps",),
    "max_new_tokens": ("max_completion_length",),
    "attention": ("attn_implementation",),
    "reference_model": ("ref_model",),
}
# TrainingArguments / TRL flags that are not spec keys: read by the TrainingArguments
# importer (importers/hf_args.py), the same mapping `--training-args FILE` uses.
_TRAINER_FLAGS = (("optim", str, N_("TrainingArguments optim, e.g. adamw_torch_fused, paged_adamw_8bit")),
                  ("bf16", _flag_bool, N_("TrainingArguments bf16 (autocast: precision amp-bf16)")),
                  ("fp16", _flag_bool, N_("TrainingArguments fp16 (autocast: precision amp-fp16)")),
                  ("use_peft", _flag_bool, N_("TRL use_peft: method lora")))


# The `diffusion` section (spec/tasks.py DiffusionConfig) from flags; any of them implies
# --task diffusion, and a catalog pipeline fills the rest from its published defaults.
_DIFFUSION_FLAGS = (("num_frames", int, N_("diffusion: video frames in pixel space (1 = an image; CogVideoX: 49)")),
                    ("height", int, N_("diffusion: frame height in pixels")),
                    ("width", int, N_("diffusion: frame width in pixels")),
                    ("text_encoders", str, N_("diffusion: frozen | precomputed (embeddings from disk)")),
                    ("vae", str, N_("diffusion: frozen | precomputed (latents from disk)")),
                    ("frozen_copy", _flag_bool, N_("diffusion: a frozen copy of the denoiser beside it")),
                    ("offload_frozen", _flag_bool, N_("diffusion: frozen modules on the CPU between forwards")),
                    ("prior_preservation", _flag_bool,
                     N_("diffusion: DreamBooth prior preservation (class images double the batch)")),
                    ("vae_slicing", _flag_bool, N_("diffusion: VAE encodes one sample at a time")),
                    ("vae_tiling", _flag_bool, N_("diffusion: VAE encodes in tiles")),
                    ("controlnet", _flag_bool,
                     N_("diffusion: train a ControlNet beside the frozen UNet (train_controlnet.py)")),
                    ("set_grads_to_none", _flag_bool,
                     N_("diffusion: the loop's zero_grad(set_to_none=...); false keeps gradients into the next "
                        "forward (default: the script's, false for train_dreambooth.py)")))


def _int_word(value: str):
    """An integer flag's value as an int when it is one; anything else is handed on for the
    spec to refuse, naming its field (`--quant-bits three` -> quantization.bits)."""
    try:
        return int(value)
    except ValueError:
        return value


def _bool_value(value: str):
    """A boolean flag's value as True/False for the usual words; anything else is handed on
    for the spec to refuse, naming its field (`--double-quant maybe` -> quantization.double_quant)."""
    word = _bool_word(value, "true", "false")
    return {"true": True, "false": False}.get(word, word)


def _list_word(value: str):
    """A comma-separated list (`q_proj,v_proj`), or one word (`all-linear`)."""
    items = [v.strip() for v in str(value).split(",")]
    return items if len(items) > 1 else value


# Spec sections from flags: (section, key, flag names, type, help). The names are the spec's
# keys with dashes, beside the words users already type: `--quant` (bitsandbytes / GPTQ / AWQ
# checkpoints), transformers TrainingArguments `optim_target_modules` for GaLore / APOLLO
# (spec/low_rank.py; `--optim-args` is read by importers/hf_args.py), TRL's vision
# `freeze_vision` words. Values the spec refuses are refused there, naming the field.
_SECTION_FLAGS = (
    ("quantization", "type", ("quant", "quantization"), str,
     N_("quantized frozen base: nf4 | fp4 | int8 | gptq | awq | hqq | torchao-int8 | torchao-int4 | torchao-fp8 "
        "(without --method: qlora)")),
    ("quantization", "bits", ("quant_bits",), _int_word, N_("quantization: bits per weight (GPTQ 2/3/4/8, HQQ 1-8)")),
    ("quantization", "group_size", ("quant_group_size",), _int_word,
     N_("quantization: input features per scale (GPTQ/AWQ 128, HQQ 64; -1: one group per row, GPTQ)")),
    ("quantization", "double_quant", ("double_quant", "bnb_4bit_use_double_quant"), _bool_value,
     N_("quantization: bitsandbytes 4-bit double quantization (true/false)")),
    ("quantization", "kernel", ("quant_kernel",), str,
     N_("quantization: GPTQ torch | triton | exllama | exllamav2 | marlin; AWQ gemm | gemv | marlin | torch")),
    ("quantization", "prepare", ("quant_prepare",), str,
     N_("QLoRA: what prepares the quantized base: peft (prepare_model_for_kbit_training) | peft-bf16 "
        "(TRL < 0.26) | bf16-trainable (TRL >= 0.26) | none (torchtune, litgpt); default: the stack's")),
    ("low_rank", "rank", ("rank",), _int_word, N_("GaLore / APOLLO: projection rank (low_rank.rank)")),
    ("low_rank", "update_proj_gap", ("update_proj_gap",), _int_word,
     N_("GaLore / APOLLO: steps between projection updates")),
    ("low_rank", "proj_type", ("proj_type",), str, "std | reverse_std | left | right"),
    ("low_rank", "target_modules", ("optim_target_modules",), _list_word,
     N_("GaLore / APOLLO: projected modules, comma-separated, or all-linear (TrainingArguments "
        "optim_target_modules)")),
    ("vision", "image_size", ("image_size",), _int_word, N_("vision: image side in pixels")),
    ("vision", "image_height", ("image_height",), _int_word, N_("vision: image height (native-resolution towers)")),
    ("vision", "image_width", ("image_width",), _int_word, N_("vision: image width (native-resolution towers)")),
    ("vision", "num_images", ("images_per_sample", "num_images"), _int_word, N_("vision: images per sample")),
    ("vision", "min_pixels", ("min_pixels",), _int_word, N_("vision: Qwen-VL processor's smallest image area")),
    ("vision", "max_pixels", ("max_pixels",), _int_word, N_("vision: Qwen-VL processor's largest image area")),
    ("vision", "max_tiles", ("max_tiles",), _int_word, N_("vision: InternVL tiles per image")),
    ("vision", "num_videos", ("num_videos",), _int_word, N_("vision: videos per sample")),
    ("vision", "video_frames", ("video_frames",), _int_word, N_("vision: frames per video")),
    ("vision", "freeze_vision_tower", ("freeze_vision", "freeze_vision_tower"), _bool_value,
     N_("vision: keep the vision tower frozen (true/false; default true)")),
)


def add_section_flags(p) -> None:
    for section, key, names, typ, help_ in _SECTION_FLAGS:
        bool_flag = typ is _bool_value
        p.add_argument(*["--" + n.replace("_", "-") for n in names], dest=f"section_{section}_{key}", type=typ,
                       help=_(help_), nargs="?" if bool_flag else None, const=True if bool_flag else None)
    p.add_argument("--optim-args", dest="section_optim_args",
                   help=_('GaLore / APOLLO: TrainingArguments optim_args, e.g. "rank=64,update_proj_gap=100"'))


def section_flags(args, data: dict, imply: bool = True) -> dict:
    """The spec mapping with the section flags given merged into their sections. `imply`: a
    quantization flag without a method means method qlora (not for inference)."""
    given: dict[str, dict] = {}
    for section, key, _names, _typ, _help in _SECTION_FLAGS:
        value = getattr(args, f"section_{section}_{key}", None)
        if value is not None:
            given.setdefault(section, {})[key] = value
    optim_args = getattr(args, "section_optim_args", None)
    if optim_args is not None:
        from vramplan.importers.hf_args import low_rank_args
        low = {**low_rank_args(optim_args, "--optim-args"), **given.get("low_rank", {})}
        if low:  # optim_args of another optimizer (betas=...) made an empty low_rank section: "rank required"
            given["low_rank"] = low
    data = dict(data)
    for section, values in given.items():
        old = data.get(section)
        if old is None or isinstance(old, dict):  # else load_spec names the field
            data[section] = {**(old or {}), **values}
    if imply and "quantization" in given and data.get("method") is None and str(data.get("task")) != "inference":
        data["method"] = "qlora"  # a LoRA on a quantized base (spec: method qlora with quantization)
    return data


def say_notes(args) -> None:
    """What reading the input noted (the importers' report, a pipeline's defaults filled in),
    said once the command is past the checks that can refuse the job: a bad input stays one
    line. The answering commands call it before printing; main() after any other."""
    for note in vars(args).pop("pending_notes", []):
        print(tr(note), file=sys.stderr)


def _flag_names(name: str) -> list[str]:
    return ["--" + n.replace("_", "-") for n in (name, *_ALIASES.get(name, ()))]


def dashed(argv: list[str]) -> list[str]:
    """`--per_device_train_batch_size 4` as HfArgumentParser accepts it: underscores in an
    option's name are dashes (values are left alone)."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if re.fullmatch(r"--[A-Za-z0-9_-]+", name) and "_" in name:
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _trainer_flags(args, data: dict) -> dict:
    given = {name: getattr(args, "hf_" + name) for name, _, _ in _TRAINER_FLAGS
             if getattr(args, "hf_" + name, None) is not None}
    if not given:
        return data
    from vramplan.importers.hf_args import from_training_args
    overrides, rep = from_training_args(given, "flags", file_defaults=False)
    for name, why in rep.unresolved.items():
        raise SpecError(name, why)
    return {**data, **overrides}


def _diffusion(args, data: dict) -> dict:
    if data.get("diffusion") is not None and not isinstance(data["diffusion"], dict):
        return data  # `diffusion: 5` or a list: load_spec names the field
    section = dict(data.get("diffusion") or {})
    given = {name: getattr(args, "diffusion_" + name) for name, _, _ in _DIFFUSION_FLAGS
             if getattr(args, "diffusion_" + name, None) is not None}
    section.update(given)
    pipe = _catalog_pipeline(data.get("model"))
    if data.get("task") is None and (given or pipe is not None):
        data = {**data, "task": "diffusion"}
    if str(data.get("task")) == "diffusion" and pipe is not None:
        filled = {k: v for k, v in (pipe.get("defaults") or {}).items() if k not in section}
        if filled:
            section.update(filled)
            # said once the command is past the checks that can refuse it (cli.main.say_notes)
            vars(args).setdefault("pending_notes", []).append(
                Msg("vramplan: diffusion: {settings} from {pipeline}'s defaults",
                    settings=", ".join(f"{k}={v}" for k, v in filled.items()), pipeline=pipe["name"]))
    return {**data, "diffusion": section} if section else data


def _catalog_pipeline(model) -> dict | None:
    if not isinstance(model, str):
        return None
    from vramplan.catalog.pipelines import pipeline_or_none
    pipe = pipeline_or_none(model)
    if pipe is None and not _catalog_model(model):
        # a diffusers pipeline folder (model_index.json), local or in the HF cache
        from vramplan.catalog.model_index import pipeline_at
        pipe = pipeline_at(model)
    return pipe


def _catalog_model(model: str) -> bool:
    from vramplan import catalog
    try:
        catalog.find_model(model)
    except (catalog.UnknownNameError, KeyError, ValueError):
        return False
    return True


def strategy_from_flags(text: str):
    """`--strategy "zero3 --zero-stage 3 --gradient-checkpointing full"`: the same flag words
    as the command line; leading words without dashes name the row (default: the flags)."""
    import shlex

    from vramplan.cli.main import UsageError, _add_spec_args, _Parser, flags_to_data
    from vramplan.plan.compare import Strategy
    words = shlex.split(text)
    first = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
    name, flags = " ".join(words[:first]), words[first:]
    parser = _Parser(prog="--strategy", add_help=False)
    _add_spec_args(parser)
    try:
        args = parser.parse_args(dashed(flags))
    except UsageError as exc:
        raise SpecError("strategy", f"{exc} in {text!r}") from None
    if args.model or args.spec or args.save_spec or any(getattr(args, "import_" + k) for k in
                                                          ("deepspeed", "training_args", "accelerate_config", "recipe")):
        raise SpecError("strategy", f"a strategy changes flags of the job, not its model or files: {text!r}")
    changes: dict = {}
    for key, value in flags_to_data(args, {}, imply=False).items():
        if isinstance(value, dict):
            changes.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            changes[key] = value
    if not changes:
        raise SpecError("strategy", f"no change in {text!r}; e.g. \"--zero-stage 3 --gradient-checkpointing full\"")
    return Strategy(name=name or " ".join(flags), changes=changes)


_PATH_OPTIONS = ("spec", "save_spec", "plot", "strategies", "import_deepspeed", "import_training_args",
                 "import_accelerate_config", "import_recipe", "static_build", "pyodide")


def check_paths(args) -> None:
    """A file option given an empty path (`--plot ""`, an unset shell variable) was skipped
    as if not given: no picture, no saved spec, the job without its spec file."""
    for name in _PATH_OPTIONS:
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():
            flag = "--" + name.removeprefix("import_").replace("_", "-")
            from vramplan.cli.main import UsageError
            raise UsageError(f"{flag}: the path is empty; give a file, or drop {flag}")
    headroom = getattr(args, "headroom", None)  # `--headroom ""` kept 0 or fit's default without a word
    if isinstance(headroom, str) and not headroom.strip():
        from vramplan.cli.main import UsageError
        raise UsageError("--headroom: the value is empty; give a size like 2GiB or 512MiB, or drop --headroom")
    answer_format(args)


def answer_format(args) -> str:
    """--format table|json|markdown|csv; --json is --format json."""
    fmt = getattr(args, "format", None) or "table"
    if getattr(args, "json", False) and fmt not in ("table", "json"):  # the default is table
        from vramplan.cli.main import UsageError
        raise UsageError(f"--json and --format {fmt} ask for two forms; keep one")
    return "json" if getattr(args, "json", False) else fmt


def add_format_args(p) -> None:
    from vramplan.report.tables import FORMATS
    p.add_argument("--format", choices=FORMATS, default="table", help=_("how to print the answer (default: table)"))
    p.add_argument("--json", action="store_true", help=_("the versioned JSON form (= --format json)"))


def cmd_completion(args) -> int:
    """A completion script generated by shtab from this very parser (so it never drifts)."""
    from vramplan.cli.main import UsageError, build_parser
    try:
        import shtab
    except ImportError:
        raise UsageError("shell completion needs shtab: pip install 'vramplan[completion]'") from None
    print(shtab.complete(build_parser(), shell=args.shell))
    return 0
