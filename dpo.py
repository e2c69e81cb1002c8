"""Direct Preference Optimization (DPO): the KL-regularised objective solved in closed form.

PPO (ppo.py) maximises the judge's reward less beta times the KL to the reference, with the
judge in the loop. That objective has a closed-form optimum (Rafailov et al. 2023, sec. 4):
    pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x)
so any reward is beta log(pi*(y|x) / pi_ref(y|x)) + beta log Z(x). Put that into the judge's
Bradley-Terry loss (R1) of reward_model.py: Z(x) cancels in the difference of a pair, and the
policy itself becomes the judge, fitted to people's comparisons with no judge and no sampling:
    (D1) r_hat(x, y) = beta (log pi_theta(y|x) - log pi_ref(y|x))     the implicit reward
    (D2) L_DPO = -log sigmoid(r_hat(x, y_w) - r_hat(x, y_l))           mean over pairs
log pi(y|x) = sum_t log pi(y_t | x, y_<t), over the summary's real tokens (its EOS included).
(D2) is (R1) with r_hat for the judge's score: `dpo_loss` calls `reward_model.bt_loss`.

Departures from Rafailov et al. (each repeated at its line):
    1. The post's LoRA (rank 16, alpha 32, q_proj and v_proj) on the SFT model, as PPO's
       policy (lora.with_lora); the reference is the SFT model, frozen. The paper tunes
       every weight.
    2. The data: the comparisons people made that the judge in --reward-model trained on,
       split by post as it split them (the settings its config.json saves: seed, held-out
       fraction, training subset, summary cut, and a fingerprint of the split, checked; a
       judge without them is refused), not the judge's extra reference and off-post pairs;
       prompts cut to --prompt-tokens (the judge's cpu preset: 128 too). Like for like with
       the judge (issue 75): `--steps 0` makes one pass over all its training comparisons.
    3. Batches drawn as sft.py draws them (`loaders.batch_for`); the cpu preset stops after
       --steps, before one pass over the pairs; constant learning rate.
    4. Log-probs through ppo.py's fused path (`ppo.token_log_probs`: fp32, logits at the
       response positions only), the reference's once per pair with no gradient. Policy and
       reference share the path, so r_hat is exactly 0 before the first step.
    5. The training curve under TRL's names (rewards/chosen, rewards/rejected,
       rewards/margins, rewards/accuracies: the share of pairs with r_hat_w > r_hat_l,
       logps/chosen, logps/rejected, loss), a row per --log-every steps.
    6. The evaluation: the implicit judge (D1) on the judge's held-out pairs (the first
       --heldout-pairs; its accuracy with ties counted one half and its Wilson interval,
       (R4)), beside the explicit judge's content and full scores on the same token ids,
       and all three beside rules that never read the summary (which system wrote it, the
       longer wins, the SFT model's log-prob), on distinct pairs, by contrast, paired
       (support/judge_baselines.py);
       and the policy sampled on ppo.py's held-out posts as ppo.py samples a run
       (support/heldout.py, `ppo.rollouts`), so its row sits beside PPO's.

Papers: Rafailov et al. 2023, arXiv:2305.18290 (sec. 4, eq. 7; sec. 5.1 the implicit
reward); Stiennon et al. 2020, arXiv:2009.01325 (the comparisons); Hu et al. 2021,
arXiv:2106.09685 (LoRA).

Run:   python dpo.py --beta 0.1 --seed 0          (cpu preset: ~25 min, one thread)
       python dpo.py --preset tiny --reward-model runs/rm_tiny --out runs/dpo_tiny
Test:  pytest tests/test_dpo.py
"""
import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from support import parallel  # noqa: F401  first: it sets what torch and tqdm read as they load
import torch
from tqdm import tqdm

import loaders
import ppo
import reward_model as rm
from lora import save_adapter, with_lora
from support import cli, disk, judge_baselines, rm_data
from support.config import option, read_config
from support.heldout import keep_for_judge, policy_row, reference_and_human, write_samples_page
from support.kept import machine
from support.quality import words
from support.report import check_finite, gradients, print_row, print_row_header
from support.rm_data import pad
from support.rm_report import pair_metrics


@dataclass
class Config:
    """Every setting, with its help string; presets below."""
    preset: str = option("auto", "blog (CUDA/MPS default), cpu (CPU default) or tiny (tests)")
    beta: float = option(0.1, "beta of (D1), the KL coefficient (Rafailov et al.: 0.1)")
    seed: int = option(0, "seed of the adapter's init, the pairs' order and the held-out draws")
    lr: float = option(1e-4, "AdamW learning rate of the LoRA adapter (PPO's: the post's 1e-4)")
    epochs: int = option(1, "passes over the training pairs, when --steps is 0")
    steps: int = option(0, "optimizer steps, each on --batch pairs; 0 = --epochs passes")
    batch: int = option(16, "comparisons per optimizer step")
    micro_batch: int = option(4, "comparisons per forward and backward pass (same gradient)")
    prompt_tokens: int = option(256, "longer posts are cut, as ppo.py cuts them (the post: 256)")
    heldout_pairs: int = option(0, "the judge's first N held-out comparisons, for both "
                                   "judges' accuracy; 0 = all")
    eval_prompts: int = option(64, "ppo.py's held-out posts, for the policy's row")
    max_new_tokens: int = option(ppo.MAX_NEW_TOKENS, "tokens sampled per held-out summary")
    log_every: int = option(1, "a row of the training curve every N steps")
    reward_model: str = option("runs/reward_model", "the judge: its pairs, its split, its "
                                                    "held-out accuracy, the policy's reward")
    out: str = option(None, "output folder (default runs/dpo_beta{b}_seed{s}), replaced only "
                            "when the run completes")
    model: str = loaders.SFT_MODEL                  # --model and --data-dir: loaders.py
    data_dir: str = None


PRESETS = {
    "blog": dict(),
    # Measured with SmolLM2 on 2 cores busy with other runs (load 4.4), OMP_NUM_THREADS=1:
    # a step of 8 pairs 31 s (the reference's log-probs of its new pairs included), 30 steps
    # ~16 min; 128 held-out pairs ~5 min (policy, reference, judge); the 64 posts' samples
    # ~3 min, the reference's and start rows ~3-6 min more unless the judge's folder keeps
    # them from a PPO run: ~25-30 min. 240 of the ~1,400 pairs; LR 5e-4, PPO's cpu one.
    "cpu": dict(prompt_tokens=128, batch=8, micro_batch=4, steps=30, lr=5e-4,
                heldout_pairs=128),
    "tiny": dict(prompt_tokens=64, batch=2, micro_batch=2, steps=3, heldout_pairs=8,
                 eval_prompts=4, max_new_tokens=8),
}
CHOICES = {"preset": ("auto", "blog", "cpu", "tiny")}
# beta = 0 would make (D2) log 2 whatever the policy does: refused.
RANGES = {"beta": cli.POSITIVE, "seed": cli.NON_NEGATIVE, "lr": cli.POSITIVE,
          "epochs": cli.COUNT, "steps": cli.NON_NEGATIVE, "batch": cli.COUNT,
          "micro_batch": cli.COUNT, "prompt_tokens": cli.Range(loaders.PROMPT_TEMPLATE_TOKENS),
          "heldout_pairs": cli.NON_NEGATIVE, "eval_prompts": cli.Range(1, loaders.EVAL_RESERVE),
          "max_new_tokens": cli.COUNT, "log_every": cli.COUNT}
# TRL's names for the training curve (departure 5)
CURVE = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
         "rewards/accuracies", "logps/chosen", "logps/rejected")


def parse_args(argv=None):
    """Defaults, the preset, then the flags; every value checked before anything loads."""
    cfg, parser = read_config(Config, PRESETS, RANGES, CHOICES, argv, __doc__.splitlines()[0])
    cfg.out = cfg.out or f"runs/dpo_beta{cfg.beta:g}_seed{cfg.seed}"
    if problem := cli.out_problem(cfg.out):
        parser.error(problem)
    cfg.micro_batch = min(cfg.micro_batch, cfg.batch)
    return cfg


# ------------------------------------------------------------------- the math (pure)

def implicit_reward(logp, logp_ref, beta):
    """(D1) for (N,) sequence log-probs under the policy and the reference: (N,)."""
    # (D1) r_hat(x, y) = beta (log pi_theta(y|x) - log pi_ref(y|x))
    return beta * (logp - logp_ref)


def dpo_loss(logp_w, logp_l, ref_w, ref_l, beta):
    """(D2), a scalar, from (N,) log-probs of the preferred (w) and the other (l) summary
    under the policy and the reference."""
    r_w = implicit_reward(logp_w, ref_w, beta)                             # (N,)
    r_l = implicit_reward(logp_l, ref_l, beta)                             # (N,)
    # (D2) L_DPO = -log sigmoid(r_hat(x, y_w) - r_hat(x, y_l)): (R1) of the implicit reward
    return rm.bt_loss(r_w, r_l)


def curve_row(logp_w, logp_l, ref_w, ref_l, beta):
    """The training curve's numbers (CURVE, TRL's names), means over the (N,) pairs given."""
    r_w, r_l = implicit_reward(logp_w, ref_w, beta), implicit_reward(logp_l, ref_l, beta)
    return {"loss": dpo_loss(logp_w, logp_l, ref_w, ref_l, beta).item(),
            "rewards/chosen": r_w.mean().item(), "rewards/rejected": r_l.mean().item(),
            "rewards/margins": (r_w - r_l).mean().item(),
            "rewards/accuracies": (r_w > r_l).double().mean().item(),   # TRL: a tie is wrong
            "logps/chosen": logp_w.mean().item(), "logps/rejected": logp_l.mean().item()}


# ------------------------------------------------------------------------ log-probs

def sequence_log_probs(model, prompts, summaries, pad_id, device):
    """log pi(y|x) of each summary after its prompt (id lists): (N,) fp32, with the gradient
    when enabled. Prompts left-padded and summaries right-padded, as ppo.py lays out a
    sampled batch; the sum keeps the summary's real tokens (EOS included)."""
    prompt_ids, prompt_mask = pad(prompts, pad_id, "left", device)         # (N, P)
    actions, mask = pad(summaries, pad_id, "right", device)                # (N, T)
    sequences = torch.cat([prompt_ids, actions], 1)                        # (N, P+T)
    # departure 4: ppo.py's fused path, log pi(y_t | x, y_<t) at the response positions
    logp = ppo.token_log_probs(model, sequences, ppo.full_mask(prompt_mask, actions),
                               actions)                                    # (N, T)
    return torch.where(mask.bool(), logp, 0.0).sum(-1)                     # (N,) real tokens


def pair_log_probs(model, pairs, pad_id, device):
    """(log pi(y_w|x), log pi(y_l|x)), (n,) each, for n pairs, in one pass of 2n rows."""
    logp = sequence_log_probs(model, [p["prompt"] for p in pairs] * 2,
                              [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
                              pad_id, device)                              # (2n,)
    return logp[:len(pairs)], logp[len(pairs):]


@torch.no_grad()
def log_probs_of(model, pairs, micro_batch, pad_id, device, desc=""):
    """pair_log_probs of many pairs, micro-batch by micro-batch, no gradient: (n,), (n,)."""
    parts = [pair_log_probs(model, pairs[i:i + micro_batch], pad_id, device)
             for i in tqdm(range(0, len(pairs), micro_batch), desc=desc, unit="batch",
                           disable=not desc, leave=False)]
    return torch.cat([w for w, _ in parts]), torch.cat([l for _, l in parts])


# ------------------------------------------------------------------------ training

def dpo_gradients(policy, batch, ref_w, ref_l, cfg, pad_id, device):
    """(D2) over `batch`, backward in micro-batches whose losses are weighted by their share
    of the pairs, so the gradient is the whole batch's. ref_w, ref_l: (n,). Returns the
    policy's log-probs (n,), (n,), detached."""
    logps = []
    for i in range(0, len(batch), cfg.micro_batch):
        part, rows = batch[i:i + cfg.micro_batch], slice(i, i + cfg.micro_batch)
        logp_w, logp_l = pair_log_probs(policy, part, pad_id, device)      # (b,), (b,)
        loss = dpo_loss(logp_w, logp_l, ref_w[rows], ref_l[rows], cfg.beta)
        (loss * (len(part) / len(batch))).backward()
        logps.append(torch.stack([logp_w.detach(), logp_l.detach()]))     # (2, b)
    return torch.cat(logps, 1).unbind()                                    # (n,), (n,)


def total_steps(cfg, pairs):
    """--steps, or --epochs passes over `pairs` comparisons of --batch."""
    return cfg.steps or cfg.epochs * math.ceil(pairs / cfg.batch)


def train(policy, reference, pairs, cfg, pad_id, device):
    """AdamW steps of (D2) on the adapter; returns the training curve, a row of CURVE per
    --log-every steps (means over their pairs), each with its step."""
    adapter = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapter, lr=cfg.lr)
    steps = total_steps(cfg, len(pairs))
    reference_of = {}                           # id(pair) -> (log pi_ref(y_w|x), (y_l|x))
    curve, recent = [], []
    bar = tqdm(range(steps), desc=f"dpo beta={cfg.beta:g} seed={cfg.seed}", unit="step")
    for step in bar:
        # departure 3: this step's pairs, as sft.py draws its posts
        batch = loaders.batch_for(pairs, step, cfg.batch, cfg.seed)
        # departure 4: the frozen reference's log-probs, once per pair, no gradient
        new = [p for p in batch if id(p) not in reference_of]
        if new:
            w, l = log_probs_of(reference, new, cfg.micro_batch, pad_id, device)
            reference_of.update({id(p): (a, b) for p, a, b in zip(new, w.tolist(), l.tolist())})
        ref_w, ref_l = (torch.tensor([reference_of[id(p)][k] for p in batch], device=device)
                        for k in (0, 1))                                   # (n,) each
        optimizer.zero_grad(set_to_none=True)
        logp_w, logp_l = dpo_gradients(policy, batch, ref_w, ref_l, cfg, pad_id, device)
        row = curve_row(logp_w, logp_l, ref_w, ref_l, cfg.beta)
        check_finite(step + 1, "step", loss=row["loss"],        # NaN or inf: one line,
                     logps=torch.stack([logp_w, logp_l]),        # nothing saved
                     gradient=gradients(adapter))
        optimizer.step()
        recent.append((logp_w, logp_l, ref_w, ref_l))
        bar.set_postfix(loss=f"{row['loss']:.3f}", margin=f"{row['rewards/margins']:+.3f}")
        if (step + 1) % cfg.log_every == 0 or step + 1 == steps:
            # the steps since the last row, as one set of pairs
            joined = [torch.cat(x) for x in zip(*recent)]
            curve.append({"step": step + 1, **curve_row(*joined, cfg.beta)})
            recent = []
    return curve


# ------------------------------------------------------------------------ evaluation

def judges_on_heldout(policy, reference, judge, pairs, train_pairs, cfg, split, device):
    """The implicit judge (D1) and the explicit judge's two scores (R5) on the same held-out
    pairs: {"pairs", "implicit", "content", "full"}, each part `pair_metrics` (accuracy,
    Wilson interval (R4), accuracy where people chose the shorter summary, ...); and
    "baselines": the three judges beside the rules that never read the summary, on distinct
    pairs, by contrast (support/judge_baselines.py; the SFT rule is the reference's log pi)."""
    pad_id = judge.settings["pad_id"]
    logp_w, logp_l = log_probs_of(policy, pairs, cfg.micro_batch, pad_id, device,
                                  "held-out pairs (policy)")
    ref_w, ref_l = log_probs_of(reference, pairs, cfg.micro_batch, pad_id, device,
                                "held-out pairs (reference)")
    len_w = torch.tensor([p["chosen_len"] for p in pairs])                  # (n,) tokens
    len_l = torch.tensor([p["rejected_len"] for p in pairs])                # (n,) tokens
    r_w = implicit_reward(logp_w, ref_w, cfg.beta).cpu()                    # (n,)
    r_l = implicit_reward(logp_l, ref_l, cfg.beta).cpu()                    # (n,)
    implicit = pair_metrics(r_w, r_l, len_w, len_l)
    explicit, scores = rm.evaluate(judge, pairs, split)                     # content, full
    baselines = judge_baselines.baselines(train_pairs, pairs, {"implicit": (r_w, r_l), **scores},
                                          logp=(ref_w, ref_l))
    return {"pairs": len(pairs), "implicit": implicit, **explicit, "baselines": baselines,
            "split_fingerprint": judge.settings["split"]["fingerprint"]}


# ---------------------------------------------------------- plumbing: the run and main

# What the judge's config.json must say of its split (reward_model.py's `split_settings`).
SPLIT = ("seed", "heldout_fraction", "max_pairs", "max_heldout_pairs", "max_summary_tokens",
         "fingerprint")


def judge_split(cfg, judge):
    """reward_model.py's settings that decide its comparisons, split and cut (departure 2),
    from its config.json: its seed, held-out fraction, training subset and summary cut;
    this run's prompt budget, and this run's held-out count within the judge's. A judge
    that does not say them (an older reward_model.py) stops the run with one line."""
    saved = judge.settings.get("split")
    if not isinstance(saved, dict) or not set(SPLIT) <= set(saved):
        raise cli.UserError(f"{cfg.reward_model}/config.json does not say how the judge split "
                            "its comparisons (heldout_fraction, max_pairs, ...): written by an "
                            "older reward_model.py; retrain it with `python reward_model.py`")
    if judge.settings["max_prompt_tokens"] != cfg.prompt_tokens:
        print(f"note: the judge read prompts cut to {judge.settings['max_prompt_tokens']} tokens, "
              f"this run cuts them to {cfg.prompt_tokens}: both judges read the latter")
    caps = [n for n in (cfg.heldout_pairs, saved["max_heldout_pairs"]) if n]   # 0 = all
    return rm.Config(seed=saved["seed"], heldout_fraction=saved["heldout_fraction"],
                     max_pairs=saved["max_pairs"], max_summary_tokens=saved["max_summary_tokens"],
                     max_prompt_tokens=cfg.prompt_tokens,
                     max_heldout_pairs=min(caps, default=0),
                     min_heldout_pairs=0, data_dir=cfg.data_dir or "", model=cfg.model)


def check_split(data, judge, cfg):
    """Stop with one line when the comparisons here split otherwise than the judge's did
    (another data folder, or other data in it): both judges must see the same pairs."""
    if rm_data.split_fingerprint(data) != judge.settings["split"]["fingerprint"]:
        raise cli.UserError(f"the comparisons of --data-dir {cfg.data_dir or '(default)'} do not "
                            f"split as {cfg.reward_model}'s did (another data folder?); pass "
                            "the judge's --data-dir, or retrain the judge on this one")


def sampling_config(cfg, device):
    """ppo.py's settings for the held-out row: its preset's (sampler, batch, precision) with
    this run's prompt budget, length, posts, model, judge and data, as sft.py samples."""
    sampling = ppo.Config(**{**ppo.PRESETS[cfg.preset], "prompt_tokens": cfg.prompt_tokens,
                             "max_new_tokens": cfg.max_new_tokens, "preset": cfg.preset,
                             "eval_prompts": cfg.eval_prompts, "model": cfg.model,
                             "reward_model": cfg.reward_model, "data_dir": cfg.data_dir,
                             "beta": (cfg.beta,), "seeds": (cfg.seed,)})
    sampling.precision = loaders.resolve_precision(sampling.precision, device)
    return sampling


def run(cfg, staging, start):
    """Load, split, fit, evaluate, and write results.json (and the adapter) into `staging`."""
    device = loaders.pick_device()
    if not (Path(cfg.reward_model) / "config.json").is_file():
        raise cli.UserError(f"no reward model in {cfg.reward_model}: run `python "
                            "reward_model.py` first, or pass --reward-model DIR")
    judge = rm.load_reward_model(cfg.reward_model, device=device)
    split = judge_split(cfg, judge)
    data = rm_data.load_and_split(split)        # departure 2: the judge's comparisons, split
    check_split(data, judge, cfg)
    reference, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                             device=device)
    train_pairs, heldout_pairs = rm_data.comparison_pairs(tokenizer, data, split)
    sampling = sampling_config(cfg, device)
    _, held_out = loaders.load_prompts(sampling, tokenizer,
                                       data.tldr_posts or loaders.load_tldr(cfg.data_dir))
    models = (reference, judge, tokenizer, device)
    base = reference_and_human(sampling, models, held_out, staging, ppo.rollouts)

    torch.manual_seed(cfg.seed)                 # the adapter's A
    # departure 1: PPO's policy, the reference plus LoRA, sharing its frozen tensors
    policy = with_lora(copy.deepcopy(reference, memo={id(p): p for p in reference.parameters()}))
    policy.eval()                               # dropout off, as in every pass of ppo.py
    pad_id = tokenizer.pad_token_id
    curve = train(policy, reference, train_pairs, cfg, pad_id, device)
    keep_for_judge(sampling, base)              # as ppo.py does, once a run has trained

    judges = judges_on_heldout(policy, reference, judge, heldout_pairs, train_pairs, cfg,
                               split, device)
    final, samples = policy_row(sampling, cfg.seed, policy, models, held_out, base,
                                ppo.rollouts, judges=judges)
    final["words"] = sum(len(words(s["text"])) for s in samples) / len(samples)
    results = {"config": dataclasses.asdict(cfg), "train_pairs": len(train_pairs),
               "steps": total_steps(cfg, len(train_pairs)), "curve": curve, "final": final,
               "seconds": time.time() - start, "machine": machine()}
    with cli.writing(cfg.out):                  # a full disk: one line, --out as it was
        disk.write_json(staging / "results.json", results)
        save_adapter(policy, staging / "adapter.safetensors")   # not needed by the summary
        write_samples_page(final, held_out, f"DPO beta={cfg.beta:g} seed={cfg.seed}",
                           staging / "samples.html", labels={"reference": "reference (SFT)",
                                                             "policy": "DPO"})
        plot_curve(curve, staging / "curve.png")
    print_summary(final, cfg)
    return results


def plot_curve(curve, path):
    """curve.png: the implicit rewards and their margin, and the loss, against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [r["step"] for r in curve]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        left.plot(steps, [r[key] for r in curve], label=key)
    left.set(xlabel="step", ylabel="(D1), nats x beta", title="implicit rewards")
    left.legend()
    right.plot(steps, [r["loss"] for r in curve])
    right.set(xlabel="step", ylabel="(D2)", title="loss")
    fig.tight_layout()
    disk.save_figure(fig, path, dpi=120)
    plt.close(fig)


def print_summary(final, cfg):
    """Both judges' held-out accuracy, then the policy's row beside the reference's."""
    judges = final["judges"]
    print(f"\n{judges['pairs']} held-out comparisons of the judge's split:")
    for name in ("implicit", "content", "full"):
        m = judges[name]
        print(f"  {name:>8} judge: accuracy {m['heldout_accuracy']:.3f} (Wilson 95% "
              f"{m['wilson_low']:.3f}-{m['wilson_high']:.3f})")
    judge_baselines.print_baselines(judges["baselines"], ("implicit", "content", "full"))
    print_row_header()
    print_row("DPO", final)
    print_row("(ref)", final["ref"])
    print_row("human", final["human"])
    print(f"DPO: MRR {final['retrieval_mrr']:.3f}, ROUGE-L {final['rouge_l']:.3f}, "
          f"{final['words']:.1f} words, KL {final['kl']:.2f} nats")


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
        print(f"saved to {cfg.out}/ ({time.time() - start:.0f} s in all)")


if __name__ == "__main__":
    cli.run_script(main)
