"""One small call of each compiled kernel, for compute-sanitizer (memcheck, racecheck) in the GPU check.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench_kernels/kernel_calls.py
    python bench_kernels/kernel_calls.py --device cpu        # the host kernels (the dry run)

Each call uses awkward sizes (a vocabulary and a window that are not multiples of any tile, a partial
key block, ragged rows) so that the edge paths run too, and checks nothing itself: the sanitizer
judges the memory accesses, the test suite the values. Prints one line per call; exit status 1 if a
call raises.
"""

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing: both packages sit at the root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import dinfer_kernels as dk  # noqa: E402
from dinfer_kernels import _backend, op_inputs  # noqa: E402


def decode_step_calls(backend, dev, dtype):
    N = 37
    a = op_inputs.decode_step_inputs(
        N, 32003, dtype=dtype, device=dev, seq_offsets=[0, 5, 5, N], mask_id=7, masked_frac=0.5
    )
    tokens = a.pop("tokens")
    yield "decode_step threshold", lambda: dk.decode_step(tokens=tokens.clone(), **a, backend=backend)
    credit = dk.CreditState.empty(N, 16, device=dev)
    yield (
        "decode_step credit",
        lambda: dk.decode_step(tokens=tokens.clone(), **a, credit=credit, backend=backend),
    )
    yield (
        "decode_step fixed",
        lambda: dk.decode_step(tokens=tokens.clone(), **a, rule="fixed", num_commit=2, backend=backend),
    )


def attention_calls(backend, dev, dtype):
    B, W, S, Hq, Hkv = 2, 33, 200, 4, 2
    # windows at 0 and 100, one ending at its sequence's end, one with keys past it
    pos = (torch.tensor([[0], [100]], device=dev) + torch.arange(W, device=dev)).long()
    lens = torch.tensor([W, 170], dtype=torch.int32, device=dev)
    for D in (64, 128):
        a = op_inputs.attention_inputs(B, W, S, Hq, Hkv, D, dtype=dtype, device=dev)
        q, k, v, kc, vc = (a[n] for n in ("q", "k", "v", "k_cache", "v_cache"))
        yield (
            f"attention D={D} dense",
            lambda: dk.attention(q, k, v, kc, vc, pos, lens, return_lse=True, backend=backend),
        )
        bm = dk.BlockMask.full(B, Hkv, W, S, q_block=16, kv_block=96, device=dev)
        yield (
            f"attention D={D} block mask",
            lambda: dk.attention(
                q,
                k,
                v,
                kc,
                vc,
                pos,
                lens,
                block_mask=bm,
                return_lse=True,
                return_block_mass=True,
                write_back=False,
                backend=backend,
            ),
        )
        # The paged layout: pages of 3 rows in shuffled order, spare pages, unchecked ids outside the
        # pool (one under window rows of sequence 1, one past its length).
        ps = 3
        paged = op_inputs.attention_inputs(B, W, S, Hq, Hkv, D, dtype=dtype, device=dev, page_size=ps)
        pk, pv, table = paged["k_cache"], paged["v_cache"], paged["block_table"]
        table[1, 110 // ps], table[1, -1] = -1, pk.shape[0] + 5
        pbm = dk.BlockMask.full(B, Hkv, W, table.shape[1] * ps, q_block=16, kv_block=96, device=dev)
        for wb in (True, False):
            yield (
                f"attention D={D} paged write_back={wb}",
                lambda wb=wb: dk.attention(
                    q,
                    k,
                    v,
                    pk,
                    pv,
                    pos,
                    lens,
                    block_table=table,
                    block_mask=pbm,
                    return_lse=True,
                    return_block_mass=True,
                    write_back=wb,
                    backend=backend,
                    validate=False,
                ),
            )


def moe_calls(backend, dev, dtype):
    E = 64
    a = op_inputs.moe_inputs(37, E, 256, 128, 8, dtype=dtype, device=dev)
    hidden, router, w13, w2 = a["hidden"], a["router_weight"], a["w13"], a["w2"]
    yield "moe softmax top-8", lambda: dk.moe(hidden, router, w13, w2, 8, backend=backend)
    bias = torch.rand(E, device=dev) * 0.1
    yield (
        "moe sigmoid grouped",
        lambda: dk.moe(
            hidden,
            router,
            w13,
            w2,
            8,
            scoring="sigmoid",
            expert_bias=bias,
            num_groups=8,
            topk_groups=4,
            renormalize=True,
            routed_scaling=2.5,
            backend=backend,
        ),
    )
    yield "moe one token", lambda: dk.moe(hidden[:1], router, w13, w2, 8, backend=backend)


def rms_norm_calls(backend, dev, dtype):
    a = op_inputs.rms_norm_inputs((37, 1000), dtype=dtype, device=dev)
    yield "rms_norm", lambda: dk.rms_norm(**a, backend=backend)


def rope_calls(backend, dev, dtype):
    a = op_inputs.rope_inputs(2, 37, 3, 72, dtype=dtype, device=dev)
    yield "rope", lambda: dk.rope(**a, backend=backend)
    yield "rope partial", lambda: dk.rope(**a, rotary_dim=36, backend=backend)


# The calls of every compiled kernel family (OP_TABLE's compiled rows, as the extension lists them):
# <op>_calls above.
_EXT = _backend.compiled()
CALLS = {op: globals()[f"{op}_calls"] for op in (_EXT.host_kernels() if _EXT else ())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    a = p.parse_args(argv)
    backend = "cuda" if a.device == "cuda" else "cpu"
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    failed = 0
    for op, calls in CALLS.items():
        if backend not in dk.available_backends(a.device, op):
            print(f"{op}: no {backend} kernel in this build, skipped")
            continue
        for name, call in calls(backend, a.device, dtype):
            try:
                call()
                if a.device == "cuda":
                    torch.cuda.synchronize()
                print(f"{name} [{backend}]: ran")
            except Exception:
                failed += 1
                print(f"{name} [{backend}]: FAILED")
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
