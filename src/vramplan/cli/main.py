"""The `vramplan` command: parse, call the API, render. No arithmetic here.

Exit status, the same for estimate, compare, fit and check: 0 the job fits (or no GPU
was named to fit against), 1 it does not fit, 2 bad input (one line on stderr, never a
traceback).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from vramplan.i18n import LANGUAGES, N_, _, language_for, set_language, tr
from vramplan.i18n.errors import error_line
from vramplan.cli.catalogs import cmd_gpus, cmd_models
from vramplan.cli.flags import (  # noqa: F401 (dashed, strategy_from_flags: public from here too)
    _ATTN_IMPL, _DIFFUSION_FLAGS, _TRAINER_FLAGS, _bool_word, _diffusion, _flag_bool, _flag_names,
    _trainer_flags, add_format_args, add_section_flags, answer_format, cmd_completion, dashed, section_flags,
    strategy_from_flags, check_paths, say_notes,
)
from vramplan.report.header import BATCH_HELP
from vramplan.spec import SpecError

_SPEC_FLAGS = {
    # flag name -> (type, help)
    "task": (str, "sft | pretrain | sequence-classification | inference | dpo | ipo | kto | orpo | simpo | "
                  "reward-model | ppo | grpo | distill"),
    "method": (str, "full | lora | qlora | freeze"),
    "precision": (str, N_("fp32 | bf16 | fp16 (as the stack's flag) | amp-bf16 | amp-fp16 | mixed-bf16 | "
                          "mixed-fp16 | pure-bf16 | pure-fp16")),
    "stack": (str, "plain (default: the words as said) | hf-trainer | trl | deepspeed | accelerate-fsdp | torchtune | axolotl | "
                   "llama-factory | ms-swift | litgpt | torchtitan | megatron | diffusers-scripts; trl@1.9: a TRL release"),
    "load_dtype": (str, N_("dtype the weights are loaded in: float32 | bfloat16 | float16 "
                           "(default: the stack's, the checkpoint's dtype in transformers 5)")),
    "optimizer": (str, "adamw | adam | sgd | adafactor | lion | adamw-8bit | paged-adamw-8bit | paged-adamw-32bit"),
    "optimizer_impl": (str, "foreach | fused | forloop"),
    "momentum": (float, N_("SGD momentum")),
    "weight_decay": (float, N_("optimizer weight decay (default: the optimizer's)")),
    "micro_batch_size": (int, BATCH_HELP),
    "seq_len": (int, N_("tokens per row (ppo/grpo: the prompt)")),
    "grad_accum_steps": (int, N_("micro-steps per optimizer step")),
    "prompt_len": (int, N_("sft/dpo: tokens before a row's first label (ms-swift computes logits after them only)")),
    "loss_impl": (str, "standard | chunked | fused-linear-cross-entropy"),
    "logprob_head": (str, N_("dpo/kto/grpo log-prob head: auto | full | selective | chunked")),
    "gradient_checkpointing": (lambda v: _bool_word(v, "full", "none"),
                               "none | full | selective | op-selective (true = full)"),
    "checkpoint_every": (int, N_("with full checkpointing: checkpoint one layer in N "
                                 "(torchtitan selective_ac_option N)")),
    "attention": (lambda v: _ATTN_IMPL.get(v, v), "eager | sdpa | flash (flash_attention_2 = flash)"),
    "backend": (str, "cuda | cpu"),
    "gpu": (str, N_("GPU catalog name (see `vramplan gpus`)")),
    "num_gpus": (int, N_("GPUs in the job")),
    "cuda_version": (str, N_("CUDA runtime, e.g. 12.4 (before 11.7 every kernel loads at start)")),
    "num_params": (str, N_("raw size instead of a model, e.g. 8e9 or 7B")),
    "reference_model": (str, N_("dpo/ipo/kto/ppo/grpo: reference model, or 'precomputed'")),
    "teacher": (str, N_("distill: the frozen teacher model")),
    "reward_model": (str, N_("ppo/grpo: the reward model")),
    "critic_model": (str, N_("ppo: the critic (default: the model)")),
    "num_generations": (int, N_("grpo: completions per prompt")),
    "max_new_tokens": (int, N_("ppo/grpo/inference: generated tokens")),
    "num_labels": (int, N_("sequence-classification: classes")),
    "num_layers": (int, N_("with --num-params: layer count")),
    "hidden_size": (int, N_("with --num-params: hidden size")),
    "float8": (str, N_("torchao float8 training of the linear layers: tensorwise | rowwise | rowwise-with-gw-hp")),
    "neftune_noise_alpha": (float, N_("NEFTune noise on the input embeddings (TrainingArguments.neftune_noise_alpha)")),
    "alloc_conf": (str, N_("PYTORCH_CUDA_ALLOC_CONF of the run, e.g. expandable_segments:True "
                           "(default: the environment's)")),
}
# Read at this edge only (the core never reads the environment); PyTorch 2.9 also reads PYTORCH_ALLOC_CONF.
_ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


_PARALLEL_FLAGS = (
    ("zero_stage", int, N_("DeepSpeed ZeRO stage 0-3")),
    ("fsdp", str, "none | full-shard | shard-grad-op | hybrid-shard | no-shard"),
    ("fsdp_version", int, N_("1 or 2")),
    ("tp", int, N_("tensor-parallel size")),
    ("sp", _flag_bool, N_("sequence parallelism with tp (true/false)")),
    ("cp", int, N_("context-parallel size")),
    ("ulysses", int, N_("DeepSpeed Ulysses sequence-parallel size")),
    ("pp", int, N_("pipeline-parallel size")),
    ("ep", int, N_("expert-parallel size")),
    ("offload_optimizer", str, "none | cpu | nvme"),
    ("offload_params", str, "none | cpu | nvme"),
)
_SWITCH_FLAGS = (  # on/off spec keys given as a bare flag (the spec's default otherwise)
    ("packing", N_("packed rows without padding, documents told apart by position_ids")),
    ("activation_offloading", N_("saved activations offloaded to CPU (torchtune enable_activation_offloading)")),
    ("optimizer_in_backward", N_("optimizer step per parameter inside backward (torchtune optimizer_in_bwd)")),
    ("compile", N_("torch.compile (accepted; its fusion is not modelled)")),
    ("keep_logits", N_("the training loop keeps the model's output, so its logits live through backward and the "
                       "optimizer step (a plain loop's outputs = model(**batch)); Trainer does not")),
)


EXIT_STATUS_HELP = N_("exit status: 0 the job fits (or no --gpu was given), 1 it does not fit "
                    "(fit: no layout fits; compare: the job as given), 2 bad input")


class UsageError(Exception):
    """An argparse usage error (one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        from vramplan.i18n.argparse_text import LocalizedHelpFormatter, localize_parser
        kwargs.setdefault("formatter_class", LocalizedHelpFormatter)
        super().__init__(*args, **kwargs)
        localize_parser(self)
        # read by main() before parsing (help texts are translated as the parser is built);
        # declared on every command so it may stand before or after the command's name
        self.add_argument("--lang", choices=LANGUAGES, default=argparse.SUPPRESS,
                          help=_("language of the answers (default: from LC_ALL, LC_MESSAGES or LANG, else en)"))

    def error(self, message):  # argparse's own usage errors: one line, exit 2
        raise UsageError(message)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help=_("catalog name, hub id, config.json path or model folder"))
    p.add_argument("--spec", help=_("job spec file (YAML or JSON); flags override it"))
    p.add_argument("--save-spec", help=_("write the resolved spec to this file"))
    for name, (typ, help_) in _SPEC_FLAGS.items():
        p.add_argument(*_flag_names(name), dest=name, type=typ, help=_(help_),
                       metavar="N" if typ is int else name.upper())
    for name, typ, help_ in _DIFFUSION_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest="diffusion_" + name, type=typ, help=_(help_),
                       nargs="?" if typ is _flag_bool else None, const=True if typ is _flag_bool else None)
    for name, typ, help_ in _TRAINER_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest="hf_" + name, type=typ, nargs="?",
                       const=True if typ is _flag_bool else None, help=_(help_))
    p.add_argument("--lora-r", type=int, help=_("LoRA rank"))
    p.add_argument("--lora-alpha", type=float)
    p.add_argument("--lora-dropout", type=float)
    p.add_argument("--lora-target-modules", help=_("comma-separated names or all-linear"))
    p.add_argument("--use-dora", "--lora-use-dora", dest="lora_use_dora", action="store_true", default=None,
                   help=_("DoRA (PEFT use_dora): a trained magnitude per adapted linear and its weight norm"))
    p.add_argument("--use-rslora", "--lora-use-rslora", dest="lora_use_rslora", action="store_true", default=None,
                   help=_("rsLoRA (PEFT use_rslora): scaling alpha/sqrt(r); no memory effect"))
    add_section_flags(p)
    for name, help_ in _SWITCH_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), action="store_true", default=None, help=_(help_))
    p.add_argument("--disable-dropout", action=argparse.BooleanOptionalAction, default=None, help=_(
        "TRL's disable_dropout: every nn.Dropout, lora_dropout too, at p 0 (the default of TRL's DPO, KTO, ORPO, CPO, GKD and reward trainers)"))
    for name, typ, help_ in _PARALLEL_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest="parallel_" + name, type=typ, help=_(help_))
    for name, help_ in (("deepspeed", N_("DeepSpeed config JSON")), ("training_args", N_("HF TrainingArguments / TRL config")),
                        ("accelerate_config", N_("accelerate config YAML")), ("recipe", N_(
                            "axolotl / LLaMA-Factory / torchtune / ms-swift recipe YAML, or a `swift sft` script"))):
        p.add_argument("--" + name.replace("_", "-"), dest="import_" + name, help=_(help_))
    p.add_argument("--trust-remote-code", action="store_true", default=None)
    p.add_argument("--online", action="store_true", default=None,
                   help=_("allow fetching a hub model's config.json that is not in the catalog or the "
                          "local Hugging Face cache (also VRAMPLAN_ONLINE=1); offline otherwise"))


def _imported(args, data: dict) -> dict:
    """Merge engine/trainer config files into the spec mapping; report what was used."""
    files = {k: getattr(args, "import_" + k, None)
             for k in ("deepspeed", "training_args", "accelerate_config", "recipe")}
    if not any(files.values()):
        return data
    from vramplan.importers.cli_args import import_config_files
    from vramplan.importers.report import merge
    overrides, lines = import_config_files(**files)
    vars(args).setdefault("pending_notes", []).extend(f"vramplan: {tr(line)}" for line in lines)
    return merge(data, overrides)


def spec_from_args(args) -> "object":
    from vramplan.spec import load_spec
    data: dict = {}
    if args.spec:
        from vramplan.spec.job import read_spec_file
        data = read_spec_file(args.spec)
    data = flags_to_data(args, _imported(args, data))
    if data.get("alloc_conf") is None:  # the environment is read here, at the edge
        env = next((k for k in _ALLOC_CONF_ENV if os.environ.get(k)), None)
        if env:
            from vramplan.spec.alloc_conf import parse_alloc_conf
            try:  # name the variable: the user gave no alloc_conf
                parse_alloc_conf(os.environ[env].strip())
            except SpecError as exc:
                raise SpecError("alloc_conf", f"{str(exc).split(': ', 1)[-1]}; it comes from the environment's "
                                f"{env} (fix it, or pass --alloc-conf to override it)") from None
            data["alloc_conf"] = os.environ[env]
    spec = load_spec(data)
    if spec.lengths is not None:  # the lengths file is read here, relative to the spec file
        from vramplan.importers.lengths import resolve_lengths
        spec = resolve_lengths(spec, os.path.dirname(os.path.abspath(args.spec)) if args.spec else None)
    if spec.diffusion is not None:  # a size the pipeline cannot take stays one line
        from vramplan.jobs.diffusion import check_spec_shape
        check_spec_shape(spec)
    if args.save_spec:
        from vramplan.spec import save_spec
        save_spec(spec, args.save_spec)
    return spec


def flags_to_data(args, data: dict, *, imply: bool = True) -> dict:
    """The spec mapping `data` with every flag given on top (sections merged key by key).
    `imply`: a diffusion flag or pipeline name sets the task and the pipeline's defaults."""
    data = _trainer_flags(args, dict(data))
    parallel = data.get("parallel") or {}
    if isinstance(parallel, dict):  # else load_spec names the field
        parallel = dict(parallel)
        for name, _, _ in _PARALLEL_FLAGS:
            value = getattr(args, "parallel_" + name, None)
            if value is not None:
                parallel[name] = value
    if parallel:
        data["parallel"] = parallel
    if getattr(args, "model", None):
        data["model"] = args.model
        data.pop("num_params", None)
    for name in [*_SPEC_FLAGS, *(n for n, _ in _SWITCH_FLAGS), "trust_remote_code", "online", "disable_dropout"]:
        value = getattr(args, name, None)
        if value is not None:
            data[name] = value
    if os.environ.get("VRAMPLAN_ONLINE") == "1":  # the environment is read here, at the edge
        data["online"] = True
    if imply:
        data = _diffusion(args, data)
    else:
        section = {n: getattr(args, "diffusion_" + n) for n, _, _ in _DIFFUSION_FLAGS
                   if getattr(args, "diffusion_" + n, None) is not None}
        data = {**data, "diffusion": {**(data.get("diffusion") or {}), **section}} if section else data
    lora = data.get("lora") or {}
    for key in ("r", "alpha", "dropout", "target_modules", "use_dora", "use_rslora"):
        value = getattr(args, f"lora_{key}", None)
        if value is not None and isinstance(lora, dict):  # else load_spec names the field
            lora = {**lora, key: value.split(",") if key == "target_modules" and value != "all-linear" else value}
    if lora:
        data["lora"] = lora
    return section_flags(args, data, imply)


def cmd_estimate(args) -> int:
    from vramplan.estimation import estimate
    # What is imported by now lives as long as this short process: gc.freeze moves it out of the
    # collector's generations, so the collections the estimate and the allocator replay trigger
    # do not traverse it again (3% of this command's instructions, bench/speed/README.md).
    gc.freeze()
    if args.depth < 1:  # groups(0) would fold every term into one row, groups(-1) drop a key part
        raise SpecError("depth", f"expected an integer >= 1, got {args.depth}")
    est = estimate(spec_from_args(args))
    say_notes(args)
    if args.plot:
        from vramplan.report.plots import plot_breakdown
        plot_breakdown(est, args.plot)
    fmt = answer_format(args)
    if fmt == "json":
        print(json.dumps(est.to_dict(), indent=2))
    elif fmt in ("markdown", "csv"):
        from vramplan.report.answers import estimate_table
        print(estimate_table(est, depth=args.depth).render(fmt), end="")
    else:
        from rich.console import Console
        from rich.markup import escape

        from vramplan.report.answers import parallel_lines
        from vramplan.report.text import render_estimate
        console = Console()
        render_estimate(est, console=console, depth=args.depth)
        for line in parallel_lines(est):
            console.print(escape(tr(line)))
    return fit_status(est.fits)


def fit_status(fits: bool | None) -> int:
    """The exit status of every answering command: 0 fits (or no GPU to fit against),
    1 does not fit. Bad input is 2, from main()."""
    return 1 if fits is False else 0


def cmd_measure(args) -> int:
    from vramplan.cli.measure import measure_main
    result = measure_main(args)
    if args.json:
        print(json.dumps(result, indent=2))
    from vramplan.cli.measure import refusal_line
    line = refusal_line(result)  # a job `measure` does not build: bad input, exit 2
    if line:
        print(line, file=sys.stderr)
        return 2
    return 0


# Commands this module defines; `_main` builds only the named one's flags (build_parser's `only`).
_OWN_COMMANDS = ("estimate", "models", "gpus", "measure")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only` (one of _OWN_COMMANDS), that command alone: the
    same subparser, without building every other command's flags or importing cli.plan
    (about a fifth of `vramplan estimate`'s start-up)."""
    parser = _Parser(prog="vramplan", description=_("Per-GPU peak memory of a training step, in named terms."),
                     epilog=_(EXIT_STATUS_HELP))
    parser.add_argument("--version", action="version", version=f"vramplan {_version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    if only in (None, "estimate"):
        est = sub.add_parser("estimate", help=_("estimate one GPU's peak memory for a job"))
        _add_spec_args(est)
        add_format_args(est)
        est.add_argument("--depth", type=int, default=2, help=_("group terms by this many key parts"))
        est.add_argument("--plot", help=_("write the breakdown as stacked bars (.png, .svg or interactive .html)"))
        est.set_defaults(func=cmd_estimate)
        est.epilog = _(EXIT_STATUS_HELP)
    for name, fn, help_ in (("models", cmd_models, N_("the built-in catalog: language, vision-language, diffusion")),
                            ("gpus", cmd_gpus, N_("the built-in GPU catalog"))):
        if only not in (None, name):
            continue
        p = sub.add_parser(name, help=_(help_))
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=fn)
        if name == "models":
            p.add_argument("name", nargs="?", help=_("only names or hub ids containing this text"))
            p.add_argument("--kind", choices=("llm", "vlm", "diffusion"), help=_("only this kind"))
    if only in (None, "measure"):
        m = sub.add_parser("measure", help=_("run real training steps and record the true peak"))
        _add_spec_args(m)
        m.add_argument("--device", default=None, help=_("cpu or cuda (default: cuda if available)"))
        m.add_argument("--fake", action="store_true", help=_("run under FakeTensorMode: no memory used"))
        m.add_argument("--trace", action="store_true",
                       help=_("list the tensors alive at the peak; on CUDA, also record the caching "
                              "allocator's trace and replay it through the allocator model"))
        m.add_argument("--json", action="store_true")
        m.set_defaults(func=cmd_measure)
    if only is not None:
        return parser
    __import__("vramplan.cli.plan").cli.plan.register(sub, _add_spec_args, spec_from_args)
    __import__("vramplan.cli.serve").cli.serve.register(sub)
    comp = sub.add_parser("completion", help=_("print a shell completion script (shtab)"),
                          description=_("eval \"$(vramplan completion bash)\", or for zsh write it to a file "
                                        "named _vramplan on your $fpath"))
    comp.add_argument("shell", choices=("bash", "zsh", "tcsh"))
    comp.set_defaults(func=cmd_completion)
    for name in ("compare", "fit", "check"):
        sub.choices[name].epilog = _(EXIT_STATUS_HELP)
    return parser


def _version() -> str:
    from vramplan import __version__
    return __version__


def _error(message: str) -> int:
    """One line on stderr, exit 2 (bad input)."""
    print(error_line(" ".join(str(message).split())), file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    set_language(language_for(sys.argv[1:] if argv is None else argv))
    try:
        return _main(argv)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # a bug, not the user's input: still one line, no traceback
        if os.environ.get("VRAMPLAN_DEBUG") == "1":
            raise
        from vramplan.spec.enums import internal_error_line
        print(internal_error_line(exc), file=sys.stderr)
        return 70


def _main(argv: list[str] | None) -> int:
    try:
        words = dashed(sys.argv[1:] if argv is None else list(argv))
        only = words[0] if words and words[0] in _OWN_COMMANDS else None
        args = build_parser(only).parse_args(words)
        check_paths(args)
        if not getattr(args, "func", None):
            build_parser().print_help()
            return 2
        code = args.func(args)
        if code != 2:  # 2: the command said its one error line itself (check: no local GPU)
            say_notes(args)
        return code
    except UsageError as exc:
        return _error(exc)
    except (SpecError, ValueError, KeyError, NotImplementedError, ArithmeticError) as exc:
        # SpecError, importer and catalog input errors; KeyError's quotes dropped
        from vramplan.spec.enums import user_error_line
        print(user_error_line(exc), file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as exc:  # --plot / --save-spec to a missing folder, onto a folder, ...
        return _error(f"{exc.filename or 'file'}: {exc.strerror or type(exc).__name__}")
    except ImportError as exc:
        print(error_line(f"{exc.name or exc} is not installed; pip install 'vramplan[measure]'"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
