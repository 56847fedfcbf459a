"""Loop unrolling on CUDA: a chunk of iterations captured once as a CUDA graph and replayed.

A chunk's first occurrence in a block runs eagerly (it is also the warm-up that initialises cuBLAS
handles and compiles Triton kernels); from the second occurrence of the same pattern on, the chunk
is captured (which executes nothing) and replayed. The block's tensors keep fixed addresses for the
whole block, so replays read and write the live state. New block: new tensors, new graphs.
"""

import torch


class StepGraphs:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._owner = None
        self._seen = set()
        self._graphs = {}

    def run(self, iteration, state, kinds: tuple):
        """Runs iteration(state, kind) for each kind in `kinds` (the KV-cache manager's)."""
        if not self.enabled:
            for kind in kinds:
                iteration(state, kind)
            return
        if self._owner is not state:  # a new block: its tensors live elsewhere
            self._owner, self._seen, self._graphs = state, set(), {}
        graph = self._graphs.get(kinds)
        if graph is None and kinds in self._seen:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for kind in kinds:
                    iteration(state, kind)
            self._graphs[kinds] = graph
        if graph is None:
            self._seen.add(kinds)
            for kind in kinds:
                iteration(state, kind)
        else:
            graph.replay()
