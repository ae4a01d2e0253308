"""Diffusion / video jobs: tokens, the recorder's block, and the mechanisms of frozen
modules (precomputed, offloaded, frozen copy), LoRA and checkpointing."""
from __future__ import annotations

import pytest

import vramplan
from vramplan.components.arch_dit import DitCtx, joint_block
from vramplan.components.graph import Recorder

BASE = {"task": "diffusion", "model": "cogvideox-2b", "precision": "bf16", "method": "lora",
        "micro_batch_size": 1, "diffusion": {"height": 480, "width": 720, "num_frames": 49}}


def est(diffusion=None, **fields):
    return vramplan.estimate({**BASE, **fields, "diffusion": {**BASE["diffusion"], **(diffusion or {})}})


def test_cogvideox_tokens_and_latents():
    e = est()
    # 49 frames -> 13 latent frames; 480x720 / 8 / patch 2 -> 30 x 45; + 226 T5 tokens
    assert any("(1, 16, 13, 60, 90)" in n and "'image': 17550" in n and "'text': 226" in n for n in e.notes)
    assert e.components.terms["batch/latents"] == 16 * 13 * 60 * 90 * 2


def test_full_block_saves_more_than_lora_and_lora_saves_adapter_inputs():
    def saved(trainable, rank):
        rec = Recorder(backend="cpu")
        ctx = DitCtx(hidden=64, heads=4, ff_mult=4, dtype="bf16", trainable=trainable, lora_rank=rank)
        x, t, emb = rec.new("x", (1, 10, 64), "bf16", trainable), rec.new("t", (1, 3, 64), "bf16", trainable), \
            rec.new("e", (1, 1, 64), "bf16", trainable)
        joint_block(rec, ctx, x, t, emb)
        return rec.saved_bytes()
    assert saved(True, 0) > saved(False, 8) > saved(False, 0) == 0


def test_frozen_modules_precomputed_offloaded_and_copied():
    base, pre = est(), est({"text_encoders": "precomputed", "vae": "precomputed"})
    assert "text_encoder_t5/weights/frozen" in base.events[0].live.terms
    assert not any(k.startswith(("text_encoder", "vae/")) for e in pre.events for k in e.live.terms)
    off = est({"offload_frozen": True})
    peak_static = [e for e in off.events if e.label.startswith("denoiser")]
    assert peak_static and not any("text_encoder_t5/weights" in k for k in peak_static[0].live.terms)
    assert off.peak_allocated_bytes < base.peak_allocated_bytes
    copy = est({"frozen_copy": True, "text_encoders": "precomputed", "vae": "precomputed"})
    assert copy.components.terms["frozen_denoiser/weights/frozen"] == 1692494016 * 2


def test_checkpointing_and_method():
    lora = est({"vae": "precomputed"})
    gc = est({"vae": "precomputed"}, gradient_checkpointing="full")
    full = est({"vae": "precomputed"}, method="full")
    assert gc.peak_allocated_bytes < lora.peak_allocated_bytes < full.peak_allocated_bytes
    assert full.trainable_params == 1692494016


@pytest.mark.parametrize("name", ["stable-diffusion-v1-5", "stable-diffusion-xl-base-1.0", "flux.1-dev",
                                  "stable-diffusion-3-medium", "cogvideox-5b"])
def test_every_catalog_pipeline_estimates(name):
    e = vramplan.estimate({**BASE, "model": name, "diffusion": {"height": 512, "width": 512, "num_frames": 1}})
    assert e.peak_allocated_bytes > 0 and e.components.total("denoiser/activations") > 0


def test_inline_tiny_dit_matches_committed_and_live_cpu_measurements():
    import json
    from pathlib import Path
    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json").read_text())
    for name, row in rows.items():
        if name.startswith("diffusion/"):
            m = row["measured"]["peak_allocated_bytes"]
            assert abs(vramplan.estimate(row["job"]).peak_allocated_bytes / m - 1) < 0.02, name
    pytest.importorskip("diffusers")
    from conftest import measure_fresh  # the meter counts what earlier tests left alive
    job = dict(rows["diffusion/fp32/full/cogvideox-tiny/128px"]["job"])
    m, e = measure_fresh(job), vramplan.estimate(job)
    assert abs(e.peak_allocated_bytes / m["peak_allocated_bytes"] - 1) < 0.03, (e.peak_allocated_bytes, m)


def test_forward_phase_of_every_committed_diffusion_row_within_five_percent():
    """The forward's own peak (inside the last block, or a checkpointed block's no-grad
    working set) against the exact CPU meter's forward phase of the real diffusers step."""
    import json
    from pathlib import Path
    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json").read_text())
    for name, row in rows.items():
        if name.startswith("diffusion/"):
            m = row["measured"]["phases"]["forward"]
            assert abs(vramplan.estimate(row["job"]).phases["forward"] / m - 1) < 0.05, name


def test_wan_forward_and_backward_phases_match_committed_measurements():
    """Wan (full, LoRA with PEFT's fp32 adapters on a bf16 or fp32 base, with and without
    gradient checkpointing): the forward's own peak (the adapted to_out.0 inside a
    checkpointed block, the fp32 residual tail of the last block) and the recomputed
    block's locals in backward (jobs/diffusion_wan.py) against the exact CPU meter's
    phases of the real diffusers + PEFT step (bench/jobs/run.py)."""
    import json
    from pathlib import Path
    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json").read_text())
    names = [k for k in rows if k.startswith("diffusion/") and "/wan-tiny" in k]
    assert {"diffusion/bf16/lora/wan-tiny/gc", "diffusion/bf16/lora/wan-tiny", "diffusion/fp32/lora/wan-tiny/gc"} <= set(names)
    for name in names:
        measured, est = rows[name]["measured"], vramplan.estimate(rows[name]["job"])
        for phase in ("forward", "backward"):
            err = est.phases[phase] / measured["phases"][phase] - 1
            assert abs(err) < 0.02, (name, phase, f"{err:+.2%}")


def test_gradients_kept_by_the_script_or_the_spec():
    """diffusers' train_dreambooth.py calls zero_grad(set_to_none=args.set_grads_to_none),
    a store_true flag: full DreamBooth under the scripts' stack keeps its gradients into the
    next forward; the spec's diffusion.set_grads_to_none overrides; elsewhere zero_grad()."""
    from vramplan.jobs.diffusion_scripts import grads_kept
    job = {**BASE, "model": "stable-diffusion-v1-5", "method": "full", "load_dtype": "float32",
           "diffusion": {"height": 512, "width": 512, "prior_preservation": True}}
    assert not grads_kept(vramplan.load_spec(job))
    script = vramplan.load_spec({**job, "stack": "diffusers-scripts"})
    assert grads_kept(script)
    told = vramplan.load_spec({**job, "stack": "diffusers-scripts",
                               "diffusion": {**job["diffusion"], "set_grads_to_none": True}})
    assert not grads_kept(told)
    kept, freed = vramplan.estimate(script), vramplan.estimate(told)
    assert kept.phases["forward"] - freed.phases["forward"] == kept.components.total("denoiser/gradients")
    with pytest.raises(vramplan.SpecError) as err:
        vramplan.load_spec({**job, "diffusion": {"set_grads_to_none": "no"}})
    assert err.value.field == "diffusion.set_grads_to_none"


def _jobs_rows() -> dict:
    import json
    from pathlib import Path
    return json.loads((Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json").read_text())


@pytest.mark.parametrize("part, plain", [("sd3.5-tiny", "sd3-tiny"), ("sd3.5-medium-tiny", "sd3.5-tiny")])
def test_sd35_part_adds_what_autograd_saves(part, plain):
    """What one SD3.5 part adds to the same tiny denoiser without it, estimated against
    measured (real diffusers step, exact meter), trained and under LoRA: the q/k RMSNorm on
    both streams (JointAttnProcessor2_0's norm_q, norm_k, norm_added_q, norm_added_k;
    diffusers RMSNorm), and SD3.5-medium's MMDiT-X block (dual_attention_layers:
    SD35AdaLayerNormZeroX's second modulation and the image-only attn2)."""
    rows = _jobs_rows()
    for run in ("fp32/full", "bf16/lora"):
        with_part, without = rows[f"diffusion/{run}/{part}"], rows[f"diffusion/{run}/{plain}"]
        measured = with_part["measured"]["peak_allocated_bytes"] - without["measured"]["peak_allocated_bytes"]
        estimated = (vramplan.estimate(with_part["job"]).peak_allocated_bytes
                     - vramplan.estimate(without["job"]).peak_allocated_bytes)
        assert measured > 0 and abs(estimated / measured - 1) < 0.01, (run, estimated, measured)


def test_sd35_medium_lora_adapters_count_as_peft_adds_them():
    """attn2's to_q, to_k, to_v and to_out.0 match the scripts' target suffixes too."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from peft import LoraConfig
    from vramplan.measure.diffusion import build_denoiser
    job = _jobs_rows()["diffusion/bf16/lora/sd3.5-medium-tiny"]["job"]
    with torch.device("meta"):
        model = build_denoiser(job["model"], job["diffusion"], torch.float32).requires_grad_(False)
        model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert any(n.startswith("transformer_blocks.0.attn2.") for n, p in model.named_parameters() if p.requires_grad)
    assert vramplan.estimate(job).trainable_params == trained


def test_tiny_dit_block_backward_holds_the_incoming_gradient_only_with_accumulation():
    """At a DiT block's backward peak (ff.net.2's AddmmBackward0, jobs/diffusion_dit.py)
    ff.net.2's new weight and bias gradients (f x h + h) are in flight beside the `.grad`
    they are added into when gradients are accumulated; without a `.grad` they become it.
    Block 0's conditioning-embedding gradient waits in AccumulateGrad's InputBuffer either
    way (its 256 -> h and h -> h Linears and the 1001-row class table)."""
    import json
    from pathlib import Path
    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "jobs" / "results.json").read_text())
    job = rows["diffusion/fp32/full/dit-tiny/ga2"]["job"]
    h, f = 128, 512
    acc, one = vramplan.estimate(job), vramplan.estimate({**job, "grad_accum_steps": 1})
    peak = max(acc.events, key=lambda e: e.total)
    assert peak.label == "denoiser stage 1 backward"
    assert peak.live.terms["denoiser/backward/incoming_grad"] == (f * h + h) * 4
    assert peak.live.terms["denoiser/backward/grad_conditioning_pending"] == (256 * h + h + h * h + h + 1001 * h) * 4
    assert peak.live.terms["denoiser/gradients"] == 988064 * 4
    solo = next(e for e in one.events if e.label == "denoiser stage 1 backward")
    assert "denoiser/backward/incoming_grad" not in solo.live.terms
    assert solo.live.terms["denoiser/gradients"] == (f * h + h) * 4  # ff.net.2's, stolen by AccumulateGrad
    assert "denoiser/activations/blocks/ff.video_out" in peak.live.terms  # block 0's, not block 1's
    assert peak.live.terms["denoiser/activations/blocks/ff.video_out"] == 2 * 256 * h * 4


def test_timeline_counts_in_flight_gradients_only_when_gradients_are_alive():
    from vramplan.breakdown import Breakdown
    from vramplan.timeline import StepPlan, walk

    def plan(accum):
        return StepPlan(static=Breakdown().add("w", 100), grads_by_stage=[Breakdown().add("g", 10)] * 2,
                        stage_acts=[Breakdown().add("a", 7)] * 2, loss_saved=Breakdown(),
                        forward_end_transient=Breakdown(), loss_backward_transient=Breakdown(),
                        stage_backward_transient=[Breakdown().add("t", 3)] * 2, optimizer_temporaries=Breakdown(),
                        grads_alive_in_forward=accum, stage_grads_in_flight=[Breakdown().add("in", 5), Breakdown()])
    on = {e.label: e.total for e in walk(plan(True))}
    off = {e.label: e.total for e in walk(plan(False))}
    # stage 0 with accumulation: weights, both stages' gradients, its activations, transient, in flight
    assert on["stage 0 backward"] == 100 + 20 + 7 + 3 + 5
    assert on["stage 1 backward"] == 100 + 20 + 14 + 3
    # without: stage 1's own gradients as they are made, nothing in flight
    assert off["stage 0 backward"] == 100 + 10 + 10 + 7 + 3
