"""What reward_model.py measures and prints: held-out accuracy, length, relevance.

Pure functions of scores (tensors) and counts, or of a scoring function passed in; nothing
here builds or trains a model. The equation numbers are reward_model.py's:
    pairwise_accuracy, wilson_interval (R4)    how often a score ranks a pair as people did,
                                               and its Wilson 95% interval
    pair_metrics        accuracy, accuracy where people chose the shorter summary, the
                        score-length correlation, accuracy by length difference
    human_minus_reference_sd    people's TL;DRs above SmolLM2's samples, in sample SDs
    reserve_ids, relevance_rows, relevance, relevance_sets, relevance_metrics
                        departure 9's test, on posts never trained on: does the judge
                        read the post?
    tfidf_score         the same test's yardstick: word overlap with the post, no training
    post_openings, lead_test    does the judge pay for copying? people's TL;DR against
                        the post's own opening words, cut to the same length
    collect_metrics, print_summary, verdict, plot    metrics.json, the printed summary,
                        loss.png and margins.png
Test: pytest tests/test_reward_model.py
"""
import functools
import math

import torch

import loaders
from support.quality import cosine, idf_weights, tfidf_vector
from support.rm_data import cut_to_shorter, length_neighbours, off_post_pairs


def pairwise_accuracy(r_w, r_l):
    """Fraction of comparisons ranked right; an exact tie counts one half. Counted on the
    CPU: Apple's MPS has no float64."""
    r_w, r_l = r_w.cpu(), r_l.cpu()
    return ((r_w > r_l).double() + 0.5 * (r_w == r_l).double()).mean().item()


def wilson_interval(accuracy, n, z=1.96):
    """(low, high): the Wilson score interval of a proportion; z = 1.96 for 95%."""
    if n == 0:
        return 0.0, 1.0
    # (R4)  (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)
    centre = accuracy + z * z / (2 * n)
    spread = z * math.sqrt(accuracy * (1 - accuracy) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n), (centre + spread) / (1 + z * z / n)


# Held-out pairs by how much their two summaries differ in length, in tokens (inclusive).
LENGTH_BINS = (("0-3", 0, 3), ("4-10", 4, 10), (">10", 11, 10 ** 9))



def pair_metrics(r_w, r_l, len_w, len_l):
    """What one score does on held-out pairs. r_w, r_l: (n,) scores; len_w, len_l: (n,) tokens.

    Accuracy and its Wilson interval (R4); accuracy on the pairs where people chose the
    shorter summary (a score that only measures length gets these wrong); the Pearson
    correlation of score and length over all 2n summaries; accuracy by length difference.
    """
    n, nan = len(r_w), float("nan")
    accuracy = pairwise_accuracy(r_w, r_l)
    low, high = wilson_interval(accuracy, n)
    shorter = len_w < len_l                                                 # (n,) bool
    both = torch.stack([torch.cat([r_w, r_l]).cpu().double(),             # float64 on the
                        torch.cat([len_w, len_l]).cpu().double()])          # CPU: (2, 2n)
    out = {"heldout_accuracy": accuracy, "wilson_low": low, "wilson_high": high,
           "shorter_preferred_accuracy": (pairwise_accuracy(r_w[shorter], r_l[shorter])
                                          if shorter.any() else nan),
           "score_length_correlation": torch.corrcoef(both)[0, 1].item(),
           "accuracy_by_length_difference": {}}
    gap = (len_w - len_l).abs()                                             # (n,)
    for name, lo, hi in LENGTH_BINS:
        rows = (gap >= lo) & (gap <= hi)                                    # (n,) bool
        k = int(rows.sum())
        a = pairwise_accuracy(r_w[rows], r_l[rows]) if k else nan
        out["accuracy_by_length_difference"][name] = {
            "pairs": k, "accuracy": a, "wilson": list(wilson_interval(a, k)) if k else [0, 1]}
    return out


def human_minus_reference_sd(human, reference):
    """(mean human score - mean reference-sample score) / SD of the reference samples' scores.

    How many of the reference policy's own spreads separate a person's TL;DR from what
    SmolLM2 writes for the same posts; the SD is the sample SD (n - 1).
    """
    human, reference = (torch.as_tensor(x).cpu().double() for x in (human, reference))
    return ((human.mean() - reference.mean()) / reference.std()).item()



# ------------------------------------------------------------ relevance (departure 9)

def relevance_rows(prompts, summaries, eos, seed):
    """The rows `relevance` scores, as one list: (prompts, summaries, sizes).

    Four kinds, in this order: under post p its own summary and its length neighbour q's,
    both cut to the shorter (`off_post_pairs`: n rows each); then p's uncut summary under p
    and under q (`length_neighbours`: m rows each). sizes = [n, n, m, m]. Every row's
    prompt is one of `prompts`, so a grouped scorer reads each post once for all of them.
    """
    pairs = off_post_pairs(prompts, summaries, list(range(len(prompts))), eos, seed)
    moved = length_neighbours([len(x) for x in summaries], seed)            # [(p, q)]
    rows_p = ([p["prompt"] for p in pairs] * 2 + [prompts[p] for p, _ in moved]
              + [prompts[q] for _, q in moved])
    rows_s = ([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
              + [summaries[p] + [eos] for p, _ in moved] * 2)
    return rows_p, rows_s, [len(pairs), len(pairs), len(moved), len(moved)]


def relevance(score, eos, prompts, summaries, seed):
    """Does the judge read the post? On posts never trained on, two measures:

    accuracy: under post p, p's own summary beats its length neighbour q's, both cut to the
        shorter (content and full agree: g cancels); Wilson 95% interval (R4).
    gap_sd: the same uncut summary under its own post minus under q's post,
        f(x_p, y_p) - f(x_q, y_p), averaged, in SDs of f(x_p, y_p) over the posts; with
        its SE. 0 means the score ignores the post.
    score(prompts, summaries) -> (n,): the judge's content scores of id lists (summaries end
    in `eos`), called once; prompts: [prompt ids]; summaries: [summary ids, no EOS].
    """
    rows_p, rows_s, sizes = relevance_rows(prompts, summaries, eos, seed)
    own, other, home, away = score(rows_p, rows_s).cpu().split(sizes)       # (n,) x2, (m,) x2
    accuracy = pairwise_accuracy(own, other)
    low, high = wilson_interval(accuracy, sizes[0])
    # gap_sd = mean_p (f(x_p, y_p) - f(x_q, y_p)) / SD_p f(x_p, y_p)
    sd = home.double().std().item()
    d = (home - away).double() / sd                                         # (m,)
    return {"accuracy": accuracy, "wilson_low": low, "wilson_high": high, "pairs": sizes[0],
            "gap_sd": d.mean().item(), "gap_sd_se": (d.std() / math.sqrt(len(d))).item(),
            "posts": len(prompts)}


def reserve_ids(tokenizer, reserve, max_summary_tokens):
    """([prompt ids], [human TL;DR ids, no EOS]) of `reserve`: [(fitted prompt, post)]."""
    return ([tokenizer(prompt).input_ids for prompt, _ in reserve],
            [tokenizer(" " + p["summary"]).input_ids[:max_summary_tokens] for _, p in reserve])


def tfidf_score(tokenizer, prompts, summaries):
    """A judge that never trained, for `relevance`'s `score`: (n,) the TF-IDF cosine of each
    summary's words with its post's (support/quality.py; idf fitted on the distinct posts of
    this call). On the judge's own pairs it says how far word overlap alone gets: where it
    does no better than chance, the summaries hardly say which post they are about."""
    posts = {tuple(p): tokenizer.decode(p) for p in prompts}               # prompt -> text
    idf = idf_weights(list(posts.values()))
    vectors = {p: tfidf_vector(text, idf) for p, text in posts.items()}
    # score(x, y) = cos(tfidf(y), tfidf(x)), both unit length: their dot product     (n,)
    return torch.tensor([cosine(tfidf_vector(tokenizer.decode(s, skip_special_tokens=True), idf),
                                vectors[tuple(p)]) for p, s in zip(prompts, summaries)])


def post_openings(tokenizer, prompts):
    """[ids of " " + the POST field of each prompt id list]: the post's own first words, the
    copy a policy could make, taken from the prompt the judge reads."""
    return [tokenizer(" " + loaders.parse_prompt(tokenizer.decode(p))["post"]).input_ids
            for p in prompts]


def lead_test(score, eos, prompts, summaries, openings):
    """Does the judge pay for copying? Under post p, p's human TL;DR against the lead (the
    post's opening words, `post_openings`), both cut to the shorter and ending in EOS, so
    g cancels. Returns the share of posts where the TL;DR wins (a tie counts one half),
    with its Wilson 95% interval (R4). A judge that reads the post but not what a summary
    is for prefers the lead: every word of it is on topic.
    score, prompts, summaries: as `relevance`; openings: [ids], one per prompt."""
    rows = [(p, *pair) for p, s, o in zip(prompts, summaries, openings)
            if (pair := cut_to_shorter(s, o, eos))]             # [(prompt, tldr, lead)]
    n = len(rows)
    tldr, lead = score([p for p, _, _ in rows] * 2,
                       [s for _, s, _ in rows] + [o for _, _, o in rows]).split([n, n])  # (n,) x2
    accuracy = pairwise_accuracy(tldr, lead)
    low, high = wilson_interval(accuracy, n)
    return {"accuracy": accuracy, "wilson_low": low, "wilson_high": high, "pairs": n}


def relevance_sets(score, tokenizer, reserve, encoded, samples, config):
    """`relevance` on three sets of posts never trained on: human TL;DRs of ppo.py's
    evaluation reserve (`reserve`: [(fitted prompt, post)], posts of no training comparison)
    and of this split's held-out posts (`encoded`), and SmolLM2's samples for the latter.
    The two human sets also get `lead_test` (their "lead" key). Each test also runs under
    `tfidf_score` (its "tfidf" key), on the same pairs."""
    sets = {"human_reserve": reserve_ids(tokenizer, reserve, config.max_summary_tokens),
            "human_heldout": ([p for p, _ in encoded], [h[:-1] for _, h in encoded]),
            "samples_heldout": ([p for p, _ in encoded], [ids for ids, _ in samples])}
    words_only = functools.partial(tfidf_score, tokenizer)
    eos, seed, out = tokenizer.eos_token_id, config.seed, {}
    for name, (prompts, summaries) in sets.items():
        if len(prompts) < 3:
            continue
        out[name] = {**relevance(score, eos, prompts, summaries, seed),
                     "tfidf": relevance(words_only, eos, prompts, summaries, seed)}
        if name.startswith("human"):
            openings = post_openings(tokenizer, prompts)
            out[name]["lead"] = {**lead_test(score, eos, prompts, summaries, openings),
                                 "tfidf": lead_test(words_only, eos, prompts, summaries, openings)}
    return out


def relevance_metrics(sets):
    """metrics.json's relevance keys: human TL;DRs on the evaluation reserve, SmolLM2's
    samples on the held-out posts, and the lead test on the former, each with TF-IDF's
    accuracy on the same pairs (NaN where a set was too small)."""
    nan, out = float("nan"), {}
    human = sets.get("human_reserve", {})
    for prefix, got in (("relevance", human), ("relevance_sample", sets.get("samples_heldout", {})),
                        ("lead", human.get("lead", {}))):
        for key in ("accuracy", "wilson_low", "wilson_high", "pairs"):
            out[f"{prefix}_{key}"] = got.get(key, nan)
        out[f"{prefix}_tfidf_accuracy"] = got.get("tfidf", {}).get("accuracy", nan)
    out.update(relevance_gap_sd=human.get("gap_sd", nan),
               relevance_gap_sd_se=human.get("gap_sd_se", nan))
    return out



# ------------------------------------------------------------ metrics.json and the report

def collect_metrics(by_part, pairs, gap, length_weight, default_part):
    """metrics.json's top level (the default score's keys, then each part's) and `extra`.
    by_part: {part of (R5): pair_metrics}; gap: `reference_gap`'s dict, or None."""
    default, nan = by_part[default_part], float("nan")
    len_w = torch.tensor([p["chosen_len"] for p in pairs])                  # (n,) tokens
    len_l = torch.tensor([p["rejected_len"] for p in pairs])                # (n,) tokens
    metrics = {key: default[key] for key in ("heldout_accuracy", "wilson_low", "wilson_high",
                                             "shorter_preferred_accuracy")}
    metrics.update(heldout_pairs=len(pairs), default_part=default_part,
                   length_weight=length_weight,
                   # "The longer summary wins", in tokens of the full summary; ties count 1/2.
                   length_baseline_accuracy=pairwise_accuracy(len_w, len_l),
                   length_matched_accuracy=default["accuracy_by_length_difference"]["0-3"][
                       "accuracy"])
    extra = {"shorter_preferred_pairs": int((len_w < len_l).sum()),
             "length_ties": int((len_w == len_l).sum()),
             "score_length_correlation": default["score_length_correlation"],
             "reference_gap": gap}
    for part in by_part:
        for key in ("heldout_accuracy", "wilson_low", "wilson_high",
                    "shorter_preferred_accuracy", "score_length_correlation"):
            metrics[f"{part}_{key}"] = by_part[part][key]
        metrics[f"{part}_human_minus_reference_sd"] = (gap[part]["human_minus_reference_sd"]
                                                      if gap else nan)
        extra[f"{part}_accuracy_by_length_difference"] = by_part[part][
            "accuracy_by_length_difference"]
    return metrics, extra


def verdict(metrics, part):
    """Plain words on chance and on the length baseline, for one score."""
    low, high = metrics[f"{part}_wilson_low"], metrics[f"{part}_wilson_high"]
    said = [f"{part}: " + ("above chance (Wilson lower bound > 0.5)" if low > 0.5 else
                           "NOT distinguishable from chance (Wilson lower bound <= 0.5)")]
    base = metrics["length_baseline_accuracy"]
    said.append("beats 'the longer summary wins'" if base < low else
                "does NOT beat 'the longer summary wins'" if base > high else
                "cannot be told apart from 'the longer summary wins'")
    shorter = metrics[f"{part}_shorter_preferred_accuracy"]
    if shorter < 0.5:
        said.append(f"right only {shorter:.0%} of the time where people chose the shorter "
                    "summary, so it leans on length")
    return "; ".join(said)


def print_summary(metrics, extra, parts):
    """The final report: the scores `parts` side by side, then the length bins, the gap,
    relevance and the verdicts."""
    print(f"\n{metrics['heldout_pairs']} held-out pairs; the longer summary wins "
          f"{metrics['length_baseline_accuracy']:.3f} of them ({extra['length_ties']} ties "
          f"count one half); length weight w = {metrics['length_weight']:.3f}")
    print(f"{'':34}{'content':>22}{'full':>22}")
    rows = [("held-out accuracy [Wilson 95%]", lambda p: f"{metrics[p + '_heldout_accuracy']:.3f} "
             f"[{metrics[p + '_wilson_low']:.3f}, {metrics[p + '_wilson_high']:.3f}]"),
            (f"shorter preferred ({extra['shorter_preferred_pairs']} pairs)",
             lambda p: f"{metrics[p + '_shorter_preferred_accuracy']:.3f}"),
            ("corr(score, length)", lambda p: f"{metrics[p + '_score_length_correlation']:+.3f}"),
            ("human - reference (reference SDs)",
             lambda p: f"{metrics[p + '_human_minus_reference_sd']:+.2f}")]
    for name, bins in (("0-3", "|dlen| <= 3"), ("4-10", "|dlen| 4-10"), (">10", "|dlen| > 10")):
        rows.append((f"{bins} ({extra['content_accuracy_by_length_difference'][name]['pairs']}"
                     " pairs)", lambda p, name=name: "{accuracy:.3f} [{0:.2f}, {1:.2f}]".format(
                         *extra[p + "_accuracy_by_length_difference"][name]["wilson"],
                         **extra[p + "_accuracy_by_length_difference"][name])))
    for name, cell in rows:
        print(f"{name:34}" + "".join(f"{cell(p):>22}" for p in parts))
    gap = extra["reference_gap"]
    if gap and gap["content_reference_cut_at_limit"]["samples"]:
        cut = gap["content_reference_cut_at_limit"]
        print(f"reference samples on {gap['posts']} held-out posts: "
              f"{gap['reference_eos_fraction']:.0%} end in an EOS; content score of those "
              f"cut at the limit {cut['mean_read_at_an_appended_eos']:+.2f} read at an appended "
              f"EOS (as PPO now does), {cut['mean_read_at_the_last_token']:+.2f} at their last "
              "token (before)")
    for name, what in (("human_reserve", "human TL;DRs, ppo.py's evaluation posts"),
                       ("human_heldout", "human TL;DRs, held-out posts"),
                       ("samples_heldout", "the reference policy's samples, held-out posts")):
        if r := extra["relevance"].get(name):
            print(f"relevance, {what}: own beats another post's of the same length "
                  f"{r['accuracy']:.3f} [{r['wilson_low']:.3f}, {r['wilson_high']:.3f}] "
                  f"({r['pairs']} pairs; TF-IDF cosine {r['tfidf']['accuracy']:.3f}); under "
                  f"its own post minus another's {r['gap_sd']:+.2f} ± {r['gap_sd_se']:.2f} SDs")
            if lead := r.get("lead"):
                print(f"copying, {what}: the TL;DR beats the post's own opening words of the "
                      f"same length {lead['accuracy']:.3f} [{lead['wilson_low']:.3f}, "
                      f"{lead['wilson_high']:.3f}] ({lead['pairs']} pairs; TF-IDF cosine "
                      f"{lead['tfidf']['accuracy']:.3f})")
    print(f"trained on {metrics['train_pairs']} pairs ({metrics['reference_pairs']} reference "
          f"pairs, {metrics['off_post_pairs']} + {metrics['off_post_sample_pairs']} off-post); "
          f"{metrics['seconds']:.0f} s in all")
    for part in parts:
        print(f"verdict, {verdict(metrics, part)}")


def plot(losses, margins, folder):
    """loss.png: the loss of each training step; margins.png: held-out r(y_w) - r(y_l)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    w = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - w + 1):i + 1]) / min(w, i + 1) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, alpha=0.3, label="each step")
    ax.plot(smooth, label=f"mean of {w} steps")
    ax.axhline(math.log(2), color="grey", ls=":", label="log 2 (a coin)")
    ax.set(xlabel="step", ylabel="Bradley-Terry loss (R1)", title="reward model training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(margins.numpy(), bins=40)
    ax.axvline(0, color="black", lw=1)
    ax.set(xlabel="r(x, y_w) - r(x, y_l)", ylabel="held-out comparisons",
           title=f"held-out margins: {(margins > 0).double().mean():.1%} above 0")
    fig.tight_layout()
    fig.savefig(folder / "margins.png", dpi=120)
    plt.close("all")
