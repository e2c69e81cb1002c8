"""docs/estimators.md's comparison from kept runs: does RLOO (and REINFORCE, GRPO) beat a
careful PPO on the objective they share, reward - beta KL held out?

PPO's runs are docs/claims.md's baseline (docs/runs/claims/base_s*.json: `ppo.py --beta 0.1`),
the others the same command with `--estimator` (rloo24_s*.json: RLOO 2 x 4; REINFORCE and
GRPO 2 x 4 where their files are kept). Each setting against PPO, paired by seed and post
on the seeds both have, by support/intervals.py's rule (crossed seed and post effects,
Satterthwaite's t, 95%): reward - beta KL (the judge's reward minus 0.1 times the summary's
KL to SFT), the judge, MRR and ROUGE-L, a verdict on the objective and the seeds a side it
would take to resolve. Any seed the kept files hold is read.

    python -m tools.analysis.estimators_page            # the block of docs/estimators.md
    python -m tools.analysis.estimators_page --check    # exit 1 if it is not the files'

It rewrites only the lines between `<!-- kept: estimators -->` and `<!-- /kept -->`; the
transcribed table (tools.analysis.transcribed_tables) stays beside it.
Test: pytest tests/test_claims.py -k estimators
"""
import argparse
import re
from pathlib import Path

from support import cli
from support.disk import write_text
from support.intervals import verdict
from support.tables import markdown_table
from tools.analysis.claims_runs import RLOO, compare, load, mean_of, pm, pools, seeds_needed

RUNS = Path("docs/runs/claims")
PAGE = Path("docs/estimators.md")
BLOCK = re.compile(r"(<!-- kept: estimators -->\n)(.*?)(<!-- /kept -->)", re.S)
SETTINGS = {RLOO: "RLOO 2 x 4", "--estimator reinforce": "REINFORCE",
            "--estimator grpo --batch 2 --samples-per-prompt 4": "GRPO 2 x 4"}
MEASURES = (("objective", "reward − β·KL", 2), ("reward", "judge", 2), ("mrr", "MRR", 3),
            ("rouge_l", "ROUGE-L", 3))


def machines(*groups, sep="; "):
    return sep.join(sorted({r["machine"] for g in groups for r in g.values()}))


def sentence(runs):
    """The README's sentence: RLOO 2 x 4 against PPO on the objective, from the kept runs."""
    ppo, rloo = runs.get(""), runs.get(RLOO)
    if not (ppo and rloo):
        return "RLOO 2 x 4 and PPO at β = 0.1 are not both kept yet."
    iv = compare(rloo, ppo, "objective")
    said = {"holds": "RLOO ahead", "does not hold": "PPO ahead",
            "not resolved": "not resolved"}[verdict(iv, +1)]
    return (f"On the kept runs, from {machines(ppo, rloo, sep=' and ')}, RLOO 2 x 4 against PPO at β = 0.1 "
            f"on reward − β·KL held out: {pm(iv)} (95% interval, {iv.seeds} seeds a side): "
            f"{said}.")


def block(runs):
    """The Markdown between the markers: the table and its sentence."""
    ppo, pooled = runs.get(""), pools(runs)
    if not ppo:
        return "No PPO run at β = 0.1 is kept yet.\n"
    rows = [["PPO (`gae`, 8 x 1)", str(len(ppo)), f"{mean_of(ppo, 'objective'):+.2f}",
             f"{mean_of(ppo, 'kl'):.2f}", "", "", "", "", "", "", machines(ppo)]]
    for setting, name in SETTINGS.items():
        group = runs.get(setting)
        if not group:
            rows.append([f"{name} (`{setting}`)", "0", *[""] * 7, "not kept yet", ""])
            continue
        ivs = [compare(group, ppo, m, pooled) for m, _, _ in MEASURES]
        word = verdict(ivs[0], +1)
        one = " (1 seed: the seed variance pooled as on claims.md)" * (ivs[0].seeds == 1)
        rows.append([f"{name} (`{setting}`)", str(len(group)) + one,
                     f"{mean_of(group, 'objective'):+.2f}", f"{mean_of(group, 'kl'):.2f}",
                     *(pm(iv, d) for iv, (_, _, d) in zip(ivs, MEASURES)),
                     {"holds": "ahead of PPO", "does not hold": "behind PPO"}.get(word, word),
                     "—" if word != "not resolved" else seeds_needed(ivs[0]),
                     machines(group)])
    return "\n".join([
        markdown_table(["setting (`ppo.py --beta 0.1` and)", "seeds", "reward − β·KL",
                        "KL", *(f"{name} vs PPO" for _, name, _ in MEASURES),
                        "on reward − β·KL", "seeds to resolve", "machine"], rows), "",
        sentence(runs), ""])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=str(RUNS), help=f"kept summaries (default {RUNS})")
    parser.add_argument("--out", default=str(PAGE), help=f"the page (default {PAGE})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the block differs from the files'")
    args = parser.parse_args(argv)
    runs, _ = load(args.runs)
    out = Path(args.out)
    text = out.read_text()
    if not BLOCK.search(text):
        raise cli.UserError(f"{out}: no `<!-- kept: estimators -->` block to fill")
    new = BLOCK.sub(lambda m: m[1] + block(runs) + m[3], text)
    if args.check:
        print(f"{out}: {'the same as' if new == text else 'differs from'} what {args.runs} gives")
        raise SystemExit(0 if new == text else 1)
    write_text(out, new)
    print(f"wrote {out}")


if __name__ == "__main__":
    cli.run_script(main)
