"""ms-swift's own training step, measured: each case is a `swift sft`, `swift pt` or `swift rlhf`
(DPO) command line run by ms-swift's real entry (`swift.pipelines.sft_main` / `pretrain_main` /
`rlhf_main`: its argument parser and defaults, model loader, tuner setup, template, collator,
`logits_to_keep` and Seq2SeqTrainer or DPOTrainer) for two optimizer steps on CPU, in a fresh
process, under vramplan's exact meter (`vramplan.measure.trainer_meter.metered_train`, the
phases of bench/trainers), next to `vramplan.estimate` of the job the same command line
imports to (`vramplan.importers.ms_swift`).

    /tmp/swiftenv/bin/python bench/stack/ms_swift.py               # all cases -> results-ms-swift.json
    /tmp/swiftenv/bin/python bench/stack/ms_swift.py --only full   # those cases, merged into it
    python bench/stack/ms_swift.py --reestimate                    # new estimates, same measurements
    python bench/stack/ms_swift.py --summary

Run the measuring with an interpreter that has ms-swift 4.6.0 (it pins transformers < 5.20,
peft < 0.21 and trl < 1.0, so it lives in its own venv: bench/stack/README.md says how);
`src/` is put on the path. The model is a tiny random Llama saved in bf16 (as hub checkpoints
are) with a word-level tokenizer and ms-swift's `default` template; the data a local JSONL
whose answers are longer than `max_length`, cut by `--truncation_strategy right`, so every
row is exactly `max_length` tokens and its labels start after the prompt. The case's
`prompt_len` (the spec key) is checked against the labels ms-swift builds: the run fails
if they differ.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
sys.path[:0] = [str(SRC), str(HERE)]
from harness import MEASURED, Bench, errors, estimate  # noqa: E402,F401  (errors, estimate: for its test)
OUT = HERE / "results-ms-swift.json"

TINY = {"model_type": "llama", "vocab_size": 8000, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "tie_word_embeddings": False, "max_position_embeddings": 1024}
"""The tiny model every case trains, saved in bfloat16."""

BASE = ["--model_type", "llama", "--template", "default", "--max_length", "256",
        "--truncation_strategy", "right", "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "1", "--max_steps", "2", "--save_strategy", "no",
        "--report_to", "none", "--dataloader_num_workers", "0", "--use_cpu", "true",
        "--split_dataset_ratio", "0", "--logging_steps", "1000", "--seed", "0"]
"""What every case's command line holds (ms-swift's examples/train/*.sh options); the paths
(`--model`, `--dataset`, `--output_dir`) are added at run time. A case's own options come
after these, so they win (HfArgumentParser keeps the last); an option given as `None` is
dropped from both, so ms-swift's own default applies."""

PROMPT_WORDS = 8
"""Words of each row's user turn; the `default` template adds 9 tokens around them."""

CASES = [
    # name, command, options, user words, prompt_len (tokens before the first label)
    ("sft/lora/b2/gc", "sft", [], PROMPT_WORDS, 17),
    ("sft/lora/b1/gc", "sft", ["--per_device_train_batch_size", "1"], PROMPT_WORDS, 17),
    ("sft/lora/b2/no-gc", "sft", ["--gradient_checkpointing", "false"], PROMPT_WORDS, 17),
    ("sft/lora/b2/gc/long-prompt", "sft", [], 120, 129),
    ("sft/lora/b1/no-gc/long-prompt", "sft", ["--per_device_train_batch_size", "1",
                                              "--gradient_checkpointing", "false"], 120, 129),
    ("sft/lora/b2/gc/r16-q+v-no-dropout", "sft", ["--lora_rank", "16", "--lora_dropout", "0",
                                                   "--target_modules", "q_proj", "v_proj"], PROMPT_WORDS, 17),
    ("sft/lora/b2/gc/fp32-load", "sft", ["--torch_dtype", "float32", "--fp16", "false", "--bf16", "true"], PROMPT_WORDS, 17),
    ("sft/lora/b8/gc/accum-default", "sft", ["--per_device_train_batch_size", "8",
                                             "--gradient_accumulation_steps", "None"], PROMPT_WORDS, 17),
    ("sft/full/b2/gc", "sft", ["--tuner_type", "full"], PROMPT_WORDS, 17),
    ("sft/full/b1/no-gc", "sft", ["--tuner_type", "full", "--per_device_train_batch_size", "1",
                                  "--gradient_checkpointing", "false"], PROMPT_WORDS, 17),
    ("sft/full/b2/gc/sgd", "sft", ["--tuner_type", "full", "--optim", "sgd"], PROMPT_WORDS, 17),
    # QLoRA: bitsandbytes nf4 (runs on CPU since 0.49), double quantization by ms-swift's default
    ("sft/qlora/b2/gc", "sft", ["--quant_method", "bnb", "--quant_bits", "4"], PROMPT_WORDS, 17),
    ("sft/qlora/b1/no-gc", "sft", ["--quant_method", "bnb", "--quant_bits", "4", "--per_device_train_batch_size",
                                   "1", "--gradient_checkpointing", "false"], PROMPT_WORDS, 17),
    ("pt/lora/b2/gc", "pt", [], 0, None),
    # swift rlhf (DPO): chosen and rejected rows through ms-swift's DPOTrainer
    ("dpo/lora/b1/gc", "rlhf", ["--per_device_train_batch_size", "1"], PROMPT_WORDS, 17),
    ("dpo/lora/b2/no-gc", "rlhf", ["--gradient_checkpointing", "false"], PROMPT_WORDS, 17),
    ("dpo/lora/b1/gc/long-prompt", "rlhf", ["--per_device_train_batch_size", "1"], 120, 129),
    ("dpo/full/b1/gc", "rlhf", ["--per_device_train_batch_size", "1", "--tuner_type", "full"], PROMPT_WORDS, 17),
    ("ipo/lora/b1/gc", "rlhf", ["--per_device_train_batch_size", "1", "--loss_type", "ipo"], PROMPT_WORDS, 17),
    # swift rlhf --rlhf_type rm: chosen and rejected rows through a one-output classifier
    ("rm/lora/b1/gc", "rlhf", ["--rlhf_type", "rm", "--per_device_train_batch_size", "1"], PROMPT_WORDS, None),
    ("rm/full/b2/no-gc", "rlhf", ["--rlhf_type", "rm", "--tuner_type", "full", "--gradient_checkpointing",
                                  "false"], PROMPT_WORDS, None),
]

OPEN: dict[str, str] = {}
"""Cases outside the targets, with the mechanism the estimate lacks."""


def case(name: str) -> tuple[str, list[str], int, int | None]:
    for c in CASES:
        if c[0] == name:
            return c[1], _options(BASE + c[2]), c[3], c[4]
    raise KeyError(name)


def _options(argv: list[str]) -> list[str]:
    """`--key value...` pairs, later ones replacing earlier ones, `None` dropping the key."""
    pairs: dict[str, list[str]] = {}
    for word in argv:
        if word.startswith("--"):
            key = word
            pairs.pop(key, None)
            pairs[key] = []
        else:
            pairs[key].append(word)
    return [w for k, v in pairs.items() if v != ["None"] for w in (k, *v)]


def import_case(name: str) -> dict:
    """The job vramplan imports from the case's command line (importers/ms_swift.py), with
    the model the command's `--model` points at given as its config."""
    from vramplan.importers.ms_swift import from_swift
    from vramplan.importers.shell import parse_command

    command, argv, _, prompt_len = case(name)
    cfg, sub, env = parse_command(" ".join(["swift", command, "--model", "tiny-llama", *argv]), name)
    out, _ = from_swift(cfg, name, command=sub, env=env)
    job = {**out, "model": {**TINY, "dtype": "bfloat16"}}
    if prompt_len is not None:
        job["prompt_len"] = prompt_len
    return job


# ------------------------------------------------------------------ the child (ms-swift)

def write_assets(root: Path, user_words: int, pairs: bool = False) -> tuple[str, str]:
    """Save the tiny model and its tokenizer, and the case's data; (model dir, data file)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vramplan.measure import trl_data

    torch.manual_seed(0)
    cfg = dict(TINY)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(root / "model")
    trl_data.tokenizer(TINY["vocab_size"]).save_pretrained(root / "model")
    vocab, n = TINY["vocab_size"], 32
    if user_words:
        rows = [{"messages": [{"role": "user", "content": trl_data.words(user_words, i, vocab)},
                              {"role": "assistant", "content": trl_data.words(600, 100 + i, vocab)}]}
                for i in range(n)]
    else:
        rows = [{"text": trl_data.words(600, i, vocab)} for i in range(n)]
    if pairs:  # ms-swift's preference format: the chosen answer in messages, the rejected beside
        for i, row in enumerate(rows):
            row["rejected_response"] = trl_data.words(600, 200 + i, vocab)
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(root / "model"), str(root / "data.jsonl")


def child(name: str) -> dict:
    """Run the case's command line through ms-swift's entry, metering its trainer's train()."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MODELSCOPE_OFFLINE", "1")
    import swift
    import torch
    from swift.pipelines import pretrain_main, rlhf_main, sft_main
    from swift.rlhf_trainers import DPOTrainer, RewardTrainer
    from swift.trainers import Seq2SeqTrainer

    from vramplan.measure.trainer_meter import metered_train

    command, argv, words, prompt_len = case(name)
    root = Path(tempfile.mkdtemp(prefix="vramplan-swift-"))
    model_dir, data = write_assets(root, words, pairs=command == "rlhf")
    rlhf_type = argv[argv.index("--rlhf_type") + 1] if "--rlhf_type" in argv else "dpo"
    reward = command == "rlhf" and rlhf_type == "rm"
    trainer = RewardTrainer if reward else DPOTrainer if command == "rlhf" else Seq2SeqTrainer
    result: dict = {"first_labels": [], "labelled": None}

    class Done(Exception):
        """Raised after the metered train(): saving and logging are not run."""

    def prepare(self, inputs):
        labels = inputs["labels"]  # before prepare_logits_to_keep slices them
        result["first_labels"].append(int((labels != -100).int().argmax(-1).min()))
        result["labelled"] = int((labels != -100).sum(-1).min())
        return original_prepare(self, inputs)

    def metered(self, *a, **k):
        runner = {"library": "ms-swift", "version": swift.__version__, "entry": type(self).__name__}
        self.train = original[type(self)].__get__(self)
        models = {"policy": self.model}
        if getattr(self, "ref_model", None) is not None:
            models["reference"] = self.ref_model
        res = metered_train(self, models, runner)
        p = next(x for x in self.model.parameters() if x.requires_grad)
        frozen = [x for x in self.model.parameters() if not x.requires_grad]
        result.update(res.to_dict(), dtypes={"trained": str(p.dtype),
                                             "frozen": str(frozen[0].dtype) if frozen else None,
                                             "optimizer": type(self.optimizer).__name__},
                      args={k: str(getattr(self.args, k, None)) for k in (
                          "gradient_accumulation_steps", "gradient_checkpointing", "optim", "weight_decay",
                          "bf16", "fp16", "use_logits_to_keep", "disable_dropout")})
        raise Done

    original = {trainer: trainer.train}
    original_prepare = trainer.prepare_logits_to_keep
    trainer.prepare_logits_to_keep = prepare  # a reward model's score head keeps no positions
    for cls in original:
        cls.train = metered
    torch.manual_seed(0)
    main = {"pt": pretrain_main, "rlhf": rlhf_main}.get(command, sft_main)
    try:
        main(["--model", model_dir, "--dataset", data, "--output_dir", str(root / "out"), *argv])
    except Done:
        pass
    want = prompt_len if prompt_len is not None else 1
    if not reward and set(result["first_labels"]) != {want}:
        raise SystemExit(f"{name}: labels start at {sorted(set(result['first_labels']))}, the case says {want}")
    return result


# ------------------------------------------------------------------ the parent

def new_row(name: str) -> dict:
    command, argv, _, prompt_len = case(name)
    return {"name": name, "command": command, "argv": argv, "prompt_len": prompt_len}


BENCH = Bench(script=__file__, out=OUT, names=[c[0] for c in CASES], new_row=new_row,
              job_of=lambda row: import_case(row["name"]), child=child,
              packages=("ms-swift", "torch", "transformers", "peft", "trl", "accelerate"),
              measured=MEASURED + ("args", "labelled"), width=36)


if __name__ == "__main__":
    sys.exit(BENCH.main(description=__doc__.splitlines()[0]))
