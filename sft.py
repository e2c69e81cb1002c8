"""Supervised fine-tuning (SFT): the first stage, SmolLM2-135M-Instruct fitted to people's TL;DRs.

The post's reference is "the SFT model, frozen for the whole run", and the canonical pipeline
starts every later model from it (Stiennon et al. 2020; Huang et al. 2024):

    1. sft.py           SmolLM2-135M-Instruct + the post's LoRA, fitted to the human TL;DRs of
                        training posts; the adapter is merged and the model saved: runs/sft/
    2. reward_model.py  the judge, fitted to people's comparisons
    3. ppo.py           the policy and its frozen reference both start from runs/sft/ (the
                        default --model; SmolLM2-135M-Instruct when there is none)

The loss is the post's (13), here the whole objective, computed by `ppo.ptx_loss`:
    (13)  L_SFT = -E_{(x,y)~D} sum_t log pi_theta(y_t | x, y_{1:t-1})
x a post's prompt and y its author's TL;DR, then EOS; the sum runs over the summary's
tokens only. Training ends with the merge of `lora.merge_lora`:
    W' = W + (alpha / r) B A        on q_proj and v_proj, so later stages load a plain model

Departures from Stiennon et al.'s SFT (every weight, 116k TL;DRs), each repeated at its line:
    1. The post's LoRA (rank 16, alpha 32, q_proj and v_proj) on a frozen SmolLM2, merged at
       the end.
    2. The data: the TL;DR file's posts, less ppo.py's evaluation reserve (the first
       `loaders.EVAL_RESERVE` of `loaders.tldr_order`) and less every post that people
       compared summaries of (the judge holds some of those out, which ones depending on its
       seed); each prompt cut to --prompt-tokens as ppo.py cuts them (`loaders.load_prompts`).
    3. Batches drawn as ppo.py draws its prompts (`loaders.batch_for`); the learning rate
       decays linearly to 0 (--schedule constant keeps it).
    4. The held-out loss and rows on ppo.py's evaluation posts, never trained on: the model
       it started from and the SFT model, sampled as ppo.py samples (`ppo.rollouts`).

Run:   python sft.py                        (cpu preset: 120 steps of 8 posts)
       python sft.py --preset tiny --out runs/tiny_sft      (a toy model, seconds)
Test:  pytest tests/test_sft.py
"""
import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from support import parallel    # first: it sets what torch and tqdm read as they load
import torch
from tqdm import tqdm

import loaders
import ppo
import reward_model as rm
from lora import merge_lora, with_lora
from support import cli, disk
from support.config import option, read_config
from support.heldout import draws_key, sft_rows, write_samples_page
from support.report import check_finite, gradients


@dataclass
class Config:
    """Every setting, with its help string; presets below."""
    preset: str = option("auto", "blog (CUDA/MPS default), cpu (CPU default) or tiny (tests)")
    steps: int = option(120, "optimizer steps, each on --batch posts")
    batch: int = option(8, "posts per step")
    micro_batch: int = option(8, "posts per forward and backward pass (same gradient)")
    lr: float = option(2e-3, "AdamW learning rate of the LoRA adapter, at the first step")
    lora_layers: int = option(0, "put the adapter on the top N layers only; 0 = every "
                                 "layer (the post's)")
    schedule: str = option("linear", "the learning rate over the steps: linear (decays to 0 "
                                     "at the last step), or constant")
    prompt_tokens: int = option(128, "longer posts are cut, as ppo.py cuts them (the post: 256)")
    eval_prompts: int = option(64, "ppo.py's held-out posts: the held-out loss and rows")
    eval_every: int = option(20, "held-out loss every N steps (the learning curve)")
    seed: int = option(0, "seed of the adapter's init and of the batches")
    max_new_tokens: int = option(ppo.MAX_NEW_TOKENS, "tokens sampled per held-out summary")
    reward_model: str = option("runs/reward_model", "a judge to score the held-out rows with, "
                                                    "when that folder holds one")
    out: str = option("runs/sft", "output folder, replaced only when the run completes")
    model: str = loaders.POLICY_NAME                # --model and --data-dir: loaders.py
    data_dir: str = None


PRESETS = {
    "blog": dict(prompt_tokens=256, batch=16, micro_batch=4),
    # About 9 minutes on 2 cores. Steps, LR and schedule chosen by the held-out loss at
    # equal time, every layer by it too (the top 8 alone: 1.7x faster a step, far slower
    # to learn), 128 prompt tokens by MRR and ROUGE-L against 256 (docs/sft.md).
    "cpu": dict(prompt_tokens=128, batch=8, micro_batch=8),
    "tiny": dict(steps=4, batch=2, micro_batch=2, prompt_tokens=64, eval_prompts=4,
                 eval_every=2, max_new_tokens=8),
}
CHOICES = {"preset": ("auto", "blog", "cpu", "tiny"), "schedule": ("constant", "linear")}
RANGES = {"steps": cli.COUNT, "batch": cli.COUNT, "micro_batch": cli.COUNT, "lr": cli.POSITIVE,
          "prompt_tokens": cli.Range(loaders.PROMPT_TEMPLATE_TOKENS),
          "eval_prompts": cli.Range(1, loaders.EVAL_RESERVE), "eval_every": cli.COUNT,
          "lora_layers": cli.NON_NEGATIVE, "seed": cli.NON_NEGATIVE, "max_new_tokens": cli.COUNT}


def parse_args(argv=None):
    """Defaults, the preset, then the flags; every value checked before anything loads."""
    cfg, parser = read_config(Config, PRESETS, RANGES, CHOICES, argv, __doc__.splitlines()[0])
    if problem := cli.out_problem(cfg.out):
        parser.error(problem)
    if cfg.micro_batch > cfg.batch:
        cfg.micro_batch = cfg.batch
    return cfg


# ------------------------------------------------------------------------ the data

def training_posts(cfg, tokenizer, posts, comparisons):
    """(training posts, held-out posts): ppo.py's split at --prompt-tokens, then departure 2:
    no post of ppo.py's evaluation reserve and no post that people compared summaries of."""
    pool, held_out = loaders.load_prompts(cfg, tokenizer, posts)
    reserved = {posts[i]["title"].strip()
                for i in loaders.tldr_order(posts)[:loaders.EVAL_RESERVE]}
    compared = {c["title"].strip() for c in comparisons}
    train = [p for p in pool if p["title"].strip() not in reserved | compared]
    if len(train) < cfg.batch:
        raise loaders.DataError(f"{len(train)} TL;DR posts are left to train on, fewer than "
                                f"--batch {cfg.batch}")
    print(f"SFT: training on {len(train)} posts' TL;DRs (not the {loaders.EVAL_RESERVE} of "
          f"ppo.py's evaluation reserve, not the {len(compared)} posts people compared "
          f"summaries of); held-out loss on {len(held_out)} evaluation posts")
    return train, held_out


def load_comparisons_or_none(data_dir):
    """The human comparisons, or [] when the data has none (then no judge can hold a post out)."""
    try:
        return loaders.load_comparisons(data_dir)
    except loaders.DataError as error:
        print(f"no comparisons ({' '.join(str(error).split())[:120]}): no post is left out "
              "for the judge")
        return []


# ------------------------------------------------------------------- the math (pure)

def learning_rate_factor(step, steps, schedule):
    """The multiplier of --lr at optimizer step `step` (0-based): 1 (constant), or
    1 - step / steps (linear: from 1 at the first step to 1/steps at the last)."""
    return 1.0 if schedule == "constant" else 1.0 - step / steps


# ------------------------------------------------------------------------ training

def sft_loss(policy, tokenizer, posts, micro_batch, device):
    """(13) over `posts`, in micro-batches whose losses are weighted by their share of the
    posts, so the gradient is the whole batch's; backward is called on each part. Returns
    the batch's loss (a float)."""
    total = 0.0
    for i in range(0, len(posts), micro_batch):
        part = posts[i:i + micro_batch]
        # (13) L = -E_(x,y) sum_t log pi_theta(y_t | x, y_<t): ppo.ptx_loss, shared
        loss = ppo.ptx_loss(policy, tokenizer, part, device) * (len(part) / len(posts))
        loss.backward()
        total += loss.item()
    return total


@torch.no_grad()
def heldout_loss(policy, tokenizer, posts, micro_batch, device):
    """(13) on held-out posts, averaged over them: nats per summary."""
    parts = [posts[i:i + micro_batch] for i in range(0, len(posts), micro_batch)]
    return sum(ppo.ptx_loss(policy, tokenizer, part, device).item() * len(part)
               for part in parts) / len(posts)


def train(policy, tokenizer, train_posts, held_out, cfg, device):
    """--steps AdamW steps of (13) on the adapter; returns the learning curve, a row per
    --eval-every steps: {step, train_loss (mean of the steps since the last row),
    heldout_loss}. Row 0 is the model before any step."""
    adapter = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapter, lr=cfg.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate_factor(step, cfg.steps, cfg.schedule))
    curve = [{"step": 0, "train_loss": None,
              "heldout_loss": heldout_loss(policy, tokenizer, held_out, cfg.micro_batch, device)}]
    recent = []
    bar = tqdm(range(cfg.steps), desc="sft", unit="step")
    for step in bar:
        # departure 3: the posts of this step, as ppo.py draws an iteration's prompts
        posts = loaders.batch_for(train_posts, step, cfg.batch, cfg.seed)
        optimizer.zero_grad(set_to_none=True)
        loss = sft_loss(policy, tokenizer, posts, cfg.micro_batch, device)
        # NaN or inf: one line, before the step and before anything is saved
        check_finite(step + 1, "step", loss=loss, gradient=gradients(adapter))
        recent.append(loss)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.2f}",
                        lr=f"{schedule.get_last_lr()[0]:.1e}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            curve.append({"step": step + 1, "train_loss": sum(recent) / len(recent),
                          "heldout_loss": heldout_loss(policy, tokenizer, held_out,
                                                       cfg.micro_batch, device)})
            bar.write(f"step {step + 1}: training loss {curve[-1]['train_loss']:.2f}, "
                      f"held-out loss {curve[-1]['heldout_loss']:.2f} nats per summary")
            recent = []
    return curve


# ---------------------------------------------------------- plumbing: the run and main

def sampling_config(cfg, device):
    """ppo.py's settings for sampling the held-out rows: its preset's (the post's sampler, its
    batch, its precision on this device: bf16 where the blog preset's `auto` finds it native),
    this run's prompt budget and length, the judge's content score. With the same settings
    ppo.py's reference row, sampled from the saved model, is the SFT row on every device."""
    sampling = ppo.Config(**{**ppo.PRESETS[cfg.preset], "prompt_tokens": cfg.prompt_tokens,
                             "max_new_tokens": cfg.max_new_tokens,
                             "eval_prompts": cfg.eval_prompts, "model": cfg.model})
    sampling.precision = loaders.resolve_precision(sampling.precision, device)
    return sampling


def saved_bytes(model):
    """About what `run` writes: the merged model in fp32, the tokenizer and the reports."""
    return 4 * sum(p.numel() for p in model.parameters()) + 20 * 10 ** 6


def run(cfg, staging, start):
    """Load, split, fit, merge, evaluate, and write everything into `staging`."""
    device = loaders.pick_device()
    posts = loaders.load_tldr(cfg.data_dir)
    comparisons = load_comparisons_or_none(cfg.data_dir)
    base, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                        device=device)
    if cfg.lora_layers > len(base.model.layers):
        raise cli.UserError(f"argument --lora-layers: {cfg.lora_layers} is more than the "
                            f"model's {len(base.model.layers)} layers")
    disk.check_room(cfg.out, saved_bytes(base), f"the SFT model in {cfg.out}")
    train_posts, held_out = training_posts(cfg, tokenizer, posts, comparisons)
    judge_path = Path(cfg.reward_model)
    judge = (rm.load_reward_model(judge_path, device=device)
             if (judge_path / "config.json").is_file() else None)
    print(f"held-out rows scored by the judge in {judge_path}" if judge else
          f"no judge in {judge_path}: the held-out rows have no reward")

    torch.manual_seed(cfg.seed)                 # the adapter's A
    # departure 1: the post's LoRA on a frozen copy of the base (kept apart: the merge
    # writes into the copy's weights, and the base's row is sampled after)
    policy = with_lora(copy.deepcopy(base), top_layers=cfg.lora_layers)
    policy.eval()                               # dropout off, as in every pass of ppo.py
    curve = train(policy, tokenizer, train_posts, held_out, cfg, device)
    sft_model = merge_lora(policy)              # W' = W + (alpha / r) B A, in the copy

    sampling = sampling_config(cfg, device)
    rows, samples = sft_rows(base, sft_model, judge, tokenizer, held_out, sampling, device,
                             ppo.rollouts)
    results = {"config": dataclasses.asdict(cfg), "curve": curve, "rows": rows,
               "samples": samples, "draws_key": draws_key(sampling, held_out, device),
               "train_posts": len(train_posts),
               "seconds": time.time() - start}
    with cli.writing(cfg.out):                  # a full disk: one line, --out as it was
        sft_model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        disk.write_json(staging / "results.json", results)
        people = [{"text": p["summary"], "reward": None} for p in held_out]
        write_samples_page({"samples": samples["sft"], "ref_samples": samples["start"],
                            "human_samples": people}, held_out,
                           f"SFT ({cfg.steps} steps) against {cfg.model}",
                           staging / "samples.html",
                           labels={"reference": "start (SmolLM2)", "policy": "SFT"})
        plot_curve(curve, staging / "curve.png")
    print_rows(rows, cfg)
    return results


def plot_curve(curve, path):
    """curve.png: the training and held-out loss (13) against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    trained = [r for r in curve if r["train_loss"] is not None]
    ax.plot([r["step"] for r in trained], [r["train_loss"] for r in trained], label="training")
    ax.plot([r["step"] for r in curve], [r["heldout_loss"] for r in curve], label="held-out")
    ax.set(xlabel="step", ylabel="(13), nats per summary", title="SFT on people's TL;DRs")
    ax.legend()
    fig.tight_layout()
    disk.save_figure(fig, path, dpi=120)
    plt.close(fig)


def print_rows(rows, cfg):
    """The held-out rows, one line each."""
    print(f"\n{cfg.eval_prompts} held-out posts, {cfg.max_new_tokens} tokens at most:")
    for name, row in rows.items():
        reward = (f"reward {row['reward']:+.2f} ± {row['reward_se']:.2f}, "
                  if row.get("reward") is not None else "")
        print(f"  {name:>6}: {reward}MRR {row['retrieval_mrr']:.2f}, ROUGE-L "
              f"{row['rouge_l']:.3f}, {row['words']:.0f} words, ends by itself "
              f"{row['eos_fraction']:.0%}, copied {row['copied_bigrams']:.0%}, KL to the "
              f"start {row['kl']:.1f} nats")
    gain = rows["sft"]
    print(f"  SFT over its start, paired by post: ROUGE-L {gain['rouge_l_gain_over_ref']:+.3f} "
          f"± {gain['rouge_l_gain_over_ref_se']:.3f}, MRR "
          f"{gain['retrieval_mrr_gain_over_ref']:+.2f} ± "
          f"{gain['retrieval_mrr_gain_over_ref_se']:.2f} (SE)")


def main(argv=None):
    start = time.time()
    cfg = parse_args(argv)
    print(f"preset {cfg.preset}: " + ", ".join(f"{k}={v}" for k, v in
                                                dataclasses.asdict(cfg).items()))
    # One process a folder (support/disk.py); written aside and renamed into place when
    # complete, so a crash leaves --out as it was.
    with disk.holding([cfg.out]):
        results = disk.write_aside(cfg.out, lambda staging: run(cfg, staging, start))
    if results:
        print(f"saved to {cfg.out}/ ({time.time() - start:.0f} s in all); "
              + ("ppo.py starts from it by default" if Path(cfg.out).resolve()
                 == Path(loaders.SFT_MODEL).resolve() else f"ppo.py --model {cfg.out} starts "
                 "from it"))


if __name__ == "__main__":
    cli.run_script(main)
