"""docs/claims.md: the readings' claims, each a record (the reading, the claim, its command,
its runs, the measures it is about and the direction it predicts), read by one verdict
function, from the run summaries the repository keeps (docs/runs/claims/).

    python -m tools.analysis.claims_page            # docs/claims.md and its plots, in seconds
    python -m tools.analysis.claims_page --check    # exit 1 if the page is not what the files say

Every comparison is support/intervals.py's: the paired gain with a 95% interval that counts
the training seeds and the held-out posts as crossed random effects, Satterthwaite's t. A
claim holds where the interval of each measure it names lies wholly on the side it
predicts, does not hold where one lies wholly on the other, and is not resolved otherwise
(`decide`); the row lists every measure shown that moved past its interval either way, and
the seeds a side that an interval of the measured variances would need to resolve it.
Any seed the kept files hold is read; none is expected.

Test: pytest tests/test_claims.py
"""
import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from support import cli
from support.disk import write_text
from support.intervals import moved, paired_interval, verdict
from support.judge_baselines import NEAR_CHANCE, dpo_near_chance
from support.optimum import (best_of_n_weights, by_score, optimum_point,
                             self_normalised_kl)
from support.tables import markdown_table
from tools.analysis import claims_sections as sections
from tools.analysis.claims_runs import (BETA, NAMES, RLOO, Part, Reading, bin_intervals,
                                        bin_pools, cell, common, compare, doubled,
                                        dpo_groups, load, mean_of, over_sft, per_post, pm,
                                        pools, seed_list, seeds_needed, win_rate)

RUNS, PAGE = sections.RUNS, sections.PAGE
PPO = "python ppo.py --beta 0.1"
LAMS = ["--lam 1", "", "--lam 0.5", "--lam 0"]     # λ 1, 0.95 (the baseline), 0.5, 0
SWEEP_BETAS = (0, 0.01, 0.1, 0.5, 2)              # ppo.py's sweep (the post's)
LAST = 10             # iterations: the end of a run's training, the controller's last word


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


# ------------------------------------------------------------------------ the verdict

def combine(words):
    """One verdict of several: 'holds' if each holds, 'does not hold' if any does not."""
    return ("holds" if all(w == "holds" for w in words) else
            "does not hold" if "does not hold" in words else "not resolved")


def decide(reading):
    """(verdict, seeds to resolve) of a row from its parts' intervals alone (`verdict`,
    `moved`), naming every measure shown that moved past its interval either way. A claim
    with no direction is resolved where its measure moved."""
    if reading.verdict:
        return reading.verdict, reading.seeds or "n/a"
    parts = reading.parts
    if all(p.direction == 0 for p in parts):           # read on whether it moved at all
        said, open_ = "no direction claimed", [p for p in parts if not moved(p.interval)]
    else:
        words = [verdict(p.interval, p.direction) for p in parts]
        said = combine(words)
        open_ = [p for p, w in zip(parts, words) if w == "not resolved"] * (
            said == "not resolved")
        if len(set(words)) > 1:
            said += ": " + "; ".join(f"{p.name} {w}" for p, w in zip(parts, words))
    went = [f"{name} {'up' if moved(iv) > 0 else 'down'}" for name, iv in reading.shown
            if moved(iv)]
    said += "; moved past its interval: " + ", ".join(went) if went else (
        "; nothing shown moved past its interval" * bool(reading.shown))
    one = [p.interval for p in parts if p.interval.seeds == 1]
    if one:
        said += (" (1 seed: the seed variance pooled from the page's comparisons of the "
                 "same measure with several seeds)" if all(iv.seeds_counted for iv in one)
                 else " (1 seed: posts only)")
    if not open_:
        return said, "—"
    if len(open_) == 1:
        return said, seeds_needed(open_[0].interval)
    return said, "; ".join(f"{p.name}: {seeds_needed(p.interval)}" for p in open_)


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


def controller(runs, base):
    """The adaptive KL controller's own job: KL near its target, β where it ended."""
    last = [x for r in runs.values() for x in r["iterations"][-LAST:]]
    ends = " / ".join(f"{runs[s]['iterations'][-1]['beta']:.3f}" for s in sorted(runs))
    target = next(iter(runs.values()))["config"]["target_kl"]
    return (f"; the batch's KL over the last {LAST} iterations "
            f"{sum(x['kl'] for x in last) / len(last):.2f} against its target {target:g}, "
            f"β at the end {ends} ({seed_list(runs)})")


def copying(runs, base):
    """RAFT's copying and KL beside RLOO's, on the seeds both have."""
    a, b = common(runs, base)
    return (f"; bigrams copied from the post {mean_of(a, 'copied_bigrams'):.0%} against "
            f"RLOO's {mean_of(b, 'copied_bigrams'):.0%}, KL {mean_of(a, 'kl'):.1f} against "
            f"{mean_of(b, 'kl'):.1f}")


def lambdas(claim, page):
    """λ 1 against 0 decides; an adjacent pair that moved against the order breaks it."""
    have = [s for s in LAMS if s in page.runs]
    if "" not in have or len(have) < 2:
        return None
    same = common(*(page.runs[s] for s in have))
    name = lambda s: s.split()[-1] if s else "0.95"  # noqa: E731
    text = "judge's reward: " + "; ".join(f"λ {name(s)}: {mean_of(r, 'reward'):+.2f}"
                                          for s, r in zip(have, same))
    ends = compare(page.runs[have[0]], page.runs[have[-1]], "reward", page.pooled)
    parts = [Part(f"λ {name(have[0])} against {name(have[-1])}", ends, +1)]
    for hi, lo in zip(have, have[1:]):
        step = compare(page.runs[hi], page.runs[lo], "reward", page.pooled)
        if moved(step) < 0:
            parts.append(Part(f"λ {name(hi)} against {name(lo)}", step, +1))
    text += f" ({seed_list(same[0])}); {parts[0].name}: {cell('reward', ends)}"
    lacking = [s or "--lam 0.95" for s in LAMS if s not in page.runs]
    return Reading(text + f" ({', '.join(lacking)} not yet run)" * bool(lacking), parts)


def concentration(claim, page):
    conc = page.other.get("concentration")
    if not conc:
        return None
    later = conc["after_first"]
    top1, top16 = later["top1"], later["top16"]
    return Reading(f"top token {top1:.0%}, top 16 {top16:.0%}, entropy / log V "
                   f"{later['entropy']:.2f}", [], verdict="holds" if top1 >= 0.5 and
                   top16 >= 0.9 else "does not hold: less concentrated")


def clipped(claim, page):
    """Every PPO run that clips and learns the task: the largest mean over iterations, and
    the worst single iteration of any run."""
    runs = {s: r for s, r in page.runs.items() if "--clip off" not in s
            and "--estimator" not in s and "--flip-sign" not in s}
    if not runs:
        return None
    mean = max(sum(sum(x["clipfrac"] for x in r["iterations"]) / len(r["iterations"])
                   for r in g.values()) / len(g) for g in runs.values())
    worst = max(x["clipfrac"] for g in runs.values() for r in g.values()
                for x in r["iterations"])
    return Reading(f"share of tokens clipped, mean over iterations: at most {mean:.2%}; the "
                   f"worst iteration of any run {worst:.2%} ({len(runs)} settings; not "
                   "--flip-sign, whose objective rewards leaving SFT)", [],
                   verdict="holds" if worst < 0.05 else "does not hold")


def noise(claim, page):
    """fall_e = R(e, noisy) - R(e, clean), paired by post within seed, on reward − β·KL;
    D = fall_RAFT - fall_RLOO, the claim D < 0. A one-seed D's seed variance is the
    pooled one doubled: four runs, where a gain has two."""
    raft = "--estimator raft --batch 2 --samples-per-prompt 4"
    cells, parts, shown = [], [], []
    for sd in sections.noise_levels(page.runs):
        pairs = [(page.runs.get(f"{e} --reward-noise {sd}"), page.runs.get(e))
                 for e in (raft, RLOO)]
        if not all(a and b for a, b in pairs):
            continue
        ivs = {}
        for m in ("objective", "reward"):
            falls = [{s: [x - y for x, y in zip(per_post(a[s], m), per_post(b[s], m))]
                      for s in set(a) & set(b)} for a, b in pairs]
            ivs[m] = paired_interval(*falls, doubled(page.pooled.get(m)))
        fall = [compare(a, b, "objective", page.pooled).gain for a, b in pairs]
        cells.append(f"SD {sd}: RAFT {fall[0]:+.2f}, RLOO {fall[1]:+.2f}; RAFT's against "
                     f"RLOO's {cell('objective', ivs['objective'])}, {cell('reward', ivs['reward'])}"
                     f" ({ivs['objective'].seeds} seed{'s' * (ivs['objective'].seeds > 1)})")
        parts.append(Part(f"SD {sd}", ivs["objective"], -1))
        shown += [(f"{NAMES[m]} at SD {sd}", ivs[m]) for m in ivs]
    if not parts:
        return None
    return Reading("change with the noise, on reward − β·KL: " + "; ".join(cells), parts,
                   shown)


def optimum(claim, page):
    """PPO's held-out reward − β·KL against the optimum at β = 0.1 and best-of-n, on the
    optimum's posts (ppo.py's first), KL on one basis: the optimum's and best-of-n's both
    by (O5)'s sum_i w_i log(k w_i) from the same k samples; PPO's, its summaries' own."""
    base, opt = page.runs.get(""), page.other.get("optimum")
    if not (base and opt):
        return None
    n, k = opt["posts"], opt["samples"]
    scores = [post["reward"] for post in opt["per_post"]]                  # n lists of k
    kl = mean_of(base, "kl", n)
    best = max(m for m in range(1, k + 1) if self_normalised_kl(best_of_n_weights(k, m)) <= kl)
    w = best_of_n_weights(k, best)
    best_kl = self_normalised_kl(w)
    star = [optimum_point(r, BETA)[:2] for r in scores]                    # (E*[r], KL)
    points = {"the optimum at β = 0.1": ([e - BETA * d for e, d in star], [e for e, _ in star],
                                          sum(d for _, d in star) / n),
              f"best of {best}": ([(w * by_score(r, r)).sum().item() - BETA * best_kl
                                   for r in scores],
                                  [(w * by_score(r, r)).sum().item() for r in scores], best_kl)}
    text = [f"on the first {n} held-out posts: β = 0.1 run: reward − β·KL "
            f"{mean_of(base, 'objective', n):+.2f} (judge {mean_of(base, 'reward', n):+.2f} at "
            f"KL {kl:.2f})"]
    parts, shown = [], []
    for name, (objective, reward, at) in points.items():
        iv = paired_interval({s: per_post(r, "objective", n) for s, r in base.items()},
                             {s: objective for s in base})
        judge = paired_interval({s: per_post(r, "reward", n) for s, r in base.items()},
                                {s: reward for s in base})
        text.append(f"{name} {sum(objective) / n:+.2f} (judge {sum(reward) / n:+.2f} at KL "
                    f"{at:.2f}), PPO against it {cell('objective', iv)}, {cell('reward', judge)}")
        parts += [Part(name, iv, -1)] * (not parts)
        shown += [(f"{NAMES['objective']} against {name}", iv),
                  (f"judge against {name}", judge)]
    return Reading("; ".join(text) + f" (KL of the optimum and best of n: Σ w log(k w) on the "
                   f"same k = {k} samples, at most log k = {opt['kl_cap']:.2f})", parts, shown)


def by_length(claim, page):
    """The win rate over SFT in each length bin, against 1/2, per β of the sweep."""
    pooled = bin_pools(page.runs)
    settings = {f"{b:g}": "" if b == BETA else f"--beta {b:g}" for b in SWEEP_BETAS}
    cells, verdicts, seeds = [], [], []
    for b, s in settings.items():
        if s not in page.runs:
            continue
        bins = bin_intervals(page.runs[s], pooled)
        cells.append(f"β = {b}: " + ", ".join(f"{name} {win_rate(iv)} of {posts}"
                                             for name, posts, iv in bins))
        said, needed = decide(Reading("", [Part(n, iv, +1) for n, _, iv in bins]))
        verdicts.append(f"β = {b}: {said}")
        seeds += [f"β = {b}: {needed}"] * (needed != "—")
    if not cells:
        return None
    unrun = [b for b, s in settings.items() if s not in page.runs]
    return Reading("win rate over SFT [95% interval, seeds and posts] by length over the "
                   "person's TL;DR: " + "; ".join(cells), [],
                   verdict="; ".join(verdicts) + f" (β = {', '.join(unrun)}: not yet run)" *
                   bool(unrun), seeds="; ".join(seeds) or "—")


def flip(claim, page):
    """Below SFT on the judge, and fluent: a KL to SFT that rose breaks 'fluent'."""
    runs, base = page.runs.get("--flip-sign"), page.runs.get("")
    if not (runs and base):
        return None
    judge = over_sft(runs, "reward", page.pooled)
    kl = compare(runs, base, "kl", page.pooled)
    fluency = lambda g: sum(r["final"]["fluency"] for r in g.values()) / len(g)  # noqa: E731
    return Reading(f"judge {cell('reward', judge).split(' ', 1)[1]} over SFT; held-out KL "
                   f"{mean_of(runs, 'kl'):.1f} nats a summary ({cell('kl', kl)} against "
                   f"β = 0.1); the reference's log-probability of a summary "
                   f"{fluency(runs):.0f} (β = 0.1: {fluency(base):.0f})",
                   [Part("the judge below SFT", judge, -1)] +
                   [Part("fluent (KL to SFT not above β = 0.1's)", kl, -1)] * (moved(kl) > 0),
                   [("judge over SFT", judge), ("KL against β = 0.1", kl)])


def dpo(claim, page):
    """Like for like (issue 75): the DPO runs whose files keep every held-out vote (one pass
    over the judge's training split of people's comparisons, beside a judge fitted on those
    alone), their implicit judge (D1) against the explicit one they ran with, on the
    distinct held-out pairs of the contrasts where neither the system nor the length rule
    reaches NEAR_CHANCE (`judge_baselines.dpo_near_chance`), paired by seed and pair by
    the one rule. Until they are kept, `sections.dpo_reading` of the cpu preset's runs."""
    groups, rules = dpo_groups(page.other), page.other.get("judge_rules")
    like = [d for g in groups.values() for d in g.values() if "baselines" in d["final"]["judges"]]
    if not (like and rules):
        return sections.dpo_reading(groups, rules)
    got = dpo_near_chance(like, rules)
    ivs = {s: paired_interval(got["votes"]["implicit"], got["votes"][s])
           for s in ("content", "full")}
    acc = {s: sum(x[s]["accuracy"] for x in got["seeds"]) / len(got["seeds"])
           for s in ("implicit", "content", "full")}
    return Reading(
        f"on the {ivs['content'].posts} distinct held-out pairs where neither the system nor "
        f"the length rule reaches {NEAR_CHANCE:.0%} ({', '.join(got['contrasts'])}): implicit "
        f"{acc['implicit']:.1%}, explicit content {acc['content']:.1%}, full {acc['full']:.1%}"
        f"; implicit − content {pm(ivs['content'], 1, 100)} points, implicit − full "
        f"{pm(ivs['full'], 1, 100)} points ({seed_list([x['seed'] for x in got['seeds']])})",
        [Part(f"below the {s} score", iv, -1) for s, iv in ivs.items()],
        [(f"implicit − {s}", iv) for s, iv in ivs.items()])


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
