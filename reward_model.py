"""A Bradley-Terry reward model fitted to human comparisons of TL;DR summaries.

The post takes its reward model off the shelf (section "The four models": it "reads a
post and a summary of it, returns one number"). This file trains one instead, from the
human comparisons Stiennon et al. collected on this same Reddit data; `ppo.py` loads it.

The model is the policy's base LM (SmolLM2-135M-Instruct without its LM head), the post's
LoRA adapter (`lora.py`: rank 16, alpha 32, on q_proj and v_proj) and a scalar linear head
read at the EOS that ends "post + TL;DR: + summary". It shares the policy's tokenizer, so
PPO scores the sampled ids directly. The post numbers no reward-model equation, so the
ones here are R1-R6 (R1 is Stiennon et al.'s eq. 1):
    (R1) L = -log sigmoid(r(x, y_w) - r(x, y_l))        y_w preferred over y_l by a person
    (R2) f(x, y) = u . h_T + b,   u, b ~ N(0, 1/sqrt(d+1)) as a std, d the hidden width
    (R3) f_hat(x, y) = f(x, y) + bias,   bias = -mean of f over human TL;DRs (held-out posts)
    (R4) the Wilson 95% interval of the held-out pairwise accuracy
    (R5) r(x, y) = f(x, y) + w g(y),   g(y) = log(1 + |y|),   |y| the summary's tokens
    (R6) w = argmax_w  sum_pairs log sigmoid(w (g(y_w) - g(y_l)))    length alone, then frozen
R1 sees only the difference of two scores: add a constant to every score and the loss
does not change. The origin of the scale is arbitrary; R3 fixes it after training.

Length is a separate, explicit term (R5), as in the length-controlled win rate of AlpacaEval
(Dubois et al. 2024, arXiv:2404.04475: a regression with a length covariate) and in ODIN
(Chen et al. 2024, arXiv:2402.07319: a length head apart from a quality head). The simplest
form that worked: one scalar w times a fixed g, fitted by (R6) before the network trains and
then frozen. In the probes filed with issue 9 (seed 0, cpu preset), w learned jointly
lost the race to the adapter, which soaked up length itself (content accuracy where people
chose the shorter summary: 0.29); fitted first and frozen, 0.50. The saved model gives
    content = f_hat                 what the text is worth at a given length (PPO's default)
    full    = f_hat + w g(y)        what people's choices predict, length included
    length_weight = w
g is log length because one more token matters more to a 5-token summary than to a 45-token
one; a linear g would let a policy buy the same reward with every extra token.

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
  6. Length is modelled apart from content, (R5)-(R6): see above.
  7. `--reference-pairs N` adds N comparisons "a post's human TL;DR beats the reference
     policy's own sample" (SmolLM2 with the post's sampling settings), as Stiennon et al.'s
     data compared policy samples with the human reference ("ref" in batch18). The sample is
     cut to the TL;DR's length, so the pair carries no length difference and only f learns
     from it. No post whose TL;DR serves in evaluation is used: not this file's held-out
     posts, not ppo.py's evaluation posts (`loaders.EVAL_RESERVE`). For the same reason a
     training comparison holding the human TL;DR of one of ppo.py's evaluation posts is
     dropped. `--reference-pairs 0` turns this off.
  8. Every summary is read at an EOS: training appends one, and PPO's responses that hit
     the length limit get one appended before scoring (`score_ids`), so a response cut at
     48 tokens looks like a training summary cut at 48 tokens, not like nothing seen before.
  9. `--off-post-pairs N` adds N comparisons "under post p, p's own human TL;DR beats the
     human TL;DR of another post q" (RRM, Liu et al. 2024, arXiv:2409.13156), and
     `--off-post-sample-pairs M` the same with SmolLM2's samples for p and q. q is p's
     neighbour in summary length, and both summaries are cut to the shorter: g(y) is equal,
     (R5)'s length term cancels, and f learns only whether the summary belongs to the post.
     The posts are those departure 7 may use. Human comparisons never show this: both
     summaries of a comparison are of the same post, so nothing in them rewards reading it.
     The relevance metrics (`relevance`) measure it on posts never trained on.
Speed, exact: a pair's two summaries share one pass over their prompt (its keys and values
are cached and copied), which causal attention makes identical to two full passes (tested).

Run:   python reward_model.py                 (cpu preset: ~25 min on a 2-core CPU without AVX-512)
       python reward_model.py --preset tiny   (toy model, seconds)
       torchrun --standalone --nproc_per_node N reward_model.py     (data-parallel: parallel.py)
Test:  python -m pytest -q tests/test_reward_model.py
Use:   model = load_reward_model("runs/reward_model")
       r = score_ids(model, p, pm, y, ym, part="content")      # or part="full"
"""
import inspect
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Before torch loads OpenMP: on a shared CPU, threads that spin while they wait for each
# other lose ~10x (measured here: 40-70 s per step against 11 s, with two other busy
# processes); threads that sleep cost nothing measurable on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from support import parallel  # noqa: E402  (before tqdm: it turns bars off on ranks but 0)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from support import cli  # noqa: E402
import loaders  # noqa: E402
import lora  # noqa: E402
from gae import ended_with_eos, last_token_index  # noqa: E402
from support.config import option, read_config  # noqa: E402
from support.report import publish  # noqa: E402


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
    reference_pairs: int = option(1024, "add this many 'human TL;DR beats the reference "
                                         "policy's sample' comparisons (departure 7); 0 = off")
    sample_batch: int = option(32, "prompts per generate call when sampling the reference")
    off_post_pairs: int = option(0, "add this many 'under post p, p's human TL;DR beats "
                                    "another post's TL;DR of the same length' comparisons "
                                    "(departure 9); 0 = off")
    off_post_sample_pairs: int = option(0, "the same with SmolLM2's samples (those drawn for "
                                           "--reference-pairs, so at most that many); 0 = off")
    model: str = loaders.POLICY_NAME             # --model and --data-dir come from loaders
    data_dir: str = ""


# Named override sets, printed at start-up; the defaults above are `blog`.
PRESETS = {
    "blog": {},                                  # every pair, one epoch, CUDA or MPS
    # On a 2-core CPU without AVX-512 (102 GFLOP/s fp32): 287 reference samples in ~5 min,
    # 186 steps of 8 pairs at 5.4 s a step when idle (2.8 s on one with AVX-512), ~25 min in
    # all. `--reference-pairs 0` drops 192 of the samples and 24 of the steps.
    "cpu": {"max_prompt_tokens": 128, "lora_layers": 8, "reference_pairs": 192},
    "tiny": {"max_pairs": 16, "batch_pairs": 4, "max_prompt_tokens": 64, "lora_layers": 1,
             "max_summary_tokens": 24, "min_heldout_pairs": 0, "max_heldout_pairs": 32,
             "reference_pairs": 4, "sample_batch": 8},
}

# Every numeric flag's allowed values (cli.py), checked before anything loads.
RANGES = {"seed": cli.NON_NEGATIVE, "epochs": cli.COUNT, "max_pairs": cli.NON_NEGATIVE,
          "batch_pairs": cli.COUNT, "lr": cli.POSITIVE, "head_lr": cli.POSITIVE,
          "lora_layers": cli.NON_NEGATIVE,
          "max_prompt_tokens": cli.Range(loaders.PROMPT_TEMPLATE_TOKENS),
          "max_summary_tokens": cli.COUNT, "heldout_fraction": cli.Range(0, 1, True, True),
          "min_heldout_pairs": cli.NON_NEGATIVE, "max_heldout_pairs": cli.NON_NEGATIVE,
          "eval_batch": cli.COUNT, "reference_pairs": cli.NON_NEGATIVE,
          "sample_batch": cli.COUNT, "off_post_pairs": cli.NON_NEGATIVE,
          "off_post_sample_pairs": cli.NON_NEGATIVE}

# The two scores a saved model gives (R5), and the one ppo.py maximises unless told.
# `content` by default: the length term is what PPO exploited when it was part of the
# reward (samples ran to the 48-token limit, scored highest for it), and w g(y) adds
# nothing a policy should chase; `full` is there to compare with.
PARTS = ("content", "full")
DEFAULT_PART = "content"


def parse_config(argv=None):
    """Defaults, then the preset's overrides, then the flags given on the command line;
    then every value is checked (RANGES, --out, --data-dir, --model): a bad one exits with
    status 2 and one line, before anything loads."""
    config, parser = read_config(Config, PRESETS, RANGES, {"preset": tuple(PRESETS)}, argv,
                                 __doc__.splitlines()[0])
    if problem := cli.out_problem(config.out):
        parser.error(problem)
    return config


# ------------------------------------------------------------------ the math (pure)

def bt_loss(r_w, r_l):
    """Mean Bradley-Terry loss over comparisons. r_w, r_l: (N,) scores of y_w and y_l."""
    # (R1)  L = -log sigmoid(r(x, y_w) - r(x, y_l))      only the difference enters
    return -F.logsigmoid(r_w - r_l).mean()


def length_feature(tokens):
    """g(y) of (R5): log(1 + |y|), for (B,) token counts (without the EOS)."""
    return torch.log1p(torch.as_tensor(tokens, dtype=torch.float64))


def fit_length_weight(dg, iterations=50):
    """(R6): the w that best predicts people's choices from length alone. dg: (N,) g_w - g_l.

    A one-parameter logistic regression with no intercept (swapping a pair's sides flips
    dg and the label together), solved by Newton's method; the log-likelihood is concave.
    """
    dg, w = torch.as_tensor(dg, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for _ in range(iterations):
        p = torch.sigmoid(w * dg)                                           # (N,)
        # d/dw sum log sigmoid(w dg) = sum dg (1 - p);  d2/dw2 = -sum dg^2 p (1 - p)
        step = (dg * (1 - p)).sum() / (dg * dg * p * (1 - p)).sum().clamp(min=1e-12)
        w = w + step
        if step.abs() < 1e-10:
            break
    return w.item()


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


# Held-out pairs by how much their two summaries differ in length, in tokens (inclusive).
LENGTH_BINS = (("0-3", 0, 3), ("4-10", 4, 10), (">10", 11, 10 ** 9))


def pair_metrics(r_w, r_l, len_w, len_l):
    """What one score does on held-out pairs. r_w, r_l: (n,) scores; len_w, len_l: (n,) tokens.

    Accuracy and its Wilson interval (R4); accuracy on the pairs where people chose the
    shorter summary (a score that only measures length gets these wrong); the Pearson
    correlation of score and length over all 2n summaries; accuracy by length difference.
    """
    n, nan = len(r_w), float("nan")
    accuracy = pairwise_accuracy(r_w, r_l)
    low, high = wilson_interval(accuracy, n)
    shorter = len_w < len_l                                                 # (n,) bool
    both = torch.stack([torch.cat([r_w, r_l]).double(),
                        torch.cat([len_w, len_l]).double()])                # (2, 2n)
    out = {"heldout_accuracy": accuracy, "wilson_low": low, "wilson_high": high,
           "shorter_preferred_accuracy": (pairwise_accuracy(r_w[shorter], r_l[shorter])
                                          if shorter.any() else nan),
           "score_length_correlation": torch.corrcoef(both)[0, 1].item(),
           "accuracy_by_length_difference": {}}
    gap = (len_w - len_l).abs()                                             # (n,)
    for name, lo, hi in LENGTH_BINS:
        rows = (gap >= lo) & (gap <= hi)                                    # (n,) bool
        k = int(rows.sum())
        a = pairwise_accuracy(r_w[rows], r_l[rows]) if k else nan
        out["accuracy_by_length_difference"][name] = {
            "pairs": k, "accuracy": a, "wilson": list(wilson_interval(a, k)) if k else [0, 1]}
    return out


def human_minus_reference_sd(human, reference):
    """(mean human score - mean reference-sample score) / SD of the reference samples' scores.

    How many of the reference policy's own spreads separate a person's TL;DR from what
    SmolLM2 writes for the same posts; the SD is the sample SD (n - 1).
    """
    human, reference = torch.as_tensor(human).double(), torch.as_tensor(reference).double()
    return ((human.mean() - reference.mean()) / reference.std()).item()


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
    """LM body with LoRA, a scalar head (R2), the shift `bias` (R3) and the length weight (R5).

    Calling it gives the content score f_hat; `score_part` turns that into either part.
    """

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
        # (R5) w, fitted by (R6) before training and frozen; 0 until then
        self.register_buffer("length_weight", torch.zeros((), device=self.head.weight.device))

    def forward(self, input_ids, attention_mask):
        """Content scores f_hat (B,) fp32 of (B, L) ids, read at each row's last real token.

        Real tokens may sit anywhere: after left padding (PPO's prompts), before right
        padding (training), or both (a left-padded prompt, then a response that stopped).
        """
        # Departure 3: positions from the mask, so the padding side does not matter.
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=loaders.positions(attention_mask),
                           use_cache=False).last_hidden_state              # (B, L, d)
        return self.read_score(hidden, attention_mask)

    def forward_shared(self, prompts, summaries, owner):
        """Content scores (N,) of N summaries that follow M prompts, reading each prompt once.

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
        # (R3)  f_hat = f + bias       (bias stays 0 until training has finished)
        return raw + self.bias                                              # (B,)

    def score_part(self, content, summary_tokens, part):
        """(R5) `content`: f_hat as it is; `full`: f_hat + w g(y). Both (B,); tokens (B,)."""
        if part == "content":
            return content
        if part == "full":
            g = length_feature(summary_tokens).to(content.device, content.dtype)   # (B,)
            return content + self.length_weight.to(content.dtype) * g
        raise ValueError(f"part must be one of {PARTS}, not {part!r}")


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
def score_grouped(model, prompts, summaries, batch_rows=32, progress=False, split=False):
    """Scores (N,) of summaries[i] after prompts[i] (id lists), on the CPU.

    Each distinct prompt is read once and each distinct (prompt, summary) scored once;
    prompts of similar length share a batch of about `batch_rows` summaries. `split`: under
    torchrun each rank scores its share of the rows and every rank gets all N scores (a
    collective: every rank calls it); nothing changes in one process.
    """
    if split:
        mine = parallel.mine(range(len(prompts)))        # every row in one process
        prompts, summaries = [prompts[i] for i in mine], [summaries[i] for i in mine]
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
    out = torch.tensor([scores[tuple(p), tuple(s)] for p, s in zip(prompts, summaries)])
    return parallel.gather(out) if split else out


def with_eos(response_ids, response_mask, eos_id):
    """Responses that hit the length limit, given the EOS that training summaries end in.

    response_ids, response_mask: (B, T), the mask 1 up to and including the first EOS.
    Returns (B, T + 1) ids and mask: rows with no EOS get one in the new last column
    (departure 8), the others a padding column; and (B,) summary tokens, EOS not counted.
    """
    ended = ended_with_eos(response_ids, response_mask, eos_id)            # (B,) bool
    column = torch.full_like(response_ids[:, :1], eos_id)                  # (B, 1)
    ids = torch.cat([response_ids, column], dim=1)                         # (B, T + 1)
    mask = torch.cat([response_mask, (~ended).long()[:, None]], dim=1)     # (B, T + 1)
    return ids, mask, response_mask.sum(1) - ended.long()                  # ..., (B,)


@torch.no_grad()
def score_ids(model, prompt_ids, prompt_mask, response_ids, response_mask, part=DEFAULT_PART):
    """PPO's entry point: scores (B,) of sampled ids, with no decode/re-encode.

    prompt_ids, prompt_mask: (B, P), left-padded. response_ids, response_mask: (B, T), the
    mask 1 up to and including the first EOS. The score is read at an EOS: the response's
    own, or one appended when it hit the length limit (departure 8). `part`: see (R5).
    """
    response_ids, response_mask, tokens = with_eos(response_ids, response_mask,
                                                   model.settings["eos_id"])  # (B, T+1) x2
    ids = torch.cat([prompt_ids, response_ids], dim=1)                      # (B, P + T + 1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)                   # (B, P + T + 1)
    return model.score_part(model(ids, mask), tokens, part)                 # (B,)


@torch.no_grad()
def score_texts(model, tokenizer, prompts, summaries, max_prompt_tokens=None, batch_rows=32,
                part=DEFAULT_PART):
    """Scores (B,) of written summaries (human TL;DRs), tokenized as in training."""
    budget = max_prompt_tokens or model.settings["max_prompt_tokens"]
    encoded = [encode(tokenizer, fit_prompt_text(tokenizer, p, budget), s,
                      model.settings["max_summary_tokens"]) for p, s in zip(prompts, summaries)]
    content = score_grouped(model, [p for p, _ in encoded], [s for _, s in encoded], batch_rows)
    return model.score_part(content, [len(s) - 1 for _, s in encoded], part)  # EOS not counted


# ------------------------------------------------------------------ saving and loading

def base_fingerprint(model):
    """A checksum of the frozen base, to catch an adapter loaded onto other weights."""
    first = model.body.embed_tokens.weight[:64].detach().cpu()       # MPS has no float64
    return float(first.double().sum())


def save_reward_model(model, folder):
    """adapter.safetensors, head.safetensors, config.json (and base.safetensors if tiny)."""
    folder = Path(folder)
    lora.save_adapter(model.body, folder / "adapter.safetensors")
    save_file({"head.weight": model.head.weight.detach().contiguous(),
               "head.bias": model.head.bias.detach().contiguous(),
               "bias": model.bias.detach().reshape(1),
               "length_weight": model.length_weight.detach().reshape(1)},
              str(folder / "head.safetensors"))
    if model.settings["tiny"]:    # random weights: save them rather than trust a seed
        base = {k: v.contiguous() for k, v in model.body.state_dict().items()
                if not k.endswith(("down.weight", "up.weight"))}
        save_file(base, str(folder / "base.safetensors"))
    settings = {**model.settings, "base_fingerprint": base_fingerprint(model)}
    (folder / "config.json").write_text(json.dumps(settings, indent=2))


# What load_reward_model needs from config.json (save_reward_model writes more).
SETTINGS = {"base_model", "tiny", "seed", "lora_r", "lora_alpha", "lora_layers",
            "base_fingerprint", "resolved_from"}


def load_reward_model(path, device="cpu"):
    """A saved RewardModel, frozen, in eval mode, its normalisation shift included."""
    path, what = Path(path), "a reward model folder written by `python reward_model.py`"
    missing = [n for n in ("config.json", "adapter.safetensors", "head.safetensors")
               if not (path / n).is_file()]
    if missing:
        raise cli.UserError(f"{path} is not a reward model folder (missing "
                            f"{', '.join(missing)}); train one with `python reward_model.py "
                            "--out DIR`")
    with cli.reading(path / "config.json", what):
        settings = json.loads((path / "config.json").read_text())
    if not isinstance(settings, dict) or not SETTINGS <= set(settings):
        raise cli.UserError(f"{path / 'config.json'} lacks the settings of {what}")
    expected = settings.pop("base_fingerprint")
    model, _ = build_reward_model(settings, device)
    if settings["tiny"]:
        with cli.reading(path / "base.safetensors", what):
            model.body.load_state_dict(load_file(str(path / "base.safetensors"),
                                                 device=str(device)), strict=False)
    if abs(base_fingerprint(model) - expected) > 1e-6 * max(1.0, abs(expected)):
        raise cli.UserError(f"{path} was trained on other weights of {settings['base_model']} "
                            f"({settings['resolved_from']}); load that copy (HF_HUB_OFFLINE=1 "
                            "selects the embedded one) or retrain")
    with cli.reading(path / "adapter.safetensors", what, lora.AdapterMismatch):
        lora.load_adapter(model.body, path / "adapter.safetensors")
    with cli.reading(path / "head.safetensors", what):
        head = load_file(str(path / "head.safetensors"), device=str(device))
    if "length_weight" not in head:
        raise cli.UserError(f"{path} was written by an older reward_model.py, without the "
                            "length term (R5); retrain it with `python reward_model.py`")
    with torch.no_grad():
        model.head.weight.copy_(head["head.weight"])
        model.head.bias.copy_(head["head.bias"])
        model.bias.copy_(head["bias"][0])
        model.length_weight.copy_(head["length_weight"][0])
    return loaders.freeze(model)


# ------------------------------------------------------------------ data

def prepare_pairs(tokenizer, comparisons, config):
    """Comparisons -> [{post_id, prompt, chosen, rejected (id lists), *_len, *_tokens}].

    *_len: the whole summary's tokens, before any cut; they feed the length baseline.
    *_tokens: the tokens the model reads (cut, EOS not counted); they feed g of (R5).
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
            pair[side + "_tokens"] = len(pair[side]) - 1        # g's |y|: as cut, no EOS
        pairs.append(pair)
    if len(pairs) < len(comparisons):
        print(f"dropped {len(comparisons) - len(pairs)} comparisons whose title alone "
              f"exceeds {config.max_prompt_tokens} tokens")
    return pairs


def serves_in_evaluation(comparison, reserved_titles):
    """Whether a comparison holds the human TL;DR of one of ppo.py's evaluation posts."""
    return (comparison["title"].strip() in reserved_titles
            and "ref" in (comparison["chosen_policy"], comparison["rejected_policy"]))


# The post's sampling settings (MAX_NEW_TOKENS, TEMPERATURE, TOP_K, TOP_P), as ppo.py's
# `generate` samples by default; tests/test_reward_model.py checks that the two agree.
POST_SAMPLING = {"max_new_tokens": 48, "temperature": 1.0, "top_k": 50, "top_p": 0.95}


@torch.no_grad()
def sample_reference(lm, tokenizer, prompts, batch, seed, desc):
    """One summary per prompt (id lists) from the reference policy, sampled as in PPO.

    Returns [(ids without the EOS, ended: bool)] in the prompts' order. Prompts of similar
    length share a `generate` call; the draw is seeded without touching the caller's RNG.
    """
    eos = tokenizer.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    samples = [None] * len(prompts)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for start in tqdm(range(0, len(order), batch), desc=desc, unit="batch", leave=False):
            rows = order[start:start + batch]
            ids, mask = pad([prompts[i] for i in rows], tokenizer.pad_token_id, "left",
                            lm.device)                                      # (b, P)
            out = lm.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                              pad_token_id=eos, **POST_SAMPLING)            # (b, P+T)
            actions = out[:, ids.shape[1]:]                                 # (b, T)
            for i, row in zip(rows, actions.tolist()):
                cut = row.index(eos) if eos in row else len(row)
                samples[i] = (row[:cut], cut < len(row))
    return samples


def reference_pairs(tokenizer, posts, samples, config):
    """Departure 7: pairs "the post's human TL;DR beats the reference policy's sample".

    posts: [{id, prompt (already fitted), summary}]; samples: from `sample_reference`.
    The sample is cut to the TL;DR's length when longer, so the two sides have the same
    g(y) and (R5)'s length term cancels: only f learns from these pairs.
    """
    pairs = []
    for post, (sample, _) in zip(posts, samples):
        prompt, human = encode(tokenizer, post["prompt"], post["summary"],
                               config.max_summary_tokens)
        sample = sample[:len(human) - 1]                  # no longer than the TL;DR
        if not sample or sample == human[:-1]:
            continue
        pairs.append({"post_id": post["id"], "prompt": prompt, "kind": "reference",
                      "chosen": human, "rejected": sample + [tokenizer.eos_token_id],
                      "chosen_len": len(human) - 1, "rejected_len": len(sample),
                      "chosen_tokens": len(human) - 1, "rejected_tokens": len(sample)})
    return pairs


def length_neighbours(lengths, seed):
    """[(i, j)]: each item i but the longest, with j the next one up in length. A seeded
    shuffle comes first, so items of equal length pair at random, not by their index."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda i: lengths[i])         # stable: equal lengths stay shuffled
    return list(zip(order, order[1:]))


def off_post_pairs(prompts, summaries, post_ids, eos_id, seed, kind="off_post"):
    """Departure 9: under post p, p's own summary beats q's (q: p's length neighbour).

    prompts: [prompt ids]; summaries: [summary ids, no EOS], one per post; both sides are
    cut to the shorter of the two and end in EOS, so g(y_w) = g(y_l) and only f learns.
    Returns the pairs in a seeded random order (take the first n).
    """
    pairs = []
    for p, q in length_neighbours([len(x) for x in summaries], seed):
        cut = min(len(summaries[p]), len(summaries[q]))
        own, other = summaries[p][:cut], summaries[q][:cut]
        if not cut or own == other:
            continue
        pairs.append({"post_id": post_ids[p], "prompt": prompts[p], "kind": kind,
                      "chosen": own + [eos_id], "rejected": other + [eos_id],
                      "chosen_len": cut, "rejected_len": cut,
                      "chosen_tokens": cut, "rejected_tokens": cut})
    random.Random(seed).shuffle(pairs)
    return pairs


def relevance(model, prompts, summaries, seed, batch_rows=32):
    """Does the judge read the post? On posts never trained on, two measures:

    accuracy: under post p, p's own summary beats its length neighbour q's, both cut to the
        shorter (content and full agree: g cancels); Wilson 95% interval (R4).
    gap_sd: the same uncut summary under its own post minus under q's post,
        f(x_p, y_p) - f(x_q, y_p), averaged, in SDs of f(x_p, y_p) over the posts; with
        its SE. 0 means the score ignores the post.
    prompts: [prompt ids]; summaries: [summary ids, no EOS]. Returns a dict.
    """
    eos = model.settings["eos_id"]
    pairs = off_post_pairs(prompts, summaries, list(range(len(prompts))), eos, seed)
    own = score_grouped(model, [p["prompt"] for p in pairs], [p["chosen"] for p in pairs],
                        batch_rows, split=True)                             # (n,)
    other = score_grouped(model, [p["prompt"] for p in pairs],
                          [p["rejected"] for p in pairs], batch_rows, split=True)  # (n,)
    accuracy = pairwise_accuracy(own, other)
    low, high = wilson_interval(accuracy, len(pairs))
    moved = length_neighbours([len(x) for x in summaries], seed)            # [(p, q)]
    home = score_grouped(model, [prompts[p] for p, _ in moved],
                         [summaries[p] + [eos] for p, _ in moved], batch_rows, split=True)
    away = score_grouped(model, [prompts[q] for _, q in moved],
                         [summaries[p] + [eos] for p, _ in moved], batch_rows, split=True)
    # gap_sd = mean_p (f(x_p, y_p) - f(x_q, y_p)) / SD_p f(x_p, y_p)
    sd = home.double().std().item()
    d = (home - away).double() / sd                                         # (n,)
    return {"accuracy": accuracy, "wilson_low": low, "wilson_high": high, "pairs": len(pairs),
            "gap_sd": d.mean().item(), "gap_sd_se": (d.std() / math.sqrt(len(d))).item(),
            "posts": len(prompts)}


def relevance_sets(model, tokenizer, reserve, encoded, samples, config):
    """`relevance` on three sets of posts never trained on: human TL;DRs of ppo.py's
    evaluation reserve (`reserve`: [(fitted prompt, post)], posts of no training comparison)
    and of this split's held-out posts (`encoded`), and SmolLM2's samples for the latter."""
    sets = {"human_reserve": ([tokenizer(prompt).input_ids for prompt, _ in reserve],
                              [tokenizer(" " + p["summary"]).input_ids[:config.max_summary_tokens]
                               for _, p in reserve]),
            "human_heldout": ([p for p, _ in encoded], [h[:-1] for _, h in encoded]),
            "samples_heldout": ([p for p, _ in encoded], [ids for ids, _ in samples])}
    return {name: relevance(model, prompts, summaries, config.seed, config.eval_batch)
            for name, (prompts, summaries) in sets.items() if len(prompts) >= 3}


def relevance_metrics(sets):
    """metrics.json's relevance keys: human TL;DRs on the evaluation reserve, SmolLM2's
    samples on the held-out posts (NaN where a set was too small)."""
    nan, out = float("nan"), {}
    for prefix, name in (("relevance", "human_reserve"), ("relevance_sample", "samples_heldout")):
        got = sets.get(name, {})
        for key in ("accuracy", "wilson_low", "wilson_high", "pairs"):
            out[f"{prefix}_{key}"] = got.get(key, nan)
    human = sets.get("human_reserve", {})
    out.update(relevance_gap_sd=human.get("gap_sd", nan),
               relevance_gap_sd_se=human.get("gap_sd_se", nan))
    return out


def human_references(heldout, tldr_posts):
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
    by_title = {p["title"].strip(): p["summary"] for p in tldr_posts}
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
    """One AdamW step of (R1) on a list of pairs. Returns the batch's (loss, accuracy).

    Under torchrun each rank takes its share of the pairs, and its loss is that share of the
    batch's mean: the summed gradients are the whole batch's (parallel.py).
    """
    mine = parallel.mine(batch)                  # all of them in one process
    k = len(mine)
    optimizer.zero_grad()
    loss_sum = right = 0.0
    if k:                                        # a rank may get none of a short last batch
        owner = torch.arange(k).repeat(2)        # (2k,) rows 0..k-1 chosen, k..2k-1 rejected
        f = model.forward_shared([p["prompt"] for p in mine],
                                 [p["chosen"] for p in mine] + [p["rejected"] for p in mine],
                                 owner)                                     # (2k,)
        tokens = [p["chosen_tokens"] for p in mine] + [p["rejected_tokens"] for p in mine]
        # (R5)  r = f + w g(y), w frozen (a buffer): the gradient reaches f only
        scores = model.score_part(f, tokens, "full")                        # (2k,)
        r_w, r_l = scores[:k], scores[k:]                                   # (k,), (k,)
        loss = bt_loss(r_w, r_l) * (k / len(batch))     # this rank's share of the mean (R1)
        loss.backward()
        loss_sum = loss.item()
        right = pairwise_accuracy(r_w.detach(), r_l.detach()) * k
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    parallel.sum_gradients(trainable)            # torchrun: the whole batch's gradient
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    return parallel.total(loss_sum), parallel.total(right) / len(batch)


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
    """Both scores' held-out metrics ({part: pair_metrics}) and the content scores (n,) x 2."""
    n = len(pairs)
    f = score_grouped(model, [p["prompt"] for p in pairs] * 2,
                      [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
                      config.eval_batch, progress=True, split=True)       # (2n,) content
    len_w = torch.tensor([p["chosen_len"] for p in pairs])                  # (n,) tokens
    len_l = torch.tensor([p["rejected_len"] for p in pairs])                # (n,) tokens
    tokens = [p["chosen_tokens"] for p in pairs] + [p["rejected_tokens"] for p in pairs]
    by_part = {}
    for part in PARTS:
        r = model.score_part(f, tokens, part)                               # (2n,)
        by_part[part] = pair_metrics(r[:n], r[n:], len_w, len_l)
    return by_part, f[:n], f[n:]


def reference_gap(model, encoded, samples, config):
    """How far people's TL;DRs score above the reference policy's samples on the same posts.

    encoded: [(prompt ids, human TL;DR ids + EOS)]; samples: `sample_reference` on those
    prompts. Also the reference samples read the old way, at their last token when they hit
    the limit without an EOS, to show what departure 8 changes.
    """
    eos = model.settings["eos_id"]
    prompts = [p for p, _ in encoded]
    human = score_grouped(model, prompts, [h for _, h in encoded], config.eval_batch,
                          split=True)
    sample = score_grouped(model, prompts, [s + [eos] for s, _ in samples], config.eval_batch,
                           split=True)
    old = score_grouped(model, prompts, [s + [eos] if ended else s for s, ended in samples],
                        config.eval_batch, split=True)                      # (n,) each
    ended = torch.tensor([e for _, e in samples])                           # (n,) bool
    out = {"posts": len(encoded), "reference_eos_fraction": ended.double().mean().item()}
    for part in PARTS:
        h = model.score_part(human, [len(x) - 1 for _, x in encoded], part)
        r = model.score_part(sample, [len(x) for x, _ in samples], part)
        out[part] = {"human_minus_reference_sd": human_minus_reference_sd(h, r),
                     "human_mean": h.mean().item(), "reference_mean": r.mean().item(),
                     "reference_sd": r.std().item()}
    cut = ~ended
    out["content_reference_cut_at_limit"] = {
        "samples": int(cut.sum()),
        "mean_read_at_an_appended_eos": sample[cut].mean().item() if cut.any() else None,
        "mean_read_at_the_last_token": old[cut].mean().item() if cut.any() else None}
    out["content_reference_ended"] = {
        "samples": int(ended.sum()),
        "mean": sample[ended].mean().item() if ended.any() else None}
    return out


def verdict(metrics, part):
    """Plain words on chance and on the length baseline, for one score."""
    low, high = metrics[f"{part}_wilson_low"], metrics[f"{part}_wilson_high"]
    said = [f"{part}: " + ("above chance (Wilson lower bound > 0.5)" if low > 0.5 else
                           "NOT distinguishable from chance (Wilson lower bound <= 0.5)")]
    base = metrics["length_baseline_accuracy"]
    said.append("beats 'the longer summary wins'" if base < low else
                "does NOT beat 'the longer summary wins'" if base > high else
                "cannot be told apart from 'the longer summary wins'")
    shorter = metrics[f"{part}_shorter_preferred_accuracy"]
    if shorter < 0.5:
        said.append(f"right only {shorter:.0%} of the time where people chose the shorter "
                    "summary, so it leans on length")
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


def main(argv=None):
    start = time.time()
    parallel.setup()                             # under torchrun only (parallel.py)
    config = parse_config(argv)
    print(f"preset {config.preset}: "
          + (", ".join(f"{k}={v}" for k, v in PRESETS[config.preset].items()) or "defaults")
          + "\nsettings: " + ", ".join(f"{k}={v}" for k, v in asdict(config).items()))
    # Written aside, in a hidden folder beside --out, and renamed into place when complete;
    # a failure removes it and any folder made for it: --out is left as it was.
    out = Path(config.out).resolve()
    if not parallel.is_main():                   # torchrun: rank 0 alone writes --out
        with tempfile.TemporaryDirectory() as scratch:
            run(config, Path(scratch), start)
        return
    with cli.new_folders(out.parent):
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            metrics = run(config, staging, start)
            publish(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    print(f"saved to {config.out}/ ({metrics['seconds']:.0f} s in all)")


def sample_reference_phase(config, tokenizer, tldr_posts, reserved, heldout_c, encoded,
                           device):
    """SmolLM2's own samples: departure 7's training pairs and the held-out gap's samples.

    Training posts: TL;DR posts whose title is neither reserved for ppo.py's evaluation nor
    one of this split's held-out posts. Returns (reference pairs, samples for `encoded`,
    seconds taken).
    """
    t = time.time()
    pool = []
    if config.reference_pairs or config.off_post_pairs:
        excluded = reserved | {c["title"].strip() for c in heldout_c}
        pool = [p for p in tldr_posts if p["title"].strip() not in excluded]
        random.Random(config.seed).shuffle(pool)
        pool = [{**p, "prompt": prompt} for p in pool
                if (prompt := loaders.fit_prompt(tokenizer, p, config.max_prompt_tokens))]
    posts = pool[:config.reference_pairs]
    lm, _ = loaders.load_policy_and_tokenizer(config.model, device=device,   # ppo's reference
                                              preset="tiny" if config.preset == "tiny" else None)
    samples = sample_reference(lm, tokenizer, [tokenizer(p["prompt"]).input_ids for p in posts],
                               config.sample_batch, config.seed, "sampling (training)")
    gap_samples = sample_reference(lm, tokenizer, [p for p, _ in encoded], config.sample_batch,
                                   config.seed + 1, "sampling (held-out)")
    pairs = reference_pairs(tokenizer, posts, samples, config)
    print(f"sampled the reference policy on {len(posts) + len(encoded)} posts in "
          f"{time.time() - t:.0f} s: {len(pairs)} reference pairs for training "
          f"(departure 7), {len(encoded)} samples for the held-out gap")
    eos = tokenizer.eos_token_id
    human = off_post_pairs([tokenizer(p["prompt"]).input_ids for p in pool],
                           [tokenizer(" " + p["summary"]).input_ids[:config.max_summary_tokens]
                            for p in pool], [p["id"] for p in pool], eos, config.seed,
                           "off_post")[:config.off_post_pairs]
    own = off_post_pairs([tokenizer(p["prompt"]).input_ids for p in posts],
                         [ids for ids, _ in samples], [p["id"] for p in posts], eos,
                         config.seed, "off_post_sample")[:config.off_post_sample_pairs]
    if config.off_post_pairs or config.off_post_sample_pairs:
        print(f"off-post pairs (departure 9): {len(human)} of human TL;DRs from {len(pool)} "
              f"posts, {len(own)} of SmolLM2's samples from {len(posts)}")
    return pairs, human, own, gap_samples, time.time() - t


def run(config, staging, start):
    """Load, split, sample, train, normalise, evaluate, and write everything into `staging`."""
    device = loaders.pick_device()
    try:
        comparisons = loaders.load_comparisons(config.data_dir or None)
    except loaders.NoDataError:
        raise
    except loaders.DataError as error:
        raise loaders.DataError(f"{error}; pass --data-dir a folder holding "
                                "summarize_from_feedback_comparisons/batch*.json") from error
    try:
        tldr_posts = loaders.load_tldr(config.data_dir or None)
    except loaders.DataError as error:
        print(f"no TL;DR posts ({error}): no reference pairs, normalising on the "
              "comparisons' human TL;DRs only")
        tldr_posts = []
    train_c, heldout_c = split_comparisons(comparisons, config.heldout_fraction, config.seed)
    if len(heldout_c) < config.min_heldout_pairs:
        raise cli.UserError(f"only {len(heldout_c)} comparisons held out, fewer than "
                            f"--min-heldout-pairs {config.min_heldout_pairs}; raise "
                            "--heldout-fraction")
    # Departure 7: no human TL;DR of one of ppo.py's evaluation posts is trained on.
    reserved = {tldr_posts[i]["title"].strip()
                for i in loaders.tldr_order(tldr_posts)[:loaders.EVAL_RESERVE]}
    kept = [c for c in train_c if not serves_in_evaluation(c, reserved)]
    print(f"dropped {len(train_c) - len(kept)} training comparisons holding the human TL;DR "
          "of one of ppo.py's evaluation posts")
    train_c = kept
    random.Random(config.seed).shuffle(train_c)

    settings = {"base_model": config.model, "tiny": config.preset == "tiny",
                "seed": config.seed, "lora_r": lora.LORA_R, "lora_alpha": lora.LORA_ALPHA,
                "lora_layers": config.lora_layers,
                "max_prompt_tokens": config.max_prompt_tokens,
                "max_summary_tokens": config.max_summary_tokens,
                "length_feature": "log(1 + tokens)",
                "off_post_pairs": config.off_post_pairs,
                "off_post_sample_pairs": config.off_post_sample_pairs,
                "resolved_from": "random tiny model" if config.preset == "tiny"
                else loaders.resolve_model(config.model)[0]}
    model, tokenizer = build_reward_model(settings, device)
    if config.lora_layers > len(model.body.layers):
        raise cli.UserError(f"argument --lora-layers: {config.lora_layers} is more than the "
                            f"model's {len(model.body.layers)} layers")
    model.settings.update(pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id)
    trainable, total = lora.count_parameters(model)
    print(f"reward model: {trainable:,} trainable of {total:,} parameters on {device}, "
          f"adapter on the top {config.lora_layers or len(model.body.layers)} of "
          f"{len(model.body.layers)} layers")

    human_pairs = prepare_pairs(tokenizer, train_c[:config.max_pairs or None], config)
    heldout_pairs = prepare_pairs(tokenizer, heldout_c[:config.max_heldout_pairs or None],
                                  config)
    if not human_pairs or not heldout_pairs:           # every title too long, or no data
        raise cli.UserError(f"{len(human_pairs)} training and {len(heldout_pairs)} held-out "
                            "comparisons fit --max-prompt-tokens "
                            f"{config.max_prompt_tokens}; both need at least one (raise "
                            "--max-prompt-tokens, or --max-pairs if it is small)")
    print(f"{len(comparisons)} comparisons of {len({c['post_id'] for c in comparisons})} "
          f"posts: training on {len(human_pairs)}, evaluating on {len(heldout_pairs)} "
          f"from {len({c['post_id'] for c in heldout_c})} posts never trained on")

    # The held-out posts' human TL;DRs: (R3) and the human-minus-reference gap.
    references, sources = human_references(heldout_c[:config.max_heldout_pairs or None],
                                           tldr_posts)
    fitted = [(loaders.fit_prompt(tokenizer, post, config.max_prompt_tokens), summary)
              for post, summary in references]                  # cut as training cut them
    encoded = [encode(tokenizer, p, s, config.max_summary_tokens) for p, s in fitted if p]
    print(f"{len(encoded)} human TL;DRs of held-out posts (found {sources['comparisons']} in "
          f"the comparisons, {sources['tldr_file']} in the TL;DR file; "
          f"{len(fitted) - len(encoded)} with too long a title)")

    # The reference policy's own samples: departure 7's pairs, and the gap's other side.
    extra_pairs, off_human, off_sample, gap_samples, sampling_seconds = sample_reference_phase(
        config, tokenizer, tldr_posts, reserved, heldout_c, encoded, device)

    # (R6) w from people's choices and length alone, frozen before the network trains.
    dg = (length_feature([p["chosen_tokens"] for p in human_pairs])
          - length_feature([p["rejected_tokens"] for p in human_pairs]))   # (N,)
    model.length_weight.fill_(fit_length_weight(dg))
    print(f"length weight w = {model.length_weight.item():.3f} (R6: log(1 + tokens), fitted "
          f"on {len(human_pairs)} human comparisons, then frozen)")
    train_pairs = human_pairs + extra_pairs + off_human + off_sample
    random.Random(config.seed).shuffle(train_pairs)
    losses, train_accuracy = train(model, train_pairs, config)

    # (R3) the shift that makes the held-out posts' human TL;DRs average 0 (content score).
    if encoded:
        raw = score_grouped(model, *zip(*encoded), batch_rows=config.eval_batch, split=True)
    else:
        print("WARNING: no human TL;DR of any held-out post; normalising on the preferred "
              "held-out summaries, so 0 means 'a typical preferred summary' instead")
        sources = {"heldout_chosen": len(heldout_pairs)}
        raw = score_grouped(model, [p["prompt"] for p in heldout_pairs],
                            [p["chosen"] for p in heldout_pairs], config.eval_batch,
                            split=True)
    model.bias.fill_(-raw.mean().item())

    by_part, f_w, f_l = evaluate(model, heldout_pairs, config)
    gap = reference_gap(model, encoded, gap_samples, config) if encoded else None
    metrics, extra = collect_metrics(by_part, heldout_pairs, gap, model)
    metrics.update(train_pairs=len(train_pairs), reference_pairs=len(extra_pairs),
                   off_post_pairs=len(off_human), off_post_sample_pairs=len(off_sample))
    # Departure 9's measure, on posts never trained on: does the judge read the post?
    reserve = [tldr_posts[i] for i in loaders.tldr_order(tldr_posts)[:loaders.EVAL_RESERVE]]
    trained = {c["title"].strip() for c in train_c}
    reserve = [(prompt, p) for p in reserve if p["title"].strip() not in trained
               and (prompt := loaders.fit_prompt(tokenizer, p, config.max_prompt_tokens))]
    extra["relevance"] = relevance_sets(model, tokenizer, reserve, encoded, gap_samples, config)
    metrics.update(relevance_metrics(extra["relevance"]))
    extra.update(preset=config.preset, normalisation_bias=model.bias.item(),
                 normalisation_sources=sources, train_accuracy=train_accuracy,
                 human_train_pairs=len(human_pairs), sampling_seconds=sampling_seconds,
                 # the first held-out pair's content scores, for the round-trip test
                 probe={"post_id": heldout_pairs[0]["post_id"],
                        "scores": [f_w[0].item(), f_l[0].item()]})
    save_reward_model(model, staging)
    plot(losses, f_w - f_l, staging)
    metrics["seconds"] = time.time() - start
    (staging / "metrics.json").write_text(json.dumps({**metrics, "extra": extra}, indent=2))
    print_summary(metrics, extra)
    return metrics


def collect_metrics(by_part, pairs, gap, model):
    """metrics.json's top level (the default score's keys, then each part's) and `extra`."""
    default, nan = by_part[DEFAULT_PART], float("nan")
    len_w = torch.tensor([p["chosen_len"] for p in pairs])                  # (n,) tokens
    len_l = torch.tensor([p["rejected_len"] for p in pairs])                # (n,) tokens
    metrics = {key: default[key] for key in ("heldout_accuracy", "wilson_low", "wilson_high",
                                             "shorter_preferred_accuracy")}
    metrics.update(heldout_pairs=len(pairs), default_part=DEFAULT_PART,
                   length_weight=model.length_weight.item(),
                   # "The longer summary wins", in tokens of the full summary; ties count 1/2.
                   length_baseline_accuracy=pairwise_accuracy(len_w, len_l),
                   length_matched_accuracy=default["accuracy_by_length_difference"]["0-3"][
                       "accuracy"])
    extra = {"shorter_preferred_pairs": int((len_w < len_l).sum()),
             "length_ties": int((len_w == len_l).sum()),
             "score_length_correlation": default["score_length_correlation"],
             "reference_gap": gap}
    for part in PARTS:
        for key in ("heldout_accuracy", "wilson_low", "wilson_high",
                    "shorter_preferred_accuracy", "score_length_correlation"):
            metrics[f"{part}_{key}"] = by_part[part][key]
        metrics[f"{part}_human_minus_reference_sd"] = (gap[part]["human_minus_reference_sd"]
                                                      if gap else nan)
        extra[f"{part}_accuracy_by_length_difference"] = by_part[part][
            "accuracy_by_length_difference"]
    return metrics, extra


def print_summary(metrics, extra):
    """The final report: both scores side by side, then the length bins and the gap."""
    print(f"\n{metrics['heldout_pairs']} held-out pairs; the longer summary wins "
          f"{metrics['length_baseline_accuracy']:.3f} of them ({extra['length_ties']} ties "
          f"count one half); length weight w = {metrics['length_weight']:.3f}")
    print(f"{'':34}{'content':>22}{'full':>22}")
    rows = [("held-out accuracy [Wilson 95%]", lambda p: f"{metrics[p + '_heldout_accuracy']:.3f} "
             f"[{metrics[p + '_wilson_low']:.3f}, {metrics[p + '_wilson_high']:.3f}]"),
            (f"shorter preferred ({extra['shorter_preferred_pairs']} pairs)",
             lambda p: f"{metrics[p + '_shorter_preferred_accuracy']:.3f}"),
            ("corr(score, length)", lambda p: f"{metrics[p + '_score_length_correlation']:+.3f}"),
            ("human - reference (reference SDs)",
             lambda p: f"{metrics[p + '_human_minus_reference_sd']:+.2f}")]
    for name, bins in (("0-3", "|dlen| <= 3"), ("4-10", "|dlen| 4-10"), (">10", "|dlen| > 10")):
        rows.append((f"{bins} ({extra['content_accuracy_by_length_difference'][name]['pairs']}"
                     " pairs)", lambda p, name=name: "{accuracy:.3f} [{0:.2f}, {1:.2f}]".format(
                         *extra[p + "_accuracy_by_length_difference"][name]["wilson"],
                         **extra[p + "_accuracy_by_length_difference"][name])))
    for name, cell in rows:
        print(f"{name:34}" + "".join(f"{cell(p):>22}" for p in PARTS))
    gap = extra["reference_gap"]
    if gap and gap["content_reference_cut_at_limit"]["samples"]:
        cut = gap["content_reference_cut_at_limit"]
        print(f"reference samples on {gap['posts']} held-out posts: "
              f"{gap['reference_eos_fraction']:.0%} end in an EOS; content score of those "
              f"cut at the limit {cut['mean_read_at_an_appended_eos']:+.2f} read at an appended "
              f"EOS (as PPO now does), {cut['mean_read_at_the_last_token']:+.2f} at their last "
              "token (before)")
    for name, what in (("human_reserve", "human TL;DRs, ppo.py's evaluation posts"),
                       ("human_heldout", "human TL;DRs, held-out posts"),
                       ("samples_heldout", "SmolLM2's samples, held-out posts")):
        if r := extra["relevance"].get(name):
            print(f"relevance, {what}: own beats another post's of the same length "
                  f"{r['accuracy']:.3f} [{r['wilson_low']:.3f}, {r['wilson_high']:.3f}] "
                  f"({r['pairs']} pairs); under its own post minus another's "
                  f"{r['gap_sd']:+.2f} ± {r['gap_sd_se']:.2f} SDs")
    print(f"trained on {metrics['train_pairs']} pairs ({metrics['reference_pairs']} reference "
          f"pairs, {metrics['off_post_pairs']} + {metrics['off_post_sample_pairs']} off-post); "
          f"{metrics['seconds']:.0f} s in all")
    for part in PARTS:
        print(f"verdict, {verdict(metrics, part)}")


if __name__ == "__main__":
    cli.run_script(main)
