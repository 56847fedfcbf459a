"""Tiny LLaDA-MoE and LLaDA configs with random-weight models, a stand-in model whose logits favour
chosen tokens, and a one-call generate() that the engine tests share."""

import dataclasses

import torch
import torch.nn.functional as F

from dinfer.decoders import DecoderConfig
from dinfer.generate import GenerationConfig, generate
from dinfer.models.checkpoint import random_weights
from dinfer.models.config import ModelConfig
from dinfer.models.transformer import DiffusionLM

MOE = ModelConfig(
    family="llada_moe",
    hidden_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=12,
    vocab_size=61,
    intermediate_size=None,
    num_experts=8,
    top_k=2,
    expert_intermediate_size=40,
    qk_norm=True,
    rope_theta=10000.0,
    rotary_dim=12,
    rms_eps=1e-5,
    max_positions=256,
    mask_id=59,
    eos_id=60,
    pad_id=60,
    tie_embeddings=False,
    router_renormalize=False,
    expert_bias=False,
    architectures=("LLaDAMoEModelLM",),
)


DENSE = dataclasses.replace(
    MOE,
    family="llada",
    intermediate_size=72,
    num_experts=0,
    top_k=0,
    expert_intermediate_size=None,
    qk_norm=False,
    num_kv_heads=4,
    architectures=("LLaDAModelLM",),
)


def model_of(cfg, seed=0, scale=None):
    w = random_weights(cfg, seed=seed)
    if scale:  # sharper logits, so that thresholds are reached and several tokens commit per step
        w["lm_head"] = w["lm_head"] * scale
    return DiffusionLM(cfg, w)


def run(model, prompts, **kw):
    dec = kw.pop("decoder", DecoderConfig(threshold=0.5))
    cfg = GenerationConfig(**{"gen_length": 16, "block_length": 8, "cache": "none", **kw}, decoder=dec)
    out, stats = generate(model, prompts, cfg)
    return [o.tolist() for o in out], stats


class ScriptedModel:
    """A stand-in model whose logits favour a chosen token per position: drives the loop's
    early-stop and progress paths deterministically. Records the batch size and width of each forward."""

    def __init__(self, favourite):
        self.config = MOE
        self.device = torch.device("cpu")
        self.embedding = torch.zeros(MOE.vocab_size, MOE.hidden_size)
        self.favourite = favourite
        self.batch_sizes, self.widths = [], []

    def embed(self, tokens):
        return F.embedding(tokens, self.embedding)

    def new_cache(self, batch, max_len):
        return DiffusionLM(MOE, random_weights(MOE)).new_cache(batch, max_len)

    def forward(
        self, emb, pos, cache, seq_lens, write_back=True, logits_rows=None, block_mask=None, block_table=None
    ):
        assert block_mask is None and block_table is None, "the scripted model is bidirectional"
        self.batch_sizes.append(emb.shape[0])
        self.widths.append(emb.shape[1])
        flat = pos.flatten() if logits_rows is None else pos.flatten()[logits_rows]
        logits = torch.zeros(flat.numel(), MOE.vocab_size)
        logits[torch.arange(flat.numel()), self.favourite(flat)] = 10.0
        return logits
