"""Checkpoint I/O: released safetensors names <-> our canonical in-memory weight names.

Canonical names (the models use these; per-layer names carry a `layers.{i}.` prefix):
  embed [V,H], final_norm [H], lm_head [V,H]
  per layer: attn_norm [H], q [Hq*D,H], k [Hkv*D,H], v [Hkv*D,H], o [H,Hq*D], q_norm/k_norm [D] (QK-norm
  only), mlp_norm [H]; dense MLP: gate [I,H], up [I,H], down [H,I]; MoE: router [E,H] (fp32),
  w13 [E,2I,H] (per expert: gate rows, then up rows), w2 [E,H,I], expert_bias [E] (when enabled).
  LLaDA2: qkv [(Hq+2Hkv)*D,H] (Q heads, then K, then V: its fused projection) instead of q/k/v; dense
  MLP layers below first_k_dense; MoE layers add the shared expert shared_w13 [2S,H], shared_w2 [H,S].

Released layouts (as the checkpoints ship): LLaDA dense, LLaDA-MoE and LLaDA2 per-expert, and dInfer's
fused stacked-expert layouts of both MoE families; each family's module (llada.py, llada_moe.py,
llada2.py) names its tensors (Family.plan), this one reads and checks them. Loading parses safetensors over a private memory map, so a tensor that needs no
cast is a zero-copy view of the file and the model is never held twice in RAM. Before any tensor is used
the checkpoint is checked against the config from the headers alone (load_weights), so a config that
disagrees with the weights, or a broken file, is a CheckpointError naming the file, the key and both values.
"""

from __future__ import annotations

import json
import math
import mmap
import operator
import os
import re
import struct
from typing import Dict, List, Optional, Set, Tuple

import torch
from safetensors import SafetensorError, safe_open

import dinfer_kernels as dk

from .config import CONFIG_FILE, CheckpointError, ModelConfig
from .families import FAMILIES
from .family import EXPERTS, LAYOUTS, Plan, Source
from .quantization import (
    FP8,
    SCALE,
    SCALE_INV,
    halves,
    is_expert_weight,
    quantization_config,
    scale_index,
    scale_shape,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
FP8_DTYPE = "F8_E4M3"  # FP8 checkpoints' quantised weights (dinfer.models.quantization)
_STORED = {**_DTYPES, FP8_DTYPE: torch.float8_e4m3fn}  # what the parser reads


def _symbolic_shapes(config: ModelConfig) -> Dict[str, Tuple[str, ...]]:
    """Canonical name -> its shape as size symbols (see _dim_sizes), in checkpoint order (embedding,
    layers, final norm, head)."""
    c = config
    shapes = {"embed": ("V", "H")}
    for i in range(c.num_layers):
        layer = {"attn_norm": ("H",)}
        if c.family_spec.fused_qkv:
            layer["qkv"] = ("QKV", "H")
        else:
            layer.update(q=("Q", "H"), k=("KV", "H"), v=("KV", "H"))
        layer["o"] = ("H", "Q")
        if c.qk_norm:
            layer.update(q_norm=("D",), k_norm=("D",))
        layer["mlp_norm"] = ("H",)
        if c.is_dense_layer(i):
            layer.update(gate=("DI", "H"), up=("DI", "H"), down=("H", "DI"))
        else:
            layer.update(router=("E", "H"), w13=("E", "2I", "H"), w2=("E", "H", "I"))
            if c.expert_bias:
                layer["expert_bias"] = ("E",)
            if c.shared_intermediate_size:
                layer.update(shared_w13=("2S", "H"), shared_w2=("H", "S"))
        shapes.update({f"layers.{i}.{name}": dims for name, dims in layer.items()})
    shapes.update(final_norm=("H",), lm_head=("V", "H"))
    return shapes


def _dim_sizes(config: ModelConfig) -> Dict[str, Tuple[int, str]]:
    """Size symbol -> (size, the config.json keys that set it), so a shape mismatch names the key."""
    c, key = config, config.hf_key
    width, dense_width, shared = c.expert_intermediate_size, c.intermediate_size, c.shared_intermediate_size
    head_dim = key("head_dim")
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return {
        "V": (c.vocab_size, key("vocab_size")),
        "H": (c.hidden_size, key("hidden_size")),
        "Q": (c.num_heads * c.head_dim, f"{key('num_heads')} x {head_dim}"),
        "KV": (c.num_kv_heads * c.head_dim, f"{key('num_kv_heads')} x {head_dim}"),
        "QKV": (qkv, f"({key('num_heads')} + 2 x {key('num_kv_heads')}) x {head_dim}"),
        "D": (c.head_dim, head_dim),
        "DI": (dense_width, key("intermediate_size")),
        "I": (width, key("expert_intermediate_size")),
        "2I": (2 * (width or 0), f"2 x {key('expert_intermediate_size')}"),
        "S": (shared, key("shared_intermediate_size")),
        "2S": (2 * shared, f"2 x {key('shared_intermediate_size')}"),
        "E": (c.num_experts, key("num_experts")),
    }


def expected_shapes(config: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Canonical name -> shape, in checkpoint order (embedding, layers, final norm, head)."""
    sizes = _dim_sizes(config)
    return {name: tuple(sizes[d][0] for d in dims) for name, dims in _symbolic_shapes(config).items()}


def checkpoint_plan(config: ModelConfig, layout: str = "hf") -> Plan:
    """Canonical name -> the released tensors that fill it, for the names this config has."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'hf' or 'fused', got {layout!r}")
    if layout not in config.family_spec.layouts:
        raise ValueError("the fused layout exists only for MoE checkpoints")
    plan = config.family_spec.plan(config, layout)
    return {name: plan[name] for name in expected_shapes(config)}


class _SafetensorsFile:
    """One safetensors file mapped privately (copy-on-write): views of it are writable without touching
    the file, and pages are shared with the page cache until written. Opening reads and checks the
    header only (every entry's dtype, shape and offsets; then the safetensors library's own validation,
    which also catches overlapping or uncovered data), never the tensors' data."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (header_len,) = struct.unpack("<Q", self._map[:8])
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: header length {header_len} runs past the end of the {size}-byte "
                "file (truncated or not a safetensors file)"
            )
        try:
            header = json.loads(self._map[8 : 8 + header_len])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._data_len = size - self._data_start
        self.entries = {name: self._parse_entry(name, entry) for name, entry in header.items()}
        try:  # the reference reader's checks on top of ours (header only: it maps, it does not read)
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a valid safetensors file (safetensors: {e})") from e

    def _parse_entry(self, name: str, entry) -> Tuple[str, Tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of a header entry, its offsets inside the data and consistent
        with shape x dtype where we know the dtype's size."""
        where = f"tensor {name!r} in {self.path}"
        try:  # operator.index: a TypeError for anything but an integer (strings, floats, null)
            begin, end = map(operator.index, entry["data_offsets"])
            dtype, shape = entry["dtype"], tuple(map(operator.index, entry["shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: corrupt header entry {entry!r}") from e
        if not 0 <= begin <= end <= self._data_len:
            raise CheckpointError(
                f"{where}: data_offsets [{begin}, {end}] lie outside the {self._data_len} data "
                "bytes (truncated or corrupt file)"
            )
        if dtype in _STORED and end - begin != math.prod(shape) * _STORED[dtype].itemsize:
            raise CheckpointError(
                f"{where}: data_offsets span {end - begin} bytes but shape {list(shape)} of "
                f"{dtype} needs {math.prod(shape) * _STORED[dtype].itemsize} (corrupt file)"
            )
        return dtype, shape, begin, end

    def check(
        self, name: str, shape: Tuple[int, ...], sizes: Tuple[Tuple[int, str], ...], fp8: bool = False
    ) -> None:
        """A CheckpointError unless tensor `name` has a dtype we load (FP8 too when `fp8`) and `shape`,
        whose dimensions `sizes` sets as (size, config.json key); a wrong size names the key."""
        dtype, got, _, _ = self.entries[name]
        where = f"tensor {name!r} in {self.path}"
        if dtype not in _DTYPES and not (fp8 and dtype == FP8_DTYPE):
            raise CheckpointError(f"{where} has dtype {dtype}; supported: {', '.join(_DTYPES)}")
        if got == tuple(shape):
            return
        wrong = [(want, key) for (want, key), have in zip(sizes, got) if want != have]
        if len(got) != len(shape) or not wrong:
            raise CheckpointError(f"{where} has shape {list(got)}, expected {list(shape)}")
        want, key = wrong[0]
        raise CheckpointError(
            f"{CONFIG_FILE}: {key} is {want} but {where} has shape {list(got)}, expected {list(shape)}"
        )

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` (checked), as a view of the mapping where alignment allows."""
        dtype, shape, begin, end = self.entries[name]
        torch_dtype = _STORED[dtype]
        offset = self._data_start + begin
        if (
            offset % torch_dtype.itemsize
        ):  # the format does not promise alignment; copy, not a misaligned view
            return torch.frombuffer(
                bytearray(self._map[offset : offset + end - begin]), dtype=torch_dtype
            ).view(shape)
        return torch.frombuffer(self._map, dtype=torch_dtype, count=math.prod(shape), offset=offset).view(
            shape
        )


class _Checkpoint:
    """The tensors of a checkpoint directory: one model.safetensors, or shards listed by the index. Every
    file's header is read (and checked) up front: a missing shard or a broken header fails before any
    weight is used."""

    def __init__(self, path: str):
        self.path = path
        self._files: Dict[str, _SafetensorsFile] = {}
        self.fp8: Set[str] = set()  # the tensors stored in FP8, each with its block scales (open_checked)
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            self.where = _read_index(index)
            self.source = f"the shards of {index}"
            for shard in dict.fromkeys(self.where.values()):
                file = self._open(shard, f"listed in {INDEX_FILE}")
                for name in file.entries:  # a shard's tensors are all loaded by HF, listed or not
                    self.where.setdefault(name, shard)
            for name, shard in self.where.items():
                if name not in self._files[shard].entries:
                    raise CheckpointError(
                        f"{index} places tensor {name!r} in {self._files[shard].path}, which "
                        "has no such tensor"
                    )
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            self.where = dict.fromkeys(self._open(SINGLE_FILE, "").entries, SINGLE_FILE)
            self.source = os.path.join(path, SINGLE_FILE)
        elif os.path.isdir(path):
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path!r}")
        else:
            raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")

    def file(self, name: str) -> _SafetensorsFile:
        return self._files[self.where[name]]

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` as stored (a view of the file where it can be); an FP8 one read for any other
        dtype is dequantised to it (dinfer_kernels.fp8_block_dequantize: q * its block's scale)."""
        t = self.file(name).tensor(name)
        if name in self.fp8 and dtype != torch.float8_e4m3fn:
            scale = self.file(name + SCALE_INV).tensor(name + SCALE_INV).float()
            return dk.fp8_block_dequantize(t, scale, dtype)
        return t

    def _open(self, shard: str, listed: str) -> _SafetensorsFile:
        file = os.path.join(self.path, shard)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"shard {file!r} ({listed}) does not exist")
        self._files[shard] = _SafetensorsFile(file)
        return self._files[shard]


def _read_index(index: str) -> Dict[str, str]:
    with open(index, encoding="utf-8") as f:
        try:
            weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index}: corrupt index ({e})") from e
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no 'weight_map' object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard:
            raise CheckpointError(
                f"{index}: weight_map[{name!r}] = {shard!r} is not a file name in the folder"
            )
    return weight_map


# Buffers some exports save that are recomputed from config.json (RoPE frequencies from rope_theta).
_DERIVED = (".rotary_emb.inv_freq",)


def load_weights(
    path, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device="cpu"
) -> Dict[str, torch.Tensor]:
    """Canonical name -> tensor for the checkpoint in directory `path` (either released layout).

    The checkpoint is first checked against `config` from the headers alone: the layer and expert
    counts, the optional tensors (QK-norm, expert bias), every tensor's dtype and shape (a wrong size
    names the config.json key), and every tensor consumed; a CheckpointError names the file, the key
    or tensor and both values. Everything is cast to `dtype` except the routers (and LLaDA2's expert
    bias), which stay fp32 (as dInfer keeps its gate). A tensor already in the target dtype, loaded to the host, is a view of the
    memory-mapped file; any other is converted with one copy, and per-expert tensors are copied straight
    into a preallocated stacked tensor. Values are not inspected (NaN weights load).
    An FP8 checkpoint's expert weights stay FP8 with their block scales, its other FP8 tensors are
    dequantised (tensor_plan).
    """
    ckpt, plan = open_checked(path, config)
    return {
        name: _assemble(ckpt, sources, shape, to, device)
        for name, (sources, shape, to) in tensor_plan(ckpt, config, plan, dtype).items()
    }


def tensor_plan(
    ckpt: "_Checkpoint", config: ModelConfig, plan: Plan, dtype: torch.dtype, fp8_shared: bool = True
) -> Dict[str, Tuple[List[Source], Tuple[int, ...], torch.dtype]]:
    """Canonical name -> (sources, shape, dtype) of every tensor a load makes: each of `plan`'s in
    `dtype` (kept_fp32's in fp32), except the expert weights of an MoE layer whose experts the
    checkpoint stores wholly in FP8 (routed and shared alike: the moe op takes both in one dtype; with
    fp8_shared False the routed ones alone, the shared expert dequantised): those stay FP8 and add
    their block scales `<name>_scale` (fp32, dinfer_kernels.fp8's layout) from the `_scale_inv` ones."""
    shapes = expected_shapes(config)
    stacks: Dict[str, List[str]] = {}  # a layer's prefix -> its expert weights kept in FP8 if all are
    for name in plan:
        if is_expert_weight(name) and (fp8_shared or not name.rsplit(".", 1)[-1].startswith("shared")):
            stacks.setdefault(name.rsplit(".", 1)[0], []).append(name)
    kept = {
        name
        for names in stacks.values()
        if all(src in ckpt.fp8 for name in names for src, _ in plan[name])
        for name in names
    }
    out = {}
    for name, sources in plan.items():
        if name not in kept:
            out[name] = (sources, shapes[name], torch.float32 if kept_fp32(config, name) else dtype)
            continue
        n, half = halves(name), shapes[name][-2] // halves(name)
        out[name] = (sources, shapes[name], torch.float8_e4m3fn)
        scales = [(src + SCALE_INV, scale_index(index, half)) for src, index in sources]
        out[name + SCALE] = (scales, scale_shape(shapes[name], n), torch.float32)
    return out


def open_checked(path, config: ModelConfig):
    """(the checkpoint in directory `path`, its plan: canonical name -> sources), checked against
    `config` from the headers alone (load_weights' checks; no tensor data is read)."""
    ckpt = _Checkpoint(os.fspath(path))
    layout = _layout(ckpt, config)
    plan = checkpoint_plan(config, layout)
    scales = _fp8_tensors(ckpt, config, layout, plan)
    _check_structure(ckpt, config, layout, plan, scales)
    symbols, sizes = _symbolic_shapes(config), _dim_sizes(config)
    for name, sources in plan.items():
        dims = _source_dims(symbols[name], sources[0][1])  # every part of a stacked tensor has one shape
        shape, dim_sizes = tuple(sizes[d][0] for d in dims), tuple(sizes[d] for d in dims)
        for src, _ in sources:
            ckpt.file(src).check(src, shape, dim_sizes, fp8=config.quantization == FP8)
    for src in ckpt.fp8:
        _check_scales(ckpt, src)
    return ckpt, plan


def _fp8_tensors(ckpt: "_Checkpoint", config: ModelConfig, layout: str, plan: Plan) -> Set[str]:
    """Finds the planned tensors stored in FP8 (ckpt.fp8) and returns their scales' names; a
    CheckpointError for FP8 tensors config.json does not announce, in the fused layout, or without
    their scales, and for scales of a tensor that is not FP8."""
    for sources in plan.values():
        for src, _ in sources:
            if src not in ckpt.where or ckpt.file(src).entries[src][0] != FP8_DTYPE:
                continue
            where = f"tensor {src!r} in {ckpt.file(src).path}"
            if config.quantization != FP8:
                raise CheckpointError(
                    f"{where} is FP8 ({FP8_DTYPE}) but {CONFIG_FILE} has no quantization_config "
                    "(an FP8 checkpoint's config names its format: quant_method 'fp8')"
                )
            if layout != "hf":
                raise CheckpointError(
                    f"{where} is FP8 in dInfer's fused layout, which has no FP8 format (FP8 checkpoints "
                    "ship per-expert tensors)"
                )
            if src + SCALE_INV not in ckpt.where:
                raise CheckpointError(
                    f"{where} is FP8 but the checkpoint has no {src + SCALE_INV!r} (its block scales)"
                )
            ckpt.fp8.add(src)
    for name in ckpt.where:
        weight = name[: -len(SCALE_INV)]
        stored = ckpt.file(weight).entries[weight][0] if weight in ckpt.where else None
        if name.endswith(SCALE_INV) and stored not in (None, FP8_DTYPE):
            raise CheckpointError(
                f"{ckpt.file(name).path}: {name!r} holds block scales but {weight!r} is not FP8 "
                f"(dtype {ckpt.file(weight).entries[weight][0]})"
            )
    return {src + SCALE_INV for src in ckpt.fp8}


def _check_scales(ckpt: "_Checkpoint", src: str) -> None:
    """A CheckpointError unless FP8 tensor `src` has fp32 / bf16 scales, one per 128 x 128 block."""
    name = src + SCALE_INV
    shape = ckpt.file(src).entries[src][1]
    dtype, got, _, _ = ckpt.file(name).entries[name]
    where = f"tensor {name!r} in {ckpt.file(name).path}"
    if dtype not in ("F32", "BF16"):
        raise CheckpointError(f"{where} has dtype {dtype}; block scales are F32 or BF16")
    want = scale_shape(shape, 1)
    if len(shape) != 2 or got != want:
        raise CheckpointError(
            f"{where} has shape {list(got)}, expected {list(want)}: one scale per {dk.FP8_BLOCK} x "
            f"{dk.FP8_BLOCK} block of {src!r} {list(shape)}"
        )


def _layout(ckpt: _Checkpoint, config: ModelConfig) -> str:
    """dInfer's fused layout, recognised by its tensor names (the first MoE layer's stacked w13)
    whatever config.json says, or the released one."""
    i = config.first_k_dense
    if "fused" not in config.family_spec.layouts or i >= config.num_layers:
        return "hf"
    ((stacked, _),) = config.family_spec.plan(config, "fused")[f"layers.{i}.w13"]
    return "fused" if stacked in ckpt.where else "hf"


def kept_fp32(config: ModelConfig, name: str) -> bool:
    """Whether canonical tensor `name` loads in fp32 whatever the dtype (its family's fp32_tensors: the
    routers, as dInfer keeps its gate, and LLaDA2's expert bias)."""
    return name.endswith(config.family_spec.fp32_tensors)


def _check_structure(
    ckpt: _Checkpoint, config: ModelConfig, layout: str, plan: Plan, scales: Set[str]
) -> None:
    """The checkpoint's tensor names against config: family, layer and expert counts, optional
    tensors, then every planned tensor present and every present tensor planned (or the `scales`
    of FP8 ones)."""
    names, key, spec = set(ckpt.where), config.hf_key, config.family_spec
    if not any(n.startswith(spec.tensor_root) for n in names):
        for other in FAMILIES.values():  # the first family whose tensors these are, by their root
            theirs = [n for n in names if n.startswith(other.tensor_root)]
            if other.tensor_root != spec.tensor_root and theirs:
                raise CheckpointError(
                    f"{CONFIG_FILE}: architectures {list(config.architectures)} describe a "
                    f"{config.family} model but {ckpt.source} holds {other.name} tensors such as {min(theirs)!r}"
                )
    layer = re.escape(spec.layer_prefix)
    counts = [(key("num_layers"), config.num_layers, "layers", re.compile(layer + r"(\d+)\."))]
    if config.is_moe and layout == "hf" and config.first_k_dense < config.num_layers:
        expert = re.compile(layer + r"\d+\." + re.escape(EXPERTS) + r"(\d+)\.")
        counts.append((key("num_experts"), config.num_experts, "experts", expert))
    for config_key, want, what, pattern in counts:
        found = {int(m.group(1)) for m in map(pattern.match, names) if m}
        if not found or max(found) + 1 != want:
            held = f"{what} 0..{max(found)}" if found else f"no {what}"
            raise CheckpointError(f"{CONFIG_FILE}: {config_key} is {want} but {ckpt.source} holds {held}")
    wanted = {src for sources in plan.values() for src, _ in sources}
    optional = spec.optional_tensors(config)  # a tensor a flag adds says which flag is wrong
    every = spec.plan(config, layout) if optional else {}  # the names of the tensors the config lacks too
    for name, field in optional:
        ((src, _),) = every[name]
        if (src in names) != (name in plan):
            state = f"true but {ckpt.source} has no" if name in plan else f"false but {ckpt.source} holds"
            raise CheckpointError(f"{CONFIG_FILE}: {key(field)} is {state} tensor {src!r}")
    missing = sorted(wanted - names, key=lambda n: [int(t) if t.isdigit() else t for t in n.split(".")])
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{ckpt.source} ({layout} layout) has no tensor {missing[0]!r}{more}")
    extra = sorted(n for n in names - wanted - scales if not n.endswith(_DERIVED))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{ckpt.file(extra[0]).path}: unexpected tensor {extra[0]!r}{more}: not part of the "
            f"{config.family} model {CONFIG_FILE} describes ({layout} layout)"
        )


def _source_dims(dims: Tuple[str, ...], index: tuple) -> Tuple[str, ...]:
    """The size symbols of canonical[index]: an integer drops its dimension; the only slice taken is
    one half (gate or up rows) of a 2I or 2S dimension (w13, shared_w13)."""
    half = {"2I": "I", "2S": "S"}
    out = [None if isinstance(i, int) else half.get(d, d) for d, i in zip(dims, index)]
    return tuple(d for d in out if d is not None) + dims[len(index) :]


def _assemble(
    ckpt: _Checkpoint, sources: List[Source], shape: Tuple[int, ...], dtype: torch.dtype, device
) -> torch.Tensor:
    if len(sources) == 1 and sources[0][1] == ():
        return ckpt.read(sources[0][0], dtype).to(dtype=dtype, device=device)  # no-op if unchanged
    out = torch.empty(shape, dtype=dtype, device=device)
    for name, index in sources:
        out[index].copy_(ckpt.read(name, dtype))
    return out


def save_checkpoint(
    path,
    config: ModelConfig,
    weights: Dict[str, torch.Tensor],
    layout: str = "hf",
    shards: int = 1,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write config.json and the weights under the released names of `layout` ("hf" splits w13/w2 into
    per-expert tensors; "fused" is dInfer's stacked layout), as one model.safetensors or as `shards` files
    plus model.safetensors.index.json. `dtype` casts every tensor (None keeps each tensor's own) but
    FP8 ones: weights with FP8 expert tensors and their `<name>_scale` (dinfer.models.quantization,
    the hf layout only) make an FP8 checkpoint, each FP8 tensor with its `_scale_inv` and
    config.json's quantization_config naming the modules left unconverted."""
    from safetensors.torch import save_file

    tensors = _released_tensors(config, weights, layout, dtype)
    hf = config.to_hf(layout)
    if any(t.dtype == torch.float8_e4m3fn for t in tensors.values()):
        hf["quantization_config"] = quantization_config(
            n[: -len(".weight")]
            for n, t in tensors.items()
            if n.endswith(".weight") and t.dim() == 2 and t.dtype != torch.float8_e4m3fn
        )
    names = list(tensors)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be between 1 and {len(names)} (the number of tensors), got {shards}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
    if shards == 1:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for k in range(shards):  # consecutive, nearly equal groups of tensors, named like the release
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        group = names[k * len(names) // shards : (k + 1) * len(names) // shards]
        save_file({n: tensors[n] for n in group}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _released_tensors(
    config: ModelConfig, weights: Dict[str, torch.Tensor], layout: str, dtype: Optional[torch.dtype]
) -> Dict[str, torch.Tensor]:
    shapes = expected_shapes(config)
    out = {}
    for name, sources in checkpoint_plan(config, layout).items():
        if name not in weights:
            raise ValueError(f"weights have no tensor {name!r}")
        if tuple(weights[name].shape) != shapes[name]:
            raise ValueError(
                f"weight {name!r} has shape {list(weights[name].shape)}, expected {list(shapes[name])}"
            )
        fp8 = weights[name].dtype == torch.float8_e4m3fn
        if fp8 and (layout != "hf" or name + SCALE not in weights):
            raise ValueError(
                f"weight {name!r} is FP8: it needs {name + SCALE!r} (its block scales) and the hf layout"
            )
        for released, index in sources:
            # Own storage per tensor: save_file refuses tensors that share memory (the w13/w2 slices).
            to = weights[name].dtype if fp8 or dtype is None else dtype
            out[released] = weights[name][index].to(device="cpu", dtype=to, copy=True).contiguous()
            if fp8:
                half = shapes[name][-2] // halves(name)
                scale = weights[name + SCALE][scale_index(index, half)]
                out[released + SCALE_INV] = scale.to(
                    device="cpu", dtype=torch.float32, copy=True
                ).contiguous()
    return out


def random_weights(
    config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Dict[str, torch.Tensor]:
    """Canonical weights for tests: norms near 1, everything else N(0, 0.02²)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        noise = torch.randn(shape, generator=gen)
        weights[name] = (1 + 0.1 * noise if name.endswith("norm") else 0.02 * noise).to(dtype)
    return weights
