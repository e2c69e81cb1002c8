"""The KL-regularised optimum and best-of-n on the held-out posts, read off the SFT model's
own samples scored by the judge: where PPO's runs could be on the sweep's plot.

For each of ppo.py's held-out posts (the cpu preset's 64), k summaries from the SFT model
(ppo.generate, the cpu preset's sampler), each scored by the judge exactly as PPO's reward
(ppo.score, --reward content), ROUGE-L against the person's TL;DR and the rank of its own
post by TF-IDF retrieval (support/quality.py, as heldout.outside_measures). Then, per post
and averaged over the posts with the SE over posts (support/optimum.py):

    the optimum   pi* = pi_ref e^{r/beta} / Z at each beta of --betas (0: the best of the k):
                  self-normalised weights w_i, its reward sum_i w_i r_i, its KL
                  E*[r]/beta - log Z, and the w-weighted ROUGE-L and reciprocal rank
    best-of-n     n = 1..k: the expected judge's reward, ROUGE-L and reciprocal rank of the
                  judge's favourite of n drawn without replacement from the k (exact over
                  the n-subsets), at the KL log n - (n-1)/n

With k samples the optimum's KL cannot pass log k (2.77 nats at k = 16): at small beta it
is best-of-k, not pi*. The effective sample size 1 / sum w_i^2 is kept beside each point.
report.optimum_curves draws both curves on the sweep's three panels.

Run:  python -m tools.analysis.optimum                        # 64 posts x 16 samples: about an hour
      python -m tools.analysis.optimum --samples 2 --eval-prompts 4 --out /tmp/optimum.json  # a check
Writes a table to the terminal and --out (JSON: both curves, and each sample's reward,
ROUGE-L, rank, length and EOS per post, no texts).
Test: pytest tests/test_analysis_tools.py -k optimum
"""
import argparse
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

import loaders
import ppo
import reward_model as rm
from gae import ended_with_eos, response_mask
from support import cli, optimum
from support.disk import write_json
from support.kept import machine
from support.quality import retrieval_ranks, rouge_l
from tools.analysis.concentration import add_setup_flags, held_out_setup

BETAS = (0, 0.01, 0.1, 0.5, 2.0)                # the sweep's (docs/sweep.md)
SHOWN_N = (1, 2, 4, 8, 16, 32, 64)              # the best-of-n rows printed (all in the JSON)


@torch.no_grad()
def sample_and_score(model, reward, tokenizer, held_out, cfg, device, k):
    """k summaries of each post from `model`, scored by the judge as PPO's reward: per post a
    dict of lists (k each): reward, text, length (tokens, EOS included), eos. Rows are the
    posts each repeated k times, sampled in batches of --batch rows (the cpu preset's 8)."""
    eos, rows = tokenizer.eos_token_id, [p for p in held_out for _ in range(k)]
    out = [{"reward": [], "text": [], "length": [], "eos": []} for _ in held_out]
    bar = tqdm(range(0, len(rows), cfg.batch), desc="samples", unit="batch")
    for i in bar:
        prompt_ids, prompt_mask = loaders.encode(
            tokenizer, [p["prompt"] for p in rows[i:i + cfg.batch]], device)     # (b, P)
        with loaders.precision(cfg, device):
            _, actions = ppo.generate(model, prompt_ids, prompt_mask, cfg, eos)  # (b, T)
            mask = response_mask(actions, eos)                                   # (b, T)
            rewards = ppo.score(reward, prompt_ids, prompt_mask, actions, mask, eos_id=eos,
                                part=cfg.reward)                                 # (b,)
        ended = ended_with_eos(actions, mask, eos)                               # (b,)
        for b in range(len(actions)):
            ids = actions[b][mask[b].bool()].tolist()
            post = out[(i + b) // k]
            post["reward"].append(rewards[b].item())
            post["text"].append(tokenizer.decode(ids, skip_special_tokens=True))
            post["length"].append(len(ids))
            post["eos"].append(bool(ended[b]))
        bar.set_postfix(reward=f"{rewards.mean().item():+.2f}")
    return out


def outside(samples, held_out, k):
    """Adds to each post's samples their ROUGE-L against its TL;DR and the retrieval rank of
    the post among the held-out posts (the j-th sample of every post ranked together, as
    heldout.outside_measures ranks one sample a post)."""
    texts = [f"{p['title']}\n{p['post']}" for p in held_out]
    for s, post in zip(samples, held_out):
        s["rouge_l"] = [rouge_l(t, post["summary"]) for t in s["text"]]
        s["retrieval_rank"] = []
    for j in range(k):
        for s, rank in zip(samples, retrieval_ranks([s["text"][j] for s in samples], texts)):
            s["retrieval_rank"].append(rank)
    return samples


def table(curves):
    """The printed table: a row per beta of the optimum, then best-of-n at a few n."""
    lines = ["| point | KL (nats) | judge's reward | MRR | ROUGE-L | samples carrying it |",
             "|" + " --- |" * 6]
    cell = lambda row, key, sign="": f"{row[key]:{sign}.3f} ± {row[key + '_se']:.3f}"  # noqa: E731
    for row in curves["optimum"]:
        lines.append(f"| optimum, β = {row['beta']:g} | {cell(row, 'kl')} | "
                     f"{cell(row, 'reward', '+')} | {cell(row, 'retrieval_mrr')} | "
                     f"{cell(row, 'rouge_l')} | {row['ess']:.1f} |")
    for row in curves["best_of_n"]:
        if row["n"] in SHOWN_N or row["n"] == len(curves["best_of_n"]):
            lines.append(f"| best of {row['n']} | {row['kl']:.3f} | {cell(row, 'reward', '+')} | "
                         f"{cell(row, 'retrieval_mrr')} | {cell(row, 'rouge_l')} | 1 |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Writes a table to the terminal and --out (JSON). Time: --samples x "
               "--eval-prompts summaries sampled and scored, in batches of 8; at the cpu "
               "preset on one thread of a busy 2-core CPU about 26 s a batch (3.3 s a "
               "summary), so about an hour for the default 64 x 16, 30 s for --samples 2 "
               "--eval-prompts 4.")
    add_setup_flags(parser, "held-out posts, ppo.py's first N (default the preset's: 64)")
    parser.add_argument("--reward-model", default="runs/reward_model",
                        help="the judge, a folder written by reward_model.py "
                             "(default runs/reward_model)")
    parser.add_argument("--samples", type=int, default=16,
                        help="k, summaries sampled per post (default 16)")
    parser.add_argument("--betas", type=float, nargs="+", default=list(BETAS),
                        help="the optimum's betas (default the sweep's: 0 0.01 0.1 0.5 2)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    parser.add_argument("--out", default="runs/optimum.json",
                        help="the JSON written (default runs/optimum.json)")
    args = parser.parse_args(argv)
    if args.samples < 1 or (args.eval_prompts or 2) < 2 or min(args.betas) < 0:
        parser.error("--samples >= 1, --eval-prompts >= 2 (an SE needs two posts), "
                     "--betas >= 0")
    if not (Path(args.reward_model) / "config.json").is_file():
        parser.error(f"argument --reward-model: no reward model in {args.reward_model} "
                     "(`python reward_model.py` writes runs/reward_model)")
    start = time.perf_counter()
    cfg, device, model, tokenizer, held_out = held_out_setup(args, args.reward_model)
    reward = rm.load_reward_model(args.reward_model, device=device)
    torch.manual_seed(args.seed)
    samples = outside(sample_and_score(model, reward, tokenizer, held_out, cfg, device,
                                       args.samples), held_out, args.samples)
    curves = optimum.curves([s["reward"] for s in samples],
                            {"retrieval_mrr": [[1 / r for r in s["retrieval_rank"]]
                                               for s in samples],
                             "rouge_l": [s["rouge_l"] for s in samples]}, args.betas)
    seconds = time.perf_counter() - start
    print(f"{cfg.model}, judged by {args.reward_model} ({cfg.reward}): {len(held_out)} "
          f"held-out posts x {args.samples} samples, means over posts ± SE over posts")
    print(table(curves))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), {
        "model": cfg.model, "reward_model": args.reward_model, "reward": cfg.reward,
        "preset": cfg.preset, "posts": len(held_out), "samples": args.samples,
        "seed": args.seed, "kl_cap": math.log(args.samples), "seconds": seconds,
        "machine": machine(), **curves,
        "per_post": [{"post": i, **{key: s[key] for key in ("reward", "rouge_l",
                                                             "retrieval_rank", "length", "eos")}}
                     for i, s in enumerate(samples)]})
    print(f"written to {args.out} ({seconds:.0f} s, {seconds / len(held_out) / args.samples:.2f}"
          f" s a summary)")


if __name__ == "__main__":
    cli.run_script(main)
