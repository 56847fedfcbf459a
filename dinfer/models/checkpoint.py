"""Checkpoint I/O: released safetensors names <-> our canonical in-memory weight names.

Canonical names (the models use these; per-layer names carry a `layers.{i}.` prefix):
  embed [V,H], final_norm [H], lm_head [V,H]
  per layer: attn_norm [H], q [Hq*D,H], k [Hkv*D,H], v [Hkv*D,H], o [H,Hq*D], q_norm/k_norm [D] (QK-norm
  only), mlp_norm [H]; dense MLP: gate [I,H], up [I,H], down [H,I]; MoE: router [E,H] (fp32),
  w13 [E,2I,H] (per expert: gate rows, then up rows), w2 [E,H,I], expert_bias [E] (when enabled).

Released layouts (shared/reference/models.md): LLaDA dense §1.2, LLaDA-MoE per-expert §2.2 and dInfer's fused
stacked-expert layout §2.3. Loading parses safetensors over a private memory map, so a tensor that needs no
cast is a zero-copy view of the file and the model is never held twice in RAM.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch

from .config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# A source is (released tensor name, index into the canonical tensor it fills); () is the whole tensor.
Source = Tuple[str, tuple]


def expected_shapes(config: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Canonical name -> shape, in checkpoint order (embedding, layers, final norm, head)."""
    c = config
    H, D = c.hidden_size, c.head_dim
    shapes = {"embed": (c.vocab_size, H)}
    for i in range(c.num_layers):
        layer = {"attn_norm": (H,), "q": (c.num_heads * D, H), "k": (c.num_kv_heads * D, H),
                 "v": (c.num_kv_heads * D, H), "o": (H, c.num_heads * D)}
        if c.qk_norm:
            layer.update(q_norm=(D,), k_norm=(D,))
        layer["mlp_norm"] = (H,)
        if c.is_moe:
            E, I = c.num_experts, c.expert_intermediate_size
            layer.update(router=(E, H), w13=(E, 2 * I, H), w2=(E, H, I))
            if c.expert_bias:
                layer["expert_bias"] = (E,)
        else:
            I = c.intermediate_size
            layer.update(gate=(I, H), up=(I, H), down=(H, I))
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes.update(final_norm=(H,), lm_head=(c.vocab_size, H))
    return shapes


def _dense_plan(config: ModelConfig) -> Dict[str, List[Source]]:
    names = {"embed": "model.transformer.wte.weight", "final_norm": "model.transformer.ln_f.weight",
             "lm_head": "model.transformer.ff_out.weight"}
    per_layer = {"attn_norm": "attn_norm", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out",
                 "mlp_norm": "ff_norm", "gate": "ff_proj", "up": "up_proj", "down": "ff_out"}  # ff_proj is the gate
    for i in range(config.num_layers):
        names.update({f"layers.{i}.{ours}": f"model.transformer.blocks.{i}.{theirs}.weight"
                      for ours, theirs in per_layer.items()})
    return {ours: [(theirs, ())] for ours, theirs in names.items()}


def _moe_plan(config: ModelConfig, layout: str) -> Dict[str, List[Source]]:
    plan = {"embed": [("model.embed_tokens.weight", ())], "final_norm": [("model.norm.weight", ())],
            "lm_head": [("lm_head.weight", ())]}
    E, I = config.num_experts, config.expert_intermediate_size
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names = {"attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
                 "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
                 "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
                 "mlp_norm": "post_attention_layernorm.weight", "router": "mlp.gate.weight",
                 "expert_bias": "mlp.expert_bias"}
        plan.update({f"layers.{i}.{ours}": [(p + theirs, ())] for ours, theirs in names.items()})
        if layout == "fused":
            plan[f"layers.{i}.w13"] = [(p + "mlp.w1", ())]
            plan[f"layers.{i}.w2"] = [(p + "mlp.w2", ())]
        else:
            experts = [p + f"mlp.experts.{e}." for e in range(E)]
            plan[f"layers.{i}.w13"] = [src for e, x in enumerate(experts)
                                       for src in ((x + "gate_proj.weight", (e, slice(0, I))),
                                                   (x + "up_proj.weight", (e, slice(I, 2 * I))))]
            plan[f"layers.{i}.w2"] = [(x + "down_proj.weight", (e,)) for e, x in enumerate(experts)]
    return plan


def checkpoint_plan(config: ModelConfig, layout: str = "hf") -> Dict[str, List[Source]]:
    """Canonical name -> the released tensors that fill it, for the names this config has."""
    if layout not in ("hf", "fused"):
        raise ValueError(f"layout must be 'hf' or 'fused', got {layout!r}")
    if layout == "fused" and not config.is_moe:
        raise ValueError("the fused layout exists only for LLaDA-MoE checkpoints")
    plan = _moe_plan(config, layout) if config.is_moe else _dense_plan(config)
    return {name: plan[name] for name in expected_shapes(config)}


class _SafetensorsFile:
    """One safetensors file mapped privately (copy-on-write): views of it are writable without touching
    the file, and pages are shared with the page cache until written."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (header_len,) = struct.unpack("<Q", self._map[:8])
        if 8 + header_len > size:
            raise ValueError(f"{path}: header length {header_len} runs past the end of the {size}-byte file "
                             "(truncated or not a safetensors file)")
        try:
            header = json.loads(self._map[8:8 + header_len])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.entries = header
        self._data_start = 8 + header_len
        self._data_len = size - self._data_start

    def tensor(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, checked to have `shape`, as a view of the mapping where alignment allows."""
        dtype, got, begin, end = self._entry(name)
        where = f"tensor {name!r} in {self.path}"
        if dtype not in _DTYPES:
            raise ValueError(f"{where} has dtype {dtype}; supported: {', '.join(_DTYPES)}")
        if tuple(got) != tuple(shape):
            raise ValueError(f"{where} has shape {list(got)}, expected {list(shape)}")
        if not 0 <= begin <= end <= self._data_len:
            raise ValueError(f"{where}: data_offsets [{begin}, {end}] lie outside the {self._data_len} data "
                             "bytes (truncated or corrupt file)")
        torch_dtype = _DTYPES[dtype]
        itemsize = torch_dtype.itemsize
        if end - begin != math.prod(shape) * itemsize:
            raise ValueError(f"{where}: data_offsets span {end - begin} bytes but shape {list(got)} of {dtype} "
                             f"needs {math.prod(shape) * itemsize} (corrupt file)")
        offset = self._data_start + begin
        if offset % itemsize:  # the format does not promise alignment; copy rather than make a misaligned view
            return torch.frombuffer(bytearray(self._map[offset:offset + end - begin]), dtype=torch_dtype).view(shape)
        return torch.frombuffer(self._map, dtype=torch_dtype, count=math.prod(shape), offset=offset).view(shape)

    def _entry(self, name: str):
        entry = self.entries[name]
        try:
            (begin, end) = entry["data_offsets"]
            dtype, shape = entry["dtype"], entry["shape"]
            if not all(isinstance(x, int) for x in (begin, end, *shape)):
                raise TypeError("non-integer offset or dimension")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor {name!r} in {self.path}: corrupt header entry {entry!r}") from e
        return dtype, shape, begin, end


class _Checkpoint:
    """The tensors of a checkpoint directory: one model.safetensors, or shards listed by the index."""

    def __init__(self, path: str):
        self.path = path
        self._files: Dict[str, _SafetensorsFile] = {}
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            self.where = _read_index(index)
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            self.where = dict.fromkeys(self._file(SINGLE_FILE).entries, SINGLE_FILE)
        elif os.path.isdir(path):
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path!r}")
        else:
            raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")

    def tensor(self, name: str, shape: Tuple[int, ...]) -> torch.Tensor:
        file = self._file(self.where[name])
        if name not in file.entries:
            raise ValueError(f"{INDEX_FILE} places tensor {name!r} in {file.path}, which has no such tensor")
        return file.tensor(name, shape)

    def _file(self, shard: str) -> _SafetensorsFile:
        if shard not in self._files:
            file = os.path.join(self.path, shard)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"shard {file!r} (listed in {INDEX_FILE}) does not exist")
            self._files[shard] = _SafetensorsFile(file)
        return self._files[shard]


def _read_index(index: str) -> Dict[str, str]:
    with open(index, encoding="utf-8") as f:
        try:
            weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{index}: corrupt index ({e})") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no 'weight_map' object")
    return weight_map


def load_weights(path, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 device="cpu") -> Dict[str, torch.Tensor]:
    """Canonical name -> tensor for the checkpoint in directory `path` (either released layout).

    Everything is cast to `dtype` except the routers, which stay fp32 (as dInfer keeps its gate). A tensor
    already in the target dtype, loaded to the host, is a view of the memory-mapped file; any other is
    converted with one copy, and per-expert tensors are copied straight into a preallocated stacked tensor.
    """
    ckpt = _Checkpoint(os.fspath(path))
    # dInfer's fused layout is recognised by its tensor names, whatever config.json says.
    layout = "fused" if config.is_moe and "model.layers.0.mlp.w1" in ckpt.where else "hf"
    plan = checkpoint_plan(config, layout)
    missing = [src for sources in plan.values() for src, _ in sources if src not in ckpt.where]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint {ckpt.path!r} ({layout} layout) has no tensor {missing[0]!r}{more}")
    shapes = expected_shapes(config)
    return {name: _assemble(ckpt, sources, shapes[name], torch.float32 if name.endswith("router") else dtype,
                            device)
            for name, sources in plan.items()}


def _assemble(ckpt: _Checkpoint, sources: List[Source], shape: Tuple[int, ...], dtype: torch.dtype,
              device) -> torch.Tensor:
    if len(sources) == 1 and sources[0][1] == ():
        return ckpt.tensor(sources[0][0], shape).to(dtype=dtype, device=device)  # no-op when nothing changes
    out = torch.empty(shape, dtype=dtype, device=device)
    for name, index in sources:
        part = out[index]
        part.copy_(ckpt.tensor(name, tuple(part.shape)))
    return out


def save_checkpoint(path, config: ModelConfig, weights: Dict[str, torch.Tensor], layout: str = "hf",
                    shards: int = 1, dtype: Optional[torch.dtype] = None) -> None:
    """Write config.json and the weights under the released names of `layout` ("hf" splits w13/w2 into
    per-expert tensors; "fused" is dInfer's stacked layout), as one model.safetensors or as `shards` files
    plus model.safetensors.index.json. `dtype` casts every tensor (None keeps each tensor's own)."""
    from safetensors.torch import save_file

    tensors = _released_tensors(config, weights, layout, dtype)
    names = list(tensors)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be between 1 and {len(names)} (the number of tensors), got {shards}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_hf(layout), f, indent=2)
    if shards == 1:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for k in range(shards):  # consecutive, nearly equal groups of tensors, named like the release
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        group = names[k * len(names) // shards:(k + 1) * len(names) // shards]
        save_file({n: tensors[n] for n in group}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _released_tensors(config: ModelConfig, weights: Dict[str, torch.Tensor], layout: str,
                      dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    shapes = expected_shapes(config)
    out = {}
    for name, sources in checkpoint_plan(config, layout).items():
        if name not in weights:
            raise ValueError(f"weights have no tensor {name!r}")
        if tuple(weights[name].shape) != shapes[name]:
            raise ValueError(f"weight {name!r} has shape {list(weights[name].shape)}, expected {list(shapes[name])}")
        for released, index in sources:
            # Own storage per tensor: save_file refuses tensors that share memory (the w13/w2 slices).
            part = weights[name][index].to(device="cpu", dtype=dtype or weights[name].dtype, copy=True)
            out[released] = part.contiguous()
    return out


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """Canonical weights for tests: norms near 1, everything else N(0, 0.02²)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        noise = torch.randn(shape, generator=gen)
        weights[name] = (1 + 0.1 * noise if name.endswith("norm") else 0.02 * noise).to(dtype)
    return weights
