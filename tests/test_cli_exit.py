"""Exit status: 0 fits, 1 does not fit, 2 bad input; the same for estimate, compare, fit, check;
and `python -m vramplan` is the same command."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan.cli import main

BIG = ["llama-3.1-8b", "--gpu", "rtx-4090", "--seq-len", "2048"]      # full fine-tune: ~100 GiB
SMALL = ["qwen2.5-0.5b", "--gpu", "h100-80gb", "--method", "lora", "--seq-len", "256"]


@pytest.mark.parametrize("command", ["estimate", "compare"])
def test_fits_is_0_and_does_not_fit_is_1(capsys, command):
    assert main([command, *SMALL]) == 0
    assert main([command, *BIG]) == 1
    capsys.readouterr()


def test_estimate_json_keeps_the_status(capsys):
    assert main(["estimate", *BIG, "--json"]) == 1
    assert main(["estimate", "llama-3.1-8b", "--json"]) == 0  # no GPU: nothing to fit against
    capsys.readouterr()


def test_fit_none_fits_is_1(capsys):
    assert main(["fit", "llama-3.1-70b", "--gpu", "t4", "--vary", "gradient_checkpointing=full", "--only",
                 "--json"]) == 1
    capsys.readouterr()


@pytest.mark.parametrize("command", ["estimate", "compare", "fit", "check"])
def test_bad_input_is_2(capsys, command):
    assert main([command, "llama-3.1-8b", "--gpu", "rtx-4090", "--seq-len", "-5"]) == 2
    assert "seq_len" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["estimate", "compare", "fit", "check"])
def test_help_documents_the_exit_status(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "exit status: 0" in out and "1 it does not fit" in out and "2 bad input" in out


def test_python_dash_m(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    run = subprocess.run([sys.executable, "-m", "vramplan", "estimate", *BIG], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 1 and "does not fit" in run.stdout
    run = subprocess.run([sys.executable, "-m", "vramplan", "estimate", "nosuchmodel-xyz"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
