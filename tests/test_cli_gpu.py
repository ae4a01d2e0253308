"""--gpu by size with exact units, the extended GPU catalog, and names that ask instead of guessing."""
import json

import pytest

from vramplan import catalog
from vramplan.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("text, nbytes", [
    ("64GB", 64 * 10**9), ("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("81559MiB", 81559 * 2**20),
    ("23.5GB", 23_500_000_000), ("1TB", 10**12), ("64gb", 64 * 10**9)])
def test_size_units_are_exact(text, nbytes):
    gpu = catalog.find_gpu(text)
    assert gpu.memory_bytes == nbytes and gpu.by_size and gpu.memory_marketed.replace(" ", "") == text.replace(" ", "")


@pytest.mark.parametrize("text", ["64G", "80", "48 g"])
def test_size_without_a_unit_asks(text):
    with pytest.raises(catalog.UnknownNameError, match="GB .*or .*GiB"):
        catalog.find_gpu(text)


def test_gpu_by_size_on_the_command_line(capsys):
    code, out, _ = run(capsys, "estimate", "qwen2.5-0.5b", "--gpu", "80GiB", "--json")
    data = json.loads(out)
    assert code == 0 and data["gpu"]["memory_bytes"] == 80 * 2**30
    # the same job against 1 GB (10^9) does not fit: exit 1, not an error
    assert run(capsys, "estimate", "qwen2.5-0.5b", "--gpu", "1GB")[0] == 1


def test_planning_needs_a_named_gpu(capsys):
    code, _, err = run(capsys, "fit", "qwen2.5-0.5b", "--gpu", "64GB")
    assert code == 2 and "step time" in err and err.count("\n") == 1


@pytest.mark.parametrize("name, members", [
    ("A100", {"a100-40gb", "a100-80gb"}), ("a800", {"a800-40gb", "a800-80gb"}),
    ("V100", {"v100-16gb", "v100-32gb"})])
def test_ambiguous_names_ask(capsys, name, members):
    with pytest.raises(catalog.AmbiguousNameError) as exc:
        catalog.find_gpu(name)
    assert set(exc.value.candidates) == members
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--gpu", name)
    assert code == 2 and all(m in err for m in members) and err.count("\n") == 1


def test_unknown_gpu_keeps_its_quotes_and_suggests(capsys):
    code, _, err = run(capsys, "estimate", "llama-3.2-1b", "--gpu", "h801")
    assert code == 2 and "unknown GPU 'h801'" in err and "did you mean" in err and "h800-80gb" in err


@pytest.mark.parametrize("query, name, mib", [
    ("H800", "h800-80gb", 81559), ("A800-SXM4-80GB", "a800-80gb", 81920), ("H20", "h20-96gb", 97871),
    ("L20", "l20", 46068), ("L40", "l40", 46068), ("RTX 4090 D", "rtx-4090d", 24564),
    ("RTX 6000 Ada", "rtx-6000-ada", 49140), ("A6000", "rtx-a6000", 49140),
    ("Ascend 910B", "ascend-910b", 65536), ("MI300X", "mi300x", None), ("mi250x", "mi250x-gcd", None),
    ("4090", "rtx-4090", 24564), ("l40s", "l40s", 46068)])
def test_rented_cards_resolve(query, name, mib):
    gpu = catalog.find_gpu(query)
    assert gpu.name == name
    if mib is not None:
        assert gpu.memory_bytes == mib * 2**20


def test_every_catalog_gpu_says_what_its_figure_means():
    for gpu in catalog.list_gpus():
        assert "GB" in gpu.memory_marketed and gpu.sources
        assert any(w in gpu.memory_unit_note for w in ("10^9", "GiB", "MiB", "MB")), gpu.name
        assert not gpu.by_size
    # no alias or name answers to two cards
    seen = {}
    for gpu in catalog.list_gpus():
        for key in (gpu.name, *gpu.aliases):
            assert seen.setdefault(key.lower(), gpu.name) == gpu.name, key
