"""Keep runs' summaries in the repository: each RUN's summary.json (made from its results.json
when a run predates it) copied to DEST/<name>.json, name the run folder's (or --name).

    python -m tools.keep_runs runs/ppo_beta0.1_seed0 runs/lam0_seed0 --to docs/runs/claims

A page's command (python -m tools.analysis.claims_page, ...) reads its tables and plots from these
files, so that the page can be remade on another machine. A summary is about 40 kB: no
weights, no checkpoint, the texts of three posts only (support/kept.py). Seconds.
"""
import argparse
from pathlib import Path

from support import cli
from support.disk import write_json
from support.kept import read_run


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("runs", nargs="+", help="run folders (or their summary.json)")
    parser.add_argument("--to", required=True, help="the folder that keeps them, e.g. "
                        "docs/runs/claims")
    parser.add_argument("--name", nargs="+", help="a file name for each run (default: the "
                        "run folder's name)")
    args = parser.parse_args(argv)
    names = args.name or [Path(r).name if Path(r).is_dir() else Path(r).parent.name
                          for r in args.runs]
    if len(names) != len(args.runs):
        parser.error(f"--name: {len(names)} names for {len(args.runs)} runs")
    Path(args.to).mkdir(parents=True, exist_ok=True)
    for run, name in zip(args.runs, names):
        summary = read_run(run)
        if not summary.get("final"):
            raise cli.UserError(f"{run} has no held-out evaluation yet (an unfinished run): "
                                "nothing to keep")
        write_json(Path(args.to) / f"{name}.json", summary)
        print(f"kept {run} as {Path(args.to) / f'{name}.json'} ({summary['machine']})")


if __name__ == "__main__":
    cli.run_script(main)
