"""No network unless asked: a hub id outside the catalog and the local Hugging Face cache
makes no connection and says how to allow the hub; with `online` (spec, --online,
VRAMPLAN_ONLINE=1) only its config.json is fetched."""
from __future__ import annotations

import json
import socket

import pytest

import vramplan
from vramplan.cli import main

HUB_ID = "vramplan-test-org/not-cached-model"
TINY = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 500, "max_position_embeddings": 1024}


@pytest.fixture
def no_network(monkeypatch):
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError("network use")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("VRAMPLAN_ONLINE", raising=False)
    return attempts


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """hf_hub_download replaced by a local file: records which files were asked for."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked = []
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))

    def download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        return str(path)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    # sources._from_hub asks for the file's metadata once, without retries, before downloading
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, **kwargs: None)
    return asked


def test_offline_by_default_without_a_connection(no_network, fake_hub):
    with pytest.raises(vramplan.SpecError) as info:
        vramplan.estimate({"model": HUB_ID, "seq_len": 128})
    assert info.value.field == "model" and "--online" in str(info.value)
    assert no_network == [] and fake_hub == []


def test_online_in_the_spec_fetches_only_config_json(no_network, fake_hub):
    est = vramplan.estimate({"model": HUB_ID, "seq_len": 128, "online": True})
    assert est.num_params > 0 and fake_hub == [(HUB_ID, "config.json")]


@pytest.mark.parametrize("how", [["--online"], []])
def test_cli_online_flag_and_environment(no_network, fake_hub, monkeypatch, capsys, how):
    if not how:
        monkeypatch.setenv("VRAMPLAN_ONLINE", "1")
    assert main(["estimate", HUB_ID, "--seq-len", "128", *how]) == 0
    assert fake_hub == [(HUB_ID, "config.json")]


def test_cli_offline_is_one_line(no_network, fake_hub, capsys):
    assert main(["estimate", HUB_ID, "--seq-len", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--online" in err[0] and fake_hub == []


def test_online_is_a_real_boolean():
    with pytest.raises(vramplan.SpecError, match="online"):
        vramplan.load_spec({"model": "gpt2", "online": "false"})
