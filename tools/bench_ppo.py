"""Time and peak memory of one PPO iteration: the post's forward passes against ours.

The post's listing runs the whole model over prompt + response, keeps every hidden
state (`output_hidden_states=True`), computes logits at all ~300 positions and a
full-vocabulary `log_softmax` on them, in the old, reference and inner-step passes.
ppo.py computes the last hidden state only, projects just the T response positions,
and gathers log-probs with the fused op from ppo_kernels/ (no (rows x V) log-prob tensor,
recomputed in backward), optionally in micro-batches.

Both variants run the same ppo.train loop at the blog preset (BATCH 16, PROMPT_TOKENS
256, 48 new tokens), same seed, each in a fresh subprocess so that its peak resident
memory (ru_maxrss, which includes the weights of the three models) is its own. The
naive variant swaps in the post's `policy_forward` and `token_log_probs` (with the
attention mask and position ids added, so both compute the same numbers) and does no
entropy pass, as the post does not. Time is the median over iterations after the
first, per phase; ratios are taken within this one run (the machine is shared).

Two more variants run ours and the post's with --precision bf16 (the bodies under
bfloat16 autocast, log-probs and losses in fp32; the blog preset's default where bf16
matmuls are native), so that the precision's share of the gain shows; --skip-bf16 leaves
them out. The ratios in the table are all against the fp32 post.

Run:  python -m tools.bench_ppo                  (about 12 minutes on a 2-core CPU)
      python -m tools.bench_ppo --iterations 3 --micro-batch 4
      python -m tools.bench_ppo --check-gpu [--dry-run]   (checks a GPU: tools/check_gpu.py)
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.monotonic()          # --check-gpu's budget counts from here: torch's import too
import torch  # noqa: E402

import loaders
from support.report import peak_memory_gb

ROOT = Path(__file__).resolve().parent.parent        # the repository root

PHASES = ("generate", "score", "forward", "update")


def post_policy_forward(policy, value_head, sequences, attention_mask, actions, temperature=1.0,
                        with_entropy=False):
    """The post's policy_forward: full logits at every position, log_softmax, gather."""
    P = sequences.shape[1] - actions.shape[1]
    out = policy(sequences, attention_mask=attention_mask,
                 position_ids=loaders.positions(attention_mask), output_hidden_states=True)
    logits = out.logits[:, P - 1:-1] / temperature                      # (B, T, V)
    chosen = torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    hidden = out.hidden_states[-1][:, P - 1:-1]                         # (B, T, H)
    # .float(): under --precision bf16 autocast leaves these in bf16; train stores fp32
    return chosen.float(), value_head(hidden).float(), torch.zeros_like(chosen).float()


def post_token_log_probs(model, sequences, attention_mask, actions, temperature=1.0):
    """The post's token_log_probs: full logits, log_softmax over V, gather."""
    P = sequences.shape[1] - actions.shape[1]
    logits = model(sequences, attention_mask=attention_mask,
                   position_ids=loaders.positions(attention_mask)).logits[:, P - 1:-1]
    logits = logits / temperature                                       # (B, T, V)
    return torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1).float()


def worker(variant, iterations, micro_batch, reward_model, precision):
    """Run `iterations` of ppo.train at the blog preset; print one JSON line of results."""
    import ppo
    import reward_model as rm
    if variant == "post":
        ppo.policy_forward, ppo.token_log_probs = post_policy_forward, post_token_log_probs
    cfg = ppo.parse_args(["--preset", "blog", "--iterations", str(iterations),
                          "--micro-batch", str(micro_batch), "--reward-model", reward_model,
                          "--precision", precision,
                          "--checkpoint-every", "1000", "--eval-prompts", "16"])
    device = loaders.pick_device()
    reference, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, device=device)
    reward = rm.load_reward_model(cfg.reward_model, device=device)
    pool, _ = loaders.load_prompts(cfg, tokenizer)
    with tempfile.TemporaryDirectory() as out:
        _, _, results = ppo.train(cfg, 0.1, 0, (reference, reward, tokenizer, device), pool,
                                  out, progress=False)
    rows = results["iterations"]
    print("RESULT " + json.dumps({"rows": rows, "peak_gb": peak_memory_gb(device)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3,
                        help="iterations per variant; the first is dropped as warm-up")
    parser.add_argument("--micro-batch", type=int, default=4,
                        help="ours: sequences per forward/backward in the inner step")
    parser.add_argument("--reward-model", default="runs/reward_model",
                        help="folder written by reward_model.py")
    parser.add_argument("--skip-bf16", action="store_true",
                        help="time only the fp32 variants")
    parser.add_argument("--check-gpu", action="store_true",
                        help="check a CUDA machine in one command instead (check_gpu.py): "
                             "kernel tests compiled, tools/bench_kernels.py, PPO iterations")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --check-gpu: the same steps on the CPU at toy sizes")
    parser.add_argument("--prepare", action="store_true",
                        help="with --check-gpu: only write the weightless model folders")
    parser.add_argument("--out", default="runs/gpu_check.json",
                        help="with --check-gpu: where the table goes, as JSON")
    parser.add_argument("--steps", nargs="+", default=["tests", "kernels", "ppo"],
                        choices=["tests", "kernels", "ppo"],
                        help="with --check-gpu: run only these steps (default all three)")
    parser.add_argument("--worker", choices=["post", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.check_gpu:
        from tools import check_gpu
        sys.exit(check_gpu.main(args.dry_run, args.out, prepare_only=args.prepare,
                                steps=args.steps, started=STARTED))
    if args.worker:
        return worker(args.worker, args.iterations, args.micro_batch, args.reward_model,
                      args.precision)

    results = {}
    variants = [("post", "post", 16, "fp32"), ("ours", "ours", args.micro_batch, "fp32")]
    if not args.skip_bf16:
        variants += [("ours-bf16", "ours", args.micro_batch, "bf16"),
                     ("post-bf16", "post", 16, "bf16")]
    for name, variant, micro, precision in variants:
        started = time.time()
        out = subprocess.run([sys.executable, "-m", "tools.bench_ppo", "--worker", variant,
                              "--iterations", str(args.iterations), "--micro-batch", str(micro),
                              "--reward-model", args.reward_model, "--precision", precision],
                             capture_output=True, text=True, cwd=ROOT)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not line:
            sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
        results[name] = json.loads(line[0][len("RESULT "):])
        print(f"{name}: done in {time.time() - started:.0f} s")

    def median(variant, key):
        rows = results[variant]["rows"][1:] or results[variant]["rows"]
        return statistics.median(r[key] for r in rows)

    names = list(results)
    print(f"\nblog preset, {args.iterations} iterations each (first dropped), ours with "
          f"micro-batch {args.micro_batch}; seconds are medians; ratios against post")
    print(f"{'':>18}" + "".join(f"{n:>11}" for n in names)
          + "".join(f"{n + '/post':>16}" for n in names[1:]))
    for key in [f"seconds_{p}" for p in PHASES] + ["seconds"]:
        values = [median(n, key) for n in names]
        print(f"{key:>18}" + "".join(f"{v:>11.1f}" for v in values)
              + "".join(f"{v / values[0]:>15.2f}x" for v in values[1:]))
    values = [results[n]["peak_gb"] for n in names]
    print(f"{'peak memory (GB)':>18}" + "".join(f"{v:>11.2f}" for v in values)
          + "".join(f"{v / values[0]:>15.2f}x" for v in values[1:]))
    if "post-bf16" in results:                      # how much of it is the precision alone
        a, b = median("post-bf16", "seconds"), median("ours-bf16", "seconds")
        print(f"ours-bf16 / post-bf16: {b / a:.2f}x per iteration ({b:.1f} s / {a:.1f} s)")
    Path("runs").mkdir(exist_ok=True)
    Path("runs/bench_ppo.json").write_text(json.dumps(results, indent=1))
    print("per-iteration rows in runs/bench_ppo.json")


if __name__ == "__main__":
    main()
