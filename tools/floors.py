"""How close is each phase of a PPO iteration, and the reward model's training step, to what
this machine could do at best?

Measures two rates of this machine, in this process's threads:
    fp32 matmul    GFLOP/s of the shapes SmolLM2's layers multiply (tokens x 576 by 576 x 1536)
    weight reads   GB/s a matrix-vector product streams a 500 MB weight matrix at: the rate
                   of token-by-token generation, which reads every weight once a step
and, from SmolLM2's config and the run's settings, each phase's floor:
    generate   the prompt in one pass (FLOPs), then a step per new token, each the larger of
               its FLOPs and its weight reads (all layers and the head, fp32)
    score      one pass of the reward model over prompt and summary (FLOPs)
    forward    the old policy's and the reference's passes (FLOPs; the head on the response
               positions only, as the code does)
    update     each inner step a forward pass and a backward one, the backward at 2x the
               forward (the input gradients; the adapter's own are negligible)
    rm step    the reward model's training step (--rm-steps N: N batches of the cpu preset,
               drawn as tools/bench_rm_step does, timed here): each distinct prompt and each
               summary through all layers, then the backward through the top `lora_layers`
               (nothing below the adapter needs a gradient), at 2x their forward
FLOPs count the matmuls with the weights, 2 per multiply-add; attention scores add under 3%
at these lengths and are left out, so a floor is a little below the true one. Prompts count
at the mean real length of the run's training prompts (padding is work the floor does not
need), or --prompt-tokens.

Run:  python -m tools.floors --results runs/ppo_beta0_seed0/results.json --rm-steps 10
      (prints the rates and a table: each phase's median seconds over the run's iterations,
      its floor, and the fraction of the floor achieved; docs/speed.md)
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig

import loaders
import reward_model as rm
from tools.bench_rm_step import training_batches


def best_seconds(fn, repeat=5):
    fn()                                                      # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(tokens=1024, d=576, ff=1536):
    """fp32 GFLOP/s of (tokens x d) @ (d x ff), SmolLM2's MLP shape."""
    a, b = torch.randn(tokens, d), torch.randn(d, ff)
    return 2 * tokens * d * ff / best_seconds(lambda: a @ b, repeat=20) / 1e9


def weight_read_gbs(megabytes=512, d=576, batch=8):
    """GB/s at which (batch x d) @ (d x N)^T streams an N x d fp32 weight of `megabytes`."""
    weight = torch.randn(megabytes * 2 ** 20 // (4 * d), d)
    x = torch.randn(batch, d)
    return weight.numel() * 4 / best_seconds(lambda: x @ weight.T) / 1e9


def layer_params(config):
    """Weights multiplied per token in the transformer layers, and in the head."""
    d, ff, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ff           # q, o; k, v; gate, up, down
    return layers * per_layer, d * config.vocab_size


def mean_prompt_tokens(cfg):
    """The mean real length, in tokens, of the prompts a run with `cfg` draws from."""
    tokenizer = loaders.load_tokenizer()
    pool, _ = loaders.load_prompts(SimpleNamespace(**cfg), tokenizer)
    return statistics.mean(len(tokenizer(p["prompt"]).input_ids) for p in pool)


def phase_floors(config, cfg, prompt_tokens, gflops, gbs):
    """Seconds each phase of one iteration needs at best: {phase: (seconds, what binds)}."""
    body, head = layer_params(config)
    B, P, T = cfg["batch"] * cfg.get("samples_per_prompt", 1), prompt_tokens, cfg["max_new_tokens"]
    flop = lambda n: n / (gflops * 1e9)                       # noqa: E731
    read = lambda n: n / (gbs * 1e9)                          # noqa: E731
    prefill = flop(2 * body * B * P + 2 * head * B)
    step = max(flop(2 * (body + head) * B), read(4 * (body + head)))
    one_pass = flop(2 * body * B * (P + T) + 2 * head * B * T)          # policy or reference
    return {"generate": (prefill + (T - 1) * step,
                         "weight reads" if read(4 * (body + head)) > flop(2 * (body + head) * B)
                         else "FLOPs"),
            "score": (flop(2 * body * B * (P + T)), "FLOPs"),
            "forward": (2 * one_pass, "FLOPs"),
            "update": (cfg["inner_steps"] * 3 * one_pass, "FLOPs")}


def rm_step(steps, gflops, seed=0):
    """(median measured seconds, floor seconds, tokens a step) of the reward model's
    training step at the cpu preset, on `steps` random batches of people's comparisons and
    the human off-post pairs."""
    config, model, _, _, batches = training_batches()
    batches = random.Random(seed).sample(batches, steps + 1)
    optimizer = rm.make_optimizer(model, config)
    body, _ = layer_params(model.body.config)
    top = config.lora_layers / model.body.config.num_hidden_layers
    seconds, floors, counts = [], [], []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        rm.train_step(model, optimizer, batch)
        if i:                                                 # the first is a warm-up
            seconds.append(time.perf_counter() - start)
            tokens = (sum(len(p) for p in {tuple(x["prompt"]) for x in batch})
                      + sum(len(x[k]) for x in batch for k in ("chosen", "rejected")))
            floors.append(2 * body * tokens * (1 + 2 * top) / (gflops * 1e9))
            counts.append(tokens)
    return statistics.median(seconds), statistics.median(floors), statistics.median(counts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="runs/ppo_beta0_seed0/results.json",
                        help="a ppo.py results.json (its iterations' seconds per phase)")
    parser.add_argument("--rm-steps", type=int, default=0, help="also time this many "
                        "training steps of the reward model (cpu preset) against their floor")
    parser.add_argument("--prompt-tokens", type=float, help="mean prompt length (default: "
                        "measured on the run's training prompts)")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    cfg, rows = results["config"], results["iterations"]
    config = AutoConfig.from_pretrained(loaders.resolve_model(cfg["model"])[0])
    gflops, gbs = matmul_gflops(), weight_read_gbs()
    print(f"{torch.get_num_threads()} threads: fp32 matmul {gflops:.0f} GFLOP/s, "
          f"weight reads {gbs:.1f} GB/s")
    prompt = args.prompt_tokens or mean_prompt_tokens(cfg)
    floors = phase_floors(config, cfg, prompt, gflops, gbs)
    print(f"\n{args.results}: {len(rows)} iterations, batch {cfg['batch']}, prompts "
          f"{prompt:.0f} tokens, {cfg['max_new_tokens']} new tokens, {cfg['precision']}\n")
    print("| phase | measured, s (median) | floor, s | bound by | fraction of the floor |")
    print("| --- | --- | --- | --- | --- |")
    total_measured = total_floor = 0
    for phase, (floor, bound) in floors.items():
        measured = statistics.median(r[f"seconds_{phase}"] for r in rows)
        total_measured, total_floor = total_measured + measured, total_floor + floor
        print(f"| {phase} | {measured:.1f} | {floor:.1f} | {bound} | {floor / measured:.2f} |")
    print(f"| **iteration** | {total_measured:.1f} | {total_floor:.1f} | "
          f"| {total_floor / total_measured:.2f} |")
    if args.rm_steps:
        measured, floor, tokens = rm_step(args.rm_steps, gflops)
        print(f"\nreward model, cpu preset, {args.rm_steps} training steps, {tokens:.0f} "
              "tokens a step (prompts once, summaries):\n"
              f"| rm training step | {measured:.2f} | {floor:.2f} | FLOPs "
              f"| {floor / measured:.2f} |")


if __name__ == "__main__":
    main()
