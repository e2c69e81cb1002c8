"""The one-command GPU check (tools/check_gpu.py), tested on the CPU.

- `--check-gpu --dry-run`: the three steps at toy sizes, one table, the JSON; without a GPU
  and without --dry-run, one line (slow).
- The budget: each command's limit is its share of the time left, counted from the
  command's start; the preparation (the model folders, pip) runs as limited commands.
- A command past its limit is stopped with every process under it: a shell's background
  job, and a real `torchrun`'s worker, which runs in a session of its own (slow).
- A slow kernel path is a row of the table; the phase timings wait for CUDA only where it
  is in use.

Run:  python -m pytest -q tests/test_check_gpu.py
      python -m pytest -q -m slow tests/test_check_gpu.py
"""
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import report
from tools import bench_kernels, check_gpu


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, check=True).stdout


@pytest.mark.slow
def test_check_gpu_dry_run_and_its_one_line_without_a_gpu(tmp_path):
    """`python -m tools.bench_ppo --check-gpu --dry-run`: the three steps at toy sizes on the
    CPU, one table, the JSON; without --dry-run on a machine with no GPU, one line and status 1."""
    out = run("-m", "tools.bench_ppo", "--check-gpu", "--dry-run", "--out",
              str(tmp_path / "gc.json"), timeout=900)
    report = json.loads((tmp_path / "gc.json").read_text())
    assert report["dry_run"] and report["tests"]["ok"] and report["kernels"]["ok"]
    assert set(report["kernels"]["sizes"]["64x4097"]) >= {"naive", "fallback", "fused-linear"}
    assert report["ppo"]["tiny fp32"]["ok"] and report["ppo"]["tiny fp32"]["ratio"] == [1, 1]
    assert report["ppo"]["tiny fp32 torchrun"]["ok"]                   # parallel.py's path
    assert "3. PPO iterations" in out and "DRY RUN" in out
    if not torch.cuda.is_available():
        result = subprocess.run([sys.executable, "-m", "tools.bench_ppo", "--check-gpu"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 1
        assert result.stderr.strip().splitlines() == [
            "tools.bench_ppo: error: no GPU found (torch.cuda.is_available() is False); "
            "--dry-run checks the command on the CPU"]


def test_the_gpu_checks_limits_share_out_the_time_left_within_the_budget():
    """300 s and the shares pip 10, tests 60, kernels 70, 4 PPO variants 40 each: where each
    command takes its whole limit, the limits are the shares and sum to 300; where the tests
    end after 30 s, the kernels get 70/230 of the 260 s left, and the 4 variants the rest."""
    clock = [0.0]
    deadline = check_gpu.Deadline(300, planned=300, clock=lambda: clock[0])
    limits = []
    for share in (10, 60, 70, 40, 40, 40, 40):
        limits.append(deadline.limit(share))
        clock[0] += limits[-1]
    assert limits == pytest.approx([10, 60, 70, 40, 40, 40, 40]) and clock[0] == pytest.approx(300)
    clock[0] = 0.0
    deadline = check_gpu.Deadline(300, planned=300, clock=lambda: clock[0])
    assert deadline.limit(10) == pytest.approx(10)
    clock[0] = 10.0
    assert deadline.limit(60) == pytest.approx(60)
    clock[0] = 40.0                                     # the tests took 30 s of their 60
    assert deadline.limit(70) == pytest.approx(260 * 70 / 230)          # 79.13 s
    clock[0] = 40.0 + 260 * 70 / 230
    assert deadline.limit(40) == pytest.approx((300 - clock[0]) / 4)     # 45.22 s each


def test_a_command_past_its_limit_is_stopped_with_every_process_it_started():
    """A shell that starts a background `sleep` (as torchrun starts its workers) and waits:
    at the 1 s limit the whole process group is killed, the grandchild with it."""
    code, output = check_gpu.Deadline(2, planned=2).run(
        ["sh", "-c", "sleep 100 & echo $!; sleep 100"], 1)
    assert code is None and output.splitlines()[-1] == "over 1 s, skipped"
    grandchild = Path(f"/proc/{int(output.split()[0])}/stat")
    for _ in range(50):                 # gone, or a zombie that init has yet to reap
        if not grandchild.exists() or grandchild.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"{grandchild.parent.name} still runs after the timeout")


def gone(pid):
    """Whether process `pid` has ended (gone, or a zombie that its parent has yet to reap)."""
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True


@pytest.mark.slow
def test_a_real_torchrun_past_its_limit_is_stopped_with_its_workers(tmp_path):
    """torchrun starts its workers in sessions of their own, out of its process group's
    reach (and they hold the output pipe open): at the 30 s limit the worker is killed too,
    and the call returns within a few seconds of the limit, not when the worker would have
    ended (60 s)."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, time\nprint('WORKER', os.getpid(), flush=True)\n"
                      "time.sleep(60)\n")
    start = time.monotonic()
    code, output = check_gpu.Deadline(30, planned=1).run(
        ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
         str(worker)], 1)
    took = time.monotonic() - start
    assert code is None and output.splitlines()[-1] == "over 30 s, skipped"
    pid = int(next(line for line in output.splitlines() if line.startswith("WORKER")).split()[1])
    assert took < 30 + 5, took
    assert gone(pid), f"the worker {pid} still runs after the limit"


def test_the_gpu_checks_preparation_runs_within_its_budget(tmp_path, monkeypatch):
    """The model folders are written by a command under the check's limits, not in the
    check's own process, where no limit reaches; the budget counts from the command's start
    (before `import torch`), not from when the steps begin."""
    commands = []

    class Recording(check_gpu.Deadline):
        def run(self, command, share):
            commands.append((command[:4], share))
            return 0, ""

    def in_process(*args):
        raise AssertionError("loaders.save_architecture ran in the check's own process")
    monkeypatch.setattr(check_gpu.loaders, "save_architecture", in_process)
    check_gpu.prepare(tmp_path, Recording(300, planned=20))
    assert commands == [(["python", "-m", "tools.check_gpu", "--save-architecture"],
                         check_gpu.SHARES["models"]),
                        (["python", "-m", "pip", "download"], check_gpu.SHARES["pip"])]
    clock = [100.0]
    deadline = check_gpu.Deadline(300, planned=300, clock=lambda: clock[0], start=90.0)
    assert deadline.limit(300) == pytest.approx(290)          # 10 s went before the steps


def test_phase_timings_wait_for_cuda_only_where_cuda_is_in_use(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: waits.append(1))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)       # the CPU, MPS
    lap = report.Laps()
    lap("generate")
    assert set(lap.row()) == {"seconds_generate", "seconds"} and waits == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    lap = report.Laps()
    lap("generate")
    lap("score")
    lap.row()
    assert len(waits) == 4                      # the start, two laps, the row


def test_the_gpu_check_bounds_a_slow_path_as_a_row(monkeypatch, capsys):
    """A command past its limit (or past what is left of the check's budget) is stopped and
    says so; a kernel path past --path-timeout is a row of the table, not the end of it."""
    deadline = check_gpu.Deadline(60, planned=60)
    start = time.time()
    code, output = deadline.run(["python", "-c", "import time; time.sleep(30)"], 1)
    assert code is None and output == "over 1 s, skipped" and time.time() - start < 15
    assert deadline.run(["python", "-c", "print('hi')"], 30) == (0, "hi\n")
    assert check_gpu.Deadline(-5, planned=30).run(["python", "-c", "print('hi')"], 30) == (
        None, "no time left in the budget, skipped")

    def measure(path, rows, V, device, dtype, timeout):
        if path == "compiled-linear":
            raise bench_kernels.TooSlow(f"over {timeout:g} s, skipped")
        return {"seconds": 0.01, "extra_bytes": 2**20}
    monkeypatch.setattr(bench_kernels, "measure", measure)
    paths = ["naive", "naive-linear", "fused-linear", "compiled-linear"]
    res = bench_kernels.bench_size(64, 128, paths, "cuda", "float32", rounds=2, timeout=25)
    assert res["compiled-linear"] == {"skipped": "over 25 s, skipped"}
    assert res["fused-linear"]["seconds"] == 0.01
    bench_kernels.print_table({(64, 128): res})
    table = capsys.readouterr().out
    assert "compiled-linear | naive-linear | over 25 s, skipped" in table     # its row
    assert table.count("compiled-linear at 64x128: over 25 s") == 1   # tried once, not twice
