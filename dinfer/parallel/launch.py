"""Starting a tensor-parallel group: joining torchrun's, or spawning the workers of `LLM(...,
tensor_parallel_size=N)` on this machine.

Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment) every process runs
the same program and joins the group; WORLD_SIZE must equal the requested size. Otherwise the calling
process becomes rank 0 and starts ranks 1..N-1 (torch.multiprocessing, spawn), which load their
shards and then run every `generate` call rank 0 broadcasts to them (a gloo control group), until
rank 0 closes the group. NCCL for CUDA devices (rank r on cuda:LOCAL_RANK), gloo on the host; every
collective has the group's timeout (dinfer.parallel.comm).
"""

from __future__ import annotations

import atexit
import os
import socket
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import Comm, ParallelError, backend_for, timeout


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(
    world: int,
    device,
    *,
    rank: Optional[int] = None,
    init_method: Optional[str] = None,
    timeout_s: Optional[float] = None,
) -> Tuple[Comm, torch.device]:
    """(the communicator, this rank's device) after joining the default process group of `world`
    ranks: torchrun's (from the environment), or the one at init_method as `rank`. An existing
    default group is reused when its size matches."""
    device = torch.device(device)
    if dist.is_initialized():
        have = dist.get_world_size()
        if have != world:
            raise ParallelError(f"tensor_parallel_size is {world} but the process group has {have} ranks")
    else:
        if init_method is None:
            if not under_torchrun():
                raise ParallelError(
                    f"tensor_parallel_size {world}: no process group to join (start with torchrun "
                    f"--nproc-per-node {world}, or let LLM spawn its workers)"
                )
            have = int(os.environ["WORLD_SIZE"])
            if have != world:
                raise ParallelError(
                    f"tensor_parallel_size is {world} but torchrun started {have} processes "
                    f"(--nproc-per-node {world})"
                )
            rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank or 0))
        if device.type == "cuda":
            device = torch.device("cuda", local if device.index is None else device.index + local)
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend_for(device),
            init_method=init_method,
            rank=rank if init_method is not None else -1,
            world_size=world if init_method is not None else -1,
            timeout=timeout(timeout_s),
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    comm = Comm(None, timeout_s)
    # Pickled objects (the generate calls, stdin's prompts) go through gloo whatever the device.
    comm.control = (
        dist.new_group(backend="gloo", timeout=timeout(timeout_s)) if comm.backend != "gloo" else None
    )
    return comm, device


class Workers:
    """Ranks 1..N-1 of a group this process (rank 0) started; `call` runs a method of their LLM."""

    def __init__(self, world: int, llm_args: dict, timeout_s: Optional[float]):
        self.world = world
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, self.init_method, llm_args, timeout_s), daemon=True)
            for r in range(1, world)
        ]
        for p in self.procs:
            p.start()
        self.comm: Optional[Comm] = None
        atexit.register(self.close)

    def call(self, method: str, *args, **kwargs) -> None:
        """Every worker runs llm.<method>(*args, **kwargs) (broadcast from rank 0)."""
        self.comm.broadcast_object((method, args, kwargs), group=self.comm.control)

    def close(self) -> None:
        if self.comm is not None:
            try:
                self.comm.broadcast_object(None, group=self.comm.control)
            except ParallelError:
                pass  # a worker already gone: nothing left to stop
            self.comm = None
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(rank: int, world: int, init_method: str, llm_args: dict, timeout_s) -> None:
    from ..llm import LLM

    llm = LLM(**llm_args, _join=(rank, init_method, timeout_s))
    comm = llm.comm
    while True:
        msg = comm.broadcast_object(None, group=comm.control)
        if msg is None:
            break
        method, args, kwargs = msg
        try:
            getattr(llm, method)(*args, **kwargs)
        except ParallelError:
            raise
        except Exception:  # rank 0 hit (and reported) the same error on the same arguments
            pass
    dist.destroy_process_group()
