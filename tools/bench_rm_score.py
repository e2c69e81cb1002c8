"""The reward model's relevance test, scored in one call (each post read once for all its
rows: `rm_report.relevance`) against one call per kind of row (the code before 2026-12-01).

    python -m tools.bench_rm_score                       # runs/reward_model, 64 posts
    python -m tools.bench_rm_score --reward-model runs/rm_s1 --posts 218 --repeats 3

The rows are `rm_report.relevance_rows` on the human TL;DRs of ppo.py's evaluation posts
that no training comparison holds, as `python reward_model.py` tests them: under post p,
p's own summary and a length neighbour's (cut to equal length), then p's summary under p
and under the neighbour's post. Both ways run back to back, in alternating order. Prints
seconds, their ratio (mean of per-repeat ratios), the prompt tokens each way reads, and
the largest score difference (the same numbers up to float rounding). Time it on an
otherwise idle machine.
"""
import argparse
import statistics
import time

import torch

import loaders
import reward_model as rm
from support import cli, rm_data, rm_report


def timed(model, calls, batch_rows):
    """(seconds, scores) of score_grouped over each (prompts, summaries) in `calls`."""
    start = time.perf_counter()
    scores = torch.cat([rm.score_grouped(model, p, s, batch_rows) for p, s in calls])
    return time.perf_counter() - start, scores


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward-model", default="runs/reward_model",
                        help="a folder written by reward_model.py (default runs/reward_model)")
    parser.add_argument("--posts", type=int, default=64, help="posts to test (default 64)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (default 2)")
    args = parser.parse_args(argv)
    model = rm.load_reward_model(args.reward_model)
    config = rm.parse_config(["--preset", "cpu", "--seed", str(model.settings["seed"]),
                              "--max-prompt-tokens", str(model.settings["max_prompt_tokens"])])
    data = rm_data.load_and_split(config)
    tokenizer = loaders.load_tokenizer(config.model)
    reserve = rm_data.evaluation_reserve(tokenizer, data, config)[:args.posts]
    prompts, summaries = rm_report.reserve_ids(tokenizer, reserve, config.max_summary_tokens)
    rows_p, rows_s, sizes = rm_report.relevance_rows(prompts, summaries,
                                                     tokenizer.eos_token_id, config.seed)
    one = [(rows_p, rows_s)]
    edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    per_kind = [(rows_p[a:b], rows_s[a:b]) for a, b in zip(edges, edges[1:])]
    timed(model, [(rows_p[:8], rows_s[:8])], config.eval_batch)       # warm-up, not counted
    rounds = []                                  # (one call s, per kind s, largest difference)
    for i in range(args.repeats):
        ways = [(one, "one"), (per_kind, "kind")][::-1 if i % 2 else 1]
        got = {name: timed(model, calls, config.eval_batch) for calls, name in ways}
        diff = (got["one"][1] - got["kind"][1]).abs().max().item()
        rounds.append((got["one"][0], got["kind"][0], diff))
    read = lambda calls: sum(len(p) for ps, _ in calls for p in set(map(tuple, ps)))  # noqa
    print(f"{len(reserve)} posts, {len(rows_p)} rows (own, other: {sizes[0]} each; home, "
          f"away: {sizes[2]} each), {args.repeats} rounds")
    print(f"{'':24}{'seconds':>10}{'prompt tokens read':>20}")
    print(f"{'one call':24}{statistics.mean(r[0] for r in rounds):10.1f}{read(one):20d}")
    print(f"{'a call per kind of row':24}{statistics.mean(r[1] for r in rounds):10.1f}"
          f"{read(per_kind):20d}")
    print(f"per kind / one call: {statistics.mean(r[1] / r[0] for r in rounds):.2f} x; "
          f"largest score difference {max(r[2] for r in rounds):.1e}")


if __name__ == "__main__":
    cli.run_script(main)     # a missing or bad --reward-model: one line, not a traceback
