"""The judge's win rate of each run over SFT, and MRR, by the summary's length against the
person's TL;DR: from run files only, no model loaded, in about a second.

Stiennon et al. (2020, arXiv:2009.01325; the reference note 004) bin PPO's summaries by
their length relative to the reference summaries and find that PPO wins in every bin: its
wins are not length alone. Here, for each held-out post of each run:

    ratio    the policy's summary in tokens (its EOS not counted) over the person's TL;DR
             in tokens (results.json's human_samples, no EOS either)
    bin      ratio < 0.75 (shorter than the person's), 0.75 to 1.25 (about as long),
             >= 1.25 (longer); --edges moves the cuts
    win      the judge's reward of the policy's summary against SFT's on the same post,
             reward > ref_reward, a tie one half (measures.win_rate), with its Wilson 95%
             interval (rm_report.wilson_interval)
    MRR      mean of 1 / retrieval_rank of the policy's summaries of the bin's posts, beside
             SFT's on the same posts (ref_samples)

Why those cuts: people's TL;DRs of the 64 held-out posts (cpu preset) are 24 to 47 tokens,
median 30, while a policy's summary runs from a few tokens to the 48-token limit, so the
ratio runs from about 0.1 to 2 and its spread comes mostly from the policy's length. A band
of +-25% around "as long as the person's" (22 to 37 tokens against the median TL;DR) keeps
the middle bin to summaries a reader would call the same length and leaves room on both
sides; finer bins would hold a handful of posts each. The table gives each bin's count, so
a thin bin is seen as one (--edges moves the cuts).

Runs of one beta (and estimator) pool their posts: three seeds give three (post, seed)
pairs a post. The Wilson interval treats the pairs as independent; the seeds share their
posts, so it is somewhat too narrow where seeds agree on a post. docs/claims.md counts both
instead (`bin_values`): per seed s and post i, with w_si the win (1, 1/2 or 0), z_si = 1 where
the summary falls in the bin and n_s = sum_i z_si,

    x_si = (w_si - 1/2) z_si n / n_s        mean_i x_si = the seed's win rate in the bin - 1/2

a full seed-by-post table, read by support/intervals.py's `paired_interval` against 0. Posts
outside the bin add zeros, which makes its variance a little larger than the ratio
estimator's (by the squared gain over n_s), never smaller.

Run:  python -m tools.analysis.length_bins runs/ppo_sweep/beta0.1_seed0 runs/ppo_sweep/beta0.1_seed1
      python -m tools.analysis.length_bins runs/ppo_sweep/beta*_seed* --out runs/length_bins.json
Writes a markdown table to the terminal and --out (JSON: each group's rows, each a bin).
Test: pytest tests/test_analysis_tools.py -k length
"""
import argparse
import json
from pathlib import Path

from support import cli
from support.disk import write_json
from support.measures import length_bin, win_rate
from support.rm_report import wilson_interval

EDGES = (0.75, 1.25)


def read_run(path):
    """A run's results.json (a folder holding one, or the file) or a kept summary.json of the
    same structure, with its final evaluation; cli.UserError with one line otherwise."""
    path = Path(path)
    path = path / "results.json" if path.is_dir() else path
    with cli.reading(path, "a run's results.json or summary.json", KeyError, TypeError):
        results = json.loads(path.read_text())
        final = results["final"]
        for name in ("samples", "ref_samples", "human_samples"):
            final[name]
        results["config"]["beta"]
    missing = [name for name in ("samples", "human_samples")
               if any("length" not in s for s in final[name])]
    if missing:
        raise cli.UserError(f"{path}: final[{missing[0]!r}] lacks a length per post; "
                            "the run was written before lengths were kept")
    return results


def group_name(config):
    """β = 0.1, or "rloo, β = 0.1" for another estimator than PPO's GAE."""
    estimator = config.get("estimator", "gae")
    return ("" if estimator == "gae" else f"{estimator}, ") + f"β = {config['beta']:g}"


def pool(runs):
    """{group name: [one dict per (post, run): ratio, reward, ref_reward, rank, ref_rank,
    run]} over the runs, groups in the order first seen."""
    groups = {}
    for i, results in enumerate(runs):
        final = results["final"]
        for s, ref, human in zip(final["samples"], final["ref_samples"],
                                 final["human_samples"]):
            # ratio = (policy tokens - its EOS) / person's tokens
            ratio = (s["length"] - bool(s["eos"])) / max(human["length"], 1)
            groups.setdefault(group_name(results["config"]), []).append(
                {"ratio": ratio, "reward": s["reward"], "ref_reward": s["ref_reward"],
                 "rank": s["retrieval_rank"], "ref_rank": ref["retrieval_rank"], "run": i})
    return groups


def bin_name(i, edges):
    """"< 0.75", "0.75-1.25", ">= 1.25" for bin i of `edges`."""
    if i == 0:
        return f"< {edges[0]:g}"
    return f">= {edges[-1]:g}" if i == len(edges) else f"{edges[i - 1]:g}-{edges[i]:g}"


def bin_rows(pairs, edges=EDGES):
    """One row per bin of `pool`'s pairs: posts, runs, win rate and its Wilson interval,
    the policy's MRR and SFT's on the same posts, and the mean length ratio."""
    rows = []
    for i in range(len(edges) + 1):
        kept = [p for p in pairs if length_bin(p["ratio"], edges) == i]
        n = len(kept)
        win = win_rate([p["reward"] for p in kept], [p["ref_reward"] for p in kept])
        mean = lambda xs: sum(xs) / n if n else float("nan")  # noqa: E731
        rows.append({"bin": bin_name(i, edges), "posts": n,
                     "runs": len({p["run"] for p in kept}), "win_rate": win,
                     "wilson": list(wilson_interval(win, n)) if n else [0.0, 1.0],
                     # MRR = 1/n sum_i 1 / rank_i over the bin's posts
                     "mrr": mean([1 / p["rank"] for p in kept]),
                     "ref_mrr": mean([1 / p["ref_rank"] for p in kept]),
                     "ratio": mean([p["ratio"] for p in kept])})
    return rows


def bin_values(run, edges=EDGES):
    """([x_si per post], n_s) of one run for each bin (`None` where none of its summaries
    falls in it): (win - 1/2) z n / n_s, the table `paired_interval` reads (see above)."""
    final = run["final"]
    pairs = [((s["length"] - bool(s["eos"])) / max(h["length"], 1), s["reward"],
              s["ref_reward"]) for s, h in zip(final["samples"], final["human_samples"])]
    n, out = len(pairs), []
    for i in range(len(edges) + 1):
        inside = [length_bin(ratio, edges) == i for ratio, _, _ in pairs]
        n_s = sum(inside)
        # x_si = (w_si - 1/2) z_si n / n_s
        out.append(([((r > q) + 0.5 * (r == q) - 0.5) * z * n / n_s
                     for (_, r, q), z in zip(pairs, inside)], n_s) if n_s else None)
    return out


def markdown(groups):
    """The table: a row per group and bin."""
    lines = ["| run | length / person's | posts (runs) | mean ratio | judge's win rate over "
             "SFT [Wilson 95%] | MRR | SFT's MRR, same posts |", "|" + " --- |" * 7]
    for name, rows in groups.items():
        for r in rows:
            if not r["posts"]:
                lines.append(f"| {name} | {r['bin']} | 0 | — | — | — | — |")
                continue
            low, high = r["wilson"]
            lines.append(f"| {name} | {r['bin']} | {r['posts']} ({r['runs']}) | "
                         f"{r['ratio']:.2f} | {r['win_rate']:.0%} [{low:.0%}, {high:.0%}] | "
                         f"{r['mrr']:.3f} | {r['ref_mrr']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Writes a markdown table to the terminal and --out (JSON); about a second, "
               "no model loaded.")
    parser.add_argument("runs", nargs="+",
                        help="run folders (results.json), results.json or kept summary.json "
                             "files; runs of one beta and estimator pool their posts")
    parser.add_argument("--edges", type=float, nargs="+", default=list(EDGES),
                        help="where the length ratio's bins are cut, increasing "
                             "(default 0.75 1.25: shorter, about as long, longer)")
    parser.add_argument("--out", default="runs/length_bins.json",
                        help="the JSON written (default runs/length_bins.json)")
    args = parser.parse_args(argv)
    if any(a >= b for a, b in zip(args.edges, args.edges[1:])) or min(args.edges) <= 0:
        parser.error("argument --edges: positive and increasing, e.g. 0.75 1.25")
    try:
        runs = [read_run(path) for path in args.runs]
    except cli.UserError as error:
        raise SystemExit(f"length_bins: {error}")
    groups = {name: bin_rows(pairs, args.edges) for name, pairs in pool(runs).items()}
    print(markdown(groups))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), {"edges": args.edges, "runs": [str(p) for p in args.runs],
                                "groups": groups})
    print(f"written to {args.out}")


if __name__ == "__main__":
    cli.run_script(main)
