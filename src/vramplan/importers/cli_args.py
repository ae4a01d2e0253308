"""What the CLI calls for --deepspeed, --training-args, --accelerate-config and --recipe:
read each file (JSON or YAML), import it, and merge the results in a fixed order
(recipe, accelerate config, training arguments, DeepSpeed: later, more specific files win)."""
from __future__ import annotations

import os

from vramplan.importers.accelerate_cfg import from_accelerate
from vramplan.importers.deepspeed import from_deepspeed
from vramplan.importers.hf_args import from_training_args
from vramplan.importers.recipes import from_recipe
from vramplan.files import FileReadError, read_mapping, read_text
from vramplan.importers.report import ImportError_, ImportReport, merge


def read_config(path: str) -> dict:
    """A JSON or YAML file as a mapping; errors are one line naming the file."""
    try:
        return read_mapping(path)
    except FileReadError as exc:
        raise ImportError_(str(exc), path) from None


def read_recipe(path: str) -> tuple[dict, ImportReport]:
    """A recipe file: a YAML/JSON mapping (axolotl, LLaMA-Factory, torchtune, ms-swift), or a
    shell script / command line that runs `swift sft|pt|rlhf` (importers/shell.py, ms_swift.py)."""
    from vramplan.importers.ms_swift import from_swift
    from vramplan.importers.shell import looks_like_command, parse_command
    try:
        text = read_text(path)
    except FileReadError as exc:
        raise ImportError_(str(exc), path) from None
    if path.endswith(".sh") or (not path.endswith((".yaml", ".yml", ".json")) and looks_like_command(text)):
        cfg, command, env = parse_command(text, path, base_dir=os.path.dirname(path), read_file=read_config)
        return from_swift(cfg, path, command=command, env=env)
    return from_recipe(read_config(path), source=path)


def import_config_files(deepspeed: str | None = None, training_args: str | None = None,
                        accelerate_config: str | None = None, recipe: str | None = None,
                        named_files: bool = True) -> tuple[dict, list[str]]:
    """Spec overrides (a mapping for vramplan.spec.load_spec) and report lines.
    Raises ImportError_ (a ValueError) with one line naming the file and field.
    `named_files=False` (the web API) reads no DeepSpeed JSON that a file names by path: on a
    server that path is the server's."""
    overrides: dict = {}
    lines: list[str] = []
    ds_path = deepspeed
    for path, read in ((recipe, read_recipe), (accelerate_config, lambda p: from_accelerate(read_config(p), source=p)),
                       (training_args, lambda p: from_training_args(read_config(p), source=p))):
        if not path:
            continue
        out, rep = read(path)
        inline = out.pop("__deepspeed__", None)
        gc = (out.get("parallel") or {}).pop("__gc__", None)
        if gc:
            out["gradient_checkpointing"] = "full"
        if inline is not None and ds_path is None:
            ds_path = inline
        merge(overrides, out)
        lines += rep.lines()
    if ds_path:
        if isinstance(ds_path, dict):
            cfg, source = ds_path, "deepspeed (inline)"
        elif not named_files and ds_path is not deepspeed:
            raise ImportError_(training_args or recipe or accelerate_config or "config", "deepspeed",
                               "the web API reads no files on the server; import the DeepSpeed JSON "
                               "itself (kind deepspeed) or give it inline")
        else:
            base = os.path.dirname(training_args or recipe or accelerate_config or "")
            path = ds_path if os.path.isabs(ds_path) or os.path.isfile(ds_path) else os.path.join(base, ds_path)
            cfg, source = read_config(path), path
        context = {k: overrides[k] for k in ("micro_batch_size", "grad_accum_steps", "precision") if k in overrides}
        out, rep = from_deepspeed(cfg, context, source=source)
        merge(overrides, out)
        lines += rep.lines()
    return overrides, lines
