"""The benchmarks' device time (benchmarks/harness.py) on fake profiler events, and a smoke run of
benchmarks/probes/floor_probe.py on the CPU: every section's code path on tiny sizes, its tables
and JSON, and a failing implementation kept to its own cell."""

import json
import os
import sys

import pytest
import torch
from torch.autograd import DeviceType

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
sys.path.insert(0, os.path.join(BENCHMARKS, "probes"))

import floor_probe  # noqa: E402
import harness  # noqa: E402


class Event:
    """The part of torch's KinetoEvent that harness reads."""

    def __init__(self, name, device, start, end, annotation=False):
        self._name, self._device, self._start, self._end, self._annotation = name, device, start, end, annotation

    def name(self):
        return self._name

    def device_type(self):
        return self._device

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def is_user_annotation(self):
        return self._annotation


CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


def profile_of_two_windows():
    """What a profile of two windows holds on a GPU: the windows' CPU ranges, operators and launch
    calls on the CPU, kernels, a copy and a fill on the GPU, and the GPU-side ranges of the
    record_function annotations (the window's own, and one torch.compile opens around its graph)
    spanning the kernels they enclose, gaps included."""
    w = harness.WINDOW
    return [
        Event(w + "a", CPU, 0, 900, annotation=True),
        Event("aten::add", CPU, 10, 60), Event("cudaLaunchKernel", CPU, 20, 50),
        Event("## Call CompiledFxGraph fx ##", CPU, 70, 120, annotation=True),
        Event("cudaLaunchKernel", CPU, 80, 110),
        Event("kernel_1", CUDA, 100, 300),
        Event("kernel_2", CUDA, 500, 600),
        Event(w + "a", CUDA, 100, 600, annotation=True),
        Event("## Call CompiledFxGraph fx ##", CUDA, 500, 600, annotation=True),
        Event(w + "b", CPU, 1000, 2000, annotation=True),
        Event("Memcpy DtoD (Device -> Device)", CUDA, 1100, 1150),
        Event("Memset (Device)", CUDA, 1200, 1210),
        Event("kernel_3", CUDA, 1300, 1340),
        Event(w + "b", CUDA, 1100, 1340, annotation=True),
    ]


def test_device_time_counts_each_kernel_copy_and_fill_once():
    ms = harness.window_device_ms(profile_of_two_windows(), CUDA)
    # a: 200 + 100 ns of kernels (not 2x, nor the annotation's 500 ns span); b: 50 + 10 + 40
    assert ms == {"a": pytest.approx(300e-6), "b": pytest.approx(100e-6)}


def test_device_activities_are_the_gpu_work_without_annotations():
    names = [e.name() for e in harness.device_activities(profile_of_two_windows(), CUDA)]
    assert names == ["kernel_1", "kernel_2", "Memcpy DtoD (Device -> Device)", "Memset (Device)", "kernel_3"]
    assert [e.name() for e in harness.device_activities(profile_of_two_windows(), CPU)] == [
        "aten::add", "cudaLaunchKernel", "cudaLaunchKernel"]


def test_nested_cpu_operators_count_once_and_work_before_the_first_window_nowhere():
    w = harness.WINDOW
    events = [Event("aten::early", CPU, 0, 5), Event(w + "x", CPU, 10, 100, annotation=True),
              Event("aten::linear", CPU, 20, 60), Event("aten::addmm", CPU, 25, 55), Event("aten::relu", CPU, 70, 80)]
    assert harness.window_device_ms(events, CPU) == {"x": pytest.approx(50e-6)}


def test_device_ms_divides_each_window_by_its_own_calls(monkeypatch):
    """Each window's device time over its own calls (one profile of 8 calls over 1 would be 8x)."""
    monkeypatch.setattr(harness, "window_device_ms", lambda events, device_type: {"once": 2.0, "eight": 16.0})
    calls = []
    ms = harness.device_ms([("once", lambda: calls.append(1), 1), ("eight", lambda: calls.append(8), 8),
                            ("none", lambda: None, 2)], "cpu")
    assert ms == {"once": 2.0, "eight": 2.0, "none": 0.0} and calls == [1] + [8] * 8


def test_device_ms_finds_its_windows_in_a_real_profile():
    x = torch.randn(128, 128)
    ms = harness.device_ms([("mm", lambda: x @ x, 3), ("nothing", lambda: None, 2)], "cpu")
    assert ms["mm"] > 0 and ms["nothing"] == 0


def test_window_names_must_be_distinct():
    with pytest.raises(ValueError, match="distinct"):
        harness.device_ms([("a", lambda: None, 1), ("a", lambda: None, 1)], "cpu")


@pytest.mark.cuda
def test_on_the_gpu_device_time_agrees_with_cuda_events():
    """A 1 GiB copy and a compiled cos.cos (whose calls torch.compile wraps in a record_function
    of its own), GPU-bound: device time per call within 10% of the CUDA events' wall time (the
    double count read half the copy's bandwidth)."""
    import torch._dynamo

    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    f = torch.compile(lambda t: t.cos().cos(), dynamic=False)
    f(src)
    for name, fn in (("copy", lambda: dst.copy_(src)), ("compiled cos.cos", lambda: f(src))):
        wall = harness.time_ms(fn, warmup=5, reps=20)
        dev = harness.device_ms([(name, fn, 10)], "cuda")[name]
        assert 0.9 < dev / wall < 1.1, (name, dev, wall)
    torch._dynamo.reset()


def test_floor_probe_smoke_run_on_the_cpu(tmp_path):
    records = floor_probe.main(["--device", "cpu", "--smoke", "--no-compile", "--dtypes", "fp32", "--hidden", "64",
                                "--cols", "200", "--out", str(tmp_path)])
    ops = {(r["section"], r["op"]) for r in records}
    assert ops == {(s, op) for s, names in floor_probe.SECTIONS.items() for op in names}
    for r in records:
        assert not floor_probe.disagrees(r), r
        assert r["floor_ms"] > 0 and set(r["cells"]) == {"brrr", "eager"}, r
        for impl, c in r["cells"].items():
            assert c["wall_ms"] > 0 and c["wall_pct"] > 0 and c["device_ms"] >= 0, (r["op"], impl, c)
        assert r["cells"]["eager"]["device_ms"] > 0  # eager's operators show on the CPU
    data = json.loads((tmp_path / "floor.json").read_text())
    assert len(data["rows"]) == len(records) and set(data["sections_s"]) == set(floor_probe.SECTIONS)
    text = (tmp_path / "floor.txt").read_text()
    for section in floor_probe.SECTIONS:
        assert f"## {section}, fp32" in text
    assert text.count("| swiglu_split | 64 | fwd+bwd |") == 1


def test_a_failing_implementation_fills_its_own_cell(monkeypatch):
    """A peer that refuses (as Liger refuses rows past 65536) or a compile that fails: its cells
    hold the error, the others are measured."""
    floor_probe.SETTINGS.update(rows=8, device="cpu", head_dim=32)

    def refuses(*args):
        raise RuntimeError("n = 131072 exceeds the recommended Triton blocksize | 65536")
    monkeypatch.setattr(floor_probe, "implementations",
                        lambda row, case, with_compile: {"brrr": case["brrr"], "eager": case["eager"], "liger": refuses})
    records = floor_probe.measure(("softmax", "softmax", "fp32", 40), False, 10.0)
    assert [r["pass_"] for r in records] == ["fwd", "fwd+bwd"]
    for r in records:
        assert r["cells"]["liger"] == {"error": "RuntimeError: n = 131072 exceeds the recommended Triton "
                                                "blocksize | 65536"}
        assert r["cells"]["brrr"]["wall_ms"] > 0 and r["cells"]["eager"]["wall_ms"] > 0
        assert "| error: RuntimeError: n = 131072 exceeds the recommended Triton blocksize / 65536 |" in \
            floor_probe.markdown([r], "#")


def test_a_variant_times_brrr_once_per_value_with_the_variable_set(monkeypatch):
    floor_probe.SETTINGS.update(rows=8, device="cpu", head_dim=32)
    monkeypatch.delenv("BRRR_PROBE_TEST_SWITCH", raising=False)
    seen = []
    case = floor_probe.make_case(("chains", "cos.cos", "fp32", 16))

    def brrr_fn(x):
        seen.append(os.environ.get("BRRR_PROBE_TEST_SWITCH"))
        return case["brrr"](x)
    monkeypatch.setattr(floor_probe, "implementations",
                        lambda row, c, with_compile: {"brrr": brrr_fn, "eager": c["eager"]})
    records = floor_probe.measure(("chains", "cos.cos", "fp32", 16), False, 10.0,
                                  ("BRRR_PROBE_TEST_SWITCH", ["one", "two"]))
    assert set(records[0]["cells"]) == {"brrr[one]", "brrr[two]", "eager"}
    assert {"one", "two"} <= set(seen) and "BRRR_PROBE_TEST_SWITCH" not in os.environ


def test_workers_time_their_rows_in_turn_and_the_records_keep_the_rows_order():
    """Two worker processes (as a run with torch.compile starts them), without compiling here."""
    floor_probe.SETTINGS.update(rows=64, device="cpu", head_dim=32)
    todo = [("chains", "cos.cos", "fp32", 64), ("norms", "rms_norm", "fp32", 96), ("softmax", "softmax", "fp32", 200)]
    records, prepare_s, recompiled = floor_probe.run_workers(todo, 2, False, 10.0, None,
                                                 ["--device", "cpu", "--smoke", "--no-compile"])
    assert [(r["section"], r["op"], r["dtype"], r["size"], r["pass_"]) for r in records] == [
        row + (p,) for row in todo for p in floor_probe.PASSES]
    for r in records:
        assert r["cells"]["brrr"]["wall_ms"] > 0 and r["cells"]["eager"]["wall_ms"] > 0 and r["measure_s"] > 0
    assert prepare_s >= 0 and recompiled == 0
