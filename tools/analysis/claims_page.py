"""docs/claims.md: the readings' claims, each a record (the reading, the claim, its command,
its runs, the measures it is about and the direction it predicts), read by one verdict
function, from the run summaries the repository keeps (docs/runs/claims/).

    python -m tools.analysis.claims_page            # docs/claims.md and its plots, in seconds
    python -m tools.analysis.claims_page --check    # exit 1 if the page is not what the files say

Every comparison is support/intervals.py's: the paired gain with a 95% interval that counts
the training seeds and the held-out posts as crossed random effects, Satterthwaite's t. A
claim holds where the interval of each measure it names lies wholly on the side it
predicts, does not hold where one lies wholly on the other, and is not resolved otherwise
(`claims_runs.decide`); the row lists every measure shown that moved past its interval
either way, and the seeds a side that an interval of the measured variances would need to
resolve it. Any seed the kept files hold is read; none is expected.

    claims_page.py       the claims, one record each, and the page's text (this file)
    claims_runs.py       the kept files, the per-post measures, every interval, the verdict
    claims_readers.py    the readers of the claims that are not one setting's paired gain
    claims_sections.py   the page below the table: every run by setting, sections, plots

Test: pytest tests/test_claims.py
"""
import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from support import cli
from support.disk import write_text
from support.tables import markdown_table
from tools.analysis import claims_sections as sections
from tools.analysis.claims_readers import (by_length, clipped, concentration, controller,
                                           copying, dpo, flip, lambdas, noise, optimum)
from tools.analysis.claims_runs import (NAMES, RLOO, Part, Reading, cell, compare, decide,
                                        load, pools)

RUNS, PAGE = sections.RUNS, sections.PAGE
PPO = "python ppo.py --beta 0.1"


@dataclass(frozen=True)
class Claim:
    """One claim of the readings: a row of the page. A claim about one setting against
    another names its `runs` and `measures`, and `paired` reads it (`read` may add a note
    of its own); any other claim names the reader that makes its `Reading`."""
    number: str
    reading: str
    claim: str
    command: str
    runs: tuple = ()            # (setting, against), as `flags` writes them
    measures: tuple = ()        # ((measure, direction predicted), ...)
    beside: tuple = ("reward", "mrr", "rouge_l")
    read: Callable = None       # a reader of its own, for claims that are not one gain


# ------------------------------------------------------------------------ the readers

def label(setting):
    return {"": "β = 0.1", "--beta 0": "β = 0", RLOO: "RLOO 2 x 4"}.get(setting, setting)


def paired(claim, page):
    """One setting against another on the claim's measures, the others beside."""
    setting, against = claim.runs
    a, b = page.runs.get(setting), page.runs.get(against)
    if not (a and b):
        return None
    names = list(dict.fromkeys([m for m, _ in claim.measures] + list(claim.beside)))
    ivs = {m: compare(a, b, m, page.pooled) for m in names}
    seeds = ivs[names[0]].seeds
    text = (", ".join(cell(m, ivs[m]) for m in names) +
            f" vs {label(against)} ({seeds} seed{'s' * (seeds > 1)})")
    if claim.read:                                     # a note of its own beside the gains
        text += claim.read(a, b)
    return Reading(text, [Part(NAMES[m], ivs[m], d) for m, d in claim.measures],
                   [(NAMES[m], ivs[m]) for m in names])


# ------------------------------------------------------------------------ the claims

A, H, S = "004 (Ahmadian et al.)", "004 (Huang et al.)", "004 (Stiennon, Huang et al.)"
RAFT = "--estimator raft --batch {} --samples-per-prompt {}"
HUMAN = "--reference-pairs 0 --off-post-pairs 0"     # the judge on people's comparisons alone
CLAIMS = [
    Claim("1", A, "λ from 1 to 0.95, 0.5 and 0: the reward falls in that order",
          f"{PPO} --lam {{1, 0.5, 0}} --seeds 0 1 2", read=lambdas),
    Claim("1", "004", "the SFT model puts ~60% on its top token and >90% on its top 16 after "
          "the first", "python -m tools.analysis.concentration", read=concentration),
    Claim("2", H, "PPO clips fewer than 5% of tokens", f"{PPO}  (clipfrac, every PPO run)",
          read=clipped),
    Claim("2", A, "turning clipping off does not hurt", f"{PPO} --clip off",
          ("--clip off", ""), (("reward", +1),), ("mrr", "rouge_l")),
    Claim("2", A, "vanilla policy gradient (no clip, no ratio, λ = 1) does not hurt",
          f"{PPO} --lam 1 --clip off --inner-steps 1",
          ("--lam 1 --clip off --inner-steps 1", ""), (("reward", +1),), ("mrr", "rouge_l")),
    Claim("3", "004 (the PPO/RLOO note)", "RLOO (2 x 4) beats a careful PPO", f"{PPO} {RLOO}",
          (RLOO, ""), (("objective", +1),)),
    *(Claim("3", A, f"RAFT at k = {k} trails RLOO (2 x 4)", f"{PPO} {RAFT.format(8 // k, k)}",
            (RAFT.format(8 // k, k), RLOO), (("objective", -1),), read=copying)
      for k in (2, 4)),
    Claim("3", A, "RAFT loses more reward than RLOO under reward noise",
          f"{PPO} {{{RLOO}, {RAFT.format(2, 4)}}} --reward-noise {{0, SD}}", read=noise),
    Claim("4", H, "DPO read as an implicit reward model is less accurate than the explicit "
          "judge", f"python reward_model.py {HUMAN} --out runs/rm_human; python dpo.py "
          "--reward-model runs/rm_human --steps 0 --heldout-pairs 0 --seed {0, 1, 2}", read=dpo),
    Claim("5", S, "whitening the rewards gives shorter summaries", f"{PPO} --whiten-rewards",
          ("--whiten-rewards", ""), (("words", -1),)),
    Claim("5", S, "the value head from the judge", f"{PPO} --value-init reward",
          ("--value-init reward", ""), (("reward", 0),), ("mrr", "rouge_l")),
    Claim("5", S, "-1 for a summary with no EOS: more end by themselves",
          f"{PPO} --missing-eos-penalty -1", ("--missing-eos-penalty -1", ""), (("eos", +1),)),
    Claim("5", S, "the value loss clipped at 0.2, weight 0.1", f"{PPO} --value-clip 0.2 "
          "--vf-coef 0.1", ("--value-clip 0.2 --vf-coef 0.1", ""), (("reward", 0),),
          ("mrr", "rouge_l")),
    Claim("5", S, "γ = 1", f"{PPO} --gamma 1", ("--gamma 1", ""), (("reward", 0),),
          ("mrr", "rouge_l")),
    *(Claim("5", S, f"the adaptive KL controller, target {t} nat{'s' * (t != 1)}",
            f"{PPO} --target-kl {t}", (f"--target-kl {t}", ""), (("reward", 0),),
            ("mrr", "rouge_l"), read=controller) for t in (1, 3)),
    *(Claim("6", "000 (the post)", f"{what} at β = 0 stops its copying and questions",
            f"python ppo.py {setting}", (setting, "--beta 0"),
            (("copied_bigrams", -1), ("question", -1)))
      for what, setting in (("the entropy bonus (12)", "--beta 0 --ent-coef 0.01"),
                            ("the supervised loss (13)", "--beta 0 --ptx-coef 1"))),
    Claim("7", "004 (Ziegler et al.)", "PPO falls short of the KL-regularised optimum, the "
          "reference times e^{r/β}", "python -m tools.analysis.optimum --samples 8 "
          "--eval-prompts 32", read=optimum),
    Claim("8", "004 (Stiennon et al.)", "PPO wins over SFT in every length bin",
          "python -m tools.analysis.length_bins RUN", read=by_length),
    Claim("9", "004 (Ziegler et al.)", "negating both the score and the KL term gives fluent "
          "text the judge scores worst", f"{PPO} --flip-sign", read=flip),
]


def row(claim, page):
    """[#, reading, claim, command, measured, verdict, seeds to resolve] of one claim."""
    reading = (paired if claim.runs else claim.read)(claim, page)
    if reading is None:
        return [claim.number, claim.reading, claim.claim, f"`{claim.command}`", "—",
                "not yet run: its runs are not kept", "—"]
    said, needed = decide(reading)
    return [claim.number, claim.reading, claim.claim, f"`{claim.command}`", reading.measured,
            said, needed]


class Page(NamedTuple):
    runs: dict
    other: dict
    pooled: dict


def claims(runs, other):
    page = Page(runs, other, pools(runs))
    return [row(c, page) for c in CLAIMS], page


def page(runs, other):
    """docs/claims.md's text."""
    rows, p = claims(runs, other)
    done = sum(r[5] != "not yet run: its runs are not kept" for r in rows)
    return "\n".join([
        "# The readings' claims, run at this scale", "",
        "Each claim the readings make about PPO's mechanisms, with the command that tests it "
        "here, what it measured, a verdict and the seeds it would take to decide. From the "
        "SFT model and the quick start's judge, the cpu preset, β = 0.1 and GAE unless the "
        "command says otherwise; gains are on the 64 held-out posts, paired by post within "
        "seed, and \"±\" is the half-width of a 95% interval that counts both the training "
        "seeds and the posts: crossed random seed and post effects by the method of "
        "moments, Satterthwaite's t (`support/intervals.py`). A row on one seed takes the "
        "seed variance pooled over the page's comparisons of the same measure with several "
        "seeds, and says so. A claim holds where the interval of each measure it names lies "
        "on the side it predicts, does not hold where one lies on the other, and is not "
        "resolved otherwise; every measure shown that moved past its interval is named. "
        "The estimators (PPO, RLOO, RAFT) are judged on the objective they share, "
        "reward − β·KL held out (β = 0.1: the judge's reward minus 0.1 times the summary's "
        "KL to SFT), with the judge, MRR and ROUGE-L beside it. \"Seeds to resolve\": the "
        "seeds a side at which an interval of the row's measured variances would exclude "
        "zero at its measured gain (— where it is resolved, n/a where the row is not a "
        "paired gain). "
        f"{done} of {len(rows)} rows have runs. Back to the [README](../README.md).", "",
        "```bash",
        "python -m tools.analysis.claims_page      # this page and its plots, from docs/runs/claims/",
        "```", "",
        markdown_table(["#", "reading", "claim", "command", "measured", "verdict",
                        "seeds to resolve"], rows), "",
        sections.details(p)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", default=str(RUNS), help=f"kept summaries (default {RUNS})")
    parser.add_argument("--out", default=str(PAGE), help=f"the page (default {PAGE})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the page differs from what the files say")
    args = parser.parse_args(argv)
    runs, other = load(args.runs)
    if sections.JUDGE_RULES.exists():
        other["judge_rules"] = json.loads(sections.JUDGE_RULES.read_text())
    text = page(runs, other)
    out = Path(args.out)
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out}: {'the same as' if same else 'differs from'} what {args.runs} gives")
        raise SystemExit(0 if same else 1)
    write_text(out, text)
    sections.plots(runs, other, out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    cli.run_script(main)
