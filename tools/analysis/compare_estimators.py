"""Does RLOO beat a careful PPO? The PPO/RLOO note's question, on the same sample budget.

Ahmadian et al. 2024 (arXiv:2402.14740) find RLOO ahead of PPO by 10 to 32 points of win
rate; the note asks how much of that survives a PPO built with Huang et al.'s care. This
runs ppo.py's estimators with the same number of sampled responses and the same number of
gradient steps per iteration, for the same iterations:

    gae        8 prompts x 1 sample     PPO as the post, with GAE and a value head
    rloo_2x4   2 prompts x 4 samples    leave-one-out baseline
    rloo_4x2   4 prompts x 2 samples    (k = 2: the note's contrastive form; not by default)
    reinforce  8 prompts x 1 sample     moving-average baseline
    grpo_2x4   2 prompts x 4 samples    the group's mean and standard deviation

each over --seeds at one beta, as a ppo.py sweep of its own in --out/<setting> (so
--resume, the ETA and the failed-run rows come from ppo.py). `--gae-runs runs/ppo_sweep`
takes PPO's runs from the beta sweep instead (the same command at that beta). Then one
table, support/tables.py's: the judge's reward beside what it never saw (MRR, ROUGE-L and
their gains over SFT, words, ends, copied, asks for help, KL), then reward - beta KL (the
objective they share) and the minutes of a run; and estimators.png, the sweep's plot with a
colour per setting: the judge's reward (with lines of equal reward - beta KL), MRR and
ROUGE-L against KL, one point per run.

Run:   python -m tools.analysis.compare_estimators --gae-runs runs/ppo_sweep    (cpu preset: 9 runs
                                                      of about 20 min on a 2-core CPU)
       python -m tools.analysis.compare_estimators --preset tiny --reward-model runs/rm_tiny --seeds 0
Again: the same command resumes; finished runs are skipped. Any other flag goes to ppo.py.
Time:  python -m tools.analysis.compare_estimators --time 6          (each setting for 6 iterations, back to
       back in temporary folders, on the first seed: seconds an iteration, per phase. The
       table's minutes come from whole runs, however the machine was shared while they ran;
       this is the like-for-like figure. Run it on an otherwise idle machine.)
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench_parallel import print_timings, timed_run
from support import cli, disk, tables
from support.report import finished_row, plot_sweep, read_results

DESCRIPTION = """Does RLOO beat a careful PPO? ppo.py's estimators on the same sample budget.

Runs each of --settings at one --beta over --seeds through ppo.py, in --out/SETTING, then
writes --out/estimators.md (the table: the judge's reward, MRR, ROUGE-L and their gains over
SFT, reward - beta KL, minutes a run) and --out/estimators.png (reward, MRR and ROUGE-L
against KL, one point per run). Time: a run of the cpu preset took 19 to 23 minutes on a
2-core CPU (docs/estimators.md), so the default 4 settings x 3 seeds take about 4 hours of
runs (9 runs, about 3 hours, with --gae-runs); the tiny preset, seconds a run; --table-only,
seconds."""

SETTINGS = {          # name: ppo.py flags; each draws --batch x k = 8 responses an iteration
    "gae": ["--estimator", "gae", "--batch", "8"],
    "rloo_2x4": ["--estimator", "rloo", "--batch", "2", "--samples-per-prompt", "4"],
    "rloo_4x2": ["--estimator", "rloo", "--batch", "4", "--samples-per-prompt", "2"],
    "reinforce": ["--estimator", "reinforce", "--batch", "8"],
    "grpo_2x4": ["--estimator", "grpo", "--batch", "2", "--samples-per-prompt", "4"],
}
DEFAULT = ["gae", "rloo_2x4", "reinforce", "grpo_2x4"]     # PPO and one of each other


def run_setting(name, args):
    """One setting's sweep over the seeds, through ppo.py; --resume when it has started,
    nothing when every run is over (or, for gae with --gae-runs, is the beta sweep's)."""
    if name == "gae" and args.gae_runs:
        missing = [r["seed"] for r in rows(name, args) if "reward" not in r and not r["failed"]]
        if missing:
            print(f"\n=== gae: the runs of seeds {missing} at beta {args.beta:g} are not over "
                  f"in {args.gae_runs}: finish the sweep first (python ppo.py ... --resume)")
        return 0
    if all("reward" in r or r["failed"] for r in rows(name, args)):
        print(f"\n=== {name}: every run is over, nothing to run")
        return 0
    out = Path(args.out) / name
    started = any(out.glob("*/checkpoint/state.json")) or (out / "checkpoint").is_dir()
    command = [sys.executable, "ppo.py", "--preset", args.preset, "--beta", str(args.beta),
               "--seeds", *map(str, args.seeds), "--reward-model", args.reward_model,
               "--out", str(out), *SETTINGS[name], *args.ppo_flags,
               *(["--resume"] if started else [])]
    print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
    return subprocess.run(command, cwd=Path(__file__).resolve().parents[2]).returncode


def run_folder(name, seed, args):
    """Where ppo.py wrote one run of a setting: its own sweep's layout (a folder per seed
    when there are several), or the beta sweep's for gae with --gae-runs."""
    if name == "gae" and args.gae_runs:
        return Path(args.gae_runs) / f"beta{args.beta:g}_seed{seed}"
    folder = Path(args.out) / name
    return folder / f"beta{args.beta:g}_seed{seed}" if len(args.seeds) > 1 else folder


def time_settings(args):
    """Each of --settings for --time iterations, one after another, each in a temporary
    folder; the held-out evaluation (8 posts) is not timed. Prints seconds an iteration."""
    timings = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.settings:
            command = [sys.executable, "ppo.py", "--preset", args.preset, "--beta",
                       str(args.beta), "--seeds", str(args.seeds[0]), "--reward-model",
                       args.reward_model, *SETTINGS[name], "--iterations", str(args.time),
                       "--eval-prompts", "8", *args.ppo_flags]
            print(f"\n=== timing {name}: {' '.join(command[1:])}", flush=True)
            timings.append((name, *timed_run(command, Path(scratch) / name)))
    print(f"\n{args.preset} preset, beta {args.beta:g}, seed {args.seeds[0]}, {args.time} "
          "iterations each: mean seconds an iteration")
    print_timings(timings)


def rows(name, args):
    """Each run of one setting: its final held-out numbers with its words, or its failure."""
    out = []
    for seed in args.seeds:
        folder = run_folder(name, seed, args)
        results = read_results(folder) or {}
        row = finished_row(folder, 0) or {}         # the final numbers, or the failure
        if "reward" in row:
            check_budget(name, results["config"], args)
            row = tables.with_words(row, results)
        out.append({**row, "setting": name, "seed": seed, "failed": row.get("failed"),
                    "seconds": sum(r["seconds"] for r in results.get("iterations", []))})
    return out


def check_budget(name, config, args):
    """A run read from another folder (--gae-runs) must be this setting at this budget."""
    flags = dict(zip(SETTINGS[name][::2], SETTINGS[name][1::2]))
    want = {"estimator": flags["--estimator"], "batch": int(flags["--batch"]),
            "samples_per_prompt": int(flags.get("--samples-per-prompt", 1)),
            "beta": args.beta, "preset": args.preset}
    differ = [f"{k} {config.get(k)} (not {v})" for k, v in want.items() if config.get(k) != v]
    if differ:
        raise cli.UserError(f"compare_estimators: the {name} run of seed {config.get('seed')} "
                            f"has {', '.join(differ)}")


def table(runs, base, beta, settings):
    """The table of `settings` (support/tables.py's columns), then reward - beta KL, the
    objective every estimator maximises (the note's R = score - beta sum_t KL_t, so a
    setting cannot buy its reward with drift), and the minutes of training a run."""
    groups, objective, minutes = [], [], []
    for name in settings:
        mine = [r for r in runs if r["setting"] == name]
        done = [r for r in mine if "reward" in r]
        failed = sum(bool(r["failed"]) for r in mine)
        label = name + (f" ({failed} failed)" if failed else "")
        groups.append((label if done else f"{label} (0 of {len(mine)})", done))
        objective.append(tables.over_seeds([r["reward"] - beta * r["kl"] for r in done], 2)
                         if done else "—")
        minutes.append(f"{sum(r['seconds'] for r in done) / len(done) / 60:.1f}" if done
                       else "—")
    text = tables.markdown("setting", groups, base, extra=[("reward - beta KL", objective),
                                                           ("minutes a run", minutes)])
    failures = [f"{r['setting']} seed {r['seed']}: failed: {r['failed']}" for r in runs
                if r["failed"]]
    return "\n".join([text, *failures])


def main(argv=None):
    parser = argparse.ArgumentParser(
        formatter_class=argparse.RawDescriptionHelpFormatter, description=DESCRIPTION,
        epilog="Any other flag goes to ppo.py as it is. The same command resumes: finished "
               "runs are skipped.")
    parser.add_argument("--preset", default="cpu", choices=("cpu", "blog", "tiny"),
                        help="ppo.py's preset for every run (default: %(default)s)")
    parser.add_argument("--beta", type=float, default=0.1,
                        help="the KL coefficient of every run (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="the seeds of each setting (default: 0 1 2)")
    parser.add_argument("--reward-model", default="runs/reward_model", metavar="DIR",
                        help="the judge, a folder of reward_model.py (default: %(default)s)")
    parser.add_argument("--out", default="runs/estimators", metavar="DIR",
                        help="a folder per setting, the table and the plot "
                             "(default: %(default)s)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=DEFAULT,
                        metavar="NAME", help=f"run and show these, of {', '.join(SETTINGS)} "
                                             f"(default: {' '.join(DEFAULT)})")
    parser.add_argument("--gae-runs", metavar="SWEEP", help="take gae's runs from this ppo.py "
                        "sweep folder (its --beta runs of these seeds), e.g. runs/ppo_sweep "
                        "(default: none, gae runs here)")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing; write the table and the plot from the runs there")
    parser.add_argument("--time", type=int, metavar="N", help="instead of the experiment, time "
                        "N >= 2 iterations of each setting, back to back in temporary folders "
                        "(on an idle machine); writes nothing (default: off)")
    args, args.ppo_flags = parser.parse_known_args(argv)     # the rest go to ppo.py as they are
    if args.time is not None:
        if args.time < 2:
            parser.error(f"argument --time: needs at least 2 iterations, got {args.time}")
        return time_settings(args)
    with disk.holding([args.out]):      # one process a folder; ppo.py holds each setting's
        return experiment(args)


def experiment(args):
    """Each setting's runs (ppo.py), then the table and the plot."""
    if not args.table_only:
        for name in args.settings:
            if run_setting(name, args):
                print(f"{name}: ppo.py stopped with an error; its finished runs still count")
    runs = [r for name in args.settings for r in rows(name, args)]
    baselines = [*sorted(Path(args.out).glob("*/baseline.json")),       # one judge: any
                 *([Path(args.gae_runs) / "baseline.json"] if args.gae_runs else [])]
    baselines = [path for path in baselines if path.is_file()]
    base = json.loads(baselines[0].read_text()) if baselines else None
    text = table(runs, base, args.beta, args.settings)
    print("\n" + text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    disk.write_text(Path(args.out) / "estimators.md", text + "\n")
    if base:
        plot_sweep([r for r in runs if "reward" in r], base["baseline"],
                   Path(args.out) / "estimators.png", group="setting", objective_beta=args.beta)
    print(f"\ntable in {args.out}/estimators.md, plot in {args.out}/estimators.png")


if __name__ == "__main__":
    cli.run_script(main)     # a folder in use, a full disk: one line, not a traceback
