"""Does RLOO beat a careful PPO? The PPO/RLOO note's question, on the same sample budget.

Ahmadian et al. 2024 (arXiv:2402.14740) find RLOO ahead of PPO by 10 to 32 points of win
rate; the note asks how much of that survives a PPO built with Huang et al.'s care. This
runs ppo.py's estimators with the same number of sampled responses and the same number of
gradient steps per iteration, for the same iterations:

    gae        8 prompts x 1 sample     PPO as the post, with GAE and a value head
    rloo_2x4   2 prompts x 4 samples    leave-one-out baseline
    rloo_4x2   4 prompts x 2 samples    (k = 2: the note's contrastive form)
    reinforce  8 prompts x 1 sample     moving-average baseline

each over --seeds at one beta, as a ppo.py sweep of its own in --out/<setting> (so
--resume, the ETA and the failed-run rows come from ppo.py). Then one table: held-out
reward mean ± standard error across seeds, the same for reward - beta KL (the objective
they share), the gain over the reference, KL, length, the share of samples that end with
EOS, fluency, distinct-2 and the wall time of a run; and estimators.png, held-out reward
against KL, one point per run (bars: SE over posts).

Run:   python -m tools.compare_estimators                   (cpu preset: 12 runs of 36 to 63 min
                                                        here, on a shared 2-core machine)
       python -m tools.compare_estimators --preset tiny --reward-model runs/rm_tiny --seeds 0
Again: the same command resumes; finished runs are skipped. Any other flag goes to ppo.py.
Time:  python -m tools.compare_estimators --time 6          (each setting for 6 iterations, back to
       back in temporary folders, on the first seed: seconds an iteration, per phase. The
       table's minutes come from whole runs, however the machine was shared while they ran;
       this is the like-for-like figure. Run it on an otherwise idle machine.)
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bench_parallel import print_timings, timed_run
from support import cli, disk
from support.measures import standard_error
from support.report import finished_row, read_results

SETTINGS = {          # name: ppo.py flags; each draws --batch x k = 8 responses an iteration
    "gae": ["--estimator", "gae", "--batch", "8"],
    "rloo_2x4": ["--estimator", "rloo", "--batch", "2", "--samples-per-prompt", "4"],
    "rloo_4x2": ["--estimator", "rloo", "--batch", "4", "--samples-per-prompt", "2"],
    "reinforce": ["--estimator", "reinforce", "--batch", "8"],
}


def run_setting(name, args):
    """One setting's sweep over the seeds, through ppo.py; --resume when it has started,
    nothing when every run is over (--out/gae may be a link to a beta sweep's folder, whose
    beta = 0.1 runs are this setting's: ppo.py would rewrite that sweep's table)."""
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
    return subprocess.run(command, cwd=Path(__file__).resolve().parent.parent).returncode


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
    """Each run of one setting: its final held-out numbers, or its failure."""
    out = []
    for seed in args.seeds:
        folder = Path(args.out) / name              # ppo.py's layout: a folder per run
        folder = folder / f"beta{args.beta:g}_seed{seed}" if len(args.seeds) > 1 else folder
        results = read_results(folder) or {}
        row = finished_row(folder, 0) or {}         # the final numbers, or the failure
        out.append({**row, "setting": name, "seed": seed, "failed": row.get("failed"),
                    "seconds": sum(r["seconds"] for r in results.get("iterations", []))})
    return out


def table(runs, baseline, beta):
    """The table; "reward - beta KL" is the objective every estimator maximises (the note's
    R = score - beta sum_t KL_t), so a setting cannot buy its reward with drift."""
    lines = ["| setting | runs | reward: mean ± SE over seeds | reward - beta KL ± SE "
             "| gain over (ref) | KL | length | EOS | fluency | distinct-2 "
             "| minutes of training a run |", "|" + " --- |" * 11]
    for name in SETTINGS:
        mine = [r for r in runs if r["setting"] == name]
        done, failed = [r for r in mine if "reward" in r], [r for r in mine if r["failed"]]
        if not done:
            lines.append(f"| {name} | 0 of {len(mine)} |" + " |" * 9)
            continue
        mean = lambda key: sum(r[key] for r in done) / len(done)  # noqa: E731
        rewards = [r["reward"] for r in done]
        objective = [r["reward"] - beta * r["kl"] for r in done]
        lines.append(f"| {name} | {len(done)}{f' ({len(failed)} failed)' if failed else ''} "
                     f"| {mean('reward'):.2f} ± {standard_error(rewards):.2f} "
                     f"| {sum(objective) / len(done):.2f} ± {standard_error(objective):.2f} "
                     f"| {mean('gain_over_ref'):+.2f} | {mean('kl'):.2f} | {mean('length'):.1f} "
                     f"| {mean('eos_fraction'):.2f} | {mean('fluency'):.1f} "
                     f"| {mean('distinct_2'):.3f} | {mean('seconds') / 60:.1f} |")
    if baseline:
        ref, human = baseline["ref"], baseline["human"]
        lines.append(f"| (ref) | | {ref['reward']:.2f} ± {ref['reward_se']:.2f} (over posts) "
                     f"| {ref['reward']:.2f} | | 0 | {ref['length']:.1f} "
                     f"| {ref['eos_fraction']:.2f} | {ref['fluency']:.1f} "
                     f"| {ref['distinct_2']:.3f} | |")
        lines.append(f"| human | | {human['reward']:.2f} ± {human['reward_se']:.2f} (over posts)"
                     " |" + " |" * 8)
    lines += [f"| {r['setting']} seed {r['seed']} | failed: {r['failed']} |" + " |" * 9
              for r in runs if r["failed"]]
    return "\n".join(lines)


def plot(runs, beta, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, name in enumerate(SETTINGS):
        done = [r for r in runs if r["setting"] == name and "reward" in r]
        ax.errorbar([r["kl"] for r in done], [r["reward"] for r in done], fmt="o",
                    yerr=[r["reward_se"] for r in done], color=f"C{i}", label=name)
    # Lines of equal reward - beta KL, the objective: a point up and to the right of another
    # is only better when it sits on a higher line.
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    levels = range(math.floor(10 * (y0 - beta * x1)), math.ceil(10 * (y1 - beta * x0)) + 1)
    for k, level in enumerate(c / 10 for c in levels):
        ax.plot([x0, x1], [level + beta * x0, level + beta * x1], color="0.85", lw=0.8,
                zorder=0, label=None if k else "equal reward - beta KL (0.1 apart)")
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_xlabel("held-out KL from the reference (nats)")
    ax.set_ylabel("held-out reward (bars: SE over posts)")
    ax.set_title(f"beta = {beta:g}: one point per run")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    disk.save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=("cpu", "blog", "tiny"))
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--reward-model", default="runs/reward_model")
    parser.add_argument("--out", default="runs/estimators")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="run only these (the table shows every one that has results)")
    parser.add_argument("--table-only", action="store_true", help="run nothing; print the table")
    parser.add_argument("--time", type=int, metavar="N", help="instead of the experiment, time "
                        "N iterations of each setting, back to back (on an idle machine)")
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
    runs = [r for name in SETTINGS for r in rows(name, args)]
    baselines = sorted(Path(args.out).glob("*/baseline.json"))
    baseline = json.loads(baselines[0].read_text())["baseline"] if baselines else None
    text = table(runs, baseline, args.beta)
    print("\n" + text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    disk.write_text(Path(args.out) / "estimators.md", text + "\n")
    plot(runs, args.beta, Path(args.out) / "estimators.png")
    print(f"\ntable in {args.out}/estimators.md, plot in {args.out}/estimators.png")


if __name__ == "__main__":
    cli.run_script(main)     # a folder in use, a full disk: one line, not a traceback
