"""What both scripts do at their command line: check every flag, and report a bad input as
one line.

A reference implementation is read by people who will mistype a flag or point at the wrong
folder. So `ppo.py` and `reward_model.py`:
    1. check every flag right after parsing, before loading anything (`check_flags`, with
       the ranges each script lists next to its Config). A bad value exits with status 2 and
       one line in argparse's own format:
           ppo.py: error: argument --clip: 0.0 is outside 0 < clip < 1
    2. turn a failure to read a file (data, a reward model, a checkpoint) into a `UserError`
       that names the file and what was expected (`reading`). `run_script` prints it as one
       line and exits with status 1. Any other exception is a bug in this code and keeps its
       traceback; `--debug` (or RLHF_DEBUG=1) shows the traceback of a UserError too.
    3. leave --out as it was when they fail: `out_problem` refuses an --out that cannot be
       written before any work, and `new_folders` removes the folders a failed run made.
    4. turn a failure to write (a full disk, a read-only filesystem, no permission) into a
       `WriteError`, one line naming the file and the free space (`writing`); a full or
       read-only disk ends in one line wherever it strikes (`run_script`).
       SIGTERM (`kill`, a batch scheduler, torchrun stopping its workers) counts as a
       failure: `run_script` turns it into SystemExit, so that cleanup runs before exit.

Used by: ppo.py, reward_model.py, loaders.py, report.py, disk.py. It imports no module of
this project, so loaders.py, which support/ imports, can use it too (tests/test_layout.py).
Tests: tests/test_cli.py.
"""

import contextlib
import errno
import json
import math
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

DEBUG_ENV = "RLHF_DEBUG"


class UserError(RuntimeError):
    """Something the user can fix (a file that is missing, unreadable or of the wrong kind; a
    run that went NaN), as opposed to a bug here. Scripts print it as one line."""


# ------------------------------------------------------------------------ flag ranges

@dataclass(frozen=True)
class Range:
    """The values a numeric flag allows: low to high, each end included unless `*_open`.
    Never NaN or inf, but for `off`: the flag also takes "off", read as inf (`number_or_off`:
    ppo.py's --clip off, no clipping)."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    off: bool = False

    def __contains__(self, value):
        if self.off and value == math.inf:
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, name):
        """'0 < clip < 1', 'batch >= 1', 'lr > 0'."""
        low = f"{self.low:g} {'<' if self.low_open else '<='} "
        high = f" {'<' if self.high_open else '<='} {self.high:g}"
        if self.low == -math.inf and self.high == math.inf:
            return f"{name} finite"
        if self.high == math.inf:                   # one-sided: 'batch >= 1'
            return f"{name} {'>' if self.low_open else '>='} {self.low:g}"
        return f"{low if self.low > -math.inf else ''}{name}{high}" + (" or off" * self.off)


def number_or_off(text):
    """A flag's value: a number, or "off" (inf: a range with no end, as --clip off)."""
    return math.inf if text.strip().lower() == "off" else float(text)


COUNT = Range(1)                                    # batch, iterations, epochs, ...
NON_NEGATIVE = Range(0)                             # beta, top-k, seeds, coefficients
POSITIVE = Range(0, low_open=True)                  # learning rates, temperature
UNIT = Range(0, 1)                                  # gamma, lambda
FINITE = Range()                                    # any number but NaN and inf


def flag(name):
    return "--" + name.replace("_", "-")


def check_flags(parser, config, ranges):
    """Exit through `parser.error` (status 2, one line) at the first value outside its range.

    `ranges` maps a Config field to its Range. None (an option left unset) is allowed; a
    list is checked value by value and may not repeat one (two identical runs of a sweep
    would write one folder).
    """
    for name, allowed in ranges.items():
        value = getattr(config, name)
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is not None and v not in allowed:
                rule = allowed.describe(name.replace("_", "-"))
                parser.error(f"argument {flag(name)}: {v} is outside {rule}" if math.isfinite(v)
                             else f"argument {flag(name)}: {v} is not finite ({rule})")
        if len(set(values)) < len(values):
            parser.error(f"argument {flag(name)}: a value is repeated in "
                         f"{' '.join(f'{v:g}' for v in values)}")


def out_problem(out):
    """Why a run could not write the folder `out` (a file is in the way, or nothing above it
    is writable), or None. Checked before any work, so a bad --out costs nothing."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        return f"argument --out: {out} is a file; pass a folder"
    existing = nearest_existing(out)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return f"argument --out: cannot write {out}: {existing} is not a writable folder"
    return None


# ----------------------------------------------------------------------- files

@contextlib.contextmanager
def reading(path, expected, *also):
    """Inside this block, failing to read `path` raises a UserError: one line naming the file
    and what it should have been. Only errors of reading are caught (and the exception
    classes in `also`, such as lora.AdapterMismatch), never a bug's."""
    try:
        yield
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError, *also) as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise UserError(f"cannot read {path} ({reason}); expected {expected}") from error


def megabytes(n):
    return f"{n / 1e6:,.1f} MB"


def nearest_existing(path):
    """`path` or the nearest of its parents that exists (resolved)."""
    path = Path(path).resolve()
    return next(p for p in (path, *path.parents) if p.exists())


def free_bytes(path):
    """(free bytes, the folder measured): the nearest existing folder at or above `path`."""
    existing = nearest_existing(path)
    return shutil.disk_usage(existing).free, existing


class WriteError(UserError):
    """A file could not be written (no space, a read-only filesystem, no permission, ...)."""


# The errors of writing that are the machine's, not a bug here: each ends in one line. Those
# of a full or read-only disk do wherever they happen (run_script), the others where a
# `writing` block names the file.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}
WRITE_ERRNOS = DISK_ERRNOS | {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
                              errno.ENOENT, errno.EIO}


def write_problem(path, error):
    """'cannot write PATH: No space left on device (0.1 MB free on /mnt)', for an OSError or
    a SafetensorError (whose text ends in '(os error 28)'); None for any other error."""
    if isinstance(error, SafetensorError):
        code = re.search(r"os error (\d+)", str(error))
        number = int(code.group(1)) if code else None
    else:
        number = getattr(error, "errno", None)
    if number not in WRITE_ERRNOS:
        return None
    reason = os.strerror(number)
    if number in (errno.ENOSPC, errno.EDQUOT):
        with contextlib.suppress(OSError):
            free, where = free_bytes(Path(path).parent)
            reason += f" ({megabytes(free)} free on {where})"
    return f"cannot write {path}: {reason}"


@contextlib.contextmanager
def writing(path):
    """Inside this block, a failed write becomes a WriteError naming `path`."""
    try:
        yield
    except (OSError, SafetensorError) as error:
        problem = write_problem(path, error)
        if problem is None:
            raise
        raise WriteError(problem) from error


def full_disk(error):
    """A full or read-only disk's OSError as a WriteError, wherever it struck (a write that
    no `writing` names: a library's own file); None for any other OSError."""
    if error.errno not in DISK_ERRNOS:
        return None
    return WriteError(write_problem(error.filename or "a file", error))


@contextlib.contextmanager
def new_folders(path, keep=lambda path: False):
    """Make the folder `path` and any missing parent. If the block raises, remove the ones
    made here, unless `keep(path)` (a run that left a checkpoint to resume from)."""
    path = Path(path).resolve()
    made = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        if made and not keep(path):
            shutil.rmtree(made[-1], ignore_errors=True)     # the topmost folder made here
        raise


# ------------------------------------------------------------------------ the entry point

def run_script(main, argv=None):
    """Run a script's `main(argv)`. A UserError ends it with one line on stderr and exit
    status 1 (`--debug` or RLHF_DEBUG=1: the traceback instead); anything else is a bug
    and keeps its traceback. SIGTERM ends it with one line and status 143 (128 + 15), after
    the cleanup of `new_folders` and `write_aside` has run: Python's default for SIGTERM is
    to die on the spot, leaving a half-made run folder behind."""
    argv = sys.argv[1:] if argv is None else list(argv)
    script = Path(main.__code__.co_filename).name
    try:
        with stop_on_sigterm(script):
            return main(argv)
    except (UserError, OSError) as caught:
        error = caught if isinstance(caught, UserError) else full_disk(caught)
        if error is None:                           # any other OSError: a bug, its traceback
            raise
        if "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        sys.exit(f"{script}: error: {' '.join(str(error).split())}")


@contextlib.contextmanager
def stop_on_sigterm(script):
    """Inside this block SIGTERM raises SystemExit(143), so `finally` and `except
    BaseException` blocks run. The old handler comes back after. Only the main thread may
    set a handler; elsewhere (a test's worker thread) this does nothing."""
    def stop(signum, frame):
        print(f"{script}: stopped by SIGTERM", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:                              # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_debug_flag(parser):
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of an error (also {DEBUG_ENV}=1)")
    return parser
