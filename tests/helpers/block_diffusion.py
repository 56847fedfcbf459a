"""A tiny LLaDA2 (block diffusion) model whose answers vary with their context, the decoders run on it,
and the ops' float64 references that hold a cache to the truth: shared by the block-diffusion,
parallel and serving-engine tests."""

import dataclasses

import torch

from dinfer.decoders import JOINT_SPEED, DecoderConfig
from dinfer.models.checkpoint import random_weights
from dinfer.models.transformer import DiffusionLM
from dinfer_kernels.reference.attention import attention_reference
from dinfer_kernels.reference.moe import moe_reference
from dinfer_kernels.reference.qk_rope import qk_rope_reference
from dinfer_kernels.reference.rms_norm import rms_norm_reference
from helpers.hf_configs import tiny

BL = 4


MIXING = ("qkv", "o", "gate", "up", "down", "w13", "w2", "shared_w13", "shared_w2", "router")


def llada2_model(seed=0):
    cfg = dataclasses.replace(tiny("llada2"), block_length=BL)
    w = random_weights(cfg, seed=seed)
    for name in w:  # ~1/sqrt(fan-in) weights: rows depend on their context, so answers vary
        if name.split(".")[-1] in MIXING:
            w[name] = w[name] * 10
    w["lm_head"] = w["lm_head"] * 3  # confident enough that thresholds commit several tokens
    return DiffusionLM(cfg, w)


class Float64Ops:
    """The ops' references computing in float64 (the kernels take no fp64): a truth to hold the
    cache to."""

    f64 = dict(compute_dtype=torch.float64)
    rms_norm = staticmethod(lambda x, w, eps: rms_norm_reference(x, w, eps, **Float64Ops.f64))
    qk_rope = staticmethod(lambda *a, **kw: qk_rope_reference(*a, **kw, **Float64Ops.f64))
    attention = staticmethod(lambda *a, **kw: attention_reference(*a, **kw, **Float64Ops.f64))
    moe = staticmethod(lambda *a, **kw: moe_reference(*a, **kw, **Float64Ops.f64))


DECODERS = {
    "threshold": DecoderConfig(threshold=0.5),
    "fixed": DecoderConfig(name="fixed", steps_per_block=2),
    "hierarchical": DecoderConfig(name="hierarchical", threshold=0.7, low_threshold=0.4),
    "joint": DecoderConfig(
        name="joint", threshold=0.5, edit_threshold=0.02, max_post_edit_steps=3
    ),  # edits on this model
    "joint-speed": dataclasses.replace(JOINT_SPEED),
}
