"""The LLaDA / LLaDA-MoE / LLaDA2-MoE transformer, written against dinfer_kernels ops.

One forward takes a *window* of rows per sequence ([B, W], each row at its own absolute position)
and a per-layer KV cache [B, S, Hkv, D]. Every row attends bidirectionally to keys [0, seq_lens[b])
of its sequence: cached keys outside the window, the fresh keys of the window inside it. With
write_back=True the window's fresh K/V replace the cache rows in place (a full-sequence forward with
W = S therefore *fills* the cache); with False the cache is left as it was (dInfer's vicinity step).
`attn_mask` [B, W, S] (dense, torch backend) or `block_mask` (a dinfer_kernels.BlockMask, every backend)
narrow what each row sees: LLaDA2's block-causal attention. With `block_table` the cache is paged
(dinfer.paged_cache: per-layer page pools shared by the sequences, each sequence's pages in its row
of the table), as dinfer_kernels.attention takes it.
The LM head runs only on the rows the caller asks for (`logits_rows`), and so do the last layer's
output projection and MLP.

Weights use the canonical names of dinfer.models.checkpoint (embed, layers.{i}.q, ..., lm_head).
With `parallel` (a dinfer.parallel.TensorParallel) the model is one rank of a tensor-parallel group:
`config` and `weights` are the rank's (its heads, slices and experts: dinfer.parallel.plan), and the
forward adds the group's collectives (dinfer/parallel/tp.py); its logits are the rank's vocabulary
range. None is the one-process forward, unchanged.
With DINFER_NVTX=1 a forward names its parts for profilers (dinfer_kernels.profiling): model.forward,
in it layer.{i}, in each its attention and mlp.
The ops (rms_norm, qk_rope, attention, moe) come from `ops`: dinfer_kernels for inference, the
differentiable stand-ins of dinfer.train.ops for training, so both run this one forward.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

import dinfer_kernels as dk
from dinfer_kernels import profiling

from .config import ModelConfig

# The moe op's optional per-layer weights: the shared expert, and FP8 experts' block scales.
_MOE_EXTRAS = ("shared_w13", "shared_w2", "w13_scale", "w2_scale", "shared_w13_scale", "shared_w2_scale")


@dataclass
class KVCache:
    """Per-layer keys and values, [B, S, Hkv, D] each, RoPE already applied to the keys."""

    keys: List[torch.Tensor]
    values: List[torch.Tensor]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]


def fused_qkv(weights: dict, num_layers: int) -> dict:
    """`weights` with each layer's q, k and v projections replaced by one `qkv`: their rows
    concatenated (Q heads, then K heads, then V heads). A new dict; weights already fused (LLaDA2's)
    are returned as they are."""
    if "layers.0.q" not in weights:
        return weights
    w = dict(weights)
    for i in range(num_layers):
        p = f"layers.{i}."
        w[p + "qkv"] = torch.cat([w.pop(p + "q"), w.pop(p + "k"), w.pop(p + "v")])
    return w


class DiffusionLM:
    def __init__(self, config: ModelConfig, weights: dict, ops=dk, parallel=None, fuse_qkv=None):
        """fuse_qkv: the q, k and v projections of each layer as one [(Hq + 2 Hkv) D, H] weight, one
        GEMM instead of three (fewer launches, a wider and better-streamed GEMM), in the layout of
        LLaDA2's fused projection. Default: on a GPU for inference (ops dinfer_kernels); the host
        keeps the three (its outputs stay those of the separate GEMMs) and so does training (its
        parameters are the three tensors)."""
        self.config = config
        self.parallel = parallel
        fuse = weights["embed"].device.type == "cuda" and ops is dk if fuse_qkv is None else fuse_qkv
        self.w = fused_qkv(weights, config.num_layers) if fuse else weights
        self.ops = ops
        self.dtype = weights["embed"].dtype
        self.device = weights["embed"].device
        # The rope tables (_rope_table), the largest last. A grown table never frees the smaller ones:
        # CUDA graphs captured on them (another Generator's, on a smaller cache) still read them.
        self._rope_tables: List[torch.Tensor] = []
        # LLaDA2's router (sigmoid scores, group-limited choice, scaled weights); LLaDA-MoE's defaults
        self._routing = (
            dict(
                scoring=config.router_scoring,
                num_groups=config.num_groups,
                topk_groups=config.topk_groups,
                routed_scaling=config.routed_scaling,
            )
            if config.router_scoring != "softmax"
            else {}
        )

    @classmethod
    def from_pretrained(cls, path, dtype=torch.bfloat16, device="cpu") -> "DiffusionLM":
        from .checkpoint import load_weights

        config = ModelConfig.from_dir(path)
        return cls(config, load_weights(path, config, dtype=dtype, device=device))

    @property
    def embedding(self) -> torch.Tensor:
        """The input embedding table [V, H] (iteration smoothing mixes its rows); under tensor
        parallelism the rank's rows, those of its vocabulary range."""
        return self.w["embed"]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:
            return self.parallel.embed(tokens, self.w["embed"])
        return F.embedding(tokens, self.w["embed"])

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=self.dtype, device=self.device)
        return KVCache([zeros() for _ in range(c.num_layers)], [zeros() for _ in range(c.num_layers)])

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        seq_lens: torch.Tensor,
        *,
        write_back: bool = True,
        logits_rows: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        ffn_rows: Optional[torch.Tensor] = None,
        block_mask: Optional[dk.BlockMask] = None,
        block_table: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """inputs_embeds [B, W, H], positions [B, W] int64, seq_lens [B] int32 →
        logits [R, V] for the flat rows `logits_rows` (indices into B * W; all rows if None).
        ffn_rows: the flat rows whose MLP / MoE runs (all if None); the others get none. Training
        passes the rows before each seq_lens: its padded batches are about half padding, which no
        row attends to, so skipping their MLP changes no other row. An empty `logits_rows` runs the
        layers up to the last attention only: a forward that just writes the cache (a prefill)."""
        c = self.config
        B, W, H = inputs_embeds.shape
        h = inputs_embeds
        rope_table = self._rope_table(cache, block_table)
        with profiling.region("model.forward"):
            for i in range(c.num_layers):
                last = i == c.num_layers - 1
                with profiling.region(f"layer.{i}"):
                    with profiling.region("attention"):
                        o = self._attention(
                            i,
                            h,
                            positions,
                            cache,
                            seq_lens,
                            write_back,
                            attn_mask,
                            block_mask,
                            block_table,
                            rope_table,
                        )
                    if last and logits_rows is not None and logits_rows.numel() == 0:
                        return h.new_empty(
                            (0, self.w["lm_head"].shape[0])
                        )  # the last K/V are written; nothing is read
                    if last and logits_rows is not None:
                        # Past the last attention (whose K/V come from its input) only the logits rows
                        # are read: the other rows' output projection and MLP would be thrown away. A
                        # refresh's window is the whole sequence but its logits rows are one block (~1/9
                        # of it on the embedded models).
                        h = h.reshape(B * W, H).index_select(0, logits_rows)[None]
                        o = o.reshape(B * W, -1).index_select(0, logits_rows)[None]
                        ffn_rows = None  # every logits row is a real one
                    o = o @ self.w[f"layers.{i}.o"].t()
                    h = h + (o if self.parallel is None else self.parallel.reduce(o))
                    with profiling.region("mlp"):
                        h = h + self._mlp(i, h, ffn_rows)
            return (
                self.ops.rms_norm(h.reshape(-1, H), self.w["final_norm"], c.rms_eps) @ self.w["lm_head"].t()
            )

    def _rope_table(self, cache, block_table) -> torch.Tensor:
        """The cos / sin table (dk.rope_table) covering every position this forward's cache can hold:
        its length, the pages of the block table times their size, or without cache tensors
        (training's whole sequences) the model's positions. Read from shapes only (no sync on the
        positions); built once and grown, to the next power of two, only when a larger cache shows
        up, in the forward that first sees it: eager, before any CUDA graph of it is captured
        (dinfer/graphs.py runs a chunk eagerly first)."""
        c, rows = self.config, cache.keys[0]
        need = c.max_positions if rows is None else rows.shape[1]
        if block_table is not None:
            need *= block_table.shape[1]
        if not self._rope_tables or self._rope_tables[-1].shape[0] < need:
            size = 1 << max(need - 1, 0).bit_length()
            self._rope_tables.append(dk.rope_table(c.rope_theta, c.rotary_dim, size, self.device))
        return self._rope_tables[-1]

    def _attention(
        self, i, h, positions, cache, seq_lens, write_back, attn_mask, block_mask, block_table, rope_table
    ):
        c, w = self.config, self.w
        p = f"layers.{i}."
        B, W, _ = h.shape
        a = self.ops.rms_norm(h, w[p + "attn_norm"], c.rms_eps)
        if p + "qkv" in w:  # LLaDA2's fused projection: Q heads, then K heads, then V heads
            qkv = (a @ w[p + "qkv"].t()).view(B, W, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
            q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=2)
        else:
            q = (a @ w[p + "q"].t()).view(B, W, c.num_heads, c.head_dim)
            k = (a @ w[p + "k"].t()).view(B, W, c.num_kv_heads, c.head_dim)
            v = (a @ w[p + "v"].t()).view(B, W, c.num_kv_heads, c.head_dim)
        norms = dict(q_norm=w[p + "q_norm"], k_norm=w[p + "k_norm"], eps=c.rms_eps) if c.qk_norm else {}
        q, k = self.ops.qk_rope(q, k, positions, rope_table, **norms)
        o = self.ops.attention(
            q,
            k,
            v,
            cache.keys[i],
            cache.values[i],
            positions,
            seq_lens,
            write_back=write_back,
            attn_mask=attn_mask,
            **({} if block_mask is None else {"block_mask": block_mask}),
            **({} if block_table is None else {"block_table": block_table}),
        )
        return o.reshape(B, W, c.num_heads * c.head_dim)  # the output projection is the caller's

    def _mlp(self, i, h, ffn_rows):
        c, w = self.config, self.w
        p = f"layers.{i}."
        B, W, H = h.shape
        m = self.ops.rms_norm(h, w[p + "mlp_norm"], c.rms_eps).reshape(B * W, H)
        if ffn_rows is not None:
            m = m.index_select(0, ffn_rows)
        if c.is_dense_layer(i):
            out = (F.silu(m @ w[p + "gate"].t()) * (m @ w[p + "up"].t())) @ w[p + "down"].t()
            if self.parallel is not None:
                out = self.parallel.reduce(out)
        elif self.parallel is not None:
            out = self.parallel.moe(m, w, p, c, self._routing)
        else:
            # LLaDA2's shared expert (every token, weight 1) runs inside the op, added to the routed
            # fp32 sum; FP8 expert weights come with their block scales
            extra = {k: w[p + k] for k in _MOE_EXTRAS if p + k in w}
            out = self.ops.moe(
                m,
                w[p + "router"],
                w[p + "w13"],
                w[p + "w2"],
                c.top_k,
                renormalize=c.router_renormalize,
                expert_bias=w.get(p + "expert_bias"),
                **self._routing,
                **extra,
            )
        if ffn_rows is not None:
            out = out.new_zeros(B * W, H).index_copy(0, ffn_rows, out)
        return out.view(B, W, H)
