"""TRL's SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer and RLOOTrainer of earlier releases, measured on
CPU beside the installed one.

    pip install --no-deps --target /tmp/trl-0.25.1 trl==0.25.1      # one folder per release
    python bench/trainers/trl_releases.py /tmp/trl-0.25.1 /tmp/trl-1.4.0 /tmp/trl-1.6.0
    python bench/trainers/trl_releases.py --only grpo/ /tmp/trl-1.6.0  # the GRPO cases only
    python bench/trainers/trl_releases.py --reestimate           # today's estimates, same measurements

Each folder holds one TRL release, put ahead of the installed one on `sys.path` (these
releases load on transformers 5.24). Each case runs in a fresh process through
vramplan.measure.trainers.measure_trainer (the runner of bench/trainers/run.py, under the
exact CPU meter) with `stack: {framework: trl, trl: <release>}`, and is estimated from that
job. What differs by release is what SFTTrainer does after the model's loss (entropy and
token accuracy over the full logits: components/trl_sft_metrics.py) and how it prepares a
quantized base (components/qlora_prep.py); for DPO, KTO, GRPO and RLOO, the head the trainer runs before
TRL's fused one and what each release keeps alive around it (jobs/dpo_head.py,
jobs/grpo_head.py). Results:
results-trl-releases.json, written after each case.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(HERE))

from run import BASE, GRPO, LORA, QLORA, errors  # noqa: E402  (bench/trainers/run.py)

CASES = {
    "sft/bf16/full/b2": dict(BASE, task="sft", precision="bf16"),
    "sft/bf16/lora/b4": dict(BASE, task="sft", precision="bf16", micro_batch_size=4, **LORA),
    "sft/fp32/full/b1": dict(BASE, task="sft", precision="fp32", micro_batch_size=1),
    "sft/bf16/qlora/b2": dict(BASE, task="sft", precision="bf16", **QLORA),
    # a head weight (v x h) four times a 256-token chunk of logits: its fp32 copies and
    # gradients, not the logits, set chunked_nll's moments
    "sft/bf16/full/b1/h512": dict(BASE, task="sft", precision="bf16", micro_batch_size=1,
                                  model=dict(BASE["model"], hidden_size=512, intermediate_size=1376,
                                             num_attention_heads=8, num_key_value_heads=4)),
}
# DPOTrainer's own head before TRL 1.15 (jobs/dpo_head.py): under the trainer's autocast
# (fp32 logits), pure bf16 (`plain`: 16-bit logits, the row loop), fp32, a LoRA policy whose
# reference is the adapter-disabled base, a precomputed reference, and IPO on one pair
PLAIN = {"framework": "plain"}
CASES.update({
    "dpo/bf16/full/b2": dict(BASE, task="dpo", precision="bf16"),
    "dpo/bf16-plain/full/b2": dict(BASE, task="dpo", precision="bf16", stack=PLAIN),
    "dpo/fp32/full/b2": dict(BASE, task="dpo", precision="fp32"),
    "dpo/bf16/lora/b2": dict(BASE, task="dpo", precision="bf16", **LORA),
    "dpo/bf16/full/b2/ref-precomputed": dict(BASE, task="dpo", precision="bf16", reference_model="precomputed"),
    "ipo/bf16-plain/lora/b1/gc": dict(BASE, task="ipo", precision="bf16", micro_batch_size=1, stack=PLAIN,
                                     gradient_checkpointing="full", **LORA),
})
# GRPOTrainer's own head of 0.21 to 1.14 (jobs/grpo_head.py): under autocast, fp32, and a
# pure-bf16 LoRA policy (16-bit logits, the row loop)
CASES.update({
    "grpo/bf16/full/g4-c32": dict(BASE, **GRPO, precision="bf16"),
    "grpo/fp32/full/g4-c32": dict(BASE, **GRPO, precision="fp32"),
    "grpo/bf16-plain/lora/g4-c32": dict(BASE, **GRPO, precision="bf16", stack=PLAIN, **LORA),
    # the two that run where the harness cannot stand in for a release's reference loader
    # (before 0.26): a LoRA policy under autocast, and a full one with beta 0 (no reference)
    "grpo/bf16/lora/g4-c32": dict(BASE, **GRPO, precision="bf16", **LORA),
    "grpo/bf16/full/g4-c32/beta0": dict(BASE, **GRPO, precision="bf16", reference_model="precomputed"),
})
# KTOTrainer's own head of 1.9 to 1.14 (jobs/dpo_head.py): under autocast, fp32, and a
# pure-bf16 LoRA policy whose reference is its adapter-disabled base
CASES.update({
    "kto/bf16/full/b2": dict(BASE, task="kto", precision="bf16"),
    "kto/fp32/full/b2": dict(BASE, task="kto", precision="fp32"),
    "kto/bf16-plain/lora/b2": dict(BASE, task="kto", precision="bf16", stack=PLAIN, **LORA),
})
# RLOOTrainer of 0.22 to 1.14: GRPO's head of the same release (jobs/logprob.py
# RLOO_GROUP_SINCE), the policy's own old log-probs, the reference at beta 0.05
RLOO = dict(GRPO, task="rloo")
CASES.update({
    "rloo/bf16/full/g4-c32": dict(BASE, **RLOO, precision="bf16"),
    "rloo/fp32/full/g4-c32": dict(BASE, **RLOO, precision="fp32"),
    "rloo/bf16-plain/lora/g4-c32": dict(BASE, **RLOO, precision="bf16", stack=PLAIN, **LORA),
    "rloo/bf16/lora/g4-c32": dict(BASE, **RLOO, precision="bf16", **LORA),
    "rloo/bf16/full/g4-c32/beta0": dict(BASE, **RLOO, precision="bf16", reference_model="precomputed"),
})
OUT = HERE / "results-trl-releases.json"
# Older releases on transformers 5: trl/import_utils.py keeps (before 0.26) or asks for (0.27,
# 0.28) transformers' `_is_package_available` answers, now (bool, version) tuples that are
# always true (so trl.trainer.callbacks imports mergekit or weave), and DPOTrainer writes
# `model.warnings_issued`, which PreTrainedModel no longer has. Neither touches what the step
# allocates.
_OLD_RELEASE_SHIMS = (
    "import trl.import_utils as iu; "
    "[setattr(iu, k, v[0]) for k, v in list(vars(iu).items()) "
    " if k.startswith('_') and k.endswith('_available') and isinstance(v, tuple)]; "
    # 0.27 and 0.28 ask transformers' `_is_package_available` at call time (`is_weave_available`)
    "f = getattr(iu, '_is_package_available', None); "
    "iu._is_package_available = f and (lambda n, *a, **k: f(n, *a, **k) if a or k else "
    " (lambda r: r[0] if isinstance(r, tuple) else r)(f(n))); "
    "import transformers; PM = transformers.PreTrainedModel; "
    "PM.warnings_issued = getattr(PM, 'warnings_issued', {}); ")


def _release(folder: Path) -> str:
    dist = next(folder.glob("trl-*.dist-info"), None)
    if dist is None:
        raise SystemExit(f"{folder}: no trl-*.dist-info (install one release there with pip --target)")
    return dist.name.removeprefix("trl-").removesuffix(".dist-info")


def measure(folder: Path, job: dict) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[2]); "
            + _OLD_RELEASE_SHIMS +
            "from vramplan.measure.trainers import measure_trainer; "
            "print(json.dumps(measure_trainer(json.loads(sys.argv[3])).to_dict()))")
    proc = subprocess.run([sys.executable, "-c", code, str(folder), str(SRC), json.dumps(job)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def estimate_row(job: dict) -> dict:
    import vramplan
    est = vramplan.estimate(job)
    return {"peak_allocated_bytes": est.peak_allocated_bytes, "phases": est.phases, "peak_event": est.peak_event}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="*", type=Path, help="folders each holding one TRL release")
    ap.add_argument("--reestimate", action="store_true")
    ap.add_argument("--only", default="", help="run only the cases whose name holds this")
    args = ap.parse_args(argv)
    rows = json.loads(OUT.read_text()) if OUT.exists() else {}
    if args.reestimate:
        for row in rows.values():
            row["estimate"] = estimate_row(row["job"])
    for folder in args.folders:
        release = _release(folder)
        minor = ".".join(release.split(".")[:2])
        for name, job in CASES.items():
            if args.only not in name:
                continue
            stack = job.get("stack", "trl")
            stack = dict(stack) if isinstance(stack, dict) else {"framework": stack}
            job = dict(job, stack=dict(stack, trl=minor))
            try:
                m = measure(folder, job)
            except RuntimeError as exc:  # e.g. 0.29's DPOTrainer loads a reference by the policy's
                # name even when its log-probs are precomputed: an in-memory model has none
                print(f"trl-{release}/{name}: not measured: {str(exc).strip().splitlines()[-1]}")
                continue
            assert m["runner"]["version"] == release, (m["runner"], release)
            rows[f"trl-{release}/{name}"] = {"job": job, "measured": m, "estimate": estimate_row(job)}
            OUT.write_text(json.dumps(rows, indent=1) + "\n")
    for key, row in rows.items():
        est = type("E", (), {"peak_allocated_bytes": row["estimate"]["peak_allocated_bytes"],
                             "phases": row["estimate"]["phases"]})
        row["error"] = errors(est, row["measured"])
        print(f"{key:36} measured {row['measured']['peak_allocated_bytes']:>10} "
              f"estimated {row['estimate']['peak_allocated_bytes']:>10} {row['error']['peak']:+.3%}")
    OUT.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
