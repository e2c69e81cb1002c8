"""The one rule every page uses to compare two settings: an interval for a paired gain that
counts both sources of noise, the training seed and the held-out post.

A gain is read on S seeds and the same n held-out posts, paired by seed and post:

    d_si = x_si - y_si          (setting minus baseline, seed s, post i)

and modelled as crossed random effects, a seed's luck and a post's difficulty apart:

    d_si = mu + a_s + b_i + e_si,   a_s ~ (0, s2_seed), b_i ~ (0, s2_post), e_si ~ (0, s2_rest)

The gain is the grand mean; its variance over new seeds and new posts is

    Var(mean d) = s2_seed / S + s2_post / n + s2_rest / (S n)                        (V1)

The three are read off the two-way table by the method of moments (ANOVA with one value a
cell):

    MS_seed = n/(S-1) sum_s (dbar_s. - dbar)^2          E = n s2_seed + s2_rest
    MS_post = S/(n-1) sum_i (dbar_.i - dbar)^2          E = S s2_post + s2_rest
    MS_rest = sum_si (d_si - dbar_s. - dbar_.i + dbar)^2 / ((S-1)(n-1))    E = s2_rest

so (V1) is estimated by

    V = (MS_seed + max(MS_post - MS_rest, 0)) / (S n)                                  (V2)

and the interval is mean d ± t_{q, nu} sqrt(V), nu by Satterthwaite's approximation

    nu = (S n V)^2 / (MS_seed^2/(S-1) + MS_post^2/(n-1) + MS_rest^2/((S-1)(n-1)))      (V3)

FLOOR: MS_post - MS_rest estimates S s2_post and is added only where positive (else nu is
MS_seed's own S - 1); MS_seed, an unbiased estimate of n s2_seed + s2_rest, always stays. With
three seeds nu is near 2 where the seeds or the rest dominate, and t_{0.975, 2} = 4.30, not
2. On simulated runs with the page's own mixes of seed, post and other noise, this interval
covers the true gain 93-97% of the time at 3 and at 6 seeds; the rule it replaced ("the
larger of the SE over seeds and over posts, 2 SE") covers it 81-89% where the seeds dominate
(tests/test_intervals.py).

One seed carries no seed variance; `seed_variance` reads s2_seed off other comparisons of the
same measure with several seeds (pooled, with its degrees of freedom), and `paired_interval`
adds it in. Without one, the interval counts the posts only and says so (`seeds_counted`).

The verdict follows from the interval alone (`verdict`), and `seeds_to_resolve` says how many
seeds would make an interval of the measured variances exclude zero at the measured gain.

Used by: tools/analysis/claims_page.py and the other page makers. Test: pytest tests/test_intervals.py
"""

import math
from typing import NamedTuple

import torch

LEVEL = 0.95


class Interval(NamedTuple):
    gain: float            # mean_s mean_i d_si
    se: float              # sqrt(V)
    df: float              # nu of (V3)
    low: float
    high: float
    seeds: int             # S
    posts: int             # n
    seeds_counted: bool    # False: one seed and no pooled seed variance
    s2_seed: float         # the components of (V1), for `seeds_to_resolve`
    s2_post: float
    s2_rest: float


class SeedVariance(NamedTuple):
    s2: float              # pooled estimate of s2_seed
    df: float              # its degrees of freedom


# ------------------------------------------------------------------------- Student's t

def t_cdf(q, df):
    """P(T <= q) for Student's t with `df` >= 1 degrees of freedom (tensors of one shape).
    With t = sqrt(df) tan(theta) the density f(t) dt becomes c cos^(df-1)(theta) dtheta,
        c = Gamma((df+1)/2) / (sqrt(pi) Gamma(df/2)),
    smooth on [0, pi/2): Simpson's rule from 0 to atan(|q| / sqrt(df))."""
    q, df = torch.broadcast_tensors(torch.as_tensor(q, dtype=torch.float64),
                                    torch.as_tensor(df, dtype=torch.float64))
    return 0.5 + torch.sign(q) * _area(torch.atan(q.abs() / df.sqrt()), df)


def _area(theta, df, steps=256):
    """c int_0^theta cos^(df-1)(u) du, by Simpson's rule (`steps` even); tensors of one shape."""
    u = theta.unsqueeze(-1) * torch.linspace(0, 1, steps + 1, dtype=torch.float64)
    nu = df.unsqueeze(-1)
    log_c = torch.lgamma((nu + 1) / 2) - torch.lgamma(nu / 2) - 0.5 * math.log(math.pi)
    integrand = torch.exp(log_c + (nu - 1) * torch.log(torch.cos(u).clamp(min=1e-300)))
    weights = torch.ones(steps + 1, dtype=torch.float64)
    weights[1:-1:2], weights[2:-1:2] = 4, 2
    return (integrand * weights).sum(-1) * theta / (3 * steps)


def t_quantile(p, df):
    """The q with P(T <= q) = p (0.5 <= p <= 0.99), df >= 1: bisection for the theta of `t_cdf`
    whose area is p - 1/2, then q = sqrt(df) tan(theta); p <= 0.99; tensors allowed."""
    p, df = torch.broadcast_tensors(torch.as_tensor(p, dtype=torch.float64),
                                    torch.as_tensor(df, dtype=torch.float64))
    # theta up to atan(64 / sqrt(df)): q <= 64 holds every p <= 0.99 (t_{0.99, 1} = 31.8)
    low, high = torch.zeros_like(p), torch.atan(64 / df.sqrt())
    for _ in range(48):
        mid = (low + high) / 2
        below = _area(mid, df) < p - 0.5
        low, high = torch.where(below, mid, low), torch.where(below, high, mid)
    return df.sqrt() * torch.tan((low + high) / 2)


# ------------------------------------------------------------------ the two-way table

def mean_squares(d):
    """MS_seed, MS_post, MS_rest of a (..., S, n) table of paired differences (S >= 2)."""
    S, n = d.shape[-2:]
    grand = d.mean((-2, -1), keepdim=True)                           # (..., 1, 1)
    by_seed = d.mean(-1, keepdim=True)                               # (..., S, 1)
    by_post = d.mean(-2, keepdim=True)                               # (..., 1, n)
    ms_seed = n * ((by_seed - grand) ** 2).sum((-2, -1)) / (S - 1)
    ms_post = S * ((by_post - grand) ** 2).sum((-2, -1)) / (n - 1)
    rest = d - by_seed - by_post + grand
    ms_rest = (rest ** 2).sum((-2, -1)) / ((S - 1) * (n - 1))
    return ms_seed, ms_post, ms_rest


def crossed_variance(d):
    """(V, nu, s2_seed, s2_post, s2_rest) of (V2) and (V3) for a (..., S, n) table, S >= 2.
    MS_post - MS_rest (S s2_post) enters V only where it is positive (`FLOOR` above)."""
    S, n = d.shape[-2:]
    ms_seed, ms_post, ms_rest = mean_squares(d)
    posts_vary = ms_post > ms_rest
    # S n V = MS_seed + max(MS_post - MS_rest, 0)                                     (V2)
    total = ms_seed + (ms_post - ms_rest).clamp(min=0)
    # nu = total^2 / (MS_seed^2/(S-1) + MS_post^2/(n-1) + MS_rest^2/((S-1)(n-1)))     (V3)
    nu = total ** 2 / (ms_seed ** 2 / (S - 1) + ms_post ** 2 / (n - 1)
                       + ms_rest ** 2 / ((S - 1) * (n - 1)))
    nu = torch.where(posts_vary, nu, torch.full_like(nu, S - 1.0)).clamp(min=1)
    s2_seed = ((ms_seed - ms_rest) / n).clamp(min=0)
    s2_post = ((ms_post - ms_rest) / S).clamp(min=0)
    return total / (S * n), nu, s2_seed, s2_post, ms_rest


def table(values, base):
    """The (S, n) float64 table d_si of two settings' {seed: [x_i per post]}, on the seeds
    both have (sorted), paired by post."""
    seeds = sorted(set(values) & set(base))
    if not seeds:
        raise ValueError("no seed in common: nothing to pair")
    return torch.tensor([[x - y for x, y in zip(values[s], base[s], strict=True)]
                         for s in seeds], dtype=torch.float64)


def seed_variance(tables):
    """The seed component s2_seed pooled over several (S, n) tables of one measure (each
    S >= 2), weighted by their degrees of freedom S - 1: for comparisons run on one seed."""
    tables = [d for d in tables if d.shape[0] >= 2]
    if not tables:
        return None
    dfs = [d.shape[0] - 1 for d in tables]
    s2 = [crossed_variance(d)[2].item() for d in tables]
    return SeedVariance(sum(w * v for w, v in zip(dfs, s2)) / sum(dfs), float(sum(dfs)))


def paired_interval(values, base, pooled=None, level=LEVEL):
    """The gain of one setting over another and its `level` interval by (V1)-(V3).
    values, base: {seed: [x_i for each post i]}, paired by seed and post on the seeds both
    have; pooled: a `SeedVariance` for the seed noise of a one-seed comparison."""
    d = table(values, base)                                          # (S, n)
    S, n = d.shape
    gain = d.mean().item()
    if S >= 2:
        v, nu, s2_seed, s2_post, s2_rest = (x.item() for x in crossed_variance(d))
        counted = True
    else:
        # one seed: Var = s2_seed (pooled) + var_i(d_i) / n, nu by Satterthwaite of the two;
        # var_i(d_i) holds the posts' and the rest's noise together (kept as s2_post)
        posts_part = d[0].var(correction=1).item() / n
        s2_seed = pooled.s2 if pooled else 0.0
        v = s2_seed + posts_part
        parts = [(posts_part, n - 1)] + ([(s2_seed, pooled.df)] if pooled else [])
        nu = max(1.0, v ** 2 / sum(x ** 2 / k for x, k in parts if x > 0)) if v > 0 else n - 1
        s2_post, s2_rest, counted = posts_part * n, 0.0, pooled is not None
    se = math.sqrt(v)
    half = t_quantile(0.5 + level / 2, nu).item() * se
    return Interval(gain, se, nu, gain - half, gain + half, S, n, counted, s2_seed, s2_post,
                    s2_rest)


# --------------------------------------------------------------------------- the words

def verdict(interval, direction):
    """'holds', 'does not hold' or 'not resolved' for a claim that the gain has the sign of
    `direction` (+1: the setting raises the measure, -1: lowers it), from the interval alone.
    One seed with no pooled seed variance decides nothing."""
    if not interval.seeds_counted:
        return "not resolved"
    if interval.low > 0 or interval.high < 0:
        return "holds" if (interval.low > 0) == (direction > 0) else "does not hold"
    return "not resolved"


def moved(interval):
    """+1 or -1 where the interval lies wholly above or below zero, else 0."""
    return 1 if interval.low > 0 else -1 if interval.high < 0 else 0


def seeds_to_resolve(interval, level=LEVEL, most=100):
    """The fewest seeds S at which an interval with this comparison's variance components
    ((V1) with S seeds, nu from (V3) at the expected mean squares) would exclude zero at the
    measured gain; None if not by `most` seeds (the posts' share alone is too wide)."""
    n, gain = interval.posts, abs(interval.gain)
    a, b, e = interval.s2_seed, interval.s2_post, interval.s2_rest
    for S in range(2, most + 1):
        ms_seed, ms_post, ms_rest = n * a + e, S * b + e, e
        total = ms_seed + ms_post - ms_rest
        nu = (total ** 2 / (ms_seed ** 2 / (S - 1) + ms_post ** 2 / (n - 1)
                            + ms_rest ** 2 / ((S - 1) * (n - 1)))) if b > 0 else S - 1
        if t_quantile(0.5 + level / 2, max(nu, 1.0)).item() * math.sqrt(total / (S * n)) < gain:
            return S
    return None
