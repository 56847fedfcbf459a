"""The embedded models: architecture, training schedule and generation defaults.

Each trains on a 2-core CPU in under 45 minutes on one thread (docs/training.md) and ships in the
package (bf16 weights, < 20 MB each): tiny-llada-moe (the default model; LLaDA-MoE: QK-norm, 8
experts, top-2, no renormalisation), tiny-llada (the dense LLaDA block: SwiGLU MLP, no QK-norm), both
trained with LLaDA's objective over bidirectional attention, and tiny-llada2 (LLaDA2-MoE: fused QKV
with GQA, QK-norm, partial RoPE, a dense first layer, sigmoid group-limited routing with an expert
bias, a shared expert), trained with the block-diffusion objective (dinfer/train/block.py) under the
block-causal attention it decodes with.
"""

from dataclasses import dataclass
from typing import Tuple

from ..models import llada, llada2, llada_moe
from ..models.config import ModelConfig
from .curriculum import RECALL_CURRICULUM, RecallCurriculum
from .tokenizer import EOS, MASK, special_ids, vocab_size

DEFAULT_MODEL = "tiny-llada-moe"
# Generation defaults written to generation_config.json: the canvas covers every task's answer and
# is decoded in 4 blocks.
GEN_LENGTH, BLOCK_LENGTH = 32, 8
# How often each task is drawn, relative to the others, once the curriculum's recall-only steps are
# over. Sort (ranks with repeats) and add learn slowest of the tasks, so they get more. Chain gets a
# double share, not for vanilla decoding (100% at 1/7.75 of the batch) but so that its late digits are
# right when several are committed from one forward: at 1/7.75, 8% of chains went wrong that way; at
# 2/8.75, none of 100 (docs/notes/results-log.md, 2026-12-02). Recall's lookup forms in the recall-only steps; at a
# double share after them add and sort fell below the bar (docs/training.md, 2026-12-02).
TASK_WEIGHTS = (("add", 2.0), ("sort", 2.5), ("reverse", 1.25), ("recall", 1.0), ("chain", 2.0))


def _reweighted(**shares: float) -> Tuple[Tuple[str, float], ...]:
    """TASK_WEIGHTS with the named tasks' shares replaced (a preset that differs only there)."""
    unknown = set(shares) - {task for task, _ in TASK_WEIGHTS}
    if unknown:
        raise ValueError(f"task_weights: unknown task {sorted(unknown)[0]!r}")
    return tuple((task, shares.get(task, weight)) for task, weight in TASK_WEIGHTS)


@dataclass(frozen=True)
class TrainPreset:
    config: ModelConfig
    steps: int  # sized to < 45 minutes on the 2-core CI box
    batch_size: int = 64
    lr: float = 1e-3  # 2e-3 and up delay, or stop, the heads that read the prompt
    warmup: int = 100
    weight_decay: float = 0.01
    max_canvas: int = GEN_LENGTH + 2  # training canvases are answer + EOS fill, up to this long
    fill_ramp: float = 0.3  # fraction of the run over which the EOS fill grows to max_canvas
    soft_fraction: float = 0.25  # batches that also train on iteration-smoothing inputs
    task_weights: Tuple[Tuple[str, float], ...] = TASK_WEIGHTS
    recall_curriculum: RecallCurriculum = RECALL_CURRICULUM
    # > 0: the block-diffusion objective (block.py) in blocks of this length on the grid from
    # position 0, the block length the model then decodes with (its generation_config.json); 0:
    # LLaDA's objective over bidirectional attention.
    block_length: int = 0
    # Aux-loss-free balancing of the expert bias (models with one): after each step every MoE layer's
    # bias moves by this much towards balanced expert load (bias_e += u * sign(mean load - load_e)).
    expert_bias_update: float = 0.0
    # > 0 (block-diffusion presets): LLaDA2.1's token-to-token objective (block.corrupt_blocks), each
    # noisy block's visible tokens corrupted at p ~ U(0, edit_fraction) and the loss on all of them.
    edit_fraction: float = 0.0


def _config(family: str, **kw) -> ModelConfig:
    ids = special_ids()
    hidden, heads = 256, 8
    fields = dict(
        hidden_size=hidden,
        num_layers=4,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        vocab_size=vocab_size(),
        rope_theta=10000.0,
        rotary_dim=hidden // heads,
        rms_eps=1e-5,
        max_positions=256,
        mask_id=ids[MASK],
        eos_id=ids[EOS],
        pad_id=ids[EOS],
        tie_embeddings=False,
        router_renormalize=False,
        expert_bias=False,
    )
    fields.update(kw)
    return ModelConfig(family=family, **fields)


PRESETS = {
    "tiny-llada-moe": TrainPreset(
        _config(
            llada_moe.NAME,
            intermediate_size=None,
            num_experts=8,
            top_k=2,
            expert_intermediate_size=256,
            qk_norm=True,
            architectures=(llada_moe.ARCH,),
        ),
        steps=3400,
    ),
    "tiny-llada": TrainPreset(
        _config(
            llada.NAME,
            intermediate_size=768,
            num_experts=0,
            top_k=0,
            expert_intermediate_size=None,
            qk_norm=False,
            architectures=(llada.ARCH,),
        ),
        steps=4200,
        # The dense model's sort needs the most (68% exact at a double share); it only serves the
        # quality bar, not the parallel-decoding benchmark, so chain gives add a quarter share.
        task_weights=_reweighted(add=1.25, sort=3.0, reverse=1.0, chain=0.75),
    ),
    "tiny-llada2": TrainPreset(
        _config(
            llada2.NAME,
            num_kv_heads=2,  # GQA: 4 query heads per KV head, as the release's 16 / 4
            rotary_dim=16,  # partial RoPE on half of each head, as the release's 64 of 128
            rms_eps=1e-6,
            intermediate_size=768,  # layer 0's dense MLP
            first_k_dense=1,
            num_experts=8,
            top_k=2,
            expert_intermediate_size=256,
            shared_intermediate_size=256,  # one shared expert of the experts' width
            qk_norm=True,
            router_renormalize=True,  # the released code renormalises whenever top_k > 1
            expert_bias=True,
            router_scoring="sigmoid",
            num_groups=4,
            topk_groups=2,
            routed_scaling=2.5,
            # what loading the checkpoint gives (config.json has no block length); the model decodes
            # with the preset's block_length, which its generation_config.json sets
            block_length=llada2.BLOCK_LENGTH,
            architectures=(llada2.ARCH,),
        ),
        steps=2400,
        block_length=llada2.BLOCK_LENGTH,
        expert_bias_update=1e-3,
        # up to a quarter of a block's visible tokens wrong (12.5% on average): more than a decoder's
        # commits at thresholds >= 0.5 get wrong, so edits are learned for the cases they meet
        edit_fraction=0.25,
    ),
}
