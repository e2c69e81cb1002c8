"""A Bradley-Terry reward model fitted to human comparisons of TL;DR summaries.

The post takes its reward model off the shelf (section "The four models": it "reads a
post and a summary of it, returns one number"). This file trains one instead, from the
human comparisons Stiennon et al. collected on this same Reddit data; `ppo.py` loads it.

The model is the policy's base LM (SmolLM2-135M-Instruct without its LM head), the post's
LoRA adapter (`lora.py`: rank 16, alpha 32, on q_proj and v_proj) and a scalar linear head
read at the EOS that ends "post + TL;DR: + summary". It shares the policy's tokenizer, so
PPO scores the sampled ids directly. The post numbers no reward-model equation, so the
ones here are R1-R4 (R1 is Stiennon et al.'s eq. 1):
    (R1) L = -log sigmoid(r(x, y_w) - r(x, y_l))        y_w preferred over y_l by a person
    (R2) r(x, y) = w . h_T + b,   w, b ~ N(0, 1/sqrt(d+1)) as a std, d the hidden width
    (R3) r_hat(x, y) = r(x, y) + bias,   bias = -mean of r over human TL;DRs (held-out posts)
    (R4) the Wilson 95% interval of the held-out pairwise accuracy
R1 sees only the difference of two scores: add a constant to every score and the loss
does not change. The origin of the scale is arbitrary; R3 fixes it after training.

Papers:
  Bradley & Terry 1952, "Rank analysis of incomplete block designs I" (the pairwise model)
  Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2 (a reward model from comparisons, for PPO)
  Stiennon et al. 2020, arXiv:2009.01325, sec. 3.4 "Reward models" (eq. 1; one epoch;
      shift so the reference summaries score 0 on average), sec. 4.1 and 4.3 (length as a
      confound), appendix (head drawn from N(0, 1/sqrt(d_model + 1)))
  Hu et al. 2021, arXiv:2106.09685, sec. 4.1 (LoRA)
  Wilson 1927, "Probable inference, the law of succession, and statistical inference"

Departures from Stiennon et al. (each repeated at its line):
  1. A LoRA adapter on a frozen LM, not full fine-tuning of a supervised TL;DR model.
     The `cpu` preset puts it on the top 8 of 30 layers only, so backpropagation stops
     there; `blog` uses every layer, as the post does.
  2. ~1.8k comparisons from OpenAI's two small offline batches, not 64k. Posts are held
     out by id: no held-out post is ever trained on.
  3. The score is read at the last real token (the EOS we append), found from the mask,
     with positions counted from the first real token: left and right padding agree.
  4. Prompts are cut to a token budget with `loaders.fit_prompt` (cpu: 128 tokens, blog:
     512 as Stiennon) and summaries to 48 tokens, the post's sampling length.
  5. R3 averages over the held-out posts' human TL;DRs, not the whole dataset's.
Speed, exact: a pair's two summaries share one pass over their prompt (its keys and values
are cached and copied), which causal attention makes identical to two full passes (tested).

Run:   python reward_model.py                 (cpu preset: 15 min on a shared 2-core CPU)
       python reward_model.py --preset tiny   (toy model, seconds)
Test:  python -m pytest -q tests/test_reward_model.py
Use:   model = load_reward_model("runs/reward_model"); r = score_ids(model, p, pm, y, ym)
"""
import argparse
import inspect
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# Before torch loads OpenMP: on a shared CPU, threads that spin while they wait for each
# other lose ~10x (measured here: 40-70 s per step against 11 s, with two other busy
# processes); threads that sleep cost nothing measurable on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import loaders  # noqa: E402
import lora  # noqa: E402
from gae import last_token_index  # noqa: E402
from loaders import option  # noqa: E402
from report import publish  # noqa: E402


@dataclass
class Config:
    """Every setting, with its help string. Defaults are the `blog` preset's."""
    preset: str = option("", "blog | cpu | tiny (default: blog with CUDA or MPS, else cpu)")
    out: str = option("runs/reward_model", "output folder, replaced only when a run completes")
    seed: int = option(0, "seed for the head, the adapter, the pair subset and the split")
    epochs: int = option(1, "passes over the training pairs (Stiennon et al.: 1)")
    max_pairs: int = option(0, "train on at most this many comparisons (a seeded random "
                               "subset); 0 = all")
    batch_pairs: int = option(8, "comparisons per optimizer step (2 rows each)")
    lr: float = option(3e-4, "AdamW learning rate of the LoRA adapter (usual LoRA range)")
    head_lr: float = option(5e-4, "AdamW learning rate of the scalar head")
    lora_layers: int = option(0, "put the adapter on the top N layers only; 0 = every "
                                 "layer (the post's)")
    max_prompt_tokens: int = option(512, "cut each post to fit this many prompt tokens "
                                         "(Stiennon et al.: 512)")
    max_summary_tokens: int = option(48, "cut each summary to this many tokens before the "
                                         "EOS (the post samples 48)")
    heldout_fraction: float = option(0.25, "fraction of post ids held out for evaluation")
    min_heldout_pairs: int = option(300, "stop with an error if fewer comparisons are held out")
    max_heldout_pairs: int = option(0, "evaluate on at most this many held-out "
                                       "comparisons; 0 = all")
    eval_batch: int = option(32, "summaries per forward pass when scoring")
    model: str = loaders.POLICY_NAME             # --model and --data-dir come from loaders
    data_dir: str = ""


# Named override sets, printed at start-up; the defaults above are `blog`.
PRESETS = {
    "blog": {},                                  # every pair, one epoch, CUDA or MPS
    # Measured on a 2-core CPU shared with other jobs: 162 steps of 8 pairs in 12 min
    # (2.8 s a step when idle), 15 min in all with evaluation; about 10 min when idle.
    "cpu": {"max_prompt_tokens": 128, "lora_layers": 8},
    "tiny": {"max_pairs": 16, "batch_pairs": 4, "max_prompt_tokens": 64, "lora_layers": 1,
             "max_summary_tokens": 24, "min_heldout_pairs": 0, "max_heldout_pairs": 32},
}


def parse_config(argv=None):
    """Defaults, then the preset's overrides, then the flags given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    loaders.add_common_args(parser)
    for f in fields(Config):
        if f.name not in ("model", "data_dir"):
            extra = {"choices": list(PRESETS)} if f.name == "preset" else {}
            parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                                default=None, help=f.metadata["help"], **extra)
    args = vars(parser.parse_args(argv))
    preset = args["preset"] or loaders.default_preset()
    config = Config(**{**PRESETS[preset], "preset": preset})
    for name, value in args.items():
        if value is not None:
            setattr(config, name, value)
    return config


# ------------------------------------------------------------------ the math (pure)

def bt_loss(r_w, r_l):
    """Mean Bradley-Terry loss over comparisons. r_w, r_l: (N,) scores of y_w and y_l."""
    # (R1)  L = -log sigmoid(r(x, y_w) - r(x, y_l))      only the difference enters
    return -F.logsigmoid(r_w - r_l).mean()


def pairwise_accuracy(r_w, r_l):
    """Fraction of comparisons ranked right; an exact tie counts one half."""
    return ((r_w > r_l).double() + 0.5 * (r_w == r_l).double()).mean().item()


def wilson_interval(accuracy, n, z=1.96):
    """(low, high): the Wilson score interval of a proportion; z = 1.96 for 95%."""
    if n == 0:
        return 0.0, 1.0
    # (R4)  (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    centre = accuracy + z * z / (2 * n)
    spread = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n), (centre + spread) / (1 + z * z / n)


def split_comparisons(comparisons, heldout_fraction, seed=0):
    """(train, held-out) split by post id: every comparison of one post lands on one side."""
    return loaders.split_by_id(comparisons, "post_id", heldout_fraction, seed)


# ------------------------------------------------------------------ the model

def pad(sequences, pad_id, side, device):
    """Lists of ids -> (ids, mask), both (B, L) long, padded on `side`; mask 1 = real."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)    # (B, L)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)            # (B, L)
    for i, seq in enumerate(sequences):
        cols = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
        ids[i, cols], mask[i, cols] = torch.tensor(seq, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


class RewardModel(nn.Module):
    """LM body with LoRA, a scalar head (R2) and the normalisation shift `bias` (R3)."""

    def __init__(self, body, settings):
        super().__init__()
        self.body = body                         # LlamaModel (no LM head) with the adapter
        self.settings = settings                 # what config.json records
        d = body.config.hidden_size
        self.head = nn.Linear(d, 1, device=body.embed_tokens.weight.device)
        # (R2)  w, b ~ N(0, 1/sqrt(d+1)), the second argument a std (Stiennon, appendix)
        nn.init.normal_(self.head.weight, std=1 / math.sqrt(d + 1))
        nn.init.normal_(self.head.bias, std=1 / math.sqrt(d + 1))
        self.register_buffer("bias", torch.zeros((), device=self.head.weight.device))

    def forward(self, input_ids, attention_mask):
        """Normalised scores (B,) fp32 of (B, L) ids, read at each row's last real token.

        Real tokens may sit anywhere: after left padding (PPO's prompts), before right
        padding (training), or both (a left-padded prompt, then a response that stopped).
        """
        # Departure 3: positions from the mask, so the padding side does not matter.
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=loaders.positions(attention_mask),
                           use_cache=False).last_hidden_state              # (B, L, d)
        return self.read_score(hidden, attention_mask)

    def forward_shared(self, prompts, summaries, owner):
        """Scores (N,) of N summaries that follow M prompts, reading each prompt once.

        prompts: M id lists; summaries: N id lists, each ending in EOS; owner: (N,) long,
        the prompt each summary follows. Exact: attention is causal, so a prompt's keys and
        values do not depend on what comes after it. They are computed once, copied to each
        of its summaries, and the scores equal `forward` on the concatenations.
        """
        device = self.head.weight.device
        prompt_ids, prompt_mask = pad(prompts, self.settings["pad_id"], "left", device)
        summary_ids, summary_mask = pad(summaries, self.settings["pad_id"], "right", device)
        owner = owner.to(device)                                           # (N,)
        cache = DynamicCache()
        # transformers 5 calls the argument `cache`, 4.x `past_key_values`; both are allowed.
        name = "cache" if "cache" in inspect.signature(self.body.forward).parameters \
            else "past_key_values"
        self.body(input_ids=prompt_ids, attention_mask=prompt_mask,        # (M, P) left
                  position_ids=loaders.positions(prompt_mask), use_cache=True, **{name: cache})
        cache.reorder_cache(owner)               # every layer's K, V: (M, ...) -> (N, ...)
        mask = torch.cat([prompt_mask[owner], summary_mask], dim=1)         # (N, P + S)
        hidden = self.body(input_ids=summary_ids, attention_mask=mask,      # (N, S) right
                           position_ids=loaders.positions(mask)[:, prompt_ids.shape[1]:],
                           use_cache=True, **{name: cache}).last_hidden_state  # (N, S, d)
        return self.read_score(hidden, summary_mask)

    def read_score(self, hidden, mask):
        """(R2) and (R3) at the last column where mask is 1. hidden (B, L, d) -> (B,)."""
        last = last_token_index(mask)            # (B,); ValueError if a row has no real token
        h_T = hidden[torch.arange(len(last), device=last.device), last]     # (B, d)
        # (R2)  r(x, y) = w . h_T + b
        raw = self.head(h_T).squeeze(-1).float()                            # (B,)
        # (R3)  r_hat = r + bias       (bias stays 0 until training has finished)
        return raw + self.bias                                              # (B,)


def build_reward_model(settings, device="cpu"):
    """A fresh RewardModel (adapter a no-op, head random) and the policy's tokenizer.

    Seeded from settings["seed"] without touching the caller's random state (PPO loads
    this model after seeding its own run).
    """
    lm, tokenizer = loaders.load_policy_and_tokenizer(
        settings["base_model"], preset="tiny" if settings["tiny"] else None,
        device=device, seed=settings["seed"])
    with torch.random.fork_rng():
        torch.manual_seed(settings["seed"])
        # Departure 1: the adapter of `lora.with_lora` on the top `lora_layers` layers only
        # (0 = all). Below them nothing needs a gradient, so backpropagation stops there.
        lora.with_lora(lm, settings["lora_r"], settings["lora_alpha"], settings["lora_layers"])
        model = RewardModel(lm.model, settings)
    # Dropout is off: the body stays in eval mode even while it trains (Llama's only
    # dropout, on attention, is 0 anyway), so a summary scores the same here and in PPO.
    return model.eval(), tokenizer


# ------------------------------------------------------------------ tokens and scoring

def encode(tokenizer, prompt, summary, max_summary_tokens):
    """(prompt ids, summary ids + EOS), laid out exactly as PPO produces them.

    PPO tokenizes the prompt alone and then samples response ids, which usually start
    with a space token. So the prompt and " " + summary are tokenized separately, never as
    one string: BPE would merge across the seam and train on a layout PPO never shows.
    """
    summary_ids = tokenizer(" " + summary).input_ids[:max_summary_tokens]
    return tokenizer(prompt).input_ids, summary_ids + [tokenizer.eos_token_id]


def fit_prompt_text(tokenizer, prompt, max_tokens):
    """A prompt string cut to `max_tokens` as training cut it (`loaders.fit_prompt`)."""
    if len(tokenizer(prompt).input_ids) <= max_tokens:
        return prompt
    parsed = loaders.parse_prompt(prompt)
    fitted = parsed and loaders.fit_prompt(tokenizer, parsed, max_tokens)
    if not fitted:
        raise ValueError(f"cannot cut this prompt to {max_tokens} tokens: it must read "
                         "'SUBREDDIT: r/...TITLE: ...POST: ...TL;DR:' with a short title")
    return fitted


@torch.no_grad()
def score_grouped(model, prompts, summaries, batch_rows=32, progress=False):
    """Scores (N,) of summaries[i] after prompts[i] (id lists), on the CPU.

    Each distinct prompt is read once and each distinct (prompt, summary) scored once;
    prompts of similar length share a batch of about `batch_rows` summaries.
    """
    groups = {}                                  # prompt -> its distinct summaries, in order
    for p, s in zip(prompts, summaries):
        groups.setdefault(tuple(p), {})[tuple(s)] = None
    batches, batch, rows = [], [], 0
    for p in sorted(groups, key=len):
        batch, rows = batch + [p], rows + len(groups[p])
        if rows >= batch_rows:
            batches, batch, rows = batches + [batch], [], 0
    batches += [batch] if batch else []
    scores = {}
    for batch in tqdm(batches, desc="score", unit="batch", disable=not progress, leave=False):
        rows = [(i, s) for i, p in enumerate(batch) for s in groups[p]]
        got = model.forward_shared(batch, [s for _, s in rows],
                                   torch.tensor([i for i, _ in rows]))      # (rows,)
        scores.update(zip([(batch[i], s) for i, s in rows], got.cpu().tolist()))
    return torch.tensor([scores[tuple(p), tuple(s)] for p, s in zip(prompts, summaries)])


@torch.no_grad()
def score_ids(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """PPO's entry point: normalised scores (B,) of sampled ids, with no decode/re-encode.

    prompt_ids, prompt_mask: (B, P), left-padded. response_ids, response_mask: (B, T), the
    mask 1 up to and including the first EOS. The score is read at the last real token:
    the response's EOS, or its last token when it hit the length limit (a layout training
    never shows, since every training summary ends in EOS).
    """
    ids = torch.cat([prompt_ids, response_ids], dim=1)                      # (B, P + T)
    mask = torch.cat([prompt_mask, response_mask], dim=1)                   # (B, P + T)
    return model(ids, mask)                                                 # (B,)


@torch.no_grad()
def score_texts(model, tokenizer, prompts, summaries, max_prompt_tokens=None, batch_rows=32):
    """Normalised scores (B,) of written summaries (human TL;DRs), tokenized as in training."""
    budget = max_prompt_tokens or model.settings["max_prompt_tokens"]
    encoded = [encode(tokenizer, fit_prompt_text(tokenizer, p, budget), s,
                      model.settings["max_summary_tokens"]) for p, s in zip(prompts, summaries)]
    return score_grouped(model, [p for p, _ in encoded], [s for _, s in encoded], batch_rows)


# ------------------------------------------------------------------ saving and loading

def base_fingerprint(model):
    """A checksum of the frozen base, to catch an adapter loaded onto other weights."""
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
    settings = {**model.settings, "base_fingerprint": base_fingerprint(model)}
    (folder / "config.json").write_text(json.dumps(settings, indent=2))


def load_reward_model(path, device="cpu"):
    """A saved RewardModel, frozen, in eval mode, its normalisation shift included."""
    path = Path(path)
    missing = [n for n in ("config.json", "adapter.safetensors", "head.safetensors")
               if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not a reward model folder (missing {missing}); "
                                "train one with `python reward_model.py --out DIR`")
    settings = json.loads((path / "config.json").read_text())
    expected = settings.pop("base_fingerprint")
    model, _ = build_reward_model(settings, device)
    if settings["tiny"]:
        model.body.load_state_dict(load_file(str(path / "base.safetensors"),
                                             device=str(device)), strict=False)
    if abs(base_fingerprint(model) - expected) > 1e-6 * max(1.0, abs(expected)):
        raise ValueError(f"{path} was trained on other weights of {settings['base_model']} "
                         f"({settings['resolved_from']}); load that copy (HF_HUB_OFFLINE=1 "
                         "selects the embedded one) or retrain")
    lora.load_adapter(model.body, path / "adapter.safetensors")
    head = load_file(str(path / "head.safetensors"), device=str(device))
    with torch.no_grad():
        model.head.weight.copy_(head["head.weight"])
        model.head.bias.copy_(head["head.bias"])
        model.bias.copy_(head["bias"][0])
    return loaders.freeze(model)


# ------------------------------------------------------------------ data

def prepare_pairs(tokenizer, comparisons, config):
    """Comparisons -> [{post_id, prompt, chosen, rejected (id lists), *_len (tokens)}].

    The lengths are of the whole summary, before any cut; they feed the length baseline.
    A post whose title alone exceeds the prompt budget is dropped.
    """
    prompts, pairs = {}, []
    for c in comparisons:
        if c["post_id"] not in prompts:
            prompts[c["post_id"]] = loaders.fit_prompt(tokenizer, c, config.max_prompt_tokens)
        if prompts[c["post_id"]] is None:
            continue
        pair = {"post_id": c["post_id"]}
        for side in ("chosen", "rejected"):
            pair["prompt"], pair[side] = encode(tokenizer, prompts[c["post_id"]], c[side],
                                                config.max_summary_tokens)
            pair[side + "_len"] = len(tokenizer(" " + c[side]).input_ids)
        pairs.append(pair)
    if len(pairs) < len(comparisons):
        print(f"dropped {len(comparisons) - len(pairs)} comparisons whose title alone "
              f"exceeds {config.max_prompt_tokens} tokens")
    return pairs


def human_references(heldout, data_dir):
    """One human-written TL;DR per held-out post: ([(post, summary)], counts by source).

    Stiennon et al. shift scores so the dataset's reference summaries average 0. Ours are
    the held-out posts' own author TL;DRs, never trained on, from two places: summaries
    of policy "ref" in the comparisons (batch18), then the TL;DR file's posts whose title
    matches a held-out post. Together they cover the most posts (~95 here).
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

def make_optimizer(model, config):
    """AdamW on the adapter (`lr`) and the head (`head_lr`); the base stays frozen."""
    adapter = [p for p in model.body.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": adapter, "lr": config.lr},
                              {"params": model.head.parameters(), "lr": config.head_lr}],
                             weight_decay=0.0)


def train_step(model, optimizer, batch):
    """One AdamW step of (R1) on a list of k pairs. Returns the batch's (loss, accuracy)."""
    k = len(batch)
    owner = torch.arange(k).repeat(2)            # (2k,) rows 0..k-1 chosen, k..2k-1 rejected
    scores = model.forward_shared([p["prompt"] for p in batch],
                                  [p["chosen"] for p in batch] + [p["rejected"] for p in batch],
                                  owner)                                    # (2k,)
    r_w, r_l = scores[:k], scores[k:]                                       # (k,), (k,)
    loss = bt_loss(r_w, r_l)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(
        [p for group in optimizer.param_groups for p in group["params"]], 1.0)
    optimizer.step()
    return loss.item(), pairwise_accuracy(r_w.detach(), r_l.detach())


def train(model, pairs, config):
    """`epochs` passes of (R1) over length-bucketed batches. Returns per-step losses."""
    optimizer = make_optimizer(model, config)
    longest = lambda p: len(p["prompt"]) + max(len(p["chosen"]), len(p["rejected"]))
    ordered = sorted(pairs, key=longest)         # similar lengths per batch: little padding
    batches = [ordered[i:i + config.batch_pairs]
               for i in range(0, len(ordered), config.batch_pairs)]
    steps, warm = config.epochs * len(batches), max(1, config.epochs * len(batches) // 20)
    # Linear warm-up over the first 5% of steps, then linear decay to 0.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, (steps - s) / max(1, steps - warm)))
    rng, losses, right, seen = random.Random(config.seed), [], 0.0, 0
    with tqdm(total=steps, desc="train", unit="step") as bar:
        for _ in range(config.epochs):
            rng.shuffle(batches)                 # shuffles the order of batches, each epoch
            for batch in batches:
                loss, accuracy = train_step(model, optimizer, batch)
                schedule.step()
                losses.append(loss)
                right, seen = right + accuracy * len(batch), seen + len(batch)
                recent = losses[-20:]
                bar.update()
                bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}",
                                acc=f"{right / seen:.3f}")
    return losses, right / seen


# ------------------------------------------------------------------ evaluation and report

def evaluate(model, pairs, config):
    """Held-out accuracy, its Wilson interval, the length checks; and the scores."""
    n = len(pairs)
    scores = score_grouped(model, [p["prompt"] for p in pairs] * 2,
                           [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
                           config.eval_batch, progress=True)               # (2n,)
    r_w, r_l = scores[:n], scores[n:]                                       # (n,), (n,)
    accuracy = pairwise_accuracy(r_w, r_l)
    low, high = wilson_interval(accuracy, n)
    len_w = torch.tensor([p["chosen_len"] for p in pairs])                  # (n,) tokens
    len_l = torch.tensor([p["rejected_len"] for p in pairs])                # (n,) tokens
    shorter = len_w < len_l                                                 # (n,) bool
    metrics = {
        "heldout_accuracy": accuracy, "wilson_low": low, "wilson_high": high,
        "heldout_pairs": n,
        # "The longer summary wins", in tokens of the full summary; a tie counts one half.
        "length_baseline_accuracy": pairwise_accuracy(len_w, len_l),
        "shorter_preferred_accuracy": (pairwise_accuracy(r_w[shorter], r_l[shorter])
                                       if shorter.any() else float("nan")),
    }
    both = torch.stack([torch.cat([r_w, r_l]), torch.cat([len_w, len_l]).float()])  # (2, 2n)
    extra = {"shorter_preferred_pairs": int(shorter.sum()),
             "length_ties": int((len_w == len_l).sum()),
             "score_length_correlation": torch.corrcoef(both)[0, 1].item()}
    return metrics, extra, r_w, r_l


def verdict(metrics):
    """Plain words on chance and on the length baseline."""
    said = ["above chance (Wilson lower bound > 0.5)" if metrics["wilson_low"] > 0.5 else
            "NOT distinguishable from chance (Wilson lower bound <= 0.5)"]
    base = metrics["length_baseline_accuracy"]
    if base < metrics["wilson_low"]:
        said.append("it beats 'the longer summary wins'")
    elif base > metrics["wilson_high"]:
        said.append("it does NOT beat 'the longer summary wins'. That is a finding, not a "
                    "failure: on this data and budget, length alone predicts people better")
    else:
        said.append("it cannot be told apart from 'the longer summary wins' (the baseline "
                    "lies inside its interval)")
    if metrics["shorter_preferred_accuracy"] < 0.5:
        said.append(f"where people preferred the shorter summary it is right only "
                    f"{metrics['shorter_preferred_accuracy']:.0%} of the time, so it leans "
                    "on length")
    return "; ".join(said)


def plot(losses, margins, folder):
    """loss.png: the loss of each training step; margins.png: held-out r(y_w) - r(y_l)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    w = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - w + 1):i + 1]) / min(w, i + 1) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, alpha=0.3, label="each step")
    ax.plot(smooth, label=f"mean of {w} steps")
    ax.axhline(math.log(2), color="grey", ls=":", label="log 2 (a coin)")
    ax.set(xlabel="step", ylabel="Bradley-Terry loss (R1)", title="reward model training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(margins.numpy(), bins=40)
    ax.axvline(0, color="black", lw=1)
    ax.set(xlabel="r(x, y_w) - r(x, y_l)", ylabel="held-out comparisons",
           title=f"held-out margins: {(margins > 0).double().mean():.1%} above 0")
    fig.tight_layout()
    fig.savefig(folder / "margins.png", dpi=120)
    plt.close("all")


def staging_folder(out):
    """A fresh hidden folder beside `out`, made first so an unwritable --out fails at once."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file; pass a folder path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as error:
        raise SystemExit(f"error: cannot write next to --out {out} ({error}); "
                         "pass --out a folder you can write to") from error


def main(argv=None):
    start = time.time()
    config = parse_config(argv)
    print(f"preset {config.preset}: "
          + (", ".join(f"{k}={v}" for k, v in PRESETS[config.preset].items()) or "defaults")
          + "\nsettings: " + ", ".join(f"{k}={v}" for k, v in asdict(config).items()))
    staging = staging_folder(config.out)
    try:
        metrics = run(config, staging, start)
        publish(staging, config.out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)       # nothing half-written is left
        raise
    print(f"saved to {config.out}/ ({metrics['seconds']:.0f} s in all)")


def run(config, staging, start):
    """Load, split, train, normalise, evaluate, and write everything into `staging`."""
    device = loaders.pick_device()
    try:
        comparisons = loaders.load_comparisons(config.data_dir or None)
    except loaders.DataError as error:
        raise SystemExit(f"error: {error}\nPass --data-dir a folder holding "
                         "summarize_from_feedback_comparisons/batch*.json") from error
    train_c, heldout_c = split_comparisons(comparisons, config.heldout_fraction, config.seed)
    if len(heldout_c) < config.min_heldout_pairs:
        raise SystemExit(f"error: only {len(heldout_c)} comparisons held out, fewer than "
                         f"{config.min_heldout_pairs}; raise --heldout-fraction")
    random.Random(config.seed).shuffle(train_c)

    settings = {"base_model": config.model, "tiny": config.preset == "tiny",
                "seed": config.seed, "lora_r": lora.LORA_R, "lora_alpha": lora.LORA_ALPHA,
                "lora_layers": config.lora_layers,
                "max_prompt_tokens": config.max_prompt_tokens,
                "max_summary_tokens": config.max_summary_tokens,
                "resolved_from": "random tiny model" if config.preset == "tiny"
                else loaders.resolve_model(config.model)[0]}
    model, tokenizer = build_reward_model(settings, device)
    model.settings.update(pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    trainable, total = lora.count_parameters(model)
    print(f"reward model: {trainable:,} trainable of {total:,} parameters on {device}, "
          f"adapter on the top {config.lora_layers or len(model.body.layers)} of "
          f"{len(model.body.layers)} layers")

    train_pairs = prepare_pairs(tokenizer, train_c[:config.max_pairs or None], config)
    heldout_pairs = prepare_pairs(tokenizer, heldout_c[:config.max_heldout_pairs or None],
                                  config)
    if not train_pairs or not heldout_pairs:
        raise SystemExit(f"error: {len(train_pairs)} training and {len(heldout_pairs)} "
                         "held-out comparisons; both need at least one")
    print(f"{len(comparisons)} comparisons of {len({c['post_id'] for c in comparisons})} "
          f"posts: training on {len(train_pairs)}, evaluating on {len(heldout_pairs)} "
          f"from {len({c['post_id'] for c in heldout_c})} posts never trained on")
    losses, train_accuracy = train(model, train_pairs, config)

    # (R3) the shift that makes the held-out posts' human TL;DRs average 0.
    references, sources = human_references(heldout_c, config.data_dir or None)
    fitted = [(loaders.fit_prompt(tokenizer, post, config.max_prompt_tokens), summary)
              for post, summary in references]                  # cut as training cut them
    encoded = [encode(tokenizer, p, s, config.max_summary_tokens) for p, s in fitted if p]
    if encoded:
        print(f"normalising on {len(encoded)} human TL;DRs of held-out posts (found "
              f"{sources['comparisons']} in the comparisons, {sources['tldr_file']} in the "
              f"TL;DR file; {len(fitted) - len(encoded)} with too long a title)")
    else:
        print("WARNING: no human TL;DR of any held-out post; normalising on the preferred "
              "held-out summaries, so 0 means 'a typical preferred summary' instead")
        encoded = [(p["prompt"], p["chosen"]) for p in heldout_pairs]
        sources = {"heldout_chosen": len(encoded)}
    raw = score_grouped(model, *zip(*encoded), batch_rows=config.eval_batch)
    model.bias.fill_(-raw.mean().item())

    metrics, extra, r_w, r_l = evaluate(model, heldout_pairs, config)
    metrics["train_pairs"] = len(train_pairs)
    extra.update(preset=config.preset, normalisation_bias=model.bias.item(),
                 normalisation_sources=sources, train_accuracy=train_accuracy,
                 # the first held-out pair's normalised scores, for the round-trip test
                 probe={"post_id": heldout_pairs[0]["post_id"],
                        "scores": [r_w[0].item(), r_l[0].item()]})
    save_reward_model(model, staging)
    plot(losses, r_w - r_l, staging)
    metrics["seconds"] = time.time() - start
    (staging / "metrics.json").write_text(json.dumps({**metrics, "extra": extra}, indent=2))
    print(f"\nheld-out accuracy  {metrics['heldout_accuracy']:.3f}   Wilson 95% "
          f"{metrics['wilson_low']:.3f} to {metrics['wilson_high']:.3f}, "
          f"{metrics['heldout_pairs']} pairs\n"
          f"length baseline    {metrics['length_baseline_accuracy']:.3f}   the longer "
          f"summary (tokens) wins; {extra['length_ties']} ties count one half\n"
          f"shorter preferred  {metrics['shorter_preferred_accuracy']:.3f}   the model, on "
          f"the {extra['shorter_preferred_pairs']} pairs where people chose the shorter one\n"
          f"trained on {metrics['train_pairs']} pairs; {metrics['seconds']:.0f} s in all\n"
          f"verdict: {verdict(metrics)}")
    return metrics


if __name__ == "__main__":
    sys.exit(main())
