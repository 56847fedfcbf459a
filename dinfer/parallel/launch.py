"""Starting a tensor-parallel group: joining torchrun's, or spawning the workers of `LLM(...,
tensor_parallel_size=N)` on this machine.

Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment) every process runs
the same program and joins the group; WORLD_SIZE must equal the requested size. Otherwise the calling
process becomes rank 0 and starts ranks 1..N-1 (torch.multiprocessing, spawn) running the entry it
is given (dinfer.llm's: they load their shards and then run every `generate` call rank 0 broadcasts
to them on a gloo control group, until rank 0 closes the group; this module never imports the LLM).
Rank 0 joins only once every rank has started: one that dies at start ends the run at once with a
ParallelError saying why, instead of leaving rank 0 waiting out the group's timeout. NCCL for CUDA devices (rank r on cuda:LOCAL_RANK), gloo on the host; every
collective has the group's timeout (dinfer.parallel.comm).
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from multiprocessing.connection import wait
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import DEFAULT_TIMEOUT_S, Comm, ParallelError, backend_for, timeout


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


# The exit status of a spawned process that re-ran the main module up to a second LLM's spawn.
RERAN_MAIN = 3


class Workers:
    """Ranks 1..N-1 of a group this process (rank 0) started, each running
    entry(rank, world, init_method, timeout_s, started, *args): `started` is a connection on which
    the entry sends once it runs (its process bootstrapped); `call` broadcasts a method call to them."""

    def __init__(self, world: int, entry: Callable, args: tuple, timeout_s: Optional[float]):
        if getattr(mp.current_process(), "_inheriting", False):
            # This process is a spawned rank still importing the program's main module (spawn runs
            # it again, as __mp_main__), which reached the code creating the group at its top level:
            # it cannot spawn (multiprocessing refuses, at length). Rank 0 says why, on one line.
            raise SystemExit(RERAN_MAIN)
        self.world = world
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.comm: Optional[Comm] = None
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, world)]
        self.procs = [
            ctx.Process(target=entry, args=(r, world, self.init_method, timeout_s, send, *args), daemon=True)
            for r, (_, send) in zip(range(1, world), pipes)
        ]
        for p in self.procs:
            p.start()
        atexit.register(self.close)
        try:
            self._wait_started([recv for recv, _ in pipes], timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_started(self, pipes, timeout_s: Optional[float]) -> None:
        """Returns once every rank's entry runs; a ParallelError naming the first rank that exited
        before (or did not start within the timeout)."""
        limit = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        waiting = dict(zip(range(1, self.world), zip(pipes, self.procs)))
        while waiting:
            ready = wait(
                [c for c, _ in waiting.values()] + [p.sentinel for _, p in waiting.values()],
                max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                raise ParallelError(
                    f"tensor_parallel_size={self.world}: rank {min(waiting)} did not start within {limit:g} s"
                )
            for rank, (conn, proc) in sorted(waiting.items()):
                if conn in ready and conn.poll():
                    conn.recv()
                    del waiting[rank]
                elif proc.sentinel in ready:
                    proc.join()  # it has ended: this reaps it, setting its exit status
                    raise ParallelError(_died_at_start(rank, self.world, proc.exitcode))

    def call(self, method: str, *args, **kwargs) -> None:
        """Every worker runs llm.<method>(*args, **kwargs) (broadcast from rank 0)."""
        self.comm.broadcast_object((method, args, kwargs), group=self.comm.control)

    def close(self, wait: bool = True) -> None:
        """Tells the workers to stop and waits for them (wait=False, or none told: kills them)."""
        comm, self.comm = self.comm, None
        if comm is not None and wait:
            try:
                comm.broadcast_object(None, group=comm.control)
            except ParallelError:
                pass  # a worker already gone: nothing left to stop
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()


def _died_at_start(rank: int, world: int, status: Optional[int]) -> str:
    if status == RERAN_MAIN:
        main = getattr(sys.modules["__main__"], "__file__", None) or "the main module"
        return (
            f"tensor_parallel_size={world}: rank {rank} stopped at start: each spawned rank first runs "
            f"{main} again (Python's spawn start method), and its top level creates the parallel LLM "
            f'again: put that code under `if __name__ == "__main__":`'
        )
    return (
        f"tensor_parallel_size={world}: rank {rank} exited with status {status} before it started "
        f"(its own error, if any, is above on stderr)"
    )
