"""dinfer_kernels._dispatch: plain eager calls run an op's function directly (no dispatcher, no
torch._dynamo import, version counters still bumped for mutated inputs); anything that traces —
FakeTensor, torch.compile, autograd — goes through the registered torch.library op."""

import subprocess
import sys

import pytest
import torch

import dinfer_kernels as dk
from dinfer_kernels import _dispatch
from dinfer_kernels.ops import attention as attention_mod
from dinfer_kernels.ops import rms_norm as rms_norm_mod


def _small_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 2, 8, generator=g) for _ in range(3))
    kc, vc = torch.randn(1, 10, 2, 8, generator=g), torch.randn(1, 10, 2, 8, generator=g)
    return q, k, v, kc, vc, torch.tensor([[2, 5, 7]]), torch.tensor([10], dtype=torch.int32)


def test_eager_calls_do_not_import_dynamo():
    code = (
        "import sys, torch, dinfer_kernels as dk\n"
        "x = torch.randn(4, 8); dk.rms_norm(x, torch.ones(8), 1e-5)\n"
        "q = torch.randn(1, 3, 2, 8); c = torch.randn(1, 10, 2, 8)\n"
        "dk.attention(q, q, q, c, c.clone(), torch.tensor([[1, 2, 3]]), torch.tensor([10], dtype=torch.int32))\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_eager_call_skips_the_dispatcher_and_matches_it(monkeypatch):
    x, w = torch.randn(5, 16), torch.rand(16)
    via_op = rms_norm_mod._rms_norm_op.registered(x, w, 1e-5, "torch")
    calls = []
    monkeypatch.setattr(rms_norm_mod._rms_norm_op, "registered", lambda *a: calls.append(a))
    got = dk.rms_norm(x, w, 1e-5)
    assert calls == [] and torch.equal(got, via_op)


@pytest.mark.parametrize("write_back", [True, False])
def test_mutated_inputs_get_their_version_bumped(write_back):
    q, k, v, kc, vc, pos, lens = _small_attention()
    before = (kc._version, vc._version)
    # The host kernel writes through raw pointers (on an ISA where auto would pick torch, the
    # reference's own in-place writes bump the counters too).
    backend = "cpu" if "cpu" in dk.available_backends("cpu", "attention") else "auto"
    dk.attention(q, k, v, kc, vc, pos, lens, write_back=write_back, backend=backend)
    assert (kc._version, vc._version) == (before[0] + 1, before[1] + 1)  # as the dispatcher does


def test_fake_tensors_go_through_the_registered_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, kc, vc, pos, lens = _small_attention()
        out, lse = dk.attention(q, k, v, kc, vc, pos, lens, return_lse=True, backend="cpu", validate=False)
    assert out.shape == (1, 3, 2, 8) and lse.shape == (1, 3, 2)


def test_tracing_and_autograd_take_the_registered_op(monkeypatch):
    q, k, v, kc, vc, pos, lens = _small_attention()
    args = (q, k, v, kc, vc, pos, lens, True, None, None, None, 3, 64, 0.3, False, False, "torch")
    assert _dispatch._plain_eager(args)
    q.requires_grad_(True)
    assert not _dispatch._plain_eager(args)  # autograd needs the op's registration
    with torch.no_grad():
        assert _dispatch._plain_eager(args)
    q.requires_grad_(False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not _dispatch._plain_eager(args)
    calls = []
    real = attention_mod._attention_op.registered
    monkeypatch.setattr(attention_mod._attention_op, "registered", lambda *a: calls.append(1) or real(*a))
    dk.attention(q, k, v, kc, vc, pos, lens)
    assert calls == [1]
