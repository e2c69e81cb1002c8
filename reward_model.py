"""A Bradley-Terry reward model fitted to human comparisons of TL;DR summaries.

The post takes its reward model off the shelf (section "The four models": "Reads a post
and a summary of it, returns one number"). This file trains one instead, from the human
comparisons Stiennon et al. collected on this same Reddit data, and `ppo.py` imports it.

    r(x, y) = w . h_T(x, y) + b          h_T: the LM's last hidden state at the EOS after y

The model is the policy's base LM (SmolLM2-135M-Instruct, without its LM head) with the
post's LoRA adapter (`lora.py`: rank 16 on q_proj and v_proj) and a scalar linear head.
The post numbers no equation for the reward model, so the ones here are numbered R1-R4:
    (R1) L = -log sigmoid(r(x, y_w) - r(x, y_l))        Bradley-Terry loss, Stiennon eq. (1)
    (R2) r(x, y) = w . h_T + b,  w, b ~ N(0, 1/sqrt(d+1)) (std), d the hidden width
    (R3) r_hat = r + bias,  bias = -mean r(x, human TL;DR) over held-out posts
    (R4) Wilson 95% interval of the held-out pairwise accuracy
R1 sees only the difference of two scores: adding any constant to every score leaves
the loss unchanged, so the scale's origin is arbitrary and R3 pins it afterwards.

Papers:
  Bradley & Terry 1952, "Rank analysis of incomplete block designs I" (the pairwise model)
  Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2 (reward model from comparisons, for PPO)
  Stiennon et al. 2020, arXiv:2009.01325, sec. 3.4 "Reward models" (eq. 1, one epoch,
      normalise so the reference summaries score 0), sec. 4.1 and 4.3 (length as a
      confound), appendix (head init N(0, 1/sqrt(d_model + 1)))
  Hu et al. 2021, arXiv:2106.09685, sec. 4.1 (LoRA)
  Wilson 1927, "Probable inference, the law of succession, and statistical inference"

Departures from Stiennon et al. (each repeated at its line):
  1. A LoRA adapter on the frozen LM (the post's), not full fine-tuning of a supervised
     summariser; SmolLM2 was never fine-tuned on TL;DR.
  2. ~1.8k comparisons from OpenAI's two small offline batches (their validation splits),
     not 64k; posts are held out by id, so no held-out post is ever trained on.
  3. The score is read at the last real token (the EOS we append), found from the
     attention mask, with position ids counted from the first real token, so left and
     right padding give the same score. Stiennon's code reads the EOS too.
  4. Prompts are cut to a token budget with `loaders.fit_prompt` (the cpu preset: 128
     tokens) and summaries to `max_summary_tokens`; Stiennon cuts at 512.
  5. Normalisation (R3) uses the human TL;DRs of held-out posts, not of the whole dataset.

Run:   python reward_model.py                 (cpu preset on this CPU: ~15 min)
       python reward_model.py --preset tiny   (toy model, seconds)
Test:  python -m pytest -q tests/test_reward_model.py
ppo.py: model = load_reward_model("runs/reward_model"); r = score_ids(model, ...)
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

import loaders
import lora


@dataclass
class Config:
    """Every setting, with its help string. Defaults are the `blog` preset's."""
    preset: str = field(default="", metadata={"help": "blog | cpu | tiny (default: blog with "
                                              "CUDA or MPS, else cpu)"})
    out: str = field(default="runs/reward_model", metadata={"help": "output folder"})
    seed: int = field(default=0, metadata={"help": "seed for the head init, shuffling, split"})
    epochs: int = field(default=1, metadata={"help": "passes over the training pairs "
                                             "(Stiennon: 1)"})
    max_pairs: int = field(default=0, metadata={"help": "train on at most this many "
                                                "comparisons, a seeded random subset; 0 = all"})
    batch_pairs: int = field(default=8, metadata={"help": "comparisons per step "
                                                  "(each is 2 rows: chosen and rejected)"})
    lr: float = field(default=2e-4, metadata={"help": "AdamW learning rate of the LoRA "
                                              "adapter (LoRA's usual 1e-4..3e-4)"})
    head_lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate of the "
                                                   "scalar head (new, so larger)"})
    max_prompt_tokens: int = field(default=512, metadata={"help": "cut each post to this many "
                                                          "prompt tokens (Stiennon: 512)"})
    max_summary_tokens: int = field(default=48, metadata={"help": "cut each summary to this "
                                                          "many tokens (the post samples 48)"})
    heldout_fraction: float = field(default=0.25, metadata={"help": "fraction of post ids "
                                                            "held out for evaluation"})
    min_heldout_pairs: int = field(default=300, metadata={"help": "stop with an error when "
                                                          "fewer comparisons are held out"})
    max_heldout_pairs: int = field(default=0, metadata={"help": "evaluate on at most this "
                                                        "many held-out comparisons; 0 = all"})
    eval_batch: int = field(default=32, metadata={"help": "rows per forward pass when scoring"})
    lora_r: int = field(default=lora.LORA_R, metadata={"help": "LoRA rank (the post: 16)"})
    lora_alpha: int = field(default=lora.LORA_ALPHA, metadata={"help": "LoRA alpha (the "
                                                               "post: 32)"})
    model: str = loaders.POLICY_NAME           # --model and --data-dir come from loaders
    data_dir: str = ""


# Named override sets, printed at start-up. Timings are for this repo's 2-core CPU.
PRESETS = {
    "blog": {},                                 # all pairs, one epoch, 512-token prompts
    "cpu": {"max_pairs": 600, "max_prompt_tokens": 128},      # measured: ~15 min, 2 cores
    "tiny": {"max_pairs": 16, "batch_pairs": 4, "max_prompt_tokens": 64,
             "max_summary_tokens": 24, "min_heldout_pairs": 0, "max_heldout_pairs": 32},
}


def parse_config(argv=None):
    """Defaults, then the preset's overrides, then the flags given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    loaders.add_common_args(parser)
    for f in fields(Config):
        if f.name not in ("model", "data_dir"):
            parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                                default=None, help=f.metadata["help"],
                                **({"choices": list(PRESETS)} if f.name == "preset" else {}))
    args = vars(parser.parse_args(argv))
    preset = args["preset"] or ("blog" if loaders.pick_device().type != "cpu" else "cpu")
    config = Config(**{**PRESETS[preset], "preset": preset})
    for name, value in args.items():
        if value is not None and name != "preset":
            setattr(config, name, value)
    return config


# ------------------------------------------------------------------ the math (pure)

def bt_loss(r_w, r_l):
    """Mean Bradley-Terry loss over a batch of comparisons. r_w, r_l: (N,) scores."""
    # (R1)  L = -log sigmoid(r(x, y_w) - r(x, y_l))    only the difference enters
    return -F.logsigmoid(r_w - r_l).mean()


def pairwise_accuracy(r_w, r_l):
    """Fraction of comparisons the scores get right; an exact tie counts one half."""
    return ((r_w > r_l).double() + 0.5 * (r_w == r_l).double()).mean().item()


def wilson_interval(accuracy, n, z=1.96):
    """(low, high): the Wilson score interval of a proportion (z = 1.96 for 95%)."""
    if n == 0:
        return 0.0, 1.0
    # (R4)  (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    centre = accuracy + z * z / (2 * n)
    spread = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n), (centre + spread) / (1 + z * z / n)


def split_comparisons(comparisons, heldout_fraction, seed=0):
    """(train, held-out), split by post id: every comparison of one post lands on one side."""
    return loaders.split_by_id(comparisons, "post_id", heldout_fraction, seed)


# ------------------------------------------------------------------ the model

class RewardModel(nn.Module):
    """The LM body with LoRA, a scalar head, and the normalisation shift `bias` (R3)."""

    def __init__(self, body, settings):
        super().__init__()
        self.body = body                        # LlamaModel wrapped by lora.with_lora
        self.settings = settings                # what config.json records
        d = body.config.hidden_size
        self.head = nn.Linear(d, 1, device=body.embed_tokens.weight.device)
        # (R2)  w, b ~ N(0, 1/sqrt(d+1)) as a standard deviation (Stiennon, appendix)
        nn.init.normal_(self.head.weight, std=1 / math.sqrt(d + 1))
        nn.init.normal_(self.head.bias, std=1 / math.sqrt(d + 1))
        self.register_buffer("bias", torch.zeros((), device=self.head.weight.device))

    def forward(self, input_ids, attention_mask):
        """Normalised score of each row, read at its last real token. (B, L) -> (B,) fp32.

        `attention_mask` is 1 on real tokens, which may sit anywhere: left padding (PPO's
        prompts), right padding (training) or both (a left-padded prompt followed by a
        response that stopped early).
        """
        mask = attention_mask.long()                                     # (B, L)
        # Departure 3: positions count real tokens only, so padding on the left shifts no
        # position and the score is the same as with padding on the right.
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)                # (B, L)
        hidden = self.body(input_ids=input_ids, attention_mask=mask,
                           position_ids=position_ids).last_hidden_state  # (B, L, d)
        columns = torch.arange(mask.shape[1], device=mask.device)        # (L,)
        last = torch.where(mask.bool(), columns, -1).amax(-1)            # (B,) last real col
        if (last < 0).any():
            raise ValueError("a row of attention_mask has no real token to score")
        h_T = hidden[torch.arange(len(last), device=last.device), last]  # (B, d)
        # (R2)  r(x, y) = w . h_T + b
        raw = self.head(h_T).squeeze(-1).float()                         # (B,)
        # (R3)  r_hat = r + bias; bias is 0 until training ends
        return raw + self.bias                                           # (B,)


def build_reward_model(settings, device="cpu"):
    """A fresh RewardModel (adapter a no-op, head random) and the policy's tokenizer."""
    torch.manual_seed(settings["seed"])
    lm, tokenizer = loaders.load_policy_and_tokenizer(
        settings["base_model"], preset="tiny" if settings["tiny"] else None,
        device=device, seed=settings["seed"])
    lora.with_lora(lm, settings["lora_r"], settings["lora_alpha"])
    # Dropout is off: the body stays in eval mode even while it trains (Llama's only dropout,
    # on attention, is 0 anyway), so a sequence scores the same in training and in PPO.
    return RewardModel(lm.model, settings).eval(), tokenizer


def encode(tokenizer, prompt, summary, max_summary_tokens):
    """Token ids of prompt + " " + summary + EOS, laid out exactly as PPO produces them.

    PPO tokenizes the prompt alone and then samples the response ids, which usually
    begin with a space token. So the prompt and " " + summary are tokenized separately
    and their ids concatenated, never tokenized as one string (BPE would merge across
    the seam and the reward model would learn a layout it never sees in PPO).
    """
    prompt_ids = tokenizer(prompt).input_ids                            # (P,)
    summary_ids = tokenizer(" " + summary).input_ids[:max_summary_tokens]  # (<= S,)
    return prompt_ids + summary_ids + [tokenizer.eos_token_id]         # (P + S + 1,)


def fit_prompt_text(tokenizer, prompt, max_tokens):
    """A prompt string cut to `max_tokens` the way training cut it (`loaders.fit_prompt`)."""
    if len(tokenizer(prompt).input_ids) <= max_tokens:
        return prompt
    fields_ = loaders.parse_prompt(prompt)
    fitted = fields_ and loaders.fit_prompt(tokenizer, fields_, max_tokens)
    if not fitted:
        raise ValueError(f"cannot cut this prompt to {max_tokens} tokens at a paragraph or "
                         f"sentence; it must read 'SUBREDDIT: ...TITLE: ...POST: ...TL;DR:'")
    return fitted


def pad_right(sequences, pad_id, device):
    """Lists of ids -> (ids, mask), both (B, L), padded on the right."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)   # (B, L)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)           # (B, L) 1 = real
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def score_sequences(model, sequences, batch_size=32, progress=False):
    """Scores of many id lists, (N,) on the CPU. Each distinct sequence is scored once,
    in batches of similar length so little compute goes to padding."""
    unique = sorted(set(map(tuple, sequences)), key=len)
    device = model.head.weight.device
    scores = {}
    for start in tqdm(range(0, len(unique), batch_size), desc="score", disable=not progress,
                      leave=False):
        chunk = unique[start:start + batch_size]
        ids, mask = pad_right(chunk, model.settings["pad_id"], device)    # (b, L)
        scores.update(zip(chunk, model(ids, mask).cpu().tolist()))
    return torch.tensor([scores[tuple(s)] for s in sequences])           # (N,)


@torch.no_grad()
def score_ids(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """PPO's entry point: normalised scores (B,) of sampled ids, with no decode/re-encode.

    prompt_ids, prompt_mask: (B, P), left-padded. response_ids, response_mask: (B, T),
    mask 1 up to and including the first EOS. The score is read at the last real token:
    the response's EOS, or its last token when it hit the length limit (then the model
    reads a layout it never saw in training, which always ends in EOS).
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)                   # (B, P + T)
    mask = torch.cat([prompt_mask, response_mask], dim=1)                # (B, P + T)
    return model(ids, mask)                                              # (B,)


@torch.no_grad()
def score_texts(model, tokenizer, prompts, summaries, max_prompt_tokens=None, batch_size=32):
    """Normalised scores (B,) of written summaries (human TL;DRs), tokenized as in training."""
    budget = max_prompt_tokens or model.settings["max_prompt_tokens"]
    sequences = [encode(tokenizer, fit_prompt_text(tokenizer, p, budget), s,
                        model.settings["max_summary_tokens"])
                 for p, s in zip(prompts, summaries)]
    return score_sequences(model, sequences, batch_size)                 # (B,)


# ------------------------------------------------------------------ saving and loading

def base_fingerprint(model):
    """A checksum of the frozen base, to catch loading an adapter onto different weights."""
    return float(model.body.embed_tokens.weight[:64].double().sum())


def save_reward_model(model, folder):
    """adapter.safetensors, head.safetensors, config.json (and base.safetensors if tiny)."""
    folder = Path(folder)
    lora.save_adapter(model.body, folder / "adapter.safetensors")
    save_file({"head.weight": model.head.weight.detach().contiguous(),
               "head.bias": model.head.bias.detach().contiguous(),
               "bias": model.bias.detach().reshape(1)}, str(folder / "head.safetensors"))
    if model.settings["tiny"]:    # random weights: save them rather than trust a seed
        base = {k: v.contiguous() for k, v in model.body.state_dict().items()
                if not k.endswith(("down.weight", "up.weight"))}
        save_file(base, str(folder / "base.safetensors"))
    config = {**model.settings, "base_fingerprint": base_fingerprint(model)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def load_reward_model(path, device="cpu"):
    """A saved RewardModel, frozen and in eval mode, its normalisation shift included."""
    path = Path(path)
    needed = ["config.json", "adapter.safetensors", "head.safetensors"]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a reward model folder (missing {missing}); "
                                "train one with `python reward_model.py --out DIR`")
    settings = json.loads((path / "config.json").read_text())
    expected = settings.pop("base_fingerprint")
    model, _ = build_reward_model(settings, device)
    if settings["tiny"]:
        base = load_file(str(path / "base.safetensors"), device=str(device))
        model.body.load_state_dict(base, strict=False)
    if abs(base_fingerprint(model) - expected) > 1e-6 * max(1.0, abs(expected)):
        raise ValueError(f"{path} was trained on other weights of {settings['base_model']} "
                         f"({settings['resolved_from']}); load the same copy (offline: "
                         "HF_HUB_OFFLINE=1 selects the embedded one) or retrain")
    lora.load_adapter(model.body, path / "adapter.safetensors")
    head = load_file(str(path / "head.safetensors"), device=str(device))
    model.head.weight.data.copy_(head["head.weight"])
    model.head.bias.data.copy_(head["head.bias"])
    model.bias.copy_(head["bias"][0])
    return loaders.freeze(model)


# ------------------------------------------------------------------ data

def prepare_pairs(tokenizer, comparisons, config):
    """Comparisons -> {post_id, chosen, rejected (id lists), chosen_len, rejected_len}.

    Lengths are in tokens of the full summary, before any cut; they feed the length
    baseline. A post whose title alone exceeds the prompt budget is dropped.
    """
    prompts, pairs = {}, []
    for c in comparisons:
        if c["post_id"] not in prompts:
            prompts[c["post_id"]] = loaders.fit_prompt(tokenizer, c, config.max_prompt_tokens)
        if prompts[c["post_id"]] is None:
            continue
        pair = {"post_id": c["post_id"], "prompt": prompts[c["post_id"]]}
        for side in ("chosen", "rejected"):
            pair[side] = encode(tokenizer, pair["prompt"], c[side], config.max_summary_tokens)
            pair[side + "_len"] = len(tokenizer(" " + c[side]).input_ids)
        pairs.append(pair)
    if len(pairs) < len(comparisons):
        print(f"dropped {len(comparisons) - len(pairs)} comparisons whose title alone "
              f"exceeds {config.max_prompt_tokens} tokens")
    return pairs


def human_references(heldout, data_dir):
    """One human-written TL;DR per held-out post: [(post, summary)], and where they came from.

    Stiennon et al. shift the scores so the dataset's reference summaries average 0. Ours
    are the held-out posts' own author TL;DRs, never trained on, from two places: the
    comparisons' summaries whose policy is "ref" (the human TL;DR, batch18), and the TL;DR
    file's posts whose title matches a held-out post. The union covers the most posts.
    """
    posts = {c["post_id"]: c for c in heldout}
    found, sources = {}, {"comparisons": 0, "tldr_file": 0}
    for c in heldout:
        for side in ("chosen", "rejected"):
            if c[side + "_policy"] == "ref" and c["post_id"] not in found:
                found[c["post_id"]] = c[side]
                sources["comparisons"] += 1
    try:
        by_title = {p["title"].strip(): p["summary"] for p in loaders.load_tldr(data_dir)}
    except loaders.DataError as error:
        print(f"no TL;DR file for normalisation ({error}); using the comparisons' only")
        by_title = {}
    for post_id, c in posts.items():
        if post_id not in found and c["title"].strip() in by_title:
            found[post_id] = by_title[c["title"].strip()]
            sources["tldr_file"] += 1
    return [(posts[i], s) for i, s in found.items()], sources


# ------------------------------------------------------------------ training

def train_step(model, optimizer, batch):
    """One AdamW step of (R1) on a list of pairs. Returns (loss, accuracy) of the batch."""
    k = len(batch)
    # Chosen and rejected of every pair in one forward pass, padded on the right.
    ids, mask = pad_right([p["chosen"] for p in batch] + [p["rejected"] for p in batch],
                          model.settings["pad_id"], model.head.weight.device)  # (2k, L)
    scores = model(ids, mask)                                                # (2k,)
    r_w, r_l = scores[:k], scores[k:]                                        # (k,), (k,)
    loss = bt_loss(r_w, r_l)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]],
                                   1.0)
    optimizer.step()
    return loss.item(), pairwise_accuracy(r_w.detach(), r_l.detach())


def make_optimizer(model, config):
    """AdamW: the adapter at `lr`, the new head at the larger `head_lr`; the base is frozen."""
    adapter = [p for p in model.body.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": adapter, "lr": config.lr},
                              {"params": model.head.parameters(), "lr": config.head_lr}],
                             weight_decay=0.0)


def train(model, pairs, config):
    """`epochs` passes of (R1) over length-bucketed batches. Returns per-step losses, accs."""
    optimizer = make_optimizer(model, config)
    rng = random.Random(config.seed)
    by_length = sorted(pairs, key=lambda p: max(len(p["chosen"]), len(p["rejected"])))
    batches = [by_length[i:i + config.batch_pairs]       # similar lengths, little padding
               for i in range(0, len(by_length), config.batch_pairs)]
    steps = config.epochs * len(batches)
    # Linear warm-up over the first 5% of steps, then linear decay to 0.
    warm = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, (steps - s) / max(1, steps - warm)))
    losses, accs = [], []
    bar = tqdm(total=steps, desc="train", unit="step")
    for _ in range(config.epochs):
        rng.shuffle(batches)                               # batch order, not contents
        for batch in batches:
            loss, acc = train_step(model, optimizer, batch)
            schedule.step()
            losses.append(loss)
            accs.extend([acc] * len(batch))
            bar.update()
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                            acc=f"{sum(accs) / len(accs):.3f}")
    bar.close()
    return losses, accs


# ------------------------------------------------------------------ evaluation and report

def evaluate(model, pairs, config):
    """Held-out scores, accuracy, its Wilson interval and the two length checks."""
    n = len(pairs)
    scores = score_sequences(model, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
                             config.eval_batch, progress=True)            # (2n,)
    r_w, r_l = scores[:n], scores[n:]                                     # (n,), (n,)
    accuracy = pairwise_accuracy(r_w, r_l)
    low, high = wilson_interval(accuracy, n)
    len_w = torch.tensor([p["chosen_len"] for p in pairs])                # (n,) tokens
    len_l = torch.tensor([p["rejected_len"] for p in pairs])              # (n,) tokens
    shorter = len_w < len_l                                               # (n,) bool
    metrics = {
        "heldout_accuracy": accuracy, "wilson_low": low, "wilson_high": high,
        "heldout_pairs": n,
        # "The longer summary wins", length in tokens; equal lengths count one half.
        "length_baseline_accuracy": pairwise_accuracy(len_w.float(), len_l.float()),
        "shorter_preferred_accuracy": (pairwise_accuracy(r_w[shorter], r_l[shorter])
                                       if shorter.any() else float("nan")),
    }
    extra = {"shorter_preferred_pairs": int(shorter.sum()),
             "length_ties": int((len_w == len_l).sum()),
             "score_length_correlation": float(torch.corrcoef(torch.stack(
                 [torch.cat([r_w, r_l]), torch.cat([len_w, len_l]).float()]))[0, 1])}
    return metrics, extra, (r_w, r_l)


def verdict(metrics):
    """One plain sentence on chance and on the length baseline."""
    lines = [("above chance: the Wilson lower bound is above 0.5" if metrics["wilson_low"] > 0.5
              else "NOT distinguishable from chance: the Wilson lower bound is <= 0.5")]
    base = metrics["length_baseline_accuracy"]
    if base < metrics["wilson_low"]:
        lines.append("it beats the length baseline (the baseline is below its interval)")
    elif base > metrics["wilson_high"]:
        lines.append("it does NOT beat 'the longer summary wins': that is a finding, not a "
                     "bug; with this data and budget the model learned less than length")
    else:
        lines.append("it is not distinguishable from 'the longer summary wins' (the "
                     "baseline lies inside its interval)")
    return "; ".join(lines)


def plot(losses, margins, folder):
    """loss.png: the training loss per step; margins.png: held-out r_w - r_l."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    window = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, alpha=0.3, label="per step")
    ax.plot(smooth, label=f"mean of {window}")
    ax.axhline(math.log(2), color="grey", ls=":", label="log 2 (chance)")
    ax.set(xlabel="step", ylabel="Bradley-Terry loss (R1)", title="reward model training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(margins.numpy(), bins=40)
    ax.axvline(0, color="black", lw=1)
    ax.set(xlabel="r(x, y_w) - r(x, y_l)", ylabel="held-out comparisons",
           title=f"held-out margins: {(margins > 0).float().mean():.1%} right of 0")
    fig.tight_layout()
    fig.savefig(folder / "margins.png", dpi=120)
    plt.close("all")


def staging_folder(out):
    """A fresh hidden folder beside `out`, made now so an unwritable --out fails at once."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file; pass a folder path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as error:
        raise SystemExit(f"error: cannot write next to --out {out} ({error}); "
                         "pass --out to a folder you can write") from error


def publish(staging, out):
    """Move the finished folder into place; an older `out` is replaced, not merged."""
    out = Path(out).resolve()
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    staging.chmod(0o755)                          # mkdtemp made it private (0700)
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv=None):
    start = time.time()
    config = parse_config(argv)
    print(f"preset {config.preset}: " + ", ".join(
        f"{k}={v}" for k, v in asdict(config).items() if k in PRESETS[config.preset])
        + "\nsettings: " + ", ".join(f"{k}={v}" for k, v in asdict(config).items()))
    staging = staging_folder(config.out)
    try:
        metrics = run(config, staging, start)
        publish(staging, config.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)     # nothing half-written is left
        raise
    print(f"saved to {config.out}/ in {metrics['seconds']:.0f} s")


def run(config, staging, start):
    device = loaders.pick_device()
    try:
        comparisons = loaders.load_comparisons(config.data_dir or None)
    except loaders.DataError as error:
        raise SystemExit(f"error: {error}\nPoint --data-dir at a folder holding "
                         "summarize_from_feedback_comparisons/batch*.json") from error
    train_c, heldout_c = split_comparisons(comparisons, config.heldout_fraction, config.seed)
    if len(heldout_c) < config.min_heldout_pairs:
        raise SystemExit(f"error: only {len(heldout_c)} comparisons held out, fewer than "
                         f"{config.min_heldout_pairs}; raise --heldout-fraction")
    random.Random(config.seed).shuffle(train_c)
    train_c = train_c[:config.max_pairs or None]
    heldout_eval = heldout_c[:config.max_heldout_pairs or None]

    settings = {"base_model": config.model, "tiny": config.preset == "tiny",
                "seed": config.seed, "lora_r": config.lora_r, "lora_alpha": config.lora_alpha,
                "max_prompt_tokens": config.max_prompt_tokens,
                "max_summary_tokens": config.max_summary_tokens,
                "resolved_from": (loaders.POLICY_NAME + " (tiny, random)" if
                                  config.preset == "tiny" else
                                  loaders.resolve_model(config.model)[0])}
    model, tokenizer = build_reward_model(settings, device)
    model.settings.update(pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                          hidden_size=model.body.config.hidden_size)
    trainable, total = lora.count_parameters(model)
    print(f"reward model: {trainable:,} trainable of {total:,} parameters on {device}")

    train_pairs = prepare_pairs(tokenizer, train_c, config)
    heldout_pairs = prepare_pairs(tokenizer, heldout_eval, config)
    if not train_pairs or not heldout_pairs:
        raise SystemExit(f"error: {len(train_pairs)} training and {len(heldout_pairs)} "
                         "held-out comparisons; both need at least one")
    print(f"{len(comparisons)} comparisons over {len({c['post_id'] for c in comparisons})} "
          f"posts: training on {len(train_pairs)}, evaluating on {len(heldout_pairs)} "
          f"held-out comparisons ({len({c['post_id'] for c in heldout_c})} posts never "
          f"trained on)")
    losses, accs = train(model, train_pairs, config)

    # (R3) the shift that makes the held-out posts' human TL;DRs score 0 on average.
    references, sources = human_references(heldout_c, config.data_dir or None)
    if references:
        print(f"normalising on {len(references)} human TL;DRs of held-out posts "
              f"({sources['comparisons']} from the comparisons, {sources['tldr_file']} "
              "from the TL;DR file)")
        fitted = [(loaders.fit_prompt(tokenizer, p, config.max_prompt_tokens), s)
                  for p, s in references]                 # cut as the training posts were
        raw = score_sequences(model, [encode(tokenizer, p, s, config.max_summary_tokens)
                                      for p, s in fitted if p], config.eval_batch)
    else:
        print("WARNING: no human TL;DR of any held-out post; normalising on the preferred "
              "held-out summaries instead, so 0 means 'a typical preferred summary'")
        raw = score_sequences(model, [p["chosen"] for p in heldout_pairs], config.eval_batch)
        sources = {"heldout_chosen": len(raw)}
    model.bias.fill_(-raw.mean().item())

    metrics, extra, (r_w, r_l) = evaluate(model, heldout_pairs, config)
    metrics["train_pairs"] = len(train_pairs)
    extra.update(preset=config.preset, normalisation_bias=model.bias.item(),
                 normalisation_sources=sources, final_train_accuracy=sum(accs) / len(accs),
                 # the first held-out pair's normalised scores, for the round-trip test
                 probe={"post_id": heldout_pairs[0]["post_id"],
                        "scores": [r_w[0].item(), r_l[0].item()]})
    save_reward_model(model, staging)
    plot(losses, r_w - r_l, staging)
    metrics["seconds"] = time.time() - start
    (staging / "metrics.json").write_text(json.dumps({**metrics, "extra": extra}, indent=2))
    print(f"\nheld-out accuracy  {metrics['heldout_accuracy']:.3f}  (Wilson 95% "
          f"{metrics['wilson_low']:.3f} to {metrics['wilson_high']:.3f}, "
          f"{metrics['heldout_pairs']} pairs)\n"
          f"length baseline    {metrics['length_baseline_accuracy']:.3f}  (longer summary "
          f"in tokens wins; {extra['length_ties']} ties count one half)\n"
          f"shorter preferred  {metrics['shorter_preferred_accuracy']:.3f}  (model, on the "
          f"{extra['shorter_preferred_pairs']} pairs where the shorter summary won)\n"
          f"trained on {metrics['train_pairs']} pairs, {metrics['seconds']:.0f} s in all\n"
          f"verdict: {verdict(metrics)}")
    return metrics


if __name__ == "__main__":
    sys.exit(main())
