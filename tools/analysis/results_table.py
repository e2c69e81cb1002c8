"""The README's table of held-out results, from the results.json of one or more ppo.py runs.

One row per summariser on the run's held-out posts: SmolLM2-135M-Instruct (the post's
start), the SFT model when PPO started from sft.py's (the reference), each run's policy, OpenAI's 1.3B PPO policy (its summaries are in the data file,
when they are) and people's TL;DRs. Columns: the judge's reward (mean ± SE over posts),
then what the judge never saw (support/quality.py): the mean reciprocal rank of the
summary's own post by TF-IDF retrieval, ROUGE-L F1 against the human TL;DR, words, the
share of summaries that end by themselves (EOS before the 48-token limit), and the share
of the summary's token bigrams found in the post.

ROUGE-L is recomputed from the saved texts with `quality.rouge_l` (rouge-score, Porter
stemmer), so a results.json written before that measure gives the papers' number too.
The runs must share their held-out posts and judge (one sweep, or runs of one judge with
the same --eval-prompts and --prompt-tokens); the first run gives the shared rows.

Run:  python -m tools.analysis.results_table runs/ppo_beta0_seed0 runs/ppo_beta0.1_seed0
      python -m tools.analysis.results_table runs/ppo_beta0_seed0 --samples 0 5
"""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import loaders
from support.heldout import length_and_copying
from support.measures import standard_error
from support.quality import rouge_l, words

COLUMNS = ("summaries", "reward (judge)", "retrieval MRR", "ROUGE-L", "words",
           "ends by itself", "copied from the post")


def read_results(folder):
    """results.json of a finished run (its `final` evaluation), or SystemExit with one line."""
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise SystemExit(f"results_table: no results.json in {folder}")
    results = json.loads(path.read_text())
    if "final" not in results:
        raise SystemExit(f"results_table: {path} has no final evaluation (the run is not done)")
    return results


def people_copying(results, texts):
    """Copied-bigram shares of people's TL;DRs, for a results.json that lacks them: the
    held-out prompts rebuilt from the run's settings, measured as heldout.written_row does."""
    cfg = SimpleNamespace(**results["config"])
    tokenizer = loaders.load_tokenizer(cfg.model)
    _, held_out = loaders.load_prompts(cfg, tokenizer)
    return [length_and_copying(tokenizer, text, post["prompt"])[1]
            for text, post in zip(texts, held_out)]


def row(name, samples, humans, copied=None):
    """One table row from a list of per-post samples (each with text, reward,
    retrieval_rank; eos and copied_bigrams where known). humans: the TL;DR of each post, or
    None for people's own row (no ROUGE-L against themselves)."""
    n = len(samples)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rewards = [s["reward"] for s in samples]
    copied = copied or ([s["copied_bigrams"] for s in samples]
                        if "copied_bigrams" in samples[0] else None)
    cells = [name, f"{mean(rewards):+.2f} ± {standard_error(rewards):.2f}",
             f"{mean([1 / s['retrieval_rank'] for s in samples]):.2f}",
             f"{mean([rouge_l(s['text'], h) for s, h in zip(samples, humans)]):.3f}"
             if humans else "—",
             f"{mean([len(words(s['text'])) for s in samples]):.0f}",
             f"{sum(s['eos'] for s in samples) / n:.0%}" if "eos" in samples[0] else "—",
             f"{mean(copied):.0%}" if copied else "—"]
    return "| " + " | ".join(cells) + " |"


def short(model):
    """A hub id without its owner: SmolLM2-135M-Instruct."""
    return model.rsplit("/", 1)[-1] if model == loaders.POLICY_NAME else model


def reference_name(config):
    """The reference row's name: SmolLM2, or the SFT model PPO started from (sft.py)."""
    model = config.get("model", loaders.POLICY_NAME)
    return (f"{short(model)} (the reference)" if model == loaders.POLICY_NAME
            else f"SFT, {model} (the reference)")


def table(runs):
    """The markdown table for a list of results.json dicts (the first gives the shared rows)."""
    first = runs[0]["final"]
    humans = [s["text"] for s in first["human_samples"]]
    people = first["human_samples"]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    if "start_samples" in first:                        # the reference is sft.py's model
        lines.append(row(f"{short(first['start']['model'])} (the post's start, before SFT)",
                         first["start_samples"], humans))
    lines.append(row(reference_name(runs[0]["config"]), first["ref_samples"], humans))
    for results in runs:
        final, config = results["final"], results["config"]
        if [s["text"] for s in final["human_samples"]] != humans:
            raise SystemExit("results_table: the runs were evaluated on different posts")
        lines.append(row(f"PPO, β = {config['beta']:g} (seed {config['seed']})",
                         final["samples"], humans))
    if "openai_1b_samples" in first:
        lines.append(row("OpenAI's 1.3B PPO policy (10x our size, 64k+ human labels)", first["openai_1b_samples"], humans))
    copied = None if "copied_bigrams" in people[0] else people_copying(runs[0], humans)
    lines.append(row("people's TL;DRs", people, None, copied))
    return "\n".join(lines)


def samples_table(runs, posts):
    """A markdown table of the summaries of a few held-out posts (indices), side by side."""
    first = runs[0]["final"]
    start = "start_samples" in first                    # the reference is sft.py's model
    names = (["human TL;DR"] + (["SmolLM2", "SFT"] if start else ["SmolLM2"])
             + [f"PPO, β = {r['config']['beta']:g}" for r in runs]
             + (["OpenAI 1.3B"] if "openai_1b_samples" in first else []))
    lines = ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]
    quote = lambda s: '"' + " ".join(s["text"].split()).replace("|", "/") + '"'  # noqa: E731
    for i in posts:
        cells = [first["human_samples"][i], *([first["start_samples"][i]] if start else []),
                 first["ref_samples"][i],
                 *[r["final"]["samples"][i] for r in runs],
                 *([first["openai_1b_samples"][i]] if "openai_1b_samples" in first else [])]
        lines.append("| " + " | ".join(quote(s) for s in cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (each with a results.json)")
    parser.add_argument("--samples", type=int, nargs="*", default=[],
                        help="also print these held-out posts' summaries side by side")
    args = parser.parse_args(argv)
    runs = [read_results(folder) for folder in args.runs]
    print(table(runs))
    if args.samples:
        n = len(runs[0]["final"]["samples"])
        if any(not 0 <= i < n for i in args.samples):
            parser.error(f"argument --samples: post indices run from 0 to {n - 1}")
        print()
        print(samples_table(runs, args.samples))


if __name__ == "__main__":
    main()
