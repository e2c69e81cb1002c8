"""Nothing lost when two runs share a folder or the disk fills (support/disk.py).

- Two real processes on one folder, each order of start: ppo.py (a new run against
  --force), reward_model.py (two seeds), a sweep against a run inside it. The second stops
  at once with one line naming the folder and the first's process id; after kill -9 of the
  holder a new run takes the folder (the kernel dropped the lock), and removes what the
  killed run left of its temporaries (never a live run's).
- Room: a run that cannot fit stops before its long part with one line (needed, free,
  where), on a patched free-space reading and, where this process may mount one, on a real
  small filesystem.
- A write that fails mid-run (no space, read-only, no permission, a path through a file):
  one line naming the file, exit status 1, no traceback; the last checkpoint and
  results.json whole, no hidden file left; and after a full disk, --resume continues to the
  numbers of an uninterrupted run.
The real small filesystems are tmpfs mounts: they need root (CI and this machine have it)
and are skipped elsewhere; the patched cases run everywhere. Real processes and tiny runs
are marked slow (`pytest -m slow`); the pieces run with plain `pytest`.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError

import ppo
import reward_model as rm
from lora import adapter_numel
from support import cli, disk, report

ROOT = Path(__file__).resolve().parent.parent


def ppo_args(tiny_reward_model, small_data, out, *more):
    return ["ppo.py", "--preset", "tiny", "--reward-model", str(tiny_reward_model),
            "--data-dir", str(small_data), "--out", str(out), *map(str, more)]


def start(args):
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def wait_until_held(folder, process, timeout=120):
    """Until `process` holds `folder` (its pid in the lock file)."""
    path, deadline = disk.lock_path(folder), time.time() + timeout
    while time.time() < deadline:
        with contextlib.suppress(OSError):
            if json.loads(path.read_text() or "{}").get("pid") == process.pid:
                return
        if process.poll() is not None:
            raise AssertionError(f"the holder ended first:\n{process.communicate()}")
        time.sleep(0.02)
    raise AssertionError(f"{folder} was never held")


def refused_in_one_line(done, folder, holder_pid):
    """Exit 1, no traceback, and a last line naming the folder and the holder's pid."""
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"{Path(folder).resolve()} is in use by process {holder_pid} " in last
    return last


def kill_hard(process):
    process.kill()                                   # SIGKILL: no cleanup of any kind
    process.communicate()


# ------------------------------------------------------------------ two processes, one folder

@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 1])
def test_two_ppo_runs_one_folder_the_second_stops_at_once(tiny_reward_model, small_data,
                                                          tmp_path, first):
    """A new run and a --force run of another beta, each started first once."""
    out = tmp_path / "run"
    runs = [ppo_args(tiny_reward_model, small_data, out, "--beta", "0", "--iterations", 1000),
            ppo_args(tiny_reward_model, small_data, out, "--beta", "0.5", "--force",
                     "--iterations", 1000)]
    holder = start(runs[first])
    try:
        wait_until_held(out, holder)
        began = time.time()
        done = finish(runs[1 - first][:-2] + ["--iterations", "2"])
        last = refused_in_one_line(done, out, holder.pid)
        assert time.time() - began < 60 and "pass another --out" in last   # no model loaded
        assert holder.poll() is None                 # the holder runs on, untouched
    finally:
        kill_hard(holder)
    # kill -9 left the lock file but no lock: a new run takes the folder
    done = finish(runs[1 - first][:-2] + ["--iterations", "2", "--force"])
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "results.json").read_text())["config"]["iterations"] == 2
    assert not disk.lock_path(out).exists()          # released and removed at the end


@pytest.mark.slow
@pytest.mark.parametrize("first", [0, 1])
def test_two_reward_models_one_folder_the_second_stops_at_once(tmp_path, data_dir, first):
    out = tmp_path / "rm"
    runs = [["reward_model.py", "--preset", "tiny", "--out", str(out)],
            ["reward_model.py", "--preset", "tiny", "--seed", "1", "--out", str(out)]]
    holder = start(runs[first])
    try:
        wait_until_held(out, holder)
        refused_in_one_line(finish(runs[1 - first]), out, holder.pid)
    finally:
        kill_hard(holder)
    assert not out.exists()                          # it had not published; the other refused
    if first:                                        # once is enough for a 30 s run
        done = finish(runs[0])
        assert done.returncode == 0, done.stderr
        assert json.loads((out / "config.json").read_text())["seed"] == 0


@pytest.mark.slow
def test_a_sweep_and_a_run_inside_it(tiny_reward_model, small_data, tmp_path):
    """--resume on a sweep that another process runs stops at once; so does a run of one
    of its folders, and a sweep over a folder that a single run holds."""
    sweep = tmp_path / "sweep"
    args = ppo_args(tiny_reward_model, small_data, sweep, "--beta", "0", "0.5",
                    "--iterations", 1000)
    holder = start(args)
    try:
        wait_until_held(sweep, holder)
        refused_in_one_line(finish(args + ["--resume"]), sweep, holder.pid)
        inside = sweep / "beta0.5_seed0"
        refused_in_one_line(finish(ppo_args(tiny_reward_model, small_data, inside,
                                            "--beta", "0.5")), inside, holder.pid)
    finally:
        kill_hard(holder)
    one = ppo_args(tiny_reward_model, small_data, sweep / "beta0.5_seed0", "--beta", "0.5",
                   "--iterations", 1000, "--force")
    holder = start(one)
    try:
        wait_until_held(sweep / "beta0.5_seed0", holder)
        refused_in_one_line(finish(args + ["--force"]), sweep / "beta0.5_seed0", holder.pid)
    finally:
        kill_hard(holder)


def test_the_lock_is_released_and_a_stale_lock_file_is_taken(tmp_path):
    """In one process: held, refused to a second holder (another open file), released;
    a lock file left by a killed process (no lock on it) is taken; folders made only for
    the lock file go with it."""
    folder = tmp_path / "made" / "run"
    with disk.holding([folder]):
        who = json.loads(disk.lock_path(folder).read_text())
        assert who["pid"] == os.getpid() and who["command"]
        with pytest.raises(disk.FolderInUse, match=f"is in use by process {os.getpid()} "):
            with disk.holding([folder]):
                pass
    assert not (tmp_path / "made").exists()
    disk.lock_path(tmp_path / "run").write_text('{"pid": 1}')          # kill -9 left it
    with disk.holding([tmp_path / "run"]):
        assert json.loads(disk.lock_path(tmp_path / "run").read_text())["pid"] == os.getpid()
    assert not disk.lock_path(tmp_path / "run").exists()


def test_the_next_holder_removes_what_a_killed_run_left(tmp_path, capsys):
    """Taking a folder's lock removes its temporaries that a killed run left: beside it (a
    folder being made, an old one moved aside) and inside it (a checkpoint being made, a file
    being written); not another folder's, not one that a lock file says is held, not the
    lock file, not the run's own files."""
    runs, run = tmp_path / "runs", tmp_path / "runs" / "sft"
    stale = [runs / ".sft.tmp-k9_x2ab7", runs / ".sft.old-4242", run / ".checkpoint.tmp-a1b2c3d4"]
    kept = [runs / ".sft2.tmp-k9_x2ab7", runs / "sft.tmp-k9_x2ab7", run / ".sub.tmp-a1b2c3d4",
            run / "checkpoint"]
    for folder in stale + kept:
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    (run / ".results.ab12cd34.tmp.json").write_text("{")             # stale too
    (run / "results.json").write_text("{}")
    (run / ".sub.lock").write_text('{"pid": 1}')                      # sub is held elsewhere
    with disk.holding([run]):
        left = sorted(str(p.relative_to(runs)) for p in runs.rglob("*")
                      if p.name != "model.safetensors")
    assert left == sorted(["sft", ".sft.lock", "sft/results.json", "sft/.sub.lock",
                           *(str(p.relative_to(runs)) for p in kept)])
    line = capsys.readouterr().out.splitlines()
    assert len(line) == 1 and line[0].startswith(f"removed what a stopped run left of {run}: ")


@pytest.mark.slow
def test_a_killed_runs_folder_in_the_making_goes_with_the_next_run_never_a_live_ones(
        tmp_path):
    """A process making --out (write_aside) holds it: a second stops and leaves its folder in
    the making alone. After kill -9 the folder stays, until the next run takes the lock."""
    out = tmp_path / "sft"
    code = ("import sys, time\nfrom support import disk\nwith disk.holding([sys.argv[1]]):\n"
            "    disk.write_aside(sys.argv[1], lambda staging: print(staging, flush=True) "
            "or time.sleep(300))")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        staging = Path(holder.stdout.readline().strip())
        assert staging.parent == tmp_path and staging.name.startswith(".sft.tmp-")
        with pytest.raises(disk.FolderInUse):
            with disk.holding([out]):
                pass
        assert staging.is_dir()                                       # a live run's: kept
    finally:
        kill_hard(holder)
    assert staging.is_dir()                                           # kill -9: left behind
    with disk.holding([out]):
        assert not staging.exists()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------- room before a run

def with_free(monkeypatch, free):
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))


def exit_line(main, argv):
    """What `python SCRIPT ARGV` prints as its last line, run here through cli.run_script."""
    with pytest.raises(SystemExit) as stop:
        cli.run_script(main, argv)
    return str(stop.value.code)


def test_no_room_for_a_ppo_run_or_a_sweep(tiny_judge, small_data, tiny, tmp_path,
                                          monkeypatch):
    """One run asks for report.run_bytes; a sweep of 4 for 4 of them and half of one more
    (its baseline and table)."""
    with_free(monkeypatch, 100_000)
    argv = ppo_args(tiny_judge, small_data, tmp_path / "out")[1:]
    one = report.run_bytes(adapter_numel(tiny), tiny.config.hidden_size, ppo.parse_args(argv))
    line = exit_line(ppo.main, argv)
    assert line == (f"ppo.py: error: no room for 1 run in {tmp_path / 'out'}: it needs about "
                    f"{cli.megabytes(one)} and {tmp_path} has 0.1 MB free; free some space or "
                    "pass another --out")
    line = exit_line(ppo.main, argv + ["--beta", "0", "0.5", "--seeds", "0", "1"])
    assert line.startswith(f"ppo.py: error: no room for 4 runs in {tmp_path / 'out'}: it needs "
                           f"about {cli.megabytes(4 * one + one // 2)} and ")
    assert list(tmp_path.iterdir()) == []                # nothing made, no lock file left


def test_no_room_for_the_reward_model(tmp_path, data_dir, monkeypatch):
    with_free(monkeypatch, 5_000_000)
    line = exit_line(rm.main, ["--preset", "tiny", "--out", str(tmp_path / "rm")])
    assert line.startswith("reward_model.py: error: no room for the reward model in ")
    assert re.search(r"needs about 1\d\.\d MB and .* has 5.0 MB free", line), line
    assert list(tmp_path.iterdir()) == []


@pytest.fixture()
def small_filesystem(tmp_path):
    """A function that mounts a tmpfs of the given size (kB) and returns its folder;
    unmounted after the test. Skips where this process may not mount."""
    mounts = []

    def mount(kilobytes, name="disk"):
        folder = tmp_path / name
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kilobytes}k", "tmpfs",
                               str(folder)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()})")
        mounts.append(folder)
        return folder

    yield mount
    for folder in mounts:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.slow
def test_no_room_on_a_real_small_filesystem(tiny_reward_model, small_data, small_filesystem):
    disk_ = small_filesystem(256)
    done = finish(ppo_args(tiny_reward_model, small_data, disk_ / "run"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no room for 1 run in " in done.stderr.splitlines()[-1]
    done = finish(["reward_model.py", "--preset", "tiny", "--out", str(disk_ / "rm")])
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no room for the reward model in " in done.stderr.splitlines()[-1]
    assert os.listdir(disk_) == []


# ------------------------------------------------------------------ a write that fails mid-run

def hidden(folder):
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob(".*"))


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_then_resume(tiny_reward_model, small_data, tmp_path,
                                               small_filesystem):
    """A real full disk: a 2 MB tmpfs fills (another 'process' writes) once the first
    checkpoint is there. One line, exit 1; the checkpoint and results.json whole; then,
    with room again, --resume gives the numbers of a run that never stopped."""
    common = ["--beta", "0.1", "--iterations", 6, "--checkpoint-every", 2]
    straight = finish(ppo_args(tiny_reward_model, small_data, tmp_path / "straight", *common))
    assert straight.returncode == 0, straight.stderr
    disk_ = small_filesystem(2048)
    run_dir, filler = disk_ / "run", disk_ / "filler"
    process = start(ppo_args(tiny_reward_model, small_data, run_dir, *common))

    def fill():                                     # as soon as a checkpoint is there
        while not (run_dir / "checkpoint" / "state.json").exists():
            if process.poll() is not None:
                return
            time.sleep(0.005)
        with contextlib.suppress(OSError), open(filler, "wb") as sink:
            while True:
                sink.write(b"\0" * 4096)
    thread = threading.Thread(target=fill)
    thread.start()
    _, stderr = process.communicate(timeout=300)
    thread.join()
    last = stderr.strip().splitlines()[-1]
    assert process.returncode == 1 and "Traceback" not in stderr, stderr
    assert last.startswith(f"ppo.py: error: cannot write {run_dir}/") and \
        "No space left on device (0.0 MB free on " in last
    assert f"the checkpoint after 2 iterations in {run_dir} is intact" in last and \
        "--resume" in last
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["iteration"] == 1
    json.loads((run_dir / "results.json").read_text())          # whole
    assert hidden(run_dir) == []                                 # nothing half-written
    filler.unlink()
    done = finish(ppo_args(tiny_reward_model, small_data, run_dir, *common, "--resume"))
    assert done.returncode == 0, done.stderr
    a, b = (json.loads((d / "results.json").read_text()) for d in (tmp_path / "straight", run_dir))
    assert report.differences(a, b) == []


FAILURES = [(errno.ENOSPC, "No space left on device ("), (errno.EROFS, "Read-only file system"),
            (errno.EACCES, "Permission denied"), (errno.ENOTDIR, "Not a directory")]


@pytest.mark.slow
@pytest.mark.parametrize("number, reason", FAILURES)
def test_a_failed_write_of_results_is_one_line(tiny_reward_model, small_data, tmp_path,
                                               monkeypatch, number, reason):
    """The 4th write of results.json (iteration 3, after the checkpoint of iteration 1)
    fails as the OS would fail it."""
    real_sync, calls = disk.sync, []

    def sync(path):
        if Path(path).name.startswith(".results.") and len(calls) == 3:
            raise OSError(number, os.strerror(number))
        calls.append(path) if Path(path).name.startswith(".results.") else None
        real_sync(path)

    monkeypatch.setattr(disk, "sync", sync)
    run_dir = tmp_path / "run"
    argv = ppo_args(tiny_reward_model, small_data, run_dir, "--iterations", 6,
                    "--checkpoint-every", 2)[1:]
    line = exit_line(ppo.main, argv)
    assert line.startswith(f"ppo.py: error: cannot write {run_dir.resolve()}/results.json: "
                           f"{reason}")
    assert "the checkpoint after 2 iterations" in line
    results = json.loads((run_dir / "results.json").read_text())
    assert [row["iteration"] for row in results["iterations"]] == [0, 1, 2]
    assert hidden(run_dir) == []


@pytest.mark.slow
def test_a_failed_checkpoint_keeps_the_last_one(tiny_reward_model, small_data, tmp_path,
                                                monkeypatch):
    """safetensors reports a full disk as SafetensorError: the second checkpoint fails
    half-way, the first stays as it was."""
    real_save, calls = report.save_file, []

    def save_file(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 4:                      # value head and optimizer, twice
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                  "device (os error 28)")
        real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(report, "save_file", save_file)
    run_dir = tmp_path / "run"
    line = exit_line(ppo.main, ppo_args(tiny_reward_model, small_data, run_dir, "--iterations",
                                        6, "--checkpoint-every", 2)[1:])
    assert line.startswith(f"ppo.py: error: cannot write {run_dir.resolve()}/checkpoint: "
                           "No space left on device (")
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["iteration"] == 1
    assert hidden(run_dir) == []


@pytest.mark.slow
def test_the_reward_model_that_cannot_be_saved_leaves_out_as_it_was(tmp_path, data_dir,
                                                                    monkeypatch):
    def save_file(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(rm, "save_file", save_file)
    out = tmp_path / "rm"
    line = exit_line(rm.main, ["--preset", "tiny", "--out", str(out)])
    assert line.startswith(f"reward_model.py: error: cannot write {out}: No space left on "
                           "device (")
    assert list(tmp_path.iterdir()) == []                # no folder, no staging, no lock


def test_replacing_keeps_the_old_file_when_a_write_fails(tmp_path):
    path = tmp_path / "results.json"
    disk.write_json(path, {"a": 1})
    with pytest.raises(cli.WriteError, match=f"cannot write {path}: No space left on device"):
        with disk.replacing(path) as tmp:
            tmp.write_text("half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["results.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~disk.UMASK)
    with pytest.raises(ZeroDivisionError):           # a bug stays a bug, with its traceback
        with disk.replacing(path):
            1 / 0


def test_write_problem_reads_safetensors_and_os_errors(tmp_path):
    full = SafetensorError("Error while serializing: I/O error: No space left on device "
                           "(os error 28)")
    assert cli.write_problem(tmp_path / "x", full).startswith(
        f"cannot write {tmp_path / 'x'}: No space left on device (")
    assert cli.write_problem("x", OSError(errno.EROFS, "ro")) == \
        "cannot write x: Read-only file system"
    assert cli.write_problem("x", SafetensorError("header too large")) is None
    assert cli.write_problem("x", OSError(errno.EINTR, "interrupted")) is None


def test_a_full_disk_anywhere_is_one_line():
    """A write no `writing` names (a library's own file): still one line, exit 1."""
    def main(argv):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/somewhere/file")
    line = exit_line(main, [])
    assert re.fullmatch(r"test_disk.py: error: cannot write /somewhere/file: No space left on "
                        r"device \([0-9,.]+ MB free on /\)", line), line


def folder_bytes(folder):
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


@pytest.mark.slow
def test_the_estimates_bound_what_the_runs_write(tiny_reward_model, small_data, tiny,
                                                 tmp_path):
    """What check_room asks for is at least what a run leaves (a second checkpoint beside
    the first while it is written: twice the checkpoint), and not wildly more."""
    argv = ["--preset", "tiny", "--beta", "0.1", "--iterations", "6", "--checkpoint-every", "2"]
    done = finish(ppo_args(tiny_reward_model, small_data, tmp_path / "run", *argv[2:]))
    assert done.returncode == 0, done.stderr
    cfg = ppo.parse_args(argv)
    need = report.run_bytes(adapter_numel(tiny), tiny.config.hidden_size, cfg)
    written = folder_bytes(tmp_path / "run")
    checkpoint = folder_bytes(tmp_path / "run" / "checkpoint")
    assert written + checkpoint <= need <= 4 * (written + checkpoint)
    model = rm.load_reward_model(tiny_reward_model)
    assert folder_bytes(tiny_reward_model) <= rm.saved_bytes(model) \
        <= 2 * folder_bytes(tiny_reward_model)


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    """Where flock is refused (ENOLCK: an NFS mount without lockd), one warning line, and
    the run holds nothing rather than stopping."""
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(disk.fcntl, "flock", no_locks)
    with disk.holding([tmp_path / "run"]):
        pass
    err = capsys.readouterr().err
    assert err.startswith(f"warning: cannot lock {tmp_path / 'run'} (No locks available)")
