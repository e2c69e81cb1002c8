"""`python ppo.py` against `torchrun --nproc_per_node N ppo.py`, back to back: seconds an
iteration, from each run's results.json.

    python bench_parallel.py                         # cpu preset, 6 iterations, 2 processes
    python bench_parallel.py --nproc 2 -- --preset tiny --iterations 3 --reward-model DIR

The flags after `--` go to both runs (default: --preset cpu --iterations 6). Each run writes
into a fresh temporary folder; the evaluation at the end is not timed. torchrun gives each
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

ROOT = Path(__file__).resolve().parent


def timed_run(command, out):
    """Run `command` (its --out is `out`); (wall seconds, seconds of each iteration)."""
    start = time.time()
    subprocess.run(command + ["--out", str(out)], cwd=ROOT, check=True)
    wall = time.time() - start
    rows = json.loads((out / "results.json").read_text())["iterations"]
    return wall, [row["seconds"] for row in rows]


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
            wall, seconds = timed_run(command, Path(scratch) / name.split()[0])
            rows.append((name, wall, seconds))
    print(f"\nppo.py {' '.join(flags)}")
    print(f"{'':34}{'s/iteration':>14}{'± SE':>8}{'first':>8}{'wall s':>9}")
    for name, wall, seconds in rows:
        se = statistics.stdev(seconds) / len(seconds) ** 0.5 if len(seconds) > 1 else 0.0
        print(f"{name:34}{statistics.mean(seconds):14.1f}{se:8.1f}{seconds[0]:8.1f}"
              f"{wall:9.0f}")
    print(f"torchrun / python, seconds an iteration: "
          f"{statistics.mean(rows[1][2]) / statistics.mean(rows[0][2]):.2f}")


if __name__ == "__main__":
    main()
