"""Registering an op with torch.library while keeping plain eager calls cheap.

Every op is a torch.library custom op, so that torch.compile, FakeTensor / meta tracing, export and
opcheck see a proper operator. In plain eager mode, though, the dispatcher path costs more than our
small host kernels: ~10 µs per call, ~60 µs more for an op that mutates an input (torch's generated
ADInplaceOrView kernel re-reads the schema on every call), and the first call of any custom op
imports torch._dynamo (~1.1 s, most of a cold `dinfer generate`). `op` registers the function and
returns a caller that runs it directly when nothing is tracing — not compiling, no dispatch or
function mode, only plain tensors, nothing that needs autograd, no profiler recording — bumping the
version counters of the mutated inputs as the dispatcher would; anything else goes through the
registered op. A recording profiler (torch.profiler, or nsys's --pytorch=autograd-nvtx) thus sees
every call as the op dinfer::<name>, which the direct path would hide from it.

With DINFER_NVTX=1 each call also sits in a range dinfer::<name>[<backend>] (dinfer_kernels.profiling):
every op takes its resolved backend as its last argument.
"""

import inspect
from typing import Callable, Sequence

import torch
from torch.autograd import profiler as autograd_profiler

from . import profiling

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(args) -> bool:
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        # Set while any of torch's profilers records (torch.profiler, emit_nvtx as nsys's
        # --pytorch=autograd-nvtx starts it, emit_itt), the flag torch's own compilers read: ~150 ns
        # cheaper a call than asking the C++ profiler state.
        or autograd_profiler._is_profiler_enabled
    ):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or (grad and a.requires_grad)):
            return False
    return True


class Op:
    """The custom op dinfer::<name> over `fn` (positional arguments only), callable like `fn`."""

    def __init__(self, name: str, fn: Callable, mutates_args: Sequence[str]):
        self.impl = fn
        self.registered = torch.library.custom_op(f"dinfer::{name}", fn, mutates_args=tuple(mutates_args))
        params = list(inspect.signature(fn).parameters)
        if params[-1] != "backend":
            raise TypeError(
                f"dinfer::{name}: the last argument must be the resolved backend (the range's name)"
            )
        self.name = name
        self.mutated = [params.index(a) for a in mutates_args]

    def register_fake(self, fake: Callable) -> Callable:
        return self.registered.register_fake(fake)

    def __call__(self, *args):
        if profiling.ENABLED and not torch.compiler.is_compiling():
            with profiling.annotate(f"dinfer::{self.name}[{args[-1]}]"):
                return self._run(args)
        return self._run(args)

    def _run(self, args):
        if not _plain_eager(args):
            return self.registered(*args)
        out = self.impl(*args)
        for i in self.mutated:
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return out


def op(name: str, mutates_args: Sequence[str] = ()):
    """Decorator: `fn` becomes the custom op dinfer::<name>; see the module docstring."""
    return lambda fn: Op(name, fn, mutates_args)
