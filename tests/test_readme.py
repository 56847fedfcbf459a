"""Every example of README.md runs and prints what the README shows.

The README's fenced blocks follow one convention:
- ```console: each line starting with "$ " is a command, run by bash in the repository root; the
  lines after it, up to the next "$ " line or the block's end, are exactly its standard output.
- ```python: run as a script in the repository root; when the next block is a ```text block, that
  block is exactly its standard output.
- any other fence (```bash: installs, the test command, checkpoint paths, servers, GPUs; ```text
  not after a python block; ```py) is not run.
Commands run offline, on the embedded models, with this checkout first on PYTHONPATH.
"""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
TIMEOUT_S = 300  # the slowest example (an eval line) takes ~15 s on a 2-core CPU
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def blocks(text: str):
    """[(info word, body, line of the opening fence, what lies between it and the next block)]."""
    found = list(FENCE.finditer(text))
    return [
        (m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, text[m.end() : n.start() if n else None])
        for m, n in zip(found, found[1:] + [None])
    ]


def examples(text: str):
    """[(kind, code, expected stdout or None, README line)]: the console commands and python scripts."""
    found, parsed = [], blocks(text)
    for i, (info, body, line, after) in enumerate(parsed):
        if info == "console":
            command = None
            for j, row in enumerate(body.splitlines()):
                if row.startswith("$ "):
                    command = [row[2:], [], line + 1 + j]
                    found.append(command)
                elif command is None:
                    raise ValueError(f"README.md:{line + 1 + j}: output before any '$ ' command")
                else:
                    command[1].append(row + "\n")
        elif info == "python":
            nxt = parsed[i + 1] if i + 1 < len(parsed) else None
            shown = nxt[1] if nxt is not None and nxt[0] == "text" and not after.strip() else None
            found.append(["python", body, shown, line])
    return [("console", c[0], "".join(c[1]), c[2]) if len(c) == 3 else tuple(c) for c in found]


def _env():
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=REPO + (os.pathsep + path if path else ""), HF_HUB_OFFLINE="1")


with open(README, encoding="utf-8") as f:
    EXAMPLES = examples(f.read())


@pytest.mark.parametrize(
    "kind,code,shown", [e[:3] for e in EXAMPLES], ids=[f"README.md:{e[3]}" for e in EXAMPLES]
)
def test_readme_example(kind, code, shown, tmp_path):
    if kind == "console":
        argv = ["bash", "-o", "pipefail", "-c", code]
    else:
        script = tmp_path / "example.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    p = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"{code}\nexit status {p.returncode}:\n{p.stderr[-3000:]}"
    if shown is not None:
        assert p.stdout == shown, f"{code}\nprinted:\n{p.stdout}\nthe README shows:\n{shown}"


def test_the_readme_has_checked_examples():
    # The parse itself: the README shows answers, and a block of each runnable kind is found.
    kinds = {kind for kind, _, shown, _ in EXAMPLES if shown is not None}
    assert kinds == {"console", "python"}


def test_the_parse_follows_the_convention():
    text = (
        "```console\n$ echo a\na\n$ true\n```\n\n```python\nprint(1)\n```\n\n```text\n1\n```\n"
        "```bash\nrm -rf /\n```\n```python\nx = 1\n```\nprose\n```text\nnot its output\n```\n"
    )
    assert examples(text) == [
        ("console", "echo a", "a\n", 2),
        ("console", "true", "", 4),
        ("python", "print(1)\n", "1\n", 7),
        ("python", "x = 1\n", None, 17),
    ]
