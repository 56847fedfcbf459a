"""The compiled attention entry point on its own: dinfer_kernels._C.attention over DLPack. Every
argument error names the argument, host arrays (torch or NumPy) run the host kernel and match the
reference, a fuzz of good and bad host calls never crashes, and on a GPU the same errors hold for
CUDA arrays, the CUDA-only layout rules are enforced and a small call matches the reference."""

import pytest
import torch
from conftest import EXT, assert_precision
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dinfer_kernels.op_inputs import paged_caches
from dinfer_kernels.reference.attention import attention_reference

pytestmark = pytest.mark.skipif(
    EXT is None or not hasattr(EXT, "attention"),
    reason="dinfer_kernels._C was built without the attention kernels",
)
needs_cuda_build = pytest.mark.skipif(
    EXT is None or not hasattr(EXT, "attention_workspace_bytes"),
    reason="dinfer_kernels._C was built without the CUDA kernels",
)

ORDER = [
    "q",
    "k",
    "v",
    "k_cache",
    "v_cache",
    "positions",
    "seq_lens",
    "out",
    "lse",
    "block_mass",
    "kv_num_blocks",
    "kv_indices",
    "block_table",
]
SCALARS = ["write_back", "q_block", "kv_block", "scale", "workspace", "stream"]


def make_args(
    B=2,
    W=5,
    S=40,
    Hq=4,
    Hkv=2,
    D=64,
    dtype=torch.float16,
    q_block=2,
    kv_block=16,
    device="cpu",
    blocks=True,
    seed=0,
    page_size=None,
):
    """Valid arguments of one call; page_size: the caches as shuffled page pools with a block table
    (S = MP * page_size positions, MP = ceil(S / page_size))."""
    if page_size is not None:
        S = -(-S // page_size) * page_size
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
    nqb, nkb = -(-W // q_block), -(-S // kv_block)
    pos = torch.stack([torch.randperm(S, generator=g)[:W] for _ in range(B)]).to(device)
    a = dict(
        q=r(B, W, Hq, D),
        k=r(B, W, Hkv, D),
        v=r(B, W, Hkv, D),
        k_cache=r(B, S, Hkv, D),
        v_cache=r(B, S, Hkv, D),
        positions=pos,
        seq_lens=torch.full((B,), S, dtype=torch.int32, device=device),
        out=torch.empty(B, W, Hq, D, dtype=dtype, device=device),
        lse=torch.empty(B, W, Hq, device=device),
        block_mass=torch.empty(B, Hq, nkb, device=device),
        kv_num_blocks=(torch.full((B, Hkv, nqb), nkb, dtype=torch.int32, device=device) if blocks else None),
        kv_indices=(
            torch.arange(nkb, dtype=torch.int32, device=device).expand(B, Hkv, nqb, nkb).contiguous()
            if blocks
            else None
        ),
        block_table=None,
    )
    if page_size is not None:
        kc, vc = a["k_cache"].cpu(), a["v_cache"].cpu()
        (pk, pv), table = paged_caches((kc, vc), page_size, seed=seed, extra_pages=2)
        a.update(k_cache=pk.to(device), v_cache=pv.to(device), block_table=table.to(device))
    params = dict(write_back=True, q_block=q_block, kv_block=kv_block, scale=D**-0.5)
    return a, params


def workspace_for(a, p):
    B, W, Hq, D = a["q"].shape
    S, Hkv = a["k_cache"].shape[1:3]
    if isinstance(a.get("block_table"), torch.Tensor):
        S *= a["block_table"].shape[1]
    maxb = -1 if a["kv_indices"] is None else a["kv_indices"].shape[-1]
    n = EXT.attention_workspace_bytes(
        B, W, Hq, Hkv, D, S, p["q_block"], p["kv_block"], maxb, p["write_back"], a["block_mass"] is not None
    )
    return torch.empty(n, dtype=torch.uint8, device=a["q"].device)


def call(a, **params):
    p = dict(params)
    on_gpu = isinstance(a["q"], torch.Tensor) and a["q"].is_cuda
    if "workspace" not in p and on_gpu:
        p["workspace"] = workspace_for(a, p)
    if on_gpu:
        p.setdefault("stream", torch.cuda.current_stream().cuda_stream)
    EXT.attention(*[a[k] for k in ORDER], **p)


def small_call_matches_reference(device, dtype, write_back, page_size=None):
    a, p = make_args(device=device, dtype=dtype, page_size=page_size)
    p["write_back"] = write_back
    kc0, vc0 = a["k_cache"].clone(), a["v_cache"].clone()
    call(a, **p)
    if device == "cuda":
        torch.cuda.synchronize()
    c = {k: (t.cpu() if isinstance(t, torch.Tensor) else t) for k, t in a.items()}
    bm = (c["kv_num_blocks"], c["kv_indices"], p["q_block"], p["kv_block"])
    same, truth = (
        attention_reference(
            c["q"],
            c["k"],
            c["v"],
            kc0.cpu(),
            vc0.cpu(),
            c["positions"],
            c["seq_lens"],
            write_back,
            None,
            p["scale"],
            dtype,
            block_mask=bm,
            return_lse=True,
            return_block_mass=True,
            block_table=c["block_table"],
        )
        for dtype in (torch.float32, torch.float64)
    )
    for nm, s, t in zip(("out", "lse", "block_mass"), same, truth):
        assert_precision(c[nm], s, t, nm)
    if not write_back:
        assert torch.equal(a["k_cache"].isnan(), kc0.isnan()) and torch.equal(
            a["v_cache"].isnan(), vc0.isnan()
        )
        assert torch.equal(a["k_cache"].nan_to_num(), kc0.nan_to_num())
        assert torch.equal(a["v_cache"].nan_to_num(), vc0.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.usefixtures("host_isa")
def test_host_call_matches_reference(dtype, write_back):
    small_call_matches_reference("cpu", dtype, write_back)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.usefixtures("host_isa")
def test_host_paged_call_matches_reference(dtype, write_back, page_size):
    small_call_matches_reference("cpu", dtype, write_back, page_size)


@pytest.mark.usefixtures("host_isa")
def test_numpy_arrays_go_through_dlpack():
    a, p = make_args(blocks=False, dtype=torch.float32)
    same, truth = (
        attention_reference(
            a["q"],
            a["k"],
            a["v"],
            a["k_cache"].clone(),
            a["v_cache"].clone(),
            a["positions"],
            a["seq_lens"],
            True,
            None,
            p["scale"],
            dtype,
        )
        for dtype in (torch.float32, torch.float64)
    )
    for key in ("q", "k", "v", "k_cache", "v_cache", "positions", "seq_lens", "out", "lse"):
        a[key] = a[key].numpy()
    a["block_mass"] = None
    call(a, **p)
    assert_precision(torch.from_numpy(a["out"]), same, truth, "out")


def _swap_last_two(t):  # same shape, last dim strided
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


BAD = [
    ("q", lambda a: a["q"].double(), TypeError),
    ("q", lambda a: a["q"][0], ValueError),
    ("q", lambda a: torch.zeros(2, 5, 4, 0, dtype=torch.float16), ValueError),
    ("q", lambda a: [[1.0]], TypeError),
    ("k", lambda a: a["k"].bfloat16(), TypeError),
    ("k", lambda a: a["k"][:, :3], ValueError),
    ("v", lambda a: a["v"][..., :1, :], ValueError),
    ("k_cache", lambda a: torch.zeros(2, 40, 3, 64, dtype=torch.float16), ValueError),
    ("k_cache", lambda a: _swap_last_two(a["k_cache"]), ValueError),
    ("v_cache", lambda a: a["v_cache"][:, :-1], ValueError),
    ("positions", lambda a: a["positions"].int(), TypeError),
    ("positions", lambda a: a["positions"][:, :2], ValueError),
    ("positions", lambda a: a["positions"].t().contiguous().t(), ValueError),
    ("seq_lens", lambda a: a["seq_lens"].long(), TypeError),
    ("seq_lens", lambda a: a["seq_lens"][:1], ValueError),
    ("out", lambda a: a["out"].float(), TypeError),
    ("out", lambda a: a["out"][:, :, :2], ValueError),
    ("lse", lambda a: a["lse"].double(), TypeError),
    ("lse", lambda a: a["lse"][..., :1], ValueError),
    ("block_mass", lambda a: a["block_mass"][..., :-1], ValueError),
    ("kv_num_blocks", lambda a: a["kv_num_blocks"].long(), TypeError),
    ("kv_num_blocks", lambda a: a["kv_num_blocks"][..., :1], ValueError),
    ("kv_indices", lambda a: a["kv_indices"][0], ValueError),
    ("kv_indices", lambda a: a["kv_indices"].float(), TypeError),
    ("kv_indices", lambda a: None, ValueError),  # counts without indices
]


@pytest.mark.parametrize("name,make,exc", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_binding_errors_name_the_argument(name, make, exc):
    a, p = make_args()
    a[name] = make(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a, **p)


def _pool(a, **sizes):
    """A page pool like a's k_cache with some sizes changed (pages, page_size)."""
    P, ps, Hkv, D = a["k_cache"].shape
    P, ps = sizes.get("pages", P), sizes.get("page_size", ps)
    return torch.zeros(P, ps, Hkv, D, dtype=a["k_cache"].dtype, device=a["k_cache"].device)


def _huge_pages(a):
    """Pages of 2^16 rows and a table of 2^14 of them per sequence: 2^30 positions, one too many."""
    a["k_cache"], a["v_cache"] = _pool(a, pages=1, page_size=1 << 16), _pool(a, pages=1, page_size=1 << 16)
    a["block_table"] = torch.zeros(a["q"].shape[0], 1 << 14, dtype=torch.int32, device=a["q"].device)


# (name, change of the paged arguments in place, exception)
BAD_PAGED = [
    ("block_table", lambda a: a.update(block_table=a["block_table"].long()), TypeError),
    ("block_table", lambda a: a.update(block_table=a["block_table"][0]), ValueError),
    ("block_table", lambda a: a.update(block_table=a["block_table"][:1]), ValueError),
    ("block_table", lambda a: a.update(block_table=a["block_table"].t().contiguous().t()), ValueError),
    ("block_table", lambda a: a.update(block_table="x"), TypeError),
    ("block_table", _huge_pages, ValueError),
    ("k_cache", lambda a: a.update(k_cache=_pool(a, pages=0), v_cache=_pool(a, pages=0)), ValueError),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"][0]), ValueError),
    ("v_cache", lambda a: a.update(v_cache=_pool(a, pages=a["k_cache"].shape[0] + 1)), ValueError),
    ("v_cache", lambda a: a.update(v_cache=_pool(a, page_size=a["k_cache"].shape[1] + 1)), ValueError),
]


@pytest.mark.parametrize("name,change,exc", BAD_PAGED, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_PAGED)])
def test_binding_paged_errors_name_the_argument(name, change, exc):
    a, p = make_args(page_size=8)
    call(dict(a), **p)  # the unchanged call is valid
    change(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a, **p)


@pytest.mark.usefixtures("host_isa")
def test_host_strided_views_match_contiguous():
    """The host kernel reads any leading strides (here a head stride of 68 elements)."""
    a, p = make_args(blocks=False)
    a["block_mass"] = None
    kc0, vc0 = a["k_cache"].clone(), a["v_cache"].clone()
    call(a, **p)
    want = a["out"].clone()
    odd = torch.zeros(2, 5, 4, 68, dtype=torch.float16)
    odd[..., :64] = a["q"]
    a["q"], a["k_cache"], a["v_cache"] = odd[..., :64], kc0, vc0
    call(a, **p)
    assert torch.equal(a["out"], want)


@pytest.mark.parametrize(
    "param,value,exc",
    [
        ("write_back", 1, TypeError),
        ("q_block", 0, ValueError),
        ("q_block", 2.0, TypeError),
        ("kv_block", -1, ValueError),
        ("scale", float("nan"), ValueError),
        ("scale", float("inf"), ValueError),
        ("scale", "x", TypeError),
        ("stream", 1.5, TypeError),
    ],
)
def test_scalar_errors_name_the_parameter(param, value, exc):
    a, p = make_args()
    p[param] = value
    with pytest.raises(exc, match=rf"^{param}\b"):
        call(a, **p)


def test_read_only_output_is_refused():
    a, p = make_args(blocks=False)
    for key in ("q", "k", "v", "k_cache", "v_cache", "positions", "seq_lens", "out", "lse"):
        a[key] = a[key].numpy()
    a["block_mass"] = None
    a["out"].flags.writeable = False
    with pytest.raises(ValueError, match=r"^out\b"):
        call(a, **p)


@needs_cuda_build
def test_workspace_size_and_split_count():
    ws = lambda **kw: EXT.attention_workspace_bytes(
        **dict(
            dict(
                batch=1,
                window=96,
                heads_q=16,
                heads_kv=16,
                head_dim=128,
                cache_len=4096,
                q_block=96,
                kv_block=64,
                max_blocks=-1,
                write_back=True,
                block_mass=False,
            ),
            **kw,
        )
    )
    base = ws()
    assert base > 0 and base % 256 == 0  # a split-KV workspace for the window step
    assert ws(write_back=False) > base  # saved cache rows
    assert ws(block_mass=True, max_blocks=64) > base  # per-(row, block) statistics
    assert ws(window=0) == 0
    ns = lambda **kw: EXT.attention_num_splits(
        **dict(
            dict(
                batch=1,
                window=96,
                heads_q=16,
                heads_kv=16,
                cache_len=4096,
                q_block=96,
                kv_block=64,
                max_blocks=-1,
                block_mass=False,
            ),
            **kw,
        )
    )
    assert 1 < ns() <= 32
    assert ns(window=8192, cache_len=8192, q_block=128) == 1  # a full refresh fills the GPU alone
    assert ns(cache_len=64) == 1  # too few keys to split
    assert ns(max_blocks=2, block_mass=True) <= 2  # whole blocks per split


FLOATS = [torch.float16, torch.bfloat16, torch.float32]


@st.composite
def fuzz_call(draw):
    B, W, S = draw(st.integers(1, 3)), draw(st.integers(0, 6)), draw(st.integers(1, 40))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 3))
    D = draw(st.sampled_from([64, 128]))
    q_block, kv_block = draw(st.integers(1, 4)), draw(st.integers(1, 20))
    page_size = draw(st.sampled_from([None, 1, 3, 8]))
    W = min(W, S)
    a, p = make_args(
        B,
        W,
        S,
        Hq,
        Hkv,
        D,
        draw(st.sampled_from(FLOATS[:2])),
        q_block,
        kv_block,
        blocks=draw(st.booleans()),
        seed=draw(st.integers(0, 100)),
        page_size=page_size,
    )
    if draw(st.booleans()):
        a["lse"] = None
    if draw(st.booleans()):
        a["block_mass"] = None
    bad = draw(st.booleans())
    if bad:
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(ORDER + SCALARS[:4]))
            what = draw(st.sampled_from(["dtype", "shape", "foreign", "layout"]))
            if key in SCALARS:
                p[key] = draw(st.sampled_from([0, -3, 1.5, float("nan"), "x", None, True]))
            elif a[key] is None:
                a[key] = torch.zeros(1)
            elif not isinstance(a[key], torch.Tensor):
                continue
            elif what == "dtype":
                a[key] = a[key].to(
                    draw(st.sampled_from([torch.float64, torch.int8, torch.int32, torch.float32]))
                )
            elif what == "shape":
                a[key] = a[key].reshape(-1)[:1] if draw(st.booleans()) else a[key].unsqueeze(0)
            elif what == "layout" and a[key].ndim >= 2 and a[key].shape[-1] > 1:
                a[key] = a[key].flip(-1).transpose(-1, -2).contiguous().transpose(-1, -2)
            else:
                a[key] = draw(st.sampled_from([None, 3, "x", [1, 2]]))
    return a, p, bad


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(fuzz_call())
def test_fuzz_bindings_never_crash(case):
    """400 host calls, half valid (which must run) and half broken (which must raise a
    TypeError/ValueError naming an argument, or run if the break was harmless)."""
    a, p, bad = case
    try:
        call(a, **p)
    except (TypeError, ValueError) as e:
        first = str(e).split(":")[0]
        assert first in set(ORDER) | set(SCALARS), str(e)
        assert bad, str(e)


# ---- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name,make,exc", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_gpu_binding_errors_name_the_argument(name, make, exc):
    a, p = make_args(device="cuda")
    p["workspace"] = workspace_for(a, p)  # sized from the valid arguments: the bad one may have no shape
    bad = make({k: (t.cpu() if isinstance(t, torch.Tensor) else t) for k, t in a.items()})
    a[name] = bad.cuda() if isinstance(bad, torch.Tensor) else bad
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a, **p)


@pytest.mark.gpu
@pytest.mark.parametrize("name,change,exc", BAD_PAGED, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_PAGED)])
def test_gpu_binding_paged_errors_name_the_argument(name, change, exc):
    a, p = make_args(device="cuda", page_size=8)
    p["workspace"] = workspace_for(a, p)  # sized from the valid arguments
    change(a)
    with pytest.raises(exc, match=rf"^{name}\b"):
        call(a, **p)


@pytest.mark.gpu
def test_gpu_paged_block_table_on_another_device():
    a, p = make_args(device="cuda", page_size=8)
    a["block_table"] = a["block_table"].cpu()
    with pytest.raises(ValueError, match=r"^block_table\b.*same device"):
        call(a, **p)


@pytest.mark.gpu
def test_gpu_layout_rules_dtype_and_head_dim():
    """The CUDA kernels copy rows in 16-byte vectors and are tiled for D in {64, 128}, fp16/bf16:
    strides that are multiples of 8 pass, others, fp32 and other head dims are refused naming q."""
    a, p = make_args(device="cuda")
    a["q"] = torch.zeros(2, 5, 6, 64, dtype=torch.float16, device="cuda")[:, :, :4]  # strides 384, 64
    call(a, **p)
    for bad, what in (
        (torch.zeros(2, 5, 4, 68, dtype=torch.float16, device="cuda")[..., :64], "multiple of 8"),
        (a["q"].float(), "dtype"),
        (torch.zeros(2, 5, 4, 32, dtype=torch.float16, device="cuda"), "head dim"),
    ):
        a["q"] = bad
        with pytest.raises((TypeError, ValueError), match=rf"^q\b.*{what}"):
            call(a, **p)


@pytest.mark.gpu
def test_gpu_mixed_devices_and_workspace_errors():
    a, p = make_args(device="cuda")
    a["lse"] = a["lse"].cpu()
    with pytest.raises(ValueError, match=r"^lse\b.*same device"):
        call(a, **p)
    a, p = make_args(device="cuda")
    with pytest.raises(ValueError, match=r"^workspace\b"):
        call(a, workspace=torch.empty(1, dtype=torch.uint8, device="cuda"), **p)
    a, p = make_args(device="cuda")
    if workspace_for(a, p).numel():
        with pytest.raises(ValueError, match=r"^workspace\b"):
            call(a, workspace=None, **p)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("write_back", [True, False])
def test_gpu_small_call_matches_reference(dtype, write_back):
    small_call_matches_reference("cuda", dtype, write_back)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("write_back", [True, False])
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_gpu_small_paged_call_matches_reference(dtype, write_back, page_size):
    small_call_matches_reference("cuda", dtype, write_back, page_size)
