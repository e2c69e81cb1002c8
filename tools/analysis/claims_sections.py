"""docs/claims.md below its table of claims: every run by setting, the figures and the
sections that say how a row was measured (λ, concentration, DPO, reward noise, the
controller, the optimum, the sign flip, by length), and the DPO claim's reading.

Used by: tools/analysis/claims_page.py. Test: pytest tests/test_claims.py
"""
import math
from pathlib import Path

import matplotlib

from support.disk import save_figure
from support.optimum import best_of_n_weights, self_normalised_kl
from support.report import optimum_curves
from support.sweep import judge_sd
from support.tables import MEASURES, markdown_table
from tools.analysis.claims_runs import (Reading, bin_intervals, bin_pools, dpo_groups,
                                        held_back, mean_of, settings_table,
                                        sft_per_post, win_rate)
from tools.analysis.length_bins import bin_rows, pool

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

RUNS = Path("docs/runs/claims")
PAGE = Path("docs/claims.md")
JUDGE_RULES = Path("docs/runs/judge/baselines_seed0.json")   # tools.analysis.judge_baselines
NOISE_SDS = (1, 3)    # --reward-noise, in the judge's SDs: `order_kept` says why these two


def accuracy(m):
    """'61.2% [55.0%, 67.1%]': a judge's held-out accuracy and its Wilson interval (R4)."""
    return f"{m['heldout_accuracy']:.1%} [{m['wilson_low']:.1%}, {m['wilson_high']:.1%}]"


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



def dpo_reading(groups, rules):
    """The cpu preset's DPO runs (240 of the judge's training pairs, its first 128 held-out
    votes), before the like-for-like runs that decide the claim: each implicit judge (D1)
    beside the explicit judge's content score and, from `rules` (tools.analysis.judge_baselines'
    kept file, votes in the split's order), the system and length rules on the same votes."""
    if not groups:
        return None
    runs = [(name, seed, d["final"]["judges"]) for name, group in sorted(groups.items())
            for seed, d in sorted(group.items())]
    n = runs[0][2]["pairs"]
    implicit = [j["implicit"]["heldout_accuracy"] for _, _, j in runs]
    text = "; ".join(f"β {name.split()[-1]}, seed {seed}: implicit {accuracy(j['implicit'])}"
                     for name, seed, j in runs)
    text += (f"; the explicit judge (content) "
             f"{' / '.join(sorted({accuracy(j['content']) for _, _, j in runs}))} on the same "
             f"{n} held-out pairs")
    said = "not resolved: the like-for-like runs that decide it are not yet kept"
    if rules:
        votes = rules["per_pair"]
        system, length = (sum(votes[r][:n]) / n for r in ("system", "length"))
        text += (f"; on those votes, the summary of the system that wins more of the judge's "
                 f"training comparisons {system:.1%}, the longer summary {length:.1%}")
        where = ("within" if min(implicit) <= system <= max(implicit) else
                 "above" if system > max(implicit) else "below")
        said += (f"; a rule that knows only which system wrote each summary scores "
                 f"{system:.1%}, {where} the implicit judges' {min(implicit):.1%} to "
                 f"{max(implicit):.1%}")
    return Reading(text, [], verdict=said)


def best_of_n_on_one_basis(opt):
    """optimum.json's best-of-n rows with their KL by (O5)'s estimate from the same samples
    as the optimum's (`self_normalised_kl`), in place of (B2)'s formula."""
    k = opt["samples"]
    return {**opt, "best_of_n": [{**r, "kl": self_normalised_kl(best_of_n_weights(k, r["n"]))}
                                 for r in opt["best_of_n"]]}


# ------------------------------------------------------------------------ plots

def plot_lambda(runs, path):
    """The judge's reward on each iteration's batch for each λ, a line per run."""
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
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    optimum_curves(axes, best_of_n_on_one_basis(opt))
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



def plots(runs, other, folder):
    """claims_lambda.png, claims_optimum.png and claims_beta.png, where their runs are kept."""
    if any(s in runs for s in ("--lam 1", "--lam 0.5", "--lam 0")):
        plot_lambda(runs, folder / "claims_lambda.png")
    if runs and "optimum" in other:
        plot_optimum(runs, other["optimum"], folder / "claims_optimum.png")
    if any("--target-kl" in s for s in runs):
        plot_beta(runs, folder / "claims_beta.png")


# ------------------------------------------------------------------------ the sections

def length_table(runs):
    """A row per setting and length bin: posts, mean ratio, the win rate over SFT with its
    interval (seeds and posts, `claims_runs.bin_intervals`), MRR beside SFT's."""
    pooled, rows = bin_pools(runs), []
    for setting, group in sorted(runs.items(), key=lambda x: (x[0] != "", x[0])):
        name = f"`{setting}`" if setting else "β = 0.1 (baseline)"
        (pairs,) = pool(list(group.values())).values()
        ivs = {b: iv for b, _, iv in bin_intervals(group, pooled)}
        for r in bin_rows(pairs):
            iv = ivs.get(r["bin"])
            rows.append([name, r["bin"], f"{r['posts']} ({r['runs']})"] + (
                [f"{r['ratio']:.2f}", win_rate(iv) + " (1 seed, pooled)" * (iv.seeds == 1),
                 f"{r['mrr']:.3f}", f"{r['ref_mrr']:.3f}"] if iv else ["—"] * 4))
    return markdown_table(["run", "length / person's", "posts (runs)", "mean ratio",
                           "judge's win rate over SFT [95%, seeds and posts]", "MRR",
                           "SFT's MRR, same posts"], rows)


def details(page):
    """Everything on the page below the claims' table."""
    runs, other = page.runs, page.other
    machines = sorted({r["machine"] for group in runs.values() for r in group.values()})
    dpo = dpo_groups(other)
    lines = [
        "## Every run, by setting", "",
        "Held-out means (mean over seeds), gains ± the half-width of their 95% interval as "
        "above (against β = 0.1: over the seeds both have; a setting on one seed with the "
        "pooled seed variance), reward − β·KL the objective at β = 0.1, the share of tokens "
        "the clipped loss clipped (mean over iterations and inner steps) and the ratio "
        "π_θ / π_old after the last inner step (lowest and highest over every iteration's "
        "tokens). Machines: " + ("; ".join(machines) if machines else "none yet") + "."
        + held_back(runs), "",
        settings_table(runs, dpo, page.pooled) if runs else "No run is kept yet.", ""]
    if any(s in runs for s in ("--lam 1", "--lam 0.5", "--lam 0")):
        lines += ["## λ", "", "![The judge's reward on each training batch, a line per run "
                  "for each GAE λ at β = 0.1](claims_lambda.png)", ""]
    conc = other.get("concentration")
    if conc:
        lines += ["## How concentrated the SFT model is", "",
                  "On its own held-out summaries, at each position after the first: the "
                  "probability of its top token, of its top 16, and its entropy over log V "
                  f"(mean ± SE over posts; `python -m tools.analysis.concentration`, on "
                  f"{conc.get('machine', 'this machine')}).", "",
                  markdown_table(["positions", "top token", "top 16", "entropy / log V"], [
                      [name, *(f"{part[k]:.3f} ± {part[k + '_se']:.3f}"
                               for k in ("top1", "top16", "entropy"))]
                      for name, part in (("the first", conc["first"]),
                                         ("after the first", conc["after_first"]))]), ""]
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
                  f"`python -m tools.analysis.optimum --samples {opt['samples']} --eval-prompts {n}` on "
                  f"{opt['machine']}: {opt['samples']} summaries of each of ppo.py's first {n} "
                  "held-out posts from the SFT model, scored by the judge; the optimum "
                  "π* ∝ π_ref e^{r/β} read off them by self-normalised weights w, and "
                  "best-of-n by the exact weights of the best of n drawn from the k. Both KLs "
                  "are on one basis, the self-normalised estimate Σ w log(k w) from the same "
                  f"samples (at most log k = {opt['kl_cap']:.2f} nats; for best-of-n it stands "
                  "in for the formula log n − (n−1)/n, which is on another basis and put "
                  "best-of-n above the optimum on reward − β·KL). Means over the posts (their "
                  "SEs are in the file); the runs' points are their means over the same posts, "
                  "their KL the summaries' own."
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
                  "TL;DR (tokens, EOS not counted; cuts at 0.75 and 1.25, `tools/analysis/"
                  "length_bins.py` says why): the judge's win rate over SFT's summary of the same post (a tie "
                  "counts one half) with a 95% interval that counts seeds and posts (the "
                  "bin's win indicators less 1/2, `length_bins.bin_values`, by the page's rule; "
                  "a setting on one seed with the seed variance pooled over the settings with "
                  "several), and MRR beside SFT's on the same posts.", "",
                  length_table(runs), ""]
    return "\n".join(lines)
