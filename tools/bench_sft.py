"""Time sft.py's optimizer step for adapter depths and prompt budgets, as ratios in one run.

Each variant is LAYERS:PROMPT_TOKENS: the adapter on the top LAYERS layers (0: every layer,
the post's) and posts cut to PROMPT_TOKENS, as `sft.py --lora-layers --prompt-tokens` do.
Every variant gets a fresh adapter and optimizer on the same SmolLM2 and the same batches
(seed 0). The rounds alternate the variants, so a busy moment of the machine falls on all of
them; the first step of each is untimed (warm-up). Memory is not separated per variant.

Run:  python -m tools.bench_sft                          (0:128 8:128 16:128 0:256, 6 steps)
      python -m tools.bench_sft --variants 0:128 8:256 --steps 10
"""

import argparse
import copy
import statistics
import time

import torch

import loaders
import sft
from lora import with_lora
from support.config import read_config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["0:128", "8:128", "16:128", "0:256"])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    args = parser.parse_args(argv)
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants]
    cfg, _ = read_config(sft.Config, sft.PRESETS, sft.RANGES, sft.CHOICES, ["--preset", "cpu"])
    device = loaders.pick_device()
    base, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                        device=device)
    posts, comparisons = loaders.load_tldr(None), sft.load_comparisons_or_none(None)
    runs = {}
    for layers, tokens in variants:
        budget = copy.copy(cfg)
        budget.prompt_tokens = tokens
        train, _ = sft.training_posts(budget, tokenizer, posts, comparisons)
        torch.manual_seed(0)
        policy = with_lora(copy.deepcopy(base), top_layers=layers).eval()
        adapter = [p for p in policy.parameters() if p.requires_grad]
        runs[(layers, tokens)] = dict(policy=policy, train=train, seconds=[],
                                      optimizer=torch.optim.AdamW(adapter, lr=cfg.lr))
    for step in range(args.steps + 1):
        for (layers, tokens), run in runs.items():
            batch = loaders.batch_for(run["train"], step, cfg.batch, 0)
            began = time.perf_counter()
            run["optimizer"].zero_grad(set_to_none=True)
            sft.sft_loss(run["policy"], tokenizer, batch, cfg.micro_batch, device)
            run["optimizer"].step()
            if step:                                    # step 0 warms up
                run["seconds"].append(time.perf_counter() - began)
    first = statistics.median(next(iter(runs.values()))["seconds"])
    print(f"\nsft.py's step, {cfg.batch} posts, median of {args.steps} (first variant = 1.00):")
    print("adapter layers | prompt tokens | s/step | ratio")
    for (layers, tokens), run in runs.items():
        median = statistics.median(run["seconds"])
        print(f"{layers or 'all':>14} | {tokens:>13} | {median:6.2f} | {median / first:5.2f}")


if __name__ == "__main__":
    main()
