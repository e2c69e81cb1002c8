"""What a PPO run leaves behind: results, checkpoints, plots and the post's table.

Kept apart from ppo.py so that the loop reads like the post. Nothing here is RL:
    git_commit            the code's version, recorded in results.json
    run_bytes             about how much a run writes, checked against the free space
    resume_hint           a failed write says where the last checkpoint is
    check_run_folders     before a run: --resume finds its checkpoint and settings, and a
                          new run does not write over an old one
    finished_row, record_failure, load_baseline     what a resumed sweep reads back: runs
                          that are over (or failed), and the reference and human rows
    differences           where two runs' numbers differ, beyond timings and rounding
    save_checkpoint       adapter, value head, AdamW moments and the RNG, as safetensors,
    load_checkpoint       so that `ppo.py --resume` continues a killed run exactly
    peak_memory_gb        CUDA's allocator peak, or the process's peak resident memory
    iteration_row         one iteration's row of results.json (reward, KL, clipfrac, ...)
    print_row, print_gain, print_samples    one run's rows of the post's table (each reward
                          with its standard error, the paired gain over the reference)
    sweep_summary, sweep_markdown, report_sweep     the sweep's table, per beta over seeds
                          (the judge beside what it never saw: support/tables.py)
    sweep_samples         what its samples look like: question-shaped ones, a median one
    side_by_side          the best and the worst beta's summaries of the same posts
    per_run_markdown      every run's gains over the reference, ± SE over posts
    plot_curves, plot_sweep                   curves.png and sweep.png

Used by: ppo.py (tests: tests/test_ppo.py, resume and sweep end to end).
"""

import contextlib
import json
import math
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from support import cli
from support.disk import save_figure, write_aside, write_json, write_text
from support import parallel, tables
from support.measures import median_sample, question_fraction, spearman, standard_error
from gae import ended_with_eos
from lora import AdapterMismatch, load_adapter, save_adapter


# ------------------------------------------------------------------ files, checkpoints

def git_commit():
    """This checkout's commit, '-dirty' when tracked files differ from it; None outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=30)
    try:
        head, status = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain",
                                                                    "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def run_bytes(adapter_numel, hidden, cfg):
    """About the most one run has on disk at once, an overestimate: two checkpoints (a new one
    is complete before the old one goes), each the adapter in fp32 with AdamW's two moments,
    the value head and the RNG; results.json (a row per iteration, the held-out samples);
    samples.html and curves.png. Measured on the tiny preset: 170 kB written, 380 kB here."""
    checkpoint = 4 * 3 * (adapter_numel + hidden + 1) + 2 ** 14
    samples = cfg.eval_prompts * (8 * cfg.max_new_tokens + 4096)     # ids, text, the html
    return 2 * checkpoint + 4096 * cfg.iterations + samples + 2 ** 17


def has_checkpoint(run_dir):
    return (Path(run_dir) / "checkpoint" / "state.json").is_file()


def check_run_folders(plan, config, may_change):
    """`plan` ([(beta, seed, run_dir)]) once every run may start; else a UserError, and
    nothing is touched. With config["resume"], a checkpoint must be there (in one run of a
    sweep at least; the others start) and its run's settings must be `config`'s, bar those
    in `may_change`, unless config["force"]. A new run does not write over one in its
    folder unless config["force"]."""
    resume, force = config["resume"], config["force"]
    resumable = [(beta, seed, d) for beta, seed, d in plan if has_checkpoint(d)]
    if resume and not resumable:
        where = plan[0][2] if len(plan) == 1 else plan[0][2].parent / "*"
        raise cli.UserError(f"--resume: no checkpoint in {where}/checkpoint, so nothing to "
                            "resume; check --out, or leave out --resume to start")
    for _, _, run_dir in plan:
        if not (resume or force) and (run_dir / "results.json").exists():
            raise cli.UserError(f"{run_dir} already holds a run: --resume continues it, "
                                "--force starts it over, or pass another --out")
    for beta, seed, run_dir in resumable if resume and not force else []:
        with cli.reading(run_dir / "results.json", "the results.json of the run to resume"):
            saved = json.loads((run_dir / "results.json").read_text()).get("config", {})
        now = {**config, "beta": beta, "seed": seed}
        differ = [f"{k} {saved[k]!r} there, {v!r} now" for k, v in now.items()
                  if k in saved and k not in may_change and saved[k] != v]
        if differ:
            raise cli.UserError(f"--resume: {run_dir} was run with other settings ("
                                + "; ".join(differ) + "); pass the same flags, or add "
                                "--force to continue anyway")
    return plan


@contextlib.contextmanager
def resume_hint(run_dir):
    """A write that fails inside (cli.WriteError, or a full disk anywhere) ends in one line
    that also says what is left: the last checkpoint, intact, for --resume."""
    try:
        yield
    except (cli.WriteError, OSError) as caught:
        error = caught if isinstance(caught, cli.WriteError) else cli.full_disk(caught)
        if error is None:
            raise
        hint = (f"; the checkpoint after {checkpoint_iteration(run_dir)} iterations in "
                f"{run_dir} is intact: make room and run the same command with --resume"
                if has_checkpoint(run_dir) else "")
        raise cli.WriteError(f"{error}{hint}") from caught


def checkpoint_iteration(run_dir):
    """The iteration a resumed run starts at: 0 without a checkpoint."""
    if not has_checkpoint(run_dir):
        return 0
    with cli.reading(Path(run_dir) / "checkpoint" / "state.json", "a ppo.py checkpoint"):
        return json.loads((Path(run_dir) / "checkpoint" / "state.json").read_text())[
            "iteration"] + 1


def read_results(run_dir):
    """A run's results.json, or None when there is none yet."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        return None
    with cli.reading(path, "the results.json that ppo.py writes"):
        return json.loads(path.read_text())


# What two runs of the same code may differ in by nature: time (every "seconds*" key),
# memory, threads, folders, whether it was resumed, and the commits of the code.
CIRCUMSTANCES = {"peak_memory_gb", "threads", "run_dir", "commits", "out", "resume", "force"}


def differences(a, b, rel=1e-6, where=""):
    """Where two results (JSON values) disagree, as ["where: a != b"], CIRCUMSTANCES aside.

    Texts, counts and flags must be equal; floats equal to `rel` (relative, or absolute
    near 0). One CPU gives the same bits on every rerun, but fp32 sums are ordered by the
    CPU's kernels, and on some (AVX-512 MKL) by the alignment of a buffer, so a resumed
    process may round the last bit differently. A real resume bug (a lost RNG state, a
    reset AdamW moment) moves the numbers by far more than 1e-6."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = [k for k in {**a, **b} if k not in CIRCUMSTANCES and not k.startswith("seconds")]
        return [d for k in keys for d in differences(a.get(k), b.get(k), rel, f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b))
                for d in differences(x, y, rel, f"{where}[{i}]")]
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    if numbers and (math.isclose(a, b, rel_tol=rel, abs_tol=rel) or a == b
                    or math.isnan(a) and math.isnan(b)):       # NaN: the same "no value"
        return []
    return [] if a == b else [f"{where or '.'}: {a!r} != {b!r}"]


def finished_row(run_dir, iterations):
    """The sweep-table row of the run in `run_dir` if it is over (all `iterations` trained
    and evaluated, or failed), else None. The per-post rows stay in results.json."""
    results = read_results(run_dir) or {}
    config = results.get("config", {})
    row = {"beta": config.get("beta"), "seed": config.get("seed"), "run_dir": str(run_dir)}
    if results.get("failed"):
        return {**row, "failed": results["failed"]}
    if not results.get("final") or len(results["iterations"]) < iterations:
        return None
    return {**row, **{k: v for k, v in results["final"].items() if not k.endswith("samples")}}


def record_failure(run_dir, config, error):
    """Mark the run in `run_dir` as failed in its results.json (the iterations before the
    failure stay): the sweep table shows it as a row, and --resume does not rerun it."""
    results = read_results(run_dir) or {"config": config, "iterations": [], "final": None}
    write_json(Path(run_dir) / "results.json", {**results, "failed": str(error)})


def load_baseline(path, key):
    """The reference and human rows an earlier start of this sweep stored in `path`, when
    they were made with the settings `key`; else None (they are sampled again)."""
    if not Path(path).is_file():
        return None
    with cli.reading(path, "the baseline.json that ppo.py writes"):
        stored = json.loads(Path(path).read_text())
    return stored if stored.get("key") == key else None


def save_checkpoint(run_dir, iteration, policy, value_head, optimizer, controller_beta,
                    one_action=None):
    """Adapter, value head (if any), optimizer moments, RNG state and, with --estimator
    reinforce, `one_action`'s moving-average baseline (ppo.OneActionAdvantages), as
    safetensors + JSON. Under torchrun every rank calls it and rank 0 writes, with every
    rank's RNG state ("rng.torch" for rank 0, "rng.torch.1" for rank 1, ...)."""
    rng = parallel.rng_states(model_device(policy))   # a collective: before rank 0 goes its way
    if not parallel.is_main():
        return
    tensors, scalars = {}, {}
    for i, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.ndim > 0:
                tensors[f"{i}.{key}"] = value.contiguous()
            else:
                scalars[f"{i}.{key}"] = float(value)
    for rank, states in enumerate(rng):                 # "rng.torch", "rng.cuda.1", ...
        for kind, state in states.items():
            tensors[f"rng.{kind}" + (f".{rank}" if rank else "")] = state

    def make(staging):                          # a stop half-way leaves the old checkpoint
        save_adapter(policy, staging / "adapter.safetensors")
        if value_head is not None:
            save_file(value_head.state_dict(), str(staging / "value_head.safetensors"))
        save_file(tensors, str(staging / "optimizer_rng.safetensors"))
        write_json(staging / "state.json", {"iteration": iteration, "beta": controller_beta,
                                            "reinforce_baseline": getattr(
                                                one_action, "baseline", None),
                                            "optimizer_scalars": scalars})
    with cli.writing(Path(run_dir) / "checkpoint"):
        write_aside(Path(run_dir) / "checkpoint", make)


def model_device(model):
    """The device a model is on: whose RNG state a checkpoint keeps beside the CPU's."""
    return next(model.parameters()).device


def load_checkpoint(run_dir, policy, value_head, optimizer):
    """Restore what `save_checkpoint` wrote, with this rank's RNG state; returns (next
    iteration, beta, the REINFORCE baseline or None)."""
    folder = Path(run_dir) / "checkpoint"
    expected = "a checkpoint written by ppo.py with this preset (delete it to start over)"
    with cli.reading(folder / "state.json", expected):
        state = json.loads((folder / "state.json").read_text())
    with cli.reading(folder / "adapter.safetensors", expected, AdapterMismatch):
        load_adapter(policy, folder / "adapter.safetensors")
    if value_head is not None:
        with cli.reading(folder / "value_head.safetensors", expected):
            value_head.load_state_dict(load_file(str(folder / "value_head.safetensors")))
    with cli.reading(folder / "optimizer_rng.safetensors", expected):
        tensors = load_file(str(folder / "optimizer_rng.safetensors"))
    saved = optimizer.state_dict()
    groups = saved["param_groups"]
    restored = {}
    for name, value in list(tensors.items()) + list(state["optimizer_scalars"].items()):
        if name.startswith("rng."):
            continue
        index, key = name.split(".", 1)
        restored.setdefault(int(index), {})[key] = (value if torch.is_tensor(value)
                                                    else torch.tensor(value))
    optimizer.load_state_dict({"state": restored, "param_groups": groups})
    suffix = f".{parallel.rank()}" if parallel.rank() else ""
    if f"rng.torch{suffix}" not in tensors:
        raise cli.UserError(f"--resume: the checkpoint in {folder} was written by fewer "
                            f"processes than this run's {parallel.size()}; resume it with "
                            "as many as it had")
    states = {kind: tensors[f"rng.{kind}{suffix}"] for kind in ("torch", "cuda", "mps")
              if f"rng.{kind}{suffix}" in tensors}
    device = model_device(policy)
    if device.type != "cpu" and device.type not in states:
        print(f"note: the checkpoint in {folder} has no {device.type.upper()} RNG state (written "
              "on another device or by an older version): the run continues, but not as an "
              "uninterrupted one")
    parallel.set_rng_states(states, device)
    return state["iteration"] + 1, state["beta"], state.get("reinforce_baseline")


def peak_memory_gb(device):
    """Peak memory: CUDA's allocator peak, else the process's peak resident memory (Linux
    reports it in KiB, taken as GB / 1e6 here; macOS in bytes). On MPS the GPU shares that
    memory, and torch.mps keeps no peak: the resident peak is what there is."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1e9 if sys.platform == "darwin" else 1e6)


# ------------------------------------------------------------------ tables and plots

def iteration_row(iteration, *, rewards, per_token, kl, values, ret, mask, actions, eos, logs,
                  ratios, beta):
    """One row of results.json: what the post and the concept lesson say to watch, from the
    whole batch's tensors (every rank's, under torchrun): rewards (B,) the reward model's
    scores; per_token (the shaped r_t), kl, values, ret, mask and actions (B, T), ret None
    without a value head; the inner steps' logs; `ratios`, the ratio's range at the first
    inner step (1 to 1) and after the last (ratio_after_min, ratio_after_max); beta now."""
    ratio_min, ratio_max, after_min, after_max = ratios
    m = mask.bool()
    per_seq_kl = torch.where(m, kl, 0.0).sum(-1)                 # (B,) summed over tokens
    non_score = torch.where(m, per_token, 0.0).sum(-1) - rewards  # (B,) the -beta KL part
    explained = None                                             # no value head
    if ret is not None:
        residual = (ret - values)[m]                             # (N,) real tokens
        explained = (1 - residual.var(correction=0)
                     / ret[m].var(correction=0).clamp(min=1e-12)).item()

    def avg(key):                                               # over the inner steps
        return sum(log[key] for log in logs) / len(logs)

    return {"iteration": iteration, "responses": len(rewards), "reward": rewards.mean().item(),
            "non_score_reward": non_score.mean().item(), "kl": per_seq_kl.mean().item(),
            "response_length": m.sum(-1).float().mean().item(),
            "new_tokens": actions.shape[1],                     # T: the decoding steps
            "eos_fraction": ended_with_eos(actions, m, eos).float().mean().item(),
            "entropy": avg("entropy"), "clipfrac": avg("clipfrac"),
            "approx_kl": avg("approx_kl"), "value_loss": avg("value_loss"),
            "policy_loss": avg("policy_loss"), "ptx_loss": avg("ptx_loss"),
            "explained_variance": explained,
            "ratio_min": ratio_min, "ratio_max": ratio_max, "ratio_after_min": after_min,
            "ratio_after_max": after_max, "beta": beta}


def print_samples(samples, posts, title, n=3):
    print(f"\n{title}")
    for s, p in list(zip(samples, posts))[:n]:
        print(f"  [{s['reward']:+.2f}, KL {s['kl']:.1f}, {s['length']} tokens] {s['text'][:140]!r}")
        print(f"      human: {p['summary'][:120]!r}")


def print_row_header():
    print(f"\n{'KL':>6} {'reward ± SE':>15} {'fluency':>9} {'KL(ref)':>8} {'length':>7} "
          f"{'EOS':>5} {'copied':>7} {'distinct-2':>10}")


def print_row(name, r):
    """One row of the table; a row with a reward only (human TL;DRs) stops after it.
    EOS: the fraction of samples that ended; copied: of their bigrams, those in the post."""
    line = f"{name:>6} {r['reward']:>7.2f} ± {r['reward_se']:<5.2f}"
    if "fluency" in r:
        line += (f" {r['fluency']:>9.1f} {r['kl']:>8.2f} {r['length']:>7.1f} "
                 f"{r['eos_fraction']:>5.2f} {r['copied_bigrams']:>7.2f} {r['distinct_2']:>10.3f}")
    print(line.rstrip())


def print_gain(r):
    """The paired gain over the reference: mean of r_policy,i - r_ref,i, its SE, in SEs;
    then the same for the measures the judge never saw, when the run has them."""
    gain, se = r["gain_over_ref"], r["gain_over_ref_se"]
    z = f"{gain / se:.1f} SE" if se > 0 else "SE n/a"            # NaN below two posts
    print(f"gain over (ref): {gain:+.2f} ± {se:.2f} ({z}, paired over {len(r['samples'])} posts)")
    if "retrieval_mrr" not in r:
        return
    ref, human = r["ref"], r["human"]
    print(f"outside the judge, policy (ref; human): ROUGE-L vs the human TL;DR "
          f"{r['rouge_l']:.3f} ({ref['rouge_l']:.3f}), gain {r['rouge_l_gain_over_ref']:+.3f} ± "
          f"{r['rouge_l_gain_over_ref_se']:.3f}; own post retrieved, MRR "
          f"{r['retrieval_mrr']:.3f} ({ref['retrieval_mrr']:.3f}; {human['retrieval_mrr']:.3f}), "
          f"gain {r['retrieval_mrr_gain_over_ref']:+.3f} ± "
          f"{r['retrieval_mrr_gain_over_ref_se']:.3f}"
          f"; judge's relevance gap {r['relevance_gap']:+.2f} ({ref['relevance_gap']:+.2f}; "
          f"{human['relevance_gap']:+.2f}); ends in ? {r['question_fraction']:.2f} "
          f"({ref['question_fraction']:.2f}; {human['question_fraction']:.2f})")


def fluency_per_token(row):
    """A row's fluency (a summary's total log-probability under the reference, a mean over
    posts) over its mean length: the nats a token, which a short sample cannot win."""
    return row["fluency"] / row["length"] if row["length"] else math.nan


def sweep_summary(table, baseline):
    """Per beta, over its finished seeds: the mean final reward with its standard error
    across seeds, the worst and best, the mean gain over the reference, fluency worst to
    best and per token (each run's fluency over its length: a total favours short samples),
    and the means of KL, length, distinct-2, EOS, copied and the value loss (each run's
    mean over its last 20 iterations). Over every run: Spearman's rho of beta with
    the final KL, and how far the best beta's mean reward went from the reference to the
    human TL;DRs (0 = the reference, 1 = people)."""
    betas = {}
    for beta in sorted({r["beta"] for r in table}):
        runs = [r for r in table if r["beta"] == beta]
        mean = lambda key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
        rewards = sorted(r["reward"] for r in runs)
        betas[beta] = {"runs": len(runs), "reward": mean("reward"),
                       "reward_se_seeds": standard_error(rewards),
                       "reward_worst": rewards[0], "reward_best": rewards[-1],
                       "gain_over_ref": mean("gain_over_ref"),
                       "fluency_worst": min(r["fluency"] for r in runs),
                       "fluency_best": max(r["fluency"] for r in runs),
                       "fluency_per_token": sum(map(fluency_per_token, runs)) / len(runs),
                       **{k: mean(k) for k in ("fluency", "kl", "length", "distinct_2",
                                               "eos_fraction", "copied_bigrams",
                                               "value_loss_last20")}}
    best = max(betas, key=lambda b: betas[b]["reward"]) if betas else None
    ref, human = baseline["ref"]["reward"], baseline["human"]["reward"]
    return {"by_beta": betas, "best_beta": best,
            "best_fraction_of_ref_to_human": (betas[best]["reward"] - ref) / (human - ref)
            if best is not None and human != ref else math.nan,
            "spearman_beta_kl": spearman([r["beta"] for r in table], [r["kl"] for r in table])
            if len(table) > 1 else math.nan}


def sweep_markdown(table, base, failed):
    """The post's table as Markdown (printed, and saved as sweep.md for docs/sweep.md): per
    beta the judge's reward beside what it never saw (support/tables.py), where each peaks,
    then the rest of each beta's numbers. `table`: the finished runs' rows with their words
    (tables.with_words), `base`: baseline.json, `failed`: the failed runs' rows."""
    betas = sorted({r["beta"] for r in table} | {r["beta"] for r in failed})
    groups = [(f"{b:g}", [r for r in table if r["beta"] == b]) for b in betas]
    lines = [tables.markdown("beta", groups, base)]
    lines += [f"\nbeta={r['beta']:g} seed {r['seed']}: failed: {r['failed']}" for r in failed]
    if not table:
        return "\n".join(lines + ["\nNo run finished."])
    peak = tables.peaks(groups)
    if peak:
        lines.append("\nMeans over seeds peak at: " + "; ".join(
            f"{measure}, beta = {name}" for measure, name in peak.items()) + ".")
    lines.append("\n" + more_markdown(groups, sweep_summary(table, base["baseline"])))
    lines.append("\nEvery run (± SE over the posts):\n\n" + per_run_markdown(table))
    return "\n".join(lines)


def more_markdown(groups, summary):
    """The rest of each beta: its runs above the reference (SFT) by more than 2 SE (paired
    over posts) on the judge, MRR, ROUGE-L and all three (tables.beside_sft); fluency, worst
    to best and per token; length in tokens, distinct-2, the judge's relevance gap, the share ending in "?"
    and the value loss (means over seeds); then Spearman's rho of beta and KL."""
    lines = ["| beta | above (ref) by 2 SE: judge | MRR | ROUGE-L | all three "
             "| fluency, worst to best (per token) | length (tokens) | distinct-2 "
             "| relevance gap | ends in ? | value loss |", "|" + " --- |" * 11]
    for name, runs in groups:
        if not runs:
            continue
        b, n = summary["by_beta"][runs[0]["beta"]], len(runs)
        above = tables.beside_sft(runs)
        mean = lambda key: (sum(r[key] for r in runs) / n if all(key in r for r in runs)  # noqa: E731
                            else math.nan)
        lines.append(f"| {name} | " + " | ".join(f"{c} of {n}" for c in above.values())
                     + f" | {b['fluency_worst']:.1f} to {b['fluency_best']:.1f} "
                     f"({b['fluency_per_token']:.2f}) | {b['length']:.1f} "
                     f"| {b['distinct_2']:.3f} | {mean('relevance_gap'):+.2f} "
                     f"| {mean('question_fraction'):.0%} | {b['value_loss_last20']:.3f} |")
    n = sum(len(runs) for _, runs in groups)
    rho = summary["spearman_beta_kl"]
    lines.append(f"\nSpearman's rho of beta and the final KL over {n} runs: "
                 + ("n/a (one beta)" if math.isnan(rho) else f"{rho:+.2f}") + ".")
    return "\n".join(lines)


def per_run_markdown(table):
    """Every finished run: the judge's reward, and its gains over the reference on the judge,
    MRR and ROUGE-L, each ± its SE over the posts (paired), with KL and words."""
    lines = ["| beta | seed | judge's reward | judge's gain over (ref) | MRR gain | ROUGE-L gain "
             "| KL | words |", "|" + " --- |" * 8]
    for r in sorted(table, key=lambda r: (r["beta"], r["seed"])):
        gain = lambda key, d: (f"{r[key]:+.{d}f} ± {r[key + '_se']:.{d}f}"  # noqa: E731
                               if key in r else "—")
        lines.append(f"| {r['beta']:g} | {r['seed']} | {r['reward']:.2f} ± {r['reward_se']:.2f} "
                     f"| {gain('gain_over_ref', 2)} | {gain('retrieval_mrr_gain_over_ref', 3)} "
                     f"| {gain('rouge_l_gain_over_ref', 3)} | {r['kl']:.2f} "
                     f"| {r['words']:.0f} |")
    return "\n".join(lines)


def sweep_samples(table, results, posts):
    """What the samples look like, per beta over its seeds: the share that end in "?" (each
    seed's in brackets) and the median-reward sample of all seeds together, beside its
    post's human TL;DR; the reference and people last. `results` maps each run's folder to
    its results.json, `posts` is baseline.json's baseline_posts."""
    def quote(text, n=150):
        text = " ".join(text.split()).replace("|", "/")
        return repr(text if len(text) <= n else text[:n] + "...")
    def asked(samples):
        return f"{question_fraction([s['text'] for s in samples]):.2f}"
    human = posts["human_samples"]
    lines = ['| beta | ends in "?" (per seed) | the median-reward sample (reward) '
             "| its post's human TL;DR |", "|" + " --- |" * 4]
    for beta in sorted({r["beta"] for r in table}):
        runs = [results[r["run_dir"]]["final"]["samples"] for r in table if r["beta"] == beta]
        every = [s for samples in runs for s in samples]
        median = median_sample(every)
        lines.append(f"| {beta:g} | {asked(every)} ({', '.join(asked(x) for x in runs)}) "
                     f"| {quote(median['text'])} ({median['reward']:+.2f}) "
                     f"| {quote(human[median['post']]['text'])} |")
    for name, samples in (("(ref)", posts["ref_samples"]), ("human", human)):
        median = median_sample(samples)
        lines.append(f"| {name} | {asked(samples)} | {quote(median['text'])} "
                     f"({median['reward']:+.2f}) | |")
    return "\n".join(lines)


def side_by_side(table, results, posts, n=3):
    """The summaries of the beta with the highest mean judge's reward and of the one with
    the lowest, side by side on the first `n` held-out posts (not chosen: the same posts
    for every sweep), from each beta's lowest seed, beside SFT's and people's."""
    def quote(sample, n=200):
        text = " ".join(sample["text"].split()).replace("|", "/")
        return repr(text if len(text) <= n else text[:n] + "...") + f" ({sample['reward']:+.2f})"
    means = {b: sum(r["reward"] for r in table if r["beta"] == b)
             / sum(r["beta"] == b for r in table) for b in {r["beta"] for r in table}}
    best, worst = max(means, key=means.get), min(means, key=means.get)
    first = {b: min((r for r in table if r["beta"] == b), key=lambda r: r["seed"])
             for b in (best, worst)}
    by_post = lambda rows: {s["post"]: s for s in rows}  # noqa: E731
    samples = {b: by_post(results[first[b]["run_dir"]]["final"]["samples"]) for b in first}
    ref, human = by_post(posts["ref_samples"]), by_post(posts["human_samples"])
    lines = [f"| post | beta {best:g}, seed {first[best]['seed']} (highest judge's reward) "
             f"| beta {worst:g}, seed {first[worst]['seed']} (lowest) | the reference "
             "| people |", "|" + " --- |" * 5]
    for i in sorted(ref)[:n]:
        lines.append(f"| {i} | {quote(samples[best][i])} | {quote(samples[worst][i])} "
                     f"| {quote(ref[i])} | {quote(human[i])} |")
    return "\n".join(lines)


def report_sweep(rows, base, out):
    """The post's table from every run's row (report.finished_row): printed, and written as
    sweep.md, sweep.json and sweep.png. A failed run is a row of its own. The table ends
    with the git commits of the code that ran it (issue 13: the README must say which), and
    sweep.md with what the samples look like (sweep_samples). `base`: baseline.json."""
    failed = [r for r in rows if r and r.get("failed")]
    results = {r["run_dir"]: read_results(r["run_dir"]) or {} for r in rows if r}
    table = [tables.with_words(r, results[r["run_dir"]]) for r in rows
             if r and not r.get("failed")]
    summary = sweep_summary(table, base["baseline"])
    # The code that made the table: every commit that wrote iterations of any run of it
    commits = sorted({c for r in results.values() for c in r.get("commits") or [] if c})
    text = (sweep_markdown(table, base, failed) + "\n\nCode: "
            + (", ".join(commits) or "unknown") + " (git commits, from the runs' results.json)")
    if table:
        text += "\n\n" + sweep_samples(table, results, base["baseline_posts"])
    if len({r["beta"] for r in table}) > 1:         # a best and a worst beta to set side by side
        text += "\n\n" + side_by_side(table, results, base["baseline_posts"])
    print("\n" + text)
    if len(table) + len(failed) < len(rows):
        print(f"{len(rows) - len(table) - len(failed)} runs have not finished")
    write_json(out / "sweep.json", {"runs": table + failed, "baseline": base["baseline"],
                                    "summary": summary, "commits": commits})
    write_text(out / "sweep.md", text + "\n")
    plot_sweep(table, base["baseline"], out / "sweep.png")
    print(f"sweep in {out}/sweep.json, {out}/sweep.md and {out}/sweep.png")


def plot_curves(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = results["iterations"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    for ax, key in zip(axes, ("reward", "kl", "response_length", "entropy")):
        ax.plot([r["iteration"] for r in rows], [r[key] for r in rows])
        ax.set_title(key)
        ax.set_xlabel("iteration")
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


# The y-axis of each of plot_sweep's panels, by tables.MEASURES' name
AXES = {"judge's reward": "judge's reward (held out)",
        "MRR": "MRR: 1 / rank of its own post (TF-IDF)",
        "ROUGE-L": "ROUGE-L F1 against people's TL;DR"}


def plot_sweep(table, baseline, path, group="beta", objective_beta=None, point="run",
               bars="bars: ± 1 SE over the held-out posts (judge: of the run's reward; MRR "
                    "and ROUGE-L: of its gain over the reference, paired by post)"):
    """Where the judge and the summaries part: the judge's reward, MRR and ROUGE-L against
    KL, one point per row of `table` (a run, or a group's means: `point` names it), a colour
    per value of `group` ("beta", or compare_estimators' "setting"), error bars on every
    panel (the rows' reward_se and gain SEs; `bars` says what they are, under the panels).
    The reference (SFT) is a hollow star at KL 0, so points under it show; the OpenAI 1.3B
    and people rows are lines (people have no ROUGE-L). Where the KLs span more than 20x,
    KL is on a symlog axis (linear below 1 nat), so runs that stay near the reference are
    not piled on it. With
    `objective_beta`, the judge's panel has dashed lines of equal reward - beta KL."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    values = (sorted({r["beta"] for r in table}) if group == "beta"
              else list(dict.fromkeys(r[group] for r in table)))        # the table's order
    kl = [r["kl"] for r in table] + [1]
    spread = max(kl) > 20 * min(k for k in kl if k > 0)     # runs near 0 and far: symlog
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, (title, (key, gain)) in zip(axes, tables.MEASURES.items()):
        se = "reward_se" if key == "reward" else f"{gain}_se"
        for i, value in enumerate(values):
            runs = [r for r in table if r[group] == value and key in r]
            ax.errorbar([r["kl"] for r in runs], [r[key] for r in runs], fmt="o", ms=5,
                        color=f"C{i}", capsize=3, elinewidth=1, alpha=0.85, zorder=3,
                        label=f"beta {value:g}" if group == "beta" else value,
                        yerr=[r[se] for r in runs] if all(se in r for r in runs) else None)
        if key in baseline["ref"]:
            ax.plot([0], [baseline["ref"][key]], "*", ms=16, mfc="none", mec="k", mew=1.5,
                    zorder=4, label="the reference (SFT)" if "start" in baseline
                    else "the reference")
        ax.margins(x=0.05, y=0.08)                      # the star whole, at the edge too
        for name, style in (("openai_1b", "--"), ("human", ":")):
            if baseline.get(name, {}).get(key) is not None:
                ax.axhline(baseline[name][key], color="gray", ls=style,
                           label="OpenAI 1.3B" if name == "openai_1b" else "people")
        if spread:
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xlim(-0.15, 1.3 * max(kl))
            ticks = [t for t in (0, 0.5, 1, 2, 5, 10, 20, 50) if t <= ax.get_xlim()[1]]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        if key == "reward" and objective_beta is not None:
            equal_objective_lines(ax, objective_beta)
        ax.set_xlabel("KL from the reference (nats a summary" + ("; symlog)" if spread
                                                                  else ")"))
        ax.set_ylabel(AXES[title])
        ax.set_title(f"held-out {title}, one point per {point}", fontsize=10)
    handles = {}                                        # every entry once, from all panels
    for ax in axes:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    axes[-1].legend(handles.values(), handles.keys(), loc="upper left",
                    bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.text(0.01, 0.01, bars, fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, dpi=100)
    plt.close(fig)


def optimum_curves(axes, optimum):
    """The KL-regularised optimum and best-of-n (tools/analysis/optimum.py's JSON, support/optimum.py)
    on plot_sweep's three panels, the judge's reward, MRR and ROUGE-L against KL: a line
    per curve, each point labelled by its beta, and no error bars (their SEs over posts are
    in the JSON). `axes`: the three panels, in tables.MEASURES' order."""
    keys = [key for key, _ in tables.MEASURES.values()]
    k = len(optimum["best_of_n"])
    for ax, key in zip(axes, keys):
        best = [row for row in optimum["best_of_n"] if key in row]
        ax.plot([row["kl"] for row in best], [row[key] for row in best], "-", color="0.4",
                marker=".", label=f"best of n, n = 1..{k} (SFT samples)")
        top = [row for row in optimum["optimum"] if key in row]
        ax.plot([row["kl"] for row in top], [row[key] for row in top], "--", color="k",
                marker="x", label="the optimum, e^{r/beta} (SFT samples)")
        for row in top:
            ax.annotate(f"{row['beta']:g}", (row["kl"], row[key]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))


def equal_objective_lines(ax, beta):
    """Dashed grey lines of equal reward - beta KL, 0.1 apart, across the panel: a point up
    and to the right of another is only better on the objective when it sits on a higher
    line. Drawn as polylines, so they stay the straight lines they are on a symlog axis."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    xs = [x0 + (x1 - x0) * k / 400 for k in range(401)]
    levels = range(math.floor(10 * (y0 - beta * x1)), math.ceil(10 * (y1 - beta * x0)) + 1)
    for k, level in enumerate(c / 10 for c in levels):
        ax.plot(xs, [level + beta * x for x in xs], color="0.55", lw=0.9, ls=(0, (4, 3)),
                zorder=1, label=None if k else f"equal reward - {beta:g} KL (0.1 apart)")
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)


# ------------------------------------------------------------- one run's bookkeeping

def start_results(run_dir, resume, config, policy, value_head, optimizer, beta,
                  one_action=None):
    """results.json's start for a run: (first iteration, beta, results). With --resume and
    a checkpoint in `run_dir`, the checkpoint's state is loaded into the policy, the value
    head, the optimizer, the RNG and `one_action` (ppo.OneActionAdvantages: its baseline),
    and its iterations are kept; otherwise a checkpoint left there (--force) is removed.
    `commits`: the code of every process that wrote iterations here (a resumed run has two)."""
    results = {"config": config, "commits": [git_commit()], "iterations": [], "final": None}
    if not (resume and has_checkpoint(run_dir)):
        shutil.rmtree(Path(run_dir) / "checkpoint", ignore_errors=True)
        return 0, beta, results
    start, beta, baseline = load_checkpoint(run_dir, policy, value_head, optimizer)
    if one_action is not None:
        one_action.baseline = baseline
    with cli.reading(Path(run_dir) / "results.json", "the results of the run to resume"):
        old = json.loads((Path(run_dir) / "results.json").read_text())
    results["iterations"] = old["iterations"][:start]
    results["commits"] = old.get("commits", []) + results["commits"]
    print(f"resumed {run_dir} at iteration {start}")
    return start, beta, results


class Laps:
    """Seconds per phase of one iteration: `lap("generate")` closes the phase that began at
    the previous lap (or at the start). On CUDA, whose kernels run after the Python that
    launched them returns, each reading waits for the GPU first, so a phase's time is its
    work's; where CUDA is unused (the CPU, MPS) nothing waits."""

    def __init__(self):
        self.start = self.last = now()
        self.seconds = {}

    def __call__(self, phase):
        moment = now()
        self.seconds[phase], self.last = moment - self.last, moment

    def row(self):
        """results.json's timing keys: seconds_<phase> each, and the whole iteration's."""
        return {**{f"seconds_{k}": round(v, 3) for k, v in self.seconds.items()},
                "seconds": round(now() - self.start, 3)}


def now():
    """time.perf_counter() once the GPU's queued work is done, where this process uses CUDA."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def record_iteration(results, iteration, laps, run_dir, device, bar, tensors, **row_args):
    """An iteration's row (`iteration_row` of the whole batch: `tensors` gathered from every
    rank, and `row_args`), with its times, threads and memory: added to results.json, which is
    rewritten, and shown on the progress bar. Returns the row."""
    whole = {name: parallel.gather(x) for name, x in tensors.items()}
    row = iteration_row(iteration, **whole, **row_args)
    row.update(laps.row(), threads=torch.get_num_threads(),
               peak_memory_gb=round(peak_memory_gb(device), 3))
    results["iterations"].append(row)
    write_json(Path(run_dir) / "results.json", results)
    bar.set_postfix(reward=f"{row['reward']:.2f}", kl=f"{row['kl']:.2f}",
                    len=f"{row['response_length']:.1f}", ratio=f"{row['ratio_after_max']:.4f}")
    return row


def step_log(iteration, parts, rows, n_seq, n_tok, with_ptx=False):
    """One inner step's log of the whole batch, from its micro-batches' `parts` (parts, 8):
    loss, policy, value and entropy losses, clipfrac, approx_kl, ptx loss, real tokens, each
    part's share already in its losses; `rows` the sequences of each part. Read on the host
    once a step, not seven times a micro-batch (each read waits for the GPU); a NaN in the
    loss stops the run here, before the optimizer steps on it. Summed over the ranks."""
    check_finite(iteration, loss=parts[:, 0])
    log = dict.fromkeys(("policy_loss", "value_loss", "entropy", "clipfrac", "approx_kl",
                         "ptx_loss"), 0.0)
    for b, (_, pl, vl, el, clipfrac, approx_kl, lm, real) in zip(rows, parts.tolist()):
        share = real / n_tok                            # this part's real tokens
        log["ptx_loss"] += (lm * b / n_seq) if with_ptx else 0.0
        log["policy_loss"] += pl
        log["value_loss"] += vl
        log["entropy"] -= el
        log["clipfrac"] += clipfrac * share
        log["approx_kl"] += approx_kl * share
    return parallel.total(log)


def gradients(parameters):
    """Every gradient of `parameters` in one (n,) tensor, for `check_finite` before a step.
    A parameter with no gradient counts as zeros, as `parallel.sum_gradients` then makes it:
    under torchrun a rank with no pairs in a short last batch has none at all."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in parameters])


class NonFiniteError(cli.UserError):
    """A score, reward, advantage or loss became NaN or inf: the run stops there."""


def check_finite(iteration, unit="iteration", **named):
    """Stop at the first of the `named` tensors (or floats) that holds a NaN or an inf.

    ppo.py calls it before the backward pass, on the gradients (`gradients`) before each
    optimizer step, and before the iteration's results row and checkpoint are written: the
    last checkpoint is the last good state; sft.py, reward_model.py and dpo.py at each step
    (unit "step") on the loss and the gradients, before the optimizer steps on them and
    before anything is saved.
    Under torchrun it counts every rank's tensor values, so every rank stops, or none; a
    float is a value every rank already shares (a loss summed over the ranks).
    """
    for name, x in named.items():
        if torch.is_tensor(x):
            bad, n = parallel.total(int((~torch.isfinite(x)).sum())), parallel.total(x.numel())
        else:
            bad, n = int(not math.isfinite(x)), 1
        if bad:
            raise NonFiniteError(f"{unit} {iteration}: the {name} is NaN or inf in {bad} of "
                                 f"{n} values; stopped there, and what was saved before it "
                                 "(a checkpoint, the last complete run) is intact")
