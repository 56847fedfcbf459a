"""A stand-in for torch's NVTX functions (torch._C._nvtx, which CPU builds of torch lack) that records
what dinfer_kernels.profiling pushes: the ranges in push order as (depth, name), and their tree."""

from dinfer_kernels import profiling


class FakeNVTX:
    """rangePushA / rangePop recording `ranges` [(depth, name)] and the tree `root`: (name, [children])."""

    def __init__(self):
        self.ranges = []
        self.root = ("", [])
        self.stack = [self.root]

    @property
    def depth(self) -> int:
        return len(self.stack) - 1

    def rangePushA(self, name):
        self.ranges.append((self.depth, name))
        node = (name, [])
        self.stack[-1][1].append(node)
        self.stack.append(node)
        return self.depth - 1

    def rangePop(self):
        self.stack.pop()
        return self.depth


def record_ranges(monkeypatch) -> FakeNVTX:
    """Ranges on (as DINFER_NVTX=1) and pushed to a FakeNVTX, for the test's duration."""
    fake = FakeNVTX()
    monkeypatch.setattr(profiling, "_NVTX", fake)
    monkeypatch.setattr(profiling, "ENABLED", True)
    return fake
