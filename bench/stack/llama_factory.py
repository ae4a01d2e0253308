"""LLaMA-Factory's own training step, measured: each case is a LLaMA-Factory YAML run by
its real entry (`llamafactory.train.tuner.run_exp`: its argument parser, model loader and
patcher, adapter setup, data pipeline and collator, and its pt / sft / dpo / kto trainers)
for two optimizer steps on CPU, in a fresh process, under vramplan's exact meter
(`vramplan.measure.trainer_meter.metered_train`, the phases of bench/trainers), next to
`vramplan.estimate` of the job the same YAML imports to (`vramplan.importers.from_recipe`).

    /work/venv-lf/bin/python bench/stack/llama_factory.py             # all cases -> results-llama-factory.json
    /work/venv-lf/bin/python bench/stack/llama_factory.py --only dpo  # those cases, merged into it
    /work/venv-lf/bin/python bench/stack/llama_factory.py --reestimate   # new estimates, same measurements
    /work/venv-lf/bin/python bench/stack/llama_factory.py --summary

Run it with an interpreter that has llamafactory (0.9.5: bench/stack/README.md says how it
was installed); `src/` is put on the path. The model is a tiny random Llama saved in bf16
(as hub checkpoints are) with a word-level tokenizer, the data a tiny alpaca / pairwise
JSON registered in a local dataset_info.json: every row is longer than `cutoff_len`, so
LLaMA-Factory's `infer_seqlen` truncates each to exactly `cutoff_len` tokens.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
sys.path[:0] = [str(SRC), str(HERE)]
from harness import Bench, errors, estimate  # noqa: E402,F401  (errors, estimate: for its test)
OUT = HERE / "results-llama-factory.json"

TINY = {"model_type": "llama", "vocab_size": 8000, "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "tie_word_embeddings": False, "max_position_embeddings": 1024}
"""The tiny model every case trains (saved with `dtype` bfloat16: `checkpoint` in a case
names another)."""

BASE = {"stage": "sft", "do_train": True, "finetuning_type": "lora", "lora_target": "all",
        "template": "empty", "cutoff_len": 256, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1, "max_steps": 2, "learning_rate": 1.0e-4, "bf16": True,
        "report_to": "none", "save_strategy": "no", "logging_steps": 1000, "use_cpu": True,
        "dataloader_num_workers": 0, "overwrite_cache": True, "seed": 0, "disable_tqdm": True}
"""What every case's YAML holds (LLaMA-Factory's examples/train_lora/*.yaml fields); the
paths (`model_name_or_path`, `dataset_dir`, `output_dir`) are filled in at run time."""

CASES = [
    ("sft/lora/bf16/gc", {}),
    ("sft/lora/bf16/no-gc", {"disable_gradient_checkpointing": True}),
    ("sft/lora/fp32/no-gc", {"bf16": False, "disable_gradient_checkpointing": True}),
    ("sft/lora/bf16/gc/fp32-checkpoint", {}, "float32"),
    ("sft/full/bf16/gc", {"finetuning_type": "full"}),
    ("sft/full/bf16/no-gc", {"finetuning_type": "full", "disable_gradient_checkpointing": True}),
    ("sft/full/fp32/no-gc", {"finetuning_type": "full", "bf16": False, "disable_gradient_checkpointing": True}),
    ("sft/freeze/bf16/no-gc", {"finetuning_type": "freeze", "disable_gradient_checkpointing": True}),
    ("sft/freeze/bf16/gc/extra", {"finetuning_type": "freeze", "freeze_trainable_layers": 1,
                                  "freeze_extra_modules": "lm_head"}),
    ("sft/lora/bf16/gc/upcast-layernorm", {"upcast_layernorm": True}),
    ("sft/lora/bf16/gc/non-reentrant", {"use_reentrant_gc": False}),
    ("sft/lora/bf16/no-gc/upcast-layernorm", {"upcast_layernorm": True, "disable_gradient_checkpointing": True}),
    ("sft/lora/bf16/no-gc/upcast-lmhead", {"upcast_lmhead_output": True, "disable_gradient_checkpointing": True}),
    ("dpo/lora/bf16/gc", {"stage": "dpo", "cutoff_len": 128}),
    ("dpo/full/bf16/no-gc", {"stage": "dpo", "cutoff_len": 128, "finetuning_type": "full",
                              "disable_gradient_checkpointing": True}),
    ("dpo/lora/bf16/no-gc/dropout0.1", {"stage": "dpo", "cutoff_len": 128, "lora_dropout": 0.1,
                                         "disable_gradient_checkpointing": True}),
    ("sft/lora/bf16/no-gc/dropout0.1", {"lora_dropout": 0.1, "disable_gradient_checkpointing": True}),
    ("sft/lora/bf16/gc/ga2", {"gradient_accumulation_steps": 2}),
    ("dpo/full/fp32/gc", {"stage": "dpo", "cutoff_len": 128, "finetuning_type": "full", "bf16": False}),
    ("pt/lora/bf16/gc", {"stage": "pt"}),
    ("kto/lora/bf16/gc", {"stage": "kto", "cutoff_len": 128}),
    ("kto/full/bf16/no-gc", {"stage": "kto", "cutoff_len": 128, "finetuning_type": "full",
                             "disable_gradient_checkpointing": True}),
    ("orpo/lora/bf16/no-gc", {"stage": "dpo", "pref_loss": "orpo", "cutoff_len": 128,
                              "disable_gradient_checkpointing": True}),
    # QLoRA (bitsandbytes nf4, which runs on CPU since 0.49): no kbit preparation
    ("sft/qlora/bf16/gc", {"quantization_bit": 4}),
    ("sft/qlora/bf16/no-gc", {"quantization_bit": 4, "disable_gradient_checkpointing": True}),
    ("sft/qlora/bf16/no-gc/upcast-layernorm", {"quantization_bit": 4, "upcast_layernorm": True,
                                               "disable_gradient_checkpointing": True}),
]

OPEN: dict[str, str] = {}
"""Cases outside the targets, with the mechanism the estimate lacks."""


def case_recipe(name: str) -> tuple[dict, str]:
    """(the case's YAML fields without paths, the checkpoint dtype)."""
    for case in CASES:
        if case[0] == name:
            return {**BASE, **case[1]}, (case[2] if len(case) > 2 else "bfloat16")
    raise KeyError(name)


def model_config(checkpoint: str) -> dict:
    """The model field of the estimated job: the config.json the run loads (its `dtype` is
    the checkpoint dtype LLaMA-Factory's `torch_dtype="auto"` loads)."""
    return {**TINY, "dtype": checkpoint}


def import_recipe(recipe: dict, checkpoint: str) -> dict:
    """The job vramplan imports from the YAML (`from_recipe`), with the model the YAML's
    `model_name_or_path` points at given as its config, on a CPU backend."""
    from vramplan.importers import from_recipe

    out, _ = from_recipe({**recipe, "model_name_or_path": "tiny-llama"}, source="llama-factory case")
    return {**out, "model": model_config(checkpoint), "backend": "cpu"}


# ------------------------------------------------------------------ the child (llamafactory)

def _stub_torchaudio() -> None:
    """llamafactory/data/mm_plugin.py imports torchaudio at module level (audio inputs only);
    no torchaudio release loads on torch 2.13 (2.11's `_torchaudio.abi3.so` refuses it), so
    the bench puts an empty module in its place. Nothing here reads audio."""
    import importlib.machinery
    import types

    mod = types.ModuleType("torchaudio")
    mod.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    sys.modules["torchaudio"] = mod


def write_assets(root: Path, checkpoint: str, cutoff: int) -> dict:
    """Save the tiny model, its tokenizer and the datasets under `root`; the YAML path fields."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vramplan.measure import trl_data

    torch.manual_seed(0)
    cfg = dict(TINY)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, checkpoint))
    model.save_pretrained(root / "model")
    trl_data.tokenizer(TINY["vocab_size"]).save_pretrained(root / "model")
    vocab, n = TINY["vocab_size"], 16
    # prompt and answer each longer than cutoff: infer_seqlen truncates both to cutoff in all
    sft = [{"instruction": trl_data.words(cutoff, i, vocab), "input": "",
            "output": trl_data.words(cutoff, 100 + i, vocab)} for i in range(n)]
    pairs = [{"instruction": trl_data.words(cutoff, i, vocab), "input": "",
              "chosen": trl_data.words(cutoff, 100 + i, vocab),
              "rejected": trl_data.words(cutoff, 200 + i, vocab)} for i in range(n)]
    kto = [dict(row, kto_tag=i % 2 == 0) for i, row in enumerate(sft)]
    text = [{"text": trl_data.words(2 * cutoff, i, vocab)} for i in range(n)]
    (root / "data").mkdir()
    for name, rows in (("sft", sft), ("pairs", pairs), ("kto", kto), ("pt", text)):
        (root / "data" / f"{name}.json").write_text(json.dumps(rows))
    info = {"tiny_sft": {"file_name": "sft.json"}, "tiny_pt": {"file_name": "pt.json", "columns": {"prompt": "text"}},
            "tiny_kto": {"file_name": "kto.json", "columns": {"prompt": "instruction", "query": "input",
                                                              "response": "output", "kto_tag": "kto_tag"}},
            "tiny_pairs": {"file_name": "pairs.json", "ranking": True,
                           "columns": {"prompt": "instruction", "query": "input",
                                       "chosen": "chosen", "rejected": "rejected"}}}
    (root / "data" / "dataset_info.json").write_text(json.dumps(info))
    return {"model_name_or_path": str(root / "model"), "dataset_dir": str(root / "data"),
            "output_dir": str(root / "out")}


DATASETS = {"sft": "tiny_sft", "dpo": "tiny_pairs", "kto": "tiny_kto", "pt": "tiny_pt"}


def child(name: str) -> dict:
    """Run one case's YAML through LLaMA-Factory's run_exp, metering its trainer's train()."""
    _stub_torchaudio()
    import torch
    import llamafactory
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.kto.trainer import CustomKTOTrainer
    from llamafactory.train.pt.trainer import CustomTrainer
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
    from llamafactory.train.tuner import run_exp

    from vramplan.measure.trainer_meter import metered_train

    recipe, checkpoint = case_recipe(name)
    root = Path(tempfile.mkdtemp(prefix="vramplan-lf-"))
    paths = write_assets(root, checkpoint, int(recipe["cutoff_len"]))
    args = {**recipe, **paths, "dataset": DATASETS[recipe["stage"]]}
    result: dict = {}

    class Done(Exception):
        """Raised after the metered train(): the workflow's saving and logging are not run."""

    def metered(self, *a, **k):
        models = {"policy": self.model}
        if getattr(self, "ref_model", None) is not None:
            models["reference"] = self.ref_model
        entry = type(self).__name__
        runner = {"library": "llamafactory", "version": llamafactory.__version__, "entry": entry}
        self.train = original[type(self)].__get__(self)
        res = metered_train(self, models, runner)
        p = next(x for x in self.model.parameters() if x.requires_grad)
        frozen = [x for x in self.model.parameters() if not x.requires_grad]
        dtypes = {"trained": str(p.dtype), "frozen": str(frozen[0].dtype) if frozen else None,
                  "optimizer": type(self.optimizer.optimizer).__name__}
        result.update(res.to_dict(), dtypes=dtypes)
        raise Done

    original = {cls: cls.train for cls in (CustomSeq2SeqTrainer, CustomDPOTrainer, CustomKTOTrainer, CustomTrainer)}
    for cls in original:
        cls.train = metered
    torch.manual_seed(0)
    try:
        run_exp(args)
    except Done:
        pass
    return result


# ------------------------------------------------------------------ the parent

def new_row(name: str) -> dict:
    recipe, checkpoint = case_recipe(name)
    return {"name": name, "recipe": recipe, "checkpoint_dtype": checkpoint, "job": import_recipe(recipe, checkpoint)}


BENCH = Bench(script=__file__, out=OUT, names=[c[0] for c in CASES], new_row=new_row,
              job_of=lambda row: import_recipe(row["recipe"], row["checkpoint_dtype"]), child=child,
              packages=("llamafactory", "torch", "transformers", "peft", "trl", "accelerate"))


if __name__ == "__main__":
    sys.exit(BENCH.main(description=__doc__.splitlines()[0]))
