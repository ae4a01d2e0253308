"""Error bars (vramplan.bounds, catalog/bounds.json), the verdict and fit's headroom."""
from __future__ import annotations

import dataclasses
import math

import pytest

import vramplan
from vramplan.bounds import (FITS, LOW_END, NO_FIT, bounds_around, coverage, default_headroom_bytes,
                             interval, leave_one_out, verdict)
from vramplan.catalog.runtime import error_bounds
from vramplan.units import GiB


def test_interval_leaves_the_odd_row_out_at_the_low_end():
    r = [0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 2.0]
    # n=10, target 0.9: keep ceil(9.0) = 9 rows, 1 outside, taken from the low end
    assert interval(r, 0.9) == (0.9, 2.0)
    assert coverage(r, 0.9, 2.0) == 0.9


def test_interval_splits_two_outside_rows_between_the_ends():
    r = [1 + i / 100 for i in range(20)]           # 1.00 .. 1.19
    # n=20: keep 18, one left out at each end
    assert interval(r, 0.9) == (1.01, 1.18)


def test_interval_of_few_rows_is_their_range():
    r = [1.3, 0.95, 1.1, 1.02, 0.99, 1.2]
    # n=6: ceil(5.4) = 6 rows kept
    assert interval(r, 0.9) == (0.95, 1.3)
    with pytest.raises(ValueError):
        interval([], 0.9)


def test_leave_one_out_misses_the_extremes():
    # each row against the range of the other five: the smallest and largest fall outside
    assert leave_one_out([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.9) == pytest.approx(4 / 6)
    assert leave_one_out([1.0], 0.9) is None


def test_bounds_around_scales_each_metric():
    rel = {"allocated": (0.9, 1.2), "device": (1.0, 1.5)}
    out = bounds_around({"allocated": 100 * GiB, "device": 10 * GiB, "reserved": 7}, rel)
    assert out == {"allocated": [90 * GiB, 120 * GiB], "device": [10 * GiB, 15 * GiB]}


def test_verdict_three_cases():
    cap = 80 * GiB
    assert verdict(60 * GiB, 70 * GiB, cap) == FITS
    assert verdict(70 * GiB, 85 * GiB, cap) == LOW_END
    assert verdict(81 * GiB, 90 * GiB, cap) == NO_FIT
    assert verdict(80 * GiB, 80 * GiB, cap) == FITS          # exactly at capacity still fits
    assert verdict(70 * GiB, None, cap) == FITS              # no bound (cpu backend): the estimate decides


def test_default_headroom_keeps_the_upper_bound_on_the_card():
    # hi = 1.25: an estimate at the limit 100 has its upper bound at 125 = capacity
    assert default_headroom_bytes(125, {"device": (1.0, 1.25)}) == 25
    assert default_headroom_bytes(125, {"device": (0.9, 0.98)}) == 0


def test_bounds_file_meets_its_target_on_the_rows_it_was_built_from():
    data = error_bounds()
    assert set(data["metrics"]) == {"allocated", "reserved", "device"}
    assert "poor" in data["excluded_fidelity"]
    for name, m in data["metrics"].items():
        assert m["lo"] <= m["hi"], name
        assert m["n"] == len(m["rows"]) >= 2, name
        assert m["coverage"] >= data["target_coverage"], name
        assert 0 <= m["coverage_leave_one_out"] <= 1, name


def _estimate(**kw):
    job = {"model": "qwen2.5-0.5b", "method": "lora", "micro_batch_size": 2, "seq_len": 512, "gpu": "a100-40gb"}
    return vramplan.estimate(vramplan.load_spec({**job, **kw}))


def test_estimate_bounds_and_verdict_follow_the_data_file():
    est = _estimate()
    rel = {m: (v["lo"], v["hi"]) for m, v in error_bounds()["metrics"].items()}
    lo, hi = rel["device"]
    assert est.bounds["device"] == [int(est.device_bytes * lo), math.ceil(est.device_bytes * hi)]
    assert est.bounds["allocated"][1] == math.ceil(est.peak_allocated_bytes * rel["allocated"][1])
    out = est.to_dict()
    assert set(out["bounds"]) == {"allocated", "reserved", "device"} and out["verdict"] == FITS
    upper = est.bounds["device"][1]
    between = dataclasses.replace(est.gpu, memory_bytes=(est.device_bytes + upper) // 2)
    assert dataclasses.replace(est, gpu=between).verdict == (LOW_END if upper > est.device_bytes else FITS)
    small = dataclasses.replace(est.gpu, memory_bytes=est.device_bytes - 1)
    assert dataclasses.replace(est, gpu=small).verdict == NO_FIT


def test_cpu_backend_has_no_bounds():
    est = _estimate(backend="cpu", gpu=None)
    assert est.bounds is None and est.verdict is None and est.to_dict()["bounds"] is None


def test_fit_keeps_the_default_headroom():
    from vramplan.plan.fit import default_fit_headroom, fit
    spec = vramplan.load_spec({"model": "qwen2.5-0.5b", "method": "full", "seq_len": 2048, "gpu": "l4"})
    space = {"micro_batch_size": [1, 2, 4, 8, 16, 32]}
    report = fit(spec, axes=space, top_k=6, suggest=False)
    cap = vramplan.estimate(spec).gpu.memory_bytes
    assert report.headroom_bytes == default_fit_headroom(cap) > 0
    assert report.limit_bytes == cap - report.headroom_bytes
    assert report.results
    for r in report.results:
        assert r.estimate.bounds["device"][1] <= cap + 1     # the upper bound stays on the card
    none = fit(spec, axes=space, top_k=6, suggest=False, headroom_bytes=0)
    assert none.limit_bytes == cap and none.headroom_bytes == 0
    assert max(r.estimate.spec.micro_batch_size for r in none.results) >= \
        max((r.estimate.spec.micro_batch_size for r in report.results), default=0)


def test_headroom_flag_takes_a_fraction_or_bytes():
    from vramplan.plan.answers import parse_headroom
    from vramplan.spec import SpecError
    assert parse_headroom("0.05", 100 * GiB) == 5 * GiB
    assert parse_headroom("5%", 100 * GiB) == 5 * GiB
    assert parse_headroom("2GiB", 100 * GiB) == 2 * GiB
    assert parse_headroom("3000000", 100 * GiB) == 3_000_000
    with pytest.raises(SpecError):
        parse_headroom("1.2.3", 100 * GiB)


def _bench(name: str):
    import importlib.util
    import sys
    from pathlib import Path
    folder = Path(__file__).resolve().parents[1] / "bench" / "accuracy"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(folder))


def test_score_published_stats_per_metric_by_hand():
    sp = _bench("score_published")
    st = sp.stats([-0.2, -0.05, 0.1])
    assert st == {"n": 3, "median_abs_error": 0.1, "worst_abs_error": 0.2, "share_under": 0.667,
                  "share_over": 0.333, "share_under_10pct": 0.333}
    rows = [{"metric": "reserved", "fidelity": "approx", "error": -0.1},
            {"metric": "reserved", "fidelity": "poor", "error": 0.5},
            {"metric": "nvml", "fidelity": "exact", "error": 0.02}]
    assert sp.by_metric(rows, exclude_poor=True)["reserved"]["n"] == 1
    assert sp.by_metric(rows, exclude_poor=False)["reserved"]["worst_abs_error"] == 0.5
    assert sp.by_metric(rows, exclude_poor=False)["allocated"] == {"n": 0}


def test_bounds_script_builds_like_with_like_without_poor_rows():
    bb = _bench("bounds")
    # error = estimated / measured - 1, so measured / estimated = 1 / (1 + error)
    rows = [{"id": f"A{i}", "metric": "allocated", "fidelity": "approx", "error": 1 / r - 1}
            for i, r in enumerate([0.9, 1.0, 1.1])]
    rows += [{"id": "A9", "metric": "allocated", "fidelity": "poor", "error": 1.0},
             {"id": "R1", "metric": "reserved", "fidelity": "exact", "error": 0.0},
             {"id": "R2", "metric": "reserved", "fidelity": "exact", "error": 1 / 1.2 - 1},
             {"id": "D1", "metric": "nvml", "fidelity": "exact", "error": 1 / 1.05 - 1},
             {"id": "D2", "metric": "nvml", "fidelity": "exact", "error": 1 / 1.1 - 1},
             {"id": "U1", "metric": "unknown", "fidelity": "approx", "error": 1.0}]
    out = bb.build(rows, 0.9)
    m = out["metrics"]
    assert (m["allocated"]["lo"], m["allocated"]["hi"], m["allocated"]["n"]) == (0.9, 1.1, 3)
    assert (m["reserved"]["lo"], m["reserved"]["hi"]) == (1.0, 1.2)
    assert (m["device"]["lo"], m["device"]["hi"]) == (1.05, 1.1)
    assert m["allocated"]["coverage_leave_one_out"] == pytest.approx(1 / 3, abs=1e-3)
    assert out["checks"]["allocated_on_poor_rows"] == {"n": 1, "coverage": 0.0}     # r = 0.5
    assert out["checks"]["device_on_unknown_metric_rows"] == {"n": 1, "coverage": 0.0}
