"""torchtune's mechanisms: chunked cross-entropy, activation offloading, the optimizer in
backward, torchao NF4 QLoRA, the recipe importer and the compile note.

The estimates are checked against bench/torchtune/results.json: torchtune 0.6.1's own code
(recipe `_loss_step`, CEWithChunkedOutputLoss, OffloadActivations, register_optim_in_bwd_hooks)
measured on CPU under the exact meter (bench/torchtune/run.py)."""
from __future__ import annotations

import json
import pathlib

import pytest

import vramplan
from vramplan.importers import import_config_files
from vramplan.spec import SpecError

RESULTS = json.loads((pathlib.Path(__file__).parents[1] / "bench" / "torchtune" / "results.json").read_text())


@pytest.mark.parametrize("case", RESULTS, ids=[c["case"] for c in RESULTS])
def test_estimate_matches_torchtune_measured_on_cpu(case):
    est = vramplan.estimate(vramplan.load_spec(case["spec"]))
    assert est.peak_allocated_bytes == pytest.approx(case["measured"]["peak_bytes"], rel=0.02)
    for ours, theirs in (("forward", "fwd"), ("backward", "bwd"), ("optimizer", "opt")):
        assert est.phases[ours] == pytest.approx(case["measured"]["phase_peaks"][theirs], rel=0.05)


def _spec(**fields):
    base = {"model": RESULTS[0]["spec"]["model"], "stack": "torchtune", "precision": "bf16",
            "micro_batch_size": 2, "seq_len": 512, "backend": "cpu"}
    return vramplan.load_spec({**base, **fields})


def test_chunked_loss_backward_holds_one_chunk_of_fp32_gradients():
    """Standard CE holds T x v fp32 gradients at the loss backward; chunked holds T/8 x v."""
    std = vramplan.estimate(_spec()).phases["backward"]
    chunked = vramplan.estimate(_spec(loss_impl="chunked")).phases["backward"]
    tokens, v = 2 * 512, RESULTS[0]["spec"]["model"]["vocab_size"]
    assert std - chunked >= 2 * tokens * v * 4 * 7 // 8 - tokens * v * 2


def test_offloading_and_optimizer_in_backward_only_lower_the_estimate():
    plain = vramplan.estimate(_spec(gradient_checkpointing="full"))
    both = vramplan.estimate(_spec(gradient_checkpointing="full", activation_offloading=True,
                                   optimizer_in_backward=True))
    assert both.peak_allocated_bytes < plain.peak_allocated_bytes
    assert both.phases["optimizer"] < plain.phases["optimizer"]


def test_optimizer_in_backward_refuses_gradient_accumulation():
    with pytest.raises(SpecError, match="optimizer_in_backward"):
        _spec(optimizer_in_backward=True, grad_accum_steps=4)


def test_compile_is_accepted_with_a_note():
    est = vramplan.estimate(_spec(compile=True))
    assert any("compile" in str(n) for n in est.notes)
    assert est.peak_allocated_bytes == vramplan.estimate(_spec()).peak_allocated_bytes


def _to_nf4():
    for path in ("torchao.dtypes.nf4tensor", "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"):
        try:
            return __import__(path, fromlist=["to_nf4"]).to_nf4
        except ImportError:
            continue
    pytest.skip("torchao with NF4Tensor is not installed")


def test_torchao_nf4_bytes_match_the_real_tensor():
    torch = pytest.importorskip("torch")
    to_nf4 = _to_nf4()
    from vramplan.components.quant import torchao_nf4
    for shape in ((512, 256), (1024, 2048)):
        t = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
        inner = (t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4)
        n = shape[0] * shape[1]
        assert sum(torchao_nf4(n, "bf16")) == sum(x.untyped_storage().nbytes() for x in inner)


def test_torchtune_qlora_keeps_the_rest_bf16():
    """No prepare_model_for_kbit_training: embeddings, norms and adapters stay in bf16."""
    peft = vramplan.estimate(vramplan.load_spec({"model": "llama-3.2-1b", "method": "qlora"}))
    tune = vramplan.estimate(vramplan.load_spec({"model": "llama-3.2-1b", "method": "qlora", "stack": "torchtune"}))
    embed = 128256 * 2048
    assert peft.components.total("weights") - tune.components.total("weights") >= embed * 2


RECIPE = """model:
  _component_: torchtune.models.llama3_2.lora_llama3_2_3b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  lora_rank: 64
  lora_alpha: 128
  quantize_base: True
dataset:
  _component_: torchtune.datasets.alpaca_cleaned_dataset
  packed: True
batch_size: 2
optimizer:
  _component_: torch.optim.AdamW
  fused: True
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
optimizer_in_bwd: False
compile: True
enable_activation_checkpointing: True
enable_activation_offloading: True
dtype: bf16
"""


def test_recipe_switches_set_the_spec(tmp_path):
    path = tmp_path / "tt.yaml"
    path.write_text(RECIPE)
    over, _ = import_config_files(recipe=str(path))
    assert over["stack"] == "torchtune" and over["method"] == "qlora" and over["quantization"]["type"] == "nf4"
    assert over["activation_offloading"] is True and over["compile"] is True and over["packing"] is True
    assert over["optimizer_in_backward"] is False and over["loss_impl"] == "chunked"


def test_installed_torchtune_configs_import(tmp_path):
    """torchtune's own shipped recipe configs (when torchtune is installed)."""
    pytest.importorskip("torchtune")
    import torchtune
    configs = pathlib.Path(torchtune.__file__).parents[1] / "recipes" / "configs" / "llama3_2"
    full, _ = import_config_files(recipe=str(configs / "3B_full_single_device.yaml"))
    assert full["optimizer_in_backward"] is True and full["activation_offloading"] is False
    qlora, _ = import_config_files(recipe=str(configs / "3B_qlora_single_device.yaml"))
    assert qlora["method"] == "qlora" and qlora["loss_impl"] == "chunked"


def test_torchtune_qlora_is_estimated_on_cpu_but_awq_is_not():
    """torchao's NF4 runs on CPU (bench/torchtune measures it there); AWQ's default GEMM
    kernel does not (GPTQModel's torch kernel does: bench/quant)."""
    tune = _spec(method="qlora", loss_impl="chunked")
    assert tune.quantization.type.value == "nf4"
    with pytest.raises(SpecError, match="^quantization.kernel: awq's gemm kernel needs CUDA"):
        vramplan.load_spec({**tune.to_dict(), "stack": "hf-trainer", "quantization": {"type": "awq"}})
