"""FP8 expert weights: the fine-grained FP8 checkpoint format's config.json entry, and the
conversion behind `--quantize fp8`.

The format (Hugging Face's "fine-grained FP8", as released FP8 LLMs ship): config.json has
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"activation_scheme": "dynamic", "modules_to_not_convert": [...]}; each quantised `X.weight` is
float8_e4m3fn with `X.weight_scale_inv` (fp32 or bf16) [cdiv(out, 128), cdiv(in, 128)] beside it, and
its value is q * scale_inv per 128 x 128 block.

Our FP8 kernels (dinfer_kernels.moe) are for expert weights: the routed experts' w13 / w2 and the
shared expert's shared_w13 / shared_w2 stay FP8 in memory, each with its block scales under the
canonical name `<name>_scale` in dinfer_kernels.fp8's layout (a gate / up stack: the gate rows' blocks,
then the up rows'). Every other FP8 tensor of a checkpoint is dequantised to the model dtype at load.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

import dinfer_kernels as dk

from .config_keys import ConfigKeys

FP8 = "fp8"  # ModelConfig.quantization of an FP8 checkpoint; the --quantize choice
QUANTIZE_CHOICES = (FP8,)
SCALE = "_scale"  # canonical: layers.{i}.w13 -> layers.{i}.w13_scale
SCALE_INV = "_scale_inv"  # released: X.weight -> X.weight_scale_inv
# Expert weights -> how many row halves (gate, up) each has its own block grid.
EXPERT_HALVES = {"w13": 2, "w2": 1, "shared_w13": 2, "shared_w2": 1}
# The format's fields we implement (absent fields take these, Hugging Face's defaults).
_FORMAT = {"fmt": "e4m3", "weight_block_size": [dk.FP8_BLOCK, dk.FP8_BLOCK], "activation_scheme": "dynamic"}


def parse_quantization(d: ConfigKeys) -> Optional[str]:
    """FP8 for a config.json with the fine-grained FP8 quantization_config, None without one; any other
    quantization (method, format, block size, static activation scales) is refused naming the key."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise d.error(f"quantization_config={q!r} must be an object")
    method = q.get("quant_method")
    if method != FP8:
        raise d.error(
            f"quantization_config.quant_method={method!r} is not supported (only 'fp8', the "
            "fine-grained FP8 format)"
        )
    for key, value in _FORMAT.items():
        if q.get(key, value) != value:
            raise d.error(f"quantization_config.{key}={q.get(key)!r} is not supported (only {value!r})")
    skipped = q.get("modules_to_not_convert")
    if skipped is not None and not (isinstance(skipped, list) and all(isinstance(m, str) for m in skipped)):
        raise d.error(f"quantization_config.modules_to_not_convert={skipped!r} must be a list of names")
    return FP8


def quantization_config(unconverted) -> dict:
    """config.json's quantization_config of an FP8 checkpoint whose modules `unconverted` stay as they are."""
    return {"quant_method": FP8, **_FORMAT, "modules_to_not_convert": sorted(unconverted)}


def check_quantize(quantize: Optional[str], config) -> None:
    """ValueError naming `quantize` unless it is None or a choice this model can take (experts to convert)."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize: expected one of {', '.join(QUANTIZE_CHOICES)} or None, got {quantize!r}")
    if not config.is_moe or config.first_k_dense >= config.num_layers:
        raise ValueError(
            f"quantize: {quantize!r} converts expert weights, and this {config.family_spec.title} model "
            "has no expert weights to quantise"
        )


def halves(name: str) -> int:
    """The row halves of canonical expert weight `name` (layers.{i}.w13: 2)."""
    return EXPERT_HALVES[name.rsplit(".", 1)[-1]]


def is_expert_weight(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in EXPERT_HALVES


def scale_shape(shape: Tuple[int, ...], n_halves: int) -> Tuple[int, ...]:
    """The block scales' shape of a weight [..., N, K] whose N rows are `n_halves` halves."""
    *lead, rows, cols = shape
    return (*lead, *dk.fp8.fp8_scale_shape(rows, cols, n_halves))


def scale_index(index: tuple, half: int) -> tuple:
    """The index into a scale tensor of a weight's index: integers (an expert) stay; a slice is one
    half (gate or up rows, `half` rows long) of a gate / up stack, so its block rows."""
    (n, _) = dk.fp8.fp8_scale_shape(half, 1)
    return tuple(
        i if isinstance(i, int) else slice(i.start // half * n, (i.start // half + 1) * n) for i in index
    )


def quantize_experts(
    weights: Dict[str, torch.Tensor], config, shared: bool = True
) -> Dict[str, torch.Tensor]:
    """`weights` with every expert weight not FP8 yet (the routed experts', and the shared expert's
    when `shared`) converted by dinfer_kernels.fp8_block_quantize, its scales added as `<name>_scale`.
    A new dict; the other tensors are the same objects."""
    check_quantize(FP8, config)
    out = dict(weights)
    for name, t in weights.items():
        if not is_expert_weight(name) or t.dtype == torch.float8_e4m3fn:
            continue
        if name.rsplit(".", 1)[-1].startswith("shared") and not shared:
            continue
        out[name], out[name + SCALE] = dk.fp8_block_quantize(t, halves=halves(name))
    return out
