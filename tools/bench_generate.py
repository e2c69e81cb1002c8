"""Time ppo.generate on one training batch at a preset, to profile where generation goes.

The policy is SmolLM2 with a fresh LoRA adapter on every layer, as in ppo.train; the batch
is the first training batch of seed 0. Each call samples --batch summaries of up to 48
tokens. Run it under py-spy to see the split between the matmuls and the rest:

With --compare it times three ways of the same call instead, alternating, after one
untimed call of each (the compile happens there, and its time is printed): `ppo.generate`
as it is (eager, a dynamic KV cache), a static KV cache, and a static KV cache with the
model's forward under `torch.compile`. The ways sum in other orders, so their samples
differ; only time is compared.

With --decoding it times `ppo.generate` under each --decoding way side by side, in ms a new
token (a call's seconds over its T): hf (Hugging Face's `generate`), static (decoding.py's
loop, eager) and, on CUDA, auto (that loop replayed as a CUDA graph; its first, untimed
call records the graph). Alternating, from the same seed each round.

Run:  python -m tools.bench_generate                          (cpu preset, 3 calls)
      python -m tools.bench_generate --compare                (eager, static, compiled)
      python -m tools.bench_generate --decoding               (hf, static, graph: ms a token)
      py-spy record -f raw -o generate.txt -- python -m tools.bench_generate
"""

import argparse
import copy
import statistics
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
    parser.add_argument("--compare", action="store_true",
                        help="time eager, a static KV cache and torch.compile, alternating")
    parser.add_argument("--decoding", action="store_true",
                        help="ms a new token of each --decoding way (hf, static, auto), "
                             "alternating")
    args = parser.parse_args(argv)
    cfg, _ = read_config(ppo.Config, ppo.PRESETS, ppo.RANGES, ppo.CHOICES,
                         ["--preset", args.preset])
    device = loaders.pick_device()
    cfg.precision = loaders.resolve_precision(cfg.precision, device)    # auto: as ppo.py
    reference, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                             device=device)
    policy = with_lora(copy.deepcopy(reference)).eval()
    pool, _ = loaders.load_prompts(cfg, tokenizer)
    posts = loaders.batch_for(pool, 0, cfg.batch, 0)
    prompt_ids, prompt_mask = loaders.encode(tokenizer, [p["prompt"] for p in posts], device)
    if args.compare:
        compare(policy, prompt_ids, prompt_mask, cfg, tokenizer.eos_token_id, args.calls)
        return
    if args.decoding:
        per_token(policy, prompt_ids, prompt_mask, cfg, tokenizer.eos_token_id, args.calls)
        return
    torch.manual_seed(0)
    for call in range(args.calls):
        start = time.perf_counter()
        with loaders.precision(cfg, device):
            _, actions = ppo.generate(policy, prompt_ids, prompt_mask, cfg,
                                      tokenizer.eos_token_id)
        print(f"call {call}: {time.perf_counter() - start:.2f} s for {tuple(actions.shape)} "
              f"(batch, tokens), prompts of {prompt_ids.shape[1]} columns")


def compare(policy, prompt_ids, prompt_mask, cfg, eos_id, calls):
    """Seconds per call of the three ways (module docstring), `calls` each, alternating."""
    eager = policy.forward
    compiled = torch.compile(policy.forward, dynamic=False)
    ways = {"eager (ppo.generate)": (eager, {}),
            "static KV cache": (eager, {"cache_implementation": "static"}),
            "static KV cache + torch.compile": (compiled, {"cache_implementation": "static"})}

    @torch.no_grad()
    def call(name, seed):
        policy.forward, extra = ways[name]
        torch.manual_seed(seed)
        start = time.perf_counter()
        policy.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        top_k=cfg.top_k, top_p=cfg.top_p, pad_token_id=eos_id, **extra)
        return time.perf_counter() - start

    first = {name: call(name, 0) for name in ways}          # compiles, not counted
    times = {name: [] for name in ways}
    for i in range(calls):
        for name in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
            times[name].append(call(name, i + 1))
    base = statistics.mean(times["eager (ppo.generate)"])
    print(f"{'':34}{'first call, s':>14}{'s/call':>8}{'x eager':>9}")
    for name, seconds in times.items():
        print(f"{name:34}{first[name]:14.1f}{statistics.mean(seconds):8.2f}"
              f"{statistics.mean(seconds) / base:9.2f}")


def per_token(policy, prompt_ids, prompt_mask, cfg, eos_id, calls):
    """ms a new token of each --decoding way (module docstring), `calls` each, alternating,
    after one untimed call of each. Returns {way: ms a token}."""
    device = prompt_ids.device
    ways = ["hf", "static"] + (["auto"] if device.type == "cuda" else [])

    def call(way, seed):
        cfg.decoding = way
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with loaders.precision(cfg, device):
            _, actions = ppo.generate(policy, prompt_ids, prompt_mask, cfg, eos_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, actions.shape[1]

    first = {way: call(way, 0)[0] for way in ways}          # the graph is recorded here
    ms = {way: [] for way in ways}
    for i in range(calls):
        for way in (ways if i % 2 == 0 else ways[::-1]):
            seconds, T = call(way, i + 1)
            ms[way].append(1000 * seconds / T)
    print(f"{tuple(prompt_ids.shape)} prompts (batch, columns), up to {cfg.max_new_tokens} "
          f"new tokens, {cfg.precision} on {device}")
    base = statistics.mean(ms["hf"])
    print(f"{'--decoding':12}{'first call, s':>14}{'ms/token':>10}{'x hf':>7}")
    for way, values in ms.items():
        print(f"{way:12}{first[way]:14.2f}{statistics.mean(values):10.2f}"
              f"{statistics.mean(values) / base:7.2f}")
    return {way: statistics.mean(values) for way, values in ms.items()}


if __name__ == "__main__":
    main()
