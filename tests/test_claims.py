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
    from tools.claims_page import order_kept
    assert order_kept(0) == 1.0 and order_kept(1) == pytest.approx(0.75)
    g = torch.Generator().manual_seed(0)
    r, e = torch.randn(2, 200_000, generator=g), 3 * torch.randn(2, 200_000, generator=g)
    kept = ((r[0] - r[1]).sign() == (r[0] + e[0] - r[1] - e[1]).sign()).double().mean()
    assert float(kept) == pytest.approx(order_kept(3), abs=0.005)       # 0.602


def test_the_noise_verdict_is_said_once_where_the_levels_agree():
    from tools.claims_page import by_level
    assert by_level([("1", "holds here")]) == "holds here"
    assert by_level([("1", "not resolved")]) == "not resolved: within 2 SE"
    assert (by_level([("1", "not resolved"), ("3", "not resolved")])
            == "not resolved at SD 1 and 3: within 2 SE")
    assert (by_level([("1", "not resolved"), ("3", "holds here")])
            == "SD 1: not resolved (within 2 SE); SD 3: holds here")


@pytest.mark.slow
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

def test_paired_gain_takes_the_larger_of_the_two_ses_by_hand():
    from support.measures import paired_gain
    # d = [1, 2, 3] on seed 0 and [1, 1, 1] on seed 1: per-seed means 2 and 1, gain 1.5;
    # SE over seeds = sd(2, 1) / sqrt 2 = 0.5; per-post means 1, 1.5, 2: SE 0.5 / sqrt 3
    gain, se, source = paired_gain({0: [1, 2, 3], 1: [2, 2, 2]}, {0: [0, 0, 0], 1: [1, 1, 1]})
    assert (gain, source) == (1.5, "seeds") and se == pytest.approx(0.5)
    gain, se, source = paired_gain({0: [1, 2, 3]}, {0: [0, 0, 0]})     # one seed: posts
    assert (gain, source) == (2.0, "posts") and se == pytest.approx(1 / math.sqrt(3))


def fake_run(seed, rewards, config=None, ranks=None, **per_post):
    """A kept summary as support/kept.summarize_run writes it, on len(rewards) posts;
    per_post: more of each sample's fields, a list each (copied_bigrams=[...], ...)."""
    n = len(rewards)
    samples = [{"post": i, "reward": r, "ref_reward": 0.0, "length": 10, "eos": True, "words": 8,
                "retrieval_rank": (ranks or [1] * n)[i], "rouge_l": 0.2, "kl": 1.0,
                "copied_bigrams": 0.1, **{key: values[i] for key, values in per_post.items()}}
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


def test_outside_note_names_the_measures_that_fall_and_says_when_none_do():
    from tools.claims_page import outside_note
    base = {0: fake_run(0, [0.0] * 8)}
    # ranks 1, 2, 3, 4 twice against 1 everywhere: MRR falls by 0.48 on every other post
    worse = {0: fake_run(0, [0.0] * 8, ranks=[1, 2, 3, 4] * 2)}
    assert outside_note(worse, base).startswith("; but MRR below by ")
    assert "ROUGE-L" not in outside_note(worse, base)
    assert outside_note(base, base) == "; neither MRR nor ROUGE-L below"


def test_a_gain_names_the_seeds_it_pairs_on_not_the_setting_s_own():
    from tools.claims_page import judge_row
    base = {0: fake_run(0, [0.0] * 4)}
    runs = {0: fake_run(0, [1.0] * 4), 1: fake_run(1, [5.0] * 4)}   # seed 1 has no pair
    assert judge_row(runs, base).startswith("judge +1.00")
    assert judge_row(runs, base).endswith("vs β = 0.1 (1 seed)")


def test_beta0_rows_say_not_resolved_where_nothing_moves_past_2_se():
    from tools.claims_page import beta0_rows
    plain = {0: fake_run(0, [2.0] * 4, copied_bigrams=[0.5] * 4, question=[True, False] * 2)}
    # copied -0.05, +0.05 by post: 0 ± 0.05; questions the same: neither falls nor rises
    ent = {0: fake_run(0, [2.0] * 4, copied_bigrams=[0.45, 0.55] * 2,
                       question=[True, False] * 2)}
    row = beta0_rows({"--beta 0": plain, "--beta 0 --ent-coef 0.01": ent})[0]
    assert "copied bigrams +0.00 ± 0.03 against β = 0 alone" in row[4]
    assert row[5] == "not resolved: neither falls past 2 SE (seeds 1, 2 not yet run)"


def test_the_claims_page_from_kept_summaries(tmp_path):
    import json
    from tools import claims_page
    runs = tmp_path / "claims"
    runs.mkdir()
    base = fake_run(0, [0.5, 0.5, 0.5, 0.5])
    lam0 = fake_run(0, [0.0, -0.5, 0.0, -0.5], {"lam": 0.0})
    lam1 = fake_run(0, [1.0, 1.0, 1.5, 1.5], {"lam": 1.0})
    for name, run in (("base", base), ("lam0", lam0), ("lam1", lam1)):
        (runs / f"{name}.json").write_text(json.dumps(run))
    out = tmp_path / "claims.md"
    claims_page.main(["--runs", str(runs), "--out", str(out)])
    text = out.read_text()
    lam_row = next(line for line in text.splitlines() if "falls in that order" in line)
    # lambda 1 against 0: d = [1, 1.5, 1.5, 2], gain 1.5, SE 0.5 sd / 2 = 0.204: holds
    assert "λ 1: +1.25; λ 0.95: +0.50; λ 0: -0.25" in lam_row and "holds here" in lam_row
    assert "--lam 0.5 not yet run" in lam_row and "(seeds 1, 2 not yet run)" in lam_row
    clip_row = next(line for line in text.splitlines() if "fewer than 5%" in line)
    assert "at most 1.00%; in the worst iteration 1.00% (3 settings;" in clip_row
    assert "holds here" in clip_row
    assert "not yet run" in next(line for line in text.splitlines() if "RAFT at k = 2" in line)
    assert "on fewer seeds than they need" in text and "the others say what is still to run" in text
    assert (tmp_path / "claims_lambda.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as same:
        claims_page.main(["--runs", str(runs), "--out", str(out), "--check"])
    assert same.value.code == 0
    # λ = 0.5 above λ = 0.95: the ends still fall past 2 SE, the order does not hold
    (runs / "lam05.json").write_text(json.dumps(fake_run(0, [1.5] * 4, {"lam": 0.5})))
    claims_page.main(["--runs", str(runs), "--out", str(out)])
    lam_row = next(line for line in out.read_text().splitlines() if "falls in that order" in line)
    assert "λ 0.5: +1.50" in lam_row and "--lam 0.5 not yet run" not in lam_row
    assert "in part: the ends fall past 2 SE, the middle is out of order" in lam_row
    # a seed only λ = 0 has leaves the order on seed 0, the one every λ has
    (runs / "lam0_s1.json").write_text(json.dumps({**fake_run(0, [5.0] * 4, {"lam": 0.0}),
                                                   "config": {**lam0["config"], "seed": 1}}))
    lam_row = next(x for x in claims_page.page(*claims_page.load(runs)).splitlines()
                   if "falls in that order" in x)
    assert "λ 0: -0.25 (seed 0)" in lam_row
    # tier 1 asks three seeds: with seed 1 of every λ the row names seed 2 alone, then nothing
    lam05 = fake_run(0, [1.5] * 4, {"lam": 0.5})
    for seed in (1, 2):
        for name, run in (("base", base), ("lam0", lam0), ("lam1", lam1), ("lam05", lam05)):
            (runs / f"{name}_s{seed}.json").write_text(json.dumps({**run, "config": {
                **run["config"], "seed": seed}}))
        text = claims_page.page(*claims_page.load(runs))             # the page, no plots
        lam_row = next(x for x in text.splitlines() if "falls in that order" in x)
        assert lam_row.endswith(" (seed 2 not yet run) |" if seed == 1 else "out of order |")
        assert ("(seeds 0, 1)" if seed == 1 else "(seeds 0, 1, 2)") in lam_row


def test_lambda_in_order_but_within_2_se_is_not_resolved_and_says_so(tmp_path):
    import json
    from tools import claims_page
    runs = tmp_path / "claims"
    runs.mkdir()
    # λ 1: +0.50, 0.95: +0.25, 0: 0; λ 1 against 0: d = [2, -1, 2, -1], SE sqrt(3) / 2 = 0.87
    for name, rewards, config in (("base", [0.25] * 4, None), ("lam0", [0.0] * 4, {"lam": 0.0}),
                                  ("lam1", [2.0, -1.0, 2.0, -1.0], {"lam": 1.0})):
        (runs / f"{name}.json").write_text(json.dumps(fake_run(0, rewards, config)))
    lam_row = next(x for x in claims_page.page(*claims_page.load(runs)).splitlines()
                   if "falls in that order" in x)
    assert ("not resolved: the means fall in that order, but λ 1 against 0 is +0.50 ± 0.87"
            in lam_row)


def test_the_kept_page_is_what_its_kept_files_give():
    """docs/claims.md is the command's output from docs/runs/claims/, not typed in."""
    from tools import claims_page
    with pytest.raises(SystemExit) as same:
        claims_page.main(["--runs", str(RUNS), "--out", str(PAGE), "--check"])
    assert same.value.code == 0


def test_the_noise_beta_zero_and_optimum_rows_by_hand(tmp_path):
    import json
    from tools import claims_page
    runs = tmp_path / "claims"
    runs.mkdir()
    raft = {"estimator": "raft", "batch": 2, "samples_per_prompt": 4}
    rloo = {"estimator": "rloo", "batch": 2, "samples_per_prompt": 4}
    beta0 = {"beta": 0.0}
    files = {
        "base": fake_run(0, [0.5] * 4, eos=[True, False, False, False]),
        "eos": fake_run(0, [0.5] * 4, {"missing_eos_penalty": -1.0}, eos=[True] * 4),
        "raft": fake_run(0, [1.0] * 4, raft, copied_bigrams=[0.9] * 4),
        "raft_noise": fake_run(0, [0.0] * 4, {**raft, "reward_noise": 1.0}),
        "rloo": fake_run(0, [1.0] * 4, rloo),
        "rloo_noise": fake_run(0, [0.5, 1.0, 0.5, 1.0], {**rloo, "reward_noise": 1.0}),
        "target": fake_run(0, [0.25] * 4, {"target_kl": 3.0}),
        "flip": fake_run(0, [-1.0, -1.0, -2.0, -2.0], {"flip_sign": True}, kl=[50.0] * 4),
        "beta0": fake_run(0, [2.0] * 4, beta0, copied_bigrams=[0.5] * 4,
                          question=[True, True, False, False]),
        "ent": fake_run(0, [2.0] * 4, {**beta0, "ent_coef": 0.01},
                        copied_bigrams=[0.1, 0.2, 0.1, 0.2], question=[False] * 4),
        "ptx": fake_run(0, [2.0] * 4, {**beta0, "ptx_coef": 1.0},
                        copied_bigrams=[0.6, 0.7] * 2, question=[True, True, False, False]),
        "optimum": {"samples": 4, "posts": 4, "kl_cap": math.log(4), "machine": "a test CPU",
                    "optimum": [{"beta": 0.1, "kl": 1.2, "reward": 1.0, "reward_se": 0.1}],
                    "best_of_n": [{"n": n, "kl": math.log(n) - (n - 1) / n} for n in (1, 2, 3, 4)],
                    "per_post": [{"post": i, "reward": [0.0, 0.0, 0.0, 1.0 + 0.1 * i]}
                                 for i in range(4)]}}
    files["target"]["iterations"] = [{**files["target"]["iterations"][0], "iteration": i,
                                      "kl": float(i), "beta": 0.01 * i} for i in range(12)]
    for name, data in files.items():
        (runs / f"{name}.json").write_text(json.dumps(data))
    out = tmp_path / "claims.md"
    claims_page.main(["--runs", str(runs), "--out", str(out)])
    lines = out.read_text().splitlines()
    line = lambda words: next(x for x in lines if words in x)  # noqa: E731
    # falls: RAFT -1 on every post, RLOO -0.5, 0, -0.5, 0; D = -0.5, -1, -0.5, -1:
    # -0.75, SE sd / 2 = 0.144: RAFT loses more, past 2 SE
    assert ("RAFT -1.00, RLOO -0.25; RAFT's against RLOO's -0.75 ± 0.14" in
            line("under reward noise") and "holds here (1 seed)" in line("under reward noise"))
    assert line("under reward noise").endswith("; SD 3 not yet run |")
    # RAFT k = 4 against RLOO: the same judge's reward, 90% of bigrams copied against 10%
    assert "bigrams copied from the post 90% against RLOO's 10%" in line("RAFT at k = 4")
    assert "not resolved: within 2 SE: RAFT's summaries copy the post" in line("RAFT at k = 4")
    # the sign flip: below SFT (0) by 1.5 ± 0.29 and 49 nats further from SFT: not fluent
    assert "judge -1.50 ± 0.29 over SFT" in line("negating both")
    assert "but it is not fluent" in line("negating both")
    # entropy bonus: copied -0.35 ± 0.03 (below), questions -0.50 ± 0.29 (within 2 SE)
    assert "copied bigrams -0.35 ± 0.03 against β = 0 alone" in line("entropy bonus")
    assert "in part: copied bigrams" in line("entropy bonus")
    # tier 2 asks three seeds only where a sign is within 2 SE: questions are, here
    assert line("entropy bonus").endswith("fall past 2 SE (seeds 1, 2 not yet run) |")
    # supervised loss: copied +0.15 ± 0.03 (above), questions unchanged
    assert "does not hold here: copied bigrams rise past 2 SE" in line("supervised loss (13)")
    # PPO: +0.50 on every post at KL 1.00. The optimum at β = 0.1 of (0, 0, 0, 1 + 0.1 i):
    # weight e^{10 r} / sum; best of n with KL <= 1: n = 4 (KL 0.64), the top score 1 + 0.1 i,
    # mean 1.15: PPO against it -0.65 ± 0.06 (SE over posts of 0.1 i: 0.129 / 2)
    w = [math.exp(10 * (1 + 0.1 * i)) / (3 + math.exp(10 * (1 + 0.1 * i))) for i in range(4)]
    star = sum(wi * (1 + 0.1 * i) for i, wi in enumerate(w)) / 4
    assert f"the optimum at β = 0.1 {star:+.2f}, PPO against it {0.5 - star:+.2f}" in line(
        "KL-regularised")
    assert "best of 4 (KL 0.64) +1.15, PPO against it -0.65 ± 0.06" in line("KL-regularised")
    assert "holds here: below the optimum at β = 0.1 and best of 4" in line("KL-regularised")
    assert "log k = 1.39" in line("KL-regularised")
    assert (tmp_path / "claims_optimum.png").stat().st_size > 1000
    # the controller at 3 nats: -0.25 against the baseline on every post
    assert "judge -0.25 ± 0.00" in line("target 3 nats") and "below" in line("target 3 nats")
    assert "not yet run)" not in line("target 3 nats")
    # its 12 iterations' KL 0, 1, ..., 11: the last 10 average 6.5; β ends at 0.11
    assert ("the batch's KL over the last 10 iterations 6.50 against its target 3, β at the "
            "end 0.110" in line("target 3 nats"))
    # -1 for no EOS: ends by itself 1 - 1/4 more, SE over posts sd(0, 1, 1, 1) / 2 = 0.25
    assert "; ends by itself +75 ± 25 points | holds here |" in line("no EOS")
    assert "not yet run" in line("target 1 nat |")
    assert (tmp_path / "claims_beta.png").stat().st_size > 1000
    # length bins: every summary as long as the person's (ratio 1), each above SFT's 0:
    # 4 of 4 wins, Wilson's low end 4 / (4 + 1.96^2) = 0.51, past one half, at both β
    assert "β = 0: 0.75-1.25 100% of 4; β = 0.1: 0.75-1.25 100% of 4" in line("every length")
    assert line("every length").endswith("| β = 0: holds here; β = 0.1: holds here (β = 0.01, "
                                         "0.5, 2: not yet run here; `python ppo.py --beta "
                                         "0.01 0.5 2` makes them) |")


def test_the_dpo_row_picks_beta_on_seed_0_and_judges_every_run():
    from tools import claims_page

    def judged(beta, seed, low, high):
        interval = lambda acc, lo, hi: {"heldout_accuracy": acc, "wilson_low": lo,  # noqa: E731
                                        "wilson_high": hi}
        return {"config": {"beta": beta, "seed": seed},
                "final": {"judges": {"pairs": 128, "implicit": interval((low + high) / 2, low,
                                                                        high),
                                     "content": interval(0.61, 0.52, 0.69)}}}
    runs = [judged(0.05, 0, 0.55, 0.70), judged(0.1, 0, 0.60, 0.78), judged(0.5, 0, 0.50, 0.66)]
    row = claims_page.dpo_row(claims_page.dpo_groups({f"dpo{i}": d for i, d in enumerate(runs)}))
    assert row[-1] == ("not resolved: the Wilson intervals overlap; best β on seed 0 by the "
                       "implicit judge: 0.1, seeds 1, 2 not yet run")
    assert "β 0.05, seed 0: implicit 62.5% [55.0%, 70.0%]" in row[4]
    assert "the explicit judge (content) 61.0% [52.0%, 69.0%] on the same 128" in row[4]
    runs += [judged(0.1, 1, 0.70, 0.85), judged(0.1, 2, 0.62, 0.80)]
    row = claims_page.dpo_row(claims_page.dpo_groups({f"dpo{i}": d for i, d in enumerate(runs)}))
    assert row[-1].startswith("does not hold here: the implicit judge is the more accurate")
    assert row[-1].endswith("0.1, seeds 1, 2 run")
    row = claims_page.dpo_row(claims_page.dpo_groups({"dpo": runs[1]}))
    assert row[-1].endswith("β 0.05, 0.5 not yet run")
    assert "not yet run: the DPO runs" in claims_page.dpo_row({})[-1]


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
    from tools.claims_page import held_back
    base = {seed: fake_run(seed, [0.0] * 4) for seed in (0, 1)}
    held = {seed: {**fake_run(seed, [0.0] * 4, {"target_kl": 1.0}),
                   "machine": "a test CPU (AVX-512; kernels as AVX2)"} for seed in (0, 1)}
    assert held_back({"": base, "--target-kl 1": {}}) == ""          # none held back
    assert "each of the 2 such runs" in held_back({"": base, "--target-kl 1": held})
    held[1]["iterations"] = [{**held[1]["iterations"][0], "reward": 0.5}]
    assert "only 1 of the 2 such runs" in held_back({"": base, "--target-kl 1": held})


def test_the_controllers_row_gives_each_seeds_last_beta():
    from tools.claims_page import claims
    runs = {"": {s: fake_run(s, [0.0] * 4) for s in (0, 1)}, "--target-kl 1": {}}
    for seed, beta in ((1, 0.2), (0, 0.05)):            # kept out of seed order
        run = fake_run(seed, [0.0] * 4, {"target_kl": 1.0})
        run["iterations"][-1]["beta"] = beta
        runs["--target-kl 1"][seed] = run
    row = next(r for r in claims(runs, {}) if "target 1 nat" in r[2])
    assert "β at the end 0.050 / 0.200 (seeds 0, 1)" in row[4]
