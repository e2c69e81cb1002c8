"""RLHF with PPO: four models, per-token KL shaping, GAE, clipped updates.

The post "RLHF with PPO from Scratch: Four Models, GAE and LoRA", top to bottom: its
hyperparameters, then its functions in its order (`generate`, `token_log_probs`, `score`,
`fluency`, `ValueHead`, `policy_forward`, `shaped_rewards` and `advantages_and_returns`
from gae.py, `ppo_losses`, `train`), with equations (1)-(14) numbered as in the post above
the lines that compute them. What the post does not have (resume, timers, torchrun,
reports) is one call away in support/; `# ---- plumbing` marks where the loop calls it. The
run's settings (the Config of flags, the presets) and `main` come last.

    reference  the SFT model of sft.py, frozen (SmolLM2-135M-Instruct when there is none)
    policy     the reference's weights + a LoRA adapter           (lora.py)
    reward     the Bradley-Terry model fitted by reward_model.py  (reward_model.py)
    value      a linear head on the policy's last hidden state    (ValueHead, below)

Legend: rewards, the reward model's score of each summary (B,); per_token, the shaped
reward r_t of (3); logp = log pi_theta(a_t|s_t), the policy being updated; logp_old, the
policy that sampled the batch; logp_ref, the frozen reference; values V(s_t); adv A_t; ret
R_t; mask 1 up to and including the first EOS; P, T prompt (left-padded) and response
lengths; B the batch.

Departures from the post, each repeated at its line:
    1. Masks: a response ends at its first EOS; nothing after it gets reward, KL, advantage
       or loss, and the score lands on that EOS (or the last token at the length limit).
    2. The reward model shares the policy's tokenizer and scores the sampled ids (the post
       decodes and re-encodes for its DeBERTa scorer).
    3. Logits only at response positions, through a fused fp32 log-prob (ppo_kernels/) that
       never holds (rows x V) log-probs; every log-prob divides by the temperature.
    4. Each iteration draws fresh prompts (the post reuses 16), long posts are cut at a
       paragraph or sentence, and the evaluation is on held-out posts, with standard errors
       and the gain over the reference paired by post (support/heldout.py).
    5. The value loss and entropy average over real tokens; the value head starts from the
       post's default init.
    6. Extras, off by default as in the post: adaptive beta (Ziegler et al.), the k3 KL
       estimator, a missing-EOS penalty, the entropy bonus (12), the ptx loss (13); and the
       readings' tests (docs/claims.md): no clipping (--clip off), noise on the score
       (--reward-noise), the score and the KL term negated (--flip-sign).
    7. Speed and memory, same algorithm: micro-batches of similar prompt lengths, each cut to
       its own padding (same gradient); `--precision bf16` runs the bodies under autocast
       while log-probs, values and losses stay fp32 (the ratio is still exactly 1); on CUDA
       `generate` samples over a static KV cache replayed as a CUDA graph (decoding.py).
    8. The reward is the reward model's content score f, without its length term
       (reward_model.py); `--reward full` maximises f + w g(length).
    9. `--estimator rloo | reinforce | grpo` (the PPO/RLOO note, gae.py): the response as one
       action, R = score - beta sum_t KL_t, its baseline from other samples, no value head;
       A_i is spread over the response's tokens into the same clipped loss (8)-(10).
       `raft`: the supervised loss (13) on the best of each prompt's k by R, no ratio.

Papers: PPO, Schulman et al. 2017, arXiv:1707.06347 (sec. 3, 5); GAE, Schulman et al. 2015,
arXiv:1506.02438; Ziegler et al. 2019, arXiv:1909.08593 (sec. 2.2, KL reward, adaptive beta);
Stiennon et al. 2020, arXiv:2009.01325 (TL;DR); Ouyang et al. 2022, arXiv:2203.02155 (eq. 2,
ptx); Ahmadian et al. 2024, arXiv:2402.14740 (RLOO).

Run:   python reward_model.py && python ppo.py --beta 0
Sweep: python ppo.py --beta 0 0.01 0.1 0.5 2.0 --seeds 0 1 2      (--resume continues it)
RLOO:  python ppo.py --estimator rloo --samples-per-prompt 4 --beta 0.1
DDP:   torchrun --standalone --nproc_per_node N ppo.py --beta 0.1      (support/parallel.py)
Test:  pytest tests/test_ppo.py
"""

import copy
import math
from dataclasses import dataclass

from support import parallel    # first: it sets what torch and tqdm read as they load
import torch
from torch import nn
from tqdm import tqdm

import decoding
import ppo_kernels
import loaders
import reward_model as rm
from gae import (ESTIMATORS, GAMMA, LAM, AdaptiveKLController, advantages_and_returns,
                 ended_with_eos, kl_per_token, noisy_scores, response_mask,
                 sequence_advantages, sequence_rewards, shaped_rewards, spread_over_tokens,
                 whiten)
from loaders import encode, micro_batches
from lora import adapter_numel, with_lora
from support import cli, disk, sweep
from support.config import option, read_config
from support.heldout import evaluate_run, reference_and_human
from support.measures import copied_bigrams
from support.report import (Laps, check_finite, check_run_folders, gradients,
                            record_iteration, save_checkpoint, start_results, step_log)
from support.sweep import out_folder, run_config, run_dir_for, runs


# ======================================================== the post's hyperparameters
MAX_NEW_TOKENS = 48     # tokens sampled per summary
TEMPERATURE = 1.0       # sampling temperature (every log-prob divides by it: departure 3)
TOP_K = 50              # top-k sampling
TOP_P = 0.95            # nucleus sampling
PROMPT_TOKENS = 256     # posts longer than this are cut (the post drops them: departure 4)
BATCH = 16              # prompts per iteration
CLIP = 0.2              # epsilon of the clipped ratio (9)
INNER_STEPS = 2         # clipped updates on each batch
LR = 1e-4               # the LoRA adapter's learning rate
VALUE_LR = 1e-4         # the value head's learning rate
# GAMMA = 0.99 (discount) and LAM = 0.95 (GAE lambda) of (5)-(6) live with the GAE, gae.py
ITERATIONS = 100        # PPO iterations per run
# The post's LORA_R = 16 and LORA_ALPHA = 32 live with the adapter, lora.py.


# ============================================ ALGO LOGIC: the post's functions, in its order
# ---------------------------------------------------- generating and scoring (1)-(2)

@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, cfg, eos_id):
    """Sample a summary per post, keeping the ids that were sampled.

    out: sequences (B, P+T) and actions (B, T), T <= max_new_tokens. After a row's
    first EOS, generate pads with EOS (SmolLM2's pad id), so `response_mask` later
    keeps positions up to and including the first EOS, never `!= pad`.
    --decoding (`decoding.way`): Hugging Face's `generate` (the post's call) or decoding.py.
    """
    way = decoding.way(cfg.decoding, prompt_ids.device)    # "hf", "static" or "graph"
    if way == "hf":
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                             max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                             top_k=cfg.top_k, top_p=cfg.top_p, pad_token_id=eos_id)
        return out, out[:, prompt_ids.shape[1]:]                # (B, P+T), (B, T)
    graphs = decoding.CUDA_GRAPHS if way == "graph" else None   # replay the step, or eager
    return decoding.sample(model, prompt_ids, prompt_mask, cfg, eos_id, graphs)  # (B, P+T) (B, T)


def as_generated(prompt_ids, drawn, eos_id):
    """What `generate` returned when it drew `drawn`: per row the ids it kept (up to and
    including the first EOS), padded with EOS to the longest, T.
    out: sequences (B, P+T) and actions (B, T)."""
    T = max(len(ids) for ids in drawn)
    actions = torch.tensor([ids + [eos_id] * (T - len(ids)) for ids in drawn],
                           device=prompt_ids.device)                        # (B, T)
    return torch.cat([prompt_ids, actions], 1), actions                     # (B, P+T), (B, T)


def full_mask(prompt_mask, actions):
    """Attention mask for prompt + response: (B, P+T), zeros only on the left padding."""
    return torch.cat([prompt_mask, torch.ones_like(actions)], 1)


def response_hidden(model, sequences, attention_mask, T):
    """Last hidden state at the states s_0 .. s_{T-1} of the response: (B, T, H).

    (1)  s_t = (x, y_{1:t-1})   lives at sequence position P-1+t
    (2)  a_t = y_t              is the token at position P+t
    The last token is never an input to a prediction, so the forward stops before it.
    Position ids count real tokens only, which makes left padding invisible.
    """
    inputs = sequences[:, :-1]                                  # (B, P+T-1)
    mask = attention_mask[:, :-1]                               # (B, P+T-1)
    hidden = model.model(input_ids=inputs, attention_mask=mask,
                         position_ids=loaders.positions(mask)).last_hidden_state  # (B, P+T-1, H)
    return hidden[:, -T:]                                       # (B, T, H) response states only


def token_log_probs(model, sequences, attention_mask, actions, temperature=1.0):
    """log p(a_t | s_t) for the ids actually sampled, (B, T) fp32.

    Departure 3: logits only at response positions, through the fused log-prob
    (ppo_kernels/), divided by the temperature. The same path as `policy_forward`, so the
    reference and a fresh policy agree to the last bit.
    """
    hidden = response_hidden(model, sequences, attention_mask, actions.shape[1])  # (B, T, H)
    with loaders.heads_in_fp32(hidden):
        return ppo_kernels.gather_log_probs_from_hidden(hidden.float(), model.lm_head.weight,
                                                    actions, temperature)    # (B, T)


@torch.no_grad()
def score(reward, prompt_ids, prompt_mask, actions, mask, missing_eos_penalty=None, eos_id=2,
          groups=None, part=rm.DEFAULT_PART):
    """The reward model's score for each post and sampled summary: the post's `rewards`, (B,).

    Departure 2: the reward model reads the sampled ids (its tokenizer is the
    policy's), at the last real token (departure 1). No decode, no re-encode.
    `groups` (from `micro_batches`) scores a few rows at a time without their padding.
    Departure 8: `part` picks the score (rm.PARTS, --reward), "content" f (the default)
    or "full" f + w g(length).
    """
    rewards = torch.empty(len(actions), device=actions.device)  # (B,)
    for rows, first in groups or micro_batches(prompt_mask, len(actions)):
        rewards[rows] = rm.score_ids(reward, prompt_ids[rows, first:],
                                     prompt_mask[rows, first:], actions[rows], mask[rows],
                                     part=part).float()
    if missing_eos_penalty is not None:                         # Ziegler et al.'s "EOS trick"
        ended = ended_with_eos(actions, mask, eos_id)           # (B,)
        rewards = torch.where(ended, rewards, torch.full_like(rewards, missing_eos_penalty))
    return rewards


def learned_from(rewards, beta, cfg, noise_sd, seed, iteration):
    """The score and beta a run learns from: the judge's score plus Gaussian noise of SD
    `noise_sd` (--reward-noise, its own generator: gae.noisy_scores) and, with --flip-sign,
    both the score and the KL penalty negated (the note's sign bug: r_t = +beta KL_t - r).
    rewards (B,) -> ((B,), beta)"""
    seen = noisy_scores(rewards, noise_sd, seed, iteration, parallel.rank())   # (B,)
    return (-seen, -beta) if cfg.flip_sign else (seen, beta)


@torch.no_grad()
def fluency(reference, sequences, attention_mask, actions, mask, temperature=1.0):
    """The reference model's total log-probability of each summary, (B,), real tokens only.

    (Given another model, its own total log-probability: `heldout.rollouts` uses that for
    the KL.)"""
    logp_ref = token_log_probs(reference, sequences, attention_mask, actions, temperature)
    return torch.where(mask.bool(), logp_ref, 0.0).sum(-1)



# ------------------------------------------------------------ the policy and values

class ValueHead(nn.Module):
    """The fourth model. One scalar per state: what this position is worth."""

    def __init__(self, width):
        super().__init__()
        self.project = nn.Linear(width, 1)

    def forward(self, hidden):
        return self.project(hidden).squeeze(-1)                 # (B, T, H) -> (B, T)


def init_value_head(value_head, how, reward):
    """The value head's start (--value-init): `post` leaves nn.Linear's default init (the
    post's); `zero` sets V = 0; `reward` copies the reward model's content head, weight and
    bias plus its normalisation shift (the note: sensible early values and so early policy
    gradients). The policy's hidden states lack the reward model's adapter, so that V(s_t)
    is only near the content score of the prefix s_t."""
    with torch.no_grad():
        if how == "zero":
            value_head.project.weight.zero_()
            value_head.project.bias.zero_()
        elif how == "reward":
            value_head.project.weight.copy_(reward.head.weight)
            value_head.project.bias.copy_(reward.head.bias + reward.bias)
    return value_head


def policy_and_value(reference, reward, cfg, device):
    """The second and fourth models: the policy, the reference plus a fresh LoRA adapter (a
    no-op until trained), and the value head (none with --estimator rloo, reinforce, grpo:
    departure 9). The post deep-copies the reference; sharing its frozen tensors gives the
    same model without a second copy of the weights (only the adapter trains)."""
    policy = with_lora(copy.deepcopy(reference, memo={id(p): p for p in reference.parameters()}))
    policy.eval()                               # dropout off in every pass, training ones too
    if cfg.estimator != "gae":
        return policy, None
    return policy, init_value_head(ValueHead(reference.config.hidden_size).to(device),
                                   cfg.value_init, reward)


def policy_forward(policy, value_head, sequences, attention_mask, actions, temperature=1.0,
                   with_entropy=False):
    """Log-probs and values for the same positions, from one forward pass.

    in:  sequences (B, P+T), attention_mask (B, P+T), actions (B, T)
    out: logp = log pi(a_t | s_t) (B, T) fp32, values = V(s_t) (B, T), and with
         with_entropy the entropy of pi(. | s_t) (B, T) from the same pass
    """
    hidden = response_hidden(policy, sequences, attention_mask, actions.shape[1])  # (B, T, H)
    with loaders.heads_in_fp32(hidden):
        hidden = hidden.float()                                 # (B, T, H)
        out = ppo_kernels.gather_log_probs_from_hidden(hidden, policy.lm_head.weight, actions,
                                                   temperature, return_entropy=with_entropy)
        logp, entropy = out if with_entropy else (out, None)    # (B, T) each
        values = value_head(hidden) if value_head else None     # (B, T); none without a head
        return logp, values, entropy


@torch.no_grad()
def old_and_reference(policy, value_head, reference, sequences, attention, actions, groups, cfg):
    """log pi_old(a_t|s_t), V(s_t) and log pi_ref(a_t|s_t) of the sampled actions, (B, T) each
    (values 0 without a value head). In the inner step's micro-batches, groups and shapes
    (departure 7), through the same `policy_forward`: the first inner step's ratio is 1."""
    logp_old, values, logp_ref = (torch.zeros(actions.shape, device=actions.device)
                                  for _ in range(3))                # (B, T) each
    for rows, first in groups:
        seq, att, act = sequences[rows, first:], attention[rows, first:], actions[rows]
        with loaders.precision(cfg, actions.device):
            logp_old[rows], v, _ = policy_forward(policy, value_head, seq, att, act,
                                                  cfg.temperature)
            logp_ref[rows] = token_log_probs(reference, seq, att, act, cfg.temperature)
        if v is not None:                               # gae only; the others keep zeros
            values[rows] = v
    return logp_old, values, logp_ref



# ---------------------------------------------- losses (8)-(14) and the ratio probe

def ppo_losses(logp, logp_old, adv, values, ret, *, mask, clip=CLIP, entropy=None,
               n_seq=None, n_tok=None, values_old=None, value_clip=None, ratio=True):
    """Eq. (8)-(12) for one (micro-)batch: the clipped policy loss, the value loss, and
    the entropy term, each a scalar, plus the clip statistics.

    The post's five arguments (its new, old, advantage, predicted, target), then keywords:
    in:  logp, logp_old, adv, values, ret, mask, entropy: (b, T); n_seq and n_tok, the
         sequences and real tokens of the whole batch, so that the micro-batches of one
         batch add up to exactly the full-batch losses (defaults: this batch's own).
         values None: no value head (--estimator rloo, reinforce, grpo), value loss 0.
         value_clip: eps_v of the clipped value loss, around values_old (b, T).
         clip = inf: no clipping, J = r_t A_t. ratio False (--estimator raft): no ratio,
         L = -sum_t A_t log pi_theta, the supervised loss (13) on the rows A weighs.
    """
    b, m = logp.shape[0], mask.bool()
    n_seq = n_seq or b
    n_tok = n_tok or m.sum().clamp(min=1)
    # (8)  r_t(theta) = pi_theta(a_t|s_t) / pi_old(a_t|s_t) = exp(logp - logp_old)
    # (9)  J_clip = E_t[min(r_t A_t, clip(r_t, 1-eps, 1+eps) A_t)]
    # (10) L_policy = -J_clip     summed over real tokens, averaged over sequences, as the
    #      post's `-clipped.sum(-1).mean()` (departure 1: padding masked out)
    loss_of = ppo_kernels.masked_clipped_loss if ratio else ppo_kernels.masked_log_prob_loss
    policy_loss, stats = loss_of(logp, logp_old, adv, mask, clip)
    policy_loss = policy_loss * (b / n_seq)                     # this micro-batch's share
    value_loss = torch.zeros((), device=logp.device)
    if values is not None:
        # (11) L_value = E_t[(V(s_t) - R_t)^2]       (departure 5: mean over real tokens)
        error = (values - ret) ** 2                             # (b, T)
        if value_clip is not None:              # Ziegler, Stiennon: the larger of the two
            # V_clip = V_old + clip(V - V_old, -eps_v, eps_v); E_t[max((V-R)^2, (V_clip-R)^2)]
            clipped = values_old + (values - values_old).clamp(-value_clip, value_clip)
            error = torch.maximum(error, (clipped - ret) ** 2)
        value_loss = torch.where(m, error, 0.0).sum() / n_tok
    # (12) L_ent = -E_t[H(pi_theta(. | s_t))]
    ent_loss = (-torch.where(m, entropy, 0.0).sum() / n_tok if entropy is not None
                else torch.zeros((), device=logp.device))
    return policy_loss, value_loss, ent_loss, stats


def ptx_loss(policy, tokenizer, posts, device, temperature=1.0):
    """(13) L_ptx = -E_{(x,y)~D_ptx} sum_t log pi_theta(y_t | x, y_{1:t-1}) on human TL;DRs.

    The prompt and the summary are tokenized apart, as in generation, and the
    summary ends in EOS.
    """
    prompt_ids, prompt_mask = encode(tokenizer, [p["prompt"] for p in posts], device)
    summaries = tokenizer([" " + p["summary"] + tokenizer.eos_token for p in posts],
                          return_tensors="pt", padding=True, padding_side="right",
                          add_special_tokens=False)
    actions = summaries["input_ids"].to(device)                 # (B, T) right-padded
    mask = summaries["attention_mask"].to(device)               # (B, T)
    sequences = torch.cat([prompt_ids, actions], 1)             # (B, P+T)
    logp = token_log_probs(policy, sequences, full_mask(prompt_mask, actions), actions,
                           temperature)                         # (B, T)
    # (13) L_ptx = -E_(x,y) sum_t log pi_theta(y_t | x, y_{1:t-1}): summary tokens only
    return -torch.where(mask.bool(), logp, 0.0).sum(-1).mean()


class RatioError(RuntimeError):
    """The ratio is not 1 before the first step: old and new log-probs disagree."""


def ratio_line(iteration, lo, hi, clip):
    """The probe's line in the log: the ratio's range at the first inner step."""
    return (f"iteration {iteration}: ratio at the first inner step {lo:.4f} to {hi:.4f} " + (
            f"(clip range {1 - clip:.1f} to {1 + clip:.1f})" if clip < math.inf else "(no clip)"))


def check_ratio(ratio, tolerance=1e-5):
    """(min, max) of the ratio before any step; raises RatioError if either is not 1.

    Before the first inner step the policy has not moved, so every r_t of eq. (8)
    must be exactly 1 (fp32). `ratio` may be per token or per sequence.
    """
    lo, hi = ratio.min().item(), ratio.max().item()
    if abs(lo - 1) > tolerance or abs(hi - 1) > tolerance:
        raise RatioError(
            f"ratio at the first inner step is {lo:.6f} to {hi:.6f}, not 1 (tolerance "
            f"{tolerance}). The post's two failure modes:\n"
            "  1. the ids were decoded to text and re-encoded (decode-then-encode is not a "
            "round trip), so old and new log-probs score different tokens;\n"
            "  2. per-token ratios were summed (giving the sequence length) instead of summing "
            "log-ratios.\n"
            "Also check: dropout left on (call .eval()), a non-zero adapter init, different "
            "slicing or temperature between the old and the new forward.")
    return lo, hi


@torch.no_grad()
def ratio_after(policy, batch, cfg):
    """(min, max) of r_t = pi_theta / pi_old over the batch's real tokens after the last
    inner step: how far the update moved the policy. The clip does not bound r (it only
    stops pushing past 1 +- eps), so r may leave the range (the concept lesson)."""
    lo, hi = math.inf, -math.inf
    for rows, first in batch.groups:
        with loaders.precision(cfg, batch.sequences.device):
            logp, _, _ = policy_forward(policy, None, batch.sequences[rows, first:],
                                        batch.attention[rows, first:], batch.actions[rows],
                                        cfg.temperature)                        # (b, T)
        # (8) r_t = exp(logp - logp_old) on real tokens
        ratio = (logp - batch.logp_old[rows]).exp()[batch.mask[rows].bool()]    # (N,)
        lo, hi = min(lo, ratio.min().item()), max(hi, ratio.max().item())
    return parallel.total(lo, "min"), parallel.total(hi, "max")



# -------------------------------------------------------------------------- the loop

class OneActionAdvantages:
    """Departure 9 (--estimator rloo, reinforce, grpo): the response as one action, its
    baseline from other samples, not from a value head. It keeps the one state such an
    estimator carries from batch to batch, REINFORCE's moving-average `baseline` (None
    until the first batch), which the checkpoint saves."""

    def __init__(self, cfg):
        self.cfg, self.baseline = cfg, None

    def __call__(self, rewards, kl, mask, beta):
        """A_i on each real token (B, T). rewards (B,), kl and mask (B, T). A batch holds
        each post's k samples side by side (every rank's rows, under torchrun)."""
        cfg = self.cfg
        prompt_of = torch.arange(cfg.batch, device=mask.device).repeat_interleave(
            cfg.samples_per_prompt)                                               # (B,) all ranks
        # R(x, y) = r_phi(x, y) - beta sum_t D_KL^(t)
        R = sequence_rewards(rewards, kl, mask, beta)                             # (B,)
        # A_i = R_i - b_i; b_i the mean of the prompt's other samples (rloo), a moving
        # average (reinforce), the group mean, A_i then / group std (grpo); raft: A_i = k on
        # the prompt's best sample, 0 on the others (its loss has no ratio: `ppo_losses`)
        adv, self.baseline = sequence_advantages(cfg.estimator, parallel.gather(R), prompt_of,
                                                 self.baseline, cfg.reinforce_decay,
                                                 cfg.grpo_unbiased)
        # A_i on each real token, not whitened; GRPO averages a response's tokens (1/|y_i|)
        return spread_over_tokens(parallel.mine(adv), mask, length_normalise=(
            cfg.estimator == "grpo" and not cfg.grpo_unbiased))                   # (B, T)


def make_optimizer(policy, value_head, cfg):
    """The post's AdamW: the adapter at LR, the value head (if any) at VALUE_LR. Returns it
    and every tensor it trains."""
    adapter = [p for p in policy.parameters() if p.requires_grad]
    head = list(value_head.parameters()) if value_head else []
    optimizer = torch.optim.AdamW([{"params": adapter, "lr": cfg.lr}]
                                  + ([{"params": head, "lr": cfg.value_lr}] if head else []))
    return optimizer, adapter + head


@dataclass
class Rollout:
    """One iteration's batch, as the inner steps read it (this rank's rows under torchrun):
    sequences and attention (B, P+T); actions, mask, logp_old, values, adv and ret (B, T),
    ret None without a value head; the micro-batches' (rows, first column); the posts."""
    iteration: int
    sequences: torch.Tensor
    attention: torch.Tensor
    actions: torch.Tensor
    mask: torch.Tensor
    logp_old: torch.Tensor
    values: torch.Tensor
    adv: torch.Tensor
    ret: torch.Tensor
    groups: list
    posts: list


def train(cfg, beta, seed, models, pool, run_dir, progress=True, noise_sd=0.0):
    """One PPO run, the post's `train`: returns (policy, value_head, results)."""
    reference, reward, tokenizer, device = models
    eos, k = tokenizer.eos_token_id, cfg.samples_per_prompt
    torch.manual_seed(seed)                     # the same adapter and value head on every rank
    policy, value_head = policy_and_value(reference, reward, cfg, device)
    optimizer, trainable = make_optimizer(policy, value_head, cfg)
    parallel.seed_sampling(seed)                # under torchrun, each rank its own stream
    one_action = OneActionAdvantages(cfg) if cfg.estimator != "gae" else None  # departure 9
    # ---- plumbing: results.json (rewritten each iteration), or a resumed run's checkpoint
    start, kl_beta, results = start_results(run_dir, cfg.resume, run_config(cfg, beta, seed),
                                            policy, value_head, optimizer, beta, one_action)
    controller = AdaptiveKLController(kl_beta, cfg.target_kl) if cfg.target_kl else None
    bar = tqdm(range(start, cfg.iterations), desc=f"beta={beta:g} seed={seed}",
               disable=not progress, initial=start, total=cfg.iterations)
    for iteration in bar:
        lap = Laps()                            # plumbing: each phase's seconds
        # ---- 1. generate: sample k summaries for each post with the current policy
        posts = [p for p in parallel.mine(loaders.batch_for(pool, iteration, cfg.batch, seed))
                 for _ in range(k)]             # under torchrun, this rank's share
        prompt_ids, prompt_mask = encode(tokenizer, [p["prompt"] for p in posts], device)
        with loaders.precision(cfg, device):            # (B, P+T), (B, T)
            sequences, actions = generate(policy, prompt_ids, prompt_mask, cfg, eos)
        mask = response_mask(actions, eos)              # (B, T) 1 up to and incl. first EOS
        attention = full_mask(prompt_mask, actions)     # (B, P+T)
        groups = micro_batches(prompt_mask, cfg.micro_batch)    # [(rows, first column)]
        lap("generate")
        # ---- 2. score the finished summaries (ids, not text)
        with loaders.precision(cfg, device):
            rewards = score(reward, prompt_ids, prompt_mask, actions, mask, groups=groups,
                            missing_eos_penalty=cfg.missing_eos_penalty, eos_id=eos,
                            part=cfg.reward)                                    # (B,)
        check_finite(iteration, score=rewards)
        lap("score")
        # ---- 3. old log-probs and values (training path), reference log-probs
        logp_old, values, logp_ref = old_and_reference(policy, value_head, reference, sequences,
                                                       attention, actions, groups, cfg)  # (B, T)
        beta_now = controller.beta if controller else beta
        seen, beta_seen = learned_from(rewards, beta_now, cfg, noise_sd, seed, iteration)
        with torch.no_grad():
            # ---- 4. shaped reward (3)-(4), then GAE (5)-(6) and returns (7)
            # (4)  D_KL^(t) ~= log pi_old(a_t|s_t) - log pi_ref(a_t|s_t)   (k1; k3 if asked)
            kl = kl_per_token(logp_old, logp_ref, cfg.kl_estimator)         # (B, T)
            # (3)  r_t = -beta D_KL^(t) + 1{t=T} r_score, T each response's last real token
            per_token = shaped_rewards(logp_old, logp_ref, seen, beta_seen, mask, kl=kl)
            if one_action is None:                      # whitening: every rank's rows
                if cfg.whiten_rewards:                  # Stiennon et al.: rescaled, not shifted
                    per_token = parallel.across(whiten, per_token, mask, shift_mean=False)
                # (5)-(7)  delta_t, A_t = sum_l (gamma lam)^l delta_{t+l}, R_t = A_t + V(s_t)
                adv, ret = advantages_and_returns(per_token, values, mask, cfg.gamma,
                                                  cfg.lam)                  # (B, T) each
                adv = parallel.across(whiten, adv, mask)        # (B, T) over real tokens only
            else:                                       # departure 9: no value head to fit
                adv, ret = one_action(seen, kl, mask, beta_seen), None              # (B, T)
            check_finite(iteration, reward=per_token, advantage=adv)
        lap("forward")
        # ---- 5. INNER_STEPS clipped updates on this batch
        batch = Rollout(iteration, sequences, attention, actions, mask, logp_old, values, adv,
                        ret, groups, posts)
        logs = []
        for step in range(cfg.inner_steps):
            log, ratios = accumulate_gradients(policy, value_head, batch, cfg, tokenizer)
            check_finite(iteration, gradient=gradients(trainable))     # before the step
            parallel.sum_gradients(trainable)           # torchrun: the whole batch's gradient
            if step == 0:       # the post's probe, before any step, on every rank's tokens
                ratio_min, ratio_max = check_ratio(parallel.gather(ratios))
                bar.write(ratio_line(iteration, ratio_min, ratio_max, cfg.clip))
            optimizer.step()
            logs.append(log)
        lap("update")
        # ---- plumbing: the iteration's row (whole batch), results.json, a checkpoint
        row = record_iteration(results, iteration, lap, run_dir, device, bar, dict(
            rewards=rewards, per_token=per_token, kl=kl, values=values, ret=ret, mask=mask,
            actions=actions), eos=eos, logs=logs, beta=beta_now,
            ratios=(ratio_min, ratio_max, *ratio_after(policy, batch, cfg)))
        if controller:                                  # on the batch's KL per sequence
            controller.update(row["kl"])
        if (iteration + 1) % cfg.checkpoint_every == 0 or iteration + 1 == cfg.iterations:
            save_checkpoint(run_dir, iteration, policy, value_head, optimizer,
                            controller.beta if controller else beta, one_action)
    return policy, value_head, results


def accumulate_gradients(policy, value_head, batch, cfg, tokenizer):
    """One inner step's forward and backward passes, micro-batch by micro-batch. Each part's
    loss is its share of the whole batch's (14), so the gradients add up to the whole batch's
    (across ranks too, once `parallel.sum_gradients` has summed them), from zero gradients.
    Returns the step's log (whole batch) and the ratio's min and max in each micro-batch,
    (2 x parts,)."""
    policy.zero_grad(set_to_none=True)
    if value_head is not None:
        value_head.zero_grad(set_to_none=True)
    n_seq = parallel.total(len(batch.posts))            # responses in the whole batch
    n_tok = parallel.total(batch.mask.sum())            # real tokens in the whole batch
    parts, ratios = [], []
    for rows, first in batch.groups:                    # same gradient as one batch
        mask, logp_old = batch.mask[rows], batch.logp_old[rows]    # (b, T) each
        with loaders.precision(cfg, batch.sequences.device):
            logp, v, entropy = policy_forward(policy, value_head, batch.sequences[rows, first:],
                                              batch.attention[rows, first:],
                                              batch.actions[rows], cfg.temperature,
                                              with_entropy=True)
        # (8) r_t = exp(logp - logp_old) on real tokens: exactly 1 before the first step
        ratio = (logp - logp_old).exp().detach()[mask.bool()]     # (N,) real tokens
        ratios += [ratio.min(), ratio.max()]
        ret = None if batch.ret is None else batch.ret[rows]              # (b, T)
        pl, vl, el, stats = ppo_losses(logp, logp_old, batch.adv[rows], v, ret, mask=mask,
                                       clip=cfg.clip, entropy=entropy, n_seq=n_seq, n_tok=n_tok,
                                       values_old=batch.values[rows], value_clip=cfg.value_clip,
                                       ratio=cfg.estimator != "raft")
        # (14) L_total = L_policy + c_v L_value + c_ent L_ent + c_ptx L_ptx
        loss = pl + cfg.vf_coef * vl + cfg.ent_coef * el
        lm = torch.zeros(())
        if cfg.ptx_coef:                                # (13) on these posts' human TL;DRs
            with loaders.precision(cfg, batch.sequences.device):
                lm = ptx_loss(policy, tokenizer, [batch.posts[r] for r in rows.tolist()],
                              batch.sequences.device, cfg.temperature)
            loss = loss + cfg.ptx_coef * lm * (len(rows) / n_seq)
        loss.backward()
        parts.append(torch.stack([x.detach().float().to(loss.device) for x in (
            loss, pl, vl, el, stats["clipfrac"], stats["approx_kl"], lm, mask.sum())]))
    # Read on the host once a step (a NaN stops the run before the optimizer steps on it)
    log = step_log(batch.iteration, torch.stack(parts), [len(rows) for rows, _ in batch.groups],
                   n_seq, n_tok.item(), with_ptx=bool(cfg.ptx_coef))
    return log, torch.stack(ratios)                     # whole batch, (2 x parts,)



# ---------------------------------------- the final evaluation, on held-out posts

@torch.no_grad()
def rollouts(model, reference, reward, tokenizer, posts, cfg, device, drawn=None):
    """The post's last lines of `train`, on held-out posts: generate, score and fluency for
    each post in `posts`, in batches; per sample (in their order): reward (the --reward
    score; None with no reward model, as sft.py's rows may be), fluency, KL, length, eos,
    copied_bigrams, ids and text (support/measures.py). `drawn`: the ids `model` drew for
    these posts before, in these batches (sft.py's, `heldout.sft_draws`), in place of
    sampling them again. support/heldout.py turns them into the run's final numbers."""
    # In chunks of one iteration's responses: the same for every setting of
    # tools/analysis/compare_estimators.py (8), so they share the reference's samples.
    eos, out, step = tokenizer.eos_token_id, [], cfg.batch * cfg.samples_per_prompt
    for i in tqdm(range(0, len(posts), step), desc="held-out samples", unit="batch",
                  leave=False):
        chunk = posts[i:i + step]
        prompt_ids, prompt_mask = loaders.encode(tokenizer, [p["prompt"] for p in chunk], device)
        with loaders.precision(cfg, device):
            sequences, actions = (generate(model, prompt_ids, prompt_mask, cfg, eos)
                                  if drawn is None else
                                  as_generated(prompt_ids, drawn[i:i + step], eos))
            mask = response_mask(actions, eos)
            attention = full_mask(prompt_mask, actions)
            rewards = (score(reward, prompt_ids, prompt_mask, actions, mask, eos_id=eos,
                             part=cfg.reward) if reward is not None else None)       # (b,)
            flu = fluency(reference, sequences, attention, actions, mask,
                              cfg.temperature)                                       # (b,)
            # KL of a summary: sum_t logp - logp_ref = (its log-prob under `model`) - fluency
            own = flu if model is reference else fluency(
                model, sequences, attention, actions, mask, cfg.temperature)         # (b,)
        m, ended = mask.bool(), ended_with_eos(actions, mask, eos)                    # (b, T), (b,)
        for b in range(len(chunk)):
            ids = actions[b][m[b]].tolist()
            words = ids[:-1] if ended[b] else ids               # the summary without its EOS
            post = prompt_ids[b][prompt_mask[b].bool()].tolist()   # its prompt, no padding
            out.append({"reward": None if rewards is None else rewards[b].item(),
                        "fluency": flu[b].item(),
                        "kl": (own[b] - flu[b]).item(), "length": len(ids), "ids": ids,
                        "eos": bool(ended[b]), "copied_bigrams": copied_bigrams(words, post),
                        "text": tokenizer.decode(ids, skip_special_tokens=True)})
    return out


# ========================== plumbing: the run's settings (flags, presets), runs, sweeps, main

@dataclass
class Config:
    """Every setting of a run: the post's hyperparameters first, then the extras, then how
    the run is organised. Each is a flag (support/config.py); presets below."""
    # ---- the post's hyperparameters
    beta: list = option((0.1,), "KL coefficient(s) of (3); several run a sweep")
    iterations: int = option(ITERATIONS, "PPO iterations per run (the post: 100)")
    batch: int = option(BATCH, "prompts per iteration, BATCH (the post: 16)")
    prompt_tokens: int = option(PROMPT_TOKENS, "PROMPT_TOKENS, longer posts are cut (the "
                                               "post: 256)")
    max_new_tokens: int = option(MAX_NEW_TOKENS, "MAX_NEW_TOKENS (the post: 48)")
    temperature: float = option(TEMPERATURE, "sampling temperature (the post: 1.0)")
    top_k: int = option(TOP_K, "top-k sampling (the post: 50)")
    top_p: float = option(TOP_P, "nucleus sampling (the post: 0.95)")
    inner_steps: int = option(INNER_STEPS, "clipped updates per batch, INNER_STEPS (the post: 2)")
    lr: float = option(LR, "adapter learning rate, LR (the post: 1e-4)")
    value_lr: float = option(VALUE_LR, "value head learning rate, VALUE_LR (the post: 1e-4)")
    clip: float = option(CLIP, "PPO clip epsilon, CLIP (the post: 0.2); off: no clipping, "
                               "r_t A_t (the note's ablation)", parse=cli.number_or_off)
    gamma: float = option(GAMMA, "discount gamma (the post: 0.99)")
    lam: float = option(LAM, "GAE lambda (the post: 0.95)")
    # ---- the loss's other terms (14), 0 as in the post, and the departures' extras
    vf_coef: float = option(1.0, "c_v in (14) (the post: 1)")
    ent_coef: float = option(0.0, "c_ent in (14), the entropy bonus (12) (the post: 0)")
    ptx_coef: float = option(0.0, "c_ptx in (14), LM loss (13) on human TL;DRs (the post: 0)")
    target_kl: float = option(None, "if set, adapt beta toward this KL per sequence (nats), "
                                  "Ziegler et al.'s controller; --beta is the start")
    kl_estimator: str = option("k1", "per-token KL estimate for the penalty: k1 (the post) or k3")
    missing_eos_penalty: float = option(None, "if set, the score of a response with no EOS")
    reward: str = option(rm.DEFAULT_PART, "the score PPO maximises: content, f with length "
                         "partialled out (departure 8), or full, f + w*g(length)")
    estimator: str = option("gae", "the advantage: gae (the post's, with a value head), or "
                            "rloo, reinforce, grpo, raft (the PPO/RLOO note; departure 9)")
    samples_per_prompt: int = option(1, "k, responses sampled per prompt: a batch holds "
                                        "--batch x k responses; rloo and grpo need k >= 2")
    grpo_unbiased: bool = option(False, "grpo: Dr. GRPO's advantage, R - group mean, with "
                                        "neither the 1/std nor the 1/length of GRPO")
    reinforce_decay: float = option(0.9, "reinforce: decay of the moving-average baseline")
    value_clip: float = option(None, "gae: clip the value loss at this eps_v around the old "
                                     "values (Ziegler, Stiennon: 0.2 with --vf-coef 0.1)")
    value_init: str = option("post", "gae: the value head's start: post (nn.Linear's init), "
                                     "zero, or reward (the reward model's head, as Stiennon)")
    whiten_rewards: bool = option(False, "gae: scale the shaped rewards to unit variance "
                                         "before GAE (Stiennon et al.)")
    reward_noise: float = option(0.0, "Gaussian noise on every score the run learns from, its "
                                      "SD in units of the judge's SD over SFT's held-out "
                                      "summaries (the RLOO note's noise test)")
    flip_sign: bool = option(False, "negate both the judge's score and the KL penalty (the "
                                    "note's sign bug)")
    # ---- the run: seeds, speed, evaluation, files
    preset: str = option("auto", "blog (CUDA/MPS default), cpu (CPU default) or tiny (tests)")
    seeds: list = option((0,), "seed(s); every (beta, seed) pair is one run")
    micro_batch: int = option(16, "sequences per forward (and backward) in the old, reference "
                                "and inner-step passes; same gradient, less memory")
    precision: str = option("fp32", "fp32 (the post), bf16 (the bodies under autocast, "
                                  "departure 7) or auto: bf16 on native bf16 matmuls")
    decoding: str = option("auto", "how summaries are sampled: hf (Hugging Face's generate, "
                                   "the post's), static (the same sampler over a static KV "
                                   "cache, decoding.py) or auto: static replayed as a CUDA "
                                   "graph on CUDA, hf elsewhere")
    eval_prompts: int = option(64, "held-out prompts for the final evaluation")
    checkpoint_every: int = option(10, "save a resumable checkpoint every N iterations")
    reward_model: str = option("runs/reward_model", "folder written by reward_model.py")
    out: str = option(None, "output folder (default runs/ppo_beta{b}_seed{s}, or runs/ppo_sweep)")
    resume: bool = option(False, "continue the run in --out from its last checkpoint")
    force: bool = option(False, "with --resume: continue although the checkpoint's settings "
                                "differ; without: start over in an --out that holds a run")
    model: str = loaders.SFT_MODEL                  # --model and --data-dir: loaders.py
    data_dir: str = None


PRESETS = {
    # The post's hyperparameters, for a GPU or Apple silicon. Micro-batches of 4 give the same
    # gradient as the full batch with a third of the post's peak memory (tools/bench_ppo.py).
    # bf16 bodies where the hardware has native bf16 matmuls (0.37x the post's fp32 time on
    # a 2-core CPU with AVX512-BF16, against 0.75x in fp32: tools/bench_ppo.py); fp32 elsewhere.
    "blog": dict(iterations=100, batch=16, prompt_tokens=256, micro_batch=4, eval_prompts=64,
                 precision="auto"),
    # Same algorithm on a 2-core CPU in <= 20 minutes: shorter prompts, fewer iterations,
    # micro-batches of 4 to keep memory down.
    # At the post's LR of 1e-4, 36 iterations left the policy where it started (held-out KL
    # to the reference -0.04 nats, clipfrac 0): a 5x larger step makes up for running about
    # a third of the post's 100 iterations on half its batch.
    # 64 held-out posts: at 32, a gain of +0.32 (paired SD over posts ~1.3) was 1.4 SE; at
    # 64 the same gain would be 2 SE.
    "cpu": dict(iterations=36, batch=8, prompt_tokens=128, micro_batch=4, eval_prompts=64,
                lr=5e-4, value_lr=5e-4, checkpoint_every=6),   # 21-45 s an iteration, 2 cores
    # Seconds, for tests: the tiny random model (loaders.tiny_model) and a tiny reward model.
    "tiny": dict(iterations=3, batch=4, prompt_tokens=64, max_new_tokens=8, micro_batch=2,
                 eval_prompts=4, checkpoint_every=2),
}
# Flags with a fixed set of values, and every numeric flag's range (support/cli.py): both
# are checked right after parsing, before anything loads; a bad value exits with one line.
CHOICES = {"preset": ("auto", "blog", "cpu", "tiny"), "reward": rm.PARTS,
           "kl_estimator": ("k1", "k3"), "precision": ("fp32", "bf16", "auto"),
           "decoding": ("auto", "hf", "static"),
           "estimator": ESTIMATORS, "value_init": ("post", "zero", "reward")}
RANGES = {
    "beta": cli.NON_NEGATIVE, "seeds": cli.NON_NEGATIVE, "iterations": cli.COUNT,
    "batch": cli.COUNT, "prompt_tokens": cli.Range(loaders.PROMPT_TEMPLATE_TOKENS),
    "max_new_tokens": cli.COUNT, "temperature": cli.POSITIVE, "top_k": cli.NON_NEGATIVE,
    "top_p": cli.Range(0, 1, low_open=True), "inner_steps": cli.COUNT,
    "lr": cli.POSITIVE, "value_lr": cli.POSITIVE,
    # clip = 0 caps every ratio at 1 in (9): the policy can never move past pi_old, so no
    # update would be made. Refused rather than run.
    "clip": cli.Range(0, 1, low_open=True, high_open=True, off=True),
    "gamma": cli.UNIT, "lam": cli.UNIT, "vf_coef": cli.NON_NEGATIVE,
    "ent_coef": cli.NON_NEGATIVE, "ptx_coef": cli.NON_NEGATIVE, "target_kl": cli.POSITIVE,
    "missing_eos_penalty": cli.FINITE, "micro_batch": cli.COUNT,
    "eval_prompts": cli.Range(1, loaders.EVAL_RESERVE), "checkpoint_every": cli.COUNT,
    "samples_per_prompt": cli.COUNT, "reinforce_decay": cli.UNIT, "value_clip": cli.POSITIVE,
    "reward_noise": cli.NON_NEGATIVE,
}

def parse_args(argv=None):
    """Config from the command line: defaults, then the preset, then explicit flags. Then
    every value is checked (CHOICES, RANGES, --out, --data-dir, --model, the flags that only
    make sense together: support/sweep.py): a bad one exits with status 2 and one line,
    before anything loads."""
    cfg, parser = read_config(Config, PRESETS, RANGES, CHOICES, argv, __doc__.splitlines()[0])
    return sweep.check_settings(cfg, parser)


def main(argv=None):
    parallel.setup()                                    # under torchrun only
    cfg = parse_args(argv)
    plan = [(beta, seed, run_dir_for(cfg, beta, seed)) for beta, seed in runs(cfg)]
    folder = out_folder(cfg, plan)
    # One process a folder, until this one ends (support/disk.py); then the folders' checks
    with disk.holding([folder, *(run_dir for _, _, run_dir in plan)]):
        check_run_folders(plan, run_config(cfg, None, None), sweep.RESUME_MAY_CHANGE)
        run_plan(cfg, plan, folder)


def run_plan(cfg, plan, folder):
    """The four models once, then the post's sweep: a run for every beta and seed, trained,
    then evaluated on the held-out posts; a sweep's table at the end."""
    device = loaders.pick_device()
    sweep.announce(cfg, device)
    reward_path = sweep.reward_folder(cfg)
    posts = loaders.load_tldr(cfg.data_dir)             # the data first: its errors are cheap
    reference, tokenizer = loaders.load_policy_and_tokenizer(cfg.model, preset=cfg.preset,
                                                             device=device)
    reward = rm.load_reward_model(reward_path, device=device)
    pool, held_out = loaders.load_prompts(cfg, tokenizer, posts)
    models = (reference, reward, tokenizer, device)
    sweep.check_room(cfg, plan, folder, adapter_numel(reference),       # before the long part
                     reference.config.hidden_size)
    # The held-out evaluation runs on rank 0 alone; the others wait at their next collective.
    base = (reference_and_human(cfg, models, held_out, folder, rollouts) if parallel.is_main()
            else None)
    noise_sd = cfg.reward_noise * sweep.judge_sd(base)  # --reward-noise in the judge's SDs
    book = sweep.Book(cfg, plan, folder, base)          # plumbing: skip, resume, failed rows
    for beta in cfg.beta:                               # the post's COEFFICIENTS ...
        for seed in cfg.seeds:                          # ... and SEEDS: a run each
            run_dir = run_dir_for(cfg, beta, seed)
            if book.finished(run_dir):
                continue
            with book.run(beta, seed, run_dir):         # in a sweep, a NaN is a failed row
                policy, _, results = train(cfg, beta, seed, models, pool, run_dir,
                                           parallel.is_main(), noise_sd)
                if parallel.is_main():
                    evaluate_run(cfg, beta, seed, policy, results, models, held_out, base,
                                 run_dir, rollouts)
    book.table()


if __name__ == "__main__":
    cli.run_script(main)
