"""What a new user met (issue 38, part 8), each as the user ran it: a command in a subprocess, with a
time limit, ending in the right answer or in one clear line on stderr.

The tensor-parallel Python example without its main guard, a checkpoint without its chat template,
Ctrl-C and a killed rank under torchrun, non-UTF-8 prompts, a config too short for a default window,
a bad DINFER_CPU_ISA and `dinfer eval`'s progress bar in a log file."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = os.path.join(REPO, "dinfer", "assets", "tiny-llada-moe")
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")


def run(*args, stdin=None, timeout=120, env=None, cwd=None):
    """(exit status, stdout, stderr) of `python *args`."""
    p = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**ENV, **(env or {})},
        cwd=cwd or REPO,
    )
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    return lines[0]


# ----------------------------------------------------------------------------- tensor parallelism


def test_a_spawning_script_without_main_guard_ends_at_once_saying_so(tmp_path):
    # The README's tensor-parallel example as first written: spawn re-runs the script in rank 1,
    # which reached LLM(...) again; rank 0 used to wait 600 s for it.
    script = tmp_path / "tp.py"
    script.write_text(
        "from dinfer import LLM\n"
        "llm = LLM(tensor_parallel_size=2)\n"
        "print(llm.generate('add:048213+000937').texts)\n"
        "llm.close()\n"
    )
    start = time.monotonic()
    rc, out, err = run(str(script), timeout=180)
    assert time.monotonic() - start < 120
    assert rc != 0 and out == ""
    last = err.strip().splitlines()[-1]
    assert "rank 1 stopped at start" in last and str(script) in last
    assert 'put that code under `if __name__ == "__main__":`' in last
    assert "DistStoreError" not in err and "freeze_support" not in err


def _children(pid: int):
    """The ids of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return sorted(found)


def _torchrun_then(stop, tmp_path):
    """Starts `torchrun --nproc-per-node 2 -m dinfer generate` on many prompts (each rank's output
    in its own log files), calls stop(torchrun) once rank 0 printed an answer, and returns
    (seconds torchrun took to end after it, [each rank's stderr])."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"add:0{480000 + i}+000937\n" for i in range(400)))
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--log-dir", str(logs)]
    cmd += ["--redirects", "3", "-m", "dinfer", "generate", "--tensor-parallel", "2"]
    cmd += ["--prompts-file", str(prompts), "--batch-size", "1"]
    torchrun = subprocess.Popen(
        cmd, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not any(p.stat().st_size for p in logs.rglob("0/stdout.log")):
            assert torchrun.poll() is None and time.monotonic() < deadline, "no answer from rank 0"
            time.sleep(0.5)
        stop(torchrun)
        start = time.monotonic()
        torchrun.wait(timeout=120)
        took = time.monotonic() - start
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
    return took, [next(logs.rglob(f"{r}/stderr.log")).read_text() for r in (0, 1)]


def test_ctrl_c_under_torchrun_is_one_line(tmp_path):
    # The terminal sends SIGINT to the whole group: torchrun, which sends it again, and both ranks.
    took, (err0, err1) = _torchrun_then(lambda p: os.killpg(p.pid, signal.SIGINT), tmp_path)
    assert took < 60
    assert one_line(err0).startswith("dinfer: interrupted; ")
    assert err1 == ""


def test_a_killed_rank_under_torchrun_is_one_line_on_the_other(tmp_path):
    def kill_rank_1(torchrun):
        ranks = _children(torchrun.pid)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)

    took, (err0, err1) = _torchrun_then(kill_rank_1, tmp_path)
    assert took < 60
    line = one_line(err0)
    assert line.startswith("dinfer: error: rank 0 of 2: ") and "a rank died" in line
    assert "barrier" not in line  # the collective that failed, not a cleanup's
    assert err1 == ""


# ----------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_without_its_chat_template_is_an_error_naming_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(MOE, ckpt)
    os.remove(ckpt / "tokenizer_config.json")
    rc, out, err = run("-m", "dinfer", "generate", "--model", str(ckpt), "--prompt", "add:048213+000937")
    assert rc == 2 and out == ""
    line = one_line(err)
    assert (
        line.startswith("dinfer: error: chat: ") and "tokenizer_config.json" in line and "--no-chat" in line
    )


def test_a_config_too_short_for_a_default_window_is_the_configs_fault(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(MOE, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["max_position_embeddings"] > 16
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8}))
    rc, _, err = run("-m", "dinfer", "generate", "--model", str(ckpt), "--prompt", "add:048213+000937")
    assert rc == 2
    line = one_line(err)
    assert line.startswith(f"dinfer: error: {ckpt / 'config.json'}: the model has 8 positions")
    assert "prefix_look's default" in line and "must be <=" not in line


# ----------------------------------------------------------------------------- prompts


def test_non_utf8_stdin_names_stdin_and_the_line():
    rc, out, err = run("-m", "dinfer", "generate", stdin=b"sort:qmbxam\nadd:04\xff8213+000937\n")
    assert rc == 2 and out == ""
    assert one_line(err) == "dinfer: error: stdin: line 2 is not UTF-8 text (byte 0xff at byte 7 of the line)"


def test_a_non_utf8_prompts_file_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"sort:qmbxam\n\n\xe9add:048213+000937\n")
    rc, out, err = run("-m", "dinfer", "generate", "--prompts-file", str(path))
    assert rc == 2 and out == ""
    want = f"dinfer: error: prompts-file {str(path)!r}: line 3 is not UTF-8 text (byte 0xe9 at byte 1 of the line)"
    assert one_line(err) == want


def test_a_non_utf8_prompt_argument_is_one_line():
    rc, out, err = run("-m", "dinfer", "generate", "--prompt", os.fsdecode(b"ab\xff"))
    assert rc == 2 and out == ""
    assert one_line(err) == "dinfer: error: prompt: --prompt 1 is not UTF-8 text (at character 3)"


# ----------------------------------------------------------------------------- environment, logs


@pytest.mark.parametrize(
    "command", [("-m", "dinfer", "generate", "--prompt", "sort:qmbxam"), ("-m", "dinfer_kernels")]
)
def test_a_bad_cpu_isa_is_one_line_listing_the_supported_ones(command):
    rc, out, err = run(*command, env={"DINFER_CPU_ISA": "bogus"})
    assert rc != 0 and out == ""
    line = one_line(err)
    assert line.startswith("dinfer_kernels: error: DINFER_CPU_ISA=bogus: unknown ISA")
    assert "generic" in line  # the supported ones


def test_a_bad_cpu_isa_stays_an_import_error_a_program_can_catch():
    code = "try:\n    import dinfer_kernels\nexcept ValueError as e:\n    print(e)\n"
    rc, out, err = run("-c", code, env={"DINFER_CPU_ISA": "bogus"})
    assert rc == 0 and err == ""
    assert out.startswith("DINFER_CPU_ISA=bogus: unknown ISA") and "generic" in out


def test_eval_draws_its_bar_only_on_a_terminal_or_when_asked():
    args = ("-m", "dinfer", "eval", "--tasks", "sort", "--num-problems", "2")
    rc, out, err = run(*args)  # stderr is a pipe here, as a log file would be
    assert rc == 0 and "| sort |" in out
    assert "prompt/s" not in err and "\r" not in err
    rc, out, err = run(*args, "--progress")
    assert rc == 0 and "prompt/s" in err
