"""A diffusers pipeline folder (model_index.json + component config.json files) resolves
without the catalog (catalog/model_index.py): each catalog pipeline written out as the
folder diffusers and transformers would hold, its parameter counts against the real classes
built from the written configs on the meta device, its estimate against the catalog entry's;
a pipeline saved by diffusers itself, counted from its safetensors headers and from its
configs; unknown classes and pipelines outside this machine as one line."""
from __future__ import annotations

import inspect
import json
import os

import pytest

import vramplan
from vramplan.catalog.model_index import pipeline_from_folder
from vramplan.catalog.pipelines import find_pipeline, list_pipelines
from vramplan.jobs.diffusion_frozen import tile_side
from vramplan.cli import main
from vramplan.spec import SpecError

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# The SD / SDXL / DiT VAE (sd-vae-ft-ema, stable-diffusion-v1-5 vae/config.json): the catalog
# keeps only its latent channels; the layout below is checked by its count, which must be
# the catalog's num_params (83653863).
SD_VAE = {"in_channels": 3, "out_channels": 3, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
          "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
          "norm_num_groups": 32}
# Keys the catalog adds beside the diffusers config fields (derived from the pipeline code).
OURS = {"class", "num_params", "latent_packing", "note", "spatial_compression", "temporal_compression",
        "first_channels", "encode_chunk_frames", "tile_size", "first_level_stride"}
PIPELINE_OF = {"FluxTransformer2DModel": "FluxPipeline", "SD3Transformer2DModel": "StableDiffusion3Pipeline",
               "CogVideoXTransformer3DModel": "CogVideoXPipeline", "WanTransformer3DModel": "WanPipeline",
               "LTXVideoTransformer3DModel": "LTXPipeline", "HunyuanVideoTransformer3DModel": "HunyuanVideoPipeline",
               "MochiTransformer3DModel": "MochiPipeline", "DiTTransformer2DModel": "DiTPipeline"}
NAMES = [e["name"] for e in list_pipelines()]
# Where the folder and the catalog entry differ, and why (strict: the row fails once they agree).
DIFFER = {
    "cogvideox-2b": "the catalog's num_params (denoiser 1692494016, VAE 215588867) are not the diffusers 0.42 "
                    "classes built from its fields (1693783872, 215583907)",
    "cogvideox-5b": "the catalog's num_params (denoiser 5570479680, VAE 215588867) are not the diffusers 0.42 "
                    "classes built from its fields (5570283072, 215583907)",
    "flux.1-schnell": "the catalog takes 256 T5 tokens (schnell's recommended max_sequence_length); a folder "
                      "gets FluxPipeline's default, 512",
}


def _pipeline_class(pipe: dict) -> str:
    den = pipe["denoiser"]
    if den["class"] == "UNet2DConditionModel":
        return "StableDiffusionXLPipeline" if den.get("addition_embed_type") == "text_time" else "StableDiffusionPipeline"
    return PIPELINE_OF[den["class"]]


def _text_config(enc: dict):
    t = transformers
    if enc["class"] in ("T5EncoderModel", "UMT5EncoderModel"):
        config = t.UMT5Config if enc["class"] == "UMT5EncoderModel" else t.T5Config
        return config(vocab_size=enc.get("vocab_size", 32128), d_model=enc["d_model"], d_kv=enc["d_kv"],
                      d_ff=enc["d_ff"], num_layers=enc["num_layers"], num_heads=enc["num_heads"],
                      feed_forward_proj=enc.get("feed_forward_proj", "gated-gelu"))
    if enc["class"] == "LlamaModel":
        return t.LlamaConfig(vocab_size=enc["vocab_size"], hidden_size=enc["d_model"], intermediate_size=enc["d_ff"],
                             num_hidden_layers=enc["num_layers"], num_attention_heads=enc["num_heads"],
                             num_key_value_heads=enc["num_key_value_heads"])
    return t.CLIPTextConfig(hidden_size=enc["d_model"], intermediate_size=enc["d_ff"],
                            num_hidden_layers=enc["num_layers"], num_attention_heads=enc["num_heads"],
                            projection_dim=enc["d_model"])


def _encoder_components(pipe_cls: str, encoders: list[dict]) -> list[str]:
    """Each encoder's component: the first unused text_encoder* argument of the real
    pipeline's __init__ annotated with the encoder's class."""
    params = inspect.signature(getattr(diffusers, pipe_cls).__init__).parameters
    free = [(n, p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", ""))
            for n, p in params.items() if n.startswith("text_encoder")]
    out: list[str] = []
    for enc in encoders:
        out.append(next(n for n, cls in free if cls == enc["class"] and n not in out))
    return out


def _vae_fields(pipe: dict) -> dict:
    vae = {k: v for k, v in pipe["vae"].items() if k not in OURS}
    if pipe["vae"]["class"] == "AutoencoderKL":
        # the tile the catalog entry means (its sample_size, else the estimator's default):
        # AutoencoderKL.__init__ tiles at config.sample_size
        vae.setdefault("sample_size", tile_side(pipe["vae"]))
    if pipe["vae"]["class"] != "AutoencoderKL" or "block_out_channels" in vae:
        return vae
    if vae["latent_channels"] == 16:  # SD3-medium: the 16-channel VAE that SD3.5-large's entry spells out
        sd35 = {k: v for k, v in find_pipeline("stable-diffusion-3.5-large")["vae"].items() if k not in OURS}
        return {**sd35, "sample_size": vae["sample_size"]}
    return {**SD_VAE, **vae}


def write_folder(pipe: dict, out) -> str:
    """The catalog entry `pipe` as a diffusers pipeline folder: each component's config.json
    as the real class's save_config / save_pretrained writes it from the entry's fields,
    model_index.json naming each; returns the pipeline class."""
    pipe_cls = _pipeline_class(pipe)
    index = {"_class_name": pipe_cls, "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    den = {k: v for k, v in pipe["denoiser"].items() if k not in OURS}
    den_name = "unet" if pipe["kind"] == "unet" else "transformer"
    if den_name == "unet":  # unet/config.json's sample_size: the default side over the VAE's 8
        den["sample_size"] = pipe["defaults"]["height"] // 8
    for name, cls, fields in ((den_name, pipe["denoiser"]["class"], den), ("vae", pipe["vae"]["class"],
                                                                            _vae_fields(pipe))):
        with torch.device("meta"):  # config.json as diffusers writes it: every __init__ argument
            getattr(diffusers, cls).from_config(fields).save_config(os.path.join(out, name))
        index[name] = ["diffusers", cls]
    for comp, enc in zip(_encoder_components(pipe_cls, pipe["text_encoders"]), pipe["text_encoders"]):
        _text_config(enc).save_pretrained(os.path.join(out, comp))
        index[comp] = ["transformers", enc["class"]]
        index["tokenizer" + comp[len("text_encoder"):]] = ["transformers", "T5TokenizerFast"]
    with open(os.path.join(out, "model_index.json"), "w") as fh:
        json.dump(index, fh)
    return pipe_cls


def _meta_count(folder, component: str, cls: str) -> int:
    """The real class built from the folder's config.json on the meta device."""
    with open(os.path.join(folder, component, "config.json")) as fh:
        config = json.load(fh)
    with torch.device("meta"):
        if hasattr(transformers, cls) and not hasattr(diffusers, cls):
            model = getattr(transformers, cls)(transformers.AutoConfig.for_model(config.pop("model_type"), **config))
        else:
            model = getattr(diffusers, cls).from_config(config)
    return sum(p.numel() for p in model.parameters())


def _estimates(model, sizes: dict) -> list[dict]:
    """LoRA with every frozen part on the GPU; full with checkpointing; LoRA with the frozen
    parts offloaded and a tiled VAE encode (the VAE's tile size and chunking)."""
    out = []
    for job, extra in (({"method": "lora"}, {}),
                       ({"method": "full", "gradient_checkpointing": True, "micro_batch_size": 2}, {}),
                       ({"method": "lora"}, {"offload_frozen": True, "vae_tiling": True})):
        e = vramplan.estimate({"task": "diffusion", "model": model, "precision": "bf16",
                               "diffusion": {**sizes, **extra}, **job})
        # everything but the spec and the model's name: peak, phases, terms, timeline, notes
        out.append({k: v for k, v in e.to_dict().items() if k not in ("spec", "model")})
    return out


@pytest.mark.parametrize("name", NAMES)
def test_folder_counts_are_the_real_classes_on_meta(name, tmp_path):
    pipe = find_pipeline(name)
    write_folder(pipe, tmp_path)
    got = pipeline_from_folder(str(tmp_path))
    den = "unet" if pipe["kind"] == "unet" else "transformer"
    assert got["denoiser"]["num_params"] == _meta_count(tmp_path, den, pipe["denoiser"]["class"])
    assert got["vae"]["num_params"] == _meta_count(tmp_path, "vae", pipe["vae"]["class"])
    comps = _encoder_components(_pipeline_class(pipe), pipe["text_encoders"])
    assert [e["role"] for e in got["text_encoders"]] == [e["role"] for e in pipe["text_encoders"]]
    for comp, enc in zip(comps, got["text_encoders"]):
        assert enc["num_params"] == _meta_count(tmp_path, comp, enc["class"]), comp


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=DIFFER[n]))
                                  if n in DIFFER else n for n in NAMES])
def test_folder_estimate_is_the_catalog_entry(name, tmp_path):
    pipe = find_pipeline(name)
    write_folder(pipe, tmp_path)
    got = pipeline_from_folder(str(tmp_path))
    counts = [(p["num_params"], q["num_params"]) for p, q in
              zip([got["denoiser"], got["vae"], *got["text_encoders"]], [pipe["denoiser"], pipe["vae"], *pipe["text_encoders"]])]
    assert all(a == b for a, b in counts), counts
    assert _estimates(str(tmp_path), pipe["defaults"]) == _estimates(name, pipe["defaults"])


@pytest.mark.parametrize("name", sorted(DIFFER))
def test_folder_differs_from_the_catalog_only_where_said(name, tmp_path):
    """With the catalog's counts and token lengths put in, the folder's description gives the
    catalog entry's estimate: nothing else differs."""
    pipe = find_pipeline(name)
    write_folder(pipe, tmp_path)
    got = pipeline_from_folder(str(tmp_path))
    got["denoiser"] = {**got["denoiser"], "num_params": pipe["denoiser"]["num_params"]}
    got["vae"] = {**got["vae"], "num_params": pipe["vae"]["num_params"]}
    got["text_encoders"] = [{**e, "max_tokens": c["max_tokens"]} for e, c in zip(got["text_encoders"], pipe["text_encoders"])]
    assert _estimates(got, pipe["defaults"]) == _estimates(name, pipe["defaults"])


def _tiny_flux(path) -> dict:
    """A tiny Flux pipeline saved by diffusers' save_pretrained (safetensors weights)."""
    torch.manual_seed(0)
    parts = {"transformer": diffusers.FluxTransformer2DModel(
                 patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]),
             "vae": diffusers.AutoencoderKL(block_out_channels=[8, 16], down_block_types=["DownEncoderBlock2D"] * 2,
                                            up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
                                            norm_num_groups=4, layers_per_block=1),
             "text_encoder": transformers.CLIPTextModel(transformers.CLIPTextConfig(
                 hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                 projection_dim=32, vocab_size=1000, bos_token_id=0, eos_token_id=1)),
             "text_encoder_2": transformers.T5EncoderModel(transformers.T5Config(
                 d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=1000,
                 feed_forward_proj="gated-gelu"))}
    diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), tokenizer=None, tokenizer_2=None,
                           **parts).save_pretrained(path)
    return {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}


def test_saved_pipeline_counts_from_weights_and_from_configs(tmp_path):
    truth = _tiny_flux(tmp_path)
    assert any(n.endswith(".safetensors") for n in os.listdir(tmp_path / "transformer"))

    def counts():
        got = pipeline_from_folder(str(tmp_path))
        return {"transformer": got["denoiser"]["num_params"], "vae": got["vae"]["num_params"],
                "text_encoder": got["text_encoders"][0]["num_params"],
                "text_encoder_2": got["text_encoders"][1]["num_params"]}
    assert counts() == truth  # from the safetensors headers
    for comp in truth:
        for n in os.listdir(tmp_path / comp):
            if n.endswith(".safetensors"):
                os.remove(tmp_path / comp / n)
    assert counts() == truth  # from config.json, the classes built on the meta device


def test_tied_embedding_stored_twice_counts_once(tmp_path):
    from safetensors.torch import save_file

    from vramplan.catalog.model_index_counts import header_params
    emb, norm = torch.zeros(10, 4), torch.zeros(4)
    save_file({"shared.weight": emb, "encoder.embed_tokens.weight": emb.clone(), "encoder.final_layer_norm.weight": norm,
               "position_ids": torch.zeros(1, 7, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    assert header_params([str(tmp_path / "model.safetensors")], "T5EncoderModel") == 10 * 4 + 4
    assert header_params([str(tmp_path / "model.safetensors")], "CLIPTextModel") == 2 * 10 * 4 + 4


def test_cli_infers_the_task_and_the_pipeline_defaults(tmp_path, capsys):
    write_folder(find_pipeline("flux.1-dev"), tmp_path)
    code = main(["estimate", str(tmp_path), "--method", "lora", "--precision", "bf16", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 0 and out["spec"]["task"] == "diffusion"
    assert (out["spec"]["diffusion"]["height"], out["spec"]["diffusion"]["width"]) == (1024, 1024)
    assert "from " + tmp_path.name + "'s defaults" in captured.err


def _edit_index(folder, **changes) -> None:
    path = os.path.join(folder, "model_index.json")
    with open(path) as fh:
        index = json.load(fh)
    with open(path, "w") as fh:
        json.dump({**index, **changes}, fh)


@pytest.mark.parametrize("changes,words", [
    ({"_class_name": "KandinskyPipeline"}, ["'KandinskyPipeline'", "FluxPipeline", "WanPipeline"]),
    ({"transformer": ["my_repo", "MyTransformer"]}, ["transformer", "'MyTransformer'", "FluxTransformer2DModel"]),
    ({"text_encoder_2": [None, None]}, ["text_encoder_2", "T5EncoderModel"]),
])
def test_unknown_class_is_one_line(tmp_path, capsys, changes, words):
    write_folder(find_pipeline("flux.1-dev"), tmp_path)
    _edit_index(tmp_path, **changes)
    code = main(["estimate", str(tmp_path), "--task", "diffusion"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("vramplan: error: model:") and all(w in err[0] for w in words)


def test_hub_id_from_the_cache_and_offline(tmp_path, monkeypatch, capsys):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SpecError) as err:
        vramplan.estimate({"task": "diffusion", "model": "someone/tiny-flux"})
    assert err.value.field == "model" and "local folder" in str(err.value)
    assert main(["estimate", "someone/tiny-flux", "--task", "diffusion", "--online"]) == 2  # never downloaded
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1 and "someone/tiny-flux" in line[0] and "local folder" in line[0]
    repo = tmp_path / "models--someone--tiny-flux"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    write_folder(find_pipeline("flux.1-dev"), repo / "snapshots" / ("0" * 40))
    sizes = {"height": 512, "width": 512}
    assert _estimates("someone/tiny-flux", sizes) == _estimates("flux.1-dev", sizes)
    with pytest.raises(SpecError, match="diffusers pipeline .* use --task diffusion"):
        vramplan.estimate({"model": "someone/tiny-flux"})


def test_folder_without_task_says_how(tmp_path):
    write_folder(find_pipeline("stable-diffusion-v1-5"), tmp_path)
    with pytest.raises(SpecError, match="diffusers pipeline .* use --task diffusion"):
        vramplan.estimate({"model": str(tmp_path)})


def test_unmodeled_denoiser_part_is_one_line(tmp_path):
    """Wan image-to-video's image cross-attention (image_dim) is not modeled: said, not guessed."""
    write_folder(find_pipeline("wan2.1-t2v-1.3b"), tmp_path)
    path = tmp_path / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "image_dim": 1280}))
    with pytest.raises(SpecError, match=r"transformer/config.json: image_dim=1280") as err:
        pipeline_from_folder(str(tmp_path))
    assert err.value.field == "model"


@pytest.mark.parametrize("name", ["stable-diffusion-v1-5", "stable-diffusion-xl-base-1.0"])
def test_controlnet_is_made_from_the_folder_unet(name, tmp_path):
    """train_controlnet.py's `ControlNetModel.from_unet(unet)`, the real call on the meta device."""
    pipe = find_pipeline(name)
    write_folder(pipe, tmp_path)
    got = pipeline_from_folder(str(tmp_path))
    with open(tmp_path / "unet" / "config.json") as fh:
        config = json.load(fh)
    with torch.device("meta"):
        controlnet = diffusers.ControlNetModel.from_unet(diffusers.UNet2DConditionModel.from_config(config))
    assert got["controlnet"]["num_params"] == sum(p.numel() for p in controlnet.parameters())
    if "controlnet" in pipe:  # the catalog's SD 1.5 entry: the same ControlNet job
        spec = {"task": "diffusion", "method": "full", "precision": "fp16",
                "diffusion": {"controlnet": True, "height": 512, "width": 512}}
        ours, theirs = (vramplan.estimate({**spec, "model": m}).to_dict() for m in (str(tmp_path), name))
        assert {k: v for k, v in ours.items() if k not in ("spec", "model")} == \
               {k: v for k, v in theirs.items() if k not in ("spec", "model")}
