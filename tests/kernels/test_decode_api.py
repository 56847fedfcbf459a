"""The public op dinfer_kernels.decode_step: backend switch, torch.library registration (opcheck,
torch.compile fullgraph, CUDA-graph capture), CreditState, and clear errors on bad input."""

import pytest
import torch
from conftest import assert_precision, device_backends

import dinfer_kernels as dk
from dinfer_kernels.reference import decode_params, decode_step_reference


def case(N=6, V=50, device="cpu", dtype=torch.float32):
    logits = (torch.randn(N, V) * 3).to(dtype).to(device)
    tokens = torch.full((N,), 3, dtype=torch.int64, device=device)
    tokens[0] = 1
    offsets = torch.tensor([0, 2, N], dtype=torch.int32, device=device)
    return logits, tokens, offsets


@pytest.mark.parametrize("backend,device", device_backends())
@pytest.mark.usefixtures("host_isa")
def test_public_op_matches_reference(backend, device):
    logits, tokens, offsets = case(device=device)
    ref_tokens, tokens_before = tokens.cpu().clone(), tokens.cpu().clone()
    credit = dk.CreditState.empty(6, 4, device=device)
    ref_ids, ref_vals = credit.ids.cpu().clone(), credit.vals.cpu().clone()
    out = dk.decode_step(logits, tokens, offsets, 3, threshold=0.6, credit=credit, backend=backend)
    ref = decode_step_reference(
        logits.cpu(),
        ref_tokens,
        offsets.cpu(),
        decode_params(3, threshold=torch.full((2,), 0.6)),
        credit_ids=ref_ids,
        credit_vals=ref_vals,
    )
    assert isinstance(out, dk.DecodeOutput)
    assert torch.equal(out.candidate.cpu(), ref.candidate)
    assert torch.equal(out.commit.cpu(), ref.commit)
    assert torch.equal(tokens.cpu(), ref_tokens)
    assert torch.equal(credit.ids.cpu(), ref_ids)
    truth = decode_step_reference(
        logits.cpu(),
        tokens_before,
        offsets.cpu(),
        decode_params(3, threshold=torch.full((2,), 0.6)),
        credit_ids=torch.full((6, 4), -1, dtype=torch.int32),
        credit_vals=torch.zeros(6, 4),
        compute_dtype=torch.float64,
    )
    assert_precision(out.confidence.cpu(), ref.confidence, truth.confidence, "confidence")


@pytest.mark.parametrize("backend,device", device_backends())
@pytest.mark.usefixtures("host_isa")
def test_public_op_flags_nonfinite_rows_and_takes_row_keys(backend, device):
    logits, tokens, offsets = case(device=device)
    logits[1, 4] = float("nan")
    logits[4, 0] = float("-inf")
    keys = torch.tensor([7, 2**40 + 3, 5, 2**32 - 1, 0, 11], device=device)
    ref_tokens = tokens.cpu().clone()
    out = dk.decode_step(
        logits, tokens, offsets, 3, threshold=0.6, temperature=1.5, seed=4, row_keys=keys, backend=backend
    )
    ref = decode_step_reference(
        logits.cpu(),
        ref_tokens,
        offsets.cpu(),
        decode_params(3, threshold=torch.full((2,), 0.6), temperature=1.5, seed=4, row_keys=keys.cpu()),
    )
    assert out.nonfinite.tolist() == [False, True, False, False, True, False] == ref.nonfinite.tolist()
    assert torch.equal(out.candidate.cpu(), ref.candidate) and torch.equal(tokens.cpu(), ref_tokens)


def joint_case(N=8, V=50, device="cpu", dtype=torch.float32):
    """Rows 0-1 masked, the rest committed; every row confident in token 7 except row 5 (its own)."""
    logits = torch.randn(N, V) * 0.5
    logits[:, 7] += 9.0
    logits[5, 4] += 30.0
    tokens = torch.tensor([3, 3, 1, 2, 7, 4, 9, 10])[:N]
    offsets = torch.tensor([0, 3, N], dtype=torch.int32)
    editable = torch.tensor([True, True, True, False, True, True, True, True])[:N]
    return logits.to(dtype).to(device), tokens.to(device), offsets.to(device), editable.to(device)


@pytest.mark.parametrize("backend,device", device_backends())
@pytest.mark.usefixtures("host_isa")
def test_public_op_joint_rule(backend, device):
    """rule='joint' on every backend: the reference's commits and tokens, with `editable` and
    edit_threshold (rows 2, 6, 7 edited; row 3 is not editable, row 4 holds its candidate, row 5 is
    confident in its own token); None, 0 and a negative edit_threshold turn editing off."""
    logits, tokens, offsets, editable = joint_case(device=device)
    credit = dk.CreditState.empty(8, 4, device=device)
    ref_tokens, ref_credit = tokens.cpu().clone(), (credit.ids.cpu().clone(), credit.vals.cpu().clone())
    out = dk.decode_step(
        logits,
        tokens,
        offsets,
        3,
        rule="joint",
        threshold=0.8,
        credit=credit,
        editable=editable,
        edit_threshold=0.6,
        backend=backend,
    )
    ref = decode_step_reference(
        logits.cpu(),
        ref_tokens,
        offsets.cpu(),
        decode_params(
            3, rule="joint", threshold=torch.full((2,), 0.8), editable=editable.cpu(), edit_threshold=0.6
        ),
        credit_ids=ref_credit[0],
        credit_vals=ref_credit[1],
    )
    assert torch.equal(out.commit.cpu(), ref.commit) and torch.equal(tokens.cpu(), ref_tokens)
    assert torch.equal(out.candidate.cpu(), ref.candidate) and torch.equal(credit.ids.cpu(), ref_credit[0])
    assert out.commit.cpu().tolist() == [True, True, True, False, False, False, True, True]
    assert tokens.cpu().tolist() == [7, 7, 7, 2, 7, 4, 7, 7]
    for off in (None, 0, 0.0, -0.5):
        logits, tokens, offsets, editable = joint_case(device=device)
        plain = tokens.clone()
        joint = dk.decode_step(
            logits, tokens, offsets, 3, rule="joint", editable=editable, edit_threshold=off, backend=backend
        )
        want = dk.decode_step(logits, plain, offsets, 3, rule="threshold", backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(joint, want)) and torch.equal(tokens, plain)
        assert joint.commit.cpu().tolist() == [True, True] + [False] * 6


@pytest.mark.parametrize("rule", ["threshold", "joint"])
def test_auto_picks_the_same_backend_for_every_rule(monkeypatch, rule):
    """The joint rule is not routed elsewhere: auto runs the backend it runs the other rules on."""
    from dinfer_kernels import _backend

    picked = []
    real = _backend.impl
    monkeypatch.setattr(_backend, "impl", lambda op, b: picked.append(b) or real(op, b))
    logits, tokens, offsets, editable = joint_case()
    kw = dict(editable=editable, edit_threshold=0.5) if rule == "joint" else {}
    dk.decode_step(logits, tokens, offsets, 3, rule=rule, **kw)
    expected = _backend.resolve("auto", torch.device("cpu"), "decode_step")
    assert picked == ([] if expected == "torch" else [expected])


def test_kernel_backends_share_one_signature():
    """One backend contract: cpu, cuda and triton's decode_step take the same inputs and outputs, and
    every parameter of the step, the joint rule's editable rows and edit threshold included, whole
    as one DecodeParams."""
    import importlib
    import inspect

    from dinfer_kernels.reference import DecodeParams, EditParams

    params = {
        b: list(
            inspect.signature(importlib.import_module(f"dinfer_kernels.{b}.decode").decode_step).parameters
        )
        for b in ("cpu", "cuda", "triton")
    }
    assert params["cpu"] == params["cuda"] == params["triton"]
    assert params["cpu"][-1] == "params"
    assert "edit" in DecodeParams._fields and EditParams._fields == ("editable", "threshold")


@pytest.mark.usefixtures("host_isa")
def test_auto_backend_on_host():
    assert dk.available_backends("cpu")[-1] == "torch"
    from dinfer_kernels._backend import cpu_fast_ops, resolve

    fast = "cpu" in dk.available_backends("cpu") and "decode_step" in cpu_fast_ops()
    expected = "cpu" if fast else "torch"
    assert resolve("auto", torch.device("cpu"), "decode_step") == expected


def test_prefer_backend():
    from dinfer_kernels._backend import resolve

    cpu = torch.device("cpu")
    usual = resolve("auto", cpu, "decode_step")
    with dk.prefer_backend("torch"):
        assert resolve("auto", cpu, "decode_step") == "torch"
        assert resolve("auto", cpu, "rms_norm") == "torch"
        with dk.prefer_backend("cuda"):  # cannot run on the host: the usual choice stays
            assert resolve("auto", cpu, "decode_step") == usual
        assert resolve("auto", cpu, "decode_step") == "torch"
        assert resolve(usual, cpu, "decode_step") == usual  # an explicit backend wins
    assert resolve("auto", cpu, "decode_step") == usual
    with pytest.raises(ValueError, match="backend"):
        with dk.prefer_backend("fast"):
            pass


def test_opcheck():
    logits, tokens, offsets = case()
    ids = torch.full((6, 4), -1, dtype=torch.int32)
    vals = torch.zeros(6, 4)
    # The op's flat arguments: the tensors, then DecodeParams' fields in order (mask_id, rule,
    # sampling, credit, edit).
    args = (
        logits,
        tokens,
        offsets,
        ids,
        vals,
        3,
        "threshold",
        torch.full((2,), 0.7),
        0.4,
        torch.ones(2, dtype=torch.int32),
        0.0,
        0,
        0,
        torch.arange(6) * 977,
        0.7,
        0.8,
        0.2,
        None,
        None,
    )
    backend = "cpu" if "cpu" in dk.available_backends("cpu") else "torch"
    editable = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    joint = args[:6] + ("joint",) + args[7:13] + (None,) + args[14:17] + (editable, 0.3)
    for call in (args, joint):
        torch.library.opcheck(
            torch.ops.dinfer.decode_step.default,
            call + (backend,),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


@pytest.mark.parametrize("rule", ["threshold", "joint"])
def test_torch_compile_fullgraph(rule):
    logits, tokens, offsets = case()
    tokens[1] = 8  # a committed row for the joint rule to edit
    credit = dk.CreditState.empty(6, 4)
    eager_tokens, eager_credit = tokens.clone(), dk.CreditState(credit.ids.clone(), credit.vals.clone())
    editable = torch.tensor([True, True, False, True, True, True])
    edits = dict(editable=editable, edit_threshold=0.05) if rule == "joint" else {}

    def step(lg, tok, offs, ids, vals):
        out = dk.decode_step(
            lg, tok, offs, 3, rule=rule, threshold=0.5, credit=dk.CreditState(ids, vals), **edits
        )
        return out.candidate, out.confidence

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(logits, tokens, offsets, credit.ids, credit.vals)
    want = step(logits, eager_tokens, offsets, eager_credit.ids, eager_credit.vals)
    assert torch.equal(got[0], want[0]) and torch.equal(tokens, eager_tokens)
    assert torch.equal(credit.ids, eager_credit.ids) and torch.equal(credit.vals, eager_credit.vals)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("rule", ["threshold", "joint"])
def test_cuda_graph_capture(backend, rule):
    if backend not in dk.available_backends("cuda"):
        pytest.skip(f"{backend} not available")
    logits, tokens, offsets = case(N=64, V=32003, device="cuda", dtype=torch.bfloat16)
    tokens[::2] = torch.arange(32, device="cuda")  # committed rows for the joint rule to edit
    kw = dict(rule=rule, backend=backend)
    if rule == "joint":
        kw.update(editable=torch.arange(64, device="cuda") % 3 > 0, edit_threshold=1e-4)
    credit = dk.CreditState.empty(64, 16, device="cuda")
    static_tokens = tokens.clone()
    dk.decode_step(
        logits, tokens.clone(), offsets, 3, credit=dk.CreditState.empty(64, 16, "cuda"), **kw
    )  # warm-up (Triton compiles outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dk.decode_step(logits, static_tokens, offsets, 3, credit=credit, **kw)
    for _ in range(3):
        static_tokens.copy_(tokens)
        credit.reset_()
        graph.replay()
        ref_tokens = tokens.clone()
        ref = dk.decode_step(
            logits, ref_tokens, offsets, 3, credit=dk.CreditState.empty(64, 16, "cuda"), **kw
        )
        torch.cuda.synchronize()
        assert torch.equal(out.candidate, ref.candidate) and torch.equal(static_tokens, ref_tokens)


@pytest.mark.gpu
def test_cuda_graph_replays_on_fresh_logits():
    """The CUDA step's per-row tickets are zeroed inside the graph: every replay on new logits merges
    and finalizes every row again, bit for bit as an eager call (a stale ticket would leave the last
    replay's candidates in place)."""
    if "cuda" not in dk.available_backends("cuda"):
        pytest.skip("cuda not available")
    logits, tokens, offsets = case(N=48, V=157184, device="cuda", dtype=torch.bfloat16)
    static_logits, static_tokens = logits.clone(), tokens.clone()
    dk.decode_step(static_logits, tokens.clone(), offsets, 3, backend="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dk.decode_step(static_logits, static_tokens, offsets, 3, backend="cuda")
    for i in range(3):
        static_logits.copy_(case(N=48, V=157184, device="cuda", dtype=torch.bfloat16)[0])
        static_tokens.copy_(tokens)
        graph.replay()
        ref_tokens = tokens.clone()
        ref = dk.decode_step(static_logits, ref_tokens, offsets, 3, backend="cuda")
        torch.cuda.synchronize()
        assert torch.equal(out.candidate, ref.candidate), f"replay {i}"
        assert torch.equal(out.confidence.view(torch.int32), ref.confidence.view(torch.int32)), f"replay {i}"
        assert torch.equal(out.commit, ref.commit) and torch.equal(static_tokens, ref_tokens), f"replay {i}"


def test_credit_state_reset():
    c = dk.CreditState.empty(4, 3)
    c.ids.fill_(5)
    c.vals.fill_(1.0)
    c.reset_(torch.tensor([1, 2]))
    assert c.ids[0].eq(5).all() and c.ids[1:3].eq(-1).all() and c.vals[1:3].eq(0).all()
    c.reset_()
    assert c.ids.eq(-1).all() and c.vals.eq(0).all()


BAD = [
    (dict(logits=torch.zeros(6, 50, dtype=torch.int32)), TypeError, "logits"),
    (dict(logits=torch.zeros(6, 50, 1)), ValueError, "logits"),
    (dict(logits=torch.zeros(50, 6).t()), ValueError, "logits"),
    (dict(logits=torch.zeros(6, 0)), ValueError, "logits"),
    (dict(tokens=torch.zeros(6, dtype=torch.int32)), TypeError, "tokens"),
    (dict(tokens=torch.zeros(5, dtype=torch.int64)), ValueError, "tokens"),
    (dict(tokens=torch.full((6,), 50, dtype=torch.int64)), ValueError, "tokens"),
    (dict(tokens=torch.full((6,), -1, dtype=torch.int64)), ValueError, "tokens"),
    (dict(seq_offsets=torch.tensor([0, 6], dtype=torch.int64)), TypeError, "seq_offsets"),
    (dict(seq_offsets=torch.tensor([0, 4, 3, 6], dtype=torch.int32)), ValueError, "seq_offsets"),
    (dict(seq_offsets=torch.tensor([0, 5], dtype=torch.int32)), ValueError, "seq_offsets"),
    (dict(mask_id=50), ValueError, "mask_id"),
    (dict(mask_id=-1), ValueError, "mask_id"),
    (dict(mask_id=2.0), TypeError, "mask_id"),
    (dict(rule="greedy"), ValueError, "rule"),
    (dict(threshold=float("nan")), ValueError, "threshold"),
    (dict(threshold=torch.ones(3)), ValueError, "threshold"),
    (dict(rule="fixed"), ValueError, "num_commit"),
    (dict(rule="fixed", num_commit=-1), ValueError, "num_commit"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(offset=2**32), ValueError, "offset"),
    (dict(credit_beta=1.5), ValueError, "credit_beta"),
    (dict(credit_alpha=float("inf")), ValueError, "credit_alpha"),
    (dict(credit=(1, 2)), TypeError, "credit"),
    (
        dict(credit=dk.CreditState(torch.zeros(6, 4, dtype=torch.int64), torch.zeros(6, 4))),
        TypeError,
        "credit.ids",
    ),
    (
        dict(credit=dk.CreditState(torch.full((5, 4), -1, dtype=torch.int32), torch.zeros(5, 4))),
        ValueError,
        "credit.ids",
    ),
    (
        dict(credit=dk.CreditState(torch.full((6, 4), 99, dtype=torch.int32), torch.zeros(6, 4))),
        ValueError,
        "credit.ids",
    ),
    (dict(row_keys=torch.arange(6, dtype=torch.int32)), TypeError, "row_keys"),
    (dict(row_keys=torch.arange(5)), ValueError, "row_keys"),
    (dict(row_keys=torch.arange(12).view(6, 2)), ValueError, "row_keys"),
    (dict(row_keys=[0, 1, 2, 3, 4, 5]), TypeError, "row_keys"),
    (dict(rule="joint", editable=torch.ones(6, dtype=torch.uint8)), TypeError, "editable"),
    (dict(rule="joint", editable=torch.ones(6, dtype=torch.int64)), TypeError, "editable"),
    (dict(rule="joint", editable=torch.ones(5, dtype=torch.bool)), ValueError, "editable"),
    (dict(rule="joint", editable=torch.ones(6, 1, dtype=torch.bool)), ValueError, "editable"),
    (dict(rule="joint", editable=[True] * 6), TypeError, "editable"),
    (dict(rule="joint", editable=torch.ones(6, dtype=torch.bool, device="meta")), ValueError, "editable"),
    (dict(rule="joint", edit_threshold=float("nan")), ValueError, "edit_threshold"),
    (dict(rule="joint", edit_threshold=float("inf")), ValueError, "edit_threshold"),
    (dict(rule="joint", edit_threshold="0.5"), TypeError, "edit_threshold"),
    (dict(rule="joint", edit_threshold=True), TypeError, "edit_threshold"),
    (dict(editable=torch.ones(6, dtype=torch.bool)), ValueError, "editable"),
    (dict(rule="hierarchical", edit_threshold=0.5), ValueError, "edit_threshold"),
    (
        dict(rule="fixed", num_commit=1, edit_threshold=None, editable=torch.ones(6, dtype=torch.bool)),
        ValueError,
        "editable",
    ),
    (dict(backend="fpga"), ValueError, "backend"),
    (dict(logits="not a tensor"), TypeError, "logits"),
]


@pytest.mark.parametrize("override,exc,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_argument(override, exc, name):
    logits, tokens, offsets = case()
    kw = dict(logits=logits, tokens=tokens, seq_offsets=offsets, mask_id=3)
    kw.update(override)
    with pytest.raises(exc, match=rf"^{name}\b"):
        dk.decode_step(kw.pop("logits"), kw.pop("tokens"), kw.pop("seq_offsets"), kw.pop("mask_id"), **kw)


@pytest.mark.gpu
def test_device_mismatch_is_named():
    logits, tokens, offsets = case(device="cuda")
    with pytest.raises(ValueError, match="^tokens"):
        dk.decode_step(logits, tokens.cpu(), offsets, 3)
    with pytest.raises(ValueError, match="^editable"):
        dk.decode_step(logits, tokens, offsets, 3, rule="joint", editable=torch.ones(6, dtype=torch.bool))


def test_unavailable_backend_is_named():
    logits, tokens, offsets = case()
    with pytest.raises(ValueError, match="^backend"):
        dk.decode_step(logits, tokens, offsets, 3, backend="cuda")
