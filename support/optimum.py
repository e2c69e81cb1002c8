"""What PPO could reach at most: the KL-regularised optimum and best-of-n, from k samples.

PPO maximises E[r] - beta KL(pi || pi_ref). That objective has a closed-form maximiser
(Ziegler et al. 2019, arXiv:1909.08593, as the reference note 004 reads it; Rafailov et al.
2023, arXiv:2305.18290, eq. 4):

    (O1)  pi*(y|x) = pi_ref(y|x) e^{r(x,y)/beta} / Z(x),   Z(x) = E_{y~pi_ref}[e^{r/beta}]

which a finite policy can only approach. Given k summaries y_1..y_k of a post x drawn from
the reference (the SFT model) and the judge's score r_i of each, importance sampling reads
pi* off them with no training:

    (O2)  w_i = e^{r_i/beta} / sum_j e^{r_j/beta}          the self-normalised weights
    (O3)  E*[r] = sum_i w_i r_i                             the optimum's expected reward
    (O4)  log Z ~ log (1/k sum_j e^{r_j/beta})              logsumexp(r/beta) - log k
    (O5)  KL(pi* || pi_ref) = E*[r]/beta - log Z            (log pi*/pi_ref = r/beta - log Z)

and any other measure m of a summary (ROUGE-L, the reciprocal rank of its post) the same
way, E*[m] = sum_i w_i m_i. beta = 0 is the limit: all weight on the best of the k.

Best-of-n (Stiennon et al. 2020, arXiv:2009.01325; Gao et al. 2022, arXiv:2210.10760):
draw n from the reference and keep the judge's favourite. With
the k scores sorted, r_(1) <= ... <= r_(k), the expected score of the best of n drawn
without replacement from the k is exact, each n-subset counted once:

    (B1)  E[max of n] = sum_{i=n}^{k} C(i-1, n-1) / C(k, n) r_(i)

(r_(i) is the best of a subset when the other n-1 come from the i-1 below it), an unbiased
estimate of best-of-n under the reference; the same weights on the i-th sample's ROUGE-L
or reciprocal rank give the chosen summary's. Its KL to the reference, for a continuous
score, is the formula Gao et al. use, an upper bound on the true KL (Beirami et al. 2024,
arXiv:2401.01879):

    (B2)  KL(best-of-n || pi_ref) = log n - (n-1)/n

Limits of k samples, said where the numbers are shown: (O5)'s estimate of the KL is
sum_i w_i log(k w_i) <= log k (all weight on one sample), so at small beta the optimum's KL
and reward are those of best-of-k at most: k = 16 caps the KL at log 16 = 2.77 nats. The
effective sample size 1 / sum_i w_i^2 says how many samples carry the weight.

Nothing here runs a model: tools/analysis/optimum.py samples and scores, these functions weigh.
Test: pytest tests/test_analysis_tools.py -k "optimum or best_of"
"""
import math

import torch

from support.measures import standard_error


def optimum_weights(r, beta):
    """(O2): the self-normalised weights w (k,) float64 of k samples with scores r (k,);
    beta = 0: the limit, uniform over the samples of the highest score."""
    r = torch.as_tensor(r, dtype=torch.float64)                        # (k,)
    if beta == 0:
        best = (r == r.max()).double()                                 # (k,)
        return best / best.sum()
    # (O2)  w_i = e^{r_i/beta} / sum_j e^{r_j/beta}
    return torch.softmax(r / beta, dim=0)                              # (k,)


def optimum_point(r, beta):
    """(E*[r], KL(pi* || pi_ref), w) of one post from its k scores r (k,): (O3)-(O5)."""
    r = torch.as_tensor(r, dtype=torch.float64)                        # (k,)
    k, w = len(r), optimum_weights(r, beta)                            # (k,)
    # (O3)  E*[r] = sum_i w_i r_i
    expected = (w * r).sum().item()
    if beta == 0:
        # beta -> 0: w uniform on the m best, KL = sum_i w_i log(k w_i) = log(k / m)
        return expected, math.log(k / (w > 0).sum().item()), w
    # (O4)  log Z = log (1/k sum_j e^{r_j/beta})
    log_z = (torch.logsumexp(r / beta, dim=0) - math.log(k)).item()
    # (O5)  KL = E*[r]/beta - log Z
    return expected, expected / beta - log_z, w


def best_of_n_weights(k, n):
    """(B1): the weight (k,) float64 of the i-th lowest of k scores in the expected best of
    n drawn without replacement from them; 1 <= n <= k."""
    if not 1 <= n <= k:
        raise ValueError(f"best of n needs 1 <= n <= k, got n = {n}, k = {k}")
    # (B1)  weight of r_(i) = C(i-1, n-1) / C(k, n), i = 1..k (0 for i < n)
    return torch.tensor([math.comb(i - 1, n - 1) / math.comb(k, n) for i in range(1, k + 1)],
                        dtype=torch.float64)                           # (k,)


def self_normalised_kl(w):
    """(O5)'s estimate of KL(pi || pi_ref) for any weights w (k,) on k samples of pi_ref:
    sum_i w_i log(k w_i), 0 log 0 = 0; at most log k. The optimum's KL, and best-of-n's on
    the same basis with (B1)'s weights (docs/claims.md puts the two on one basis so)."""
    w = torch.as_tensor(w, dtype=torch.float64)                        # (k,)
    kept = w[w > 0]
    # KL ~ sum_i w_i log(k w_i)
    return (kept * torch.log(len(w) * kept)).sum().item()


def best_of_n_kl(n):
    """(B2): KL(best-of-n || pi_ref) = log n - (n-1)/n, in nats."""
    # (B2)  KL = log n - (n - 1)/n
    return math.log(n) - (n - 1) / n


def by_score(scores, values):
    """`values` (k,) in the order of `scores` (k,), lowest first (ties kept in their order):
    the i-th is the measure of the sample with the i-th lowest score."""
    order = torch.sort(torch.as_tensor(scores, dtype=torch.float64), stable=True).indices
    return torch.as_tensor(values, dtype=torch.float64)[order]         # (k,)


def mean_and_se(values, name):
    """{name: mean over posts, name_se: its standard error over posts}."""
    return {name: sum(values) / len(values), f"{name}_se": standard_error(values)}


def curves(rewards, measures, betas):
    """Both curves from per-post samples, each point's numbers as means over the posts with
    their SE over posts.

    rewards: one list of k scores per post; measures: {"rouge_l": [[k values] per post],
    "retrieval_mrr": [[1 / rank] per post]}, the same samples in the same order (the names
    of results.json and tables.MEASURES); betas: the sweep's.
    Returns {"optimum": [{beta, reward, kl, ess, *measures} each with _se],
             "best_of_n": [{n, kl, reward, *measures}] for n = 1..k}.
    """
    k = len(rewards[0])
    if any(len(r) != k for r in rewards):
        raise ValueError("every post needs the same number of samples")
    optimum = []
    for beta in betas:
        points = [optimum_point(r, beta) for r in rewards]             # per post
        row = {"beta": beta, **mean_and_se([e for e, _, _ in points], "reward"),
               **mean_and_se([kl for _, kl, _ in points], "kl"),
               # effective sample size = 1 / sum_i w_i^2
               **mean_and_se([1 / w.square().sum().item() for _, _, w in points], "ess")}
        for name, per_post in measures.items():
            row.update(mean_and_se([(w * torch.as_tensor(m, dtype=torch.float64)).sum().item()
                                    for (_, _, w), m in zip(points, per_post)], name))
        optimum.append(row)
    best = []
    for n in range(1, k + 1):
        weights = best_of_n_weights(k, n)                              # (k,)
        row = {"n": n, "kl": best_of_n_kl(n),
               **mean_and_se([(weights * by_score(r, r)).sum().item() for r in rewards],
                             "reward")}
        for name, per_post in measures.items():
            row.update(mean_and_se([(weights * by_score(r, m)).sum().item()
                                    for r, m in zip(rewards, per_post)], name))
        best.append(row)
    return {"optimum": optimum, "best_of_n": best}
