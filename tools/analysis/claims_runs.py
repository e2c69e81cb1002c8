"""The kept runs of docs/claims.md (docs/runs/claims/, written by `tools.keep_runs`) and
every comparison the page makes of them, by the one rule of support/intervals.py.

A kept file is one run: its config, its iterations and its held-out evaluation (`final`),
each sample of which carries the judge's reward, the summary's KL to SFT and the measures
the judge never saw. The page reads, per post i of seed s,

    reward      the judge's score of the summary
    objective   reward - beta KL, beta = 0.1: R = score - beta sum_t KL_t, held out, the
                objective PPO, RLOO, REINFORCE, GRPO and RAFT all maximise
    mrr         1 / the rank TF-IDF gives the summary's own post among the 64
    rouge_l, words, kl, eos, copied_bigrams, question      as support/heldout.py keeps them

and compares two settings by `intervals.paired_interval` on the seeds both have. A setting
run on one seed gets the seed variance pooled over the page's comparisons of the same
measure that have several seeds (`pools`).

Used by: tools/analysis/claims_page.py, tools/analysis/estimators_page.py.
Test: pytest tests/test_claims.py
"""
import json
import math
from pathlib import Path
from typing import NamedTuple

from support import cli
from support.intervals import (Interval, SeedVariance, moved, paired_interval,
                               seed_variance, seeds_to_resolve, table, verdict)
from support.tables import markdown_table
from tools.analysis.length_bins import EDGES, bin_name, bin_values

BETA = 0.1        # the page's beta: the baseline's, and the objective's
RLOO = "--estimator rloo --batch 2 --samples-per-prompt 4"     # RLOO 2 x 4, PPO's 8 samples
# The settings of the baseline run (the quick start's judge and SFT model, the cpu preset,
# beta = 0.1); a run's setting is the flags where its config differs from these.
BASE = {"beta": 0.1, "estimator": "gae", "batch": 8, "samples_per_prompt": 1, "lam": 0.95,
        "gamma": 0.99, "clip": 0.2, "inner_steps": 2, "reward_noise": 0.0,
        "whiten_rewards": False, "value_init": "post", "missing_eos_penalty": None,
        "value_clip": None, "vf_coef": 1.0, "target_kl": None, "ent_coef": 0.0,
        "ptx_coef": 0.0, "flip_sign": False, "reward": "content", "kl_estimator": "k1"}
# dpo.py's cpu preset and default judge: a DPO run's setting is its beta and where it differs
DPO_BASE = {"steps": 30, "heldout_pairs": 128, "reward_model": "runs/reward_model"}
NAMES = {"reward": "judge", "objective": "reward − β·KL", "mrr": "MRR", "rouge_l": "ROUGE-L",
         "words": "words", "kl": "KL", "eos": "ends by itself", "copied_bigrams":
         "copied bigrams", "question": "questions"}
DIGITS = {"mrr": 3, "rouge_l": 3, "words": 1, "kl": 1}




class Part(NamedTuple):
    """One comparison a verdict reads: what it is, its interval, the sign the claim predicts
    (+1 up, -1 down, 0 none)."""
    name: str
    interval: Interval
    direction: int


class Reading(NamedTuple):
    """What a claim's reader found: the row's measured cell, the Parts its verdict reads,
    every measure shown (name, Interval); or, for a row that is no one paired gain, its
    verdict and seeds-to-resolve cell as they are."""
    measured: str
    parts: list
    shown: list = ()
    verdict: str = ""
    seeds: str = ""


# ------------------------------------------------------------------------ the files

def flags(config, base=None):
    """The flags where a run's config differs from `base` (default BASE), as a command
    writes them."""
    out = []
    for key, default in (base or BASE).items():
        value = config.get(key, default)
        if value == default:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag)
        elif value == math.inf:
            out.append(f"{flag} off")
        else:
            out.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(out)


def load(folder):
    """{setting: {seed: summary}} of the PPO runs, and {name: data} of the other files
    (concentration.json, optimum.json, dpo_*.json). Any seed a file holds is read."""
    runs, other = {}, {}
    for path in sorted(Path(folder).glob("*.json")):
        with cli.reading(path, "a run summary kept by tools.keep_runs"):
            data = json.loads(path.read_text())
        config = data.get("config", {})
        if data.get("final") and "estimator" in config:
            runs.setdefault(flags(config), {})[config["seed"]] = data
        else:
            other[path.stem] = data
    return runs, other


def dpo_groups(other):
    """The DPO runs ({"dpo.py --beta B [flags beside the cpu preset's]": {seed: summary}})
    among the other kept files."""
    groups = {}
    for name, d in other.items():
        if name.startswith("dpo") and d.get("final"):
            setting = f"dpo.py --beta {d['config']['beta']:g} {flags(d['config'], DPO_BASE)}"
            groups.setdefault(setting.strip(), {})[d["config"]["seed"]] = d
    return groups


# ------------------------------------------------------------------------ per post

def value(sample, measure):
    """One held-out sample's value of `measure` (names above)."""
    if measure == "mrr":
        return 1 / sample["retrieval_rank"]
    if measure == "objective":
        # R = score - beta KL: the judge's reward minus beta times the summary's KL to SFT
        return sample["reward"] - BETA * sample["kl"]
    return float(sample[measure])


def per_post(run, measure, posts=None):
    """A run's held-out value of `measure` on each post (its first `posts`, or all)."""
    return [value(s, measure) for s in run["final"]["samples"][:posts]]


def sft_per_post(run, measure):
    """SFT's (the reference's) value on each post, from the same run's file; its KL to
    itself is 0, so its objective is its reward."""
    if measure in ("reward", "objective"):
        return [s["ref_reward"] for s in run["final"]["samples"]]
    return [value(s, measure) for s in run["final"]["ref_samples"]]


def by_seed(runs, measure, posts=None):
    """{seed: [value per post]} of one setting's runs."""
    return {seed: per_post(r, measure, posts) for seed, r in runs.items()}


def mean_of(runs, measure, posts=None):
    """The mean over seeds of each run's mean over posts (its first `posts`, or all)."""
    values = [sum(x := per_post(r, measure, posts)) / len(x) for r in runs.values()]
    return sum(values) / len(values)


def common(*groups):
    """Each group ({seed: summary}) cut to the seeds every group has."""
    seeds = set.intersection(*(set(g) for g in groups))
    return [{seed: g[seed] for seed in seeds} for g in groups]


def seed_list(seeds):
    """'seed 0' or 'seeds 0, 1, 2'."""
    seeds = sorted(seeds)
    return f"seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"


# ------------------------------------------------------------------------ intervals

def pools(runs):
    """{measure: SeedVariance}: the seed variance of each measure pooled over the page's
    comparisons with several seeds, every setting against the baseline (beta = 0.1), for
    the comparisons run on one seed (`intervals.seed_variance`)."""
    base = runs.get("", {})
    out = {}
    for measure in NAMES:
        tables = [table(by_seed(r, measure), by_seed(base, measure))
                  for setting, r in runs.items() if setting and len(set(r) & set(base)) >= 2]
        out[measure] = seed_variance(tables)
    return out


def compare(runs, base, measure, pooled=None, posts=None):
    """The `Interval` of setting `runs` over `base` ({seed: summary} each) on `measure`,
    paired by seed and post; `pooled` ({measure: SeedVariance}) for a one-seed pair."""
    return paired_interval(by_seed(runs, measure, posts), by_seed(base, measure, posts),
                           (pooled or {}).get(measure))


def over_sft(runs, measure, pooled=None):
    """The `Interval` of `runs` over SFT's summaries of the same posts."""
    return paired_interval(by_seed(runs, measure),
                           {s: sft_per_post(r, measure) for s, r in runs.items()},
                           (pooled or {}).get(measure))


def doubled(pooled):
    """A SeedVariance twice as large: the seed noise of a difference of two gains (four
    runs) where each gain's is one pooled seed variance."""
    return SeedVariance(2 * pooled.s2, pooled.df) if pooled else None


def pm(interval, digits=2, scale=1):
    """'+0.18 ± 0.08': the gain and the half-width of its 95% interval."""
    g, half = scale * interval.gain, scale * (interval.high - interval.gain)
    return f"{g:+.{digits}f} ± {half:.{digits}f}" if math.isfinite(half) else f"{g:+.{digits}f}"


def cell(measure, interval):
    """'judge +0.18 ± 0.08'; a share that ends by itself in points of percent."""
    if measure == "eos":
        return f"{NAMES[measure]} {pm(interval, 0, 100)} points"
    return f"{NAMES[measure]} {pm(interval, DIGITS.get(measure, 2))}"


def win_rate(interval):
    """'63% [53%, 73%]': a win rate from the interval of (win - 1/2), its ends kept to
    0-100%."""
    pct = lambda x: f"{min(max(50 + 100 * x, 0), 100):.0f}%"  # noqa: E731
    return f"{pct(interval.gain)} [{pct(interval.low)}, {pct(interval.high)}]"


def seeds_needed(interval):
    """The 'seeds to resolve' cell of a comparison not yet resolved: the seeds a side an
    interval of its measured variances would need, or '> 100'."""
    s = seeds_to_resolve(interval)
    return str(s) if s is not None else "> 100"


def bin_intervals(group, pooled_bins):
    """[(bin name, posts over seeds, Interval of the win rate - 1/2)] for each length bin
    some run of one setting ({seed: summary}) has summaries in (tools/analysis/length_bins.py's
    `bin_values`); `pooled_bins`: each bin's SeedVariance for one seed."""
    out = []
    for i, pooled in enumerate(pooled_bins):
        values = {s: v for s, r in group.items() if (v := bin_values(r)[i]) is not None}
        if values:
            zeros = {s: [0.0] * len(x) for s, (x, _) in values.items()}
            iv = paired_interval({s: x for s, (x, _) in values.items()}, zeros, pooled)
            out.append((bin_name(i, EDGES), sum(n for _, n in values.values()), iv))
    return out


def bin_pools(runs):
    """Each length bin's seed variance, pooled over the settings with several seeds in it."""
    out = []
    for i in range(len(EDGES) + 1):
        tables = []
        for group in runs.values():
            values = [v[0] for r in group.values() if (v := bin_values(r)[i]) is not None]
            if len(values) >= 2:
                tables.append(table(dict(enumerate(values)),
                                    {j: [0.0] * len(x) for j, x in enumerate(values)}))
        out.append(seed_variance(tables))
    return out


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


# ------------------------------------------------------------------------ the settings' table

COLUMNS = ["setting (ppo.py's flags beside `--beta 0.1`)", "seeds", "judge", "judge vs SFT",
           "judge vs β = 0.1", "reward − β·KL vs β = 0.1", "MRR", "MRR vs β = 0.1", "ROUGE-L",
           "ROUGE-L vs β = 0.1", "words", "ends by itself", "copied", "KL", "clipped",
           "ratio after the last step", "machine"]


def training(runs, key):
    """A per-iteration quantity averaged over a run's iterations, then over seeds."""
    return sum(sum(x[key] for x in r["iterations"]) / len(r["iterations"])
               for r in runs.values()) / len(runs)


def settings_table(runs, dpo, pooled):
    """A row per setting: its held-out means, its gains (one rule) and its training's clip
    statistics, with the CPU that ran it; then DPO's policies; then SFT."""
    base = runs.get("")
    rows = []
    for setting in [*sorted(runs, key=lambda s: (s != "", s)), *sorted(dpo)]:
        r = runs.get(setting) or dpo[setting]
        finals = [x["final"] for x in r.values()]
        mean = lambda key: sum(f[key] for f in finals) / len(finals)  # noqa: E731
        vs = ((lambda m: pm(compare(r, base, m, pooled), DIGITS.get(m, 2)))
              if base and setting else (lambda m: ""))
        rows_ = [x for run in r.values() for x in run.get("iterations", [])]
        clipped = ("off" if "--clip off" in setting else f"{training(r, 'clipfrac'):.2%}"
                   if rows_ else "—")
        after = (f"{min(x['ratio_after_min'] for x in rows_):.2f} to "
                 f"{max(x['ratio_after_max'] for x in rows_):.2f}" if rows_ else "—")
        rows.append([f"`{setting}`" if setting else "(baseline)", str(len(r)),
                     f"{mean_of(r, 'reward'):+.2f}", pm(over_sft(r, "reward", pooled)),
                     vs("reward"), vs("objective"), f"{mean_of(r, 'mrr'):.3f}", vs("mrr"),
                     f"{mean_of(r, 'rouge_l'):.3f}", vs("rouge_l"),
                     f"{mean_of(r, 'words'):.0f}", f"{mean('eos_fraction'):.0%}",
                     f"{mean('copied_bigrams'):.0%}", f"{mean('kl'):.2f}", clipped, after,
                     "; ".join(sorted({x["machine"] for x in r.values()}))])
    if base:
        one = next(iter(base.values()))
        ref, refs = one["final"]["ref"], one["final"]["ref_samples"]
        rows.append(["SFT (the reference)", "", f"{ref['reward']:+.2f}", "", "", "",
                     f"{ref['retrieval_mrr']:.3f}", "", f"{ref['rouge_l']:.3f}", "",
                     f"{sum(s['words'] for s in refs) / len(refs):.0f}",
                     f"{ref['eos_fraction']:.0%}", f"{ref['copied_bigrams']:.0%}", "", "", "",
                     ""])
    return markdown_table(COLUMNS, rows)


def held_back(runs):
    """A sentence on the runs whose machine ran PyTorch's kernels with fewer instructions than
    it has ("kernels as AVX2": ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU, support/kept.py):
    whether each one's first batch, drawn before any update from the same SFT model, scored
    by the same judge, has the judge's reward of its seed's β = 0.1 run to the last bit (it
    should when both are an AVX2 machine's numbers); '' when there are none."""
    base = runs.get("", {})
    same = [run["iterations"][0]["reward"] == base[seed]["iterations"][0]["reward"]
            for group in runs.values() for seed, run in group.items()
            if "kernels as" in run["machine"] and seed in base
            and "kernels as" not in base[seed]["machine"]
            and all(run["config"].get(k, BASE[k]) == BASE[k]
                    for k in ("batch", "samples_per_prompt"))]
    if not same:
        return ""
    which = f"each of the {len(same)}" if all(same) else f"only {sum(same)} of the {len(same)}"
    return (" \"Kernels as AVX2\": PyTorch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`) on a "
            "CPU with AVX-512, the SFT model and judge retrained there so; the first batch of "
            f"{which} such runs has, to the last bit, the judge's reward of its seed's "
            "β = 0.1 run on the AVX2 machine.")
