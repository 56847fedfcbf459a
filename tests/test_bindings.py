"""The compiled layer on its own: dinfer_kernels._C over DLPack (NumPy here, no torch in the call),
its argument errors, and a hypothesis fuzz of good and bad calls (none may crash)."""
import numpy as np
import pytest
import torch
from conftest import EXT, assert_precision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dinfer_kernels.reference import decode_step_reference

pytestmark = pytest.mark.skipif(EXT is None, reason="dinfer_kernels._C was not built")

PARAMS = dict(mask_id=3, rule=0, low_threshold=0.4, temperature=0.0, seed=0, offset=0,
              credit_alpha=0.7, credit_beta=0.8, credit_gamma=0.2)


def numpy_args(N=5, V=40, K=2, B=2):
    rng = np.random.default_rng(0)
    offsets = np.linspace(0, N, B + 1).astype(np.int32)
    return dict(
        logits=(rng.standard_normal((N, V)) * 3).astype(np.float32),
        tokens=np.full(N, 3, dtype=np.int64), seq_offsets=offsets,
        threshold=np.full(B, 0.5, dtype=np.float32), num_commit=np.ones(B, dtype=np.int32),
        credit_ids=np.full((N, K), -1, dtype=np.int32), credit_vals=np.zeros((N, K), dtype=np.float32),
        candidate=np.full(N, -9, dtype=np.int64), confidence=np.full(N, np.nan, dtype=np.float32),
        commit=np.zeros(N, dtype=np.bool_), row_max=np.full(N, np.nan, dtype=np.float32),
        row_lse=np.full(N, np.nan, dtype=np.float32))


ORDER = ["logits", "tokens", "seq_offsets", "threshold", "num_commit", "credit_ids", "credit_vals",
         "candidate", "confidence", "commit", "row_max", "row_lse"]


def call(args, **params):
    p = dict(PARAMS, **params)
    EXT.decode_step(*[args[k] for k in ORDER], **p)


@pytest.mark.usefixtures("host_isa")
def test_numpy_through_dlpack_matches_reference():
    a = numpy_args()
    tokens_before = a["tokens"].copy()
    call(a)
    ref_tokens = torch.from_numpy(tokens_before.copy())
    ref = decode_step_reference(torch.from_numpy(a["logits"]), ref_tokens, torch.from_numpy(a["seq_offsets"]),
                                3, threshold=torch.from_numpy(a["threshold"]),
                                credit_ids=torch.from_numpy(a["credit_ids"].copy() * 0 - 1),
                                credit_vals=torch.zeros(5, 2))
    assert np.array_equal(a["candidate"], ref.candidate.numpy())
    assert np.array_equal(a["commit"], ref.commit.numpy())
    assert np.array_equal(a["tokens"], ref_tokens.numpy())
    truth = decode_step_reference(torch.from_numpy(a["logits"]), torch.from_numpy(tokens_before.copy()),
                                  torch.from_numpy(a["seq_offsets"]), 3, threshold=torch.from_numpy(a["threshold"]),
                                  credit_ids=torch.full((5, 2), -1, dtype=torch.int32),
                                  credit_vals=torch.zeros(5, 2), compute_dtype=torch.float64)
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
    ("row_lse", lambda a: np.zeros(5, dtype=np.float16), TypeError),
]


@pytest.mark.parametrize("name,make,exc", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_binding_errors_name_the_argument(name, make, exc):
    a = numpy_args()
    a[name] = make(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a)


@pytest.mark.parametrize("param,value", [("mask_id", 40), ("mask_id", -1), ("rule", 3),
                                         ("temperature", -1.0), ("temperature", float("nan")),
                                         ("seed", -1), ("offset", 2**32), ("credit_beta", 2.0),
                                         ("low_threshold", float("inf"))])
def test_binding_parameter_errors(param, value):
    with pytest.raises(ValueError, match=rf"^{param.replace('credit_', 'credit_')}\b"):
        call(numpy_args(), **{param: value})


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
    params = dict(mask_id=int(rng.integers(0, V)), rule=int(rng.integers(0, 3)),
                  temperature=draw(st.sampled_from([0.0, 0.5])), seed=int(rng.integers(0, 2**32)))
    return a, params


def corrupt(draw, a, params, rng, N, V):
    """Breaks one or more things: a dtype, a shape, a value range, a layout or a parameter."""
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["dtype", "shape", "range", "layout", "param", "foreign"]))
        key = draw(st.sampled_from(ORDER))
        if not isinstance(a[key], np.ndarray):
            continue
        if what == "dtype":
            a[key] = a[key].astype(draw(st.sampled_from([np.float64, np.int8, np.int32, np.uint8])))
        elif what == "shape":
            a[key] = np.concatenate([a[key].reshape(-1), a[key].reshape(-1)[:1]]) if a[key].size else np.zeros(2, a[key].dtype)
        elif what == "range":
            if key in ("tokens", "credit_ids", "seq_offsets", "num_commit") and a[key].size \
                    and a[key].dtype.kind == "i":
                a[key].reshape(-1)[0] = draw(st.sampled_from([-5, V + 3, N + 3, -1]))
            elif key == "threshold" and a[key].size and a[key].dtype.kind == "f":
                a[key][0] = np.nan
        elif what == "layout" and a[key].ndim == 2 and a[key].shape[1] > 1:
            a[key] = np.asfortranarray(a[key]) if draw(st.booleans()) else a[key][:, ::-1]
        elif what == "param":
            p = draw(st.sampled_from(["mask_id", "rule", "temperature", "seed", "offset", "credit_beta"]))
            params[p] = draw(st.sampled_from([-1, V, 3, 2**32, float("nan"), -0.5]))
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
        assert str(e).split(":")[0] in set(ORDER) | set(PARAMS), str(e)
