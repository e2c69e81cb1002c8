"""The issue-61 analyses: the SFT model's concentration, the KL-regularised optimum and
best-of-n, and the win rate by length bin; their math on hand-worked values, each command
on the tiny preset (slow).

Run:  python -m pytest -q tests/test_analysis_tools.py
      python -m pytest -q -m slow tests/test_analysis_tools.py
"""
import json
import math

import pytest
import torch

from support import optimum
from support.measures import concentration, length_bin, post_means, win_rate
from tools.analysis import length_bins


# ------------------------------------------------------------------ concentration

def test_concentration_on_hand_made_distributions():
    # Row 0, position 0: p = (1/2, 1/4, 1/8, 1/8): top-1 1/2, top-2 3/4,
    # H = 1/2 log 2 + 1/4 log 4 + 2/8 log 8 = (1/2 + 1/2 + 3/4) log 2 = 1.75 log 2, over
    # log 4 = 2 log 2: 0.875. Position 1: uniform, top-1 1/4, top-2 1/2, H / log V = 1.
    # Position 2: masked out, so zeros whatever its logits.
    p = torch.tensor([[[0.5, 0.25, 0.125, 0.125], [0.25] * 4, [0.9, 0.1, 0.0, 0.0]]])
    logits = p.clamp_min(1e-30).log() + 3.0             # a constant shift changes nothing
    mask = torch.tensor([[1, 1, 0]])
    top1, top2, entropy = concentration(logits, mask, top=2)
    assert torch.allclose(top1, torch.tensor([[0.5, 0.25, 0.0]]))
    assert torch.allclose(top2, torch.tensor([[0.75, 0.5, 0.0]]))
    assert torch.allclose(entropy, torch.tensor([[0.875, 1.0, 0.0]]))
    # A certain token: top-1 1, entropy 0 (a -inf logit adds nothing, not NaN).
    sure = torch.tensor([[[5.0, -math.inf, -math.inf, -math.inf]]])
    top1, _, entropy = concentration(sure, torch.ones(1, 1))
    assert top1.item() == 1.0 and entropy.item() == 0.0


def test_post_means_average_only_the_kept_positions():
    values = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert post_means(values, mask).tolist() == [2.0, 2.0]


# ------------------------------------------------------------------ the optimum

def test_optimum_weights_and_kl_on_two_samples_by_hand():
    # r = (0, 1), beta = 1: w = (1, e) / (1 + e); E*[r] = e / (1 + e);
    # log Z = log((e^0 + e^1) / 2); KL = E*[r] / 1 - log Z.
    e = math.e
    expected, kl, w = optimum.optimum_point([0.0, 1.0], 1.0)
    assert w.tolist() == pytest.approx([1 / (1 + e), e / (1 + e)], abs=1e-12)
    assert expected == pytest.approx(e / (1 + e), abs=1e-12)
    assert kl == pytest.approx(e / (1 + e) - math.log((1 + e) / 2), abs=1e-12)
    # The same KL as sum_i w_i log(k w_i), the KL of w to the uniform draw
    assert kl == pytest.approx(sum(x * math.log(2 * x) for x in w.tolist()), abs=1e-12)
    # beta = 0.5 doubles the exponents: w = (1, e^2) / (1 + e^2)
    assert optimum.optimum_weights([0.0, 1.0], 0.5)[1].item() == pytest.approx(
        e ** 2 / (1 + e ** 2), abs=1e-12)


def test_beta_zero_is_the_best_sample_and_large_beta_the_reference():
    expected, kl, w = optimum.optimum_point([0.3, 2.0, -1.0, 2.0], 0)
    assert expected == 2.0 and w.tolist() == [0.0, 0.5, 0.0, 0.5]
    assert kl == pytest.approx(math.log(4 / 2))          # two of four share the top
    expected, kl, _ = optimum.optimum_point([0.3, 2.0, -1.0, 2.0], 1e6)
    assert expected == pytest.approx((0.3 + 2 - 1 + 2) / 4, abs=1e-5)
    assert kl == pytest.approx(0.0, abs=1e-9)
    # Scores far apart at a small beta: no overflow, the weight all on the best
    expected, kl, _ = optimum.optimum_point([0.0, 50.0], 0.01)
    assert expected == pytest.approx(50.0) and kl == pytest.approx(math.log(2))


def test_best_of_two_of_three_by_hand():
    # r = 1 < 4 < 10. The three pairs {1,4}, {1,10}, {4,10} keep 4, 10, 10: mean 8.
    weights = optimum.best_of_n_weights(3, 2)
    assert weights.tolist() == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert (weights * optimum.by_score([10.0, 1.0, 4.0], [10.0, 1.0, 4.0])).sum().item() == \
        pytest.approx(8.0)
    assert optimum.best_of_n_weights(3, 1).tolist() == pytest.approx([1 / 3] * 3)
    assert optimum.best_of_n_weights(3, 3).tolist() == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="1 <= n <= k"):
        optimum.best_of_n_weights(3, 4)


def test_best_of_n_kl_bound():
    assert optimum.best_of_n_kl(1) == 0.0
    assert optimum.best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert optimum.best_of_n_kl(16) == pytest.approx(math.log(16) - 15 / 16)


def test_curves_carry_measures_by_the_same_weights():
    # Two posts of three samples. Post 0: r = (1, 4, 10), ROUGE-L (0.1, 0.2, 0.3); post 1:
    # r = (0, 0, 3), ROUGE-L (0.4, 0.4, 0.0).
    rewards = [[10.0, 1.0, 4.0], [0.0, 3.0, 0.0]]
    rouge = [[0.3, 0.1, 0.2], [0.4, 0.0, 0.4]]
    got = optimum.curves(rewards, {"rouge_l": rouge}, betas=[0])
    best2 = got["best_of_n"][1]
    # Best of 2: post 0 (4 + 2 * 10) / 3 = 8, ROUGE-L (0.2 + 2 * 0.3) / 3 = 0.8/3;
    # post 1: sorted (0, 0, 3) with ROUGE-L (0.4, 0.4, 0.0): (0 + 2 * 3) / 3 = 2,
    # ROUGE-L (0.4 + 0) / 3. Means over the posts, SE = |8 - 2| / 2 = 3 for two.
    assert best2["n"] == 2 and best2["kl"] == pytest.approx(math.log(2) - 0.5)
    assert best2["reward"] == pytest.approx(5.0) and best2["reward_se"] == pytest.approx(3.0)
    assert best2["rouge_l"] == pytest.approx((0.8 / 3 + 0.4 / 3) / 2)
    # beta = 0: the best sample of each, 10 and 3; its ROUGE-L 0.3 and 0.0; KL log 3 each.
    top = got["optimum"][0]
    assert top["reward"] == pytest.approx(6.5) and top["rouge_l"] == pytest.approx(0.15)
    assert top["kl"] == pytest.approx(math.log(3)) and top["ess"] == pytest.approx(1.0)
    # best of 3 = beta 0 here (no ties at the top); best of 1 = the plain mean
    assert got["best_of_n"][2]["reward"] == pytest.approx(6.5)
    assert got["best_of_n"][0]["reward"] == pytest.approx((5 + 1) / 2)


def test_optimum_curves_draw_on_three_panels():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from support.report import optimum_curves
    rewards = [[10.0, 1.0, 4.0], [0.0, 3.0, 0.0]]
    got = optimum.curves(rewards, {"retrieval_mrr": [[1, 0.5, 1], [1, 1, 0.25]],
                                   "rouge_l": [[0.3, 0.1, 0.2], [0.4, 0.0, 0.4]]}, [0.1, 1])
    fig, axes = plt.subplots(1, 3)
    optimum_curves(axes, got)
    for ax, key in zip(axes, ("reward", "retrieval_mrr", "rouge_l")):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines["best of n, n = 1..3 (SFT samples)"].get_ydata()) == \
            [row[key] for row in got["best_of_n"]]
        assert list(lines["the optimum, e^{r/beta} (SFT samples)"].get_xdata()) == \
            [row["kl"] for row in got["optimum"]]
    plt.close(fig)


# ------------------------------------------------------------------ length bins

def test_length_bin_and_win_rate():
    edges = (0.75, 1.25)
    assert [length_bin(r, edges) for r in (0.2, 0.75, 1.0, 1.25, 3.0)] == [0, 1, 1, 2, 2]
    # wins 1, tie 1/2, loss 0: 1.5 / 3
    assert win_rate([2.0, 1.0, 0.0], [1.0, 1.0, 0.5]) == pytest.approx(0.5)
    assert math.isnan(win_rate([], []))


def run(beta, seed, rows):
    """A finished run's results.json on three posts: rows of (policy tokens with EOS, eos,
    reward, ref_reward, rank, ref rank); people's TL;DRs are 10, 20 and 4 tokens."""
    return {"config": {"beta": beta, "seed": seed, "estimator": "gae"}, "final": {
        "samples": [{"post": i, "length": n, "eos": eos, "reward": r, "ref_reward": q,
                     "retrieval_rank": k} for i, (n, eos, r, q, k, _) in enumerate(rows)],
        "ref_samples": [{"post": i, "retrieval_rank": k} for i, (*_, k) in enumerate(rows)],
        "human_samples": [{"post": i, "length": n} for i, n in enumerate((10, 20, 4))]}}


def test_length_bins_pool_the_seeds_of_a_beta(tmp_path):
    # Seed 0: post 0 is 5 tokens + EOS against 10 (ratio 0.5, short), wins; post 1 is
    # 20 tokens, no EOS, against 20 (1.0, even), ties; post 2 is 8 against 4 (2.0, long),
    # loses. Seed 1: post 0 is 9 + EOS (0.9, even), loses; post 1 is 30 (1.5, long), wins;
    # post 2 is 3 + EOS (0.75, even: the edge is in the upper bin), wins.
    seed0 = run(0.1, 0, [(6, True, 1.0, 0.0, 1, 2), (20, False, 0.5, 0.5, 2, 1),
                         (9, True, -1.0, 0.0, 4, 4)])
    seed1 = run(0.1, 1, [(10, True, -1.0, 0.0, 2, 2), (30, False, 2.0, 1.0, 1, 1),
                         (4, True, 0.3, 0.2, 1, 4)])
    other = run(2.0, 0, [(6, True, 0.0, 1.0, 1, 1)] * 3)
    groups = length_bins.pool([seed0, seed1, other])
    assert list(groups) == ["β = 0.1", "β = 2"] and len(groups["β = 0.1"]) == 6
    rows = length_bins.bin_rows(groups["β = 0.1"], (0.75, 1.25))
    short, even, long = rows
    assert short["posts"] == 1 and short["win_rate"] == 1.0
    assert even["posts"] == 3 and even["win_rate"] == pytest.approx(1.5 / 3)
    # ranks in the even bin: policy 2, 2, 1 against SFT's 1, 2, 4
    assert even["mrr"] == pytest.approx((1 / 2 + 1 / 2 + 1) / 3)
    assert even["ref_mrr"] == pytest.approx((1 + 1 / 2 + 1 / 4) / 3)
    assert long["posts"] == 2 and long["win_rate"] == pytest.approx(0.5)
    low, high = long["wilson"]
    assert 0 < low < 0.5 < high < 1
    # The command end to end: two run folders and a kept summary.json
    for name, results in (("a", seed0), ("b", seed1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    (tmp_path / "summary.json").write_text(json.dumps(other))
    out = tmp_path / "bins.json"
    length_bins.main([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "summary.json"),
                      "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["edges"] == [0.75, 1.25]
    assert [row["posts"] for row in saved["groups"]["β = 0.1"]] == [1, 3, 2]
    assert saved["groups"]["β = 0.1"][1]["runs"] == 2


def test_length_bins_refuse_a_run_with_no_lengths(tmp_path):
    results = run(0.1, 0, [(6, True, 1.0, 0.0, 1, 2)] * 3)
    del results["final"]["human_samples"][0]["length"]
    (tmp_path / "results.json").write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="length"):
        length_bins.main([str(tmp_path), "--out", str(tmp_path / "bins.json")])


# ------------------------------------------------------------------ the commands, tiny

@pytest.mark.slow
def test_concentration_command_on_the_tiny_preset(small_data, tmp_path, capsys):
    from tools.analysis import concentration as command
    out = tmp_path / "sub" / "concentration.json"
    command.main(["--preset", "tiny", "--data-dir", str(small_data), "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["posts"] == 4 and saved["vocabulary"] == 49152 and saved["top"] == 16
    # The tiny model is random and near uniform: top-1 well under 1%, H / log V near 1.
    after = saved["after_first"]
    assert 0 < after["top1"] < 0.01 and 0.9 < after["entropy"] <= 1
    assert after["top1"] <= after["top16"] <= 16 * after["top1"]
    positions = saved["by_position"]
    assert positions["position"][0] == 1 and positions["posts"][0] == 4
    assert "| after the first |" in capsys.readouterr().out


@pytest.mark.slow
def test_optimum_command_on_the_tiny_preset(small_data, tiny_judge, tmp_path, capsys):
    from tools.analysis import optimum as command
    out = tmp_path / "optimum.json"
    command.main(["--preset", "tiny", "--data-dir", str(small_data), "--reward-model",
                  str(tiny_judge), "--samples", "3", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [row["n"] for row in saved["best_of_n"]] == [1, 2, 3]
    assert [row["beta"] for row in saved["optimum"]] == [0, 0.01, 0.1, 0.5, 2.0]
    assert len(saved["per_post"]) == 4 and all(len(p["reward"]) == 3 for p in saved["per_post"])
    # best of 1 is the plain mean of the samples; best of 3 the mean of each post's best
    rewards = [p["reward"] for p in saved["per_post"]]
    assert saved["best_of_n"][0]["reward"] == pytest.approx(sum(map(sum, rewards)) / 12)
    assert saved["best_of_n"][2]["reward"] == pytest.approx(sum(map(max, rewards)) / 4)
    assert saved["kl_cap"] == pytest.approx(math.log(3))
    assert "| best of 3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        command.main(["--preset", "tiny", "--reward-model", str(tmp_path / "none")])
