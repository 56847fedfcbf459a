"""Random-weight models at the released shapes, for the benchmarks that time a real-shape forward or
generation without a checkpoint (bench_forward.py, bench_e2e.py --synthetic).

    model = build("llada-moe-7b", device="cuda")            # LLaDA-MoE-7B-A1B, every layer, bf16
    model = build("llada2-mini", device="cpu", layers=2)    # LLaDA2.0-mini cut to its first 2 layers
    model = build("llada-moe-7b", device="cpu", tiny=True)  # the same family, tiny (tests)

The config is the released config.json (dinfer.models.released) through ModelConfig.from_hf, so the
model is the one the loader would build: the same DiffusionLM class and canonical weight names
(dinfer.models.checkpoint.expected_shapes), the routers (and LLaDA2's expert bias) in fp32 as the
loader keeps them. Weights are drawn on the device, tensor by tensor, never on the host first
(LLaDA-MoE-7B is about 15 GB in bf16, LLaDA2.0-mini about 32.5 GB), from a seeded generator:
matrices N(0, 1/fan_in) so every projection keeps its input's scale (activations stay finite over all
layers), the embedding N(0, 1), norms 1, expert biases 0. Random routers spread the tokens about
evenly over the experts, so a forward touches about as many experts as a real one at high batch and
more than a trained model's skewed routing may at batch 1.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401  (puts the checkout's dinfer and dinfer_kernels on sys.path)
import torch

from dinfer.models import ModelConfig, expected_shapes
from dinfer.models.checkpoint import kept_fp32
from dinfer.models.released import LLADA2_MINI, MOE_7B
from dinfer.models.transformer import DiffusionLM

RELEASED = {"llada-moe-7b": MOE_7B, "llada2-mini": LLADA2_MINI}

# Tiny variants (tests, quick host runs): each family's structure (QK-norm, MHA or GQA, partial rope,
# dense first layer, grouped sigmoid routing, shared expert) at a few thousand parameters per layer.
_TINY_IDS = dict(vocab_size=256, mask_token_id=255, eos_token_id=254, pad_token_id=254)
TINY = {
    "llada-moe-7b": dict(
        _TINY_IDS,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        expert_intermediate_size=32,
        moe_layer_freq=[1, 1],
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "llada2-mini": dict(
        _TINY_IDS,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
    ),
}


def config(name: str, layers=None, tiny: bool = False) -> ModelConfig:
    """The ModelConfig of released model `name` (a key of RELEASED), its first `layers` layers only
    when given, shrunk to TINY[name] with tiny."""
    if name not in RELEASED:
        raise ValueError(f"model: expected one of {sorted(RELEASED)}, got {name!r}")
    d = dict(RELEASED[name], **(TINY[name] if tiny else {}))
    if layers is not None:
        if not 1 <= layers <= d["num_hidden_layers"]:
            raise ValueError(f"layers: expected 1..{d['num_hidden_layers']} for {name}, got {layers}")
        d["num_hidden_layers"] = layers
        if "moe_layer_freq" in d:
            d["moe_layer_freq"] = d["moe_layer_freq"][:layers]
    return ModelConfig.from_hf(d)


def random_weights_on(c: ModelConfig, device, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """Canonical name -> a random tensor made on `device` (see the module docstring for the scales)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(c).items():
        t = torch.empty(shape, dtype=torch.float32 if kept_fp32(c, name) else dtype, device=device)
        if name.endswith("norm"):
            t.fill_(1.0)
        elif name.endswith("expert_bias"):
            t.zero_()
        else:  # the embedding is a lookup (std 1); every other matrix maps its last dimension
            t.normal_(0.0, 1.0 if name == "embed" else shape[-1] ** -0.5, generator=gen)
        weights[name] = t
    return weights


def build(name: str, device="cpu", dtype=torch.bfloat16, layers=None, tiny: bool = False, seed: int = 0):
    """A DiffusionLM of released model `name` with random weights on `device` (config's arguments)."""
    c = config(name, layers, tiny)
    return DiffusionLM(c, random_weights_on(c, device, dtype, seed))
