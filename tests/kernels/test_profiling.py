"""dinfer_kernels.profiling and what profilers see of the ops: a recording torch profiler sees every
op call as dinfer::<op> (the dispatcher path, taken only while one records); with DINFER_NVTX=1 each
call also sits in a range dinfer::<op>[<backend>], pushed to NVTX (recorded here by a stand-in for
torch's NVTX functions, which CPU builds lack) and to the torch profiler; off by default."""

import os
import subprocess
import sys

import pytest
import torch
from helpers.nvtx import record_ranges
from torch.profiler import ProfilerActivity, profile

import dinfer_kernels as dk
from dinfer_kernels import profiling
from dinfer_kernels.ops import rms_norm as rms_norm_mod


@pytest.fixture
def nvtx(monkeypatch):
    """Ranges on, NVTX recorded."""
    fake = record_ranges(monkeypatch)
    yield fake
    assert fake.depth == 0, "a range was left open"


def _rms_inputs():
    return torch.randn(5, 16), torch.rand(16)


def test_a_recording_profiler_sees_the_op_through_the_dispatcher(monkeypatch):
    monkeypatch.setattr(profiling, "ENABLED", False)
    x, w = _rms_inputs()
    calls = []
    real = rms_norm_mod._rms_norm_op.registered
    monkeypatch.setattr(rms_norm_mod._rms_norm_op, "registered", lambda *a: calls.append(1) or real(*a))
    expected = dk.rms_norm(x, w, 1e-5)
    assert calls == []  # no profiler: the direct path
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = dk.rms_norm(x, w, 1e-5)
    assert calls == [1] and torch.equal(got, expected)
    names = [e.name for e in prof.events()]
    assert "dinfer::rms_norm" in names
    assert not any("[" in n for n in names if n.startswith("dinfer::"))  # no range while DINFER_NVTX is off
    dk.rms_norm(x, w, 1e-5)
    assert calls == [1]  # the profiler stopped: direct again


def test_op_ranges_name_the_op_and_its_backend(nvtx):
    x, w = _rms_inputs()
    backend = "cpu" if "cpu" in dk.available_backends("cpu", "rms_norm") else "torch"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dk.rms_norm(x, w, 1e-5, backend=backend)
    name = f"dinfer::rms_norm[{backend}]"
    assert nvtx.ranges == [(0, name)]
    # The torch profiler's copy, around the op's own event.
    ranged = [e for e in prof.events() if e.name == name]
    assert len(ranged) == 1
    op = next(e for e in prof.events() if e.name == "dinfer::rms_norm")
    assert op.cpu_parent is not None and op.cpu_parent.name == name


def test_op_ranges_without_a_profiler_take_the_direct_path(nvtx, monkeypatch):
    x, w = _rms_inputs()
    calls = []
    monkeypatch.setattr(rms_norm_mod._rms_norm_op, "registered", lambda *a: calls.append(a))
    dk.rms_norm(x, w, 1e-5, backend="torch")
    assert calls == [] and nvtx.ranges == [(0, "dinfer::rms_norm[torch]")]


def test_ranges_are_off_by_default_and_pay_nothing(monkeypatch):
    fake = record_ranges(monkeypatch)
    monkeypatch.setattr(profiling, "ENABLED", False)
    dk.rms_norm(*_rms_inputs(), 1e-5)
    with profiling.region("anything"):
        pass
    assert fake.ranges == []
    assert profiling.region("anything") is profiling.region("other")  # one shared no-op


def test_under_torchs_nvtx_mode_record_function_is_left_to_torch(nvtx, monkeypatch):
    # emit_nvtx (nsys --pytorch=autograd-nvtx) makes record_function push an NVTX range itself.
    from torch._C._profiler import ActiveProfilerType

    recorded = []
    monkeypatch.setattr(profiling, "_profiler_enabled", lambda: True)
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: recorded.append(name))
    monkeypatch.setattr(profiling, "_profiler_type", lambda: ActiveProfilerType.NVTX)
    with profiling.annotate("x"):
        pass
    assert recorded == [] and nvtx.ranges == [(0, "x")]


def test_set_enabled_returns_the_previous_setting(monkeypatch):
    monkeypatch.setattr(profiling, "ENABLED", False)
    assert profiling.set_enabled(True) is False
    assert profiling.ENABLED is True
    assert profiling.set_enabled(False) is True


@pytest.mark.parametrize("value, on", [(None, False), ("1", True)])
def test_dinfer_nvtx_is_read_at_import(value, on):
    env = {k: v for k, v in os.environ.items() if k != "DINFER_NVTX"}
    if value is not None:
        env["DINFER_NVTX"] = value
    code = "from dinfer_kernels import profiling; print(profiling.ENABLED)"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == str(on)
