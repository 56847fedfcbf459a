"""The synthetic task suite the embedded models are trained and evaluated on.

Every task draws a (prompt, answer) pair of plain text from a `random.Random`; answers are checked by
exact match. The tasks are chosen so that answer tokens depend on each other (a carry, a running
value, a rank, a position counted from the end), which is what makes parallel decoding hard:

    add      6-digit addition with carries, zero-padded   add:048213+000937  -> 0049150
    sort     sort letters (repeats allowed)               sort:qmbxam        -> abmmqx
    reverse  reverse a string of letters/digits           reverse:ab3kz      -> zk3ba
    recall   look up a key in a key=value table           recall:a=37,e=70,h=13?e -> e=70
    chain    a counter mod 10 stepped up or down 8 times  chain:7++-+---+    -> 89898767

Fixed-width operands and one character per query or step keep every answer position a fixed distance
from the prompt characters it reads, so small models learn the tasks in minutes on a CPU; carries,
running values and ranks still tie each answer token to others. Recall writes its answer as the table
entry, key included: the value is then read by matching the two characters before it (`e=`) to the
table, the copy-what-followed-last-time pattern small transformers learn first, and it depends on the
key written before it. Its keys come from 8 letters and it asks one key: with 26 letters, or two to
four keys asked, our 4-layer models did not learn the lookup in the training budget (docs/training.md,
recall probes rounds 9 and 10); the trainer brings the one-key lookup up with a curriculum
(dinfer/train/curriculum.py).

Held-out split: a problem whose prompt hashes to 0 mod HELDOUT_MOD is never trained on and is the
only kind evaluated, so evaluation never sees a training problem whatever the seeds.
"""

import random
import string
import zlib
from typing import Callable, Dict, List, Optional, Tuple

Problem = Tuple[str, str]
HELDOUT_MOD = 10
LETTERS = string.ascii_lowercase
ALNUM = string.ascii_lowercase + string.digits
KEY_LETTERS = LETTERS[:8]
RECALL_KEYS = (3, 6)  # table sizes of the suite's recall problems
CHAIN_STEPS = 8
CHARS = string.digits + string.ascii_lowercase + ":+-=,?"  # every character a task writes


def _add(rng: random.Random) -> Problem:
    a, b = (rng.randrange(10 ** rng.randint(2, 6)) for _ in range(2))
    return f"add:{a:06d}+{b:06d}", f"{a + b:07d}"


def _sort(rng: random.Random) -> Problem:
    s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(5, 12)))
    return f"sort:{s}", "".join(sorted(s))


def _reverse(rng: random.Random) -> Problem:
    s = "".join(rng.choice(ALNUM) for _ in range(rng.randint(5, 14)))
    return f"reverse:{s}", s[::-1]


def recall_problem(rng: random.Random, num_keys: int) -> Problem:
    """A recall problem over a table of `num_keys` keys (the suite draws RECALL_KEYS; the training
    curriculum starts smaller)."""
    keys = rng.sample(KEY_LETTERS, num_keys)
    entry = {k: f"{k}={rng.randrange(100):02d}" for k in keys}
    asked = rng.choice(keys)
    return f"recall:{','.join(entry[k] for k in keys)}?{asked}", entry[asked]


def _recall(rng: random.Random) -> Problem:
    return recall_problem(rng, rng.randint(*RECALL_KEYS))


def _chain(rng: random.Random) -> Problem:
    # A +-1 counter rather than a running digit sum: each answer digit still depends on the previous
    # one, but a step is one of two moves, which a 4-layer model learns; the mod-10 digit sum it does
    # not learn in the training budget (0% exact after 600 single-task steps; docs/training.md).
    start = rng.randrange(10)
    ops = "".join(rng.choice("+-") for _ in range(CHAIN_STEPS))
    value, values = start, []
    for op in ops:
        value = (value + (1 if op == "+" else -1)) % 10
        values.append(str(value))
    return f"chain:{start}{ops}", "".join(values)


TASKS: Dict[str, Callable[[random.Random], Problem]] = {
    "add": _add,
    "sort": _sort,
    "reverse": _reverse,
    "recall": _recall,
    "chain": _chain,
}


def is_heldout(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HELDOUT_MOD == 0


def check_tasks(names) -> List[str]:
    """`names` (a list or a comma-separated string) as a list; ValueError naming an unknown task."""
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise ValueError(
            f"tasks: unknown task {unknown[0] if unknown else '(none given)'!r}; "
            f"expected some of {', '.join(TASKS)}"
        )
    return names


def sample(
    task: str, rng: random.Random, heldout: bool, draw: Optional[Callable[[random.Random], Problem]] = None
) -> Problem:
    """One problem of `task` from the training (heldout=False) or the evaluation split; `draw`, if
    given, replaces the task's own generator (the training curriculum's smaller problems)."""
    draw = TASKS[task] if draw is None else draw
    while True:
        prompt, answer = draw(rng)
        if is_heldout(prompt) == heldout:
            return prompt, answer


def eval_problems(task: str, n: int, seed: int = 0) -> List[Problem]:
    """n held-out problems of `task`, the same for the same (task, n, seed)."""
    rng = random.Random(f"eval/{task}/{seed}")
    return [sample(task, rng, heldout=True) for _ in range(n)]
