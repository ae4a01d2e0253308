"""One-line errors in the user's language, translated at the CLI edge by template.

Errors are raised deep in the spec, catalog and importers with English text built from
values (`SpecError(field, f"expected an integer >= {minimum}, got {value!r}")`). Rather
than thread a language through the core, the CLI matches the finished English line
against the templates below (their `{name}` placeholders match any text) and formats the
translated template with the same values. A line no template matches stays in English, so
a new or reworded error is never lost, only untranslated; tests/test_i18n.py raises each
common error through the CLI and checks that its template still matches.

The shape handled: `[field: ]message[ Did you mean 'x'?]`, as SpecError, the catalog's
UnknownNameError and argparse write them.
"""
from __future__ import annotations

import functools
import re

from vramplan.i18n import N_, _

TEMPLATES = (
    # vramplan.spec: SpecError messages (the field name is kept as it is)
    N_("unknown value {value}; choose one of {choices}."),
    N_("expected an integer >= {minimum}, got {value}"),
    N_("expected a number in [{low}, {high}], got {value}"),
    N_("expected a mapping, got {value}"),
    N_("unknown spec key"),
    N_("unknown key"),
    N_("no such file or folder: {path}"),
    N_("must be 0, 1, 2 or 3, got {value}"),
    N_("planning needs a GPU: pass --gpu (see `vramplan gpus`)"),
    N_("expected e.g. 2GiB, 1.5GB, 512MiB, 5% or 0.05, got {text}"),
    N_("expected one of {choices}; got {kind}"),
    N_("is empty; choose one of {choices}"),
    N_("expected true or false, got {value}; write true or false without quotes"),
    N_("expected true or false, got {value}; write it without quotes"),
    N_("expected true or false, got {value}"),
    N_("expected a mapping of settings, got {value}"),
    N_("must be 1 or 2, got {value}"),
    N_("no change in {text}; e.g. {example}"),
    N_("a strategy changes flags of the job, not its model or files: {text}"),
    N_("required: a catalog name, a config.json path, a hub id, an inline HF config, or num_params"),
    N_("unknown axis {name}"),
    N_("fit tries every micro-batch that divides the global batch, gradient accumulation making up the rest, so "
       "{name} is no axis; drop it, or use --maximize micro_batch_size"),
    N_("checkpointing one layer in N needs gradient_checkpointing full; set gradient_checkpointing: full or "
       "checkpoint_every: 1"),
    N_("{n} is not divisible by tp*pp*cp = {product}"),
    N_("{n} GPUs do not split into tp x pp x cp = {product}; use a multiple of {multiple}"),
    N_("{what} are past {model}'s {limit} learned positions (max_position_embeddings); use seq_len <= {use}"),
    N_("PEFT refuses LoRA on {model}'s {modules} (Mamba-based models); name the modules to adapt without "
       "{without}, e.g. {example}"),
    N_("PEFT cannot wrap {model}'s {modules} with LoRA (its forward returns a tuple); name the modules to adapt "
       "instead of all-linear, without {without}"),
    N_("PEFT has no default target modules for model type {mtype} ({model}); name some of its layer modules "
       "({names}) or all-linear"),
    N_("{targets} match no module of {model}; name some of its layer modules ({names}) or all-linear"),
    # vision-language jobs (jobs/vlm.py, jobs/qwen_vl.py, spec/tasks.py VisionConfig)
    N_("{low} is above {high}; make it at most {limit}"),
    N_("this model's vision tower takes images only; set it to 0"),
    N_("with LoRA the adapters go on the language model only and the vision tower stays frozen; set it to true, "
       "or use method full"),
    N_("{detail} ({height} x {width} pixels); the processor refuses such an image"),
    N_("{visual} visual tokens + seq_len {seq_len} = {total} tokens, over the language model's {limit} positions; "
       "lower vision.max_pixels, the image size or the number of images/frames"),
    # Gemma 3 and LLaVA-OneVision (jobs/gemma3_vl.py, jobs/llava_onevision.py, their families' vision.py)
    N_("Gemma 3 with images needs the bidirectional image-token mask, which flash attention drops (transformers "
       "refuses it); use sdpa or eager"),
    N_("SigLIP's attention-pooling head (unused by {model}) is not modelled; set it to false, as the published "
       "{configs} configs do"),
    N_("{tokens} must be a square whose side divides the {g} patches per side (Gemma3MultiModalProjector's AvgPool2d)"),
    N_("videos of LLaVA-OneVision are not modelled yet; set it to 0"),
    N_("LLaVA-OneVision with features other than the last layer's, all patches kept (-1, full), is not modelled"),
    N_("expected anyres_max_N, got {value}"),
    # vramplan.spec: label_smoothing (spec/tasks.py check_task_fields)
    N_("is modelled for the HF Trainer's LabelSmoother (task sft, stack hf-trainer, loss_impl standard); "
       "use those or drop label_smoothing"),
    # vramplan.spec: keep_logits (spec/tasks.py check_keep_logits)
    N_("is modelled for tasks sft, pretrain and sequence-classification, not {task}; drop keep_logits"),
    N_("the fused linear cross-entropy never builds the logits; drop keep_logits or use loss_impl standard"),
    N_("Megatron's GPTModel returns the per-token loss, not the logits, when given labels; drop keep_logits"),
    N_("TRL's SFTTrainer computes its loss in a fused log-prob head that never builds the logits; drop keep_logits"),
    # vramplan.spec: float8 training and NEFTune (spec/float8.py, spec/job.py)
    N_("float8 training converts the trained nn.Linear layers; with {method} it is not modelled; "
       "use method full or freeze"),
    N_("torchao's Float8Linear follows CUDA autocast only; on cpu use precision fp32 or bf16"),
    N_("needs FSDP2 sharding (parallel.fsdp full-shard, shard-grad-op or hybrid-shard with fsdp_version 2); "
       "drop it otherwise"),
    N_("needs recipe tensorwise (torchao casts the weight before the all-gather only with one scale per tensor)"),
    N_("expected a recipe name (tensorwise, rowwise, rowwise-with-gw-hp) or a mapping, got {value}"),
    N_("expected a positive number (5 in the NEFTune paper), got {value}"),
    N_("unknown key; choose from {keys}"),
    # vramplan.spec: the quantization section (spec/sections.py QuantConfig, spec/job.py)
    N_("{qtype} does not go with bits={bits}; {qtype2} stores {widths} bits"),
    N_("{qtype} has no groups; drop group_size (bitsandbytes blocks are block_size)"),
    N_("{kernel} has no backward (GPTQModel SUPPORTS_TRAINING); train on {kernels}"),
    N_("{qtype} runs on {kernels}; got {value}"),
    N_("is a GPTQ setting; {qtype} has no act-order"),
    N_("{group} does not divide in_features {n} of {name}; AWQ needs whole groups (use a divisor of {m})"),
    N_("{value} is not a multiple of {step} (VAE factor {vae} x patch {patch}); use e.g. {near}"),
    N_("{frames} frames do not fit {model}'s VAE: use {rule} frames, e.g. {near}"),
    N_("{value} is {patches} patches a side, past the {most} that {model}'s position embedding holds; use at most "
       "{limit}"),
    N_("{frames} frames are {n} latent positions in time, past the {most} that {model}'s rotary table holds; "
       "use at most {limit} frames"),
    N_("the diffusers training scripts checkpoint every block (--gradient_checkpointing), not one in N; drop "
       "checkpoint_every"),
    N_("torchao float8 training of a diffusion denoiser is not modelled; drop float8"),
    N_("a quantized frozen base (QLoRA) is modelled on language models, not on diffusion denoisers; use method "
       "lora"),
    N_("a diffusion denoiser is modelled with diffusers' default attention processor (torch's "
       "scaled_dot_product_attention); use attention sdpa"),
    # vramplan.spec and vramplan.rawsize: a model given by its size (num_params)
    N_("describes a model given by its size, not by `model`; drop one of them"),
    N_("expected a count like 7e9, 7B or 125M, got {text}"),
    N_("is past any published model ({layers} layers); use at most {limit}"),
    N_("an MLP {ratio} x as wide as the hidden size would hold {n} parameters in {layers} layers of hidden size {h}; "
       "give a larger --hidden-size or more --num-layers"),
    N_("required in the {section} section; add {name}: <value>"),
    N_('expected "key=value,key=value", got {value}'),
    # vramplan.catalog.hf_check / hf_config: a config.json's fields
    N_("{kind} config field {key} must be an integer >= {low}, got {value}"),
    N_("{kind} config field {key} must be a number (not null), got None"),
    N_("{kind} config field {key} must be at most {limit} (no published model has more), got {value}"),
    N_("{kind} config field {key} must be a number in [0, 1], got {value}"),
    N_("{kind} config field {key} must be a number > 0, e.g. 2.0 (transformers divides the rotary frequencies by "
       "it; 1 leaves them as they are), got {value}"),
    N_("{kind} config field {key} must be true or false, got {value}"),
    N_("{kind} config field {key} must be an activation of transformers' ACT2FN ({names}), got {value}"),
    N_("{kind} config field {key} must be a positive integer, got {value}"),
    N_("{kind} config field {key} must be an activation of ACT2FN or gated-<activation>, e.g. relu or gated-gelu, "
       "got {value}"),
    N_("{kind} config is missing required field {key}"),
    # vramplan.spec: counts past any job, GRPO, an image pipeline's frames
    N_("{n} GPUs are past any cluster built; use at most {limit}"),
    N_("{trainer} needs at least 2 completions per prompt to compute its advantages (trl {config}); use "
       "num_generations >= 2"),
    N_("TRL's {trainer} generates whole groups of {gens} completions per prompt ({named}), but a step generates {rows} "
       "({what} x {dp} data-parallel GPUs); raise micro_batch_size or grad_accum_steps to generate a multiple of "
       "{gens2} per step"),
    N_("TRL's {trainer} generates whole groups of {gens} completions per prompt ({named}), but a step generates {rows} "
       "({what} x {dp} data-parallel GPUs); set num_generations to a divisor of {rows2} (at least 2), or raise "
       "micro_batch_size or grad_accum_steps to generate a multiple of {gens2} per step"),
    N_("{given} is not a whole number of micro-batches of {mb}; TRL refuses it ({config}: generation_batch_size "
       "divisible by the global batch); use a multiple of {mb2}"),
    N_("{model} makes images (its VAE has no time axis), not {frames}-frame videos; drop num_frames"),
    N_("quantization_config field {key} must be an integer, got {value}"),
    N_("{kind} config field {key} has {n} entries; give one per layer ({layers}, num_hidden_layers)"),
    N_("diffusion LoRA is modelled on diffusers' training scripts' targets ({targets}); drop target_modules or "
       "name those, got {value}"),
    N_("{total} is not micro batch x gradient accumulation ({per_rank}) x a number of GPUs; DeepSpeed refuses it "
       "(_batch_assertion)"),
    N_("applies to method lora or qlora, not {method}; set method lora (TRL: --use_peft) or drop the lora settings"),
    N_("applies to method freeze, not {method}; set method freeze or drop the freeze section"),
    N_("expected a number of bytes >= 0, got {value}"),
    # vramplan.plan and cli.plan: compare / fit options
    N_("the value is empty; give a size like 2GiB or 512MiB, or drop --headroom"),
    N_("a share of the GPU is not taken here; give a size like 2GiB or 512MiB, got {text}"),
    N_("{text} leaves nothing of the GPU's {gib} GiB for the job; keep less free, e.g. 5% or 2GiB"),
    N_("expected a number in (0, 1] (model FLOPs utilization, e.g. 0.4), got {value}"),
    N_("bounds --minimize num_gpus; add --minimize num_gpus or drop --max-gpus"),
    N_("no layout to search: no combination of the axes is a valid layout of this job (its global batch of {n} "
       "rows split over the data-parallel GPUs, heads over tp, layers over pp); open other values"),
    N_("{path}: entry {k} must be a mapping with a name and its changes, got {item}"),
    N_("{path} must hold a list of entries, each a name and its changes"),
    N_("{path}: entries {first} and {second} are both named {name}; give each entry a name of its own"),
    N_("two strategies are named {name}; give each a name of its own"),
    # cli.measure, cli.serve
    N_("expected cpu, cuda or cuda:N, got {value}"),
    N_("no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu or --fake"),
    N_("no GPU {device}: {n} visible"),
    N_("expected a port number from 1 to 65535, got {value}"),
    # badinput3: a model of the wrong kind, engine knobs, ignored fields
    N_("{name} is not a diffusion pipeline; task diffusion needs one from `vramplan models` (e.g. flux.1-dev), "
       "or drop task diffusion for a language model"),
    N_("{name} is not a vision-language model; drop the vision section, or use a model from `vramplan models` "
       "that takes images"),
    N_("unknown engine setting"),
    N_("quantization_config must be a mapping with quant_method (as transformers saves it), got {value}"),
    N_("config field {key} must be a torch dtype name (bfloat16, float16, float32, ...), got {value}"),
    N_("expected one of {choices}, got {value}"),
    N_("LLaMA-Factory quantizes only for finetuning_type lora, not {ft}; set finetuning_type: lora or drop "
       "quantization_bit"),
    N_("no catalog model has {name} in its name or hub id; run `vramplan models` for the list, or pass a "
       "hub id or config.json to estimate"),
    N_("no catalog model of kind {kind} has {name} in its name or hub id; run `vramplan models` for the list, "
       "or pass a hub id or config.json to estimate"),
    N_("pp {pp} x {v} virtual stages = {chunks} model chunks for {name}'s {layers} layers: every chunk needs a "
       "layer; use virtual_stages <= {most}"),
    N_("{group} does not divide {ranks}, the data-parallel ranks hybrid-shard splits into (replicate, shard) "
       "groups; use a shard group size that divides it, e.g. the GPUs per node"),
    N_("only optimizer sgd takes momentum, not {optimizer}; drop momentum or set optimizer: sgd"),
    N_("task {task} has no classification head; drop num_labels or set task: sequence-classification"),
    N_("task {task} does not pack rows (TRL's trainer for it has no packing or padding_free); drop packing, or "
       "use task {tasks}"),
    N_("this job needs {size} PiB per GPU, beyond any GPU (the largest hold a few hundred GB); lower "
       "micro_batch_size or seq_len, or shard more"),
    N_("this job needs {size} PiB per GPU, beyond any GPU (the largest hold a few hundred GB); lower it"),
    N_("this job needs {size} PiB per GPU, beyond any GPU (the largest hold a few hundred GB); lower "
       "diffusion.height, width or num_frames"),
    # spec/lengths.py: a percentile given twice; the size of a lengths replay
    N_("{first} and {second} both give percentile {p}; keep one of them"),
    N_("a bucket of {bucket} tokens cuts {limit} tokens into {count} padded lengths, each replayed as its own step "
       "(at most {most}); use bucket >= {least}, or leave it out (seq_len / 16)"),
    N_("a micro-batch of {batch} rows is past what a lengths replay draws ({most} rows); lower micro_batch_size "
       "or drop the lengths section"),
    N_("{steps} steps of {batch} rows draw {rows} rows (at most {most}); use steps <= {least}"),
    N_("micro_batch_size {best} still fits, and a lengths replay of {steps} steps draws at most {rows} rows; "
       "lower lengths.steps to search larger micro-batches"),
    # sources.py: a hub id fetched with --online; catalog/model_index_counts.py: safetensors headers
    N_("{hub_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so the hub is not asked; unset "
       "HF_HUB_OFFLINE, or pass a local config.json path or model folder"),
    N_("cannot reach the hub to fetch config.json for {hub_id} ({kind}: no network?); pass a local config.json path "
       "or model folder, or drop --online to use the catalog and the local cache"),
    N_("the hub has no config.json for {hub_id} that this machine may read ({kind}); check the id (a gated or "
       "private model needs `hf auth login`), or pass a local config.json"),
    N_("{path}: tensor {name} has shape {shape}, not a list of sizes; check the download, or remove the file to "
       "count from config.json"),
    # cli/measure.py, plan/solve.py, web/api.py
    N_("measuring this job on cpu holds about {need} GiB ({ranks} process(es) at the estimate's peak) and this "
       "machine has {free} GiB available; use --fake (FakeTensorMode, no memory) or a smaller job"),
    N_("a diffusion job reads no seq_len (its tokens come from height, width and num_frames); maximize "
       "micro_batch_size"),
    N_("the request body gives {key} twice; keep one"),
    N_("measure runs one process, or DeepSpeed ZeRO ranks (zero_stage >= 1), not {what}; measure num_gpus 1 or a "
       "ZeRO layout (bench/parallel/ holds the others)"),
    # spec/lora.py, spec/stack.py
    N_("{targets} is a regex, which PEFT matches against full module names and vramplan does not model; list the "
       "module names it matches (e.g. [q_proj, v_proj]) or use all-linear"),
    N_("the number {text} may be a release like {text0} read as a number; write it in quotes ({quoted})"),
    # vramplan.files: spec and config files
    N_("{path}: file not found"),
    N_("{path}: not a regular file; pass the path of a YAML/JSON file"),
    N_("{path}: not valid JSON/YAML ({detail})"),
    N_("{path}: not valid JSON ({detail})"),
    N_("{path}: not valid YAML ({detail})"),
    N_("{path}: is a folder; pass the YAML/JSON file inside it"),
    N_("{path}: duplicate key {key}; keep one"),
    N_("{path}: not UTF-8 text (byte {byte}); save it as UTF-8 YAML or JSON"),
    N_("{path}: expected a mapping (key: value lines) at the top level, found {kind}"),
    # vramplan.catalog: UnknownNameError
    N_("unknown model {name}"),
    N_("unknown GPU {name}"),
    N_("GPU {name} is ambiguous: pass one of {choices}"),
    N_("GPU size {text} needs a unit: {gb} (10^9 bytes, as datasheets count) or {gib} (2^30 bytes, as PyTorch counts)"),
    N_("GPU size {text} is too small to hold a training step"),
    # argparse's usage errors (Python 3.10-3.13 wording)
    N_("argument {arg}: invalid {kind} value: {value}"),
    N_("argument {arg}: invalid choice: {value} (choose from {choices})"),
    N_("unrecognized arguments: {args}"),
    N_("the following arguments are required: {args}"),
    N_("argument {arg}: expected one argument"),
    N_("argument {arg}: expected true or false, got {value}"),
    # vramplan.check
    N_("no local GPU (NVML and torch.cuda found none); pass a catalog GPU (--gpu / gpu=) to check against its "
       "total memory"),
    N_("no GPU {index}: visible devices are {devices}"),
    # cli.main
    N_("{name} is not installed; pip install {extra}"),
    # web.app: the JSON API's requests
    N_("the request is {size} bytes; a spec is at most {limit}"),
    N_("the request body is not JSON: {detail}"),
    N_("expected a mapping of spec fields, got {kind}"),
    N_("expected a number, got {value}"),
    N_("expected a number > 0, got {value}"),
    # web.static_build
    N_("{path} lacks {files}: give the folder of the npm package pyodide (npm pack pyodide; tar xzf; its "
       "package/ folder)"),
    N_("{path} is not empty; give a new or empty folder"),
    N_("--static-build OUT and --pyodide DIR go together"),
    N_("shell completion needs shtab: pip install {extra}"),
)
HINT = N_("did you mean {suggestion}?")

_HINT_RE = re.compile(r"(?P<body>.*?)(?:;| ) ?[Dd]id you mean (?P<suggestion>.+)\?")
_FIELD_RE = re.compile(r"(?P<field>[\w./~\[\]-]+(?: \([\w-]+\))?): (?P<rest>.+)", re.S)
"""`field: rest`; a config file's path may stand before the field (`ds.json: zero_optimization.stage: ...`),
with the recipe's kind after it (`train.yaml (llama-factory): cutoff_len: ...`)."""


def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>.+?)" for i, p in enumerate(parts))
    return re.compile(regex, re.S)


@functools.lru_cache(maxsize=1)
def _patterns() -> tuple[tuple[str, re.Pattern], ...]:
    """Each template's pattern, compiled on the first error translated (~15 ms at import otherwise)."""
    return tuple((t, _pattern(t)) for t in TEMPLATES)


def _translate_body(text: str) -> str | None:
    for template, pattern in _patterns():
        m = pattern.fullmatch(text)
        if m is not None:
            return _(template).format(**m.groupdict())
    m = _FIELD_RE.fullmatch(text)
    if m is not None:
        rest = _translate_body(m["rest"])
        if rest is not None:
            return f"{m['field']}: {rest}"
    return None


def localize(text: str) -> str:
    """The English error line in the current language; unchanged when no template matches."""
    text = str(text)
    m = _HINT_RE.fullmatch(text)
    body, hint = (m["body"], m["suggestion"]) if m else (text, None)
    translated = _translate_body(body)
    if translated is None:
        return text
    if hint is not None:
        said = _(HINT).format(suggestion=hint)
        if translated.endswith("."):  # a new sentence: "... mixed-fp16. Did you mean 'bf16'?"
            translated += " " + said[:1].upper() + said[1:]
        else:
            translated += ("" if translated.endswith(("。", "；")) else _("; ")) + said
    return translated


def error_line(exc) -> str:
    """`vramplan: error: <message>` with both parts in the current language; a word longer
    than a line (a pasted 5,000-character value echoed back, often twice) is cut, so the
    line still shows the field and the fix."""
    return "vramplan: " + _("error: ") + _LONG_WORD.sub(_cut, localize(str(exc)))


_LONG_WORD = re.compile(r"\S{201,}")


def _cut(match) -> str:
    word = match.group(0)
    tail = re.search(r"[':,;.)]*$", word).group(0)[-3:]  # the closing quote or colon stays
    return f"{word[:100]}...({len(word):,} characters){tail}"
