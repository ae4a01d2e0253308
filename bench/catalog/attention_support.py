#!/usr/bin/env python3
"""Rebuild src/vramplan/catalog/attention_support.json from the installed transformers.

    python bench/catalog/attention_support.py           # rewrite the file
    python bench/catalog/attention_support.py --check   # exit 1 when the file differs

A `model_type` is listed when none of its model classes (the auto mappings' base model,
causal LM, sequence classification, image-text-to-text and seq2seq entries) has
`_supports_sdpa` true. `PreTrainedModel._supports_sdpa` defaults to False
(transformers/modeling_utils.py), so a family that never sets it (Mamba, BLOOM, GPT-Neo,
MPT) is listed as well as one that sets it False (Gemma 2: soft-capping).
`PreTrainedModel._check_and_adjust_attn_implementation` then runs such a model with eager
attention when no attn_implementation is given and raises when "sdpa" is asked for.
Types with no model class in those mappings (sub-configs) are left out.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "src" / "vramplan" / "catalog" / "attention_support.json"


def model_classes(model_type: str) -> list[str]:
    from transformers.models.auto import modeling_auto as ma
    maps = (ma.MODEL_MAPPING_NAMES, ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            ma.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
            ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    names: set[str] = set()
    for m in maps:
        v = m.get(model_type)
        if v is not None:
            names.update([v] if isinstance(v, str) else v)
    return sorted(names)


def supports_sdpa(model_type: str) -> bool | None:
    """True/False as transformers' classes say; None when the type has no model class."""
    import transformers
    flags = []
    for name in model_classes(model_type):
        cls = getattr(transformers, name, None)
        if cls is not None:
            flags.append(bool(getattr(cls, "_supports_sdpa", False)))
    return any(flags) if flags else None


def scan() -> dict:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    warnings.filterwarnings("ignore")
    no = [mt for mt in sorted(CONFIG_MAPPING_NAMES) if supports_sdpa(mt) is False]
    return {"source": f"transformers {transformers.__version__}: the model_types none of whose model classes "
                      "(auto mappings: base, causal LM, sequence classification, image-text-to-text, seq2seq) "
                      "has `_supports_sdpa` true; PreTrainedModel defaults it to False, so families that never "
                      "set it (Mamba, BLOOM, GPT-Neo, MPT) are here beside those that set it False (Gemma 2: "
                      "soft-capping). modeling_utils.PreTrainedModel._check_and_adjust_attn_implementation runs "
                      "them eager when no attn_implementation is given and raises when sdpa is asked for. "
                      "Built by bench/catalog/attention_support.py.",
            "transformers": transformers.__version__, "no_sdpa": no}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    new = scan()
    if args.check:
        old = json.loads(OUT.read_text())
        if old["no_sdpa"] != new["no_sdpa"]:
            print(f"differs: only in the file {sorted(set(old['no_sdpa']) - set(new['no_sdpa']))}, "
                  f"only in transformers {sorted(set(new['no_sdpa']) - set(old['no_sdpa']))}")
            return 1
        print("attention_support.json matches the installed transformers")
        return 0
    OUT.write_text(json.dumps(new, indent=1) + "\n")
    print(f"{len(new['no_sdpa'])} model types without SDPA written to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
