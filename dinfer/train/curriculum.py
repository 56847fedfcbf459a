"""Recall's training curriculum: smaller tables first, with a training-only position scaffold.

On RoPE alone (LLaDA's only position signal) the key lookup sits on a plateau: a head must first
bring each value to its key by a fixed offset, and that head pays off only once the content match
exists. A learned absolute-position table added to the inputs of recall sequences gives every token
its position from the first step, and the lookup forms on two- and three-key tables within a few
hundred steps if nothing else is trained (with the other four tasks in the batch and the table on
recall rows only, it had not formed by step 600: docs/training.md, "Recall learned"); the table then fades out, the
model carries the lookup over to RoPE, and the tables grow to the suite's size (docs/training.md, recall
probes rounds 8-10). The table is never saved: the checkpoints keep the released layouts. The
schedule is in steps, not fractions of the run, because what it paces is the number of updates a
lookup takes to form.
"""

import random
from dataclasses import dataclass
from typing import Callable, Tuple

from ..tasks import RECALL_KEYS, Problem, recall_problem


@dataclass(frozen=True)
class RecallCurriculum:
    alone: int = 600  # batches are recall only up to this step
    scaffold_full: int = 300  # the position table at full weight up to this step,
    scaffold_gone: int = 600  # then linearly down to 0 at this one
    first_keys: Tuple[int, int] = (2, 3)  # table sizes while the scaffold is on
    grow: Tuple[int, int] = (600, 1200)  # steps over which the largest table grows to the suite's

    def scaffold_weight(self, step: int) -> float:
        """The position table's weight in the inputs of recall sequences at `step`."""
        if step <= self.scaffold_full:
            return 1.0
        return max(0.0, 1.0 - (step - self.scaffold_full) / (self.scaffold_gone - self.scaffold_full))

    def key_range(self, step: int) -> Tuple[int, int]:
        """(fewest, most) keys of a recall table at `step`; RECALL_KEYS from the end of `grow` on."""
        lo, hi = RECALL_KEYS
        start, end = self.grow
        if step < start:
            return self.first_keys
        grown = min(1.0, (step - start) / (end - start))
        return lo, lo + round(grown * (hi - lo))

    def draw(self, step: int) -> Callable[[random.Random], Problem]:
        """The recall generator at `step`: a table size from key_range, then the suite's problem."""

        def problem(rng: random.Random) -> Problem:
            return recall_problem(rng, rng.randint(*self.key_range(step)))

        return problem

    def fill_start(self) -> int:
        """The step from which recall sequences get the long EOS fills: not before the tables have
        grown, since a canvas of mostly EOS thins the answer's share of the loss."""
        return self.grow[1]


RECALL_CURRICULUM = RecallCurriculum()
