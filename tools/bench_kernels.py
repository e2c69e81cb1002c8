"""Benchmark: time and peak extra memory of the log-prob gather, forward plus backward.

    python -m tools.bench_kernels                  (all four sizes, 3 rounds; ~7 min on 2 cores)
    python -m tools.bench_kernels --sizes 768x49152 --rounds 1                    (a quick look)

Each row of the table is one path at one size, forward and backward with a random upstream
gradient dL/dlogp (what PPO's loss sends back):

    naive         the post's `torch.log_softmax(logits, -1).gather(-1, a[..., None]).squeeze(-1)`
                  with autograd; input: logits (rows, V)
    fallback      ppo_kernels.gather_log_probs on the PyTorch backend; same input
    triton        ppo_kernels.gather_log_probs on the Triton backend (CUDA only); same input
    naive-linear  the post's path from the last hidden state: logits = hidden @ W^T, then the
                  expression above; input: hidden (rows, 576) and a frozen W (V, 576), SmolLM2's
                  width; the gradient goes to hidden
    fused-linear  ppo_kernels.gather_log_probs_from_hidden; same input as naive-linear (W frozen, as
                  ppo.py's lm_head is: route 1 of ppo_kernels/fused_linear.py)
    compiled, compiled-linear    torch.compile of naive and of naive-linear (CUDA only: what a
                  reader would try first; compiled in the warm-up, outside the clock)
    liger, liger-linear          Liger-Kernel's cross-entropy and fused linear cross-entropy with
                  reduction="none", negated (per token, -log p at the target): today's best
                  open Triton kernels for these ops (CUDA, when liger_kernel is importable;
                  left out with a line if they fail)

fallback, triton and compiled are compared with naive, fused-linear and compiled-linear with
naive-linear, in the same run. --json FILE also writes the table's numbers.

Method.
    Time: each measurement runs in its own fresh process, which first warms the path up on 2 rows
    and then times one full-size forward+backward. The processes of all paths are interleaved,
    round after round (--rounds), and the table shows the median over rounds, so a neighbour's
    load falls on every path alike. On CUDA the warm-up is at full size (Triton compiles then),
    each process times 5 runs between torch.cuda.synchronize() calls and keeps the median.
    Peak extra memory: the highest memory in use during the runs minus what was in use once the
    inputs were allocated, so the inputs themselves do not count and the gradient that is
    returned does. On CUDA: torch.cuda.max_memory_allocated() minus memory_allocated(). On the
    CPU, where PyTorch keeps no such counter: the process's peak resident set (getrusage
    ru_maxrss) minus its resident set after the inputs were written. PyTorch takes CPU tensors
    from malloc, which maps large blocks fresh and unmaps them when they are freed, so the
    resident set follows the live tensors; a fresh process per measurement keeps one path's
    peak out of another's.
    Bandwidth (CUDA, triton only): bytes the two kernels must move (forward reads the logits;
    backward reads them again and writes their gradient: 3 rows V s bytes, s bytes per logit)
    divided by the time, as a fraction of what a plain device-to-device copy reaches on the same
    GPU, our stand-in for the achievable peak.
"""
import argparse
import functools
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent        # the repository root

import ppo_kernels  # noqa: E402

HIDDEN = 576                            # SmolLM2-135M's hidden width
COMPARATOR = {"naive": "naive", "fallback": "naive", "triton": "naive", "compiled": "naive",
              "liger": "naive", "naive-linear": "naive-linear", "fused-linear": "naive-linear",
              "compiled-linear": "naive-linear", "liger-linear": "naive-linear"}
OPTIONAL = ("liger", "liger-linear")           # another project's API: a failure leaves them out
# The targets at 16 x 304 rows x 49,152: (peak extra memory, time), both vs comparator.
TARGETS = {"fallback": (0.5, 1.0), "fused-linear": (0.2, 1.3)}


# ---------------------------------------------------------------------------------------------
# The paths. Each takes its inputs and returns logp (rows,) with a graph to backpropagate.
# ---------------------------------------------------------------------------------------------
def naive(logits, actions):
    return torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def naive_linear(hidden, weight, actions):
    logits = hidden @ weight.T          # (rows, V): what `out.logits` holds in the post
    return torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


@functools.cache
def compiled(fn):
    return torch.compile(fn)


def make_inputs(path, rows, V, device, dtype):
    """Leaf inputs for one path; the tensor that receives the gradient requires grad."""
    gen = torch.Generator(device=device).manual_seed(0)
    actions = torch.randint(0, V, (rows,), device=device, generator=gen)
    if path.endswith("linear"):
        hidden = torch.randn(rows, HIDDEN, device=device, dtype=dtype, generator=gen)
        weight = torch.randn(V, HIDDEN, device=device, dtype=dtype, generator=gen).mul_(0.05)
        return (hidden.requires_grad_(), weight, actions)
    # in place: a temporary copy would raise the high-water mark before the baseline is taken
    logits = torch.randn(rows, V, device=device, dtype=dtype, generator=gen).mul_(3)
    return (logits.requires_grad_(), actions)


def run_path(path, inputs):
    """One forward + backward."""
    if path == "naive":
        logp = naive(*inputs)
    elif path == "naive-linear":
        logp = naive_linear(*inputs)
    elif path == "fused-linear":
        logp = ppo_kernels.gather_log_probs_from_hidden(*inputs)
    elif path == "compiled":
        logp = compiled(naive)(*inputs)
    elif path == "compiled-linear":
        logp = compiled(naive_linear)(*inputs)
    elif path == "liger":
        from liger_kernel.transformers.functional import liger_cross_entropy
        logp = -liger_cross_entropy(*inputs, reduction="none")
    elif path == "liger-linear":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        hidden, weight, actions = inputs
        logp = -liger_fused_linear_cross_entropy(hidden, weight, actions, reduction="none")
    else:
        ppo_kernels.set_backend("torch" if path == "fallback" else "triton")
        logp = ppo_kernels.gather_log_probs(*inputs)
    upstream = torch.randn(logp.shape, device=logp.device)
    logp.backward(upstream)
    inputs[0].grad = None


# ---------------------------------------------------------------------------------------------
# The worker: one path, one size, in a fresh process. Prints one JSON line.
# ---------------------------------------------------------------------------------------------
def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(path, rows, V, device, dtype):
    cuda = device == "cuda"
    # Warm up on 2 rows on the CPU; on CUDA at full size, so that Triton compiles (it specialises
    # on argument values) before the clock starts.
    run_path(path, make_inputs(path, rows if cuda else 2, V, device, dtype))
    inputs = make_inputs(path, rows, V, device, dtype)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = resident_bytes()
    times = []
    for _ in range(5 if cuda else 1):                         # a GPU run is ms: take a median
        start = time.perf_counter()
        run_path(path, inputs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # kB on Linux
    result = {"seconds": seconds, "extra_bytes": max(0, peak - baseline)}
    if cuda and path == "triton":
        x = inputs[0].detach()
        y = torch.empty_like(x)
        y.copy_(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        torch.cuda.synchronize()
        copy_bps = 5 * 2 * x.numel() * x.element_size() / (time.perf_counter() - start)
        moved = 3 * x.numel() * x.element_size()               # fwd read, bwd read + write
        result.update(bytes_per_s=moved / seconds, copy_bytes_per_s=copy_bps)
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The driver: interleaved rounds of workers, then the table.
# ---------------------------------------------------------------------------------------------
def available_bytes():
    with open("/proc/meminfo") as f:
        info = dict(line.split(":") for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


class TooSlow(Exception):
    """A path that ran past --path-timeout: a row that says so, and no more rounds of it."""


def measure(path, rows, V, device, dtype, timeout):
    cmd = [sys.executable, "-m", "tools.bench_kernels", "--worker", path, str(rows), str(V),
           device, dtype]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as error:
        raise TooSlow(f"over {timeout:g} s, skipped") from error
    if out.returncode != 0:
        raise RuntimeError(f"{path} at {rows}x{V} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_size(rows, V, paths, device, dtype, rounds, timeout=1200):
    """Median time and max peak over rounds, per path; {"skipped": why} for a path that ran
    past `timeout` seconds (torch.compile at a large size can take minutes: a row, not the
    end of the table)."""
    logits_bytes = rows * V * torch.finfo(getattr(torch, dtype)).bits // 8
    # The post's path holds the logits plus about three more (rows, V) fp32 tensors at its peak.
    if device == "cpu" and logits_bytes + 3 * rows * V * 4 > 0.9 * available_bytes():
        print(f"  skipping {rows}x{V}: needs ~{(logits_bytes + 12 * rows * V) / 2**30:.1f} GiB, "
              f"{available_bytes() / 2**30:.1f} GiB available", flush=True)
        return {}
    runs, skipped = {p: [] for p in paths}, {}
    for r in range(rounds):
        for p in list(runs):
            try:
                runs[p].append(measure(p, rows, V, device, dtype, timeout))
            except TooSlow as why:
                print(f"  {p} at {rows}x{V}: {why}", flush=True)
                skipped[p] = {"skipped": str(why)}
                del runs[p]
                continue
            except RuntimeError as error:
                if p not in OPTIONAL:
                    raise
                print(f"  {p} failed, left out: {str(error).splitlines()[-1]}", flush=True)
                del runs[p]
                continue
            print(f"  round {r + 1}/{rounds} {rows}x{V} {p}: {runs[p][-1]['seconds']:.2f} s",
                  flush=True)
    return {p: {"seconds": statistics.median(x["seconds"] for x in rs),
                "extra_bytes": max(x["extra_bytes"] for x in rs),
                **({k: statistics.median(x[k] for x in rs) for k in ("bytes_per_s",
                                                                    "copy_bytes_per_s")}
                   if "bytes_per_s" in rs[0] else {})}
            for p, rs in runs.items()} | skipped


def label(rows):
    return f"16x{rows // 16}" if rows % 16 == 0 else str(rows)


def print_table(results):
    head = (f"{'rows x V':>14} | {'path':<12} | {'vs':<12} | {'time s':>7} | {'time x':>6} | "
            f"{'peak extra MB':>13} | {'memory x':>8} | bandwidth")
    print(head)
    print("-" * len(head))
    for (rows, V), res in results.items():
        for path, r in res.items():
            base = res.get(COMPARATOR[path], {})
            if "skipped" in r or "skipped" in base:
                print(f"{label(rows) + f' x {V}':>14} | {path:<12} | {COMPARATOR[path]:<12} | "
                      f"{r.get('skipped') or 'its comparator: ' + base['skipped']}")
                continue
            bandwidth = ""
            if "bytes_per_s" in r:
                bandwidth = (f"{r['bytes_per_s'] / 1e9:.0f} GB/s = "
                             f"{r['bytes_per_s'] / r['copy_bytes_per_s']:.0%} of copy")
            print(f"{label(rows) + f' x {V}':>14} | {path:<12} | {COMPARATOR[path]:<12} | "
                  f"{r['seconds']:7.3f} | {r['seconds'] / base['seconds']:6.2f} | "
                  f"{r['extra_bytes'] / 2**20:13.0f} | "
                  f"{r['extra_bytes'] / max(base['extra_bytes'], 1):8.2f} | {bandwidth}")


def check_targets(results):
    res = results.get((16 * 304, 49152))
    if not res:
        return
    print("\nDone-when targets at 16x304 x 49152 (peak extra memory and time, vs comparator):")
    for path, (mem_target, time_target) in TARGETS.items():
        r, base = res[path], res[COMPARATOR[path]]
        if "skipped" in r or "skipped" in base:
            print(f"  {path:<12} not measured: {r.get('skipped') or base['skipped']}")
            continue
        mem, t = r["extra_bytes"] / base["extra_bytes"], r["seconds"] / base["seconds"]
        ok = mem <= mem_target and t <= time_target
        print(f"  {path:<12} memory {mem:.2f}x (target <= {mem_target}x), time {t:.2f}x "
              f"(target <= {time_target}x): {'met' if ok else 'NOT met'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["768x49152", "4864x49152", "768x151936",
                                                       "4864x151936"],
                        help="rows x V; 768 = 16 x 48 (the post's MAX_NEW_TOKENS), 4864 = 16 x 304")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats per path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda adds the triton path and its bandwidth")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of logits, hidden states and lm_head")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--path-timeout", type=float, default=1200,
                        help="seconds one path may take at one size (its process: warm-up, "
                             "compile and runs); past it, a row that says so")
    parser.add_argument("--worker", nargs=5, metavar=("PATH", "ROWS", "V", "DEVICE", "DTYPE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        path, rows, V, device, dtype = args.worker
        return worker(path, int(rows), int(V), device, getattr(torch, dtype))

    cuda = args.device == "cuda"
    paths = ["naive", "fallback"] + (["triton", "compiled"] if cuda else [])
    paths += ["naive-linear", "fused-linear"] + (["compiled-linear"] if cuda else [])
    if cuda and importlib.util.find_spec("liger_kernel"):
        paths += ["liger", "liger-linear"]
    threads = torch.get_num_threads()
    print(f"device {args.device}, {args.dtype}, {threads} CPU threads, {args.rounds} rounds, "
          f"hidden width {HIDDEN}; load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    results = {}
    for size in args.sizes:
        rows, V = (int(n) for n in size.split("x"))
        res = bench_size(rows, V, paths, args.device, args.dtype, args.rounds,
                         args.path_timeout)
        if res:
            results[(rows, V)] = res
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (over {os.cpu_count()} CPUs: a "
          f"neighbour's load slows every path, the fallback's many small ops the most)\n")
    print_table(results)
    check_targets(results)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{rows}x{V}": res for (rows, V), res
                                               in results.items()}, indent=1))


if __name__ == "__main__":
    main()
