"""torchtitan's checkpointing modes and Megatron's cross-entropy, against the real libraries.

The measured tests run torchtitan's own SelectiveAC policy (torchtitan 0.3.0) and
megatron-core's own vocab_parallel_cross_entropy on CPU under vramplan's exact meter; the
larger cases are in bench/stack/checkpointing.py and bench/stack/megatron_ce.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import vramplan
from vramplan.spec import Checkpointing, SpecError, load_spec

from conftest import measure_fresh

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "vocab_size": 4000, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
JOB = {"model": TINY, "backend": "cpu", "precision": "fp32", "optimizer": "adamw", "optimizer_impl": "foreach",
       "attention": "sdpa", "micro_batch_size": 2, "seq_len": 256}


# ------------------------------------------------------------------ the spec

def test_selective_on_torchtitan_is_its_op_policy_and_elsewhere_the_attention_core():
    assert load_spec({**JOB, "gradient_checkpointing": "selective", "stack": "torchtitan"}).gradient_checkpointing \
        is Checkpointing.OP_SELECTIVE
    assert load_spec({**JOB, "gradient_checkpointing": "selective", "stack": "megatron"}).gradient_checkpointing \
        is Checkpointing.SELECTIVE


def test_checkpoint_every_needs_full_checkpointing():
    with pytest.raises(SpecError) as err:
        load_spec({**JOB, "gradient_checkpointing": "none", "checkpoint_every": 2})
    assert err.value.field == "checkpoint_every"
    with pytest.raises(SpecError) as err:
        load_spec({**JOB, "gradient_checkpointing": "full", "checkpoint_every": 0})
    assert err.value.field == "checkpoint_every"
    spec = load_spec({**JOB, "gradient_checkpointing": "full", "checkpoint_every": 2})
    assert load_spec(spec.to_dict()) == spec
    assert "checkpoint_every" not in load_spec({**JOB, "gradient_checkpointing": "full"}).to_dict()


def test_cli_flag_sets_checkpoint_every(capsys):
    from vramplan.cli import main
    argv = ["estimate", "llama-3.1-8b", "--seq-len", "8192", "--gradient-checkpointing", "full", "--json"]
    assert main(argv + ["--checkpoint-every", "2"]) == 0
    every2 = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    every1 = json.loads(capsys.readouterr().out)
    assert every2["spec"]["checkpoint_every"] == 2
    assert every2["peak_allocated_bytes"] > every1["peak_allocated_bytes"]
    assert main(["estimate", "llama-3.1-8b", "--checkpoint-every", "2"]) == 2
    assert "checkpoint_every" in capsys.readouterr().err


# ------------------------------------------------------------------ measured against the libraries

def _close(job: dict) -> None:
    measured = measure_fresh(job, device="cpu")
    est = vramplan.estimate(load_spec(job)).to_dict()
    assert abs(est["peak_allocated_bytes"] - measured["peak_allocated_bytes"]) <= 0.02 * measured["peak_allocated_bytes"]
    for phase in ("forward", "backward", "optimizer"):
        assert abs(est["phases"][phase] - measured["phases"][phase]) <= 0.05 * measured["phases"][phase], phase


def test_torchtitan_selective_ac_on_llama_matches_the_meter():
    pytest.importorskip("torchtitan.distributed.activation_checkpoint")
    _close({**JOB, "gradient_checkpointing": "op-selective"})


def test_every_second_layer_checkpointed_matches_the_meter():
    pytest.importorskip("transformers")
    _close({**JOB, "gradient_checkpointing": "full", "checkpoint_every": 2})


MEGATRON_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
import megatron_ce
megatron_ce.init()
print(json.dumps([megatron_ce.run(128, 2, 128, 4000, dt, False) for dt in ("bf16", "fp32")]))
"""


def test_megatron_cross_entropy_terms_match_megatron_core_on_the_meter():
    pytest.importorskip("megatron.core.tensor_parallel")
    out = subprocess.run([sys.executable, "-c", MEGATRON_RUN, str(ROOT / "bench" / "stack")], capture_output=True,
                         text=True, timeout=900, check=True)
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    for row in rows:
        assert abs(row["error"]["forward"]) <= 0.02, row
        assert abs(row["error"]["backward"]) <= 0.02, row


def test_stack_megatron_prices_its_loss_not_transformers():
    """At the end of forward transformers' loss holds the 16-bit logits, their fp32 copy and
    the fp32 log-softmax; Megatron's the 16-bit logits and one fp32 buffer (the softmax made
    in place in the copy): one fp32 logits-sized tensor less, T x v x 4 bytes."""
    base = {"model": "llama-3.1-8b", "precision": "bf16", "micro_batch_size": 1, "seq_len": 4096,
            "gradient_checkpointing": "full"}
    hf = vramplan.estimate(load_spec({**base, "stack": "deepspeed"})).to_dict()["phases"]["forward"]
    mg = vramplan.estimate(load_spec({**base, "stack": "megatron"})).to_dict()["phases"]["forward"]
    one_fp32_logits = 4096 * 128256 * 4
    assert abs((hf - mg) - one_fp32_logits) < 2**20  # the rest: token-sized labels and losses
