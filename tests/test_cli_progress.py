"""Progress bars go to stderr on a terminal only, never with JSON, and never change the answer."""
import argparse
import sys

from vramplan.cli import main
from vramplan.cli.progress import SearchProgress, progress_wanted, stages

JOB = ["fit", "qwen2.5-0.5b", "--gpu", "rtx-4090", "--micro-batch-size", "4", "--seq-len", "512",
       "--num-gpus", "2", "--top-k", "2"]


class _TTY:
    """A stderr that says it is a terminal and keeps what is written."""

    def __init__(self):
        self.parts = []

    def isatty(self):
        return True

    def write(self, text):
        self.parts.append(text)
        return len(text)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(self.parts)


def test_fit_progress_on_a_terminal_only(capsys, monkeypatch):
    import vramplan.plan.answers as answers  # where the CLI's fit command calls plan.fit
    monkeypatch.setattr(answers, "fit", _with_small_steps(answers.fit))
    code = main([*JOB, "--format", "csv"])
    out_plain = capsys.readouterr().out
    tty = _TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main([*JOB, "--format", "csv"]) == code == 0
    assert capsys.readouterr().out == out_plain  # the same answer on stdout
    assert "fitting so far" in tty.text  # the bar went to (the terminal's) stderr
    tty.parts.clear()
    assert main([*JOB, "--json"]) == 0
    assert "fitting so far" not in tty.text  # never with JSON


def _with_small_steps(fit):
    def wrapped(*args, **kwargs):
        return fit(*args, progress_every=10, **kwargs)
    return wrapped


def test_progress_wanted_follows_tty_and_format(monkeypatch):
    assert not progress_wanted(argparse.Namespace(json=False, format="table"))  # pytest's stderr
    monkeypatch.setattr(sys, "stderr", _TTY())
    assert progress_wanted(argparse.Namespace(json=False, format="table"))
    assert not progress_wanted(argparse.Namespace(json=True, format="table"))
    assert not progress_wanted(argparse.Namespace(json=False, format="json"))


def test_stages(monkeypatch, capsys):
    with stages(False, ["a", "b"]) as step:
        step("a")
        step("b")
    assert capsys.readouterr().err == ""
    tty = _TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    with stages(True, ["first stage", "second stage"]) as step:
        step("first stage")
        step("second stage")
    assert "second stage" in tty.text and "2/2" in tty.text
    with SearchProgress() as bar:
        bar(10, 100, 3)
        bar(100, 100, 5)
    assert "5 fitting so far" in tty.text and "100/100" in tty.text


def test_measure_shows_its_stages_on_a_terminal(tmp_path, capsys, monkeypatch):
    import pytest
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = tmp_path / "job.yaml"
    spec.write_text("model: {model_type: llama, vocab_size: 500, hidden_size: 64, intermediate_size: 128, "
                    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}\n"
                    "precision: fp32\nmicro_batch_size: 2\nseq_len: 32\nbackend: cpu\n")
    tty = _TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["measure", "--spec", str(spec), "--device", "cpu"]) == 0
    assert "measure: building the model" in tty.text and "estimate: the same job" in tty.text
    assert "peak" in capsys.readouterr().out
    tty.parts.clear()
    assert main(["measure", "--spec", str(spec), "--device", "cpu", "--json"]) == 0
    assert tty.text == ""
