"""The results of a bench script as JSON: each finished case appended to the --json file at once
(record), so a run cut short keeps what it measured, and the whole payload at the end (finish)."""

import json
import os
import sys
from pathlib import Path


def write_json(path, payload, quiet=False):
    """Writes through a temporary file and a rename, so that a run killed mid-write leaves the last
    complete file."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")


# A benchmark cut short (the GPU check's time limits) must keep what it measured: the --json file is
# registered as it is parsed, every finished case is appended to it at once, and finish() replaces
# the partial payload with the whole one.
_progress = {"path": None, "cases": []}


def json_path(path):
    """argparse type of --json: registers the file that record() appends to."""
    _progress["path"], _progress["cases"] = path, []
    return path


def record(name, result):
    """Appends one finished case to the --json file, which stays valid JSON after every case
    ({"bench", "complete": false, "cases"} until finish())."""
    _progress["cases"].append({"case": name, **result})
    if _progress["path"]:
        write_json(
            _progress["path"],
            {"bench": Path(sys.argv[0]).stem, "complete": False, "cases": _progress["cases"]},
            quiet=True,
        )


def finish(bench, env, args, bandwidth, results, tables, notes):
    """Prints the notes and writes the JSON payload every bench script returns."""
    for n in notes:
        print("note:", n)
    payload = {
        "bench": bench,
        "complete": True,
        "env": env,
        "args": vars(args),
        "bandwidth": bandwidth,  # the yardsticks (timing.bandwidth_yardsticks) where the bench measures them
        "results": results,
        "tables": tables,
        "notes": notes,
        "cases": _progress["cases"],
    }
    write_json(args.json, payload)
    return payload
