"""scripts/trace_top_kernels.py: the per-kernel table of a torch.profiler Chrome trace, split by role call."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import trace_top_kernels as ttk  # noqa: E402


def _trace(tmp_path):
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "verl::update_actor", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "verl::generate_sequences", "ts": 0, "dur": 90},
        # generation: two kernels
        {"ph": "X", "cat": "kernel", "name": "decode_gemm", "ts": 10, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "decode_gemm", "ts": 40, "dur": 20},
        # update: overlapping kernels on two streams, and a copy
        {"ph": "X", "cat": "kernel", "name": "grouped_gemm", "ts": 110, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "all_to_all", "ts": 130, "dur": 40},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 180, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 105, "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_device_time_per_kernel_and_busy_fraction(tmp_path):
    s = ttk.summarize(ttk.load_events(_trace(tmp_path)))
    assert s["kind"] == "device" and s["launches"] == 5
    assert [(r["name"], r["us"], r["count"]) for r in s["rows"]] == [
        ("grouped_gemm", 50.0, 1), ("decode_gemm", 40.0, 2), ("all_to_all", 40.0, 1), ("Memcpy HtoD", 10.0, 1)]
    # busy = [10,30] + [40,60] + [110,170] (overlap merged) + [180,190] = 110 of the span 10..190
    assert s["busy_us"] == pytest.approx(110.0) and s["span_us"] == pytest.approx(180.0)


def test_window_keeps_the_kernels_of_one_role_call(tmp_path):
    events = ttk.load_events(_trace(tmp_path))
    picked = ttk.in_windows(events, ttk.windows(events, "update_actor"))
    s = ttk.summarize(picked)
    assert {r["name"] for r in s["rows"]} == {"grouped_gemm", "all_to_all", "Memcpy HtoD"}
    assert ttk.windows(events, "compute_log_prob") == []


def test_cli_prints_a_table_per_window_and_says_when_a_range_is_missing(tmp_path, capsys):
    assert ttk.main([str(tmp_path)]) == 1  # no trace yet
    _trace(tmp_path)
    assert ttk.main([str(tmp_path), "--window", "generate_sequences", "--window", "compute_log_prob"]) == 0
    out = capsys.readouterr().out
    assert "generate_sequences (1 calls)" in out and "`decode_gemm` | 0.0 | 100.0 % | 2 |" in out
    assert "no `compute_log_prob` range" in out


def test_a_trace_without_device_events_is_summarised_over_cpu_operators(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 7}]))
    s = ttk.summarize(ttk.load_events(path))
    assert s["kind"] == "cpu_op" and s["rows"][0]["name"] == "aten::mm" and s["busy_us"] is None


def test_role_calls_are_marked_as_profiler_ranges():
    import torch

    from verl.single_controller.decorator import register

    @register()
    def update_actor(x):
        return x + 1

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert update_actor(1) == 2
    assert "verl::update_actor" in {e.name for e in prof.events()}
