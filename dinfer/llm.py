"""LLM: text in, text out. Loads a checkpoint folder (weights, config, tokenizer) once and runs the
generation loop (dinfer.generate) on batches of prompts.

Every generation setting is a field of GenerationConfig or DecoderConfig, whose defaults are dInfer's
published LLaDA-MoE settings; a checkpoint's generation_config.json (gen_length, block_length),
LLM(..., **defaults) and generate(..., **options) override them, in that order. Every value is
checked where the configs are built (dinfer.params): a TypeError or ValueError naming the option.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import signal
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from . import parallel
from .decoders import DECODERS, DecoderConfig
from .generate import GenerationConfig, generate
from .models.checkpoint import load_weights
from .models.config import ModelConfig
from .models.embedded import generation_defaults, model_dir
from .models.quantization import check_quantize, quantize_experts
from .models.tokenizer import Tokenizer
from .models.transformer import DiffusionLM
from .params import Bool, Int, check_windows

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
# Option names: the fields of both configs; `decoder` names the decoder (DecoderConfig.name).
_GEN_FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)} - {"decoder"}
_DEC_FIELDS = {f.name for f in dataclasses.fields(DecoderConfig)} - {"name"}
OPTIONS = sorted(_GEN_FIELDS | _DEC_FIELDS | {"decoder"})

Prompts = Union[str, Sequence[str], Sequence[Sequence[int]]]


@dataclass
class GenerateResult:
    texts: List[str]  # one per prompt, up to the first EOS, special tokens dropped
    token_ids: List[List[int]]  # the generated tokens of each prompt, up to the first EOS
    stats: dict  # Stats.as_dict() of the run


def generation_config(**options) -> GenerationConfig:
    """GenerationConfig defaults overridden by `options` (None values are ignored); `decoder` is a
    decoder name or a DecoderConfig. TypeError for an unknown option, ValueError for a bad value."""
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unknown option {unknown[0]!r}; expected one of {', '.join(OPTIONS)}")
    base = GenerationConfig()
    decoder = options.pop("decoder", base.decoder)
    if isinstance(decoder, str):
        decoder = dataclasses.replace(base.decoder, name=decoder)
    elif not isinstance(decoder, DecoderConfig):
        raise TypeError(
            f"decoder: expected a decoder name ({', '.join(DECODERS)}) or a DecoderConfig, "
            f"got {type(decoder).__name__}"
        )
    decoder = dataclasses.replace(decoder, **{k: options.pop(k) for k in _DEC_FIELDS & set(options)})
    return dataclasses.replace(base, decoder=decoder, **options)


def checkpoint_defaults(path, config: Optional[ModelConfig] = None) -> dict:
    """The generation defaults a checkpoint folder sets: a block-causal model's (it decodes in the
    blocks it was trained with, on the append-only paged cache: its committed blocks are final),
    then its generation_config.json's."""
    config = ModelConfig.from_dir(path) if config is None else config
    model = dict(block_length=config.block_length, cache="paged") if config.block_causal else {}
    return {**model, **generation_defaults(path)}


class LLM:
    """A diffusion LLM ready to generate: LLM("path/to/LLaDA-MoE-7B-A1B-Instruct").generate("Hi").

    model_path: a checkpoint folder, or the name of an embedded model ("tiny-llada-moe", the default
    when None, "tiny-llada" or "tiny-llada2").
    tensor_parallel_size: ranks of a tensor-parallel group (dinfer.parallel): attention heads, MLP
    channels, the vocabulary and (expert parallelism) the experts split across them. Under torchrun
    every process creates the LLM and joins (--nproc-per-node must equal it); otherwise this process
    is rank 0 and spawns the others on this machine (one GPU each, or host processes with gloo), which
    follow its generate calls until close(). Every rank returns the same results.
    expert_parallel: how the MoE layers combine their experts' outputs: "allreduce" (each rank's
    experts on every token routed to them, one all-reduce) or "alltoall" (tokens dispatched to the
    experts' ranks and back).
    quantize: "fp8" converts the expert weights (routed and shared) to FP8 with 128 x 128 block scales
    at load (dinfer.models.quantization), as an FP8 checkpoint has them; an FP8 checkpoint needs no
    option. Under tensor parallelism the routed experts only: the ranks' shared-expert slices stay
    in `dtype`.
    """

    def __init__(
        self,
        model_path=None,
        device=None,
        dtype=None,
        tensor_parallel_size: int = 1,
        expert_parallel: str = "allreduce",
        quantize: Optional[str] = None,
        _join=None,
        **defaults,
    ):
        path = model_dir(model_path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model_path: checkpoint directory {path!r} does not exist")
        generation_config(**defaults)  # unknown names and bad values fail here, not at the first call
        Int(1)("tensor_parallel_size", tensor_parallel_size)
        self.path = path
        self.device = _device(device)
        self.dtype = _dtype(dtype, self.device)
        config = ModelConfig.from_dir(path)
        check_quantize(quantize, config)
        self.defaults = {**checkpoint_defaults(path, config), **defaults}
        self._given = set(defaults)  # the options the caller set (the rest: the checkpoint's or ours)
        self._config_file = os.path.join(path, "config.json")
        cfg = generation_config(**self.defaults)
        check_windows(cfg, config.max_positions, self._given, self._config_file)  # before the weights load
        # The tokenizer before the weights: a missing tokenizer.json fails before a long load.
        self.tokenizer = Tokenizer(path, config=config)  # checked against the model config
        self.rank, self.comm, self._workers, self._torchrun = 0, None, None, False
        if tensor_parallel_size == 1:
            weights = load_weights(path, config, dtype=self.dtype, device=self.device)
            self.model = DiffusionLM(config, quantize_experts(weights, config) if quantize else weights)
            return
        self._start_parallel(
            config, tensor_parallel_size, expert_parallel, quantize, _join, device, dtype, defaults
        )

    def _start_parallel(self, config, world, ep_mode, quantize, join, device, dtype, defaults) -> None:
        """Joins (or starts) the tensor-parallel group and loads this rank's shard."""
        parallel.ShardPlan(
            config, world, 0, ep_mode
        )  # sizes that do not divide fail before any process starts
        if join is None and not parallel.under_torchrun():
            args = dict(model_path=self.path, device=device, dtype=dtype, tensor_parallel_size=world)
            self._workers = parallel.launch.Workers(
                world, _run_rank, (dict(args, expert_parallel=ep_mode, quantize=quantize, **defaults),), None
            )
            join = (0, self._workers.init_method, None)
        self._torchrun = join is None
        rank, init_method, timeout_s = join if join is not None else (None, None, None)
        self.comm, self.device = parallel.join(
            world, self.device, rank=rank, init_method=init_method, timeout_s=timeout_s
        )
        if self._workers is not None:
            self._workers.comm = self.comm
        self.rank = self.comm.rank
        self.model = parallel.load_model(
            self.path, self.comm, ep_mode, dtype=self.dtype, device=self.device, quantize=quantize
        )

    def broadcast(self, obj):
        """Rank 0's obj on every rank of a tensor-parallel group started by torchrun (itself alone)."""
        if self.comm is None or self._workers is not None:
            return obj
        return self.comm.broadcast_object(obj, group=self.comm.control)

    def close(self, wait: bool = True) -> None:
        """Stops the workers this LLM spawned (tensor_parallel_size > 1 outside torchrun), or, under
        torchrun, leaves the group once every rank is done: a rank that exits with its process group
        alive can abort in gloo's teardown while another still talks to it. wait=False: at once (this
        rank failed or was interrupted; the others' next collective then fails)."""
        if self._workers is not None:
            self._workers.close(wait)
            self._workers = None
        elif self._torchrun and self.comm is not None:
            if wait:
                self.comm.barrier(group=self.comm.control)
            dist.destroy_process_group()
            self.comm = None

    def generate(
        self,
        prompts: Prompts,
        gen_length: Optional[int] = None,
        block_length: Optional[int] = None,
        decoder: Union[str, DecoderConfig, None] = None,
        cache: Optional[str] = None,
        chat: bool = True,
        batch_size: Optional[int] = None,
        on_finish: Optional[Callable[[int, str], None]] = None,
        stop: Union[str, Sequence[str], None] = None,
        **options,
    ) -> GenerateResult:
        """Generate for a prompt or a list of prompts (strings, or token-id lists taken as they are).

        chat: wrap string prompts in the checkpoint's chat template (a ValueError when it has none).
        batch_size: the most prompts decoded at once (default: all); when one finishes, the next
            waiting prompt takes its place at the next block boundary (continuous batching).
        on_finish: on_finish(i, text) as soon as prompt i is finished, while others still run
            (results as they come; progress bars).
        stop: a string or strings; each answer's text is cut before the first place one of them
            occurs, its token_ids to the tokens wholly before that place. Decoding is not ended
            early: a diffusion model fills a whole block at once, so this only trims the answer.
        options: GenerationConfig / DecoderConfig fields (threshold=0.9, smoothing=True, ...).
        """
        if self._workers is not None:  # the spawned ranks run the same call (on_finish is rank 0's)
            self._workers.call(
                "generate",
                prompts,
                gen_length=gen_length,
                block_length=block_length,
                decoder=decoder,
                cache=cache,
                chat=chat,
                batch_size=batch_size,
                stop=stop,
                **options,
            )
        given = dict(options, gen_length=gen_length, block_length=block_length, decoder=decoder, cache=cache)
        cfg = generation_config(**{**self.defaults, **{k: v for k, v in given.items() if v is not None}})
        user = set(self._given) | {k for k, v in given.items() if v is not None}
        check_windows(
            cfg, self.model.config.max_positions, user, self._config_file
        )  # before any buffer is sized by them
        Bool()("chat", chat)
        if batch_size is not None:
            Int(1)("batch_size", batch_size)
        stops = stop_strings(stop)
        ids = self._prompt_ids(prompts, chat)
        token_ids: List[List[int]] = [None] * len(ids)
        texts: List[str] = [None] * len(ids)

        def decode(i: int, tokens: torch.Tensor) -> None:
            token_ids[i], texts[i] = cut_at_stop(self.tokenizer, self._until_eos(tokens.tolist()), stops)

        def finished(i: int, tokens: torch.Tensor) -> None:  # decoded once, handed over at once
            decode(i, tokens)
            on_finish(i, texts[i])

        outputs, stats = generate(self.model, ids, cfg, batch_size, None if on_finish is None else finished)
        if on_finish is None:  # decoded after the timed run, as it always was
            for i, tokens in enumerate(outputs):
                decode(i, tokens)
        return GenerateResult(texts, token_ids, stats.as_dict())

    def _prompt_ids(self, prompts: Prompts, chat: bool) -> List[List[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (Sequence, torch.Tensor, np.ndarray)):
            raise TypeError(
                f"prompts: expected a string, a list of strings or a list of token-id lists, "
                f"got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        return [self.encode(p, chat, f"prompts[{i}]") for i, p in enumerate(prompts)]

    def encode(self, prompt, chat: bool = True, name: str = "prompt") -> List[int]:
        """The token ids of one prompt: a string (in the chat template when `chat`) or token ids,
        checked (TypeError / ValueError naming `name`: empty, not in the vocabulary)."""
        if isinstance(prompt, str):
            if not prompt:  # a chat template would hide it: the model would answer an empty turn
                raise ValueError(f"{name}: empty prompt")
            if chat and self.tokenizer.chat_template is None:
                # Without it a prompt reaches a chat model bare, and it answers nothing at all.
                raise ValueError(
                    f"chat: the checkpoint {self.path} has no chat template (no tokenizer_config.json "
                    f"with a chat_template, no chat_template.jinja); pass chat=False (--no-chat) to use "
                    f"prompts as they are"
                )
            text = self.tokenizer.apply_chat_template(prompt) if chat else prompt
            try:
                return self.tokenizer.encode(text)
            except ValueError as e:  # a character the vocabulary lacks
                raise ValueError(f"{name}: {e}") from e
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            prompt = prompt.tolist()
        if isinstance(prompt, bytes) or not isinstance(
            prompt, Sequence
        ):  # a flat list of ids is one prompt: it goes in a list
            raise TypeError(
                f"{name}: expected a string or a list of token ids, got "
                f"{type(prompt).__name__}"
                + (
                    " (one tokenised prompt is [ids], not ids)"
                    if isinstance(prompt, numbers.Integral)
                    else ""
                )
            )
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{name}[{j}]: expected a token id (int), got {type(t).__name__}")
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _until_eos(self, ids: List[int]) -> List[int]:
        eos = self.model.config.eos_id
        return ids[: ids.index(eos)] if eos in ids else ids


def _run_rank(rank: int, world: int, init_method: str, timeout_s, started, llm_args: dict) -> None:
    """A spawned rank (parallel.launch.Workers): says it started, loads its shard, then runs every
    LLM call rank 0 broadcasts until rank 0 closes the group."""
    # Ctrl-C reaches every process of the terminal's group: rank 0 handles it, and ends this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started.send(True)
    started.close()
    try:
        llm = LLM(**llm_args, _join=(rank, init_method, timeout_s))
        comm = llm.comm
        while True:
            msg = comm.broadcast_object(None, group=comm.control)
            if msg is None:
                break
            method, args, kwargs = msg
            try:
                getattr(llm, method)(*args, **kwargs)
            except parallel.ParallelError:
                raise
            except Exception:  # rank 0 hit (and reported) the same error on the same arguments
                pass
    except parallel.ParallelError:
        raise SystemExit(1) from None  # rank 0 failed or left first, and reports it
    dist.destroy_process_group()


def cut_at_stop(tokenizer: Tokenizer, ids: List[int], stops: Sequence[str]):
    """(token ids, text) of an answer (ids up to its EOS) cut before its first stop string: the text
    exactly there, the token ids to the tokens wholly before it (a token that straddles the cut is
    dropped)."""
    text = tokenizer.decode(ids)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return ids, text
    cut, n = min(hits), 0
    while n < len(ids) and len(tokenizer.decode(ids[: n + 1])) <= cut:
        n += 1
    return ids[:n], text[:cut]


def stop_strings(stop) -> List[str]:
    """The stop strings of `stop` (None, a string or a list of strings), checked: TypeError or
    ValueError naming `stop`."""
    if stop is None or isinstance(stop, str):
        stops = [] if stop is None else [stop]
    elif isinstance(stop, Sequence):
        stops = list(stop)
    else:
        raise TypeError(f"stop: expected a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}]: expected a string, got {type(s).__name__}")
        if not s:
            raise ValueError(f"stop[{i}]: an empty stop string would cut every answer to nothing")
    return stops


def _device(device) -> torch.device:
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {str(device)!r} requested but CUDA is not available")
    return device


def _dtype(dtype, device: torch.device) -> torch.dtype:
    """bf16 on a GPU (the released weights' precision), fp32 on the host, unless asked."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)} (or the torch dtype), got {dtype!r}")
