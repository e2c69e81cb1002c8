"""docs/claims.md: the readings' claims, each a command, a row and a verdict, remade from the
run summaries the repository keeps (docs/runs/claims/, written by `tools.keep_runs`).

    python -m tools.claims_page                 # docs/claims.md and its plots, in seconds
    python -m tools.claims_page --check         # exit 1 if the page is not what the files say

Every number on the page comes from those files. A claim whose runs are not there yet is a
row that says so, with the command that makes them. Gains are paired by post within seed
(`measures.paired_gain`): the larger of the SE over seeds and the SE over the 64 held-out
posts; "above" and "below" mean past 2 SE.
"""
import argparse
import json
import math
from pathlib import Path

from support import cli
from support.disk import save_figure, write_text
from support.measures import paired_gain
from support.optimum import best_of_n_weights, by_score, optimum_point
from support.report import optimum_curves
from tools import length_bins
from support.sweep import judge_sd
from support.tables import MEASURES, markdown_table

RUNS = Path("docs/runs/claims")
PAGE = Path("docs/claims.md")
# The settings of the baseline run (the quick start's judge and SFT model, the cpu preset,
# beta = 0.1); a run's setting is the flags where its config differs from these.
BASE = {"beta": 0.1, "estimator": "gae", "batch": 8, "samples_per_prompt": 1, "lam": 0.95, "gamma": 0.99,
        "clip": 0.2, "inner_steps": 2, "reward_noise": 0.0, "whiten_rewards": False,
        "value_init": "post", "missing_eos_penalty": None, "value_clip": None, "vf_coef": 1.0,
        "target_kl": None, "ent_coef": 0.0, "ptx_coef": 0.0, "flip_sign": False,
        "reward": "content", "kl_estimator": "k1"}
DPO_BETAS = (0.05, 0.1, 0.5)   # dpo.py's β on seed 0; the best of them then on seeds 1, 2
SEEDS = (0, 1, 2)     # tier 1's seeds, and tier 2's where a sign is within 2 SE
SWEEP_BETAS = (0, 0.01, 0.1, 0.5, 2)     # ppo.py's sweep (the post's)
NOISE_SDS = (1, 3)    # --reward-noise, in the judge's SDs: `order_kept` says why these two
LAST = 10             # iterations: the end of a run's training, the controller's last word
TARGETS = (1, 3)      # --target-kl, nats a summary: below and at β = 0.1's own 2.9 at the end


# ------------------------------------------------------------------------ the runs' files

def flags(config):
    """The flags where a run's config differs from BASE, as a command writes them."""
    out = []
    for key, default in BASE.items():
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
    (concentration.json, optimum.json, dpo_*.json)."""
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


# ------------------------------------------------------------------------ per-run numbers

def per_post(run, measure):
    """A run's held-out value of `measure` on each post: reward (the judge's), mrr (1 over
    the rank of its own post), rouge_l, words, length, kl."""
    samples = run["final"]["samples"]
    if measure == "mrr":
        return [1 / s["retrieval_rank"] for s in samples]
    return [float(s[measure]) for s in samples]


def sft_per_post(run, measure):
    """SFT's (the reference's) value on each post, from the same run's file."""
    if measure == "reward":
        return [s["ref_reward"] for s in run["final"]["samples"]]
    samples = run["final"]["ref_samples"]
    return [1 / s["retrieval_rank"] if measure == "mrr" else float(s[measure]) for s in samples]


def gain(runs, base_runs, measure):
    """(gain, SE) of `runs` over `base_runs` ({seed: summary}) on `measure`, paired."""
    g, se, _ = paired_gain({s: per_post(r, measure) for s, r in runs.items()},
                           {s: per_post(r, measure) for s, r in base_runs.items()})
    return g, se


def over_sft(runs, measure):
    """(gain, SE) of `runs` over SFT on the same posts."""
    g, se, _ = paired_gain({s: per_post(r, measure) for s, r in runs.items()},
                           {s: sft_per_post(r, measure) for s, r in runs.items()})
    return g, se


def mean_of(runs, measure, posts=None):
    """The mean over seeds of each run's mean over posts (its first `posts`, or all)."""
    values = [sum(x := per_post(r, measure)[:posts]) / len(x) for r in runs.values()]
    return sum(values) / len(values)


def training(runs, key, reduce=lambda rows, k: sum(r[k] for r in rows) / len(rows)):
    """A per-iteration quantity reduced over a run's iterations, then averaged over seeds."""
    values = [reduce(r["iterations"], key) for r in runs.values()]
    return sum(values) / len(values)


def final_mean(runs, key):
    """A key of the held-out evaluation (final), averaged over seeds."""
    return sum(r["final"][key] for r in runs.values()) / len(runs)


def pm(value, se, digits=2):
    return f"{value:+.{digits}f} ± {se:.{digits}f}" if not math.isnan(se) else f"{value:+.{digits}f}"


def accuracy(m):
    """'61.2% [55.0%, 67.1%]': a judge's held-out accuracy and its Wilson interval (R4)."""
    return f"{m['heldout_accuracy']:.1%} [{m['wilson_low']:.1%}, {m['wilson_high']:.1%}]"


def outside_note(runs, base):
    """'; but MRR below by 2.9 SE' for each measure the judge never saw that fell past 2 SE
    against the baseline, or '; neither MRR nor ROUGE-L below' where none did."""
    notes = []
    for measure, name in (("mrr", "MRR"), ("rouge_l", "ROUGE-L")):
        g, se = gain(runs, base, measure)
        if g < -2 * se:
            notes.append(f"{name} below by {-g / se:.1f} SE")
    return "; but " + " and ".join(notes) if notes else "; neither MRR nor ROUGE-L below"


def on_common_seeds(*groups):
    """Each group ({seed: summary}) cut to the seeds every group has: means read on the same
    seeds, as the paired gains are."""
    common = set.intersection(*(set(g) for g in groups))
    return [{seed: g[seed] for seed in common} for g in groups]


def seed_list(seeds):
    """'seed 0' or 'seeds 0, 1, 2'."""
    seeds = sorted(seeds)
    return f"seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"


def unrun_seeds(*groups):
    """' (seeds 1, 2 not yet run)': the seeds of SEEDS that a group ({seed: summary}) of the
    comparison lacks, or ''."""
    lacking = {s for group in groups for s in SEEDS if s not in group}
    return f" ({seed_list(lacking)} not yet run)" if lacking else ""


def versus(g, se):
    """'above', 'below' (past 2 SE) or 'within 2 SE'."""
    if math.isnan(se) or abs(g) <= 2 * se:
        return "within 2 SE"
    return "above" if g > 0 else "below"


# ------------------------------------------------------------------------ the claims

def row(number, reading, claim, command, measured, verdict):
    return [number, reading, claim, f"`{command}`", measured, verdict]


def missing(number, reading, claim, command, what):
    return row(number, reading, claim, command, "—", f"not yet run: {what}")


def judge_row(runs, base, against="β = 0.1"):
    """The measured cell of a setting against the baseline: judge, MRR, ROUGE-L gains, paired
    on the seeds both have (their count in brackets)."""
    cells = []
    for measure, name, digits in (("reward", "judge", 2), ("mrr", "MRR", 3),
                                  ("rouge_l", "ROUGE-L", 3)):
        g, se = gain(runs, base, measure)
        cells.append(f"{name} {pm(g, se, digits)}")
    paired = len(set(runs) & set(base))
    return ", ".join(cells) + f" vs {against} ({paired} seed{'s' * (paired > 1)})"


def claims(runs, other):
    """The table's rows, one per claim: [#, reading, claim, command, measured, verdict]."""
    base = runs.get("")
    rows = []
    ppo = "python ppo.py --beta 0.1"
    # 1. lambda
    lams = ["--lam 1", "", "--lam 0.5", "--lam 0"]
    claim = "λ from 1 to 0.95, 0.5 and 0: the reward falls in that order"
    have = [s for s in lams if s in runs]
    if base and len(have) >= 2:
        same = on_common_seeds(*(runs[s] for s in have))           # the order on the same seeds
        common = same[0].keys()
        means = {s: mean_of(r, "reward") for s, r in zip(have, same)}
        text = "; ".join(f"λ {'0.95' if s == '' else s.split()[1]}: {means[s]:+.2f}" for s in have)
        text += f" ({seed_list(common)})"
        g, se = gain(runs[have[0]], runs[have[-1]], "reward")
        ordered = all(means[a] >= means[b] for a, b in zip(have, have[1:]))
        verdict = ("holds here" if ordered and g > 2 * se else
                   "in part: the ends fall past 2 SE, the middle is out of order" if g > 2 * se
                   else "does not hold here" if g < -2 * se else
                   "not resolved: " + "the means fall in that order, but " * ordered +
                   f"λ {have[0].split()[-1] if have[0] else '0.95'} against "
                   f"{have[-1].split()[-1] if have[-1] else '0.95'} is {pm(g, se)}, within 2 SE")
        missing_lams = [s or "--lam 0.95" for s in lams if s not in runs]
        verdict += f" ({', '.join(missing_lams)} not yet run)" * bool(missing_lams)
        verdict += unrun_seeds(base, *(runs[s] for s in have))
        rows.append(row("1", "004 (Ahmadian et al.)", claim, f"{ppo} --lam {{1, 0.5, 0}} --seeds 0 1 2",
                        "judge's reward: " + text, verdict))
    else:
        rows.append(missing("1", "004 (Ahmadian et al.)", claim,
                            f"{ppo} --lam {{1, 0.5, 0}} --seeds 0 1 2", "the λ runs"))
    conc = other.get("concentration")
    claim = "the SFT model puts ~60% on its top token and >90% on its top 16 after the first"
    if conc:
        later = conc["after_first"]
        top1, top16 = later["top1"], later["top16"]
        verdict = ("holds here" if top1 >= 0.5 and top16 >= 0.9 else
                   "does not hold here: less concentrated" if top16 < 0.9 or top1 < 0.5 else "")
        rows.append(row("1", "004", claim, "python -m tools.concentration",
                        f"top token {top1:.0%}, top 16 {top16:.0%}, entropy / log V "
                        f"{later['entropy']:.2f}", verdict))
    else:
        rows.append(missing("1", "004", claim, "python -m tools.concentration", "its file"))
    # 2. clipping
    claim = "PPO clips fewer than 5% of tokens"
    if runs:
        clipping = {s: r for s, r in runs.items()                 # PPO's: GAE, clipped,
                    if "--clip off" not in s and "--estimator" not in s   # learning the task
                    and "--flip-sign" not in s}
        mean = max(training(r, "clipfrac") for r in clipping.values())
        worst = max(training(r, "clipfrac", lambda rows, k: max(x[k] for x in rows))
                    for r in clipping.values())
        rows.append(row("2", "004 (Huang et al.)", claim, f"{ppo}  (clipfrac, every PPO run)",
                        f"share of tokens clipped, mean over iterations: at most {mean:.2%}; "
                        f"in the worst iteration {worst:.2%} ({len(clipping)} setting"
                        f"{'s' * (len(clipping) > 1)}; not --flip-sign, whose objective "
                        "rewards leaving SFT)",
                        "holds here" if worst < 0.05 else "does not hold here"))
    for setting, claim, what in (          # settings as `flags` writes them: BASE's order
            ("--clip off", "turning clipping off does not hurt", "no clipping"),
            ("--lam 1 --clip off --inner-steps 1",
             "vanilla policy gradient (no clip, no ratio, λ = 1) does not hurt",
             "vanilla policy gradient")):
        command = f"{ppo} {setting}"
        if base and setting in runs:
            g, se = gain(runs[setting], base, "reward")
            rows.append(row("2", "004 (Ahmadian et al.)", claim, command,
                            judge_row(runs[setting], base),
                            (("holds here on the judge" + outside_note(runs[setting], base))
                             if g >= -2 * se else "does not hold here: the judge's reward falls")
                            + unrun_seeds(runs[setting], base)))
        else:
            rows.append(missing("2", "004 (Ahmadian et al.)", claim, command, what))
    # 3. RAFT and reward noise
    rloo = "--estimator rloo --batch 2 --samples-per-prompt 4"
    for k in (2, 4):
        raft = f"--estimator raft --batch {8 // k} --samples-per-prompt {k}"
        claim = f"RAFT at k = {k} trails RLOO (2 x 4)"
        command = f"{ppo} {raft}"
        if raft in runs and rloo in runs:
            g, se = gain(runs[raft], runs[rloo], "reward")
            both = on_common_seeds(runs[raft], runs[rloo])     # the seeds the gains pair on
            copied = [mean_of(r, "copied_bigrams") for r in both]
            kl = [mean_of(r, "kl") for r in both]
            rows.append(row("3", "004 (Ahmadian et al.)", claim, command,
                            f"judge {pm(g, se)} against RLOO; " + judge_row(
                                runs[raft], runs[rloo], "RLOO").split(", ", 1)[1] +
                            f"; bigrams copied from the post {copied[0]:.0%} against RLOO's "
                            f"{copied[1]:.0%}, KL {kl[0]:.1f} against {kl[1]:.1f}",
                            ("holds here" if g < -2 * se else
                             "does not hold here on the judge" if g > 2 * se else
                             "not resolved: within 2 SE") +
                            (": RAFT's summaries copy the post" if copied[0] > copied[1] + 0.2
                             else "") + unrun_seeds(runs[raft], runs[rloo])))
        else:
            rows.append(missing("3", "004 (Ahmadian et al.)", claim, command,
                                "RAFT and RLOO 2 x 4 at the same samples"))
    rows.append(noise_row(runs, ppo, rloo, "--estimator raft --batch 2 --samples-per-prompt 4"))
    # 4. DPO
    rows.append(dpo_row(dpo_groups(other)))
    # 5. Stiennon's and Huang's settings, one change each: the measure a claim names moves
    # in its direction (+1 up, -1 down); a setting with no claim of its own is read on the judge
    for setting, claim, measure, name, sign in (
            ("--whiten-rewards", "whitening the rewards gives shorter summaries",
             "words", "words", -1),
            ("--value-init reward", "the value head from the judge", "reward", "the judge", 0),
            ("--missing-eos-penalty -1", "-1 for a summary with no EOS: more end by themselves",
             "eos", "ends by itself", +1),
            ("--value-clip 0.2 --vf-coef 0.1", "the value loss clipped at 0.2, weight 0.1",
             "reward", "the judge", 0),
            ("--gamma 1", "γ = 1", "reward", "the judge", 0),
            *((f"--target-kl {t}", f"the adaptive KL controller, target {t} "
               f"nat{'s' * (t != 1)}", "reward", "the judge", 0) for t in TARGETS)):
        command = f"{ppo} {setting}"
        if not (base and setting in runs):
            rows.append(missing("5", "004 (Stiennon, Huang et al.)", claim, command, "one seed"))
            continue
        g, se = gain(runs[setting], base, measure)
        if sign:
            verdict = ("holds here" if sign * g > 2 * se else f"does not hold here: {name} "
                       f"{'rises' if g > 0 else 'falls'}" if sign * g < -2 * se else
                       f"not resolved: {name} within 2 SE of the baseline's")
        else:
            verdict = (f"{name} {versus(g, se).replace('2 SE', '2 SE of')} the baseline"
                       + outside_note(runs[setting], base))
        verdict += unrun_seeds(runs[setting], base) * (versus(g, se) == "within 2 SE")
        held = ""
        if "--target-kl" in setting:        # the controller's own job: KL near its target
            last = [x for r in runs[setting].values() for x in r["iterations"][-LAST:]]
            seeds = sorted(runs[setting])
            ends = " / ".join(f"{runs[setting][s]['iterations'][-1]['beta']:.3f}" for s in seeds)
            held = (f"; the batch's KL over the last {LAST} iterations "
                    f"{sum(x['kl'] for x in last) / len(last):.2f} against its target "
                    f"{setting.split()[-1]}, β at the end {ends} ({seed_list(seeds)})")
        rows.append(row("5", "004 (Stiennon, Huang et al.)", claim, command,
                        judge_row(runs[setting], base) + held +
                        (f"; {name} " + (f"{pm(100 * g, 100 * se, 0)} points" if measure ==
                                         "eos" else pm(g, se, 1))) * bool(sign),
                        verdict))
    # 6. (12) and (13) at beta = 0
    rows += beta0_rows(runs)
    # 7. the optimum
    rows.append(optimum_row(base, other.get("optimum")))
    # 8. length bins, for each of the sweep's β that has runs here
    claim = "PPO wins over SFT in every length bin"
    settings = {f"{b:g}": "" if b == BASE["beta"] else f"--beta {b:g}" for b in SWEEP_BETAS}
    sweep = {f"β = {b}": runs[s] for b, s in settings.items() if s in runs}
    unrun = [b for b, s in settings.items() if s not in runs]
    if sweep:
        cells, verdicts = [], []
        for name, setting_runs in sweep.items():
            bins = [b for b in by_length(setting_runs) if b["posts"]]
            cells.append(f"{name}: " + ", ".join(f"{b['bin']} {b['win_rate']:.0%} of "
                                                f"{b['posts']}" for b in bins))
            verdicts.append(f"{name}: " + (
                "holds here" if all(b["wilson"][0] > 0.5 for b in bins) else
                "does not hold here" if any(b["wilson"][1] < 0.5 for b in bins) else
                "not resolved: a bin's Wilson interval holds 50%"))
        rows.append(row("8", "004 (Stiennon et al.)", claim, "python -m tools.length_bins RUN",
                        "win rate over SFT by length over the person's TL;DR: "
                        + "; ".join(cells), "; ".join(verdicts) +
                        f" (β = {', '.join(unrun)}: not yet run here; "
                        f"`python ppo.py --beta {' '.join(unrun)}` makes them)" * bool(unrun)))
    else:
        rows.append(missing("8", "004 (Stiennon et al.)", claim, "python -m tools.length_bins RUN",
                            "the β = 0.1 runs"))
    # 9. the sign flip
    claim = "negating both the score and the KL term gives fluent text the judge scores worst"
    setting = "--flip-sign"
    if setting in runs:
        g, se = over_sft(runs[setting], "reward")
        # fluent: the held-out KL from SFT (nats a summary) not above the baseline's past 2 SE
        d, d_se = gain(runs[setting], base, "kl") if base else (math.nan, math.nan)
        kl, fluency = mean_of(runs[setting], "kl"), final_mean(runs[setting], "fluency")
        rows.append(row("9", "004 (Ziegler et al.)", claim, f"{ppo} --flip-sign",
                        f"judge {pm(g, se)} over SFT; held-out KL {kl:.1f} nats a summary "
                        f"({pm(d, d_se, 1)} against β = 0.1); the reference's log-probability "
                        f"of a summary {fluency:.0f} (β = 0.1: "
                        f"{final_mean(base, 'fluency'):.0f})" if base else "",
                        ("does not hold here: the judge scores it below SFT, but it is not "
                         "fluent (see its samples in the kept file)" if d > 2 * d_se else
                         "holds here") if g < -2 * se else "does not hold here"))
    else:
        rows.append(missing("9", "004 (Ziegler et al.)", claim, f"{ppo} --flip-sign", "one seed"))
    return rows


def noise_levels(runs):
    """The --reward-noise SDs that some kept run used, as its flag writes them ('1', '3')."""
    return sorted({s.split("--reward-noise ")[1].split()[0] for s in runs
                   if "--reward-noise" in s})


def order_kept(sd):
    """How often noise of `sd` (in the judge's SDs) leaves two summaries in the judge's order:
    with scores r1, r2 ~ N(mu, s^2) and noise e1, e2 ~ N(0, (sd s)^2), the differences
    r1 - r2 and (r1 + e1) - (r2 + e2) are normal with correlation rho (Sheppard's formula):
        P(same sign) = 1/2 + asin(rho) / pi,        rho = 1 / sqrt(1 + sd^2)
    3/4 at SD 1 (most of a comparison's signal kept), 0.60 at SD 3 (little of it)."""
    return 0.5 + math.asin(1 / math.sqrt(1 + sd * sd)) / math.pi


def noise_row(runs, ppo, rloo, raft):
    """Item 3's noise claim: how much each estimator's judge's reward falls when the score it
    learns from gets Gaussian noise (--reward-noise SD), RAFT's fall against RLOO's:
        fall_e = R(e, noisy) - R(e, clean)       paired by post within seed
        D = fall_RAFT - fall_RLOO                (the claim: D < 0)"""
    claim = "RAFT loses more reward than RLOO under reward noise"
    noisy = noise_levels(runs)
    command = f"{ppo} {{{rloo}, {raft}}} --reward-noise {{0, SD}}"
    cells, verdicts = [], []
    for sd in noisy:
        pairs = [(runs.get(f"{e} --reward-noise {sd}"), runs.get(e)) for e in (raft, rloo)]
        if not all(a and b for a, b in pairs):
            continue
        falls = [{seed: [x - y for x, y in zip(per_post(a[seed], "reward"),
                                                per_post(b[seed], "reward"))]
                  for seed in set(a) & set(b)} for a, b in pairs]
        d, se, _ = paired_gain(*falls)
        fall = [gain(a, b, "reward")[0] for a, b in pairs]
        seeds = len(falls[0])
        cells.append(f"SD {sd} (judge's SDs): RAFT {fall[0]:+.2f}, RLOO {fall[1]:+.2f}; "
                     f"RAFT's against RLOO's {pm(d, se)}")
        verdicts.append((sd, "holds here" if d < -2 * se else "does not hold here"
                         if d > 2 * se else "not resolved"))
    if not cells:
        return missing("3", "004 (Ahmadian et al.)", claim, command,
                       "RAFT and RLOO 2 x 4, each with and without the noise")
    unrun = [f"{sd:g}" for sd in NOISE_SDS if f"{sd:g}" not in noisy]
    return row("3", "004 (Ahmadian et al.)", claim, command,
               "change of the judge's reward with the noise: " + "; ".join(cells),
               by_level(verdicts) + f" ({seeds} seed{'s' * (seeds > 1)})" +
               f"; SD {', '.join(unrun)} not yet run" * bool(unrun))


def by_level(verdicts):
    """One verdict for the noise levels that agree, else one per level:
    [('1', 'not resolved'), ('3', 'not resolved')] -> 'not resolved at SD 1 and 3: within 2 SE'."""
    labels = {label for _, label in verdicts}
    if len(labels) == 1:
        label = labels.pop()
        levels = " and ".join(sd for sd, _ in verdicts)
        said = label + f" at SD {levels}" * (len(verdicts) > 1)
        return said + ": within 2 SE" * (label == "not resolved")
    return "; ".join(f"SD {sd}: {label}" + " (within 2 SE)" * (label == "not resolved")
                     for sd, label in verdicts)


def beta0_rows(runs):
    """Item 6: the entropy bonus (12) and the supervised loss (13) at beta = 0, each against
    beta = 0 alone on what beta = 0 goes wrong with: copied bigrams and questions."""
    rows, plain = [], runs.get("--beta 0")
    for setting, claim in (("--beta 0 --ent-coef 0.01",
                            "the entropy bonus (12) at β = 0 stops its copying and questions"),
                           ("--beta 0 --ptx-coef 1",
                            "the supervised loss (13) at β = 0 stops its copying and questions")):
        command = f"python ppo.py {setting}"
        if not (plain and setting in runs):
            rows.append(missing("6", "000 (the post)", claim, command,
                                "one seed" + ", and `--beta 0` beside it" * (not plain)))
            continue
        changes = [(name, *gain(runs[setting], plain, key))
                   for key, name in (("copied_bigrams", "copied bigrams"),
                                     ("question", "questions"))]
        sides = {name: versus(g, se) for name, g, se in changes}
        rows.append(row("6", "000 (the post)", claim, command,
                        "; ".join(f"{name} {pm(g, se)} against β = 0 alone"
                                  for name, g, se in changes) + "; " +
                        judge_row(runs[setting], plain, "β = 0"),
                        stops_verdict(sides) + unrun_seeds(runs[setting], plain) * (
                            "within 2 SE" in sides.values())))
    return rows


def stops_verdict(sides):
    """Item 6's verdict from each measure's side ({name: versus(...)}): the claim is that
    every one of them falls."""
    fell = [name for name, side in sides.items() if side == "below"]
    rose = [name for name, side in sides.items() if side == "above"]
    if len(fell) == len(sides):
        return "holds here"
    if fell:
        return "in part: " + ", ".join(fell) + " fall past 2 SE"
    if rose:
        return "does not hold here: " + " and ".join(rose) + " rise past 2 SE"
    return "not resolved: neither falls past 2 SE"


def dpo_row(groups):
    """Item 4: each DPO run's implicit judge (D1) against the explicit judge's content score on
    the same held-out pairs, by Wilson interval. The best beta is chosen on seed 0 by the
    implicit judge's accuracy, so its later seeds are fresh draws of the chosen setting."""
    claim = "DPO read as an implicit reward model is less accurate than the explicit judge"
    command = (f"python dpo.py --beta {{{', '.join(f'{b:g}' for b in DPO_BETAS)}}} --seed 0, "
               "then the best β --seed {1, 2}")
    if not groups:
        return missing("4", "004 (Huang et al.)", claim, command, "the DPO runs")
    runs = [d for group in groups.values() for d in group.values()]
    judges = [d["final"]["judges"] for d in runs]      # implicit, content, full; per run
    explicit = {accuracy(j["content"]) for j in judges}
    firsts = {name: group[0] for name, group in groups.items() if 0 in group}
    best = max(firsts, key=lambda name: firsts[name]["final"]["judges"]["implicit"][
        "heldout_accuracy"]) if firsts else None
    cells = [f"β {name.split()[-1]}, seed {seed}: implicit "
             f"{accuracy(d['final']['judges']['implicit'])}"
             for name, group in sorted(groups.items(), key=lambda g: float(g[0].split()[-1]))
             for seed, d in sorted(group.items())]
    below = [j["implicit"]["wilson_high"] < j["content"]["wilson_low"] for j in judges]
    above = [j["implicit"]["wilson_low"] > j["content"]["wilson_high"] for j in judges]
    higher = all(j["implicit"]["heldout_accuracy"] > j["content"]["heldout_accuracy"]
                 for j in judges)
    verdict = ("holds here" if all(below) else "does not hold here: the implicit judge is "
               "the more accurate" if any(above) else "not resolved: the Wilson intervals "
               "overlap" + (" (the implicit judge is the higher in every run)" if higher else ""))
    later = sorted(set(groups.get(best, {})) - {0})
    unrun = [f"{b:g}" for b in DPO_BETAS if f"dpo.py --beta {b:g}" not in firsts]
    verdict += f"; β {', '.join(unrun)} not yet run" * bool(unrun)
    verdict += (f"; best β on seed 0 by the implicit judge: {best.split()[-1]}, "
                + (f"{seed_list(later)} run" if later else
                   "seeds 1, 2 not yet run")) if best and not unrun else ""
    return row("4", "004 (Huang et al.)", claim, command,
               "; ".join(cells) + f"; the explicit judge (content) {' / '.join(sorted(explicit))}"
               f" on the same {runs[0]['final']['judges']['pairs']} held-out pairs", verdict)


def optimum_row(base, opt):
    """Item 7: the baseline's held-out judge's reward against the optimum at beta = 0.1 and
    best-of-n at the largest n whose KL is at most the run's, on the same posts (the
    optimum's: ppo.py's first), paired by post: d_i = R_PPO,i - R_*,i."""
    claim = "PPO falls short of the KL-regularised optimum, the reference times e^{r/β}"
    command = "python -m tools.optimum"
    if not (base and opt):
        return missing("7", "004 (Ziegler et al.)", claim, command,
                       "its samples" if base else "the β = 0.1 runs")
    n, k = opt["posts"], opt["samples"]
    kl, reward = mean_of(base, "kl", n), mean_of(base, "reward", n)
    scores = [post["reward"] for post in opt["per_post"]]                  # n lists of k
    best = [r for r in opt["best_of_n"] if r["kl"] <= kl][-1]
    points = {"the optimum at β = 0.1": [optimum_point(r, 0.1)[0] for r in scores],
              f"best of {best['n']} (KL {best['kl']:.2f})":
                  [(best_of_n_weights(k, best["n"]) * by_score(r, r)).sum().item()
                   for r in scores]}
    cells, below, above = [], [], 0
    for name, values in points.items():
        g, se, _ = paired_gain({s: per_post(r, "reward")[:n] for s, r in base.items()},
                               {s: values for s in base})
        cells.append(f"{name} {sum(values) / n:+.2f}, PPO against it {pm(g, se)}")
        below += [name.split(" (")[0]] * (g < -2 * se)
        above += g > 2 * se
    star = next(r for r in opt["optimum"] if r["beta"] == 0.1)
    return row("7", "004 (Ziegler et al.)", claim, f"{command} --samples {k} --eval-prompts {n}",
               f"on the first {n} held-out posts: β = 0.1 run: judge {reward:+.2f} at KL "
               f"{kl:.2f}; the optimum's KL {star['kl']:.2f}; " + "; ".join(cells),
               (f"holds here: below {' and '.join(below)}" if below else
                "does not hold here: above both" if above == len(points) else
                "not resolved: within 2 SE") +
               f" (k = {k} samples a post: the optimum's KL is at most log k = "
               f"{opt['kl_cap']:.2f})")


def by_length(runs):
    """tools.length_bins' rows (a bin each: posts, win rate over SFT and its Wilson interval,
    MRR and SFT's) for one setting's runs ({seed: summary}), seeds pooled."""
    (pairs,) = length_bins.pool(list(runs.values())).values()
    return length_bins.bin_rows(pairs)


# ------------------------------------------------------------------------ the settings' table

COLUMNS = ["setting (ppo.py's flags beside `--beta 0.1`)", "seeds", "judge", "judge vs SFT",
           "judge vs β = 0.1", "MRR", "MRR vs β = 0.1", "ROUGE-L", "ROUGE-L vs β = 0.1",
           "words", "ends by itself", "copied", "KL", "clipped", "ratio after the last step",
           "machine"]


def dpo_groups(other):
    """The DPO runs ({"dpo.py --beta B": {seed: summary}}) among the other kept files."""
    groups = {}
    for name, d in other.items():
        if name.startswith("dpo") and d.get("final"):
            groups.setdefault(f"dpo.py --beta {d['config']['beta']:g}", {})[
                d["config"]["seed"]] = d
    return groups


def settings_table(runs, dpo=None):
    """A row per setting: its held-out means, its gains (paired, see `paired_gain`) and its
    training's clip statistics, with the CPU that ran it; then DPO's policies (`dpo`)."""
    base = runs.get("")
    rows = []
    for setting in [*sorted(runs, key=lambda s: (s != "", s)), *sorted(dpo or {})]:
        r = runs.get(setting) or dpo[setting]
        finals = [x["final"] for x in r.values()]
        mean = lambda key: sum(f[key] for f in finals) / len(finals)  # noqa: E731
        vs = (lambda m, d: pm(*gain(r, base, m), d)) if base and setting else (lambda m, d: "")
        ratios = [row for x in r.values() for row in x.get("iterations", [])]
        clipped = ("off" if "--clip off" in setting else f"{training(r, 'clipfrac'):.2%}"
                   if ratios else "—")
        after = (f"{min(x['ratio_after_min'] for x in ratios):.2f} to "
                 f"{max(x['ratio_after_max'] for x in ratios):.2f}" if ratios else "—")
        machines = sorted({x["machine"] for x in r.values()})
        rows.append([f"`{setting}`" if setting else "(baseline)", str(len(r)),
                     f"{mean_of(r, 'reward'):+.2f}", pm(*over_sft(r, "reward")),
                     vs("reward", 2), f"{mean_of(r, 'mrr'):.3f}", vs("mrr", 3),
                     f"{mean_of(r, 'rouge_l'):.3f}", vs("rouge_l", 3),
                     f"{mean_of(r, 'words'):.0f}", f"{mean('eos_fraction'):.0%}",
                     f"{mean('copied_bigrams'):.0%}", f"{mean('kl'):.2f}", clipped, after,
                     "; ".join(machines)])
    if base:
        one = next(iter(base.values()))
        ref = one["final"]["ref"]
        rows.append(["SFT (the reference)", "", f"{ref['reward']:+.2f}", "", "",
                     f"{ref['retrieval_mrr']:.3f}", "", f"{ref['rouge_l']:.3f}", "",
                     f"{sum(s['words'] for s in one['final']['ref_samples']) / len(one['final']['ref_samples']):.0f}",
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


# ------------------------------------------------------------------------ plots

def plot_lambda(runs, path):
    """The judge's reward on each iteration's batch for each λ, a line per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for setting, label in (("--lam 1", "λ = 1"), ("", "λ = 0.95 (the post's)"),
                           ("--lam 0.5", "λ = 0.5"), ("--lam 0", "λ = 0")):
        for seed, run in sorted(runs.get(setting, {}).items()):
            rows = run["iterations"]
            ax.plot([r["iteration"] for r in rows], [r["reward"] for r in rows],
                    label=f"{label}, seed {seed}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("judge's reward, mean over the batch")
    ax.set_title("The judge's reward while training, by GAE's λ (β = 0.1)")
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_beta(runs, path):
    """β by iteration of the runs with the adaptive KL controller (--target-kl), beside the
    KL each iteration measured: a panel each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for setting, group in sorted(runs.items()):
        if "--target-kl" not in setting:
            continue
        for seed, run in sorted(group.items()):
            rows = run["iterations"]
            steps = [r["iteration"] for r in rows]
            line, = left.plot(steps, [r["beta"] for r in rows], label=f"{setting}, seed {seed}")
            right.plot(steps, [r["kl"] for r in rows], color=line.get_color())
            right.axhline(run["config"]["target_kl"], color=line.get_color(), ls=":", lw=1)
    left.set(xlabel="iteration", ylabel="β", title="β, set by the controller")
    right.set(xlabel="iteration", ylabel="KL a summary (nats), training batch",
              title="KL, and its target (dotted)")
    left.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_optimum(runs, opt, path):
    """The optimum and best-of-n (tools/optimum.py) on the sweep's three panels, the judge's
    reward, MRR and ROUGE-L against KL, with every kept run's held-out point and SFT's on the
    optimum's posts (ppo.py's first; MRR ranks among those the run was evaluated on)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    optimum_curves(axes, opt)
    n = opt["posts"]
    measures = [("reward", "reward"), ("mrr", "retrieval_mrr"), ("rouge_l", "rouge_l")]
    for ax, (measure, key), title in zip(axes, measures, MEASURES):
        colors = [plt.cm.tab20(i) for i in range(20) if i not in (14, 15)]  # no greys
        for color, (setting, group) in zip(colors, sorted(runs.items())):
            ax.plot(mean_of(group, "kl", n), mean_of(group, measure, n), "o", ms=5, color=color,
                    label=f"ppo.py --beta 0.1 {setting}".strip() if setting else
                    "ppo.py --beta 0.1 (baseline)")
        one = next(iter(next(iter(runs.values())).values()))
        sft = sft_per_post(one, measure)[:n]
        ax.plot(0, sum(sft) / len(sft), "*", ms=11, mfc="none", color="k",
                label="SFT (the reference)")
        ax.set_xscale("symlog", linthresh=1)            # RAFT's runs sit at KL 15-20
        ax.set_xlabel("KL from SFT (nats), held-out; symlog")
        ax.set_ylabel(title)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.suptitle(f"The runs against the optimum and best-of-n: {opt['samples']} SFT samples "
                 f"of each of the first {n} held-out posts, and the runs on the same posts")
    fig.tight_layout()
    save_figure(fig, path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------ the page

def page(runs, other):
    """docs/claims.md's text."""
    rows = claims(runs, other)
    done = sum(not r[5].startswith("not yet run") for r in rows)
    short = sum("not yet run)" in r[5] for r in rows)      # runs, but not all their seeds
    machines = sorted({r["machine"] for group in runs.values() for r in group.values()})
    lines = [
        "# The readings' claims, run at this scale",
        "",
        "Each claim the readings make about PPO's mechanisms, with the command that tests it "
        "here, what it measured and a verdict. From the SFT model and the quick start's "
        "judge, the cpu preset, β = 0.1 and GAE unless the command says otherwise; gains "
        "are on the 64 held-out posts, paired by post within seed, ± the larger of the SE "
        "over seeds and the SE over posts; \"above\" and \"below\" mean past 2 SE. "
        f"{done} of {len(rows)} rows have runs "
        + (f"({short} of them on fewer seeds than they need: the verdict names the rest)"
           if short else "(each on the seeds it needs)")
        + ("; the others say what is still to run. " if done < len(rows) else ". ") +
        "Back to the [README](../README.md).",
        "",
        "```bash",
        "python -m tools.claims_page      # this page and its plot, from docs/runs/claims/",
        "```",
        "",
        markdown_table(["#", "reading", "claim", "command", "measured", "verdict"], rows),
        "",
        "## Every run, by setting",
        "",
        "Held-out means (mean over seeds), gains ± SE as above (against β = 0.1: over the "
        "seeds both have), the share of tokens the "
        "clipped loss clipped (mean over iterations and inner steps) and the ratio "
        "π_θ / π_old after the last inner step (lowest and highest over every iteration's "
        "tokens). Machines: " + ("; ".join(machines) if machines else "none yet") + "."
        + held_back(runs),
        "",
        settings_table(runs, dpo_groups(other)) if runs else "No run is kept yet.",
        "",
    ]
    if any(s in runs for s in ("--lam 1", "--lam 0.5", "--lam 0")):
        lines += ["## λ", "", "![The judge's reward on each training batch, a line per run "
                  "for each GAE λ at β = 0.1](claims_lambda.png)", ""]
    conc = other.get("concentration")
    if conc:
        lines += ["## How concentrated the SFT model is", "",
                  "On its own held-out summaries, at each position after the first: the "
                  "probability of its top token, of its top 16, and its entropy over log V "
                  f"(mean ± SE over posts; `python -m tools.concentration`, on "
                  f"{conc.get('machine', 'this machine')}).", "",
                  markdown_table(["positions", "top token", "top 16", "entropy / log V"], [
                      [name, *(f"{part[k]:.3f} ± {part[k + '_se']:.3f}"
                               for k in ("top1", "top16", "entropy"))]
                      for name, part in (("the first", conc["first"]),
                                         ("after the first", conc["after_first"]))]), ""]
    dpo = dpo_groups(other)
    if dpo:
        lines += ["## DPO", "",
                  "`python dpo.py --beta B --seed S`: the implicit judge (D1) against the "
                  "explicit one on the judge's held-out comparisons (accuracy, Wilson 95% "
                  "interval), and the training curve's last row under TRL's names (means over "
                  "the last logged step's pairs). \"r with length\": the correlation of each "
                  "judge's score with the summary's length over the same pairs (the content "
                  "score leaves length to its own term; the full score and the implicit one "
                  "do not). The DPO policy's held-out row is in the table of runs above.", "",
                  markdown_table(["run", "pairs", "implicit (D1)", "judge: content",
                                  "judge: full", "r with length (implicit / content / full)",
                                  "loss", "rewards/chosen", "rewards/rejected",
                                  "rewards/margins", "rewards/accuracies", "machine"], [
                      [f"`{name}`, seed {seed}", str(d["final"]["judges"]["pairs"]),
                       *(accuracy(d["final"]["judges"][k]) for k in ("implicit", "content",
                                                                    "full")),
                       " / ".join(f"{d['final']['judges'][k]['score_length_correlation']:.2f}"
                                  for k in ("implicit", "content", "full")),
                       *(f"{d['curve'][-1][k]:+.3f}" for k in (
                           "loss", "rewards/chosen", "rewards/rejected", "rewards/margins")),
                       f"{d['curve'][-1]['rewards/accuracies']:.0%}", d["machine"]]
                      for name, group in sorted(dpo.items())
                      for seed, d in sorted(group.items())]), ""]
    noisy = noise_levels(runs)
    if noisy:
        one = next(iter(next(iter(runs.values())).values()))
        refs = [s["reward"] for s in one["final"]["ref_samples"]]
        unit = judge_sd(one["final"])                      # the unit ppo.py used
        lines += ["## Reward noise", "",
                  f"`--reward-noise SD` adds Gaussian noise of SD × {unit:.2f} to every score "
                  f"a run learns from: {unit:.2f} is the SD of the judge's scores over SFT's "
                  f"{len(refs)} held-out summaries (`sweep.judge_sd`), so SD 1 makes a score's "
                  "noise as large as the spread of the judge's scores across summaries. The "
                  "papers' SD 3 and 5 are on their own reward model's scale and do not carry "
                  "over; the two levels here, SD " + " and ".join(f"{sd:g}" for sd in NOISE_SDS)
                  + ", leave two summaries in the judge's order "
                  + " and ".join(f"{order_kept(sd):.0%}" for sd in NOISE_SDS) + " of the time "
                  "(1/2 + asin(1/√(1 + SD²))/π for normal scores, `order_kept`): a comparison "
                  "that keeps most of its signal, and one that keeps little. Run here: SD "
                  + ", ".join(noisy) + ". The "
                  "judge's reward on the page is the noiseless judge on held-out posts.", ""]
    if any("--target-kl" in s for s in runs):
        lines += ["## The adaptive KL controller", "",
                  "![β by iteration for each --target-kl run, and the KL of each iteration's "
                  "batch against its target](claims_beta.png)", ""]
    opt = other.get("optimum")
    if runs and opt:
        n = opt["posts"]
        lines += ["## The optimum", "",
                  f"`python -m tools.optimum --samples {opt['samples']} --eval-prompts {n}` on "
                  f"{opt['machine']}: {opt['samples']} summaries of each of ppo.py's first {n} "
                  "held-out posts from the SFT model, scored by the judge; the optimum "
                  "π* ∝ π_ref e^{r/β} read off them by self-normalised weights (its KL "
                  f"E*[r]/β − log Z cannot pass log k = {opt['kl_cap']:.2f} nats), and "
                  "best-of-n at KL log n − (n−1)/n. Means over the posts (their SEs are in the "
                  "file); the runs' points are their means over the same posts."
                  + (f" MRR ranks a summary's post among the {n} posts for the curves and "
                     "among all 64 for the runs, so that panel's curves and points are not on "
                     "one scale." if n < 64 else ""), "",
                  "![The judge's reward, MRR and ROUGE-L against KL: the optimum and best-of-n "
                  "from SFT's samples as lines, each kept run as a point, SFT as a star at KL 0]"
                  "(claims_optimum.png)", ""]
    flip = runs.get("--flip-sign")
    if flip:
        seed, run = min(flip.items())
        lines += ["## The sign flip", "",
                  f"`python ppo.py --beta 0.1 --flip-sign`, seed {seed}: the first three "
                  "held-out summaries the kept file holds, with the judge's score of each.", "",
                  *(f"- ({s['reward']:+.2f}) {' '.join(s['text'].split())}"
                    for s in run["final"]["samples"] if "text" in s), ""]
    base = runs.get("")
    if base:
        lines += ["## By length", "",
                  "Each setting's held-out summaries binned by their length over the person's "
                  "TL;DR (tokens, EOS not counted; cuts at 0.75 and 1.25, `tools/length_bins.py` "
                  "says why): the judge's win rate over SFT's summary of the same post (a tie "
                  "counts one half) with its Wilson 95% interval, and MRR beside SFT's on the "
                  "same posts.", "",
                  length_bins.markdown({f"`{setting}`" if setting else "β = 0.1 (baseline)":
                                        by_length(group) for setting, group in
                                        sorted(runs.items(), key=lambda x: (x[0] != "", x[0]))}),
                  ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", default=str(RUNS), help=f"kept summaries (default {RUNS})")
    parser.add_argument("--out", default=str(PAGE), help=f"the page (default {PAGE})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the page differs from what the files say")
    args = parser.parse_args(argv)
    runs, other = load(args.runs)
    text = page(runs, other)
    out = Path(args.out)
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out}: {'the same as' if same else 'differs from'} what {args.runs} gives")
        raise SystemExit(0 if same else 1)
    write_text(out, text)
    if any(s in runs for s in ("--lam 1", "--lam 0.5", "--lam 0")):
        plot_lambda(runs, out.parent / "claims_lambda.png")
    if runs and "optimum" in other:
        plot_optimum(runs, other["optimum"], out.parent / "claims_optimum.png")
    if any("--target-kl" in s for s in runs):
        plot_beta(runs, out.parent / "claims_beta.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    cli.run_script(main)
