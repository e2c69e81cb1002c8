"""Tests for gae.py: what the post and the papers claim about the shaped reward and GAE.

Run:  python -m pytest -q tests/test_gae.py

The only arithmetic written out here is the independent oracles the claims are about:
eq. (6) as a direct double sum, the telescoped return at gamma = lambda = 1, delta_t at
lambda = 0, and the exact KL of a small categorical. Everything else is imported.
"""
import math

import pytest
import torch

import gae
import ppo_kernels

from gae import (GAMMA, LAM, AdaptiveKLController, advantages_and_returns,
                 kl_per_token, last_token_index, masked_mean, response_mask,
                 shaped_rewards, update_beta, whiten)

EOS = 2


def ragged_batch(seed, B=6, T=9):
    """Random float64 rewards and values with a ragged response mask.

    Row 0 ends at its first token, row 1 never ends (hits the length limit), the rest end
    at random places and are padded with EOS. Padded positions hold large junk, so any leak
    of padding into real tokens shows up as a big error.
    """
    g = torch.Generator().manual_seed(seed)
    actions = torch.randint(3, 50, (B, T), generator=g)                 # (B, T) no EOS yet
    ends = torch.randint(0, T, (B,), generator=g)                        # (B,) EOS position
    ends[0], ends[1] = 0, T                                              # one token; no EOS
    for b, e in enumerate(ends.tolist()):
        actions[b, e:] = EOS                                             # EOS, then EOS padding
    mask = response_mask(actions, EOS)                                   # (B, T)
    junk = 1e3 * (1 - mask.double())                                     # (B, T) 0 on real tokens
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) + junk
    values = torch.randn(B, T, generator=g, dtype=torch.float64) - junk
    return rewards, values, mask, ends


# ---------------------------------------------------------------- masks

def test_response_mask_keeps_first_eos_and_drops_eos_padding():
    actions = torch.tensor([[5, EOS, EOS, EOS],     # ends at t=1, padded with the EOS id
                            [5, 6, 7, 8],           # hits the length limit
                            [EOS, 6, EOS, 9]])      # ends at t=0; later tokens are junk
    mask = response_mask(actions, EOS)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert last_token_index(mask).tolist() == [1, 3, 0]


# ---------------------------------------------------------------- eq. (3)-(4)

def test_shaped_rewards_score_lands_on_eos_and_nothing_after():
    logp_old = torch.tensor([[-1.0, -2.0, -0.5, -4.0]] * 2, dtype=torch.float64)
    logp_ref = torch.tensor([[-1.5, -1.0, -0.5, -9.0]] * 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    score = torch.tensor([3.0, -1.0], dtype=torch.float64)
    r = shaped_rewards(logp_old, logp_ref, score, 0.1, mask)
    # row 0: -0.1 * k1 at t=0,1, score on its EOS (t=1), nothing on the padding
    assert r[0].tolist() == pytest.approx([-0.05, 0.1 + 3.0, 0.0, 0.0])
    # row 1 hit the limit: the post's listing (score on column -1) is the same thing there
    assert r[1].tolist() == pytest.approx([-0.05, 0.1, 0.0, -0.5 - 1.0])


def test_shaped_rewards_uses_a_precomputed_k3():
    logp_old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    logp_ref = torch.tensor([[-1.1, -2.0]], dtype=torch.float64)
    kl = kl_per_token(logp_old, logp_ref, "k3")
    r = shaped_rewards(logp_old, logp_ref, torch.zeros(1, dtype=torch.float64), 1.0,
                       torch.ones(1, 2), kl=kl)
    # k3 at log r = -0.1: e^-0.1 - 1 + 0.1 = 0.0048374...
    assert r[0, 0].item() == pytest.approx(-(math.exp(-0.1) - 0.9), abs=1e-12)
    assert r[0, 1].item() == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_average_to_the_exact_kl(estimator):
    # Sampling a ~ pi_theta, E[k] = KL(pi_theta || pi_ref) for both estimators. Take the
    # expectation exactly over a 5-token vocabulary instead of sampling.
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1], dtype=torch.float64)
    exact = (p * (p / q).log()).sum()
    k = kl_per_token(p.log(), q.log(), estimator)                        # (5,) one per token
    assert (p * k).sum().item() == pytest.approx(exact.item(), rel=1e-12)
    if estimator == "k3":
        assert (k >= 0).all()                     # k3 is never negative; k1 is here (token 1)
    else:
        assert (k < 0).any()


# ---------------------------------------------------------------- eq. (5)-(7)

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_telescopes_at_lambda_1_gamma_1(seed):
    # At gamma = lambda = 1 the V terms cancel: A_t = sum_{t' >= t} r_t' - V(s_t).
    rewards, values, mask, _ = ragged_batch(seed)
    adv, ret = advantages_and_returns(rewards, values, mask, gamma=1.0, lam=1.0)
    m = mask.bool()
    r = torch.where(m, rewards, 0.0)
    reward_to_go = r.flip(1).cumsum(1).flip(1)                           # (B, T) sum_{t'>=t} r_t'
    torch.testing.assert_close(adv[m], (reward_to_go - values)[m], rtol=0, atol=1e-12)
    torch.testing.assert_close(ret[m], reward_to_go[m], rtol=0, atol=1e-12)   # eq. (7)


@pytest.mark.parametrize("seed", [0, 1])
def test_gae_at_lambda_0_is_the_td_error(seed):
    rewards, values, mask, _ = ragged_batch(seed)
    adv, _ = advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.0)
    m = mask.bool()
    v = torch.where(m, values, 0.0)                                      # V is 0 past the end
    v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
    delta = rewards + 0.9 * v_next - values                              # (5)
    torch.testing.assert_close(adv[m], delta[m], rtol=0, atol=1e-12)


@pytest.mark.parametrize("gamma,lam", [(GAMMA, LAM), (0.8, 0.5), (1.0, 0.95)])
def test_backward_recursion_equals_eq6_double_sum(gamma, lam):
    rewards, values, mask, ends = ragged_batch(3, B=5, T=7)
    adv, ret = advantages_and_returns(rewards, values, mask, gamma=gamma, lam=lam)
    B, T = rewards.shape
    for b in range(B):
        n = int(mask[b].sum())                                           # this row's T
        assert n == min(int(ends[b]) + 1, T)
        V = lambda t: values[b, t].item() if t < n else 0.0              # noqa: E731
        delta = [rewards[b, t].item() + gamma * V(t + 1) - V(t) for t in range(n)]
        for t in range(n):
            # (6)  A_t = sum_{l=0}^{T-t-1} (gamma lam)^l delta_{t+l}
            expect = sum((gamma * lam) ** l * delta[t + l] for l in range(n - t))
            assert adv[b, t].item() == pytest.approx(expect, abs=1e-12)
            assert ret[b, t].item() == pytest.approx(expect + V(t), abs=1e-12)
        assert adv[b, n:].abs().sum() == 0 and ret[b, n:].abs().sum() == 0   # padded: exactly 0


def test_appending_padding_changes_no_advantage():
    rewards, values, mask, _ = ragged_batch(4)
    adv, ret = advantages_and_returns(rewards, values, mask)
    B, T = rewards.shape
    pad = 4
    rewards2 = torch.cat([rewards, torch.full((B, pad), 7.0, dtype=torch.float64)], 1)
    values2 = torch.cat([values, torch.full((B, pad), -7.0, dtype=torch.float64)], 1)
    mask2 = torch.cat([mask, torch.zeros(B, pad)], 1)
    adv2, ret2 = advantages_and_returns(rewards2, values2, mask2)
    assert torch.equal(adv2[:, :T], adv) and torch.equal(ret2[:, :T], ret)  # bit for bit
    assert adv2[:, T:].abs().sum() == 0 and ret2[:, T:].abs().sum() == 0


# ---------------------------------------------------------------- whitening

def test_whiten_mean_0_std_1_over_real_tokens_only():
    rewards, values, mask, _ = ragged_batch(5)
    adv, _ = advantages_and_returns(rewards, values, mask)
    adv = adv + 3.0 * mask                       # a mean far from 0 so centring is tested
    adv[~mask.bool()] = float("nan")             # junk (even NaN) on padding must not leak
    w = whiten(adv, mask)
    m = mask.bool()
    assert w[m].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert w[m].std().item() == pytest.approx(1.0, abs=1e-5)     # unbiased, as the post's .std()
    assert (w[~m] == 0).all()
    # shift_mean=False only scales: the real-token mean is kept
    raw_mean = adv[m].mean().item()
    w2 = whiten(adv, mask, shift_mean=False)
    assert w2[m].mean().item() == pytest.approx(raw_mean, abs=1e-9)
    assert w2[m].std().item() == pytest.approx(1.0, abs=1e-5)
    assert (w2[~m] == 0).all()


def test_masked_mean_counts_real_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(7.0 / 3)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 4.0])


# ---------------------------------------------------------------- edge cases: one token, no token

def test_one_token_batch_is_finite_and_exact():
    logp_old = torch.tensor([[-0.3]], dtype=torch.float64)
    logp_ref = torch.tensor([[-0.5]], dtype=torch.float64)
    mask = response_mask(torch.tensor([[EOS]]), EOS)                     # (1, 1) the EOS itself
    r = shaped_rewards(logp_old, logp_ref, torch.tensor([2.0], dtype=torch.float64), 0.5, mask)
    assert r.item() == pytest.approx(2.0 - 0.5 * 0.2)
    adv, ret = advantages_and_returns(r, torch.tensor([[0.4]], dtype=torch.float64), mask)
    assert adv.item() == pytest.approx(1.9 - 0.4)                        # r_0 - V(s_0): V(s_1) = 0
    assert ret.item() == pytest.approx(1.9)
    w = whiten(adv, mask)                                                # one real token: var := 0
    assert torch.isfinite(w).all() and w.item() == 0.0


def test_single_real_token_among_padding_whitens_to_zero():
    x = torch.tensor([[5.0, 9.0, 9.0]])
    w = whiten(x, torch.tensor([[1, 0, 0]]))
    assert w.tolist() == [[0.0, 0.0, 0.0]]


def test_all_zero_mask_gives_zeros_or_a_clear_error_never_nan():
    x = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.zeros(3, 4)
    adv, ret = advantages_and_returns(x, x, mask)                        # nothing to estimate: 0
    assert (adv == 0).all() and (ret == 0).all()
    with pytest.raises(ValueError, match="no position"):
        whiten(x, mask)
    with pytest.raises(ValueError, match="no position"):
        masked_mean(x, mask)
    with pytest.raises(ValueError, match="no real token"):
        last_token_index(mask)
    with pytest.raises(ValueError, match="no real token"):
        shaped_rewards(x, x, torch.zeros(3, dtype=torch.float64), 0.1, mask)


# ---------------------------------------------------------------- adaptive beta (Ziegler et al.)

def test_adaptive_kl_moves_beta_the_right_way_by_at_most_2_percent():
    target = 6.0
    for kl in [0.0, 1.0, 5.9, 6.1, 7.0, 12.0, 1e6]:
        new = update_beta(0.1, kl, target)
        assert (new > 0.1) == (kl > target) and (new < 0.1) == (kl < target)
        assert abs(new / 0.1 - 1) <= 0.02 + 1e-15
    assert update_beta(0.1, 12.0, target) == pytest.approx(0.102)        # u = 1 -> clipped to 0.2
    assert update_beta(0.1, 5.4, target) == pytest.approx(0.099)         # u = -0.1, e = -0.1
    assert update_beta(0.1, target, target) == 0.1                       # on target: unchanged
    with pytest.raises(ValueError):
        update_beta(0.1, 1.0, 0.0)


def test_adaptive_kl_controller_compounds_steps():
    ctl = AdaptiveKLController(beta=0.05, target=6.0)
    for _ in range(10):
        ctl.update(100.0)                                                # far above: +2% each
    assert ctl.beta == pytest.approx(0.05 * 1.02 ** 10)
    assert ctl.update(0.0) == pytest.approx(0.05 * 1.02 ** 10 * 0.98)    # far below: -2%


# ------------------------------------------- the response as one action (--estimator)

def groups_of(k, prompts):
    return torch.arange(prompts).repeat_interleave(k)                  # (prompts * k,)


def test_rloo_advantages_sum_to_zero_per_prompt_and_ignore_a_constant():
    R = torch.tensor([1.0, 4.0, -2.0, 0.5, 3.0, 3.0, 7.0, -1.0], dtype=torch.float64)
    group = groups_of(4, 2)
    adv = gae.rloo_advantages(R, group)
    assert adv[:4].sum().item() == pytest.approx(0, abs=1e-12)
    assert adv[4:].sum().item() == pytest.approx(0, abs=1e-12)
    # by hand: 1 - (4 - 2 + 0.5) / 3 = 1/6
    assert adv[0].item() == pytest.approx(1 / 6)
    assert torch.allclose(gae.rloo_advantages(R + 10, group), adv)
    with pytest.raises(ValueError):
        gae.rloo_advantages(R, groups_of(1, 8))


def test_rloo_follows_its_rows_in_any_order():
    """Micro-batching sorts rows by padding: a sample's advantage must follow its prompt id,
    not its position."""
    R = torch.randn(12, generator=torch.Generator().manual_seed(0))
    group = groups_of(3, 4)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(gae.rloo_advantages(R[perm], group[perm]),
                          gae.rloo_advantages(R, group)[perm])
    assert torch.allclose(gae.grpo_advantages(R[perm], group[perm]),
                          gae.grpo_advantages(R, group)[perm])


def test_rloo_with_two_samples_is_the_notes_contrastive_form():
    """k = 2: A = +-(R(y+) - R(y-)); the REINFORCE surrogate averaged over the pair,
    1/2 sum_i A_i log pi(y_i), is the note's 1/2 (R+ - R-)(log pi(y+) - log pi(y-)); and the
    clipped loss of eq. (8)-(10) at r = 1 has minus its gradient."""
    R = torch.tensor([2.5, -0.5], dtype=torch.float64)
    adv = gae.rloo_advantages(R, groups_of(2, 1))
    assert adv.tolist() == [3.0, -3.0]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.2, -1.0, -2.0]],
                        dtype=torch.float64, requires_grad=True)
    seq_logp = (logp * mask).sum(-1)                                   # log pi(y_i | x)
    objective = gae.rloo_pair_objective(R, seq_logp)
    assert objective.item() == pytest.approx(0.5 * (adv * seq_logp).sum().item())
    assert objective.item() == pytest.approx(0.5 * 3.0 * (seq_logp[0] - seq_logp[1]).item())
    expected = torch.autograd.grad(-objective, logp)[0]                # (2, T)
    loss, _ = ppo_kernels.masked_clipped_loss(logp.float(), logp.detach().float(),
                                          gae.spread_over_tokens(adv, mask).float(),
                                          mask.float(), 0.2)
    got = torch.autograd.grad(loss, logp)[0]                           # ratio exactly 1
    assert torch.allclose(got.double(), expected, atol=1e-6)


def test_grpo_advantages_are_standardised_per_group_and_zero_for_a_tie():
    R = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0], dtype=torch.float64)
    adv = gae.grpo_advantages(R, groups_of(4, 2))
    assert adv[:4].mean().item() == pytest.approx(0, abs=1e-12)
    assert adv[:4].std().item() == pytest.approx(1, abs=1e-5)          # std with n - 1
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]                    # not NaN
    unbiased = gae.grpo_advantages(R, groups_of(4, 2), unbiased=True)  # Dr. GRPO: centred only
    assert unbiased.tolist() == [-2.0, -1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]


# The three group estimators, each as a function of (R, group).
GROUP_ESTIMATORS = {"rloo": gae.rloo_advantages, "grpo": gae.grpo_advantages,
                    "dr_grpo": lambda R, group: gae.grpo_advantages(R, group, unbiased=True)}


def float64_oracle(name, R, group):
    """Each estimator written out per group in float64, on the float32 inputs' exact values."""
    R = R.double()
    out = torch.empty_like(R)
    for g in group.unique():
        rows = (group == g).nonzero().flatten()
        r, k = R[rows], len(rows)
        if name == "rloo":
            out[rows] = r - (r.sum() - r) / (k - 1)
        elif name == "dr_grpo":
            out[rows] = r - r.mean()
        else:
            out[rows] = (r - r.mean()) / (r.std() + 1e-6)
    return out


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_a_tied_group_gives_exact_zeros_in_float32(name, k):
    """Issue 23: k equal float32 rewards can sum to k R +- 1 ulp, so a mean taken from the sum
    sits beside every one of them, and GRPO's division by a std of the same size turned that
    ulp into an advantage of 0.2-0.9. A tie must give exact zeros at any magnitude, in any
    row order, beside groups that are not tied."""
    gen = torch.Generator().manual_seed(k)
    for magnitude in (1e-3, 1e-2, 0.1, 0.7, 1.0, 3.3, 10.0, 123.4, 1e3):
        for trial in range(20):
            tied = (torch.rand(5, generator=gen) * 2 - 1) * magnitude        # 5 tied groups
            R = torch.cat([tied.repeat_interleave(k),
                           torch.randn(k, generator=gen) * magnitude])      # and one not
            R = R.float()                                                  # (6k,)
            group = groups_of(k, 6)
            perm = torch.randperm(6 * k, generator=gen)
            adv = GROUP_ESTIMATORS[name](R[perm], group[perm])
            assert adv.dtype == torch.float32
            tie = group[perm] < 5
            assert (adv[tie] == 0).all(), (magnitude, trial, adv[tie])
            assert torch.allclose(adv.double(), float64_oracle(name, R[perm], group[perm]),
                                  rtol=1e-4, atol=1e-5 * magnitude)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_a_near_tie_keeps_its_float64_advantages(name):
    """A group one or two ulp apart is not a tie: its float32 advantages match the float64
    formula on the same inputs (no jump between a tie and a near tie but the formula's own)."""
    for value in (1e-3, 0.37, 1.0, 999.0):
        x = torch.tensor(value, dtype=torch.float32)
        up = torch.nextafter(x, torch.tensor(float("inf")))
        R = torch.stack([x, x, up, torch.nextafter(up, torch.tensor(float("inf"))), x, x, x, up])
        group = groups_of(4, 2)
        adv = GROUP_ESTIMATORS[name](R, group)
        assert torch.allclose(adv.double(), float64_oracle(name, R, group), rtol=1e-4,
                              atol=1e-12)


def test_grpo_tie_from_the_issue_all_samples_miss_the_eos():
    """The issue's trigger: 8 samples of a prompt all miss the EOS at beta = 0, so all score
    the missing-EOS penalty -0.7; before the fix every sample got A = -0.056."""
    R = torch.full((8,), -0.7, dtype=torch.float32)
    assert gae.grpo_advantages(R, groups_of(8, 1)).tolist() == [0.0] * 8


def test_reinforce_baseline_follows_its_moving_average():
    batches = [torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0]), torch.tensor([4.0, 6.0])]
    # b starts at batch 1's mean, 2; then 0.9 * 2 + 0.1 * 2 = 2; then 0.9 * 2 + 0.1 * 0 = 1.8
    b, expected_b = None, [2.0, 2.0, 1.8]
    for R, want in zip(batches, expected_b):
        adv, b_next = gae.reinforce_advantages(R, b, decay=0.9)
        assert torch.allclose(adv, R - want)
        b = b_next
    assert b == pytest.approx(0.9 * 1.8 + 0.1 * 5.0)


def test_sequence_rewards_and_spread_over_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.5, 1.5, 99.0], [0.1, 0.2, 0.3]])              # 99 on padding: ignored
    R = gae.sequence_rewards(torch.tensor([1.0, 2.0]), kl, mask, beta=0.1)
    assert R.tolist() == pytest.approx([1.0 - 0.2, 2.0 - 0.06])
    spread = gae.spread_over_tokens(torch.tensor([2.0, -3.0]), mask)
    assert spread.tolist() == [[2.0, 2.0, 0.0], [-3.0, -3.0, -3.0]]
    by_length = gae.spread_over_tokens(torch.tensor([2.0, -3.0]), mask, length_normalise=True)
    assert by_length.tolist() == [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]
