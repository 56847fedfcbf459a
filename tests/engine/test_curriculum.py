"""Recall's training curriculum: the scaffold's schedule, the table sizes it draws, and problems that
are still the suite's recall problems (answers checked from the prompt text)."""

import random

import pytest

from dinfer.tasks import RECALL_KEYS, is_heldout, sample
from dinfer.train.curriculum import RecallCurriculum
from dinfer.train.presets import PRESETS

CURRICULUM = RecallCurriculum(alone=70, scaffold_full=30, scaffold_gone=70, first_keys=(2, 3), grow=(70, 100))


def test_scaffold_full_then_fades_to_zero():
    c = CURRICULUM
    assert [c.scaffold_weight(s) for s in (0, 30)] == [1.0, 1.0]
    assert c.scaffold_weight(50) == pytest.approx(0.5)
    assert [c.scaffold_weight(s) for s in (70, 71, 10_000)] == [0.0, 0.0, 0.0]
    weights = [c.scaffold_weight(s) for s in range(0, 80)]
    assert all(a >= b for a, b in zip(weights, weights[1:]))


def test_tables_grow_to_the_suites_size():
    c = CURRICULUM
    assert c.key_range(0) == c.key_range(69) == (2, 3)
    assert c.key_range(70) == (RECALL_KEYS[0], RECALL_KEYS[0])
    assert c.key_range(85) == (RECALL_KEYS[0], 5)  # halfway from 3 to 6, rounded
    assert c.key_range(100) == c.key_range(10_000) == RECALL_KEYS
    assert c.fill_start() == 100


@pytest.mark.parametrize("step", [0, 85, 100])
def test_drawn_problems_are_recall_problems_of_the_stage(step):
    rng = random.Random(step)
    lo, hi = CURRICULUM.key_range(step)
    sizes = set()
    for _ in range(300):
        prompt, answer = sample("recall", rng, heldout=False, draw=CURRICULUM.draw(step))
        assert not is_heldout(prompt)
        table, asked = prompt.split(":", 1)[1].split("?")
        entries = dict(e.split("=") for e in table.split(","))
        assert len(entries) == len(table.split(","))  # distinct keys
        assert len(asked) == 1 and answer == f"{asked}={entries[asked]}"
        assert all(len(v) == 2 for v in entries.values())
        sizes.add(len(entries))
    assert sizes == set(range(lo, hi + 1))


def test_presets_run_the_curriculum_within_their_steps():
    for preset in PRESETS.values():
        c = preset.recall_curriculum
        # the tables reach the suite's sizes by mid-training: at least half the steps see the full suite
        assert c.scaffold_full < c.scaffold_gone <= c.alone <= c.grow[0] < c.grow[1] <= preset.steps / 2
