"""The judge's held-out accuracy beside three rules that never read the summary (issue 75).

    python -m tools.analysis.judge_baselines --sft runs/sft \
        --out docs/runs/judge/rules_seed0.json          # the rules, the cpu preset's split
    OMP_NUM_THREADS=1 python -m tools.analysis.judge_baselines \
        --reward-model runs/reward_model --sft runs/sft --out F.json     # and the judge
    python -m tools.analysis.judge_baselines --reward-model runs/reward_model \
        --sft-from docs/runs/judge/rules_seed0.json --out F.json   # the SFT log-probs kept
    python -m tools.analysis.judge_baselines --table F.json          # the page's tables
    python -m tools.analysis.judge_baselines --dpo runs/dpo_s0 runs/dpo_s1 runs/dpo_s2 \
        --table F.json              # DPO's implicit judge near chance, paired

Rebuilds the judge's split of people's comparisons (from its config.json; a judge written
before it saved its split gets the cpu preset's with its seed, and the file says so), then
scores every held-out comparison by the rules of support/judge_baselines.py (which system
wrote it, the longer wins, and with --sft the SFT model's higher log-probability) and, with
--reward-model, by the judge's content and full scores, and writes the accuracies on
distinct pairs, by contrast, each judge against each rule paired, and every vote's
right-or-wrong (for `judge_baselines.dpo_near_chance`) into --out. The rules need no model
and no machine; the judges' and the SFT model's scores name the CPU that made them.
docs/reward_model.md's table is `--table` on the kept file (tests/test_judge_baselines.py
checks that they agree).
"""
import argparse
import json
from pathlib import Path

import torch

import dpo
import loaders
import reward_model as rm
from support import cli, judge_baselines, rm_data
from support.kept import machine

SCORERS = (("content", "judge, content"), ("full", "judge, full"), ("system", "which system"),
           ("length", "the longer"), ("sft", "SFT log-prob"))


def split_config(args, judge):
    """reward_model.Config of the judge's split: its saved settings, or (before it saved
    them) the cpu preset's with its seed. Returns (config, where the settings came from)."""
    if judge is not None and "split" in judge.settings:
        s = judge.settings["split"]
        return rm.Config(**{**rm.PRESETS["cpu"], "seed": s["seed"],
                            "heldout_fraction": s["heldout_fraction"], "max_pairs": s["max_pairs"],
                            "max_heldout_pairs": s["max_heldout_pairs"],
                            "max_prompt_tokens": s["max_prompt_tokens"],
                            "max_summary_tokens": s["max_summary_tokens"],
                            "data_dir": args.data_dir or ""}), "the judge's config.json"
    seed = judge.settings["seed"] if judge is not None else args.seed
    where = ("assumed: the cpu preset with the judge's seed (its config.json predates the "
             "saved split)" if judge is not None else "the cpu preset")
    return rm.Config(**{**rm.PRESETS["cpu"], "seed": seed, "data_dir": args.data_dir or ""}), where


def measure(args):
    """The kept file's dict (see the docstring)."""
    device = loaders.pick_device()
    judge = rm.load_reward_model(args.reward_model, device) if args.reward_model else None
    config, where = split_config(args, judge)
    data = rm_data.load_and_split(config)
    fingerprint = rm_data.split_fingerprint(data)
    if judge is not None and "split" in judge.settings \
            and judge.settings["split"]["fingerprint"] != fingerprint:
        raise cli.UserError(f"the comparisons here do not split as {args.reward_model}'s did "
                            "(another data folder?); pass its --data-dir")
    tokenizer = loaders.load_tokenizer()
    train_pairs, heldout_pairs = rm_data.comparison_pairs(tokenizer, data, config)
    scores = rm.evaluate(judge, heldout_pairs, config)[1] if judge is not None else {}
    logp, sft, where_sft = None, args.sft, machine()
    if args.sft:
        lm, _ = loaders.load_policy_and_tokenizer(args.sft, device=device)
        logp = dpo.log_probs_of(lm, heldout_pairs, 4, tokenizer.pad_token_id, device,
                                "held-out pairs (SFT)")
    elif args.sft_from:                          # the SFT model's log-probs, kept before
        logp, sft, where_sft = sft_from(args.sft_from, fingerprint, len(heldout_pairs))
    out = {"judge": args.reward_model, "sft": sft, "split_settings": where,
           "split_fingerprint": fingerprint, "seed": config.seed,
           "heldout_rows": len(heldout_pairs), "train_comparisons": len(train_pairs),
           # the CPU that scored: the judge's scores here, the SFT log-probs where made
           "machine": machine() if judge is not None else None,
           "sft_machine": where_sft if logp is not None else None,
           **judge_baselines.baselines(train_pairs, heldout_pairs, scores, logp)}
    if logp is not None:                         # (n, 2): log pi_SFT of y_w and y_l, a vote
        out["sft_logp"] = torch.stack([torch.as_tensor(x).cpu() for x in logp], 1).tolist()
    return out


def sft_from(path, fingerprint, n):
    """((n,), (n,)) log-probs, the SFT model's name and the CPU that computed them, from a
    kept file of the same split."""
    what = "a file written by tools.analysis.judge_baselines --sft"
    with cli.reading(Path(path), what, KeyError):
        kept = json.loads(Path(path).read_text())
        logp, sft = torch.tensor(kept["sft_logp"], dtype=torch.float64), kept["sft"]
    if kept["split_fingerprint"] != fingerprint or len(logp) != n:
        raise cli.UserError(f"{path} holds another split's pairs; rerun with --sft")
    return (logp[:, 0], logp[:, 1]), sft, kept.get("sft_machine") or kept.get("machine")


def cell(a):
    """An accuracy and its Wilson interval on distinct pairs."""
    return f"{a['accuracy']:.3f} [{a['wilson'][0]:.3f}, {a['wilson'][1]:.3f}]"


def table(kept):
    """The page's markdown: a row per group with each scorer's accuracy on distinct pairs;
    then, where a judge was scored, a second table of each judge minus each rule, paired."""
    groups = kept["groups"]
    present = [(k, name) for k, name in SCORERS if k in groups["all"]["accuracy"]]
    judges = [k for k, _ in present if k not in judge_baselines.RULES]
    rules = [k for k, name in present if k in judge_baselines.RULES]
    names = dict(present)
    first = ["held-out pairs (distinct / votes)", *[name for _, name in present]]
    lines = ["| " + " | ".join(first) + " |", "|" + " --- |" * len(first)]
    for group, g in groups.items():
        lines.append("| " + " | ".join([f"{group} ({g['pairs']} / {g['rows']})",
                                        *[cell(g["accuracy"][k]) for k, _ in present]]) + " |")
    if judges:
        second = ["judge minus rule, paired", *[f"{names[j]} − {names[r]}"
                                                for j in judges for r in rules]]
        lines += ["", "| " + " | ".join(second) + " |", "|" + " --- |" * len(second)]
        for group, g in groups.items():
            lines.append("| " + " | ".join([group, *[
                f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
                for j in judges for d in (g["paired"][j][r] for r in rules)]]) + " |")
    return "\n".join(lines)


def dpo_lines(runs, kept_path):
    """`judge_baselines.dpo_near_chance` of the runs (folders, results.json or kept summaries)
    against the kept file: the contrasts, a line a seed, and the pooled differences."""
    kept = json.loads(Path(kept_path).read_text())
    loaded = []
    for run in runs:
        path = Path(run) / "results.json" if Path(run).is_dir() else Path(run)
        with cli.reading(path, "a dpo.py results.json"):
            loaded.append(json.loads(path.read_text()))
    try:
        got = judge_baselines.dpo_near_chance(loaded, kept)
    except ValueError as error:
        raise cli.UserError(str(error)) from error
    lines = [f"near chance: {', '.join(got['contrasts']) or 'no contrast, so no pair'}"]
    for s in got["seeds"]:
        d = s["implicit_minus_content"]
        lines.append(f"seed {s['seed']}: implicit {cell(s['implicit'])}, content "
                     f"{cell(s['content'])}, full {cell(s['full'])}; implicit - content "
                     f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] over "
                     f"{d['pairs']} distinct pairs")
    for key in ("pooled_implicit_minus_content", "pooled_implicit_minus_full"):
        d = got[key]
        lines.append(f"{key.replace('_', ' ')} over {len(runs)} seeds: {d['difference']:+.3f} "
                     f"[{d['low']:+.3f}, {d['high']:+.3f}]")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward-model", default=None, help="a judge's folder: its split, "
                        "and its content and full scores beside the rules")
    parser.add_argument("--sft", default=None, help="the SFT model (runs/sft): its "
                        "log-probability rule")
    parser.add_argument("--sft-from", default=None, help="instead of --sft: the SFT "
                        "model's log-probs kept in an earlier file of the same split")
    parser.add_argument("--seed", type=int, default=0, help="the split's seed without a judge")
    parser.add_argument("--data-dir", default=None, help="as reward_model.py's")
    parser.add_argument("--out", default=None, help="write the kept JSON here")
    parser.add_argument("--table", default=None, help="print the markdown table of a kept "
                                                      "JSON, and nothing else")
    parser.add_argument("--dpo", nargs="+", default=None, help="with --table: dpo.py runs "
                        "(folders or results.json), their implicit judge against the explicit "
                        "one on the kept file's near-chance pairs")
    args = parser.parse_args(argv)
    if args.dpo and args.table:
        print(dpo_lines(args.dpo, args.table))
        return
    if args.table:
        what = "a file written by tools.analysis.judge_baselines"
        with cli.reading(Path(args.table), what, KeyError):
            print(table(json.loads(Path(args.table).read_text())))
        return
    kept = measure(args)
    judges = [k for k in ("content", "full") if k in kept["groups"]["all"]["accuracy"]]
    judge_baselines.print_baselines(kept, judges)
    print(f"near chance (both rules under {judge_baselines.NEAR_CHANCE} on the training "
          f"comparisons of the contrast): {', '.join(kept['near_chance']) or 'none'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(kept, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    cli.run_script(main)
