"""catalog/attention_support.json against the installed transformers' own classes
(bench/catalog/attention_support.py rebuilds it), for the families vramplan models."""
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import vramplan  # noqa: E402
from vramplan.catalog.runtime import no_sdpa_model_types  # noqa: E402

DATA = Path(vramplan.__file__).parent / "catalog" / "attention_support.json"
FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
            "gemma3_text", "phi", "phi3", "gpt2", "gpt_bigcode", "gpt_neox", "bloom", "opt", "falcon", "bert",
            "t5", "mt5", "mamba", "mamba2", "jamba", "deepseek_v2", "deepseek_v3", "glm4", "llama4_text",
            "internlm3", "gpt_neo", "mpt"]


@pytest.fixture(scope="module")
def transformers_says():
    """Each family's `_supports_sdpa` as the installed transformers' classes say, read in a
    child process: importing thirty modeling modules leaves module-level tensors behind,
    which the in-process CPU meter of later tests would count."""
    import subprocess
    import sys
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from attention_support import supports_sdpa; "
            "print(json.dumps({f: supports_sdpa(f) for f in sys.argv[2:]}))")
    bench = Path(__file__).resolve().parents[1] / "bench" / "catalog"
    out = subprocess.run([sys.executable, "-c", code, str(bench), *FAMILIES], capture_output=True, text=True,
                         check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(json.loads(DATA.read_text())["transformers"] != transformers.__version__,
                    reason="the file was built from another transformers version")
@pytest.mark.parametrize("family", FAMILIES)
def test_no_sdpa_list_matches_transformers(family, transformers_says):
    assert (family in no_sdpa_model_types()) == (transformers_says[family] is False)


def test_default_attention_follows_the_list():
    """A family without SDPA and no attention named is estimated eager, with the note."""
    job = {"model": {"model_type": "bloom", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4}, "backend": "cpu", "micro_batch_size": 2, "seq_len": 64}
    default = vramplan.estimate(vramplan.load_spec(job))
    eager = vramplan.estimate(vramplan.load_spec({**job, "attention": "eager"}))
    assert default.peak_allocated_bytes == eager.peak_allocated_bytes
    assert any("_supports_sdpa" in str(n) for n in default.notes)
