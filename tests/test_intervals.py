"""The one rule for a paired gain (support/intervals.py): Student's t, the two-way table by
hand, and the interval's coverage on simulated runs with known seed and post variances."""
import math

import pytest
import torch

from support.intervals import (SeedVariance, crossed_variance, mean_squares, moved,
                               paired_interval, seed_variance, seeds_to_resolve, t_cdf,
                               t_quantile, verdict)


def test_t_quantiles_match_the_printed_tables():
    # Student's t tables (e.g. Abramowitz & Stegun 26.10): 97.5% points
    for df, q in ((1, 12.7062), (2, 4.30265), (5, 2.57058), (10, 2.22814), (63, 1.99834),
                  (1e6, 1.95996)):
        assert t_quantile(0.975, df).item() == pytest.approx(q, abs=2e-4)
    assert t_cdf(0.0, 3).item() == pytest.approx(0.5)
    assert t_cdf(-2.0, 7).item() == pytest.approx(1 - t_cdf(2.0, 7).item())


def test_mean_squares_by_hand():
    d = torch.tensor([[1.0, 2.0, 6.0], [3.0, 4.0, 8.0]], dtype=torch.float64)
    # grand 4; seed means 3, 5; post means 2, 3, 7; residuals all 0
    ms_seed, ms_post, ms_rest = mean_squares(d)
    assert ms_seed.item() == pytest.approx(3 * (1 + 1) / 1)
    assert ms_post.item() == pytest.approx(2 * (4 + 1 + 9) / 2)
    assert ms_rest.item() == pytest.approx(0.0)
    v, nu, s2_seed, s2_post, s2_rest = crossed_variance(d)
    assert v.item() == pytest.approx((6 + 14 - 0) / 6)                 # (V2)
    assert nu.item() == pytest.approx(20 ** 2 / (6 ** 2 / 1 + 14 ** 2 / 2))  # (V3)
    assert s2_seed.item() == pytest.approx(2.0) and s2_post.item() == pytest.approx(7.0)


def simulate(reps, S, n, sd_seed, sd_post, sd_rest, mu=0.3, generator=None):
    a = torch.randn(reps, S, 1, generator=generator, dtype=torch.float64) * sd_seed
    b = torch.randn(reps, 1, n, generator=generator, dtype=torch.float64) * sd_post
    e = torch.randn(reps, S, n, generator=generator, dtype=torch.float64) * sd_rest
    return mu + a + b + e                                                # (reps, S, n)


def coverage_of_the_rule(d, mu=0.3):
    S, n = d.shape[-2:]
    v, nu, *_ = crossed_variance(d)
    half = t_quantile(0.975, nu) * v.sqrt()
    return ((d.mean((-2, -1)) - mu).abs() <= half).double().mean().item()


def coverage_of_the_larger_se(d, mu=0.3):
    S, n = d.shape[-2:]
    over_seeds = d.mean(-1).std(-1, correction=1) / math.sqrt(S)
    over_posts = d.mean(-2).std(-1, correction=1) / math.sqrt(n)
    half = 2 * torch.maximum(over_seeds, over_posts)
    return ((d.mean((-2, -1)) - mu).abs() <= half).double().mean().item()


# (SD over seeds, SD over posts, SD of the rest) in judge units. The kept runs' gains on the
# judge have a rest near 1.2 and seeds from 0 (most settings) to 0.5 (lambda = 0): the rest
# alone, the seeds dominant, the posts dominant, and mixes
SETTINGS = [(0.0, 0.0, 1.2), (0.5, 0.0, 1.5), (0.15, 0.3, 0.6), (0.02, 0.6, 0.5),
            (0.1, 0.05, 0.8)]


@pytest.mark.parametrize("S", [3, 6])
@pytest.mark.parametrize("sds", SETTINGS)
def test_the_interval_covers_the_true_gain_95_percent_of_the_time(S, sds):
    g = torch.Generator().manual_seed(1000 * S + SETTINGS.index(sds))
    d = simulate(3000, S, 64, *sds, generator=g)
    assert 0.93 <= coverage_of_the_rule(d) <= 0.97


def test_the_larger_of_two_ses_under_covers_where_the_seeds_dominate():
    # the rule this module replaced: with three seeds its 2 SE is a t on 2 df read as normal
    g = torch.Generator().manual_seed(7)
    d = simulate(2000, 3, 64, *SETTINGS[1], generator=g)
    assert coverage_of_the_larger_se(d) < 0.93 <= coverage_of_the_rule(d)


def test_paired_interval_pairs_by_seed_and_post_and_reads_the_common_seeds():
    values = {0: [1.0, 2.0, 6.0], 1: [3.0, 4.0, 8.0], 2: [9.0, 9.0, 9.0]}
    base = {0: [0.0, 0.0, 0.0], 1: [0.0, 0.0, 0.0]}
    i = paired_interval(values, base)
    assert (i.seeds, i.posts, i.gain) == (2, 3, pytest.approx(4.0))
    assert i.se == pytest.approx(math.sqrt(20 / 6))
    assert i.low < i.gain < i.high and i.seeds_counted
    with pytest.raises(ValueError, match="no seed in common"):
        paired_interval({0: [1.0]}, {1: [1.0]})


def test_one_seed_counts_the_seed_noise_only_through_a_pooled_variance():
    values, base = {0: [1.0, 1.5, 2.0, 2.5]}, {0: [0.0, 0.0, 0.0, 0.0]}
    alone = paired_interval(values, base)
    assert not alone.seeds_counted and verdict(alone, +1) == "not resolved"
    assert alone.se == pytest.approx(math.sqrt(torch.tensor([1.0, 1.5, 2.0, 2.5]).var().item() / 4))
    pooled = paired_interval(values, base, pooled=SeedVariance(0.5, 4.0))
    assert pooled.seeds_counted and pooled.se == pytest.approx(math.sqrt(alone.se ** 2 + 0.5))
    assert pooled.high - pooled.low > alone.high - alone.low


def test_seed_variance_pools_by_degrees_of_freedom_and_skips_one_seed_tables():
    g = torch.Generator().manual_seed(3)
    three = simulate(1, 3, 64, 0.3, 0.2, 0.2, generator=g)[0]
    six = simulate(1, 6, 64, 0.3, 0.2, 0.2, generator=g)[0]
    pooled = seed_variance([three, six, six[:1]])
    s2 = [crossed_variance(x)[2].item() for x in (three, six)]
    assert pooled.df == 2 + 5
    assert pooled.s2 == pytest.approx((2 * s2[0] + 5 * s2[1]) / 7)
    assert seed_variance([six[:1]]) is None


def test_the_verdict_follows_from_the_interval_alone():
    g = torch.Generator().manual_seed(11)
    up = paired_interval(*as_runs(simulate(1, 3, 64, 0.01, 0.1, 0.1, mu=1.0, generator=g)[0]))
    flat = paired_interval(*as_runs(simulate(1, 3, 64, 0.3, 0.3, 0.3, mu=0.0, generator=g)[0]))
    assert (verdict(up, +1), verdict(up, -1), moved(up)) == ("holds", "does not hold", 1)
    assert (verdict(flat, +1), moved(flat)) == ("not resolved", 0)


def test_seeds_to_resolve_grows_as_the_gain_shrinks_and_stops_at_the_posts():
    g = torch.Generator().manual_seed(5)
    d = simulate(1, 3, 64, 0.2, 0.2, 0.5, mu=0.0, generator=g)[0]
    i = paired_interval(*as_runs(d))
    big, small = i._replace(gain=0.6), i._replace(gain=0.15)
    assert seeds_to_resolve(big) <= seeds_to_resolve(small)
    # the posts' part alone (s2_post / n) is wider than the gain: no number of seeds will do
    assert seeds_to_resolve(i._replace(gain=0.01, s2_seed=0.0)) is None
    # a gain the interval already excludes zero at needs no more seeds than it has
    assert seeds_to_resolve(i._replace(gain=3.0)) <= 3


def as_runs(d):
    """A (S, n) table as ({seed: values}, {seed: zeros}) for paired_interval."""
    return ({s: d[s].tolist() for s in range(d.shape[0])},
            {s: [0.0] * d.shape[1] for s in range(d.shape[0])})
