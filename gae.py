"""Shaped per-token reward, GAE advantages, returns and masked whitening.

This is the arithmetic that turns one score for a finished summary into a number per
token. It mirrors two sections of the post "RLHF with PPO from Scratch":
  "Turning one score into a reward per token"  eq. (3)-(4), `shaped_rewards`
  "What each token was worth"                  eq. (5)-(7), `advantages_and_returns`
and the advantage whitening line of "Putting it together".

Papers:
  GAE:       Schulman et al. 2015, arXiv:1506.02438, Sec. 3 (eq. 16; lambda=0 and 1 in eq. 17-18)
  PPO:       Schulman et al. 2017, arXiv:1707.06347, Sec. 5 (truncated GAE, eq. 11-12)
  KL reward: Ziegler et al. 2019, arXiv:1909.08593, Sec. 2.2 (also the adaptive beta)
             Stiennon et al. 2020, arXiv:2009.01325, Sec. 3.4 (score at EOS, whitening)
  k3:        J. Schulman, "Approximating KL divergence" (blog note, 2020)

Run:   python gae.py                          (prints a worked example, < 1 s)
Test:  python -m pytest -q tests/test_gae.py

Deviations from the post (each is repeated at the line that makes it):
  1. Every function takes a response `mask`: 1 up to and including the first EOS, 0 after.
     Positions after it carry no KL penalty, no value, no advantage and no return, and
     V(s_{t+1}) = 0 past the last real token. The post treats all T columns as real.
  2. The score lands on the last real token (the EOS, or the last column when the response
     hit the length limit). The post's listing adds it to the last column even when the
     summary ended earlier.
  3. Whitening averages over real tokens only; the post's `advantage.std()` also counts
     padding. Like the post we use the unbiased (n-1) std and divide by (std + eps).
Additions the post does not have (it uses k1 and a fixed beta): the k3 KL estimator and
the adaptive beta controller of Ziegler et al., both used by `ppo.py` when asked; and the
estimators of the PPO/RLOO note that treat a response as one action (`rloo_advantages`,
`reinforce_advantages`, `grpo_advantages`, used by `ppo.py --estimator`).

Empty inputs: a mask with no real token raises ValueError wherever an average or a
"last token" would be needed (`masked_mean`, `whiten`, `last_token_index`,
`shaped_rewards`); `advantages_and_returns` returns exact zeros there. Never NaN.
"""
import math

import torch

GAMMA, LAM = 0.99, 0.95  # the post's values ("The state and the action" listing)


# ---------------------------------------------------------------- which tokens are real

def response_mask(actions, eos_id):
    """1.0 up to and including the first EOS, 0.0 after it. (B, T) float32.

    Derived from positions, never from `actions != pad`: SmolLM2 pads with its EOS id,
    so that test would also drop the one EOS that ends the response. A response with no
    EOS (it hit the length limit) is real at every position.
    """
    is_eos = actions == eos_id                          # (B, T) bool
    eos_before = is_eos.cumsum(1) - is_eos.long()       # (B, T) count of EOS strictly before t
    return (eos_before == 0).float()                    # (B, T) keeps t <= first EOS


def ended_with_eos(actions, mask, eos_id):
    """(B,) bool: the response holds an EOS among its real tokens (mask 1), i.e. it ended
    rather than being cut at the length limit. actions, mask: (B, T)."""
    return ((actions == eos_id) & mask.bool()).any(-1)              # (B,)


def last_token_index(mask):
    """(B,) long: the last real position of each row (the EOS, or T-1 at the limit)."""
    m = mask.bool()                                     # (B, T)
    if not m.any(1).all():
        raise ValueError("last_token_index: a row of the mask has no real token; "
                         "every response has at least one (position 0 is always kept).")
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)  # (B, T)
    return torch.where(m, positions, -1).amax(1)        # (B,) long


def masked_mean(x, mask, dim=None):
    """Mean of x over real positions only (all of them, or along `dim`)."""
    m = mask.bool()                                     # same shape as x
    # torch.where rather than x * mask: a NaN or inf sitting in a padded position stays out.
    kept = torch.where(m, x, torch.zeros_like(x))      # same shape as x, 0 on padding
    total = kept.sum() if dim is None else kept.sum(dim)
    count = m.sum() if dim is None else m.sum(dim)      # scalar, or x's shape without `dim`
    if (count == 0).any():
        raise ValueError("masked_mean: the mask selects no position, so the mean is undefined.")
    return total / count


# ---------------------------------------------------------------- eq. (3)-(4): shaped reward

def kl_per_token(logp, logp_ref, estimator="k1"):
    """Per-token KL estimate from the log-probs of the tokens actually taken. (B, T).

    k1 is the post's eq. (4): unbiased, but negative on some tokens.
    k3 is unbiased too and never negative (Schulman's note): with log r = logp_ref - logp,
    k3 = (r - 1) - log r, which is >= 0 because log r <= r - 1.
    """
    if estimator == "k1":
        # (4)  D_KL^(t) ~= log pi_theta(a_t|s_t) - log pi_ref(a_t|s_t)
        return logp - logp_ref                          # (B, T)
    if estimator == "k3":
        log_r = logp_ref - logp                         # (B, T) log(pi_ref / pi_theta)
        return torch.expm1(log_r) - log_r               # (B, T) (r - 1) - log r, r = exp(log_r)
    raise ValueError(f"kl_per_token: estimator must be 'k1' or 'k3', got {estimator!r}")


def shaped_rewards(logp_old, logp_ref, rewards, beta, mask, kl=None):
    """Per-token reward r_t (the post's `per_token`): a KL penalty at every real token, the
    reward model's score at the last one.

    in:  logp_old, logp_ref (B, T) log-probs of the taken tokens; rewards (B,) the score of
         each response; beta a float; mask (B, T); kl optional (B, T) precomputed (k3)
    out: r_t (B, T), exactly 0 after the last real token
    """
    m = mask.bool()                                     # (B, T)
    if kl is None:
        kl = kl_per_token(logp_old, logp_ref)           # (B, T) k1, eq. (4)
    # (3)  r_t = -beta D_KL^(t) + 1{t=T} r_score(x, y)
    # Deviation 1: the penalty stops at the first EOS (where, not multiply, so junk
    # log-probs on padding cannot leak in as NaN).
    per_token = torch.where(m, -beta * kl, torch.zeros_like(kl))    # (B, T)
    # Deviation 2: "t=T" is each response's own last real token, not column -1.
    last = last_token_index(m)                          # (B,)
    return per_token.scatter_add(1, last[:, None],
                                 rewards.to(per_token.dtype)[:, None])  # (B, T)


# ---------------------------------------------------------------- eq. (5)-(7): GAE, returns

def advantages_and_returns(per_token, values, mask, gamma=GAMMA, lam=LAM):
    """TD errors, then GAE backwards, then reward-to-go, over real tokens only.

    in:  per_token r_t and V(s_t), both (B, T); mask (B, T)
    out: adv A_t and ret R_t (the value target), both (B, T), 0 at padded positions

    One pass from t = T-1 down to 0, vectorised over the batch. The recursion
    A_t = delta_t + gamma lam A_{t+1} is eq. (6) unrolled: the tests check it against the
    double sum. Rows whose mask is all zero come out as exact zeros.
    """
    m = mask.bool()                                     # (B, T)
    zero = torch.zeros_like(per_token)                  # (B, T)
    r = torch.where(m, per_token, zero)                 # (B, T) Deviation 1: no reward on padding
    v = torch.where(m, values.to(r.dtype), zero)        # (B, T) ... and no value either
    # (B, T+1): a zero column past the end. Together with v = 0 on padding this makes
    # V(s_{t+1}) = 0 past each row's last real token (Deviation 1); the post's listing
    # has the zero only past column T-1.
    v_next = torch.cat([v[:, 1:], zero[:, :1]], 1)      # (B, T) V(s_{t+1})
    adv = torch.zeros_like(per_token)                   # (B, T)
    running = zero[:, 0]                                # (B,) A_{t+1}, 0 past the end
    for t in reversed(range(per_token.shape[1])):
        # (5)  delta_t = r_t + gamma V(s_{t+1}) - V(s_t)
        delta = r[:, t] + gamma * v_next[:, t] - v[:, t]            # (B,)
        # (6)  A_t = sum_{l=0}^{T-t-1} (gamma lam)^l delta_{t+l} = delta_t + gamma lam A_{t+1}
        running = torch.where(m[:, t], delta + gamma * lam * running, zero[:, 0])  # (B,)
        adv[:, t] = running
    # (7)  R_t = A_t + V(s_t)        (v is 0 on padding, so ret is 0 there too)
    ret = adv + v                                       # (B, T)
    return adv, ret


# ---------------------------------------------------------------- whitening

def whiten(x, mask, shift_mean=True, eps=1e-6):
    """(x - mean) / (std + eps) over real tokens only; padded positions are set to 0. (B, T).

    The post whitens advantages with `(a - a.mean()) / (a.std() + 1e-6)`; eps = 1e-6 is its
    value. std is the unbiased (n-1) one, as torch's `.std()` in the post. Deviation 3: mean
    and std count real tokens only. With one real token the n-1 has nothing to divide, so its
    variance is taken as 0 and the token whitens to exactly 0. shift_mean=False adds the mean
    back (scale only), the variant Stiennon et al.'s code uses for rewards.
    """
    m = mask.bool()                                     # same shape as x
    mean = masked_mean(x, m)                            # scalar; ValueError if no real token
    dev = torch.where(m, x - mean, torch.zeros_like(x))                 # (B, T) 0 on padding
    n = m.sum()                                         # scalar count of real tokens
    var = (dev ** 2).sum() / (n - 1).clamp(min=1)       # scalar, unbiased; 0 when n == 1
    out = dev / (var.sqrt() + eps)                      # (B, T)
    if not shift_mean:
        out = out + mean                                # (B, T)
    return torch.where(m, out, torch.zeros_like(out))   # (B, T) padded positions stay 0


# ------------------------------------------- the response as one action (the PPO/RLOO note)
# Every token before the last earns only its KL penalty, so the note treats a response as one
# action with one reward, a bandit, and estimates its advantage from other samples instead of
# a value model. ppo.py spreads A_i over the response's real tokens and feeds the same clipped
# loss (8)-(10), summed over tokens and averaged over responses; at r = 1 its gradient is
# -(1/N) sum_i A_i grad log pi(y_i | x_i), the REINFORCE gradient.
# Ahmadian et al. 2024, arXiv:2402.14740 (RLOO, REINFORCE with a moving-average baseline);
# Shao et al. 2024, arXiv:2402.03300, sec. 4.1 (GRPO); Liu et al. 2025, arXiv:2503.20783
# (Dr. GRPO: GRPO's 1/|y_i| and 1/std terms are biased; dropping both removes the bias).
ESTIMATORS = ("gae", "rloo", "reinforce", "grpo", "raft")


def sequence_rewards(rewards, kl, mask, beta):
    """R(x, y) = r_phi(x, y) - beta sum_t KL_t over the response's real tokens: rewards (B,)
    the reward model's scores, kl and mask (B, T). (B,)"""
    # R(x, y) = r(x, y) - beta sum_t D_KL^(t)      (the note's bandit view of eq. (3))
    return rewards - beta * torch.where(mask.bool(), kl, 0.0).sum(-1)


def noisy_scores(rewards, sd, seed, iteration, stream=0):
    """The judge's scores with Gaussian noise of SD `sd` (the RLOO note's reward-noise test):
    r_i + sd z_i, z_i ~ N(0, 1) from a generator of its own, seeded by (seed, iteration,
    stream: torchrun's rank), so that the global RNG (sampling) is untouched and a resumed
    run draws the same noise. sd = 0 returns `rewards` itself. rewards: (B,) -> (B,)"""
    if sd == 0:
        return rewards
    generator = torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 1_009 + stream)
    z = torch.randn(rewards.shape, generator=generator, dtype=torch.float64)   # (B,) on the CPU
    # r_i + sd z_i
    return rewards + (sd * z).to(rewards.dtype).to(rewards.device)


def _group_sums(x, group):
    """(sum of x over each row's group, the group's size), both per row. x, group: (B,)"""
    size = torch.zeros(int(group.max()) + 1, dtype=x.dtype, device=x.device)
    total = torch.zeros_like(size)
    size.index_add_(0, group, torch.ones_like(x))
    total.index_add_(0, group, x)
    return total[group], size[group]                                  # (B,), (B,)


def _from_group_min(R, group):
    """R_i - min_{j in i's group} R_j: every estimator below is unchanged by a shift of a
    group's rewards, and this one is exact where it matters. A tied group becomes exact
    zeros (x - x = 0 in any dtype), and two rewards within a factor of 2 of each other
    subtract without rounding (Sterbenz), so a near tie keeps its true, tiny spread. Summing
    the raw R instead rounds: 3 or 8 equal float32 rewards can sum to k R +- 1 ulp, and the
    "mean" then sits beside every one of them. R, group: (B,) -> (B,)"""
    low = torch.full((int(group.max()) + 1,), float("inf"), dtype=R.dtype,
                     device=R.device)                                   # (groups,)
    low = low.scatter_reduce(0, group, R, reduce="amin")               # (groups,) minima
    return R - low[group]


def rloo_advantages(R, group):
    """REINFORCE leave-one-out: each sample's baseline is the mean of the other k - 1
    samples of its prompt. R (B,) sequence rewards; group (B,) the prompt of each row, in
    any order. Needs k >= 2 samples in every group. A tied group gives exact zeros. (B,)

    For k = 2 the advantages are +-(R(y+) - R(y-)), and the loss is the note's contrastive
    form (`rloo_pair_objective`).
    """
    R = _from_group_min(R, group)                                     # same A, exact ties
    total, k = _group_sums(R, group)
    if (k < 2).any():
        raise ValueError("rloo_advantages: every prompt needs at least 2 samples")
    # A_i = R_i - 1/(k-1) sum_{j != i} R_j
    return R - (total - R) / (k - 1)


def rloo_pair_objective(R, logp):
    """The note's two-sample form, maximised: 1/2 (R(y+) - R(y-)) (log pi(y+|x) - log pi(y-|x)).
    R, logp: (2,) the two samples' sequence rewards and sequence log-probs; either order."""
    # 1/2 (R(y+) - R(y-)) (log pi_theta(y+|x) - log pi_theta(y-|x))
    return 0.5 * (R[0] - R[1]) * (logp[0] - logp[1])


def grpo_advantages(R, group, unbiased=False, eps=1e-6):
    """GRPO's group-normalised advantage: (R_i - mean_g) / (std_g + eps) over the samples of
    a prompt (std with n - 1). With `unbiased` (Dr. GRPO) only R_i - mean_g. A group whose
    rewards are all equal gives exact zeros, in any dtype. R, group: (B,) -> (B,)"""
    R = _from_group_min(R, group)                                     # same A, exact ties
    total, k = _group_sums(R, group)
    centred = R - total / k                                           # (B,)
    if unbiased:
        # A_i = R_i - mean_j R_j                                     (Dr. GRPO)
        return centred
    squares, _ = _group_sums(centred ** 2, group)
    std = (squares / (k - 1).clamp(min=1)).sqrt()
    # A_i = (R_i - mean_j R_j) / (std_j R_j + eps)                  (Shao et al.)
    return centred / (std + eps)


def reinforce_advantages(R, baseline, decay=0.9):
    """REINFORCE with a moving-average baseline: A_i = R_i - b, then
    b <- decay b + (1 - decay) mean_i R_i. `baseline` None (the first batch) starts b at
    this batch's mean. Returns (A (B,), the next baseline, a float)."""
    mean = R.mean().item()
    b = mean if baseline is None else baseline
    # A_i = R_i - b_t;   b_{t+1} = decay b_t + (1 - decay) mean_i R_i
    return R - b, decay * b + (1 - decay) * mean


def raft_weights(R, group):
    """RAFT (reward-ranked fine-tuning): 1 on the best sample of each prompt's group by R,
    0 on the others; a tie goes to the first. The supervised loss (13) on the best is then
    -(1/prompts) sum_best sum_t log pi(y_t), which the sequence-averaged loss
    -(1/B) sum_i w_i sum_t log pi reaches with w_i = k on the best (B = prompts x k).
    R, group: (B,) -> (B,) in R's dtype"""
    groups = int(group.max()) + 1
    best = torch.full((groups,), -math.inf, dtype=R.dtype, device=R.device)
    best = best.scatter_reduce(0, group, R, reduce="amax")            # (groups,) max R
    rows = torch.arange(len(R), device=R.device)
    first = torch.full((groups,), len(R), device=R.device)
    first = first.scatter_reduce(0, group, torch.where(R == best[group], rows, len(R)),
                                 reduce="amin")                        # (groups,) its row
    _, k = _group_sums(torch.ones_like(R), group)                      # (B,) group sizes
    # w_i = k 1[i = argmax_{j in group(i)} R_j]
    return torch.where(first[group] == rows, k, torch.zeros_like(R))


def sequence_advantages(estimator, R, group, baseline=None, decay=0.9, unbiased=False):
    """A_i for --estimator rloo, reinforce, grpo or raft (its weights, `raft_weights`), and
    the next REINFORCE baseline (the others pass `baseline` through).
    R, group: (B,) -> ((B,), baseline)"""
    if estimator == "raft":
        return raft_weights(R, group), baseline
    if estimator == "rloo":
        return rloo_advantages(R, group), baseline
    if estimator == "reinforce":
        return reinforce_advantages(R, baseline, decay)
    if estimator == "grpo":
        return grpo_advantages(R, group, unbiased), baseline
    raise ValueError(f"sequence_advantages: estimator must be rloo, reinforce, grpo or raft, "
                     f"got {estimator!r}")


def spread_over_tokens(adv, mask, length_normalise=False):
    """A sequence's advantage on each of its real tokens, 0 after its EOS. adv (B,) -> (B, T).

    `length_normalise` divides by the response's length |y_i|: GRPO's per-sequence average
    of its tokens' terms, folded into A (the clipped term is linear in A > 0 or A < 0 alike).
    """
    m = mask.bool()
    if length_normalise:
        adv = adv / m.sum(-1).clamp(min=1)
    return torch.where(m, adv[:, None], 0.0)


# ---------------------------------------------------------------- adaptive beta (Ziegler)

def update_beta(beta, kl, target, k_beta=0.1, clip=0.2):
    """One step of Ziegler et al.'s log-space proportional controller (Sec. 2.2).

    `kl` and `target` are in the same units: KL of a whole response from the reference in
    nats (sum of kl_per_token over real tokens, averaged over the batch).
    Their code also scales the step by batch size / horizon; this is the paper's form.
    """
    if target <= 0:
        raise ValueError(f"update_beta: target KL must be positive, got {target}")
    # u_t = (KL_t - KL_target) / KL_target;  e_t = clip(u_t, -0.2, 0.2)
    e = min(max((float(kl) - target) / target, -clip), clip)
    # beta_{t+1} = beta_t (1 + 0.1 e_t)   -> at most 2% per step
    return beta * (1 + k_beta * e)


class AdaptiveKLController:
    """Holds beta and moves it toward a target KL with `update_beta` (Ziegler et al. 2019)."""

    def __init__(self, beta, target):
        self.beta, self.target = float(beta), float(target)

    def update(self, kl):
        self.beta = update_beta(self.beta, kl, self.target)
        return self.beta


# ---------------------------------------------------------------- worked example

def _show(name, x):
    print(f"{name}")
    for row in x.tolist():
        print("   " + " ".join(f"{v:+7.3f}" for v in row))


if __name__ == "__main__":
    # Two responses, T = 5, EOS id 2. Row 0 stops at t = 2 and is padded with EOS (as
    # SmolLM2 pads); row 1 hits the length limit. Numbers are made up, small and readable.
    EOS, beta = 2, 0.1
    actions = torch.tensor([[5, 7, 2, 2, 2],
                            [4, 6, 8, 3, 9]])                            # (B, T) = (2, 5)
    logp_old = torch.tensor([[-1.0, -0.5, -0.2, -3.0, -3.0],
                             [-0.8, -1.2, -0.4, -0.9, -0.6]])           # (B, T)
    logp_ref = torch.tensor([[-1.2, -0.7, -0.2, -0.1, -0.1],
                             [-0.9, -1.0, -0.9, -1.1, -0.6]])           # (B, T)
    values = torch.tensor([[0.3, 0.5, 0.8, 9.0, 9.0],                   # 9.0: junk on padding
                           [0.1, 0.0, -0.2, -0.3, -0.4]])               # (B, T)
    rewards = torch.tensor([1.0, -0.5])                                 # (B,) scores

    mask = response_mask(actions, EOS)                                  # (B, T)
    per_token = shaped_rewards(logp_old, logp_ref, rewards, beta, mask)  # (B, T)
    deltas, _ = advantages_and_returns(per_token, values, mask, lam=0.0)  # (B, T) lambda 0
    adv, ret = advantages_and_returns(per_token, values, mask)          # (B, T)
    print(f"gamma = {GAMMA}, lambda = {LAM}, beta = {beta}, EOS id = {EOS}, "
          f"rewards = {rewards.tolist()}, last real token = {last_token_index(mask).tolist()}")
    print("actions\n   " + "\n   ".join(" ".join(f"{a:7d}" for a in row)
                                        for row in actions.tolist()))
    _show("mask (1 up to and including the first EOS)", mask)
    _show("k1 KL  log pi_old - log pi_ref   (4)", kl_per_token(logp_old, logp_ref))
    _show("r_t  -beta KL + score at the last real token   (3)", per_token)
    _show("V(s_t) as the value head gave it (junk on padding)", values)
    _show("delta_t   (5)", deltas)
    _show("A_t   (6)", adv)
    _show("R_t = A_t + V(s_t)   (7)", ret)
    _show("whitened A_t (real tokens only)", whiten(adv, mask))
