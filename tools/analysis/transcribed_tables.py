"""The sweep's and the estimators' tables and plots, remade from their transcribed rows.

docs/sweep.md and docs/estimators.md show runs whose folders were lost: their numbers
survive only as the printed reports of those runs, transcribed into
docs/runs/transcribed/sweep.json and estimators.json (every record names its machine and
its source). From those two files alone this remakes every table of the two pages (each
between a `<!-- transcribed: NAME -->` and a `<!-- /transcribed -->` line), the lines
computed from them (where each measure peaks; Spearman's rho of beta and KL) and
docs/sweep.png and docs/estimators.png. Nothing else on the pages is touched.

Run:   python -m tools.analysis.transcribed_tables            (the two pages and plots; seconds)
       python -m tools.analysis.transcribed_tables --check    (exit 1 where a page is not the files')
Test:  pytest tests/test_transcribed_tables.py
"""

import argparse
import json
import re
import sys
from pathlib import Path

from support import cli, disk, tables
from support.report import plot_sweep
from support.measures import spearman

DOCS = Path(__file__).resolve().parents[2] / "docs"
DATA = DOCS / "runs" / "transcribed"
BLOCK = re.compile(r"(<!-- transcribed: (\S+) -->\n)(.*?)(<!-- /transcribed -->)", re.S)


# ------------------------------------------------------------------ cells as printed

def number(record, key, fmt, suffix=""):
    """A record's value as the page prints it, with " ± SE" where the record has one:
    "" where it has no such key, "—" where the value is None (not measured)."""
    if key not in record:
        return ""
    if record[key] is None:
        return "—"
    se = record.get(f"{key}_se")
    text = format(record[key], fmt) + ("" if se is None else f" ± {se:{fmt.lstrip('+')}}")
    return text + suffix


def group_cells(record):
    """tables.HEADER's cells of a group (a beta, a setting) or a fixed row (SFT, people)."""
    fixed = "row" in record
    worst_best = (f"{record['reward_worst']:.2f} to {record['reward_best']:.2f}"
                  if "reward_worst" in record else "")
    return [number(record, "reward", ".2f", " (over posts)" if fixed else ""), worst_best,
            number(record, "gain", "+.2f"), number(record, "mrr", ".3f"),
            number(record, "mrr_gain", "+.3f"), number(record, "rouge_l", ".3f"),
            number(record, "rouge_l_gain", "+.3f"), number(record, "words", "d"),
            *(number(record, key, ".0%") for key in ("ends_by_itself", "copied",
                                                      "asks_for_help")),
            number(record, "kl", ".2f"),
            # the clip statistics were not printed by those runs' reports: not measured
            *(("—", "—") if not fixed else ("", ""))]


def group_table(first, groups, fixed, extra=()):
    """The main table of a page: its groups (by `first`, beta or setting), then the fixed
    rows; `extra` [(column, key, format)] after tables.HEADER's columns."""
    rows = [[f"{g[first]:g}" if first == "beta" else g[first], str(g["runs"]),
             *group_cells(g), *(number(g, key, fmt) for _, key, fmt in extra)]
            for g in groups]
    rows += [[f["row"], "", *group_cells(f), *[""] * len(extra)] for f in fixed]
    return tables.markdown_table([first, "runs", *tables.HEADER,
                                  *(column for column, _, _ in extra)], rows)


def peaks_line(groups):
    """Where the mean over seeds of the judge's reward, MRR and ROUGE-L is highest."""
    best = {name: max(groups, key=lambda g: g[key])["beta"]
            for name, key in (("judge's reward", "reward"), ("MRR", "mrr"),
                              ("ROUGE-L", "rouge_l"))}
    return "Means over seeds peak at: " + "; ".join(f"{name}, beta = {beta:g}"
                                                    for name, beta in best.items()) + "."


def more_table(more):
    """The sweep's second table, per beta: runs above SFT by 2 SE, fluency and the rest."""
    rows = [[f"{m['beta']:g}",
             *(f"{m[key]} of {m['runs']}" for key in ("above_judge", "above_mrr",
                                                      "above_rouge_l", "above_all")),
             f"{m['fluency_worst']:.1f} to {m['fluency_best']:.1f} "
             f"({m['fluency_per_token']:.2f})",
             f"{m['length_tokens']:.1f}", f"{m['distinct_2']:.3f}",
             f"{m['relevance_gap']:+.2f}", f"{m['ends_in_question']:.0%}",
             f"{m['value_loss']:.3f}"] for m in more]
    return tables.markdown_table(
        ["beta", "above (ref) by 2 SE: judge", "MRR", "ROUGE-L", "all three",
         "fluency, worst to best (per token)", "length (tokens)", "distinct-2",
         "relevance gap", "ends in ?", "value loss"], rows)


def runs_table(runs):
    """Every run of the sweep: its judge's reward and gains (± SE over posts), KL, words."""
    rows = [[f"{r['beta']:g}", str(r["seed"]), number(r, "reward", ".2f"),
             number(r, "gain", "+.2f"), number(r, "mrr_gain", "+.3f"),
             number(r, "rouge_l_gain", "+.3f"), number(r, "kl", ".2f"),
             number(r, "words", "d")] for r in runs]
    return tables.markdown_table(["beta", "seed", "judge's reward", "judge's gain over (ref)",
                                  "MRR gain", "ROUGE-L gain", "KL", "words"], rows)


# ------------------------------------------------------------------ the pages' blocks

def sweep_blocks(data):
    """{block name: its Markdown} of docs/sweep.md."""
    samples = data["samples"]
    rho = spearman([r["beta"] for r in data["runs"]], [r["kl"] for r in data["runs"]])
    return {
        "sweep": group_table("beta", data["by_beta"], data["fixed"]) + "\n\n"
        + peaks_line(data["by_beta"]),
        "sweep-more": more_table(data["more"]) + "\n\nSpearman's rho of beta and the final "
        f"KL over {len(data['runs'])} runs (from the table below): {rho:.2f}.",
        "sweep-runs": runs_table(data["runs"]),
        "sweep-median-samples": tables.markdown_table(samples["median"]["columns"],
                                                      samples["median"]["rows"]),
        "sweep-first-posts": tables.markdown_table(samples["first_posts"]["columns"],
                                                   samples["first_posts"]["rows"]),
    }


def estimator_blocks(data):
    """{block name: its Markdown} of docs/estimators.md."""
    extra = [("reward - beta KL", "objective", "+.2f"), ("minutes a run", "minutes", ".1f")]
    return {"estimators": group_table("setting", data["by_setting"], data["fixed"], extra)}


def plot_rows(records, fixed, group, se_over):
    """plot_sweep's rows and baseline from transcribed records: a run's (or group's) MRR and
    ROUGE-L are the reference's plus its gain (the gain is paired by post, so the two
    differ only by rounding); the bars are the gains' SEs."""
    ref = next(f for f in fixed if f["row"].startswith("SFT"))
    rows = [{group: r[group], "reward": r["reward"], "reward_se": r["reward_se"],
             "kl": r["kl"], "retrieval_mrr": ref["mrr"] + r["mrr_gain"],
             "retrieval_mrr_gain_over_ref_se": r["mrr_gain_se"],
             "rouge_l": ref["rouge_l"] + r["rouge_l_gain"],
             "rouge_l_gain_over_ref_se": r["rouge_l_gain_se"]} for r in records]
    names = {"SFT (ref)": "ref", "OpenAI 1.3B PPO": "openai_1b", "people": "human"}
    baseline = {names[f["row"]]: {"reward": f["reward"], "retrieval_mrr": f["mrr"],
                                  "rouge_l": f["rouge_l"]}
                for f in fixed if f["row"] in names}
    baseline["start"] = {}                      # the reference is SFT: say so in the legend
    return rows, baseline, se_over


def pages():
    """[(page, its blocks, plot arguments)] from the two transcribed files."""
    with cli.reading(DATA / "sweep.json", "the transcribed sweep rows"):
        sweep = json.loads((DATA / "sweep.json").read_text())
    with cli.reading(DATA / "estimators.json", "the transcribed estimator rows"):
        estimators = json.loads((DATA / "estimators.json").read_text())
    posts = ("bars: ± 1 SE over the 64 held-out posts (judge: of the run's reward; MRR and "
             "ROUGE-L: of its gain over SFT, paired by post)")
    seeds = ("bars: ± 1 SE over the 3 seeds (judge: of the reward; MRR and ROUGE-L: of the "
             "gain over SFT); points: means over the seeds")
    return [(DOCS / "sweep.md", sweep_blocks(sweep),
             dict(zip(("table", "baseline", "bars"),
                      plot_rows(sweep["runs"], sweep["fixed"], "beta", posts)),
                  path=DOCS / "sweep.png", group="beta")),
            (DOCS / "estimators.md", estimator_blocks(estimators),
             dict(zip(("table", "baseline", "bars"),
                      plot_rows(estimators["by_setting"], estimators["fixed"], "setting",
                                seeds)),
                  path=DOCS / "estimators.png", group="setting", objective_beta=0.1,
                  point="setting"))]


def filled(text, blocks, page):
    """`text` with each transcribed block replaced by its Markdown; every block once."""
    seen = []

    def fill(match):
        name = match[2]
        if name not in blocks:
            raise cli.UserError(f"{page}: no transcribed table named {name!r}")
        seen.append(name)
        return f"{match[1]}{blocks[name]}\n{match[4]}"
    out = BLOCK.sub(fill, text)
    if sorted(seen) != sorted(blocks):
        raise cli.UserError(f"{page}: the blocks {sorted(seen)} are not once each of "
                            f"{sorted(blocks)}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a "
                        "page's tables are not its transcribed file's (default: write)")
    args = parser.parse_args(argv)
    stale = []
    for page, blocks, plot in pages():
        text = page.read_text()
        new = filled(text, blocks, page.name)
        if args.check:
            stale += [page.name] if new != text else []
            continue
        disk.write_text(page, new)
        plot_sweep(**plot)
        print(f"{page.relative_to(DOCS.parent)}: {len(blocks)} tables; {plot['path'].name}")
    if stale:
        print(f"not the transcribed files' tables: {', '.join(stale)} "
              "(python -m tools.analysis.transcribed_tables remakes them)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_script(main))
