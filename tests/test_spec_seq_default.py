"""seq_len not given: the default (DEFAULT_SEQ_LEN) capped at a model's learned positions,
with a note saying so; a seq_len the user gives is refused past them as before.

Ground truth: the position table of the model as resolved from its config (GPT-2's
n_positions, BERT's max_position_embeddings): nn.Embedding(limit, h), which no row can pass."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vramplan
from vramplan import JobSpec, load_spec
from vramplan.cli import main
from vramplan.model import PositionKind
from vramplan.sources import resolve_model
from vramplan.spec import DEFAULT_SEQ_LEN, SpecError
from vramplan.validity import assume_seq_len

LEARNED = ["gpt2", "bert-base-uncased", "google-bert/bert-large-uncased"]


def _limit(model: str) -> int:
    desc = resolve_model(load_spec({"model": model}))
    assert desc.position is PositionKind.LEARNED and 0 < desc.max_position_embeddings < DEFAULT_SEQ_LEN
    return desc.max_position_embeddings


@pytest.mark.parametrize("model", LEARNED)
def test_default_is_capped_at_learned_positions(model):
    task = {"task": "inference"} if "bert" in model else {}
    limit = _limit(model)
    est = vramplan.estimate(load_spec({"model": model, **task}))
    assert est.spec.seq_len == limit and not est.spec.seq_len_given
    said = [str(n) for n in est.notes if str(n).startswith("seq_len: not given")]
    assert len(said) == 1 and f"assumed {limit:,}" in said[0] and f"default {DEFAULT_SEQ_LEN:,}" in said[0]
    # the same memory as the job that names that length, which carries no such note
    given = vramplan.estimate(load_spec({"model": model, **task, "seq_len": limit}))
    assert given.device_bytes == est.device_bytes and given.components.to_dict() == est.components.to_dict()
    assert not any(str(n).startswith("seq_len: not given") for n in given.notes)


def test_rotary_model_keeps_the_default():
    spec = load_spec({"model": "llama-3.2-1b"})
    desc = resolve_model(spec)
    assert desc.position is not PositionKind.LEARNED
    est = vramplan.estimate(spec)
    assert est.spec.seq_len == DEFAULT_SEQ_LEN
    assert not any("seq_len" in str(n) for n in est.notes)
    assert est.device_bytes == vramplan.estimate(spec.with_(seq_len=DEFAULT_SEQ_LEN)).device_bytes


@pytest.mark.parametrize("model", LEARNED)
def test_given_seq_len_past_positions_is_still_refused(model):
    limit = _limit(model)
    with pytest.raises(SpecError) as err:
        vramplan.estimate(JobSpec(model=model, task="inference", seq_len=DEFAULT_SEQ_LEN))
    assert err.value.field == "seq_len"
    text = str(err.value)
    assert text.startswith(f"seq_len: {DEFAULT_SEQ_LEN:,} tokens are past ")
    assert f"{limit:,} learned positions (max_position_embeddings); use seq_len <= {limit:,}" in text


def test_completion_tokens_leave_room_in_the_cap():
    spec = load_spec({"model": "gpt2", "task": "grpo", "max_new_tokens": 100, "micro_batch_size": 8})
    limit = _limit("gpt2")
    capped = assume_seq_len(resolve_model(spec), spec)
    assert capped.seq_len + capped.max_new_tokens == limit and not capped.seq_len_given


def test_a_default_stays_a_default_through_copies():
    spec = load_spec({"model": "gpt2"})
    assert not spec.seq_len_given and spec.seq_len == DEFAULT_SEQ_LEN
    assert spec.to_dict()["seq_len"] == DEFAULT_SEQ_LEN  # to_dict: the effective fields
    assert "seq_len" not in spec.to_dict(as_given=True)
    assert not spec.with_(gpu="h100-80gb").seq_len_given and not load_spec(spec).seq_len_given
    assert spec.with_(seq_len=512).seq_len_given and load_spec({"model": "gpt2", "seq_len": 2048}).seq_len_given
    with pytest.raises(SpecError) as err:
        load_spec({"model": "gpt2", "seq_len_given": True})
    assert err.value.field == "seq_len_given"


def test_saved_spec_keeps_the_default(tmp_path):
    path = str(tmp_path / "job.yaml")
    vramplan.save_spec(load_spec({"model": "gpt2"}), path)
    again = load_spec(path)
    assert not again.seq_len_given
    assert vramplan.estimate(again).spec.seq_len == _limit("gpt2")


def test_cli_default_and_given(capsys):
    limit = _limit("gpt2")
    assert main(["estimate", "gpt2", "--gpu", "a100-80gb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["spec"]["seq_len"] == limit
    assert any(n.startswith("seq_len: not given") for n in data["notes"])


def test_fit_maximize_seq_len_stops_at_the_positions(capsys):
    assert main(["fit", "gpt2", "--gpu", "a100-80gb", "--maximize", "seq_len", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["value"] == _limit("gpt2")
    assert max(p["value"] for p in data["sweep"]) <= _limit("gpt2")


def test_python_dash_m_exit_codes_and_stderr():
    """P001's shape (published-dev-specs.json): BERT-large inference with no seq_len."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    job = ["estimate", "google-bert/bert-large-uncased", "--task", "inference", "--precision", "fp32",
           "--gpu", "v100-16gb"]
    run = subprocess.run([sys.executable, "-m", "vramplan", *job], capture_output=True, text=True, env=env,
                         timeout=120)
    limit = _limit("google-bert/bert-large-uncased")
    assert run.returncode == 0 and run.stderr == ""
    assert "seq_len: not given" in run.stdout and f"s={limit}" in run.stdout
    run = subprocess.run([sys.executable, "-m", "vramplan", *job, "--seq-len", str(DEFAULT_SEQ_LEN)],
                         capture_output=True, text=True, env=env, timeout=120)
    with pytest.raises(SpecError) as err:
        vramplan.estimate(JobSpec(model="google-bert/bert-large-uncased", task="inference", precision="fp32",
                                  gpu="v100-16gb", seq_len=DEFAULT_SEQ_LEN))
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"vramplan: error: {err.value}\n"
