"""python -m dinfer_kernels selftest: the user's check after installing. --quick on the CPU runs every
op on every host backend (the Triton interpreter included) and exits 0; a wrong or crashing backend
fails its row and makes the exit status non-zero."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from dinfer_kernels import _backend, selftest


def test_quick_selftest_covers_every_op_and_host_backend(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dinfer_kernels",
            "selftest",
            "--quick",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "s.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert all(r["ok"] for r in rows)
    ran = {(r["op"], r["backend"]) for r in rows}
    for op in selftest.CASES:
        for backend in _backend.available_backends("cpu", op):
            assert (op, backend) in ran, f"{op} on {backend} did not run"
    assert "op" in out.stdout and "max error" in out.stdout and "selftest: " in out.stdout


@pytest.mark.parametrize("op", list(selftest.CASES))
def test_a_wrong_result_fails_its_row(monkeypatch, op):
    shape = selftest._shapes("cpu", quick=True)[op]
    real = getattr(selftest, op)  # each op's public entry, as selftest calls it

    def off_by_a_little(*args, **kw):
        out = real(*args, **kw)
        if op == "decode_step":
            out.confidence.mul_(1.001)
        elif op in ("attention", "qk_rope"):  # outputs (out, ...), (q_out, k_out)
            out[0].mul_(1.01)
        else:
            out.mul_(1.01)
        return out

    monkeypatch.setattr(selftest, op, off_by_a_little)
    row = selftest._check(op, "torch", "cpu", torch.float32, shape)
    assert not row["ok"] and "output 0" in row["note"], row


def test_a_crash_fails_its_row_and_the_exit_status(monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(selftest, "rms_norm", broken)
    row = selftest._check(
        "rms_norm", "torch", "cpu", torch.float32, selftest._shapes("cpu", True)["rms_norm"]
    )
    assert not row["ok"] and "kernel exploded" in row["note"]
    monkeypatch.setattr(selftest, "CASES", {"rms_norm": selftest._rms_norm})
    assert selftest.main(["--quick", "--device", "cpu"]) == 1
