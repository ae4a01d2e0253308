"""Dynamic padding: the `lengths` spec section, the order of step lengths, the multi-step
allocator replay (cases worked out by hand from CUDACachingAllocator.cpp's rules), the
lengths file read at the edge, and the estimate/compare/report wiring."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan import estimate, load_spec
from vramplan.allocator.schedule import replay_schedule
from vramplan.spec import SpecError
from vramplan.spec.lengths import LengthsConfig, parse_lengths
from vramplan.step.lengths import draw_rows, order_rows, step_lengths

MiB = 2**20
SRC = str(Path(__file__).resolve().parents[1] / "src")


def one_tensor(length: int) -> tuple:
    """A step that allocates one tensor of `length` MiB and frees it."""
    return ((100, length * MiB), (100, 0))


# -- the allocator carried across steps -------------------------------------------------

def test_short_then_long_opens_a_segment_that_longest_first_avoids():
    # 30 MiB > kMinLargeAlloc (10 MiB): a 30 MiB segment of its own (rounded to 2 MiB).
    # The 50 MiB step then finds only the cached 30 MiB block: a second segment, 80 MiB
    # reserved. Longest first: one 50 MiB segment; the 30 MiB step takes it and splits
    # the 20 MiB rest off (remaining > kSmallSize in the large pool): 50 MiB reserved.
    short_first = replay_schedule((), one_tensor, [30, 50])
    longest_first = replay_schedule((), one_tensor, [50, 30])
    assert short_first.reserved_bytes == 80 * MiB and short_first.segments == 2
    assert short_first.peak_step == 1 and short_first.peak_length == 50
    assert longest_first.reserved_bytes == 50 * MiB and longest_first.segments == 1
    assert longest_first.peak_step == 0


def test_capacity_frees_the_cached_segment_and_retries():
    # 30 + 50 MiB exceed a 60 MiB device: malloc releases the cached 30 MiB segment and
    # retries; the 50 MiB step then fits (no out-of-memory), 50 MiB reserved at the end.
    run = replay_schedule((), one_tensor, [30, 50], capacity=60 * MiB)
    assert run.out_of_memory_step is None and run.segments == 1
    assert run.reserved == (30 * MiB, 50 * MiB)


def test_a_step_too_large_for_the_device_is_reported_at_its_index():
    run = replay_schedule((), one_tensor, [30, 30, 70, 30], capacity=60 * MiB)
    assert run.out_of_memory_step == 2
    # the run goes on without the limit: the cached 30 MiB segment stays, 70 MiB opens
    assert run.reserved_bytes == 100 * MiB and run.reserved[:2] == (30 * MiB, 30 * MiB)


def test_repeated_lengths_are_not_replayed_again():
    calls = []

    def ops(length):
        calls.append(length)
        return one_tensor(length)
    run = replay_schedule((), ops, [30] * 5 + [20] * 5)
    # 30: the first opens a segment, the second is served from cache (then known);
    # 20 splits the cached 30 MiB block without a new segment: known after one run.
    assert run.replayed == 3 and calls == [30, 30, 20]
    assert run.reserved == (30 * MiB,) * 10


# -- lengths of the steps ---------------------------------------------------------------

def test_batches_pad_to_their_longest_row_and_the_multiple():
    cfg = LengthsConfig(max=700, pad_to_multiple_of=64, bucket=1)
    rows = [100, 300, 50, 700]
    # [100, 300] -> 300 -> 320; [50, 700 truncated to seq_len 512] -> 512
    assert step_lengths(cfg, 2, 512, rows=rows) == [320, 512]
    assert step_lengths(cfg, 2, 512, rows=rows, batching="sorted-longest-first") == [512, 128]
    assert step_lengths(cfg, 2, 512, rows=rows, cap=256) == [256, 256]


def test_group_by_length_puts_the_longest_row_in_the_first_batch():
    rows = draw_rows(LengthsConfig(max=3000, percentiles=((50, 400), (90, 1200))), 400)
    ordered = order_rows(rows, "group-by-length", 4, seed=0)
    assert ordered[0] == 3000 and sorted(ordered) == sorted(rows)


def test_draws_are_seeded_follow_the_percentiles_and_hold_the_longest_row():
    cfg = LengthsConfig(max=4096, percentiles=((50, 600), (90, 1500)))
    rows = draw_rows(cfg, 2000)
    assert rows == draw_rows(cfg, 2000) and rows != draw_rows(LengthsConfig(max=4096, seed=1,
                                                                            percentiles=((50, 600), (90, 1500))), 2000)
    assert max(rows) == rows[-1] == 4096 and min(rows) >= 1  # the longest row comes last
    below = sum(r <= 600 for r in rows) / len(rows)
    assert 0.46 < below < 0.54


def test_buckets_round_up_but_never_past_the_longest_padded_length():
    cfg = LengthsConfig(max=4000, bucket=256, steps=50)
    lengths = step_lengths(cfg, 2, 4000)
    assert max(lengths) == 4000 and all(x % 256 == 0 for x in lengths if x != 4000)


# -- the spec section -------------------------------------------------------------------

@pytest.mark.parametrize("section, field", [
    ({"p50": 600, "p90": 500, "max": 4096}, "lengths.p90"),
    ({"p50": 600, "max": 500}, "lengths.p50"),
    ({"p50": 600}, "lengths.max"),
    ({"max": 4096, "batching": "shortest"}, "lengths.batching"),
    ({"max": 4096, "cap": 0}, "lengths.cap"),
    ({"max": 4096, "steps": "many"}, "lengths.steps"),
    ({"max": 4096, "mx": 3}, "lengths.mx"),
    ({"p100": 600, "max": 4096}, "lengths.p100"),
    ([600, 4096], "lengths"),
])
def test_bad_lengths_name_the_field(section, field):
    with pytest.raises(SpecError) as err:
        load_spec({"model": "gpt2", "lengths": section})
    assert err.value.field == field and "\n" not in str(err.value)


def test_packing_and_lengths_do_not_mix():
    with pytest.raises(SpecError) as err:
        load_spec({"model": "gpt2", "packing": True, "lengths": {"max": 512}})
    assert err.value.field == "lengths"


def test_section_round_trips():
    spec = load_spec({"model": "gpt2", "lengths": {"p50": 200, "p99.9": 900, "max": 1024,
                                                   "batching": "group_by_length", "cap": 800}})
    again = load_spec(spec.to_dict())
    assert again.lengths == spec.lengths and again.lengths.batching == "group-by-length"
    assert parse_lengths(spec.to_dict()["lengths"]).percentiles == ((50.0, 200), (99.9, 900))


# -- the lengths file, read at the edge -------------------------------------------------

def test_lengths_file_is_read_at_the_edge_not_by_the_spec_or_the_core(tmp_path):
    from vramplan.estimation import estimate_model
    from vramplan.importers.lengths import resolve_lengths
    from vramplan.sources import resolve_model
    spec = load_spec({"model": "gpt2", "seq_len": 512, "gpu": "H100-80GB",
                      "lengths": {"lengths_file": str(tmp_path / "absent.txt")}})
    assert not spec.lengths.resolved  # load_spec opened nothing
    with pytest.raises(SpecError) as err:
        estimate_model(resolve_model(spec), spec)
    assert err.value.field == "lengths.lengths_file"
    with pytest.raises(SpecError) as err:
        resolve_lengths(spec)
    assert err.value.field == "lengths.lengths_file" and "file not found" in str(err.value)
    (tmp_path / "lens.txt").write_text("# tokens per row\n" + "\n".join(str(n) for n in range(1, 101)) + "\n")
    read = resolve_lengths(spec.with_(lengths={"lengths_file": "lens.txt"}), str(tmp_path))
    assert read.lengths.max == 100 and read.lengths.min == 1 and read.lengths.rows == 100
    assert dict(read.lengths.percentiles)[50] == 50 and dict(read.lengths.percentiles)[99] == 99


def test_lengths_file_as_json_list_and_a_bad_line(tmp_path):
    from vramplan.importers.lengths import read_lengths
    (tmp_path / "l.json").write_text(json.dumps([5, 9, 7]))
    assert read_lengths(str(tmp_path / "l.json")) == [5, 9, 7]
    (tmp_path / "bad.txt").write_text("12\n-3\n")
    with pytest.raises(SpecError) as err:
        read_lengths(str(tmp_path / "bad.txt"))
    assert err.value.field == "lengths.lengths_file" and "line 2" in str(err.value)


def test_cli_reads_the_file_beside_the_spec_and_names_a_bad_one(tmp_path):
    (tmp_path / "lens.txt").write_text("\n".join(["120", "300", "512", "90"] * 20))
    spec = {"model": "gpt2", "seq_len": 512, "micro_batch_size": 2, "gpu": "H100-80GB",
            "lengths": {"lengths_file": "lens.txt", "steps": 20}}
    (tmp_path / "job.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "vramplan", "estimate", "--spec", str(tmp_path / "job.json"), "--format", "json"]
    env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=str(Path.home()), env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["spec"]["lengths"]["max"] == 512 and data["lengths"]["longest_padded_length"] == 512
    (tmp_path / "lens.txt").write_text("120\nlots\n")
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "lengths.lengths_file" in bad.stderr and "line 2" in bad.stderr


# -- the estimate -----------------------------------------------------------------------

JOB = {"model": "qwen2.5-0.5b", "seq_len": 1024, "micro_batch_size": 2, "gpu": "H100-80GB"}


@pytest.fixture(scope="module")
def plain_and_dynamic():
    plain = estimate(load_spec(JOB))
    dynamic = estimate(load_spec({**JOB, "lengths": {"p50": 200, "p90": 500, "p99": 800, "max": 1024,
                                                     "steps": 60}}))
    return plain, dynamic


def test_a_distribution_reaching_seq_len_reserves_at_least_the_max_length_estimate(plain_and_dynamic):
    plain, dynamic = plain_and_dynamic
    rep = dynamic.lengths
    assert rep.longest_padded == 1024
    assert rep.run.reserved_bytes >= plain.allocator.reserved_bytes
    assert dynamic.reserved_bytes >= plain.reserved_bytes
    # one GPU: the estimate's reserve is the replay of one step, and the run's replay (far
    # below 80 GB) takes its place
    assert dynamic.reserved_bytes == max(plain.reserved_bytes, rep.run.reserved_bytes)
    assert dynamic.reserved_bytes - plain.reserved_bytes == rep.applied_bytes
    assert rep.longest_first.reserved_bytes <= rep.run.reserved_bytes
    assert rep.capped is not None and rep.cap_tokens == 800
    assert rep.capped.reserved_bytes <= rep.run.reserved_bytes


def test_json_and_text_name_the_peak_step(plain_and_dynamic):
    _, dynamic = plain_and_dynamic
    data = dynamic.to_dict()["lengths"]
    assert data["peak"]["length"] == data["run"]["lengths"][data["peak"]["step"]]
    assert data["reserved_bytes"] == max(dynamic.lengths.run.reserved)
    assert data["longest_first"]["saves_bytes"] == data["reserved_bytes"] - data["longest_first"]["reserved_bytes"]
    assert f"step {data['peak']['step']}" in dynamic.lengths.summary()
    assert "lengths" not in plain_and_dynamic[0].to_dict()


def test_notes_say_when_the_terms_stay_at_seq_len():
    short = estimate(load_spec({**JOB, "lengths": {"p50": 100, "max": 600, "steps": 10}}))
    assert short.lengths.longest_padded == 600 and any("pads to 600" in n for n in short.notes)
    cpu = estimate(load_spec({**JOB, "backend": "cpu", "gpu": None, "lengths": {"max": 600}}))
    assert cpu.lengths is None and any(n.startswith("lengths:") for n in cpu.notes)


def test_applied_extra_stops_at_the_capacity_unless_the_replay_ran_out():
    from vramplan.allocator.schedule import ScheduleResult
    from vramplan.step.lengths import LengthsReplay

    def res(top, oom=None):
        return ScheduleResult(lengths=(1,), reserved=(top,), reserved_bytes=top, peak_step=0, segments=1,
                              out_of_memory_step=oom)
    rep = LengthsReplay(cfg=LengthsConfig(max=8), run=res(30), longest_first=res(20), all_longest=res(20))
    assert rep.extra_bytes == 10
    assert rep.applied(95, 100) == 5 and rep.applied(95, None) == 10 and rep.applied(200, 100) == 0
    rep.run = res(30, oom=0)
    assert rep.applied(95, 100) == 10


def test_compare_offers_longest_first_with_a_distribution():
    from vramplan.plan.compare import default_strategies
    names = lambda s: [x.name for x in default_strategies(s)]  # noqa: E731
    spec = load_spec({**JOB, "lengths": {"max": 1024}})
    assert "longest-first" in names(spec) and "longest-first" not in names(load_spec(JOB))
    assert "longest-first" not in names(spec.with_(lengths={"max": 1024, "batching": "sorted-longest-first"}))


def test_skipping_known_steps_changes_no_step_of_a_real_run():
    from vramplan.allocator.model import CachingAllocator
    from vramplan.components.trainable import param_set
    from vramplan.sources import resolve_model
    from vramplan.step.lengths import length_ops
    spec = load_spec({**JOB, "lengths": {"p50": 200, "p90": 500, "max": 1024, "steps": 30}})
    desc = resolve_model(spec)
    setup, ops_for = length_ops(desc, spec, param_set(desc, spec), True)
    lengths = step_lengths(spec.lengths, 2, 1024)
    fast = replay_schedule(setup, ops_for, lengths)
    alloc, live, every = CachingAllocator(), {}, []
    for handle, nbytes in setup:
        live[handle] = alloc.malloc(nbytes)
    for length in lengths:
        for handle, nbytes in ops_for(length):
            if nbytes:
                live[handle] = alloc.malloc(nbytes)
            else:
                alloc.free(live.pop(handle))
        every.append(alloc.peak_reserved)
    assert fast.replayed < len(lengths) and list(fast.reserved) == every
    assert fast.segments == len(alloc.segment_sizes())


def test_step_events_for_replay_cuda_builds_with_the_cublas_workspaces():
    # bench/allocator/replay_cuda.py's event list: the same workspaces as the estimate's static terms
    from vramplan.estimation import step_events
    events = step_events(load_spec(JOB))
    terms = {e[3] for e in events.setup + events.lazy}  # made by their handles' first matmuls
    assert {"runtime/cublas_workspace", "runtime/cublaslt_workspace"} <= terms


def test_text_answer_has_the_lengths_line(plain_and_dynamic):
    from rich.console import Console
    from vramplan.report.text import render_estimate
    console = Console(record=True, width=400)
    render_estimate(plain_and_dynamic[1], console=console)
    text = console.export_text()
    line = next(x for x in text.splitlines() if x.startswith("lengths (random, 60 steps)"))
    assert f"at step {plain_and_dynamic[1].lengths.run.peak_step} " in line and "longest-first" in line
