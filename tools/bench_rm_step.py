"""The reward model's training step, its prompts read once per batch (`train_step`) against
once per pair (the naive way), on the same batches; with --batching post, batches of whole
posts (`batches_by_post`) against batches sorted by length (`batches_of`), per comparison;
with --precision bf16, the step in fp32 against the step under bf16 autocast.

    python -m tools.bench_rm_step                                   # cpu preset, 12 batches
    python -m tools.bench_rm_step --batching post --steps 16        # the two batchings
    python -m tools.bench_rm_step --precision bf16 --steps 16       # fp32 against bf16
    python -m tools.bench_rm_step --steps 20 -- --off-post-pairs 1024 --off-post-negatives 4

The flags after `--` are reward_model.py's and choose the training pairs: people's
comparisons and the human off-post pairs (no sampling here, so no reference or sample
pairs). Batches are drawn at random from `reward_model.batches_of`, as training orders
them; on each, the two ways run back to back, in alternating order, at the same weights
(the learning rate is 0). Prints seconds per step, their ratio (mean of per-batch ratios,
with its SE), the prompt tokens each way reads, and the largest loss difference between
the two (they compute the same numbers). With --batching post it times --steps batches
drawn from each batching instead, alternating, and prints seconds per comparison, their
ratio, and the tokens each batching's whole epoch reads, padding included. With
--precision bf16 each batch runs in fp32 and under bf16 autocast (reward_model.py
--precision bf16), alternating, and it prints seconds per step, the ratio (SE) and the
largest loss difference. Time it on an otherwise idle machine.
"""
import argparse
import dataclasses
import math
import random
import statistics
import time

import loaders
import reward_model as rm
from support import rm_data


def per_pair(model):
    """model.forward_shared as it was called before: one prompt row per pair."""
    shared = model.forward_shared

    def forward(prompts, summaries, owner):
        k = len(owner) // 2                     # rows 0..k-1 chosen, k..2k-1 rejected
        return shared([prompts[o] for o in owner[:k].tolist()], summaries,
                      owner.new_tensor(list(range(k)) * 2))
    return forward


def timed_step(model, optimizer, batch, naive):
    """(seconds, loss) of one train_step, reading prompts per pair if `naive`."""
    if naive:
        model.forward_shared = per_pair(model)
    start = time.perf_counter()
    loss, _ = rm.train_step(model, optimizer, batch)
    seconds = time.perf_counter() - start
    model.__dict__.pop("forward_shared", None)  # back to the method
    return seconds, loss


def training_batches(rm_flags=(), lr=None):
    """The cpu preset's reward model and its training batches of people's comparisons and
    the human off-post pairs (no sampling): (config, model, human, off_post, batches).
    `lr` 0.0 keeps the weights as they are (both ways of a step see the same ones)."""
    config = rm.parse_config(["--preset", "cpu", *rm_flags, "--reference-pairs", "0",
                              "--off-post-sample-pairs", "0"])
    if lr is not None:
        config.lr = config.head_lr = lr
    data = rm_data.load_and_split(config)
    model, tokenizer = rm.build_for_run(config, "cpu")
    human, _ = rm_data.comparison_pairs(tokenizer, data, config)
    _, off_post, _, _, _ = rm_data.sample_reference_phase(config, tokenizer, data, [], "cpu")
    return config, model, human, off_post, rm.batches_of(human + off_post, config.batch_pairs)


def batch_tokens(batch, merge):
    """Tokens one step reads, padding included: its prompt pass (distinct prompts x the
    longest) and its summary pass (rows x the longest)."""
    prompts, summaries, *_ = rm.summary_rows(batch, merge)
    return len(prompts) * max(map(len, prompts)) + len(summaries) * max(map(len, summaries))


def compare_batchings(model, optimizer, pairs, config, steps, seed):
    """Seconds per comparison and per 1,000 tokens read of --batching length and post, on
    `steps` batches of each drawn at random, timed alternately at the same weights; each
    epoch's tokens, and its time projected from them at the measured rate."""
    ways = {"length": (rm.batches_of(pairs, config.batch_pairs), False),
            "post": (rm.batches_by_post(pairs, config.batch_pairs), True)}
    rng = random.Random(seed)
    drawn = {name: rng.sample(batches, min(steps, len(batches)))
             for name, (batches, _) in ways.items()}
    rm.train_step(model, optimizer, drawn["post"][0], True)                 # warm-up
    seconds, compared = {name: 0.0 for name in ways}, {name: 0 for name in ways}
    per_pair, read = {name: [] for name in ways}, {name: 0 for name in ways}
    for i in range(min(map(len, drawn.values()))):
        for name in (("length", "post") if i % 2 == 0 else ("post", "length")):
            batch, merge = drawn[name][i], ways[name][1]
            start = time.perf_counter()
            rm.train_step(model, optimizer, batch, merge)
            took = time.perf_counter() - start
            seconds[name] += took
            compared[name] += len(batch)
            per_pair[name].append(took / len(batch))
            read[name] += batch_tokens(batch, merge)
    print(f"{len(pairs)} comparison and off-post pairs; timed {len(per_pair['post'])} "
          "batches of each batching, alternating")
    print(f"{'--batching':12}{'steps/epoch':>12}{'s/comparison':>14}{'SE':>7}"
          f"{'s/1k tokens':>13}{'epoch tokens':>14}{'epoch s':>9}")
    epoch = {}
    for name, (batches, merge) in ways.items():
        se = statistics.stdev(per_pair[name]) / math.sqrt(len(per_pair[name]))
        rate, tokens = seconds[name] / read[name], sum(batch_tokens(b, merge) for b in batches)
        epoch[name] = rate * tokens
        print(f"{name:12}{len(batches):12}{seconds[name] / compared[name]:14.3f}{se:7.3f}"
              f"{1000 * rate:13.3f}{tokens:14,}{epoch[name]:9.0f}")
    print(f"post / length, an epoch projected from its tokens at each measured rate: "
          f"{epoch['post'] / epoch['length']:.2f}x")


def compare_precisions(model, optimizer, batches, config, steps, seed):
    """Seconds per step in fp32 and under bf16 autocast (`loaders.precision`, as
    reward_model.py runs it) on the same `steps` batches drawn at random, alternating which
    runs first, at the same weights (lr 0)."""
    ways = {name: dataclasses.replace(config, precision=name) for name in ("fp32", "bf16")}
    chosen = random.Random(seed).sample(batches, min(steps, len(batches)))
    for way in ways.values():                                           # warm-up, each
        with loaders.precision(way, "cpu"):
            rm.train_step(model, optimizer, chosen[0])
    seconds, losses = {name: [] for name in ways}, {name: [] for name in ways}
    for i, batch in enumerate(chosen):
        for name in (("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32")):
            start = time.perf_counter()
            with loaders.precision(ways[name], "cpu"):
                loss, _ = rm.train_step(model, optimizer, batch)
            seconds[name].append(time.perf_counter() - start)
            losses[name].append(loss)
    ratios = [b / a for a, b in zip(seconds["fp32"], seconds["bf16"])]
    se = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.nan
    print(f"{len(batches)} batches; timed {len(chosen)}, each in both precisions, alternating")
    for name in ways:
        print(f"{name:6}{statistics.mean(seconds[name]):8.2f} s/step")
    print(f"bf16 / fp32: {statistics.mean(ratios):.2f}x per step (SE {se:.2f}); largest "
          f"loss difference {max(abs(a - b) for a, b in zip(*losses.values())):.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="batches to time (default 12)")
    parser.add_argument("--seed", type=int, default=0, help="which batches (default 0)")
    parser.add_argument("--batching", choices=("prompt", "post"), default="prompt",
                        help="prompt: a prompt read once per batch against once per pair "
                             "(default); post: --batching post against length")
    parser.add_argument("--precision", choices=("bf16",),
                        help="bf16: the step in fp32 against under bf16 autocast instead")
    parser.add_argument("rm_flags", nargs="*", help="reward_model.py's flags, after --")
    args = parser.parse_args()
    config, model, human, off_post, batches = training_batches(args.rm_flags, lr=0.0)
    if args.precision:
        compare_precisions(model, rm.make_optimizer(model, config), batches, config,
                           args.steps, args.seed)
        return
    if args.batching == "post":
        compare_batchings(model, rm.make_optimizer(model, config), human + off_post, config,
                          args.steps, args.seed)
        return
    chosen = random.Random(args.seed).sample(batches, min(args.steps, len(batches)))
    optimizer = rm.make_optimizer(model, config)
    timed_step(model, optimizer, chosen[0], naive=False)            # warm-up, not counted
    rows = []                                    # (shared s, naive s, shared loss, naive loss)
    for i, batch in enumerate(chosen):
        first_naive = i % 2 == 1
        a = timed_step(model, optimizer, batch, naive=first_naive)
        b = timed_step(model, optimizer, batch, naive=not first_naive)
        (s, ls), (n, ln) = (b, a) if first_naive else (a, b)
        rows.append((s, n, ls, ln))
    ratios = [n / s for s, n, _, _ in rows]
    tokens = lambda batch, naive: sum(len(p) for p in (                    # noqa: E731
        [x["prompt"] for x in batch] if naive else {tuple(x["prompt"]) for x in batch}))
    shared_tokens = statistics.mean(tokens(b, False) for b in chosen)
    naive_tokens = statistics.mean(tokens(b, True) for b in chosen)
    print(f"{len(human)} comparison pairs + {len(off_post)} human off-post pairs "
          f"(negatives {config.off_post_negatives}), {len(batches)} batches of "
          f"{config.batch_pairs}; timed {len(rows)}")
    print(f"{'':28}{'s/step':>10}{'prompt tokens/step':>20}")
    print(f"{'prompt once per batch':28}{statistics.mean(r[0] for r in rows):10.2f}"
          f"{shared_tokens:20.0f}")
    print(f"{'prompt once per pair':28}{statistics.mean(r[1] for r in rows):10.2f}"
          f"{naive_tokens:20.0f}")
    se = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.nan
    print(f"per pair / per batch: {statistics.mean(ratios):.2f} x (SE {se:.2f}); largest "
          f"loss difference {max(abs(r[2] - r[3]) for r in rows):.1e}")


if __name__ == "__main__":
    main()
