"""docs/claims.md's readers: for each claim that is not one setting's paired gain, the function
that reads its kept runs into a `Reading` (what the row measured, the Parts its verdict
reads, every measure shown), and the notes the paired rows add (`controller`, `copying`).
Each states its rule above it; the verdict itself is `claims_runs.decide`'s.

Used by: tools/analysis/claims_page.py. Test: pytest tests/test_claims.py
"""
from support.intervals import moved, paired_interval
from support.judge_baselines import NEAR_CHANCE, dpo_near_chance
from support.optimum import (best_of_n_weights, by_score, optimum_point,
                             self_normalised_kl)
from tools.analysis import claims_sections as sections
from tools.analysis.claims_runs import (BETA, NAMES, RLOO, Part, Reading, bin_intervals,
                                        bin_pools, cell, common, compare, decide, doubled,
                                        dpo_groups, mean_of, over_sft, per_post, pm,
                                        seed_list, win_rate)

LAMS = ["--lam 1", "", "--lam 0.5", "--lam 0"]     # λ 1, 0.95 (the baseline), 0.5, 0
SWEEP_BETAS = (0, 0.01, 0.1, 0.5, 2)              # ppo.py's sweep (the post's)
LAST = 10             # iterations: the end of a run's training, the controller's last word


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
        [Part(f"implicit against the {s} score", iv, -1) for s, iv in ivs.items()],
        [(f"implicit − {s}", iv) for s, iv in ivs.items()])
