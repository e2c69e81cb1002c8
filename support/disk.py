"""What the scripts do to the disk besides computing: one process per run folder, room checked
before a long run, and every file either whole or absent, a failed write reported in one line.

A run folder is the --out of `ppo.py` (a run, or a sweep and each run in it) and of
`reward_model.py`. Three things can lose its work; each has one answer here:
    1. Two processes writing one folder. `holding(folders)` locks each folder for this
       process until the block ends: a lock file `.NAME.lock` beside the folder, under
       `flock`, which the operating system drops when the process dies (kill -9 included),
       so nothing is left to clean up by hand. A second process that wants the folder, for
       a new run, --resume or --force, stops at once with one line naming the folder and
       the process that holds it. Under torchrun rank 0 holds the locks. What a killed run
       left of its temporaries (3. below: a folder being made, an old one moved aside, a
       file being written) is removed by the next process that takes the lock
       (`remove_stale`): every writer holds a folder first, so none of them is a live run's.
    2. A disk too full for the results. `check_room(folder, need, what)` refuses a run in one
       line (needed, free, where) before its long part starts; each script says what it will
       write (report.run_bytes, reward_model.saved_bytes).
    3. A write that fails anyway (another process filled the disk, a read-only or vanished
       mount). Every file is written aside and renamed into place (`replacing`, and
       `write_aside` for a folder), so a failure leaves the previous file or folder as it
       was and nothing half-written that a later run could read back; `writing` turns the
       failure into a `WriteError`: one line naming the file and the free space, exit 1.

Locks on shared filesystems: `flock` is local to one machine on most Linux filesystems
(tested here on ext4 and tmpfs; xfs and btrfs are local the same way). On NFS, Linux
clients turn it into an NFS lock that holds across machines (NFSv4, or v3 with lockd), but
not on a mount with `nolock` or `local_lock=flock` (or `all`), where it only guards one
client; a client that dies holds its locks until the server's lease ends (90 s by default
on NFSv4). Lustre needs `-o flock`. Where the filesystem refuses locks, the run goes on
with one warning line, unguarded. NFS and Lustre were not tested here.

Used by: ppo.py, reward_model.py, support/report.py, support/heldout.py, loaders.py, tools.
Tests: tests/test_disk.py.
"""

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from support import cli
from support import parallel

# ------------------------------------------------------------------- 1. one process a folder


class FolderInUse(cli.UserError):
    """Another live process holds the run folder."""


def lock_path(folder):
    """The lock file of `folder`: beside it, so that a folder renamed into place
    (write_aside) keeps its lock."""
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.lock"


@contextlib.contextmanager
def holding(folders):
    """Hold every folder in `folders` for this process until the block ends (rank 0 under
    torchrun; the other ranks write nothing). Raises FolderInUse at once when another
    process holds one of them."""
    if not parallel.is_main():
        yield
        return
    with contextlib.ExitStack() as stack:
        for folder in dict.fromkeys(Path(f).resolve() for f in folders):
            stack.enter_context(_holding(folder))
        yield


@contextlib.contextmanager
def _holding(folder):
    path = lock_path(folder)
    made = [p for p in path.parents if not p.exists()]       # nearest first
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _lock(path, folder)
        if fd is not None:                        # held: no live run is writing beside it
            remove_stale(folder)
        try:
            yield
        finally:
            _unlock(fd, path)
    finally:
        for parent in made:                                   # folders made for the lock only
            with contextlib.suppress(OSError):
                parent.rmdir()                                # not if the run filled them


def _lock(path, folder):
    """Open and flock `path`; None where the filesystem has no locks (a warning is printed)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUse(f"{folder} is in use by {_holder(path)}; wait for it to end, "
                              "or pass another --out") from None
        except OSError as error:                  # ENOLCK, EOPNOTSUPP: no locks on this mount
            os.close(fd)
            print(f"warning: cannot lock {folder} ({error.strerror}); nothing stops another "
                  "process from writing it at the same time", file=sys.stderr)
            return None
        # The previous holder removes the file as it ends: if it went between our open and our
        # flock, we hold a file nobody else can see. Then start again with a new one.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                         "command": " ".join(sys.argv),
                                         "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
                return fd
        os.close(fd)


def _unlock(fd, path):
    if fd is None:
        return
    with contextlib.suppress(OSError):            # remove it while still held: see _lock
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            path.unlink()
    os.close(fd)


# The hidden temporaries of section 3, by name: a folder being made (write_aside:
# .NAME.tmp-XXXXXXXX, mkdtemp's 8 characters), an old one moved aside (publish: .NAME.old-PID),
# a file being written (replacing: .STEM.XXXXXXXX.tmp.SUFFIX).
FOLDER_TEMPORARY = r"\.(?P<name>{name})\.(?:tmp-[a-z0-9_]{{8}}|old-\d+)"
FILE_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp(?:\.[^.]+)?")


def remove_stale(folder):
    """Remove what killed runs left of their temporaries for `folder`: its own, beside it,
    and inside it those of its files and of the folders no lock names (a checkpoint). Call
    it holding `folder`: every process that makes them holds the folder first (a folder
    inside with a lock file may be another live process's), so none is a live run's. Prints
    one line if any."""
    folder = Path(folder)
    beside = re.compile(FOLDER_TEMPORARY.format(name=re.escape(folder.name)))
    inside = re.compile(FOLDER_TEMPORARY.format(name=".+"))

    def unheld(match):
        return match and not (folder / f".{match['name']}.lock").exists()
    stale = [p for p in _entries(folder.parent) if beside.fullmatch(p.name)] + [
        p for p in _entries(folder) if unheld(inside.fullmatch(p.name)) and p.is_dir()
        or FILE_TEMPORARY.fullmatch(p.name) and p.is_file()]
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    if stale:
        print(f"removed what a stopped run left of {folder}: "
              + ", ".join(p.name for p in stale))


def _entries(folder):
    try:
        return [p for p in folder.iterdir() if p.name.startswith(".")]
    except OSError:                               # not there yet, or not a folder
        return []


def _holder(path):
    """'process 1234 on host (python ppo.py ..., since ...)', from the lock file."""
    for _ in range(20):                           # a holder writes its name just after locking
        with contextlib.suppress(OSError, ValueError):
            who = json.loads(Path(path).read_text())
            return (f"process {who['pid']} on {who['host']} ({who['command']}, since "
                    f"{who['since']})")
        time.sleep(0.05)
    return f"another process (lock file {path})"


# ---------------------------------------------------------------------- 2. room before a run


class NoRoom(cli.UserError):
    """The filesystem at --out has less free space than the run will write."""


def check_room(folder, need, what):
    """Refuse in one line when the filesystem of `folder` has less than `need` bytes free."""
    if not parallel.is_main():
        return
    free, where = cli.free_bytes(folder)
    if free < need:
        raise NoRoom(f"no room for {what}: it needs about {cli.megabytes(need)} and {where} "
                     f"has {cli.megabytes(free)} free; free some space or pass another --out")


# ---------------------------------------------------------- 3. whole files, failures in a line


UMASK = os.umask(0o022)                               # read it: there is no other way
os.umask(UMASK)


def sync(path):
    """Flush `path` to the disk: on NFS and some local filesystems a full disk shows only now,
    and a rename after it never publishes a file whose bytes are still in memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path):
    """Yield a hidden path beside `path` to write; when the block ends it replaces `path` in
    one rename. If anything fails, `path` stays as it was and the hidden file goes."""
    path = Path(path)
    with cli.writing(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.",
                                   suffix=f".tmp{path.suffix}")
        os.fchmod(fd, 0o666 & ~UMASK)               # as open() would make it, not mkstemp's 0600
        os.close(fd)
        try:
            yield Path(tmp)
            sync(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def write_text(path, text):
    """A text file, whole or not at all."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path, obj):
    """JSON, whole or not at all. Under torchrun rank 0 alone writes (parallel.py)."""
    if parallel.is_main():
        write_text(path, json.dumps(obj, indent=1))


def save_figure(fig, path, **savefig):
    """A matplotlib figure as PNG, whole or not at all."""
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", **savefig)


def publish(staging, out):
    """Rename a finished folder into place; an older `out` is moved aside first and removed
    after. Every file is synced first, so a full disk fails here, before `out` is touched."""
    out = Path(out).resolve()
    for file in (p for p in staging.rglob("*") if p.is_file()):
        with cli.writing(file):
            sync(file)
            file.chmod(0o666 & ~UMASK)           # as open() makes them (some writers: 0600)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    staging.chmod(0o755)                         # mkdtemp made it private (0700)
    with cli.writing(out):
        if out.exists():
            out.rename(old)
        staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def write_aside(out, make):
    """`make(folder)` fills a hidden folder beside `out`, renamed to `out` when it returns
    (`publish`); a failure removes it and any folder made for it, so `out` is left as it
    was. Under torchrun only rank 0 writes: the others make into a scratch folder that goes.
    Returns what `make` returned."""
    if not parallel.is_main():
        with tempfile.TemporaryDirectory() as scratch:
            make(Path(scratch))
        return None
    out = Path(out).resolve()
    with cli.new_folders(out.parent):
        with cli.writing(out.parent):
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            made = make(staging)
            publish(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return made
