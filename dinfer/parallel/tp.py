"""What DiffusionLM does differently on one rank of a tensor-parallel group (`DiffusionLM(...,
parallel=TensorParallel(plan, comm))`; None keeps the one-process forward untouched):

- embedding: the rank looks up the tokens of its vocabulary range (zeros for the others), one
  all-reduce of [T, H];
- attention: its query / KV heads (column-parallel q, k, v), then the row-parallel output projection's
  partial sums, one all-reduce of [T, H];
- dense MLP and the shared expert: column-parallel gate / up, row-parallel down, one all-reduce;
- MoE, expert parallelism: the router runs on every rank (replicated fp32 weights, the same routing
  everywhere); "allreduce": each rank runs its experts on the (token, slot) pairs routed to them, adds
  its shared-expert part, one all-reduce (dInfer's and Diffulex's "TP MoE"); "alltoall": each rank
  routes its 1/N of the tokens, sends each pair to the expert's rank, which runs it and sends the
  weighted row back (counts, rows and (expert, weight) exchanged by all_to_all, the results by one
  more), the shared expert's part is reduce-scattered onto the token slices and one all_gather
  restores every token on every rank (the a2a exchange sizes depend on the routing: a host sync);
- LM head: the logits of the rank's vocabulary range only, [R, Vr]: the decode step and the soft
  embedding take them as they are (dinfer_kernels.decode_step_vocab_parallel).

The routed experts of a rank run through dinfer_kernels.moe on its local experts (expert_offset: the
rank's first expert, w13 / w2 its slice only; FP8 ones with their block scales' slice): from the router in "allreduce", from the received
(expert, weight) pairs in "alltoall" (dinfer_kernels.moe_route chooses them on the sending rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dinfer_kernels as dk

from .comm import Comm
from .plan import ShardPlan


class TensorParallel:
    def __init__(self, plan: ShardPlan, comm: Comm):
        if comm.world != plan.world or comm.rank != plan.rank:
            raise ValueError(
                f"tensor_parallel_size: the plan is for rank {plan.rank} of {plan.world}, the process "
                f"group has rank {comm.rank} of {comm.world}"
            )
        self.plan, self.comm = plan, comm
        self.vocab_start, self.vocab_end = plan.vocab
        self.vocab_size = plan.config.vocab_size
        self.e0, self.e1 = plan.experts if plan.config.is_moe else (0, 0)
        self.ep_mode = plan.ep_mode

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x)

    def embed(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        inside = (local >= 0) & (local < table.shape[0])
        rows = F.embedding(local.clamp(0, table.shape[0] - 1), table)
        return self.reduce(torch.where(inside[..., None], rows, torch.zeros((), dtype=rows.dtype)))

    def moe(self, m: torch.Tensor, w: dict, p: str, config, routing: dict) -> torch.Tensor:
        """The MoE layer's output [T, H] (every token, on every rank) for its input m [T, H]."""
        options = dict(renormalize=config.router_renormalize, expert_bias=w.get(p + "expert_bias"), **routing)
        scales = dict(w13_scale=w.get(p + "w13_scale"), w2_scale=w.get(p + "w2_scale"))  # FP8 experts'

        def shared(x):
            if p + "shared_w13" not in w:
                return None
            g, u = (x @ w[p + "shared_w13"].t()).chunk(2, dim=-1)
            return ((F.silu(g) * u) @ w[p + "shared_w2"].t()).float()

        if self.ep_mode == "allreduce":
            out = dk.moe(
                m,
                w[p + "router"],
                w[p + "w13"],
                w[p + "w2"],
                config.top_k,
                expert_offset=self.e0,
                **options,
                **scales,
            ).float()  # the partial sums added in fp32, as the shared expert's
            part = shared(m)
            return self.reduce(out if part is None else out + part).to(m.dtype)
        return self._moe_alltoall(m, w, p, config, options, scales, shared)

    def _moe_alltoall(self, m, w, p, config, options, scales, shared) -> torch.Tensor:
        comm, n = self.comm, self.world
        T, H = m.shape
        chunk = -(-T // n)  # equal slices (the last ones may be short or empty), padded to n * chunk
        lo, hi = min(self.rank * chunk, T), min((self.rank + 1) * chunk, T)
        mine = m[lo:hi]
        weights, experts = dk.moe_route(mine, w[p + "router"], config.top_k, **options)
        k = experts.shape[1]
        per_rank = (self.e1 - self.e0) or 1
        flat = experts.flatten()
        dest = flat // per_rank
        order = dest.argsort(stable=True)
        send = torch.bincount(dest, minlength=n)
        send_list = send.tolist()
        recv = comm.exchange_counts(send)
        rows = mine.index_select(0, order // k)
        meta = torch.stack([flat[order].float(), weights.flatten()[order].float()], dim=1)
        got = comm.all_to_all(rows, send_list, recv)
        got_meta = comm.all_to_all(meta, send_list, recv)
        # Each received row is one (token, slot) pair: a top-1 routing given with the row.
        y = dk.moe(
            got,
            None,
            w[p + "w13"],
            w[p + "w2"],
            1,
            topk_ids=got_meta[:, :1].long(),
            topk_weights=got_meta[:, 1:],
            expert_offset=self.e0,
            **scales,
        )
        back = comm.all_to_all(y.float(), recv, send_list)
        out = torch.zeros(chunk, H, dtype=torch.float32, device=m.device)
        out.index_add_(0, order // k, back)
        part = shared(m)
        if part is not None:
            padded = torch.zeros(n * chunk, H, dtype=torch.float32, device=m.device)
            padded[:T] = part
            out += comm.reduce_scatter(padded)
        return comm.all_gather(out)[:T].to(m.dtype)
