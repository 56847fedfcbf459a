"""dinfer.evaluate on a scripted model: exact-match scoring, rates, batching, options, the table."""

import io

import pytest

from dinfer.evaluate import Progress, evaluate, markdown_table
from dinfer.llm import GenerateResult
from dinfer.tasks import eval_problems


class ScriptedLLM:
    """Answers every third problem wrongly; 2 batch forwards per batch_size prompts, 3 tokens and 0.5 s
    per prompt; reports each prompt finished through on_finish."""

    def __init__(self):
        self.answers = {p: a for t in ("add", "chain") for p, a in eval_problems(t, 7, seed=2)}
        self.calls = []

    def generate(self, prompts, batch_size=None, on_finish=None, **options):
        self.calls.append((len(prompts), batch_size, options))
        texts = [self.answers.get(p, "wrong") if sum(map(ord, p)) % 3 else "wrong" for p in prompts]
        n, batch_size = len(prompts), batch_size or len(prompts)
        for i, text in enumerate(texts if on_finish else ()):
            on_finish(i, text)
        return GenerateResult(
            texts,
            [[0] * 3 for _ in prompts],
            {
                "forwards": 2 * -(-n // batch_size),
                "sequence_forwards": 2 * n,
                "refreshes": -(-n // batch_size),
                "tokens": 3 * n,
                "seconds": 0.5 * n,
            },
        )


def test_scores_and_rates(capsys):
    llm = ScriptedLLM()
    r = evaluate(
        llm,
        "add,chain",
        num_problems=7,
        batch_size=3,
        problem_seed=2,
        decoder="credit",
        unroll=None,
        progress=True,
    )
    bar = capsys.readouterr().err
    # An untimed warm-up call, then one call per task: the LLM keeps batch_size prompts in flight
    # (continuous batching). The warm-up counts nowhere (6 forwards per task below, not 8).
    assert [(n, b) for n, b, _ in llm.calls] == [(1, None), (7, 3), (7, 3)]
    assert all(o == {"decoder": "credit", "unroll": None} for _, _, o in llm.calls)
    assert "add" in bar and "7/14" in bar and "chain" in bar and "14/14" in bar
    for task in ("add", "chain"):
        expected = sum(sum(map(ord, p)) % 3 != 0 for p, _ in eval_problems(task, 7, seed=2))
        t = r["tasks"][task]
        assert t["correct"] == expected and t["accuracy"] == round(expected / 7, 4)
        assert (
            t["forwards"] == 6 and t["sequence_forwards"] == 14 and t["refreshes"] == 3 and t["tokens"] == 21
        )
        assert t["tokens_per_forward"] == 1.5
        assert t["tokens_per_second"] == 6.0
    assert r["overall"]["problems"] == 14 and r["overall"]["sequence_forwards"] == 28
    assert r["options"] == {"decoder": "credit"}
    table = markdown_table(r, title="scripted")
    assert table.startswith("### scripted") and table.count("\n| ") == 4 and "| **all** |" in table


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tasks="add,mul"), "mul"),
        (dict(num_problems=0), "num_problems"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {**dict(tasks="add", num_problems=2, batch_size=1), **kwargs}
    with pytest.raises(ValueError, match=match):
        evaluate(ScriptedLLM(), args.pop("tasks"), **args)


def test_progress_bar():
    out = io.StringIO()
    bar = Progress(4, stream=out)
    bar.update(3, "add")
    bar.update(1, "add")
    lines = out.getvalue()
    assert "add" in lines and "3/4" in lines and "4/4" in lines and lines.endswith("\n")
    silent = io.StringIO()
    Progress(2, enabled=False, stream=silent).update(2, "x")
    assert silent.getvalue() == ""
