"""The pieces the readings' claims need (docs/claims.md): RAFT, reward noise, no clipping,
vanilla policy gradient, the sign flip, and the ratio after the last inner step."""
import math
from pathlib import Path

import pytest
import torch

import ppo
import ppo_kernels
import reward_model as rm
from gae import noisy_scores, raft_weights, sequence_advantages
from support import cli, report
from test_ppo import tiny_pool

DOCS = Path(__file__).parents[1] / "docs"
RUNS, PAGE = DOCS / "runs" / "claims", DOCS / "claims.md"     # the kept files and their page


# ---------------------------------------------------------------------------------- RAFT

def test_raft_weights_pick_the_best_of_each_group_by_hand():
    # three prompts, k = 2, in any row order; the second group is a tie: its first row wins
    R = torch.tensor([0.5, -1.0, 2.0, 2.0, 3.0, 7.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    assert raft_weights(R, group).tolist() == [2.0, 0.0, 2.0, 0.0, 0.0, 2.0]
    shuffled = torch.tensor([2, 0, 1, 2, 0, 1])
    R = torch.tensor([3.0, -1.0, 1.0, 7.0, 0.5, 4.0])
    assert raft_weights(R, shuffled).tolist() == [0.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    weights, baseline = sequence_advantages("raft", torch.tensor([1.0, 2.0, 0.0, 5.0]),
                                            torch.tensor([0, 0, 0, 0]), baseline=None)
    assert weights.tolist() == [0.0, 0.0, 0.0, 4.0] and baseline is None


def test_raft_loss_is_the_supervised_loss_on_the_best():
    """(13) on each prompt's best sample, -(1/prompts) sum_best sum_t log pi, whatever the
    other samples' log-probs; the same after a step (no ratio)."""
    torch.manual_seed(0)
    logp = torch.randn(4, 3, requires_grad=True)         # 2 prompts x k = 2, 3 tokens
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    weights = raft_weights(torch.tensor([0.1, 0.9, 0.8, -2.0]), torch.tensor([0, 0, 1, 1]))
    adv = torch.where(mask.bool(), weights[:, None], 0.0)
    logp_old = logp.detach() - 0.3                        # a later inner step: r != 1
    loss, stats = ppo_kernels.masked_log_prob_loss(logp, logp_old, adv, mask)
    by_hand = -(logp[1].sum() + logp[2, 0]) / 2          # rows 1 and 2 are the best
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    loss.backward()
    expected = torch.zeros(4, 3)
    expected[1] = -0.5
    expected[2, 0] = -0.5
    assert torch.allclose(logp.grad, expected)
    assert stats["clipfrac"].item() == 1.0               # every ratio is e^0.3 = 1.35 > 1.2


# ---------------------------------------------------------------------- clipping and PG

def clipped_and_unclipped(ratio):
    logp_old = torch.zeros(2, 3)
    logp = torch.log(torch.full((2, 3), ratio)).requires_grad_()
    adv = torch.tensor([[1.0, -2.0, 0.5], [2.0, 1.0, -1.0]])
    mask = torch.ones(2, 3)
    out = []
    for clip in (0.2, math.inf):
        x = logp.detach().clone().requires_grad_()
        loss, stats = ppo_kernels.masked_clipped_loss(x, logp_old, adv, mask, clip)
        loss.backward()
        out.append((loss.item(), x.grad.clone(), stats["clipfrac"].item()))
    return out


def test_no_clipping_equals_the_clipped_loss_where_nothing_is_clipped():
    (a, ga, fa), (b, gb, fb) = clipped_and_unclipped(1.1)      # inside 0.8 .. 1.2
    assert a == b and torch.equal(ga, gb) and fa == fb == 0.0
    (a, ga, fa), (b, gb, fb) = clipped_and_unclipped(1.5)      # outside: they part
    # no clipping: L = -(1/B) sum r A = -(1.5 (1 - 2 + 0.5) + 1.5 (2 + 1 - 1)) / 2
    assert b == pytest.approx(-(1.5 * -0.5 + 1.5 * 2.0) / 2)
    assert fa == 1.0 and fb == 0.0 and not torch.equal(ga, gb)


def test_vanilla_policy_gradient_is_the_ratio_loss_at_its_one_step():
    """At r = 1 (one inner step) the gradient of -r A with no clip is that of -A log pi."""
    torch.manual_seed(1)
    logp = torch.randn(3, 4)
    adv, mask = torch.randn(3, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    grads = []
    for loss_of in (lambda x: ppo_kernels.masked_clipped_loss(x, logp, adv, mask, math.inf),
                    lambda x: ppo_kernels.masked_log_prob_loss(x, logp, adv, mask)):
        x = logp.clone().requires_grad_()
        loss_of(x)[0].backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_clip_off_parses_and_is_refused_with_a_value_clip(capsys):
    assert ppo.parse_args(["--preset", "tiny", "--clip", "off"]).clip == math.inf
    assert ppo.parse_args(["--preset", "tiny", "--clip", "0.3"]).clip == 0.3
    assert cli.Range(0, 1, low_open=True, high_open=True, off=True).describe("clip") == \
        "0 < clip < 1 or off"
    for argv, flag in ((["--clip", "off", "--value-clip", "0.2"], "--value-clip"),
                       (["--clip", "nan"], "--clip"), (["--clip", "1.5"], "--clip"),
                       (["--estimator", "raft"], "--samples-per-prompt"),
                       (["--reward-noise", "-1"], "--reward-noise")):
        with pytest.raises(SystemExit) as stop:
            ppo.parse_args(["--preset", "tiny", *argv])
        assert stop.value.code == 2 and flag in capsys.readouterr().err


# -------------------------------------------------------------------------- reward noise

def test_noise_has_its_own_generator_and_sd_zero_is_the_identity():
    rewards = torch.tensor([0.5, -1.0, 2.0, 0.0])
    assert noisy_scores(rewards, 0.0, seed=3, iteration=7) is rewards
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = noisy_scores(rewards, 2.0, seed=3, iteration=7)
    assert torch.equal(torch.get_rng_state(), before)            # sampling's RNG untouched
    assert torch.equal(a, noisy_scores(rewards, 2.0, seed=3, iteration=7))   # resume: same
    assert not torch.equal(a, noisy_scores(rewards, 2.0, seed=3, iteration=8))
    assert not torch.equal(a, noisy_scores(rewards, 2.0, seed=4, iteration=7))
    assert not torch.equal(a, noisy_scores(rewards, 2.0, seed=3, iteration=7, stream=1))
    many = noisy_scores(torch.zeros(20_000), 3.0, seed=0, iteration=0)
    assert many.mean().abs().item() < 0.1 and many.std().item() == pytest.approx(3.0, rel=0.03)


def train_tiny(argv, tiny_judge, tiny, tokenizer, folder, iterations=2, noise_sd=0.0):
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", str(iterations), "--batch", "2",
                          "--checkpoint-every", "1", "--out", str(folder), *argv])
    reward = rm.load_reward_model(tiny_judge)
    models = (tiny, reward, tokenizer, torch.device("cpu"))
    return ppo.train(cfg, 0.1, 0, models, tiny_pool(tokenizer), folder, progress=False,
                     noise_sd=noise_sd)


def test_order_kept_by_hand_and_by_sampling():
    """SD 0 keeps every order; SD 1: rho = 1/sqrt 2, asin = pi/4, so 3/4; against a draw."""
    from tools.analysis.claims_sections import order_kept
    assert order_kept(0) == 1.0 and order_kept(1) == pytest.approx(0.75)
    g = torch.Generator().manual_seed(0)
    r, e = torch.randn(2, 200_000, generator=g), 3 * torch.randn(2, 200_000, generator=g)
    kept = ((r[0] - r[1]).sign() == (r[0] + e[0] - r[1] - e[1]).sign()).double().mean()
    assert float(kept) == pytest.approx(order_kept(3), abs=0.005)       # 0.602


def test_noise_of_sd_zero_is_the_plain_run_and_noise_resumes_the_same(tiny_judge, data_dir,
                                                                       tiny, tokenizer,
                                                                       tmp_path):
    folders = [tmp_path / name for name in ("plain", "zero", "noisy", "resumed")]
    for folder in folders:
        folder.mkdir()
    _, _, plain = train_tiny([], tiny_judge, tiny, tokenizer, folders[0])
    _, _, zero = train_tiny(["--reward-noise", "0"], tiny_judge, tiny, tokenizer, folders[1])
    assert report.differences(plain["iterations"], zero["iterations"], rel=0) == []
    _, _, noisy = train_tiny(["--reward-noise", "2"], tiny_judge, tiny, tokenizer, folders[2],
                             iterations=3, noise_sd=2.0)
    train_tiny(["--reward-noise", "2"], tiny_judge, tiny, tokenizer, folders[3],
               iterations=1, noise_sd=2.0)
    _, _, resumed = train_tiny(["--reward-noise", "2", "--resume"], tiny_judge, tiny,
                               tokenizer, folders[3], iterations=3, noise_sd=2.0)
    assert report.differences(noisy["iterations"], resumed["iterations"]) == []
    # the judge's own score is what the row reports; the run learned from the noisy one
    assert noisy["iterations"][0]["reward"] == plain["iterations"][0]["reward"]
    assert noisy["iterations"][0]["policy_loss"] != plain["iterations"][0]["policy_loss"]


# ------------------------------------------------- the new settings, end to end (tiny)

@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["--estimator", "raft", "--samples-per-prompt", "2"],
    ["--clip", "off"],
    ["--clip", "off", "--inner-steps", "1", "--lam", "1"],
    ["--flip-sign"],
])
def test_each_new_setting_trains_and_records_the_ratio_after(argv, tiny_judge, data_dir, tiny,
                                                             tokenizer, tmp_path):
    _, value_head, results = train_tiny(argv, tiny_judge, tiny, tokenizer, tmp_path)
    assert (value_head is None) == ("raft" in argv)
    for row in results["iterations"]:
        assert row["ratio_min"] == row["ratio_max"] == 1.0
        assert row["ratio_after_min"] <= 1.0 + 1e-6 or row["ratio_after_max"] >= 1.0 - 1e-6
        assert 0 < row["ratio_after_min"] <= row["ratio_after_max"]
        if "off" in argv:
            assert row["clipfrac"] == 0.0


def test_flip_sign_negates_the_score_and_the_kl_term():
    cfg = ppo.parse_args(["--preset", "tiny", "--flip-sign"])
    rewards = torch.tensor([1.0, -2.0])
    seen, beta = ppo.learned_from(rewards, 0.1, cfg, 0.0, 0, 0)
    assert seen.tolist() == [-1.0, 2.0] and beta == -0.1
    plain = ppo.parse_args(["--preset", "tiny"])
    seen, beta = ppo.learned_from(rewards, 0.1, plain, 0.0, 0, 0)
    assert seen is rewards and beta == 0.1


# ------------------------------------------------------- kept summaries and the page

def fake_run(seed, rewards, config=None, ranks=None, **per_post):
    """A kept summary as support/kept.summarize_run writes it, on len(rewards) posts;
    per_post: more of each sample's fields, a list each (copied_bigrams=[...], ...)."""
    n = len(rewards)
    samples = [{"post": i, "reward": r, "ref_reward": 0.0, "length": 10, "eos": True, "words": 8,
                "retrieval_rank": (ranks or [1] * n)[i], "rouge_l": 0.2, "kl": 1.0,
                "copied_bigrams": 0.1, "question": False, **{key: values[i] for key, values in per_post.items()}}
               for i, r in enumerate(rewards)]
    ref = [{"post": i, "reward": 0.0, "length": 10, "words": 9, "retrieval_rank": 2,
            "rouge_l": 0.1} for i in range(n)]
    final = {"reward": sum(rewards) / n, "eos_fraction": 1.0, "copied_bigrams": 0.1,
             "fluency": -50.0,
             "kl": 1.0, "samples": samples, "ref_samples": ref,
             "human_samples": [{"post": i, "length": 10} for i in range(n)],
             "ref": {"reward": 0.0, "retrieval_mrr": 0.5, "rouge_l": 0.1, "eos_fraction": 0.8,
                     "copied_bigrams": 0.13}}
    rows = [{"iteration": i, "reward": 0.1 * i, "clipfrac": 0.01, "kl": 1.0, "beta": 0.1,
             "ratio_after_min": 0.9, "ratio_after_max": 1.1} for i in range(3)]
    return {"config": {"estimator": "gae", "beta": 0.1, "seed": seed, "batch": 8,
                       **(config or {})}, "iterations": rows, "final": final,
            "machine": "a test CPU"}


def seeds(n, make):
    """{seed: make(seed)} for seeds 0..n-1."""
    return {s: make(s) for s in range(n)}


def test_a_comparison_is_the_one_rule_on_the_seeds_both_have():
    from support.intervals import paired_interval
    from tools.analysis.claims_runs import compare, pm
    base = seeds(2, lambda s: fake_run(s, [0.0, 1.0, 0.0, 1.0]))
    runs = {**seeds(2, lambda s: fake_run(s, [1.0 + s, 1.0, 2.0, 2.0 + s])),
            5: fake_run(5, [9.0] * 4)}                                  # seed 5 has no pair
    iv = compare(runs, base, "reward")
    by_hand = paired_interval({0: [1, 0, 2, 1], 1: [2, 0, 2, 2]}, {0: [0] * 4, 1: [0] * 4})
    assert iv == by_hand and iv.seeds == 2
    assert pm(iv) == f"{by_hand.gain:+.2f} ± {by_hand.high - by_hand.gain:.2f}"
    # the objective: the judge's reward minus 0.1 times each summary's own KL to SFT
    far = seeds(2, lambda s: fake_run(s, [1.0 + s, 1.0, 2.0, 2.0 + s], kl=[11.0] * 4))
    assert compare(far, base, "objective").gain == pytest.approx(iv.gain - 1.0)


def test_one_seed_takes_the_seed_variance_pooled_from_the_multi_seed_comparisons():
    from support.intervals import seed_variance, table
    from tools.analysis.claims_runs import by_seed, compare, pools
    noise = [[0.3, -0.2, 0.1, 0.0], [-0.4, 0.5, 0.0, 0.2], [0.1, 0.1, -0.3, 0.4]]
    base = seeds(3, lambda s: fake_run(s, [0.0] * 4))
    multi = seeds(3, lambda s: fake_run(s, [s * 0.5 + x for x in noise[s]]))
    one = {0: fake_run(0, [1.0, 1.2, 0.8, 1.1])}
    runs = {"": base, "--gamma 1": multi, "--beta 0.5": one}
    pooled = pools(runs)
    assert pooled["reward"] == seed_variance([table(by_seed(multi, "reward"),
                                                    by_seed(base, "reward"))])
    alone, counted = compare(one, base, "reward"), compare(one, base, "reward", pooled)
    assert not alone.seeds_counted and counted.seeds_counted
    assert counted.se ** 2 == pytest.approx(alone.se ** 2 + pooled["reward"].s2)


def beta0_pair(copied, question):
    """β = 0 and --ptx-coef 1 on three seeds: the second moves copied bigrams and questions
    by `copied` and `question` on every post, give or take a little."""
    jitter = [0.01, -0.01, 0.02, -0.02]
    plain = seeds(3, lambda s: fake_run(s, [2.0] * 4, {"beta": 0.0}, copied_bigrams=[0.5] * 4,
                                        question=[0.5] * 4))
    ptx = seeds(3, lambda s: fake_run(s, [2.0] * 4, {"beta": 0.0, "ptx_coef": 1.0},
                                      copied_bigrams=[0.5 + copied + j * (s + 1) for j in jitter],
                                      question=[0.5 + question + j * (2 - s) for j in jitter]))
    return {"": seeds(3, lambda s: fake_run(s, [0.0] * 4)), "--beta 0": plain,
            "--beta 0 --ptx-coef 1": ptx}


def test_a_directional_claim_names_every_measure_that_moved_either_way():
    from tools.analysis.claims_page import claims
    rows, _ = claims(beta0_pair(-0.3, +0.25), {})
    row = next(r for r in rows if "supervised loss (13)" in r[2])
    # copied bigrams fell (as claimed), questions rose (against it): the claim does not hold
    assert row[5].startswith("does not hold: copied bigrams holds; questions does not hold")
    assert "moved past its interval: copied bigrams down, questions up" in row[5]
    assert row[6] == "—"                                      # resolved: no seeds to add
    rows, _ = claims(beta0_pair(-0.3, -0.25), {})
    row = next(r for r in rows if "supervised loss (13)" in r[2])
    assert row[5].startswith("holds; moved past its interval: copied bigrams down, "
                             "questions down")


def test_the_seeds_column_says_how_many_would_resolve_or_none():
    from support.intervals import Interval
    from tools.analysis.claims_runs import decide
    from tools.analysis.claims_runs import Part, Reading

    def iv(gain, s2_seed):
        return Interval(gain, 0.1, 2.0, gain - 0.3, gain + 0.3, 3, 64, True, s2_seed, 0.0, 0.5)
    said, needed = decide(Reading("", [Part("judge", iv(0.1, 0.01), +1)]))
    assert said == "not resolved" and needed.isdigit() and int(needed) > 3
    said, needed = decide(Reading("", [Part("judge", iv(0.0, 0.01), +1)]))
    assert needed == "> 100"                                  # no gain: no seeds resolve it
    assert decide(Reading("", [Part("judge", iv(0.5, 0.01), +1)])) == ("holds", "—")
    assert decide(Reading("", [], verdict="holds")) == ("holds", "n/a")


def test_estimators_are_judged_on_reward_minus_beta_kl():
    from tools.analysis.claims_page import claims
    rloo = {"estimator": "rloo", "batch": 2, "samples_per_prompt": 4}
    raft = {"estimator": "raft", "batch": 2, "samples_per_prompt": 4}
    j = [0.05, -0.05, 0.1, -0.1]
    runs = {"": seeds(3, lambda s: fake_run(s, [0.0] * 4)),
            "--estimator rloo --batch 2 --samples-per-prompt 4": seeds(3, lambda s: fake_run(
                s, [0.0 + x * s for x in j], rloo, kl=[3.0] * 4)),
            # RAFT: the judge higher by 0.2, at 17 nats: the objective lower by 1.2
            "--estimator raft --batch 2 --samples-per-prompt 4": seeds(3, lambda s: fake_run(
                s, [0.2 + x * (2 - s) for x in j], raft, kl=[17.0] * 4, copied_bigrams=[0.9] * 4))}
    rows, _ = claims(runs, {})
    row = next(r for r in rows if "RAFT at k = 4" in r[2])
    assert row[4].startswith("reward − β·KL -1.20 ± ") and ", judge +0.20 ± " in row[4]
    assert "KL 17.0 against 3.0" in row[4] and "copied from the post 90% against RLOO's 10%" in row[4]
    assert row[5].startswith("holds; moved past its interval: reward − β·KL down, judge up")
    assert "not yet run" in next(r for r in rows if "RAFT at k = 2" in r[2])[5]


def test_the_worst_iteration_is_the_worst_of_any_run():
    from tools.analysis.claims_page import claims
    a, b = fake_run(0, [0.0] * 4), fake_run(1, [0.0] * 4)
    a["iterations"] = [{**a["iterations"][0], "clipfrac": c} for c in (0.01, 0.02)]
    b["iterations"] = [{**b["iterations"][0], "clipfrac": c} for c in (0.001, 0.06)]
    rows, _ = claims({"": {0: a, 1: b}}, {})
    row = next(r for r in rows if "fewer than 5%" in r[2])
    # mean of each run's worst: 4%; the worst iteration: 6%, past 5%
    assert "the worst iteration of any run 6.00%" in row[4] and row[5] == "does not hold"


def test_the_optimum_and_best_of_n_share_one_kl_basis():
    from support.optimum import best_of_n_weights, optimum_point, self_normalised_kl
    from tools.analysis.claims_page import claims
    k = 4
    scores = [[0.0, 0.0, 0.0, 1.0 + 0.1 * i] for i in range(4)]
    opt = {"samples": k, "posts": 4, "kl_cap": math.log(k), "machine": "a test CPU",
           "optimum": [], "best_of_n": [], "per_post": [{"post": i, "reward": r}
                                                       for i, r in enumerate(scores)]}
    base = seeds(3, lambda s: fake_run(s, [0.5 + 0.01 * s] * 4, kl=[3.0] * 4))
    rows, _ = claims({"": base}, {"optimum": opt})
    row = next(r for r in rows if "KL-regularised" in r[2])
    # best of 4 by sum w log(k w): all weight on the top sample, log 4 = 1.39, not
    # (B2)'s log 4 - 3/4 = 0.64
    assert self_normalised_kl(best_of_n_weights(k, k)) == pytest.approx(math.log(k))
    top = sum(1.0 + 0.1 * i for i in range(4)) / 4
    assert f"best of 4 {top - 0.1 * math.log(4):+.2f} (judge {top:+.2f} at KL 1.39)" in row[4]
    star = [optimum_point(r, 0.1) for r in scores]
    objective = sum(e - 0.1 * d for e, d, _ in star) / 4
    assert f"the optimum at β = 0.1 {objective:+.2f}" in row[4]
    assert row[5].startswith("holds")


def test_length_bins_count_seeds_and_posts():
    from tools.analysis.claims_runs import bin_intervals
    from tools.analysis.length_bins import bin_values
    run = fake_run(0, [1.0, -1.0, 0.0, 1.0])          # wins 1, 0, 1/2, 1; every ratio 1
    values, n_s = bin_values(run)[1]
    assert n_s == 4 and values == [0.5, -0.5, 0.0, 0.5]       # (w - 1/2) n / n_s, n = n_s
    short = fake_run(0, [1.0, -1.0, 0.0, 1.0])
    short["final"]["samples"][0]["length"] = 5                  # post 0: ratio 0.4
    (low, n0), (middle, n1) = bin_values(short)[:2]
    assert (n0, n1) == (1, 3) and low == [2.0, 0.0, 0.0, 0.0]   # 1/2 x 4 / 1
    assert middle == pytest.approx([0.0, -0.5 * 4 / 3, 0.0, 0.5 * 4 / 3])
    group = {s: fake_run(s, [1.0, -1.0, 1.0, 1.0]) for s in range(3)}
    ((name, posts, iv),) = bin_intervals(group, [None, None, None])
    assert (name, posts, iv.seeds, iv.posts) == ("0.75-1.25", 12, 3, 4)
    assert iv.gain == pytest.approx(0.25)                       # win rate 3/4


def test_the_kept_page_is_what_its_kept_files_give():
    """docs/claims.md is the command's output from docs/runs/claims/, not typed in."""
    from tools.analysis import claims_page
    with pytest.raises(SystemExit) as same:
        claims_page.main(["--runs", str(RUNS), "--out", str(PAGE), "--check"])
    assert same.value.code == 0


def test_the_claims_page_from_kept_summaries(tmp_path):
    import json
    from tools.analysis import claims_page
    runs = tmp_path / "claims"
    runs.mkdir()
    for seed in (0, 1, 2):
        for name, rewards, config in (("base", [0.5, 0.4, 0.5, 0.6], None),
                                      ("lam0", [-0.5, -0.4, -0.6, -0.5], {"lam": 0.0}),
                                      ("lam1", [1.5, 1.4, 1.6, 1.5], {"lam": 1.0})):
            shifted = [r + 0.02 * seed for r in rewards]
            (runs / f"{name}_s{seed}.json").write_text(json.dumps(fake_run(seed, shifted, config)))
    out = tmp_path / "claims.md"
    claims_page.main(["--runs", str(runs), "--out", str(out)])
    text = out.read_text()
    lam_row = next(line for line in text.splitlines() if "falls in that order" in line)
    assert "λ 1: +1.52; λ 0.95: +0.52; λ 0: -0.48 (seeds 0, 1, 2)" in lam_row
    assert "| holds |" in lam_row and "(--lam 0.5 not yet run)" in lam_row
    assert "Satterthwaite's t" in text and "larger of" not in text
    assert (tmp_path / "claims_lambda.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as same:
        claims_page.main(["--runs", str(runs), "--out", str(out), "--check"])
    assert same.value.code == 0
    # λ = 0.5 above λ = 1 past its interval: the order breaks
    for seed in (0, 1, 2):
        (runs / f"lam05_s{seed}.json").write_text(json.dumps(fake_run(
            seed, [2.5 + 0.02 * seed, 2.4, 2.6, 2.5], {"lam": 0.5})))
    lam_row = next(x for x in claims_page.page(*claims_page.load(runs)).splitlines()
                   if "falls in that order" in x)
    assert "does not hold: λ 1 against 0 holds; λ 0.95 against 0.5 does not hold" in lam_row


def judged(beta, seed, accuracy, config=None, per_pair=None):
    """A kept dpo.py summary as the DPO row reads it: the judges' accuracies on the pairs,
    and with `per_pair` every vote's right-or-wrong (a run since issue 75)."""
    interval = lambda acc: {"heldout_accuracy": acc, "wilson_low": acc - 0.08,  # noqa: E731
                            "wilson_high": acc + 0.08}
    judges = {"pairs": 4, "implicit": interval(accuracy), "content": interval(0.61)}
    if per_pair:
        judges.update(baselines={"per_pair": per_pair}, split_fingerprint="f1")
    return {"config": {"beta": beta, "seed": seed, "steps": 30, "heldout_pairs": 128,
                       "reward_model": "runs/reward_model", "out": f"runs/dpo_s{seed}",
                       **(config or {})}, "final": {"judges": judges}}


def test_the_dpo_row_before_the_like_for_like_runs_is_not_resolved_beside_the_rules():
    from tools.analysis.claims_page import CLAIMS, Page
    from tools.analysis.claims_readers import dpo
    claim = next(c for c in CLAIMS if c.read is dpo)
    rules = {"per_pair": {"system": [1.0, 1.0, 0.0, 1.0, 0.0], "length": [0.5, 0, 1, 1, 0]},
             "near_chance": ["C vs D"], "split_fingerprint": "f1"}
    other = {f"dpo_{b}_{s}": judged(b, s, a) for b, s, a in
             ((0.05, 0, 0.70), (0.1, 0, 0.80), (0.1, 1, 0.72))}
    reading = dpo(claim, Page({}, {**other, "judge_rules": rules}, {}))
    assert "β 0.05, seed 0: implicit 70.0% [62.0%, 78.0%]" in reading.measured
    assert "the explicit judge (content) 61.0% [53.0%, 69.0%] on the same 4" in reading.measured
    # the rules on the first 4 votes: system 3 of 4, length 2.5 of 4
    assert "training comparisons 75.0%, the longer summary 62.5%" in reading.measured
    assert reading.verdict == ("not resolved: the like-for-like runs that decide it are not "
                               "yet kept; a rule that knows only which system wrote each "
                               "summary scores 75.0%, within the implicit judges' 70.0% to "
                               "80.0%")
    assert dpo(claim, Page({}, {}, {})) is None


def test_the_dpo_row_is_decided_by_the_like_for_like_runs_paired_on_the_near_chance_pairs():
    from support.intervals import paired_interval
    from tools.analysis.claims_page import CLAIMS, Page
    from tools.analysis.claims_readers import dpo
    from tools.analysis.claims_runs import decide, dpo_groups
    claim = next(c for c in CLAIMS if c.read is dpo)
    rules = {"near_chance": ["C vs D"], "split_fingerprint": "f1", "judge": "runs/rm"}
    like = {"steps": 0, "heldout_pairs": 0, "reward_model": "runs/rm_human"}

    def votes(implicit):
        # pairs x and y near chance (y voted twice), z of the strong contrast
        return {"pair": ["x", "y", "y", "z"], "contrast": ["C vs D", "C vs D", "C vs D", "A vs B"],
                "implicit": implicit, "content": [1, 1, 1, 1], "full": [1, 0, 1, 0]}
    other = {"dpo_old": judged(0.1, 0, 0.7),
             **{f"dpo_human_s{s}": judged(0.1, s, 0.6, like, votes(v)) for s, v in
                ((0, [0, 0, 0, 1]), (1, [1, 0, 1, 1]), (2, [0, 1, 0, 1]))}}
    assert sorted(dpo_groups(other)) == [
        "dpo.py --beta 0.1", "dpo.py --beta 0.1 --steps 0 --heldout-pairs 0 "
        "--reward-model runs/rm_human"]
    reading = dpo(claim, Page({}, {**other, "judge_rules": rules}, {}))
    # per seed, distinct pairs (x, y): implicit [0, 0], [1, 1/2], [0, 1/2]; content [1, 1]
    by_hand = paired_interval({0: [0, 0], 1: [1, 0.5], 2: [0, 0.5]}, {s: [1, 1] for s in range(3)})
    part = reading.parts[0]
    assert part.name == "implicit against the content score" and part.direction == -1
    assert part.interval.gain == pytest.approx(by_hand.gain) == pytest.approx(-2 / 3)
    assert part.interval.se == pytest.approx(by_hand.se)
    assert reading.measured.startswith(
        "on the 2 distinct held-out pairs where neither the system nor the length rule "
        "reaches 70% (C vs D): implicit 33.3%, explicit content 100.0%, full 75.0%; "
        "implicit − content -66.7 ± ")
    assert reading.measured.endswith("points (seeds 0, 1, 2)")
    # implicit - content -0.67, [-1.62, +0.28]; implicit - full -0.42, [-2.17, +1.33]
    said, seeds = decide(reading)
    assert said == "not resolved; nothing shown moved past its interval"
    assert seeds.startswith("implicit against the content score: ") and ": " in seeds


def test_a_kept_summary_keeps_numbers_and_words_not_texts():
    from support.kept import TEXTS, machine, summarize_run
    samples = [{"post": i, "reward": 0.1 * i, "text": "two words", "ids": [1, 2]}
               for i in range(5)]
    results = {"config": {"beta": 0.1}, "commits": ["abc"], "iterations": [{"reward": 1.0}],
               "final": {"reward": 0.2, "samples": samples}}
    kept = summarize_run(results, where="a CPU")
    assert "commits" not in kept and kept["machine"] == "a CPU"
    rows = kept["final"]["samples"]
    assert [("text" in r) for r in rows] == [True] * TEXTS + [False] * (5 - TEXTS)
    assert all(r["words"] == 2 and "ids" not in r and r["reward"] == 0.1 * i
               for i, r in enumerate(rows))
    assert isinstance(machine(), str) and machine()


def test_a_machine_run_with_fewer_instructions_says_so(monkeypatch):
    from support import kept
    avx512 = {"avx2", "avx512f"}
    for used, label in [("AVX512", ""), ("AVX2", "; kernels as AVX2"),
                        ("DEFAULT", "; kernels as no AVX2")]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: used)
        assert kept._kernels_held_back(avx512) == label
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert kept._kernels_held_back({"avx2"}) == ""                 # AVX2 on an AVX2 CPU


def test_runs_held_to_avx2_are_checked_against_their_seeds_baseline():
    from tools.analysis.claims_runs import held_back
    base = {seed: fake_run(seed, [0.0] * 4) for seed in (0, 1)}
    held = {seed: {**fake_run(seed, [0.0] * 4, {"target_kl": 1.0}),
                   "machine": "a test CPU (AVX-512; kernels as AVX2)"} for seed in (0, 1)}
    assert held_back({"": base, "--target-kl 1": {}}) == ""          # none held back
    assert "each of the 2 such runs" in held_back({"": base, "--target-kl 1": held})
    held[1]["iterations"] = [{**held[1]["iterations"][0], "reward": 0.5}]
    assert "only 1 of the 2 such runs" in held_back({"": base, "--target-kl 1": held})


def test_the_controllers_row_gives_each_seeds_last_beta():
    from tools.analysis.claims_page import claims
    runs = {"": {s: fake_run(s, [0.0] * 4) for s in (0, 1)}, "--target-kl 1": {}}
    for seed, beta in ((1, 0.2), (0, 0.05)):            # kept out of seed order
        run = fake_run(seed, [0.0] * 4, {"target_kl": 1.0})
        run["iterations"][-1]["beta"] = beta
        runs["--target-kl 1"][seed] = run
    row = next(r for r in claims(runs, {})[0] if "target 1 nat" in r[2])
    assert "β at the end 0.050 / 0.200 (seeds 0, 1)" in row[4]


def test_the_estimators_block_and_the_readme_sentence_are_the_kept_runs():
    """docs/estimators.md's kept block is the command's output, and the README quotes its
    sentence word for word."""
    from tools.analysis import estimators_page
    from tools.analysis.claims_runs import load
    with pytest.raises(SystemExit) as same:
        estimators_page.main(["--runs", str(RUNS), "--out", str(DOCS / "estimators.md"),
                              "--check"])
    assert same.value.code == 0
    readme = (DOCS.parent / "README.md").read_text()
    said = estimators_page.sentence(load(RUNS)[0])
    assert " ".join(said.split()) in " ".join(readme.split()), (
        f"README.md: quote `python -m tools.analysis.estimators_page`'s sentence: {said}")


def test_the_estimators_table_judges_each_setting_on_the_objective(tmp_path):
    from tools.analysis import estimators_page
    from tools.analysis.claims_runs import compare, pm, pools
    rloo = {"estimator": "rloo", "batch": 2, "samples_per_prompt": 4}
    j = [0.05, -0.05, 0.1, -0.1]
    runs = {"": seeds(3, lambda s: fake_run(s, [0.0 + x * s for x in j], kl=[2.0] * 4)),
            "--estimator rloo --batch 2 --samples-per-prompt 4": seeds(6, lambda s: fake_run(
                s, [0.1 + x * (s % 3) for x in j], rloo, kl=[5.0] * 4))}
    # RLOO's judge +0.1 at 3 more nats: -0.2 on reward - 0.1 KL, on the 3 seeds both have
    assert ("RLOO 2 x 4 against PPO at β = 0.1 on reward − β·KL held out: -0.20 ± "
            in estimators_page.sentence(runs))
    assert "(95% interval, 3 seeds a side): PPO ahead." in estimators_page.sentence(runs)
    text = estimators_page.block(runs)
    assert "| 6 | -0.40 | 5.00 | -0.20 ± " in text and "| behind PPO | — |" in text
    assert "| REINFORCE (`--estimator reinforce`) | 0 |" in text and "not kept yet" in text
    # a setting on one seed takes the page's pooled seed variance, and says so
    runs["--estimator reinforce"] = {0: fake_run(0, [0.3, 0.1, 0.2, 0.0], {"estimator":
                                                                      "reinforce"}, kl=[2.0] * 4)}
    row = next(x for x in estimators_page.block(runs).splitlines() if "REINFORCE" in x)
    assert "| 1 (1 seed: the seed variance pooled as on claims.md) |" in row
    pooled = compare(runs["--estimator reinforce"], runs[""], "objective", pools(runs))
    assert pooled.seeds_counted and f"| {pm(pooled)} |" in row


def test_reward_noise_is_read_on_the_objective_with_a_doubled_pooled_seed_variance():
    from support.intervals import paired_interval
    from tools.analysis.claims_page import claims
    from tools.analysis.claims_runs import doubled, pools
    raft = {"estimator": "raft", "batch": 2, "samples_per_prompt": 4}
    rloo = {"estimator": "rloo", "batch": 2, "samples_per_prompt": 4}
    noise = [[0.3, -0.2, 0.1, 0.0], [-0.4, 0.5, 0.0, 0.2], [0.1, 0.1, -0.3, 0.4]]
    runs = {"": seeds(3, lambda s: fake_run(s, [0.0] * 4)),
            "--gamma 1": seeds(3, lambda s: fake_run(s, [0.2 * s + x for x in noise[s]])),
            "--estimator raft --batch 2 --samples-per-prompt 4": {0: fake_run(0, [1.0] * 4, raft)},
            "--estimator raft --batch 2 --samples-per-prompt 4 --reward-noise 1": {
                0: fake_run(0, [0.0, 0.1, -0.1, 0.0], {**raft, "reward_noise": 1.0})},
            "--estimator rloo --batch 2 --samples-per-prompt 4": {0: fake_run(0, [1.0] * 4, rloo)},
            "--estimator rloo --batch 2 --samples-per-prompt 4 --reward-noise 1": {
                0: fake_run(0, [0.5, 1.0, 0.5, 1.0], {**rloo, "reward_noise": 1.0})}}
    rows, page = claims(runs, {})
    row = next(r for r in rows if "under reward noise" in r[2])
    # falls (KL 1 everywhere, so the objective's fall is the judge's): RAFT -1, -0.9, -1.1, -1;
    # RLOO -0.5, 0, -0.5, 0; D = -0.5, -0.9, -0.6, -1
    by_hand = paired_interval({0: [-1.0, -0.9, -1.1, -1.0]}, {0: [-0.5, 0.0, -0.5, 0.0]},
                              doubled(pools(runs)["objective"]))
    assert f"SD 1: RAFT -1.00, RLOO -0.25; RAFT's against RLOO's reward − β·KL -0.75 ± " \
           f"{by_hand.high - by_hand.gain:.2f}" in row[4]
    assert row[5].startswith(("holds", "not resolved")) and "(1 seed: the seed variance pooled" in row[5]
    assert by_hand.se ** 2 > paired_interval({0: [-1.0, -0.9, -1.1, -1.0]},
                                             {0: [-0.5, 0.0, -0.5, 0.0]}).se ** 2
