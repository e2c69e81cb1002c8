"""`python ppo.py` against `torchrun --nproc_per_node N ppo.py`, back to back: seconds an
iteration, from each run's results.json.

    python -m tools.bench_parallel                         # cpu preset, 6 iterations, 2 processes
    python -m tools.bench_parallel --nproc 2 -- --preset tiny --iterations 3 --reward-model DIR

The flags after `--` go to both runs (default: --preset cpu --iterations 6). Each run writes
into a fresh temporary folder; the evaluation at the end is not timed. The table gives each
phase (results.json's seconds_*) and the mean response length, since the two runs sample
different responses (rank 1 has its own stream). torchrun gives each
process one thread (OMP_NUM_THREADS=1, its default for several processes); the plain run
uses torch's default, every core. Time it on an otherwise idle machine.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent        # the repository root


PHASES = ("generate", "score", "forward", "update")


def timed_run(command, out):
    """Run `command` (its --out is `out`); (wall seconds, results.json's iteration rows)."""
    start = time.time()
    subprocess.run(command + ["--out", str(out)], cwd=ROOT, check=True)
    wall = time.time() - start
    return wall, json.loads((out / "results.json").read_text())["iterations"]


def print_timings(rows):
    """One line per (name, wall seconds, iteration rows): the mean seconds an iteration with
    its standard error over the iterations, each phase's mean, the mean response length
    (a run that samples longer responses does more work) and the wall time."""
    print(f"{'':30}{'iteration':>10}{'± SE':>7}" + "".join(f"{p:>10}" for p in PHASES)
          + f"{'length':>8}{'wall s':>8}")
    for name, wall, its in rows:
        seconds = [r["seconds"] for r in its]
        se = statistics.stdev(seconds) / len(seconds) ** 0.5 if len(seconds) > 1 else 0.0
        print(f"{name:30}{statistics.mean(seconds):10.1f}{se:7.1f}"
              + "".join(f"{statistics.mean(r[f'seconds_{p}'] for r in its):10.1f}"
                        for p in PHASES)
              + f"{statistics.mean(r['response_length'] for r in its):8.1f}{wall:8.0f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes under torchrun")
    parser.add_argument("ppo_flags", nargs="*", help="flags for ppo.py, after --")
    args = parser.parse_args(argv)
    flags = args.ppo_flags or ["--preset", "cpu", "--iterations", "6"]
    plain = [sys.executable, "ppo.py", *flags]
    spread = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node", str(args.nproc), "ppo.py", *flags]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, command in (("python ppo.py", plain),
                              (f"torchrun --nproc_per_node {args.nproc}", spread)):
            rows.append((name, *timed_run(command, Path(scratch) / name.split()[0])))
    print(f"\nppo.py {' '.join(flags)}: mean seconds per iteration (rank 0's under torchrun)")
    print_timings(rows)
    mean = [statistics.mean(r["seconds"] for r in its) for _, _, its in rows]
    print(f"torchrun / python, seconds an iteration: {mean[1] / mean[0]:.2f}")


if __name__ == "__main__":
    main()
