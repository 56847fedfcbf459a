"""The compiled layer on its own: dinfer_kernels._C over DLPack (NumPy here, no torch in the call),
its argument errors, and a hypothesis fuzz of good and bad calls (none may crash)."""

import numpy as np
import pytest
import torch
from conftest import EXT, assert_precision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dinfer_kernels.reference import decode_params, decode_step_reference

pytestmark = pytest.mark.skipif(EXT is None, reason="dinfer_kernels._C was not built")

PARAMS = dict(
    mask_id=3,
    rule=0,
    low_threshold=0.4,
    temperature=0.0,
    seed=0,
    offset=0,
    credit_alpha=0.7,
    credit_beta=0.8,
    credit_gamma=0.2,
)


def numpy_args(N=5, V=40, K=2, B=2):
    rng = np.random.default_rng(0)
    offsets = np.linspace(0, N, B + 1).astype(np.int32)
    return dict(
        logits=(rng.standard_normal((N, V)) * 3).astype(np.float32),
        tokens=np.full(N, 3, dtype=np.int64),
        seq_offsets=offsets,
        threshold=np.full(B, 0.5, dtype=np.float32),
        num_commit=np.ones(B, dtype=np.int32),
        credit_ids=np.full((N, K), -1, dtype=np.int32),
        credit_vals=np.zeros((N, K), dtype=np.float32),
        candidate=np.full(N, -9, dtype=np.int64),
        confidence=np.full(N, np.nan, dtype=np.float32),
        commit=np.zeros(N, dtype=np.bool_),
    )


ORDER = [
    "logits",
    "tokens",
    "seq_offsets",
    "threshold",
    "num_commit",
    "credit_ids",
    "credit_vals",
    "candidate",
    "confidence",
    "commit",
]


# Optional arrays, passed by keyword when a case has them.
OPTIONAL = ["editable"]


def call(args, **params):
    p = dict(PARAMS, **params)
    p.update({k: args[k] for k in OPTIONAL if k in args})
    EXT.decode_step(*[args[k] for k in ORDER], **p)


@pytest.mark.usefixtures("host_isa")
def test_numpy_through_dlpack_matches_reference():
    a = numpy_args()
    tokens_before = a["tokens"].copy()
    call(a)
    ref_tokens = torch.from_numpy(tokens_before.copy())
    ref = decode_step_reference(
        torch.from_numpy(a["logits"]),
        ref_tokens,
        torch.from_numpy(a["seq_offsets"]),
        decode_params(3, threshold=torch.from_numpy(a["threshold"])),
        credit_ids=torch.from_numpy(a["credit_ids"].copy() * 0 - 1),
        credit_vals=torch.zeros(5, 2),
    )
    assert np.array_equal(a["candidate"], ref.candidate.numpy())
    assert np.array_equal(a["commit"], ref.commit.numpy())
    assert np.array_equal(a["tokens"], ref_tokens.numpy())
    truth = decode_step_reference(
        torch.from_numpy(a["logits"]),
        torch.from_numpy(tokens_before.copy()),
        torch.from_numpy(a["seq_offsets"]),
        decode_params(3, threshold=torch.from_numpy(a["threshold"])),
        credit_ids=torch.full((5, 2), -1, dtype=torch.int32),
        credit_vals=torch.zeros(5, 2),
        compute_dtype=torch.float64,
    )
    assert_precision(torch.from_numpy(a["confidence"]), ref.confidence, truth.confidence, "confidence")


def test_build_info():
    assert isinstance(EXT.built_with_cuda(), bool)
    assert EXT.version()
    if EXT.built_with_cuda():
        assert EXT.cuda_archs()


BAD = [
    ("logits", lambda a: a["logits"].astype(np.float64), TypeError),
    ("logits", lambda a: a["logits"][None], ValueError),
    ("logits", lambda a: np.asfortranarray(a["logits"]), ValueError),
    ("logits", lambda a: [[1.0]], TypeError),
    ("tokens", lambda a: a["tokens"].astype(np.int32), TypeError),
    ("tokens", lambda a: a["tokens"][:3], ValueError),
    ("tokens", lambda a: np.full(5, 40, dtype=np.int64), ValueError),
    ("tokens", lambda a: np.repeat(a["tokens"], 2)[::2], ValueError),
    ("seq_offsets", lambda a: np.array([0, 6, 5], dtype=np.int32), ValueError),
    ("seq_offsets", lambda a: np.array([0, 1, 6], dtype=np.int32), ValueError),
    ("seq_offsets", lambda a: np.array([], dtype=np.int32), ValueError),
    ("threshold", lambda a: np.full(3, 0.5, dtype=np.float32), ValueError),
    ("threshold", lambda a: np.full(2, np.nan, dtype=np.float32), ValueError),
    ("num_commit", lambda a: a["num_commit"].astype(np.int64), TypeError),
    ("credit_ids", lambda a: np.full((5, 2), 40, dtype=np.int32), ValueError),
    ("credit_vals", lambda a: np.zeros((5, 3), dtype=np.float32), ValueError),
    ("candidate", lambda a: np.zeros(5, dtype=np.int32), TypeError),
    ("commit", lambda a: np.zeros(4, dtype=np.bool_), ValueError),
    ("confidence", lambda a: np.zeros(5, dtype=np.float16), TypeError),
]


@pytest.mark.parametrize("name,make,exc", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_binding_errors_name_the_argument(name, make, exc):
    a = numpy_args()
    a[name] = make(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a)


@pytest.mark.parametrize(
    "param,value",
    [
        ("mask_id", 40),
        ("mask_id", -1),
        ("rule", 4),
        ("rule", -1),
        ("edit_threshold", float("nan")),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("seed", -1),
        ("offset", 2**32),
        ("credit_beta", 2.0),
        ("low_threshold", float("inf")),
    ],
)
def test_binding_parameter_errors(param, value):
    with pytest.raises(ValueError, match=rf"^{param.replace('credit_', 'credit_')}\b"):
        call(numpy_args(), **{param: value})


@pytest.mark.usefixtures("host_isa")
@pytest.mark.parametrize("editable_dtype", [np.bool_, np.uint8, None])
def test_joint_rule_through_dlpack_matches_reference(editable_dtype):
    """Rule 3 (joint) over NumPy arrays: the edits of the rows `editable` marks (bool, or uint8 where
    any nonzero byte is editable; None: every row), as the reference makes them."""
    a = numpy_args(N=9, V=40, K=0, B=3)
    a["tokens"] = np.array([3, 7, 9, 3, 3, 11, 12, 3, 5], dtype=np.int64)
    a["logits"][:, 20] += 12.0  # every row confident in token 20: an edit where the row is committed
    a["logits"][8, 5] += 30.0  # row 8: confident in its own token
    rows = np.array([1, 1, 0, 1, 1, 1, 1, 1, 1], dtype=bool)  # row 2 is not editable
    if editable_dtype is not None:
        a["editable"] = rows.astype(np.uint8) * 7 if editable_dtype is np.uint8 else rows
    tokens_before = a["tokens"].copy()
    call(a, rule=3, edit_threshold=0.5)
    ref_tokens = torch.from_numpy(tokens_before.copy())
    ref = decode_step_reference(
        torch.from_numpy(a["logits"]),
        ref_tokens,
        torch.from_numpy(a["seq_offsets"]),
        decode_params(
            3,
            rule="joint",
            threshold=torch.from_numpy(a["threshold"]),
            editable=None if editable_dtype is None else torch.from_numpy(rows),
            edit_threshold=0.5,
        ),
    )
    assert np.array_equal(a["commit"], ref.commit.numpy()) and np.array_equal(a["tokens"], ref_tokens.numpy())
    edited = [1, 5, 6] if editable_dtype is not None else [1, 2, 5, 6]
    assert [i for i in range(9) if a["commit"][i] and tokens_before[i] != 3] == edited


JOINT_BAD = [
    ("editable", lambda a: a.update(editable=np.ones(5, dtype=np.int32)), {}, TypeError),
    ("editable", lambda a: a.update(editable=np.ones(5, dtype=np.float32)), {}, TypeError),
    ("editable", lambda a: a.update(editable=np.ones(4, dtype=np.bool_)), {}, ValueError),
    ("editable", lambda a: a.update(editable=np.ones((5, 1), dtype=np.bool_)), {}, ValueError),
    ("editable", lambda a: a.update(editable=np.ones(10, dtype=np.bool_)[::2]), {}, ValueError),
    ("editable", lambda a: a.update(editable=[True] * 5), {}, TypeError),
    ("editable", lambda a: a.update(editable=np.ones(5, dtype=np.bool_)), dict(rule=0), ValueError),
    ("edit_threshold", lambda a: None, dict(edit_threshold=float("nan")), ValueError),
    ("edit_threshold", lambda a: None, dict(edit_threshold="0.5"), TypeError),
    ("edit_threshold", lambda a: None, dict(edit_threshold=True), TypeError),
    ("edit_threshold", lambda a: None, dict(rule=2, edit_threshold=0.5), ValueError),
]


@pytest.mark.parametrize(
    "name,make,params,exc", JOINT_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(JOINT_BAD)]
)
def test_joint_binding_errors_name_the_argument(name, make, params, exc):
    a = numpy_args()
    make(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a, **dict(dict(rule=3, edit_threshold=0.5), **params))


def test_joint_edit_threshold_may_be_infinite():
    """+inf (the default) is editing off, and -inf edits every qualifying row: neither is refused."""
    for edit_at in (float("inf"), float("-inf")):
        a = numpy_args()
        a["tokens"][:] = 1
        call(a, rule=3, edit_threshold=edit_at)
        edited = (a["candidate"] != 1) & (a["candidate"] != 3)
        assert np.array_equal(a["commit"], edited if edit_at < 0 else np.zeros(5, dtype=bool))


def test_joint_editable_overlapping_a_written_array_is_refused():
    a = numpy_args()
    a["editable"] = a["commit"]  # the same bytes, read while commit is written
    with pytest.raises(ValueError, match=r"^commit: overlaps editable"):
        call(a, rule=3, edit_threshold=0.5)
    a["editable"] = a["tokens"].view(np.bool_)[8:13]  # bytes of tokens 1 and 2
    with pytest.raises(ValueError, match=r"^tokens: overlaps editable"):
        call(a, rule=3, edit_threshold=0.5)


@pytest.mark.gpu
def test_joint_editable_on_another_device_is_refused():
    a = numpy_args()
    a["editable"] = torch.ones(5, dtype=torch.bool, device="cuda")
    with pytest.raises(ValueError, match=r"^editable\b"):
        call(a, rule=3, edit_threshold=0.5)


def test_read_only_output_is_refused():
    a = numpy_args()
    a["candidate"].flags.writeable = False
    with pytest.raises((ValueError, TypeError)):
        call(a)


FLOATS = [np.float32, np.float16, np.float64]
INTS = [np.int64, np.int32, np.int8]


def valid_call(draw, N, V, K, B, rng):
    """A call every check must accept: consistent shapes and dtypes, in-range values."""
    a = numpy_args(N, V, K, B)
    a["logits"] = (rng.standard_normal((N, V)) * 3).astype(draw(st.sampled_from(FLOATS[:2])))
    if draw(st.booleans()):
        a["logits"][rng.random(a["logits"].shape) < 0.1] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    a["tokens"] = rng.integers(0, V, size=N).astype(np.int64)
    inner = np.sort(rng.integers(0, N + 1, size=B - 1))
    a["seq_offsets"] = np.concatenate([[0], inner, [N]]).astype(np.int32)
    a["credit_ids"] = rng.integers(-1, V, size=(N, K)).astype(np.int32)
    # distinct ids per row, as the op keeps them
    for row in a["credit_ids"]:
        seen = set()
        for j, v in enumerate(row):
            row[j] = -1 if v in seen else v
            seen.add(v)
    params = dict(
        mask_id=int(rng.integers(0, V)),
        rule=int(rng.integers(0, 4)),
        temperature=draw(st.sampled_from([0.0, 0.5])),
        seed=int(rng.integers(0, 2**32)),
    )
    if params["rule"] == 3:
        params["edit_threshold"] = draw(st.sampled_from([0.0, 0.3, 0.9, float("inf")]))
        if draw(st.booleans()):
            a["editable"] = rng.random(N) < 0.5
    return a, params


def corrupt(draw, a, params, rng, N, V):
    """Breaks one or more things: a dtype, a shape, a value range, a layout or a parameter."""
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["dtype", "shape", "range", "layout", "param", "foreign"]))
        key = draw(st.sampled_from(ORDER + [k for k in OPTIONAL if k in a]))
        if not isinstance(a[key], np.ndarray):
            continue
        if what == "dtype":
            a[key] = a[key].astype(draw(st.sampled_from([np.float64, np.int8, np.int32, np.uint8])))
        elif what == "shape":
            a[key] = (
                np.concatenate([a[key].reshape(-1), a[key].reshape(-1)[:1]])
                if a[key].size
                else np.zeros(2, a[key].dtype)
            )
        elif what == "range":
            if (
                key in ("tokens", "credit_ids", "seq_offsets", "num_commit")
                and a[key].size
                and a[key].dtype.kind == "i"
            ):
                a[key].reshape(-1)[0] = draw(st.sampled_from([-5, V + 3, N + 3, -1]))
            elif key == "threshold" and a[key].size and a[key].dtype.kind == "f":
                a[key][0] = np.nan
        elif what == "layout" and a[key].ndim == 2 and a[key].shape[1] > 1:
            a[key] = np.asfortranarray(a[key]) if draw(st.booleans()) else a[key][:, ::-1]
        elif what == "param":
            p = draw(
                st.sampled_from(
                    ["mask_id", "rule", "temperature", "seed", "offset", "credit_beta", "edit_threshold"]
                )
            )
            params[p] = draw(st.sampled_from([-1, V, 3, 4, 2**32, float("nan"), -0.5]))
        elif what == "foreign":
            a[key] = draw(st.sampled_from([None, 3, "x", [1, 2]]))


@st.composite
def fuzz_call(draw):
    N, V = draw(st.integers(1, 9)), draw(st.integers(1, 70))
    K, B = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    a, params = valid_call(draw, N, V, K, B, rng)
    bad = draw(st.booleans())
    if bad:
        corrupt(draw, a, params, rng, N, V)
    return a, params, bad


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(fuzz_call())
def test_fuzz_bindings_never_crash(case):
    """600 calls, about half valid (which must succeed) and half broken (which must raise a
    TypeError/ValueError naming an argument, or succeed if the break was harmless)."""
    a, params, bad = case
    try:
        call(a, **params)
    except (TypeError, ValueError) as e:
        assert bad, f"a valid call was refused: {e}"
        assert str(e).split(":")[0] in set(ORDER) | set(PARAMS) | set(OPTIONAL) | {"edit_threshold"}, str(e)


# ---- overlapping arrays, hand-built credit states, NumPy scalars ---------------------------------

from dinfer_kernels import attention, decode_step  # noqa: E402
from dinfer_kernels.ops.decode import CreditState  # noqa: E402
from dinfer_kernels.reference.rms_norm import rms_norm_reference  # noqa: E402


def rms_norm_views(out_start):
    """x = rows 0..3 of a 9-row buffer, out = 4 rows from row `out_start` of the same buffer."""
    buf = torch.randn(9, 16)
    x = buf[:4]
    return buf, x, buf[out_start : out_start + 4]


def test_rms_norm_partial_overlap_is_refused():
    """The reproducer: out one row past x in one buffer gave max error 2.76; now a ValueError
    naming both arrays."""
    _, x, out = rms_norm_views(1)
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        EXT.rms_norm(x, torch.ones(16), out, eps=1e-6)


@pytest.mark.parametrize("out_start", [0, 4, 5])
def test_rms_norm_in_place_and_disjoint_views_are_allowed(out_start):
    """Exactly x (the documented in-place call) or rows of the buffer x does not touch."""
    _, x, out = rms_norm_views(out_start)
    want = rms_norm_reference(x.clone(), torch.ones(16), 1e-6)
    EXT.rms_norm(x, torch.ones(16), out, eps=1e-6)
    assert torch.allclose(out, want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * 4)


def test_rms_norm_weight_overlapping_out_is_refused():
    """No in-place alias is documented for weight: even a disjoint-looking row of out is refused."""
    x = torch.randn(4, 16)
    out = torch.empty(4, 16)
    with pytest.raises(ValueError, match=r"^out: overlaps weight"):
        EXT.rms_norm(x, out[2], out, eps=1e-6)


def test_rope_strided_overlap_is_refused():
    """out interleaved with x (same buffer, other heads) is refused; exactly x is allowed."""
    buf = torch.randn(1, 3, 4, 8)
    x, out = buf[:, :, 0::2], buf[:, :, 1::2]  # disjoint elements, but intersecting byte ranges
    table = torch.randn(8, 8)
    positions = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        EXT.rope(x, positions, table, out)
    EXT.rope(x, positions, table, x)


def test_decode_output_inside_an_input_is_refused():
    a = numpy_args()
    lg = torch.from_numpy(a["logits"])
    a["confidence"] = lg[1, :5]  # fp32 [5] inside the logits
    with pytest.raises(ValueError, match=r"^confidence: overlaps logits"):
        call(a)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_attention_caches_overlapping_each_other_are_refused(backend):
    """With write_back both caches are written: one buffer for both is refused on every backend."""
    B, W, S, H, D = 1, 2, 8, 2, 8
    kv = torch.randn(B, S, H, D + 4)
    k_cache, v_cache = kv[..., :D], kv[..., 4:]
    q, k, v = (torch.randn(B, W, H, D) for _ in range(3))
    positions = torch.tensor([[2, 3]])
    seq_lens = torch.tensor([S], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^k_cache: overlaps v_cache"):
        attention(q, k, v, k_cache, v_cache, positions, seq_lens, backend=backend)
    # without write_back the caches are only read: sharing is fine
    attention(q, k, v, k_cache, v_cache, positions, seq_lens, write_back=False, backend=backend)


def decode_case(N=4, V=10):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(N, V, generator=g) * 3,
        torch.full((N,), 3, dtype=torch.int64),
        torch.tensor([0, N], dtype=torch.int32),
    )


def hand_built(N, K, slots):
    """An empty CreditState with {(row, slot): (id, value)} filled in."""
    cs = CreditState.empty(N, K)
    for (n, j), (i, v) in slots.items():
        cs.ids[n, j], cs.vals[n, j] = i, v
    return cs


BAD_CREDIT = [
    ({(1, 0): (2, float("nan"))}, r"credit[._]vals: value nan at row 1, slot 0"),
    ({(0, 1): (4, -5.0)}, r"credit[._]vals: value -5.0+ at row 0, slot 1"),
    ({(2, 1): (4, float("inf"))}, r"credit[._]vals: value inf at row 2, slot 1"),
    ({(3, 0): (-1, 2.0)}, r"credit[._]vals: the empty slot at row 3, slot 0"),
    ({(0, 0): (7, 40.0), (0, 1): (7, 40.0)}, r"credit[._]ids: token id 7 is in two slots of row 0"),
    ({(1, 1): (10, 0.0)}, r"credit[._]ids: slot id 10 at row 1, slot 1 is outside \[-1, 10\)"),
]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("slots,message", BAD_CREDIT, ids=range(len(BAD_CREDIT)))
def test_hand_built_credit_state_is_validated(backend, slots, message):
    """The reproducer: such states gave NaN confidences, or (a duplicate id) confidences above 1."""
    logits, tokens, offsets = decode_case()
    with pytest.raises(ValueError, match=message):
        decode_step(logits, tokens, offsets, 3, credit=hand_built(4, 2, slots), backend=backend)
    with pytest.raises(ValueError, match=message):
        hand_built(4, 2, slots).check(10)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_kept_credit_state_passes_validation(backend):
    """States the op itself leaves (and zero-valued live slots, after decay) are accepted."""
    logits, tokens, offsets = decode_case()
    cs = hand_built(4, 3, {(0, 0): (5, 0.0), (0, 2): (6, 1.5)})
    for _ in range(3):
        decode_step(logits, tokens, offsets, 3, credit=cs, threshold=1.0, backend=backend)
    cs.check(10)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint8])
def test_numpy_integer_scalars_are_taken_like_ints(backend, np_int):
    logits, tokens, offsets = decode_case()
    want = decode_step(logits, tokens.clone(), offsets, 3, seed=5, backend=backend)
    got = decode_step(
        logits,
        tokens.clone(),
        offsets,
        np_int(3),
        seed=np_int(5),
        temperature=np.float32(0.0),
        backend=backend,
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_binding_takes_numpy_scalars_and_refuses_bools():
    call(numpy_args(), mask_id=np.int64(3), seed=np.uint32(7), low_threshold=np.float32(0.4))
    for param, value in (("mask_id", np.bool_(True)), ("mask_id", True), ("seed", np.float64(1.0))):
        with pytest.raises(TypeError, match=rf"^{param}: expected an int"):
            call(numpy_args(), **{param: value})


def test_overlap_with_negative_strides_uses_the_byte_range():
    """NumPy rows in reverse order (a negative row stride): their bytes run below the data pointer."""
    buf = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    x, w = buf[3::-1], np.ones(16, dtype=np.float32)  # rows 3, 2, 1, 0
    EXT.rms_norm(x, w, buf[4:8], eps=1e-6)  # rows 4..7: disjoint
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        EXT.rms_norm(x, w, buf[2:6], eps=1e-6)  # rows 2, 3 shared
