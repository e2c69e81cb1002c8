"""A saved reward model's relevance test, rerun, beside TF-IDF word overlap on the same pairs.

    python -m tools.rm_relevance                          # runs/reward_model
    python -m tools.rm_relevance --reward-model runs/rm_s1
    python -m tools.rm_relevance --samples-from runs/sft  # another model's samples

`python reward_model.py` runs the relevance test (departure 9: under post p, does p's own
summary beat another post's of the same length?) once, after training, into metrics.json.
This rebuilds its three sets from the model's seed and preset (config.json, metrics.json):
the human TL;DRs of ppo.py's evaluation posts, those of the run's held-out posts, and the
samples for the held-out posts of the model the judge started from (config.json's
base_model), drawn again with the run's seed; --samples-from draws them from another model
(a judge started from SmolLM2, read on the SFT model's samples). It scores the
pairs with the saved judge and with `rm_report.tfidf_score`, a judge that never trained,
and prints both, with the judge's accuracy from metrics.json: on the machine that trained
the model the two judge columns agree (to float rounding), elsewhere the samples may differ.
Then the lead test on the two sets of human TL;DRs (`rm_report.lead_test`: the TL;DR
against the post's own opening words of the same length), for judges trained before it
existed too ("-" where metrics.json lacks it).

Why: a judge can only read in a summary what the summary says. Where TF-IDF cannot tell a
post's own summary from another post's either, the summaries carry little of their post,
and no judge should be expected to do much better.
"""
import argparse
import functools
import json
from pathlib import Path

import loaders
import reward_model as rm
from support import cli, rm_data, rm_report

SETS = (("human_reserve", "human TL;DRs, ppo.py's evaluation posts"),
        ("human_heldout", "human TL;DRs, held-out posts"),
        ("samples_heldout", "samples, held-out posts"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward-model", default="runs/reward_model",
                        help="a folder written by reward_model.py (default runs/reward_model)")
    parser.add_argument("--samples-from", default=None,
                        help="the model whose samples the third set holds (default: the one "
                             "the judge started from)")
    args = parser.parse_args(argv)
    device = loaders.pick_device()                  # as reward_model.py picked it
    model = rm.load_reward_model(args.reward_model, device=device)
    path = Path(args.reward_model) / "metrics.json"
    with cli.reading(path, "the metrics.json that reward_model.py writes", KeyError):
        stored = json.loads(path.read_text())
        preset = stored["extra"]["preset"]
    sampler = args.samples_from or model.settings["base_model"]
    config = rm.parse_config(["--preset", preset, "--seed", str(model.settings["seed"]),
                              "--model", sampler,
                              "--max-prompt-tokens", str(model.settings["max_prompt_tokens"]),
                              "--max-summary-tokens", str(model.settings["max_summary_tokens"])])
    data = rm_data.load_and_split(config)
    lm, tokenizer = loaders.load_policy_and_tokenizer(
        config.model, preset="tiny" if preset == "tiny" else None, device=device)
    encoded, _ = rm_data.heldout_references(tokenizer, data, config)
    samples = rm_data.heldout_samples(lm, tokenizer, encoded, config)   # the run's draw
    score = functools.partial(rm.score_grouped, model, batch_rows=config.eval_batch,
                              progress="relevance")
    got = rm_report.relevance_sets(score, tokenizer,
                                   rm_data.evaluation_reserve(tokenizer, data, config),
                                   encoded, samples, config)
    print(f"{args.reward_model} (seed {config.seed}, preset {preset}, started from "
          f"{model.settings['base_model']}; samples from {config.model}): under post p, p's "
          "own summary beats another post's of the same length")
    print(f"{'':40}{'pairs':>6}{'judge [Wilson 95%]':>24}{'in metrics.json':>17}"
          f"{'TF-IDF [Wilson 95%]':>24}")
    saved = stored["extra"].get("relevance", {})
    for name, what in SETS:
        if name in got:
            same_draw = name != "samples_heldout" or config.model == model.settings["base_model"]
            print_row(what, got[name],
                      saved.get(name, {}).get("accuracy") if same_draw else None)
    print("under post p, p's human TL;DR beats the post's own opening words, cut to the same "
          "length (the lead)")
    for name, what in SETS[:2]:
        if name in got:
            print_row(what, got[name]["lead"],
                      saved.get(name, {}).get("lead", {}).get("accuracy"))


def print_row(what, r, before):
    """One set's row: pairs, the judge's accuracy, metrics.json's, TF-IDF's (r["tfidf"])."""
    t = r["tfidf"]
    print(f"{what:40}{r['pairs']:6d}"
          f"{r['accuracy']:8.3f} [{r['wilson_low']:.3f}, {r['wilson_high']:.3f}]"
          f"{'-' if before is None else format(before, '.3f'):>17}"
          f"{t['accuracy']:8.3f} [{t['wilson_low']:.3f}, {t['wilson_high']:.3f}]")


if __name__ == "__main__":
    cli.run_script(main)     # a missing or bad --reward-model: one line, not a traceback
