"""The synthetic task suite: answers checked by an independent computation, the held-out split,
determinism and the size limits the embedded models were trained for."""

import random

import pytest

from dinfer.tasks import CHAIN_STEPS, TASKS, check_tasks, eval_problems, is_heldout, sample


def solve(prompt: str) -> str:
    """Each task solved from its prompt text alone, without the generator's code path."""
    task, body = prompt.split(":", 1)
    if task == "add":
        a, b = body.split("+")
        assert len(a) == len(b) == 6
        return f"{int(a) + int(b):07d}"
    if task == "sort":
        return "".join(sorted(body))
    if task == "reverse":
        return body[::-1]
    if task == "recall":
        pairs, asked = body.split("?")
        table = dict(p.split("=") for p in pairs.split(","))
        assert 3 <= len(table) <= 6 and len(asked) == 1
        return f"{asked}={table[asked]}"
    if task == "chain":
        start, ops = int(body[0]), body[1:]
        return "".join(
            str((start + ops[: i + 1].count("+") - ops[: i + 1].count("-")) % 10) for i in range(len(ops))
        )
    raise AssertionError(task)


@pytest.mark.parametrize("task", list(TASKS))
def test_answers_and_split(task):
    rng = random.Random(task)
    for heldout in (False, True):
        for _ in range(300):
            prompt, answer = sample(task, rng, heldout)
            assert prompt.startswith(task + ":")
            assert answer == solve(prompt)
            assert is_heldout(prompt) == heldout
            # Prompt and answer fit the embedded models' canvas: the answer plus at least one EOS in
            # the default gen_length 32, and the whole sequence in a few blocks.
            assert 1 <= len(answer) <= 31 and len(prompt) + 2 + 32 <= 128


def test_carries_and_dependencies_occur():
    rng = random.Random(0)
    adds = [sample("add", rng, False) for _ in range(200)]
    # A carry: some digit of the sum differs from the digit-wise sum mod 10.
    carries = [
        p for p, a in adds if a[1:] != "".join(str((int(x) + int(y)) % 10) for x, y in zip(p[4:10], p[11:]))
    ]
    assert len(carries) > 100
    # A chain wraps around 0 <-> 9 in some problems, and goes both up and down in most.
    chains = [sample("chain", rng, False) for _ in range(200)]
    assert all(len(a) == CHAIN_STEPS == len(p) - len("chain:") - 1 for p, a in chains)
    assert sum("90" in p[6] + a or "09" in p[6] + a for p, a in chains) > 20
    assert sum("+" in p[7:] and "-" in p[7:] for p, _ in chains) > 180


def test_eval_problems_deterministic_and_heldout():
    a, b = eval_problems("sort", 25, seed=3), eval_problems("sort", 25, seed=3)
    assert a == b and all(is_heldout(p) for p, _ in a)
    assert eval_problems("sort", 25, seed=4) != a
    assert len({p for p, _ in eval_problems("add", 200)}) > 190


def test_check_tasks():
    assert check_tasks("add, sort") == ["add", "sort"]
    assert check_tasks(["chain"]) == ["chain"]
    with pytest.raises(ValueError, match="'mul'"):
        check_tasks("add,mul")
    with pytest.raises(ValueError, match="none given"):
        check_tasks([])
