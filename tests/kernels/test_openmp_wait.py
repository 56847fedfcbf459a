"""dinfer_kernels/_openmp_wait.py: OpenMP's wait policy set before torch loads the runtime, left alone
when the user chose one, and not claimed when torch came first; and that the policy it sets is the
one the runtime runs (its worker thread sleeps between parallel regions instead of spinning).

Each case runs in a fresh interpreter, so that the import order is the real one (this process has
long loaded torch)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# Prints the policy state and environment, then (with `regions`) runs that many torch parallel
# regions back to back on a team of 2 and reports the voluntary context switches of the team's
# worker thread: a worker that sleeps between regions switches about once per region, a spinning
# one catches the next region before its spin ends and hardly ever does.
PROBE = """
import json, os, sys
first = sys.argv[1]
if first == "torch":
    import torch
import dinfer_kernels
import torch
from dinfer_kernels import _openmp_wait

def voluntary_switches():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            out[int(tid)] = next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
    return out

result = {"state": _openmp_wait.STATE, "env": {v: os.environ.get(v) for v in %(variables)r}}
regions = int(sys.argv[2])
if regions:
    torch.set_num_threads(2)
    a, b = torch.ones(1 << 20), torch.ones(1 << 20)
    c = torch.add(a, b)  # the team's worker thread starts here
    before = voluntary_switches()
    for _ in range(regions):
        torch.add(a, b, out=c)  # 1M elements, over torch's grain size: one parallel region each
    after = voluntary_switches()
    workers = [t for t in after if t != os.getpid() and t in before]
    result["worker_switches"] = sum(after[t] - before[t] for t in workers)
    result["workers"] = len(workers)
print(json.dumps(result))
""" % {"variables": POLICY_VARIABLES}


def probe(first="dinfer_kernels", regions=0, **env):
    """Runs PROBE with the policy variables removed from the environment, then `env` added."""
    base = {k: v for k, v in os.environ.items() if k not in POLICY_VARIABLES and k != "OMP_NUM_THREADS"}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", PROBE, first, str(regions)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sets_passive_when_unset_and_first():
    got = probe()
    assert got["state"] == "set"
    assert got["env"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}


def test_dinfer_sets_it_before_its_own_torch_import():
    # dinfer/__init__.py imports torch through its modules: dinfer_kernels must come first there
    got = probe(first="dinfer")
    assert got["state"] == "set" and got["env"]["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize("variable,value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "123")])
def test_leaves_a_users_policy_alone(variable, value):
    got = probe(**{variable: value})
    assert got["state"] == "user"
    assert got["env"] == {v: (value if v == variable else None) for v in POLICY_VARIABLES}


def test_too_late_after_torch_sets_nothing():
    # the runtime read its environment when torch loaded it: a variable set now would claim a policy
    # the process does not run
    got = probe(first="torch")
    assert got["state"] == "late"
    assert got["env"] == {v: None for v in POLICY_VARIABLES}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a team of 2 needs 2 cores to spin")
def test_the_runtime_runs_the_policy():
    regions = 200
    passive = probe(regions=regions)
    assert passive["workers"] >= 1
    # asleep after (almost) every region; at most a few regions caught by a wake-up in flight
    assert passive["worker_switches"] >= regions // 2, passive
    # the spinning default (libgomp's own spin count, given explicitly so dinfer leaves it): the
    # worker catches back-to-back regions while it spins
    spinning = probe(regions=regions, GOMP_SPINCOUNT="300000")
    assert spinning["state"] == "user"
    assert spinning["worker_switches"] < passive["worker_switches"] // 2, (spinning, passive)
