"""How concentrated the SFT model's next-token distribution is on its own held-out summaries.

The reference note 004 explains why PPO's reward falls as GAE's lambda goes from 1 to 0.95,
0.5 and 0 by how sure the supervised model already is: "after the first token, the
supervised model puts about 60% of its probability on the single most likely next token and
over 90% on the top 16 of a 32k vocabulary, and its normalized entropy stays low". This
measures the same three numbers for our SFT model (measures.concentration), on its own
samples of ppo.py's 64 held-out posts at the cpu preset, as its reference row draws them
(ppo.generate, the seed of heldout.reference_and_human; sft.py's own draws where they match):

    top token   pi(a* | s_t), a* the most likely next token
    top 16      the sum of the 16 largest pi(a | s_t)
    H / log V   the entropy of pi(. | s_t) over that of the uniform on the V tokens

at each response position up to and including the EOS, the first apart from the rest. Each
post's mean over its positions, then the mean and its SE over the posts; and the mean at
each position over the posts whose summary reaches it. The distribution is the model's own
at the sampling temperature, before top-k and top-p cut it.

Run:  python -m tools.analysis.concentration                  # runs/sft on 64 posts, a few minutes
      python -m tools.analysis.concentration --model runs/sft --out runs/concentration.json
Writes a small table to the terminal and --out (JSON, default runs/concentration.json).
Test: pytest tests/test_analysis_tools.py -k concentration
"""
import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import loaders
import ppo
from gae import response_mask
from support import cli, heldout
from support.config import read_config
from support.disk import write_json
from support.kept import machine
from support.measures import concentration, post_means, standard_error

TOP = 16
NAMES = (("top1", "top token"), (f"top{TOP}", f"top {TOP}"), ("entropy", "H / log V"))


def held_out_setup(args, reward_model=None):
    """ppo.py's settings at args.preset with this command's flags, the device, the SFT model
    and tokenizer, and ppo.py's held-out posts (loaders.load_prompts, as heldout does)."""
    argv = ["--preset", args.preset, "--model", args.model]
    argv += ["--eval-prompts", str(args.eval_prompts)] if args.eval_prompts else []
    argv += ["--data-dir", args.data_dir] if args.data_dir else []
    argv += ["--reward-model", reward_model] if reward_model else []
    cfg, _ = read_config(ppo.Config, ppo.PRESETS, ppo.RANGES, ppo.CHOICES, argv)
    device = loaders.pick_device()
    cfg.precision = loaders.resolve_precision(cfg.precision, device)
    model, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                         device=device)
    _, held_out = loaders.load_prompts(cfg, tokenizer)
    return cfg, device, model, tokenizer, held_out


def add_setup_flags(parser, eval_prompts_help):
    """The flags both this command and tools/analysis/optimum.py take."""
    parser.add_argument("--model", default=loaders.SFT_MODEL,
                        help="the SFT model (default runs/sft, sft.py's)")
    parser.add_argument("--preset", default="cpu", choices=("cpu", "blog", "tiny"),
                        help="ppo.py's preset whose held-out posts and sampler are used "
                             "(default cpu: 128 prompt tokens, 48 new tokens)")
    parser.add_argument("--eval-prompts", type=int, default=None, help=eval_prompts_help)
    parser.add_argument("--data-dir", default=None, help="the TL;DR data (loaders.py)")


@torch.no_grad()
def measure(model, tokenizer, held_out, cfg, device, drawn=None):
    """Per post, the three means over positions after the first and at the first, and per
    position the sums and counts over posts. Samples as ppo.rollouts does, in its batches."""
    eos, step = tokenizer.eos_token_id, cfg.batch * cfg.samples_per_prompt
    posts = {f"{name}_{where}": [] for name, _ in NAMES for where in ("after", "first")}
    sums = torch.zeros(len(NAMES), cfg.max_new_tokens, dtype=torch.float64)  # (3, T_max)
    counts = torch.zeros(cfg.max_new_tokens, dtype=torch.float64)            # (T_max,)
    for i in tqdm(range(0, len(held_out), step), desc="concentration", unit="batch"):
        prompt_ids, prompt_mask = loaders.encode(
            tokenizer, [p["prompt"] for p in held_out[i:i + step]], device)  # (b, P) each
        with loaders.precision(cfg, device):
            sequences, actions = (ppo.generate(model, prompt_ids, prompt_mask, cfg, eos)
                                  if drawn is None else
                                  ppo.as_generated(prompt_ids, drawn[i:i + step], eos))
            T = actions.shape[1]
            hidden = ppo.response_hidden(model, sequences, ppo.full_mask(prompt_mask, actions),
                                         T)                                   # (b, T, H)
            with loaders.heads_in_fp32(hidden):
                logits = model.lm_head(hidden.float()) / cfg.temperature     # (b, T, V)
        mask = response_mask(actions, eos)                   # (b, T) up to the first EOS
        first = torch.zeros_like(mask)
        first[:, 0] = mask[:, 0]                             # (b, T) the first position only
        after = mask - first                                 # (b, T) every later one
        values = concentration(logits, mask, TOP)            # 3 x (b, T)
        for (name, _), v in zip(NAMES, values):
            posts[f"{name}_after"] += post_means(v, after).tolist()
            posts[f"{name}_first"] += post_means(v, first).tolist()
        sums[:, :T] += torch.stack([v.double().sum(0) for v in values])      # (3, T)
        counts[:T] += mask.double().sum(0)                                    # (T,)
    return posts, sums, counts, logits.shape[-1]


def summary(posts, sums, counts, vocabulary, cfg, source):
    """The JSON a page reads: the means over posts with their SEs, the first position and the
    ones after it apart, and the curve by position."""
    out = {"model": cfg.model, "preset": cfg.preset, "posts": len(posts["top1_after"]),
           "vocabulary": vocabulary, "top": TOP, "samples": source,
           "sampler": {k: getattr(cfg, k) for k in ("prompt_tokens", "max_new_tokens",
                                                    "temperature", "top_k", "top_p")}}
    for where in ("after", "first"):
        key = "after_first" if where == "after" else "first"
        out[key] = {}
        for name, _ in NAMES:
            values = [v for v in posts[f"{name}_{where}"] if v == v]     # NaN: no position
            out[key].update({name: sum(values) / len(values), f"{name}_se":
                             standard_error(values)})
    reached = counts > 0                                     # positions some summary reaches
    out["by_position"] = {"position": [t + 1 for t in range(int(reached.sum()))],
                          "posts": counts[reached].int().tolist(),
                          **{name: (sums[j][reached] / counts[reached]).tolist()
                             for j, (name, _) in enumerate(NAMES)}}
    return out


def table(out):
    """The printed table: the first position and the ones after it, mean ± SE over posts."""
    lines = ["| positions | " + " | ".join(title for _, title in NAMES) + " |",
             "|" + " --- |" * (len(NAMES) + 1)]
    for key, title in (("first", "the first"), ("after_first", "after the first")):
        row = out[key]
        lines.append(f"| {title} | " + " | ".join(f"{row[name]:.3f} ± {row[name + '_se']:.3f}"
                                                  for name, _ in NAMES) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Writes a small table to the terminal and --out (JSON). Time: one sampling "
               "of the held-out posts and one forward pass over them: about 5 minutes for 64 "
               "posts at the cpu preset (40 s a batch of 8, one thread of a busy 2-core CPU); "
               "less where sft.py's draws are read back.")
    add_setup_flags(parser, "held-out posts, ppo.py's first N (default the preset's: 64)")
    parser.add_argument("--out", default="runs/concentration.json",
                        help="the JSON written (default runs/concentration.json)")
    args = parser.parse_args(argv)
    if problem := cli.out_problem(Path(args.out).parent):
        parser.error(problem)
    start = time.perf_counter()
    cfg, device, model, tokenizer, held_out = held_out_setup(args)
    draws = heldout.sft_draws(cfg, held_out, device) if loaders.sft_start(cfg.model) else None
    source = "sft.py's draws, read back" if draws else "sampled here"
    torch.manual_seed(10_000)                   # the seed of ppo.py's reference row
    got = measure(model, tokenizer, held_out, cfg, device, draws and draws["sft"])
    out = summary(*got, cfg, source)
    out["seconds"], out["machine"] = time.perf_counter() - start, machine()
    print(f"{cfg.model} on {out['posts']} held-out posts ({source}), V = {out['vocabulary']:,}:"
          f" mean over each post's positions, then mean ± SE over the posts")
    print(table(out))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), out)
    print(f"written to {args.out} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    cli.run_script(main)
