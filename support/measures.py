"""The held-out evaluation's statistics: pure functions on the samples of `heldout.rollouts`.

The post reports one number per run, the mean reward on held-out posts. With 32 or 64
posts that mean has a standard error of the same size as the gains between settings,
so each run also reports:

    reward_se        s / sqrt(n),  s^2 = 1/(n-1) sum_i (r_i - mean r)^2   (the sample SD)
    gain_over_ref    mean_i d_i,  d_i = r_policy,i - r_ref,i, on the same post i
    gain_over_ref_se sd(d) / sqrt(n): a paired comparison, so the variation from post to
                     post (some posts are easy to summarise) cancels
    eos_fraction     the share of samples that ended with an EOS rather than running
                     into the MAX_NEW_TOKENS limit (a reward that pays for length
                     shows up here first)
    copied_bigrams   the share of a summary's token bigrams that occur in its post:
                     how much of it is copied rather than written
    distinct_2       distinct bigrams over all bigrams of the samples (diversity)

What the samples look like (report.sweep_samples, from results.json's texts):
    question_fraction  the share of summaries that end in "?": a judge that pays for the
                       form of a TL;DR can be gamed with question-shaped text
    median_sample      the sample of median reward, a typical one rather than the best

Across the runs of a sweep (report.report_sweep):
    spearman         Spearman's rank correlation, e.g. of beta with the final KL: the
                     Pearson correlation of the ranks, tied values sharing their mean rank

How concentrated a model's next-token distribution is (tools/analysis/concentration.py; the
reference note 004 explains the fall of reward with GAE's lambda by it):
    concentration    per response position, pi(top token), the sum of the top 16 and the
                     normalised entropy H / log V; post_means averages each over a post

By the length of a summary against the person's TL;DR (tools/analysis/length_bins.py):
    length_bin       which of the bins cut at `edges` a length ratio falls in
    win_rate         the share of posts where the policy's reward beats the reference's,
                     ties counting one half

Nothing here runs a model: `heldout.rollouts` samples and scores, these functions count.

Used by: heldout.py, report.py, tools/analysis/concentration.py, tools/analysis/length_bins.py.
Test: pytest tests/test_ppo.py -k "eos or bigram or gain or summarize or spearman or question"
      pytest tests/test_analysis_tools.py -k "concentration or bin or win"
"""

import math

import torch

from gae import ended_with_eos  # noqa: F401  (the EOS test, kept with the masks)
from support.quality import ends_with_question


def copied_bigrams(summary_ids, prompt_ids):
    """Fraction of the summary's token-id bigrams (counted with repeats) that also occur
    as a bigram in the prompt; 0.0 for a summary of fewer than 2 tokens.

    Both are lists of ids with no padding. heldout.rollouts passes the summary without its
    final EOS, so that a summary which ends is not counted as less copied.
    """
    pairs = list(zip(summary_ids, summary_ids[1:]))
    if not pairs:
        return 0.0
    in_prompt = set(zip(prompt_ids, prompt_ids[1:]))
    return sum(pair in in_prompt for pair in pairs) / len(pairs)


def standard_error(values):
    """s / sqrt(n) with the sample SD s (n - 1 in its denominator); NaN for n < 2."""
    n = len(values)
    if n < 2:
        return math.nan
    return torch.tensor(values, dtype=torch.float64).std(correction=1).item() / math.sqrt(n)


def distinct_2(samples):
    """Distinct bigrams over all bigrams of token ids (diversity; 1.0 = no repeats)."""
    bigrams = [tuple(s["ids"][i:i + 2]) for s in samples for i in range(len(s["ids"]) - 1)]
    return len(set(bigrams)) / max(len(bigrams), 1)


def summarize(samples):
    """One run's held-out numbers: means over the samples, reward_se and distinct-2. Samples
    no judge scored (reward None: sft.py's rows without one) give reward None, no reward_se."""
    mean = lambda key: sum(s[key] for s in samples) / len(samples)  # noqa: E731
    judged = samples[0]["reward"] is not None
    return {**({"reward": mean("reward"),
                "reward_se": standard_error([s["reward"] for s in samples])}
               if judged else {"reward": None}),
            "fluency": mean("fluency"), "kl": mean("kl"), "length": mean("length"),
            "eos_fraction": mean("eos"), "copied_bigrams": mean("copied_bigrams"),
            "distinct_2": distinct_2(samples)}


def per_post(samples, keys, ref_samples=None):
    """results.json's per-sample rows, [{"post": i, "reward", ("ref_reward",) *keys}], i the
    post's index in the held-out list and ref_reward the reference's reward on that post."""
    if ref_samples is not None and len(ref_samples) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(ref_samples)} reference samples")
    rows = []
    for i, s in enumerate(samples):
        row = {"post": i, "reward": s["reward"]}
        if ref_samples is not None:
            row["ref_reward"] = ref_samples[i]["reward"]
        rows.append({**row, **{k: s[k] for k in keys}})
    return rows


def question_fraction(texts):
    """The share of `texts` whose last non-blank character is '?' (0.0 for no texts)."""
    return sum(map(ends_with_question, texts)) / max(len(texts), 1)


def median_sample(samples):
    """The sample of median reward; of an even count, the lower of the middle two."""
    ranked = sorted(samples, key=lambda s: s["reward"])
    return ranked[(len(ranked) - 1) // 2]


def ranks(values):
    """Ranks 1..n of `values`, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out, i = [0.0] * len(values), 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            out[k] = (i + j) / 2 + 1                       # the mean of ranks i+1 .. j+1
        i = j + 1
    return out


def spearman(x, y):
    """rho = Pearson correlation of ranks(x) and ranks(y); NaN when either is constant."""
    rx = torch.tensor(ranks(x), dtype=torch.float64)
    ry = torch.tensor(ranks(y), dtype=torch.float64)
    dx, dy = rx - rx.mean(), ry - ry.mean()
    denominator = (dx.square().sum() * dy.square().sum()).sqrt()
    return (dx * dy).sum().item() / denominator.item() if denominator > 0 else math.nan


# ---------------------------------------------- the next-token distribution's concentration

def concentration(logits, mask, top=16):
    """How much of the next-token distribution pi(. | s_t) sits on a few tokens.

    logits (B, T, V) at the response positions (the model's, temperature 1); mask (B, T), 1
    at the positions to measure. Returns three (B, T) fp32 tensors, 0 where mask is 0: the
    probability of the top token, the total of the top `top`, and H / log V, the entropy
    over its largest value (1: uniform over the vocabulary, 0: one token certain).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)                    # (B, T, V)
    p = logp.exp()                                                      # (B, T, V)
    # top-1 = max_a pi(a | s_t),   top-k = sum of the k largest pi(a | s_t)
    largest = p.topk(min(top, p.shape[-1]), dim=-1).values              # (B, T, top)
    top1, topk = largest[..., 0], largest.sum(-1)                       # (B, T) each
    # H(s_t) = - sum_a pi(a | s_t) log pi(a | s_t)     (0 log 0 = 0)
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1)                # (B, T)
    # normalised entropy = H / log V
    normalised = entropy / math.log(p.shape[-1])                        # (B, T)
    keep = mask.bool()                                                  # (B, T)
    return tuple(torch.where(keep, x, 0.0) for x in (top1, topk, normalised))


def post_means(values, mask):
    """Each row's mean of `values` (B, T) over the positions where mask (B, T) is 1: (B,),
    NaN for a row with none."""
    # mean_i = sum_t m_it v_it / sum_t m_it
    return (values * mask).sum(-1) / mask.sum(-1)                       # (B,)


# --------------------------------------- by length against the person's TL;DR

def length_bin(ratio, edges):
    """The bin of `ratio` among those cut at `edges` (increasing): 0 for ratio < edges[0],
    i for edges[i-1] <= ratio < edges[i], len(edges) for ratio >= edges[-1]."""
    return sum(ratio >= edge for edge in edges)


def win_rate(rewards, ref_rewards):
    """The share of pairs where the first reward beats the second, an exact tie one half:
    (1/n) sum_i ([r_i > r'_i] + 1/2 [r_i = r'_i]); NaN for no pairs."""
    if len(rewards) != len(ref_rewards):
        raise ValueError(f"{len(rewards)} rewards but {len(ref_rewards)} reference rewards")
    if not rewards:
        return math.nan
    # win = 1/n sum_i ([r_i > r'_i] + 1/2 [r_i = r'_i])
    return sum((r > q) + 0.5 * (r == q) for r, q in zip(rewards, ref_rewards)) / len(rewards)
