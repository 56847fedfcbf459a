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


def decode_calls(backend, dev, dtype):
    N, V = 37, 32003
    logits = (torch.randn(N, V, device=dev) * 3).to(dtype)
    tokens = torch.randint(0, V, (N,), device=dev)
    tokens[::2] = 7
    offsets = torch.tensor([0, 5, 5, N], dtype=torch.int32, device=dev)
    yield "decode_step threshold", lambda: dk.decode_step(logits, tokens.clone(), offsets, 7, backend=backend)
    credit = dk.CreditState.empty(N, 16, device=dev)
    yield (
        "decode_step credit",
        lambda: dk.decode_step(logits, tokens.clone(), offsets, 7, credit=credit, backend=backend),
    )
    yield (
        "decode_step fixed",
        lambda: dk.decode_step(
            logits, tokens.clone(), offsets, 7, rule="fixed", num_commit=2, backend=backend
        ),
    )


def attention_calls(backend, dev, dtype):
    B, W, S, Hq, Hkv = 2, 33, 200, 4, 2
    for D in (64, 128):
        r = lambda *s: torch.randn(*s, device=dev).to(dtype)
        q, k, v, kc, vc = r(B, W, Hq, D), r(B, W, Hkv, D), r(B, W, Hkv, D), r(B, S, Hkv, D), r(B, S, Hkv, D)
        pos = (torch.tensor([[0], [100]], device=dev) + torch.arange(W, device=dev)).long()
        lens = torch.tensor([W, 170], dtype=torch.int32, device=dev)
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
        MP = -(-S // ps)
        P = B * MP + 2
        table = torch.randperm(P, device=dev)[: B * MP].view(B, MP).to(torch.int32)
        table[1, 110 // ps], table[1, -1] = -1, P + 5
        pk, pv = r(P, ps, Hkv, D), r(P, ps, Hkv, D)
        pbm = dk.BlockMask.full(B, Hkv, W, MP * ps, q_block=16, kv_block=96, device=dev)
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
    T, E, H, inter = 37, 64, 256, 128
    hidden = torch.randn(T, H, device=dev).to(dtype)
    router = torch.randn(E, H, device=dev) * 0.2
    w13 = (torch.randn(E, 2 * inter, H, device=dev) * 0.05).to(dtype)
    w2 = (torch.randn(E, H, inter, device=dev) * 0.05).to(dtype)
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


CALLS = {"decode_step": decode_calls, "attention": attention_calls, "moe": moe_calls}


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
