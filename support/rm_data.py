"""The reward model's data: comparisons split by post, and the pairs it trains on.

reward_model.py fits a Bradley-Terry model; this file says on what, and keeps every post
that serves in evaluation out of training (departure 7):
    load_and_split       the comparisons split by post id (held out: never trained on), the
                         TL;DR posts, and the titles of ppo.py's evaluation reserve
    prepare_pairs        comparisons -> token ids laid out as PPO produces them (`encode`),
                         each with its distinct pair's id (`pair_id`) and its two systems
    split_settings       what the split depends on, saved with the judge (dpo.py reads it)
    heldout_references   the held-out posts' human TL;DRs, for (R3) and the gap
    sample_reference     SmolLM2's own summaries, sampled with the post's settings
    reference_pairs      departure 7: a post's human TL;DR beats SmolLM2's sample
    off_post_pairs       departure 9: under post p, p's own summary beats another post's
    sample_reference_phase    the samples and both kinds of extra pairs, for one run
Test: pytest tests/test_reward_model.py
"""
import hashlib
import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

import loaders
from support import cli

def split_comparisons(comparisons, heldout_fraction, seed=0):
    """(train, held-out) split by post id: every comparison of one post lands on one side."""
    return loaders.split_by_id(comparisons, "post_id", heldout_fraction, seed)


@dataclass
class Data:
    """What one run reads: every comparison, the TL;DR posts, the comparisons split by post
    id (training ones holding an evaluation post's human TL;DR dropped, and shuffled), and
    the titles of ppo.py's evaluation reserve."""
    comparisons: list
    tldr_posts: list
    train: list
    heldout: list
    reserved: set


def load_and_split(config):
    """The comparisons and the TL;DR posts of --data-dir (or the hub), split for one run."""
    try:
        comparisons = loaders.load_comparisons(config.data_dir or None)
    except loaders.NoDataError:
        raise
    except loaders.DataError as error:
        raise loaders.DataError(f"{error}; pass --data-dir a folder holding "
                                "summarize_from_feedback_comparisons/batch*.json") from error
    try:
        tldr_posts = loaders.load_tldr(config.data_dir or None)
    except loaders.DataError as error:
        print(f"no TL;DR posts ({error}): no reference pairs, normalising on the "
              "comparisons' human TL;DRs only")
        tldr_posts = []
    train_c, heldout_c = split_comparisons(comparisons, config.heldout_fraction, config.seed)
    if len(heldout_c) < config.min_heldout_pairs:
        raise cli.UserError(f"only {len(heldout_c)} comparisons held out, fewer than "
                            f"--min-heldout-pairs {config.min_heldout_pairs}; raise "
                            "--heldout-fraction")
    # Departure 7: no human TL;DR of one of ppo.py's evaluation posts is trained on.
    reserved = {tldr_posts[i]["title"].strip()
                for i in loaders.tldr_order(tldr_posts)[:loaders.EVAL_RESERVE]}
    kept = [c for c in train_c if not serves_in_evaluation(c, reserved)]
    print(f"dropped {len(train_c) - len(kept)} training comparisons holding the human TL;DR "
          "of one of ppo.py's evaluation posts")
    random.Random(config.seed).shuffle(kept)
    return Data(comparisons, tldr_posts, kept, heldout_c, reserved)


def comparison_pairs(tokenizer, data, config):
    """(training pairs, held-out pairs) of people's comparisons, as token ids."""
    human = prepare_pairs(tokenizer, data.train[:config.max_pairs or None], config)
    heldout = prepare_pairs(tokenizer, data.heldout[:config.max_heldout_pairs or None], config)
    if not human or not heldout:                       # every title too long, or no data
        raise cli.UserError(f"{len(human)} training and {len(heldout)} held-out "
                            "comparisons fit --max-prompt-tokens "
                            f"{config.max_prompt_tokens}; both need at least one (raise "
                            "--max-prompt-tokens, or --max-pairs if it is small)")
    comparisons = data.comparisons
    print(f"{len(comparisons)} comparisons of {len({c['post_id'] for c in comparisons})} "
          f"posts: training on {len(human)}, evaluating on {len(heldout)} "
          f"from {len({c['post_id'] for c in data.heldout})} posts never trained on")
    return human, heldout


def heldout_references(tokenizer, data, config):
    """The held-out posts' human TL;DRs, [(prompt ids, TL;DR ids + EOS)], cut as training
    cuts them: (R3)'s origin and the human side of the gap. And where they were found."""
    references, sources = human_references(data.heldout[:config.max_heldout_pairs or None],
                                           data.tldr_posts)
    fitted = [(loaders.fit_prompt(tokenizer, post, config.max_prompt_tokens), summary)
              for post, summary in references]                  # cut as training cut them
    encoded = [encode(tokenizer, p, s, config.max_summary_tokens) for p, s in fitted if p]
    print(f"{len(encoded)} human TL;DRs of held-out posts (found {sources['comparisons']} in "
          f"the comparisons, {sources['tldr_file']} in the TL;DR file; "
          f"{len(fitted) - len(encoded)} with too long a title)")
    return encoded, sources


def evaluation_reserve(tokenizer, data, config):
    """ppo.py's evaluation posts that no training comparison holds, with their prompts cut
    to --max-prompt-tokens: [(prompt, post)], for the relevance test (departure 9)."""
    reserve = [data.tldr_posts[i]
               for i in loaders.tldr_order(data.tldr_posts)[:loaders.EVAL_RESERVE]]
    trained = {c["title"].strip() for c in data.train}
    return [(prompt, p) for p in reserve if p["title"].strip() not in trained
            and (prompt := loaders.fit_prompt(tokenizer, p, config.max_prompt_tokens))]


# ------------------------------------------------------------ token ids

def pad(sequences, pad_id, side, device):
    """Lists of ids -> (ids, mask), both (B, L) long, padded on `side`; mask 1 = real."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)    # (B, L)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)            # (B, L)
    for i, seq in enumerate(sequences):
        cols = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
        ids[i, cols], mask[i, cols] = torch.tensor(seq, dtype=torch.long), 1
    return ids.to(device), mask.to(device)


def encode(tokenizer, prompt, summary, max_summary_tokens):
    """(prompt ids, summary ids + EOS), laid out exactly as PPO produces them.

    PPO tokenizes the prompt alone and then samples response ids, which usually start
    with a space token. So the prompt and " " + summary are tokenized separately, never as
    one string: BPE would merge across the seam and train on a layout PPO never shows.
    """
    summary_ids = tokenizer(" " + summary).input_ids[:max_summary_tokens]
    return tokenizer(prompt).input_ids, summary_ids + [tokenizer.eos_token_id]


def fit_prompt_text(tokenizer, prompt, max_tokens):
    """A prompt string cut to `max_tokens` as training cut it (`loaders.fit_prompt`)."""
    if len(tokenizer(prompt).input_ids) <= max_tokens:
        return prompt
    parsed = loaders.parse_prompt(prompt)
    fitted = parsed and loaders.fit_prompt(tokenizer, parsed, max_tokens)
    if not fitted:
        raise ValueError(f"cannot cut this prompt to {max_tokens} tokens: it must read "
                         "'SUBREDDIT: r/...TITLE: ...POST: ...TL;DR:' with a short title")
    return fitted


def prepare_pairs(tokenizer, comparisons, config):
    """Comparisons -> [{post_id, prompt, chosen, rejected (id lists), *_len, *_tokens}].

    *_len: the whole summary's tokens, before any cut; they feed the length baseline.
    *_tokens: the tokens the model reads (cut, EOS not counted); they feed g of (R5).
    A post whose title alone exceeds the prompt budget is dropped.
    """
    prompts, pairs = {}, []
    for c in comparisons:
        if c["post_id"] not in prompts:
            prompts[c["post_id"]] = loaders.fit_prompt(tokenizer, c, config.max_prompt_tokens)
        if prompts[c["post_id"]] is None:
            continue
        # which comparison it is, for the rules that do not read the summary (judge_baselines)
        pair = {"post_id": c["post_id"], "pair": pair_id(c["post_id"], c["chosen"], c["rejected"]),
                "chosen_policy": c["chosen_policy"], "rejected_policy": c["rejected_policy"]}
        for side in ("chosen", "rejected"):
            pair["prompt"], pair[side] = encode(tokenizer, prompts[c["post_id"]], c[side],
                                                config.max_summary_tokens)
            pair[side + "_len"] = len(tokenizer(" " + c[side]).input_ids)
            pair[side + "_tokens"] = len(pair[side]) - 1        # g's |y|: as cut, no EOS
        pairs.append(pair)
    if len(pairs) < len(comparisons):
        print(f"dropped {len(comparisons) - len(pairs)} comparisons whose title alone "
              f"exceeds {config.max_prompt_tokens} tokens")
    return pairs


def pair_id(post_id, a, b):
    """A distinct pair: its post and its two summaries, unordered (a repeated vote on the same
    two texts gets the same id, whichever was chosen)."""
    texts = "\n".join(sorted((a.strip(), b.strip())))
    return f"{post_id}:{hashlib.sha256(texts.encode()).hexdigest()[:12]}"


def split_settings(config, data):
    """What the judge's split depends on, saved in its config.json for dpo.py to rebuild it:
    the flags, and a fingerprint of the comparisons on each side (another data folder, or
    another split of the same one, gives another fingerprint)."""
    return {"seed": config.seed, "heldout_fraction": config.heldout_fraction,
            "max_pairs": config.max_pairs, "max_heldout_pairs": config.max_heldout_pairs,
            "max_prompt_tokens": config.max_prompt_tokens,
            "max_summary_tokens": config.max_summary_tokens,
            "fingerprint": split_fingerprint(data)}


def split_fingerprint(data):
    """16 hex digits of a hash of the training and held-out comparisons, in order."""
    digest = hashlib.sha256()
    for side, comparisons in (("train", data.train), ("heldout", data.heldout)):
        for c in comparisons:
            digest.update(f"{side}\t{c['post_id']}\t{c['chosen']}\t{c['rejected']}\n".encode())
    return digest.hexdigest()[:16]


def serves_in_evaluation(comparison, reserved_titles):
    """Whether a comparison holds the human TL;DR of one of ppo.py's evaluation posts."""
    return (comparison["title"].strip() in reserved_titles
            and "ref" in (comparison["chosen_policy"], comparison["rejected_policy"]))


def human_references(heldout, tldr_posts):
    """One human-written TL;DR per held-out post: ([(post, summary)], counts by source).

    Stiennon et al. shift scores so the dataset's reference summaries average 0. Ours are
    the held-out posts' own author TL;DRs, never trained on, from two places: summaries
    of policy "ref" in the comparisons (batch18), then the TL;DR file's posts whose title
    matches a held-out post. Together they cover the most posts (~95 here).
    """
    posts = {c["post_id"]: c for c in heldout}
    found, sources = {}, {"comparisons": 0, "tldr_file": 0}
    for c in heldout:
        for side in ("chosen", "rejected"):
            if c[side + "_policy"] == "ref" and c["post_id"] not in found:
                found[c["post_id"]] = c[side]
                sources["comparisons"] += 1
    by_title = {p["title"].strip(): p["summary"] for p in tldr_posts}
    for post_id, c in posts.items():
        if post_id not in found and c["title"].strip() in by_title:
            found[post_id] = by_title[c["title"].strip()]
            sources["tldr_file"] += 1
    return [(posts[i], s) for i, s in found.items()], sources



# ------------------------------------------------------------ SmolLM2's samples and the extra pairs

# The post's sampling settings (MAX_NEW_TOKENS, TEMPERATURE, TOP_K, TOP_P), as ppo.py's
# `generate` samples by default; tests/test_reward_model.py checks that the two agree.
POST_SAMPLING = {"max_new_tokens": 48, "temperature": 1.0, "top_k": 50, "top_p": 0.95}


@torch.no_grad()
def sample_reference(lm, tokenizer, prompts, batch, seed, desc):
    """One summary per prompt (id lists) from the reference policy, sampled as in PPO.

    Returns [(ids without the EOS, ended: bool)] in the prompts' order. Prompts of similar
    length share a `generate` call; the draw is seeded without touching the caller's RNG.
    """
    eos = tokenizer.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    samples = [None] * len(prompts)
    with loaders.fork_rng():
        torch.manual_seed(seed)
        for start in tqdm(range(0, len(order), batch), desc=desc, unit="batch", leave=False):
            rows = order[start:start + batch]
            ids, mask = pad([prompts[i] for i in rows], tokenizer.pad_token_id, "left",
                            lm.device)                                      # (b, P)
            out = lm.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                              pad_token_id=eos, **POST_SAMPLING)            # (b, P+T)
            actions = out[:, ids.shape[1]:]                                 # (b, T)
            for i, row in zip(rows, actions.tolist()):
                cut = row.index(eos) if eos in row else len(row)
                samples[i] = (row[:cut], cut < len(row))
    return samples


def heldout_samples(lm, tokenizer, encoded, config):
    """SmolLM2's samples for the held-out posts (`encoded`), the gap's and the relevance
    test's: one draw per run seed, so tools/rm_relevance.py redraws the same ones."""
    return sample_reference(lm, tokenizer, [p for p, _ in encoded], config.sample_batch,
                            config.seed + 1, "sampling (held-out)")


def reference_pairs(tokenizer, posts, samples, config):
    """Departure 7: pairs "the post's human TL;DR beats the reference policy's sample".

    posts: [{id, prompt (already fitted), summary}]; samples: from `sample_reference`.
    The sample is cut to the TL;DR's length when longer, so the two sides have the same
    g(y) and (R5)'s length term cancels: only f learns from these pairs.
    """
    pairs = []
    for post, (sample, _) in zip(posts, samples):
        prompt, human = encode(tokenizer, post["prompt"], post["summary"],
                               config.max_summary_tokens)
        sample = sample[:len(human) - 1]                  # no longer than the TL;DR
        if not sample or sample == human[:-1]:
            continue
        pairs.append({"post_id": post["id"], "prompt": prompt, "kind": "reference",
                      "chosen": human, "rejected": sample + [tokenizer.eos_token_id],
                      "chosen_len": len(human) - 1, "rejected_len": len(sample),
                      "chosen_tokens": len(human) - 1, "rejected_tokens": len(sample)})
    return pairs


def length_neighbours(lengths, seed, k=1):
    """[(i, j)]: each item i with the k items after it in length order (j no shorter, at
    most k ranks up), grouped by i in length order. A seeded shuffle comes first, so items
    of equal length pair at random, not by their index."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda i: lengths[i])         # stable: equal lengths stay shuffled
    return [(i, j) for rank, i in enumerate(order) for j in order[rank + 1:rank + 1 + k]]


def cut_to_shorter(a, b, eos_id):
    """(a, b) cut to the shorter of the two, each ending in EOS, so g(a) = g(b) of (R5) and
    only f can tell them apart; None when nothing is left to tell (an empty side, or the
    same tokens once cut)."""
    cut = min(len(a), len(b))
    if not cut or a[:cut] == b[:cut]:
        return None
    return a[:cut] + [eos_id], b[:cut] + [eos_id]


def off_post_pairs(prompts, summaries, post_ids, eos_id, seed, kind="off_post", negatives=1):
    """Departure 9: under post p, p's own summary beats q's, for p's `negatives` nearest
    length neighbours q (`length_neighbours`).

    prompts: [prompt ids]; summaries: [summary ids, no EOS], one per post; both sides are
    cut to the shorter of the two and end in EOS (`cut_to_shorter`), so only f learns.
    Returns the pairs grouped by p, in the order the posts were given (take the first n:
    whole posts, in the caller's seeded order).
    """
    by_post = [[] for _ in prompts]
    for p, q in length_neighbours([len(x) for x in summaries], seed, negatives):
        if not (pair := cut_to_shorter(summaries[p], summaries[q], eos_id)):
            continue
        chosen, rejected = pair
        cut = len(chosen) - 1                    # tokens before the EOS, the same on both sides
        by_post[p].append({"post_id": post_ids[p], "prompt": prompts[p], "kind": kind,
                           "chosen": chosen, "rejected": rejected,
                           "chosen_len": cut, "rejected_len": cut,
                           "chosen_tokens": cut, "rejected_tokens": cut})
    return [pair for pairs in by_post for pair in pairs]


def sample_reference_phase(config, tokenizer, data, encoded, device):
    """The reference policy's own samples (--model's: SmolLM2, or sft.py's model): departure
    7's training pairs and the held-out gap's samples.

    Training posts: TL;DR posts whose title is neither reserved for ppo.py's evaluation nor
    one of this split's held-out posts. Returns (reference pairs, human and sample
    off-post pairs, samples for `encoded`, seconds taken).
    """
    t = time.time()
    pool = []
    if config.reference_pairs or config.off_post_pairs:
        excluded = data.reserved | {c["title"].strip() for c in data.heldout}
        pool = [p for p in data.tldr_posts if p["title"].strip() not in excluded]
        random.Random(config.seed).shuffle(pool)
        pool = [{**p, "prompt": prompt} for p in pool
                if (prompt := loaders.fit_prompt(tokenizer, p, config.max_prompt_tokens))]
    posts = pool[:config.reference_pairs]
    lm, _ = loaders.load_policy_and_tokenizer(config.model, device=device,   # ppo's reference
                                              preset="tiny" if config.preset == "tiny" else None)
    samples = sample_reference(lm, tokenizer, [tokenizer(p["prompt"]).input_ids for p in posts],
                               config.sample_batch, config.seed, "sampling (training)")
    gap_samples = heldout_samples(lm, tokenizer, encoded, config)
    pairs = reference_pairs(tokenizer, posts, samples, config)
    print(f"sampled the reference policy on {len(posts) + len(encoded)} posts in "
          f"{time.time() - t:.0f} s: {len(pairs)} reference pairs for training "
          f"(departure 7), {len(encoded)} samples for the held-out gap")
    eos, human, own = tokenizer.eos_token_id, [], []
    if config.off_post_pairs:                    # tokenizing the whole pool is not free
        human = off_post_pairs([tokenizer(p["prompt"]).input_ids for p in pool],
                               [tokenizer(" " + p["summary"]).input_ids[
                                   :config.max_summary_tokens] for p in pool],
                               [p["id"] for p in pool], eos, config.seed, "off_post",
                               config.off_post_negatives)[:config.off_post_pairs]
    if config.off_post_sample_pairs:
        own = off_post_pairs([tokenizer(p["prompt"]).input_ids for p in posts],
                             [ids for ids, _ in samples], [p["id"] for p in posts], eos,
                             config.seed, "off_post_sample",
                             config.off_post_negatives)[:config.off_post_sample_pairs]
    if config.off_post_pairs or config.off_post_sample_pairs:
        print(f"off-post pairs (departure 9): {len(human)} of human TL;DRs from {len(pool)} "
              f"posts, {len(own)} of the reference policy's samples from {len(posts)}")
    return pairs, human, own, gap_samples, time.time() - t
