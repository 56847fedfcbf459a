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
import time
from typing import Dict, List, Optional

from .llm import LLM
from .tasks import check_tasks, eval_problems

# Summed per task from the generate stats. Refreshes are full forwards; with refreshes only at block
# starts (warmup_steps = refresh_every = 0) they count the blocks decoded: the least forwards can be.
COUNTS = ("forwards", "sequence_forwards", "refreshes", "tokens", "seconds")


class Progress:
    """A one-line progress bar on stderr (no dependency); silent when disabled."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()

    def update(self, n: int, label: str) -> None:
        self.done += n
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.t0
        self.stream.write(f"\r{label:<10} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"{elapsed:6.1f} s")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def evaluate(llm: LLM, tasks, num_problems: int = 100, batch_size: int = 1, problem_seed: int = 0,
             progress: bool = False, warmup: bool = True, **options) -> dict:
    """Run every task's held-out problems through llm.generate(..., **options).

    warmup: first generate for one problem, untimed, with the same options, so that one-off
    initialisation (kernel libraries, allocator, CUDA graph capture, Triton compilation on a GPU) is
    not charged to the first task's tokens/s."""
    tasks = check_tasks(tasks)
    if num_problems < 1:
        raise ValueError(f"num_problems: must be >= 1, got {num_problems}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if warmup:
        llm.generate([eval_problems(tasks[0], 1, problem_seed + 1)[0][0]], **options)
    bar = Progress(num_problems * len(tasks), progress)
    per_task = {}
    for task in tasks:
        problems = eval_problems(task, num_problems, problem_seed)
        out = llm.generate([p for p, _ in problems], batch_size=batch_size,
                           on_finish=lambda i, text, task=task: bar.update(1, task), **options)
        counts = {key: out.stats[key] for key in COUNTS}
        counts["correct"] = sum(text == answer for text, (_, answer) in zip(out.texts, problems))
        per_task[task] = _rates(counts, len(problems))
    total = {k: sum(per_task[t][k] for t in tasks)
             for k in ("correct",) + COUNTS}
    return {"options": {k: v for k, v in options.items() if v is not None}, "batch_size": batch_size,
            "num_problems": num_problems, "problem_seed": problem_seed, "tasks": per_task,
            "overall": _rates(total, num_problems * len(tasks))}


def _rates(c: Dict[str, float], n: int) -> dict:
    return {"problems": n, "correct": c["correct"], "accuracy": round(c["correct"] / n, 4),
            "forwards": c["forwards"], "sequence_forwards": c["sequence_forwards"], "refreshes": c["refreshes"],
            "tokens": c["tokens"],
            "seconds": round(c["seconds"], 4),
            "tokens_per_forward": round(c["tokens"] / max(c["sequence_forwards"], 1), 3),
            "tokens_per_second": round(c["tokens"] / c["seconds"], 1) if c["seconds"] else 0.0}


def markdown_table(result: dict, title: Optional[str] = None) -> str:
    rows: List[str] = []
    if title:
        rows += [f"### {title}", ""]
    # forwards are batch forwards; TPF is per sequence (tokens / forwards each sequence ran), as at batch 1
    rows += [f"batch size {result['batch_size']}, {result['num_problems']} held-out problems per task", ""]
    rows += ["| task | accuracy | TPF | TPS | forwards | tokens | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in list(result["tasks"].items()) + [("**all**", result["overall"])]:
        rows.append(f"| {name} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} | "
                    f"{r['tokens_per_second']:.1f} | {r['forwards']} | {r['tokens']} | {r['seconds']:.2f} |")
    return "\n".join(rows)
