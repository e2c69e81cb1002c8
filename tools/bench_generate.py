"""Time ppo.generate on one training batch at a preset, to profile where generation goes.

The policy is SmolLM2 with a fresh LoRA adapter on every layer, as in ppo.train; the batch
is the first training batch of seed 0. Each call samples --batch summaries of up to 48
tokens. Run it under py-spy to see the split between the matmuls and the rest:

Run:  python -m tools.bench_generate                          (cpu preset, 3 calls)
      py-spy record -f raw -o generate.txt -- python -m tools.bench_generate
"""

import argparse
import copy
import time

import torch

import loaders
import ppo
from lora import with_lora
from support.config import read_config


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="auto")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args(argv)
    cfg, _ = read_config(ppo.Config, ppo.PRESETS, ppo.RANGES, ppo.CHOICES,
                         ["--preset", args.preset])
    device = loaders.pick_device()
    reference, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                             device=device)
    policy = with_lora(copy.deepcopy(reference)).eval()
    pool, _ = loaders.load_prompts(cfg, tokenizer)
    posts = loaders.batch_for(pool, 0, cfg.batch, 0)
    prompt_ids, prompt_mask = loaders.encode(tokenizer, [p["prompt"] for p in posts], device)
    torch.manual_seed(0)
    for call in range(args.calls):
        start = time.perf_counter()
        with loaders.precision(cfg, device):
            _, actions = ppo.generate(policy, prompt_ids, prompt_mask, cfg,
                                      tokenizer.eos_token_id)
        print(f"call {call}: {time.perf_counter() - start:.2f} s for {tuple(actions.shape)} "
              f"(batch, tokens), prompts of {prompt_ids.shape[1]} columns")


if __name__ == "__main__":
    main()
