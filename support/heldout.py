"""The held-out evaluation of a PPO run: samples on posts no run trains on, scored.

Kept apart from ppo.py, whose loop reads like the post, and from measures.py, whose
statistics are pure functions. ppo.py's `rollouts` (the post's last lines of `train`:
generate, score, fluency) draws the samples and is passed in; nothing here imports ppo.py.
Per judge, once:
    reference_and_human   the floor and the ceiling: the untrained model's samples and the
                          human TL;DRs, scored by the reward model (kept in baseline.json,
                          which a resumed sweep reads back, and in the judge's folder, which
                          every later run with that judge and these settings reads back:
                          `judge_copy`); and where the data has them,
                          the summaries of OpenAI's released 1.3B PPO policy (Stiennon et
                          al. 2020), a real RLHF summariser ten times our policy's size
                          trained on 64k+ human labels, as a yardstick (`written_row`)
Per run:
    evaluate_run          the trained policy's rollouts against the reference, paired by
                          post: the final entry of results.json, curves.png, samples.html
                          and the table
    policy_row            its numbers alone (evaluate_run's, and dpo.py's policy row)
    outside_measures      per summary, what the judge never saw (quality.py): ROUGE-L
                          against the human TL;DR, the rank of its own post when the
                          summary alone retrieves it, and the judge's relevance gap
Test: pytest tests/test_ppo.py -k "end_to_end or sweep"
"""

import hashlib
import json
from pathlib import Path

import torch

import loaders
from support.measures import copied_bigrams, per_post, standard_error, summarize
from support.quality import (asks_for_help, ends_with_question, paired_difference,
                             retrieval_ranks, rouge_l, samples_page, words)
from support import cli, parallel
from support.disk import write_json, write_text
from support.kept import machine, summarize_run
from support.rm_score import score_grouped, score_texts
from support.report import (load_baseline, plot_curves, print_gain, print_row,
                            print_row_header, print_samples)

# The settings that decide the reference's held-out samples and the human rows: a resumed
# sweep reuses its stored ones only when these agree (and when they carry MEASURES).
# 2: outside_measures; 3: the OpenAI 1.3B row; 4: rouge-score ROUGE-L, people's length;
# 5: the start row (SmolLM2) when the reference is sft.py's model
MEASURES = 5
OUTSIDE = ("rouge_l", "retrieval_rank", "relevance_gap", "question", "asks_help")  # per sample
DRAWS_KEY = ("prompt_tokens", "max_new_tokens", "temperature", "top_k", "top_p", "eval_prompts",
             "precision", "decoding")
BASELINE_KEY = ("model", "reward_model", "reward", "data_dir", "preset", "prompt_tokens",
                "max_new_tokens", "temperature", "top_k", "top_p", "eval_prompts", "precision",
                "decoding")


def held_out_batch(cfg):
    """How many held-out posts ppo.rollouts samples at once: one iteration's responses,
    batch x samples_per_prompt (8 for every setting of tools/analysis/compare_estimators.py, which
    so share the reference's rows). The draws depend on it, not on its two factors."""
    return cfg.batch * cfg.samples_per_prompt


def outside_measures(samples, held_out, reward, tokenizer, written=False, human=False):
    """Adds to each sample (one per held-out post, in order) what the judge never saw:
    rouge_l against the post's human TL;DR (None for the TL;DRs themselves), retrieval_rank
    of its own post among the held-out posts by TF-IDF on the summary alone (1 = found),
    relevance_gap f(x_i, y_i) - f(x_{i+1}, y_i), the judge's content score under its own
    post minus under the next one (the length term is the same under both), and whether it
    ends in "?" or asks for help. samples: [{text, ids (EOS included if it ended)}], or
    with `written` [{text}], tokenized as the judge trained on them; `human`: they are the
    human TL;DRs."""
    gaps = (relevance_gaps(samples, held_out, reward, tokenizer, written)
            if reward is not None else None)
    ranks = retrieval_ranks([s["text"] for s in samples],
                            [f"{p['title']}\n{p['post']}" for p in held_out])
    for i, (s, post, rank) in enumerate(zip(samples, held_out, ranks)):
        s.update(rouge_l=None if human else rouge_l(s["text"], post["summary"]),
                 retrieval_rank=rank, relevance_gap=None if gaps is None else gaps[i],
                 question=ends_with_question(s["text"]), asks_help=asks_for_help(s["text"]))
    return samples


def relevance_gaps(samples, held_out, reward, tokenizer, written=False):
    """f(x_i, y_i) - f(x_{i+1}, y_i) of each sample, a list: the judge's content score under
    its own post minus under the next held-out post (outside_measures)."""
    eos = tokenizer.eos_token_id
    cut = reward.settings["max_summary_tokens"]
    prompts = [tokenizer(p["prompt"]).input_ids for p in held_out]
    ids = [tokenizer(" " + s["text"]).input_ids[:cut] + [eos] if written else
           s["ids"] if s["eos"] else s["ids"] + [eos] for s in samples]     # read at an EOS
    # Both sides scored here, the same way (content, these batches), though rollouts scored
    # home already: a gap of two differently computed numbers would carry their noise.
    home = score_grouped(reward, prompts, ids)                            # (n,)
    away = score_grouped(reward, prompts[1:] + prompts[:1], ids)          # (n,)
    return [h - a for h, a in zip(home.tolist(), away.tolist())]   # in Python's float64


def outside_summary(samples, ref_samples=None):
    """Means of outside_measures over the posts; with ref_samples, the paired gains over the
    reference's (policy minus reference on the same post, with their SEs)."""
    mean = lambda key: sum(s[key] for s in samples) / len(samples)  # noqa: E731
    judged = samples[0]["relevance_gap"] is not None            # no judge: no relevance gap
    out = {"retrieval_top1": sum(s["retrieval_rank"] == 1 for s in samples) / len(samples),
           "retrieval_mrr": sum(1 / s["retrieval_rank"] for s in samples) / len(samples),
           **({"relevance_gap": mean("relevance_gap"),
               "relevance_gap_se": standard_error([s["relevance_gap"] for s in samples])}
              if judged else {}),
           "question_fraction": mean("question"), "asks_for_help": mean("asks_help")}
    if samples[0]["rouge_l"] is not None:
        out["rouge_l"] = mean("rouge_l")
    if ref_samples is not None:
        for key, of in (("rouge_l", lambda s: s["rouge_l"]),
                        ("retrieval_mrr", lambda s: 1 / s["retrieval_rank"]),
                        *((("relevance_gap", lambda s: s["relevance_gap"]),) if judged else ())):
            out[f"{key}_gain_over_ref"], out[f"{key}_gain_over_ref_se"] = paired_difference(
                [of(s) for s in samples], [of(s) for s in ref_samples])
    return out


def fingerprint(cfg, models, held_out):
    """What the reference and human rows depend on besides the settings in BASELINE_KEY: the
    judge's saved weights and settings, the reference's weights, the held-out posts, the
    device and torch. A sha256 hex digest."""
    reference, reward, tokenizer, device = models
    digest = hashlib.sha256()
    for name in ("config.json", "adapter.safetensors", "head.safetensors"):
        path = Path(cfg.reward_model) / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    for weight in (reference.get_input_embeddings().weight, reference.lm_head.weight):
        digest.update(repr(float(weight.detach()[:256].cpu().double().sum())).encode())
    posts = [[p["prompt"], p["summary"], p.get("openai_1b")] for p in held_out]
    digest.update(json.dumps([posts, str(device), torch.__version__]).encode())
    return digest.hexdigest()


def draws_key(cfg, held_out, device):
    """What a model's held-out draws depend on besides its weights and the seed: the
    sampler's settings, the batches they are drawn in, the precision and the decoding, the
    posts, the device and torch. sft.py keeps it beside its samples; ppo.py reads them back
    (`sft_draws`) only where its own agrees."""
    posts = hashlib.sha256(json.dumps([p["prompt"] for p in held_out]).encode()).hexdigest()
    return {**{k: getattr(cfg, k) for k in DRAWS_KEY}, "held_out_batch": held_out_batch(cfg),
            "posts": posts, "device": str(device), "torch": torch.__version__}


def sft_draws(cfg, held_out, device):
    """The ids sft.py drew on the held-out posts from its start and from the SFT model,
    {"start": [ids], "sft": [ids]}, where cfg.model is sft.py's folder and they were drawn
    as this run would draw them (`draws_key`); else None. ppo.py scores them again (its
    judge, its reference) instead of drawing them again: the same rows, minutes sooner."""
    try:
        saved = json.loads((Path(cfg.model) / "results.json").read_text())
        if saved.get("draws_key") != draws_key(cfg, held_out, device):
            return None
        return {name: [s["ids"] for s in saved["samples"][name]] for name in ("start", "sft")}
    except (OSError, ValueError, KeyError, TypeError):  # none, an older sft.py's, or broken
        return None


def judge_copy(cfg, key):
    """Where the judge's folder keeps the reference and human rows made with `key`."""
    return Path(cfg.reward_model) / "baselines" / f"{key['fingerprint'][:16]}.json"


def keep_for_judge(cfg, base):
    """A copy of the rows beside the judge, for later runs, written once a run has trained
    (a run that stops before changes nothing). A folder that cannot be written (read-only,
    full) costs those runs the few minutes of sampling again, so one line."""
    if not parallel.is_main():                          # the others hold no rows
        return
    path = judge_copy(cfg, base["key"])
    if path.is_file():
        return
    try:
        path.parent.mkdir(exist_ok=True)
        write_json(path, base)
    except OSError as error:
        print(f"note: the reference and human rows were not kept beside the judge "
              f"({cli.write_problem(path, error) or error}); later runs sample them again")


def reference_and_human(cfg, models, held_out, folder, rollouts):
    """The floor and the ceiling on the held-out posts: the untrained model's samples and
    people's TL;DRs, scored. Once per judge: `folder`/baseline.json keeps them for a resumed
    sweep, and the judge's folder (`judge_copy`) for every later run of any folder, each
    read back only when the settings that made them (BASELINE_KEY) and the fingerprint of
    the judge, the reference and the posts agree. Read back, they are the same numbers."""
    reference, reward, tokenizer, device = models
    key = {**{k: getattr(cfg, k) for k in BASELINE_KEY}, "held_out_batch": held_out_batch(cfg),
           "measures": MEASURES,
           "fingerprint": fingerprint(cfg, models, held_out)}
    for path in ([folder / "baseline.json"] if cfg.resume else []) + [judge_copy(cfg, key)]:
        if stored := load_baseline(path, key):
            print(f"reference and human rows: from {path}")
            return stored
    drawn = sft_draws(cfg, held_out, device) if loaders.sft_start(cfg.model) else None
    if drawn:
        print(f"reference and start rows: the samples sft.py drew in {cfg.model}, scored here")
    torch.manual_seed(10_000)
    ref_samples = rollouts(reference, reference, reward, tokenizer, held_out, cfg, device,
                           drawn=drawn and drawn["sft"])
    with loaders.precision(cfg, device):
        outside_measures(ref_samples, held_out, reward, tokenizer)
        human_row, human = written_row([p["summary"] for p in held_out], held_out, reward,
                                       tokenizer, cfg, human=True)
    baseline = {"ref": {**summarize(ref_samples), **outside_summary(ref_samples)},
                "human": human_row}
    # Per post, once per results.json (the policy's rows also carry ref_reward).
    baseline_posts = {"ref_samples": per_post(ref_samples, ("length", "eos", "copied_bigrams",
                                                            "text", *OUTSIDE)),
                      "human_samples": per_post(human, ("length", "copied_bigrams", "text",
                                                         *OUTSIDE[1:]))}
    if start_name := loaders.sft_start(cfg.model):      # the reference is sft.py's model
        baseline["start"], baseline_posts["start_samples"] = start_row(
            start_name, cfg, models, held_out, rollouts, drawn and drawn["start"])
    if all("openai_1b" in p for p in held_out):         # the data's 1.3B PPO summaries
        with loaders.precision(cfg, device):
            baseline["openai_1b"], openai = written_row([p["openai_1b"] for p in held_out],
                                                        held_out, reward, tokenizer, cfg)
        baseline_posts["openai_1b_samples"] = per_post(openai, ("length", "copied_bigrams",
                                                                "text", *OUTSIDE))
    print(f"reference: reward {baseline['ref']['reward']:.2f} ± {baseline['ref']['reward_se']:.2f}"
          f", fluency {baseline['ref']['fluency']:.1f}; human TL;DRs: reward "
          f"{baseline['human']['reward']:.2f} ± {baseline['human']['reward_se']:.2f}")
    return {"key": key, "baseline": baseline, "baseline_posts": baseline_posts,
            "ref_samples": ref_samples}


def start_row(name, cfg, models, held_out, rollouts, drawn=None):
    """The model sft.py started from (the post's start, SmolLM2), sampled on the held-out posts
    as the reference is (the same seed: sft.py's start row; `drawn`: sft.py's draws), scored,
    its KL taken to the reference. Returns (the row's means with "model": name, the samples
    per post)."""
    reference, reward, tokenizer, device = models
    start, _ = loaders.load_policy_and_tokenizer(name, preset=cfg.preset, device=device)
    torch.manual_seed(10_000)
    samples = rollouts(start, reference, reward, tokenizer, held_out, cfg, device, drawn=drawn)
    with loaders.precision(cfg, device):
        outside_measures(samples, held_out, reward, tokenizer)
    return ({**summarize(samples), **outside_summary(samples), "model": name},
            per_post(samples, ("length", "eos", "copied_bigrams", "kl", "text", *OUTSIDE)))


def length_and_copying(tokenizer, text, prompt):
    """A written summary's length in tokens (no EOS) and the share of its token bigrams
    that occur in its post's prompt (measures.copied_bigrams), as the samples' are."""
    ids = tokenizer(" " + text).input_ids
    return len(ids), copied_bigrams(ids, tokenizer(prompt).input_ids)


def written_row(texts, held_out, reward, tokenizer, cfg, human=False):
    """A row of written summaries of the held-out posts (people's TL;DRs, or the data's
    OpenAI 1.3B PPO ones): the judge's score of each (--reward; tokenized as in its
    training), the measures it never saw, its length in tokens and the share of its bigrams
    copied from the post. Returns (the row's means, the samples)."""
    rewards = score_texts(reward, tokenizer, [p["prompt"] for p in held_out], texts,
                             part=cfg.reward).float()                         # (n,)
    samples = outside_measures([{"reward": r, "text": t} for r, t in zip(rewards.tolist(),
                                                                         texts)],
                               held_out, reward, tokenizer, written=True, human=human)
    row = {"reward": sum(s["reward"] for s in samples) / len(samples),
           "reward_se": standard_error([s["reward"] for s in samples]),
           **outside_summary(samples)}
    for s, post in zip(samples, held_out):
        s["length"], s["copied_bigrams"] = length_and_copying(tokenizer, s["text"],
                                                              post["prompt"])
    row.update(length=sum(s["length"] for s in samples) / len(samples),
               copied_bigrams=sum(s["copied_bigrams"] for s in samples) / len(samples))
    return row, samples


def policy_row(cfg, seed, policy, models, held_out, base, rollouts, **extra):
    """A trained policy's held-out numbers against the reference and people, paired by post,
    sampled with the seed 10,000 + `seed`: results.json's final entry (ppo.py's, and dpo.py's
    with its own `extra` keys), and the samples."""
    reference, reward, tokenizer, device = models
    ref_samples, baseline = base["ref_samples"], base["baseline"]
    torch.manual_seed(10_000 + seed)
    samples = rollouts(policy, reference, reward, tokenizer, held_out, cfg, device)
    with loaders.precision(cfg, device):
        outside_measures(samples, held_out, reward, tokenizer)
    # Paired over the held-out posts: d_i = r_policy,i - r_ref,i (support/quality.py)
    gain, gain_se = paired_difference([s["reward"] for s in samples],
                                      [s["reward"] for s in ref_samples])
    final = {**summarize(samples), "gain_over_ref": gain, "gain_over_ref_se": gain_se,
             **outside_summary(samples, ref_samples),
             "ref": baseline["ref"], "human": baseline["human"],
             **{k: baseline[k] for k in ("start", "openai_1b") if k in baseline}, **extra,
             "samples": per_post(samples, ("length", "eos", "copied_bigrams", "kl", "text",
                                           *OUTSIDE), ref_samples),
             **base["baseline_posts"]}
    return final, samples


def evaluate_run(cfg, beta, seed, policy, results, models, held_out, base, run_dir, rollouts):
    """The trained policy on the held-out posts, against the reference and people: the
    final entry of results.json, its small copy summary.json (support/kept.py), curves.png,
    the post's table rows and a few samples."""
    baseline = base["baseline"]
    last20 = results["iterations"][-20:]
    final, samples = policy_row(cfg, seed, policy, models, held_out, base, rollouts,
                                value_loss_last20=sum(r["value_loss"] for r in last20)
                                / len(last20))
    results["final"], results["machine"] = final, machine()
    write_json(run_dir / "results.json", results)
    write_json(run_dir / "summary.json", summarize_run(results))   # what docs/runs/ keeps
    plot_curves(results, run_dir / "curves.png")
    write_samples_page(final, held_out, f"beta={beta:g} seed={seed}", run_dir / "samples.html",
                       labels={"reference": "reference (SFT)"} if "start" in final else None)
    print_row_header()
    print_row(f"{beta:g}", final)
    print_row("(ref)", baseline["ref"])
    if "start" in baseline:                             # the post's start, before SFT
        print_row("start", baseline["start"])
    print_row("human", baseline["human"])
    if "openai_1b" in baseline:                         # a 10x larger RLHF summariser
        print_row("OpenAI", baseline["openai_1b"])
        print("OpenAI: the data's summaries by OpenAI's 1.3B PPO policy (Stiennon et al. "
              "2020), 10x our policy's size, trained on 64k+ human labels")
    print_gain(final)
    print_samples(samples, held_out, f"beta={beta:g} seed={seed}: held-out samples")
    if beta == 0:
        ranked = sorted(zip(samples, held_out), key=lambda sp: -sp[0]["reward"])
        print_samples([s for s, _ in ranked], [p for _, p in ranked],
                      "beta=0: the highest-reward samples (watch KL and length)")
    print(f"results in {run_dir}/results.json, curves in {run_dir}/curves.png")


def sft_rows(start, sft, reward, tokenizer, held_out, cfg, device, rollouts):
    """sft.py's held-out rows: the model SFT started from and the SFT model, each sampled once
    per post as ppo.py samples its reference (the same seed), with the judge's reward where
    there is a judge (`reward` None: none), the measures it never saw, words, the share
    that end by themselves, copying and the KL to the start; the SFT row also carries its
    gains over the start, paired by post. Returns ({"start", "sft"}: row, {same}: samples)."""
    keys = ("length", "eos", "copied_bigrams", "kl", "text", "ids", *OUTSIDE)
    drawn = {}
    for name, model in (("start", start), ("sft", sft)):
        torch.manual_seed(10_000)                       # as reference_and_human seeds it
        drawn[name] = rollouts(model, start, reward, tokenizer, held_out, cfg, device)
        with loaders.precision(cfg, device):
            outside_measures(drawn[name], held_out, reward, tokenizer)
    ref = drawn["start"]
    rows = {name: {**summarize(d), "words": sum(len(words(s["text"])) for s in d) / len(d),
                   **outside_summary(d, None if name == "start" else ref)}
            for name, d in drawn.items()}
    return rows, {"start": per_post(ref, keys), "sft": per_post(drawn["sft"], keys, ref)}


def write_samples_page(final, held_out, title, path, labels=None):
    """samples.html: per held-out post, the post, the human TL;DR, the reference's sample (SFT
    or SmolLM2; SmolLM2's too beside SFT's), the policy's and, where the data has it,
    OpenAI's 1.3B PPO policy's, with their rewards,
    lengths, ROUGE-L and retrieval ranks (quality.py). `labels` renames the reference and
    policy columns (sft.py: its start and the SFT model)."""
    rows = []
    openai = final.get("openai_1b_samples") or [{}] * len(held_out)
    starts = final.get("start_samples") or [{}] * len(held_out)
    for post, mine, ref, human, big, first in zip(held_out, final["samples"],
                                                  final["ref_samples"], final["human_samples"],
                                                  openai, starts):
        rows.append({"start": first.get("text"), "start_reward": first.get("reward"),
                     "start_rouge_l": first.get("rouge_l"),
                     "openai_1b": big.get("text"), "openai_1b_reward": big.get("reward"),
                     "openai_1b_rouge_l": big.get("rouge_l"),
                     "openai_1b_rank": big.get("retrieval_rank"),
                     "post": post["prompt"], "human": human["text"], "reference": ref["text"],
                     "policy": mine["text"], "policy_reward": mine["reward"],
                     "reference_reward": ref["reward"], "human_reward": human["reward"],
                     "policy_length": mine["length"], "reference_length": ref["length"],
                     "policy_rouge_l": mine["rouge_l"], "reference_rouge_l": ref["rouge_l"],
                     "policy_rank": mine["retrieval_rank"],
                     "reference_rank": ref["retrieval_rank"]})
    write_text(path, samples_page(rows, title, labels))
