"""Lazy submodules of the kernel backend packages (cpu, cuda, triton): a module of them is imported on
first use. Apart from _backend, which imports those packages, so that they import nothing back."""

import importlib
from types import ModuleType
from typing import Callable


def submodule_loader(package: str) -> Callable[[str], ModuleType]:
    """A kernel backend package's __getattr__ (PEP 562): imports its module `name` on first use, so
    that module() imports nothing it does not use (Triton only when used) yet torch.compile, which
    cannot trace importlib, runs the lookup rather than tracing it."""

    def load(name: str) -> ModuleType:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise  # the module exists; something it imports does not
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return load
