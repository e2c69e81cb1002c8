"""Tables of many runs: the judge's reward beside the measures it never saw.

The sweep (ppo.py with several betas and seeds) and tools/analysis/compare_estimators.py group their
runs, by beta or by estimator, and show each group the same way, as means over its seeds:

    judge's reward   r on the held-out posts: mean ± SE over seeds, worst to best seed
    gains over (ref) d = mean_i (x_policy,i - x_ref,i), paired by post i, for x = the judge's
                     reward, the reciprocal rank and ROUGE-L: one d a run, mean ± SE over seeds;
                     the reference is PPO's start, sft.py's model by default
    MRR              mean reciprocal rank of a summary's own post, retrieved by the summary
    ROUGE-L          F1 against the post's human TL;DR
    words, ends by itself (EOS before the token limit), copied (the share of bigrams found
    in the post), asks for help, KL from the reference

Under the groups, the fixed rows, each over the posts: the reference (SFT by default),
sft.py's start (SmolLM2), OpenAI's 1.3B PPO policy (the data's summaries) and people.
`beside_sft` counts the runs of a group that beat the reference by more than 2 SE (over
posts) on each measure; `peaks` names the group where each measure is highest.

Used by: report.py (the sweep), tools/analysis/compare_estimators.py, tools/analysis/transcribed_tables.py.
Test: pytest tests/test_ppo.py -k tables
"""

import math

from support.measures import standard_error
from support.quality import words

# What the judge never saw, as results.json names it: the run's mean, its paired gain over SFT
MEASURES = {"judge's reward": ("reward", "gain_over_ref"),
            "MRR": ("retrieval_mrr", "retrieval_mrr_gain_over_ref"),
            "ROUGE-L": ("rouge_l", "rouge_l_gain_over_ref")}
HEADER = ["judge's reward: mean ± SE over seeds", "worst to best", "judge's gain over (ref)",
          "MRR", "MRR gain", "ROUGE-L", "ROUGE-L gain", "words", "ends by itself", "copied",
          "asks for help", "KL", "clipped", "ratio after the last step"]
FIXED = (("ref", "ref_samples", "(ref)"), ("start", "start_samples", "(start)"),
         ("openai_1b", "openai_1b_samples", "OpenAI 1.3B PPO"), ("human", "human_samples", "people"))


def mean_words(samples):
    """Words in a summary (quality.words), a mean over the samples."""
    return sum(len(words(s["text"])) for s in samples) / len(samples)


def with_words(row, results):
    """A finished run's row (report.finished_row) with the mean words of its summaries and
    its training's clip statistics (the share of tokens clipped, mean over iterations; the
    ratio's range after the last inner step, over every iteration), from its results.json.
    A run from before the ratio after the last step was kept has none."""
    steps = results.get("iterations") or []
    clip = ({"clipfrac": sum(r["clipfrac"] for r in steps) / len(steps)}
            if steps and "clipfrac" in steps[0] else {})
    if steps and "ratio_after_min" in steps[0]:
        clip["ratio_after"] = (min(r["ratio_after_min"] for r in steps),
                               max(r["ratio_after_max"] for r in steps))
    return {**row, "words": mean_words(results["final"]["samples"]), **clip}


def over_seeds(values, digits=3):
    """mean ± SE over seeds, as text with a sign; one seed has no SE."""
    se = standard_error(values)
    text = f"{sum(values) / len(values):+.{digits}f}"
    return text if math.isnan(se) else f"{text} ± {se:.{digits}f}"


def group_cells(runs):
    """HEADER's cells for one group of finished runs (with_words' rows); a measure some run
    lacks (a run from before it existed) is a dash."""
    def cell(key, show):
        values = [r.get(key) for r in runs]
        return "—" if None in values else show(values)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    judge = lambda v: f"{mean(v):.2f}" + ("" if len(v) < 2 else f" ± {standard_error(v):.2f}")
    return [cell("reward", judge), cell("reward", lambda v: f"{min(v):.2f} to {max(v):.2f}"),
            cell("gain_over_ref", lambda v: over_seeds(v, digits=2)),
            cell("retrieval_mrr", lambda v: f"{mean(v):.3f}"),
            cell("retrieval_mrr_gain_over_ref", over_seeds),
            cell("rouge_l", lambda v: f"{mean(v):.3f}"),
            cell("rouge_l_gain_over_ref", over_seeds),
            cell("words", lambda v: f"{mean(v):.0f}"),
            *(cell(key, lambda v: f"{mean(v):.0%}")
              for key in ("eos_fraction", "copied_bigrams", "asks_for_help")),
            cell("kl", lambda v: f"{mean(v):.2f}"),
            cell("clipfrac", lambda v: f"{mean(v):.2%}"),
            cell("ratio_after", lambda v: f"{min(a for a, _ in v):.2f} to "
                                          f"{max(b for _, b in v):.2f}")]


def fixed_rows(base):
    """The rows of the summarisers no run trained, from baseline.json (`base`: its
    "baseline" means and "baseline_posts" per-post texts): (name, HEADER's cells)."""
    rows = []
    for key, posts, name in FIXED:
        row = base["baseline"].get(key)
        if row is None:
            continue
        if key == "start":                  # the reference is sft.py's model, this its start
            name = f"{row['model'].rsplit('/', 1)[-1]} (start)"
        elif key == "ref" and "start" in base["baseline"]:
            name = "SFT (ref)"
        rows.append((name, [f"{row['reward']:.2f} ± {row['reward_se']:.2f} (over posts)", "",
                            "", f"{row['retrieval_mrr']:.3f}", "",
                            f"{row['rouge_l']:.3f}" if "rouge_l" in row else "—", "",
                            f"{mean_words(base['baseline_posts'][posts]):.0f}",
                            f"{row['eos_fraction']:.0%}" if "eos_fraction" in row else "—",
                            f"{row['copied_bigrams']:.0%}", f"{row['asks_for_help']:.0%}",
                            f"{row['kl']:.2f}" if "kl" in row else "—", "", ""]))
    return rows


def table_line(cells):
    """One Markdown table row; an empty cell is "| |"."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def markdown_table(columns, rows):
    """A Markdown table of `rows` (lists of cell texts) under `columns`."""
    return "\n".join([table_line(columns), "|" + " --- |" * len(columns),
                      *(table_line(cells) for cells in rows)])


def markdown(first, groups, base, extra=()):
    """A Markdown table: `first` names the groups' column (beta, setting), `groups` is
    [(name, runs)], `base` baseline.json (its rows under the groups; None: none), `extra`
    [(column, cells of each group)] after HEADER's columns. A group with no finished run
    is a row of dashes."""
    columns = [first, "runs", *HEADER, *(name for name, _ in extra)]
    rows = []
    for i, (name, runs) in enumerate(groups):
        cells = group_cells(runs) if runs else ["—"] * len(HEADER)
        rows.append([name, str(len(runs)), *cells, *(column[i] for _, column in extra)])
    for name, cells in fixed_rows(base) if base else []:
        rows.append([name, "", *cells, *[""] * len(extra)])
    return markdown_table(columns, rows)


def beside_sft(runs):
    """How many runs beat the reference (SFT) by more than 2 SE (paired over posts) on each measure, and on
    all three at once: {measure: count, "all three": count}."""
    above = [{name: r.get(gain, 0) > 2 * r.get(f"{gain}_se", math.inf)
              for name, (_, gain) in MEASURES.items()} for r in runs]
    return {**{name: sum(a[name] for a in above) for name in MEASURES},
            "all three": sum(all(a.values()) for a in above)}


def peaks(groups):
    """The group where each measure's mean over seeds is highest: {measure: name}."""
    done = [(name, runs) for name, runs in groups
            if runs and all(key in r for r in runs for key, _ in MEASURES.values())]
    return {measure: max(done, key=lambda g: sum(r[key] for r in g[1]) / len(g[1]))[0]
            for measure, (key, _) in MEASURES.items()} if done else {}
