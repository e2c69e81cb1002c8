"""Rules that never read the summary, beside every judge's held-out accuracy (issue 75).

A judge's accuracy on people's comparisons means little alone: most held-out pairs are one
contrast (OpenAI's PPO policy against its 12B supervised model, batch13), where people
chose the PPO summary about 7 times in 10, so a rule that knows only which system wrote a
summary scores what the judges score. Three such rules, each a score per summary:
    system   the win rate of the summary's system over the judge's training comparisons
             (a system never seen there: 1/2)
    length   the summary's tokens: "the longer wins"
    sft      log pi_SFT(y|x), the SFT model's log-probability (tools/analysis/judge_baselines.py
             and dpo.py have that model; reward_model.py's own report leaves it out)
Every accuracy here is on distinct pairs: a pair is its post and its two summary texts,
unordered (`rm_data.pair_id`); the votes of a pair seen more than once are averaged, so
each distinct pair counts once with a value in [0, 1]. A rule or judge is right on a vote
when it scores the chosen summary higher (a tie counts one half, as `pairwise_accuracy`).
    (B1) c_i = mean over pair i's votes of 1[r(y_w) > r(y_l)] (+ 1/2 on a tie)
    (B2) accuracy = mean_i c_i over the m distinct pairs; Wilson 95% on m (R4)
    (B3) a judge against a rule on the same pairs: d_i = c_i(judge) - c_i(rule),
         mean d +- t_{0.975, m-1} SD(d) / sqrt(m)   (paired, not two intervals: the
         one rule of support/intervals.py, the pairs its posts, one seed)
By contrast: each accuracy on every contrast with enough distinct pairs, on all but the
largest contrast (batch18's six) and on the contrasts where the system and length rules
are nearest chance (`near_chance`, decided on the training comparisons, not held out).
    report           the groups' accuracies and each judge against each rule, paired
    dpo_near_chance  for the claims page: DPO's implicit judge against the explicit one
                     on the near-chance pairs, per seed and pooled
Test: pytest tests/test_judge_baselines.py
"""
import math
from collections import Counter

import torch

from support import intervals
from support.rm_report import wilson_interval

RULES = ("system", "length", "sft")
# A contrast is judged by its rules on at least this many training comparisons, and gets
# its own row with at least this many distinct held-out pairs.
MIN_CONTRAST = 20
# Near chance: on the contrast's training comparisons neither the system rule nor the
# length rule reaches this accuracy (the largest contrast: 0.71 and 0.68, seed 0's split).
NEAR_CHANCE = 0.70


def contrast(pair):
    """The two systems of a comparison, in a fixed order: 'a vs b'."""
    return " vs ".join(sorted((pair["chosen_policy"], pair["rejected_policy"])))


# ------------------------------------------------------------------ the rules (pure)

def system_win_rates(train_pairs):
    """{system: its share of wins over the training comparisons it took part in}."""
    wins, seen = Counter(), Counter()
    for p in train_pairs:
        wins[p["chosen_policy"]] += 1
        seen[p["chosen_policy"]] += 1
        seen[p["rejected_policy"]] += 1
    return {system: wins[system] / seen[system] for system in seen}


def rule_scores(pairs, rates, logp=None):
    """{rule: (r_w, r_l)}, (n,) float64 each: what each rule scores the chosen and the other
    summary of each pair. logp: (log pi_SFT(y_w|x), log pi_SFT(y_l|x)), (n,) each, or None."""
    def side(key):
        return torch.tensor([float(p[key]) for p in pairs], dtype=torch.float64)
    out = {"system": (torch.tensor([rates.get(p["chosen_policy"], 0.5) for p in pairs],
                                   dtype=torch.float64),
                      torch.tensor([rates.get(p["rejected_policy"], 0.5) for p in pairs],
                                   dtype=torch.float64)),
           "length": (side("chosen_len"), side("rejected_len"))}
    if logp is not None:
        out["sft"] = tuple(torch.as_tensor(x).detach().cpu().double() for x in logp)
    return out


def correct(r_w, r_l):
    """(n,) float64: 1 where the chosen summary scores higher, 1/2 on a tie, else 0."""
    r_w, r_l = torch.as_tensor(r_w).cpu().double(), torch.as_tensor(r_l).cpu().double()
    return (r_w > r_l).double() + 0.5 * (r_w == r_l).double()


def by_pair(ids, values):
    """(B1): (distinct ids in first-seen order, (m,) the mean of `values` (n,) per id)."""
    # (B1)  c_i = mean of the values of pair i's votes
    order = list(dict.fromkeys(ids))
    at = {pair: i for i, pair in enumerate(order)}
    index = torch.tensor([at[pair] for pair in ids], dtype=torch.long)     # (n,)
    values = torch.as_tensor(values, dtype=torch.float64)
    sums = torch.zeros(len(order), dtype=torch.float64).index_add_(0, index, values)
    counts = torch.zeros(len(order), dtype=torch.float64).index_add_(
        0, index, torch.ones_like(values))
    return order, sums / counts                                             # (m,)


def accuracy(c):
    """(B2) on (m,) per-pair values: {accuracy, wilson: [low, high], pairs}."""
    m = len(c)
    # (B2)  accuracy = 1/m sum_i c_i
    a = c.mean().item() if m else float("nan")
    return {"accuracy": a, "wilson": list(wilson_interval(a, m)) if m else [0.0, 1.0],
            "pairs": m}


def paired_interval(a, b):
    """(B3) a - b on the same (m,) distinct pairs: {difference, se, df, low, high, pairs}, by
    support/intervals.py's one rule with the pairs as its posts and one seed (a judge is
    one fixed model): mean d -+ t_{0.975, m-1} SE. NaN with fewer than two pairs."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if len(a) < 2:
        nan = math.nan
        return {"difference": (a - b).mean().item() if len(a) else nan, "se": nan, "df": nan,
                "low": nan, "high": nan, "pairs": len(a)}
    # (B3)  d_i = c_i(a) - c_i(b);  mean d -+ t_{0.975, m-1} SD(d) / sqrt(m)
    got = intervals.paired_interval({0: a.tolist()}, {0: b.tolist()})
    return {"difference": got.gain, "se": got.se, "df": got.df, "low": got.low,
            "high": got.high, "pairs": len(a)}


def contrast_strength(train_pairs, rates):
    """{contrast: {comparisons, system, length}}: each rule's accuracy on the training
    comparisons of that contrast (every vote counted: these decide, they are not reported
    as results)."""
    groups = {}
    for p in train_pairs:
        groups.setdefault(contrast(p), []).append(p)
    out = {}
    for name, rows in groups.items():
        scores = rule_scores(rows, rates)
        out[name] = {"comparisons": len(rows),
                     **{rule: correct(*scores[rule]).mean().item()
                        for rule in ("system", "length")}}
    return out


def near_chance(strength, threshold=None, least=None):
    """The contrasts of at least `least` training comparisons where neither the system nor
    the length rule reaches `threshold` on them, sorted (defaults: NEAR_CHANCE, MIN_CONTRAST)."""
    threshold = NEAR_CHANCE if threshold is None else threshold
    least = MIN_CONTRAST if least is None else least
    return sorted(name for name, s in strength.items() if s["comparisons"] >= least
                  and s["system"] < threshold and s["length"] < threshold)


# ------------------------------------------------------------------ the report

def groups_of(contrasts, near):
    """{group: (n,) bool} over the held-out rows' contrasts: all; each contrast with at least
    MIN_CONTRAST distinct pairs is added by `report`; all but the largest; near chance."""
    largest = Counter(contrasts).most_common(1)[0][0]
    return {"all": [True] * len(contrasts),
            f"all but {largest}": [c != largest for c in contrasts],
            "near chance": [c in near for c in contrasts]}


def report(ids, contrasts, right, judges, near):
    """Every scorer's accuracy (B2) on distinct pairs, by group, and each judge against each
    rule on the same pairs (B3).

    ids, contrasts: (n,) lists, one per held-out row (vote); right: {scorer: (n,) `correct`};
    judges: the scorers that are judges (the rest are rules); near: `near_chance`'s list.
    Returns {group: {rows, pairs, accuracy: {scorer: accuracy}, paired: {judge: {rule:
    paired_interval}}}}, groups with no row left out.
    """
    groups = groups_of(contrasts, near)
    for name, n in Counter(contrasts).most_common():
        rows = [c == name for c in contrasts]
        if len({i for i, keep in zip(ids, rows) if keep}) >= MIN_CONTRAST:
            groups[name] = rows
    out = {}
    for group, rows in groups.items():
        kept = torch.tensor(rows, dtype=torch.bool)                        # (n,)
        if not kept.any():
            continue
        kept_ids = [i for i, keep in zip(ids, rows) if keep]
        c = {name: by_pair(kept_ids, v[kept])[1] for name, v in right.items()}   # (m,) each
        out[group] = {"rows": int(kept.sum()), "pairs": len(set(kept_ids)),
                      "accuracy": {name: accuracy(v) for name, v in c.items()},
                      "paired": {j: {r: paired_interval(c[j], c[r]) for r in c if r in RULES}
                                 for j in judges}}
    return out


def baselines(train_pairs, heldout_pairs, judge_scores, logp=None):
    """reward_model.py's and dpo.py's entry: the rules and judges on the held-out pairs.

    judge_scores: {judge: (r_w, r_l)}, (n,) each, on `heldout_pairs` (rm_data's dicts);
    logp: the SFT model's (log pi(y_w|x), log pi(y_l|x)), or None. Returns {near_chance,
    strength, groups (`report`), per_pair: {pair, contrast, scorer: (n,) right, per vote}}.
    """
    rates = system_win_rates(train_pairs)
    strength = contrast_strength(train_pairs, rates)
    near = near_chance(strength)
    scores = {**rule_scores(heldout_pairs, rates, logp), **judge_scores}
    right = {name: correct(*s) for name, s in scores.items()}
    ids = [p["pair"] for p in heldout_pairs]
    contrasts = [contrast(p) for p in heldout_pairs]
    sides = {}                                   # pair -> the systems people chose in it
    for p in heldout_pairs:
        sides.setdefault(p["pair"], set()).add(p["chosen_policy"])
    return {"near_chance": near, "strength": strength, "system_win_rates": rates,
            "most_votes_on_a_pair": max(Counter(ids).values(), default=0),
            "pairs_voted_both_ways": sum(len(chosen) > 1 for chosen in sides.values()),
            "groups": report(ids, contrasts, right, list(judge_scores), near),
            "per_pair": {"pair": ids, "contrast": contrasts,
                         **{name: v.tolist() for name, v in right.items()}}}


def summary_lines(groups, judges):
    """The printed table: a line per group, each scorer's accuracy on distinct pairs, then
    each judge minus each rule with its paired interval."""
    lines = []
    for group, g in groups.items():
        accs = ", ".join(f"{name} {a['accuracy']:.3f}" for name, a in g["accuracy"].items())
        lines.append(f"{group} ({g['pairs']} distinct pairs, {g['rows']} votes): {accs}")
        for j in judges:
            lines.append("    " + j + " minus: " + ", ".join(
                f"{r} {d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
                for r, d in g["paired"].get(j, {}).items()))
    return lines


# ------------------------------------------------------------------ the claims page's

def dpo_near_chance(runs, kept):
    """DPO's implicit judge against the explicit judge on the near-chance pairs (issue 75).

    runs: dpo.py results.json dicts (one per seed), each with final.judges.baselines;
    kept: tools/analysis/judge_baselines.py's JSON, whose `near_chance` contrasts and split
    fingerprint decide the pairs. Per seed: the accuracies (B2) of implicit, content and
    full and implicit minus content and minus full (B3); pooled over the seeds:
    support/intervals.py's one rule, seeds and pairs crossed; "votes": {scorer: {seed: (m,)
    list}}, each pair's right-or-wrong, for an `intervals.paired_interval` of the caller's.
    A run with no per-pair data (or of another split) raises ValueError naming it.
    """
    near, seeds = set(kept["near_chance"]), []
    per_seed = {"implicit": {}, "content": {}, "full": {}}     # scorer -> {seed: (m,) list}
    for run in runs:
        judges = run.get("final", {}).get("judges", {})
        base = judges.get("baselines")
        name = run.get("config", {}).get("out", "a DPO run")
        if not base:
            raise ValueError(f"{name} holds no per-pair data (dpo.py before issue 75)")
        if judges.get("split_fingerprint") != kept.get("split_fingerprint"):
            raise ValueError(f"{name} was evaluated on another split than {kept.get('judge')}")
        per, seed = base["per_pair"], run["config"]["seed"]
        rows = [c in near for c in per["contrast"]]
        ids = [i for i, keep in zip(per["pair"], rows) if keep]
        c = {s: by_pair(ids, [v for v, keep in zip(per[s], rows) if keep])[1]
             for s in per_seed}                                             # (m,) each
        seeds.append({"seed": seed, **{s: accuracy(v) for s, v in c.items()},
                      "implicit_minus_content": paired_interval(c["implicit"], c["content"]),
                      "implicit_minus_full": paired_interval(c["implicit"], c["full"])})
        for s, v in c.items():
            per_seed[s][seed] = v.tolist()
    out = {"contrasts": sorted(near), "seeds": seeds, "votes": per_seed}
    for s in ("content", "full"):
        # support/intervals.py's one rule over seeds and pairs (crossed, Satterthwaite's t)
        got = intervals.paired_interval(per_seed["implicit"], per_seed[s]) if seeds and \
            len(next(iter(per_seed[s].values()))) > 1 else None
        out[f"pooled_implicit_minus_{s}"] = (
            {"difference": got.gain, "se": got.se, "df": got.df, "low": got.low,
             "high": got.high, "pairs": got.posts, "seeds": got.seeds} if got else
            {**paired_interval([], []), "seeds": len(seeds)})
    return out


# ------------------------------------------------------------------ plumbing: keys and lines

def print_baselines(b, judges):
    """The rules beside the judges, by group, as `summary_lines` writes them."""
    print("\nthe judges beside rules that never read the summary (distinct pairs, votes "
          "averaged; judge minus rule, paired 95%):")
    print("\n".join(summary_lines(b["groups"], judges)))
