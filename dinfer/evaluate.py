"""Task evaluation: exact-match accuracy, tokens per forward and tokens per second per task.

    result = evaluate(LLM(), ["add", "sort"], num_problems=100, decoder="credit", smoothing=True)
    print(markdown_table(result))

Problems are the held-out split of dinfer.tasks (never trained on), the same for the same seed, so
two decoding configurations are always compared on the same prompts. TPF counts every forward
(refreshes included, as dInfer does) a sequence ran, so it means the same at any batch size; TPS is
generated non-EOS tokens over the wall time of the generate calls (tokenisation, scoring and an
untimed warm-up call excluded). Each task's problems go to one generate call with `batch_size` in
flight (continuous batching).
"""

import sys
from typing import Callable, Dict, List, Optional

from tqdm import tqdm

from .llm import LLM
from .params import Int
from .tasks import check_tasks, eval_problems

# Summed per task from the generate stats. Refreshes are full forwards; with refreshes only at block
# starts (warmup_steps = refresh_every = 0) they count the blocks decoded: the least forwards can be.
COUNTS = ("forwards", "sequence_forwards", "refreshes", "tokens", "seconds")


class Progress:
    """A progress bar on stderr (tqdm), one step per finished prompt, labelled with its task; silent
    when disabled. Redrawn on every step: steps are whole prompts, never a hot loop."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.bar = tqdm(
            total=total,
            disable=not enabled,
            file=stream or sys.stderr,
            unit="prompt",
            mininterval=0,
            miniters=1,
            dynamic_ncols=True,
        )

    def update(self, n: int, label: str) -> None:
        self.bar.set_description_str(label, refresh=False)
        self.bar.update(n)
        if self.bar.n >= self.bar.total:
            self.bar.close()

    def write(self, text: str, stream=None) -> None:
        """Prints a line (stdout by default) without breaking the bar."""
        self.bar.write(text, file=stream or sys.stdout)

    def close(self) -> None:
        self.bar.close()


def evaluate(
    llm: LLM,
    tasks,
    num_problems: int = 100,
    batch_size: int = 1,
    problem_seed: int = 0,
    progress: bool = False,
    warmup: bool = True,
    on_task: Optional[Callable[[dict], None]] = None,
    **options,
) -> dict:
    """Run every task's held-out problems through llm.generate(..., **options).

    warmup: first generate for one problem, untimed, with the same options, so that one-off
    initialisation (kernel libraries, allocator, CUDA graph capture, Triton compilation on a GPU) is
    not charged to the first task's tokens/s.
    on_task(result): after each task, the result over the tasks done so far (what an interrupted
    run keeps); the last call's is the result returned."""
    tasks = check_tasks(tasks)
    num_problems, batch_size = Int(1)("num_problems", num_problems), Int(1)("batch_size", batch_size)
    problem_seed = Int()("problem_seed", problem_seed)
    if warmup:
        llm.generate([eval_problems(tasks[0], 1, problem_seed + 1)[0][0]], **options)
    bar = Progress(num_problems * len(tasks), progress)
    per_task = {}
    for task in tasks:
        problems = eval_problems(task, num_problems, problem_seed)
        out = llm.generate(
            [p for p, _ in problems],
            batch_size=batch_size,
            on_finish=lambda i, text, task=task: bar.update(1, task),
            **options,
        )
        counts = {key: out.stats[key] for key in COUNTS}
        counts["correct"] = sum(text == answer for text, (_, answer) in zip(out.texts, problems))
        per_task[task] = _rates(counts, len(problems))
        total = {k: sum(r[k] for r in per_task.values()) for k in ("correct",) + COUNTS}
        result = {
            "options": {k: v for k, v in options.items() if v is not None},
            "batch_size": batch_size,
            "num_problems": num_problems,
            "problem_seed": problem_seed,
            "tasks": dict(per_task),
            "overall": _rates(total, num_problems * len(per_task)),
        }
        if on_task is not None:
            on_task(result)
    return result


def _rates(c: Dict[str, float], n: int) -> dict:
    return {
        "problems": n,
        "correct": c["correct"],
        "accuracy": round(c["correct"] / n, 4),
        "forwards": c["forwards"],
        "sequence_forwards": c["sequence_forwards"],
        "refreshes": c["refreshes"],
        "tokens": c["tokens"],
        "seconds": round(c["seconds"], 4),
        "tokens_per_forward": round(c["tokens"] / max(c["sequence_forwards"], 1), 3),
        "tokens_per_second": round(c["tokens"] / c["seconds"], 1) if c["seconds"] else 0.0,
    }


def markdown_table(result: dict, title: Optional[str] = None) -> str:
    rows: List[str] = []
    if title:
        rows += [f"### {title}", ""]
    # forwards are batch forwards; TPF is per sequence (tokens / forwards each sequence ran), as at batch 1
    rows += [f"batch size {result['batch_size']}, {result['num_problems']} held-out problems per task", ""]
    rows += [
        "| task | accuracy | TPF | TPS | forwards | tokens | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in list(result["tasks"].items()) + [("**all**", result["overall"])]:
        rows.append(
            f"| {name} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} | "
            f"{r['tokens_per_second']:.1f} | {r['forwards']} | {r['tokens']} | {r['seconds']:.2f} |"
        )
    return "\n".join(rows)
