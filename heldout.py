"""The held-out evaluation of a PPO run: samples on posts no run trains on, scored.

Kept apart from ppo.py, whose loop reads like the post, and from evaluate.py, whose
statistics are pure functions. Per sweep, once:
    reference_and_human   the floor and the ceiling: the untrained model's samples and the
                          human TL;DRs, scored by the reward model (kept in baseline.json,
                          which a resumed sweep reads back)
Per run:
    rollouts              sample on the held-out posts; per sample its reward, fluency, KL,
                          length, EOS and copied bigrams
    evaluate_run          the trained policy's rollouts against the reference, paired by
                          post: the final entry of results.json, curves.png and the table

It uses ppo.py's `generate`, `score` and `fluency`, so ppo.py imports it inside `main`.
Test: pytest tests/test_ppo.py -k "end_to_end or sweep"
"""

import torch
from tqdm import tqdm

import loaders
import ppo
import reward_model as rm
from evaluate import copied_bigrams, paired_gain, per_post, standard_error, summarize
from gae import ended_with_eos, response_mask
from report import (load_baseline, plot_curves, print_gain, print_row, print_row_header,
                    print_samples, write_json)

# The settings that decide the reference's held-out samples and the human rows: a resumed
# sweep reuses its stored ones only when these agree.
BASELINE_KEY = ("model", "reward_model", "reward", "data_dir", "preset", "prompt_tokens",
                "max_new_tokens", "temperature", "top_k", "top_p", "eval_prompts", "batch",
                "samples_per_prompt", "precision")


@torch.no_grad()
def rollouts(model, reference, reward, tokenizer, posts, cfg, device):
    """Sample on `posts` in batches; per sample (in the order of `posts`): reward (the
    --reward score), fluency, KL, length, eos, copied_bigrams, ids and text (evaluate.py)."""
    # In chunks of one iteration's responses: the same for every setting of
    # compare_estimators.py (8), so they share the reference's samples.
    eos, out, step = tokenizer.eos_token_id, [], cfg.batch * cfg.samples_per_prompt
    for i in tqdm(range(0, len(posts), step), desc="held-out samples", unit="batch",
                  leave=False):
        chunk = posts[i:i + step]
        prompt_ids, prompt_mask = loaders.encode(tokenizer, [p["prompt"] for p in chunk], device)
        with loaders.precision(cfg, device):
            sequences, actions = ppo.generate(model, prompt_ids, prompt_mask, cfg, eos)
            mask = response_mask(actions, eos)
            attention = ppo.full_mask(prompt_mask, actions)
            scores = ppo.score(reward, prompt_ids, prompt_mask, actions, mask, None, eos,
                               part=cfg.reward)                                      # (b,)
            flu = ppo.fluency(reference, sequences, attention, actions, mask,
                              cfg.temperature)                                       # (b,)
            # KL of a summary: sum_t logp - logp_ref = (its log-prob under `model`) - fluency
            own = flu if model is reference else ppo.fluency(
                model, sequences, attention, actions, mask, cfg.temperature)         # (b,)
        m, ended = mask.bool(), ended_with_eos(actions, mask, eos)                    # (b, T), (b,)
        for b in range(len(chunk)):
            ids = actions[b][m[b]].tolist()
            words = ids[:-1] if ended[b] else ids               # the summary without its EOS
            post = prompt_ids[b][prompt_mask[b].bool()].tolist()   # its prompt, no padding
            out.append({"reward": scores[b].item(), "fluency": flu[b].item(),
                        "kl": (own[b] - flu[b]).item(), "length": len(ids), "ids": ids,
                        "eos": bool(ended[b]), "copied_bigrams": copied_bigrams(words, post),
                        "text": tokenizer.decode(ids, skip_special_tokens=True)})
    return out


def reference_and_human(cfg, models, held_out, folder):
    """The floor and the ceiling on the held-out posts: the untrained model's samples and
    people's TL;DRs, scored. Once per sweep: `folder`/baseline.json keeps them, and a
    resumed sweep reads them back when the settings that made them (BASELINE_KEY) agree."""
    reference, reward, tokenizer, device = models
    key = {k: getattr(cfg, k) for k in BASELINE_KEY}
    stored = load_baseline(folder / "baseline.json", key) if cfg.resume else None
    if stored:
        print(f"reference and human rows: from {folder / 'baseline.json'}")
        return stored
    torch.manual_seed(10_000)
    ref_samples = rollouts(reference, reference, reward, tokenizer, held_out, cfg, device)
    with loaders.precision(cfg, device):
        human = rm.score_texts(reward, tokenizer, [p["prompt"] for p in held_out],
                               [p["summary"] for p in held_out], part=cfg.reward).float()
    human = [{"reward": r, "text": p["summary"]} for r, p in zip(human.tolist(), held_out)]
    baseline = {"ref": summarize(ref_samples),
                "human": {"reward": sum(h["reward"] for h in human) / len(human),
                          "reward_se": standard_error([h["reward"] for h in human])}}
    # Per post, once per results.json (the policy's rows also carry ref_reward).
    baseline_posts = {"ref_samples": per_post(ref_samples, ("length", "eos", "copied_bigrams",
                                                            "text")),
                      "human_samples": per_post(human, ("text",))}
    print(f"reference: reward {baseline['ref']['reward']:.2f} ± {baseline['ref']['reward_se']:.2f}"
          f", fluency {baseline['ref']['fluency']:.1f}; human TL;DRs: reward "
          f"{baseline['human']['reward']:.2f} ± {baseline['human']['reward_se']:.2f}")
    return {"key": key, "baseline": baseline, "baseline_posts": baseline_posts,
            "ref_samples": ref_samples}


def evaluate_run(cfg, beta, seed, policy, results, models, held_out, base, run_dir):
    """The trained policy on the held-out posts, against the reference and people: the
    final entry of results.json, curves.png, the post's table rows and a few samples."""
    reference, reward, tokenizer, device = models
    ref_samples, baseline = base["ref_samples"], base["baseline"]
    torch.manual_seed(10_000 + seed)
    samples = rollouts(policy, reference, reward, tokenizer, held_out, cfg, device)
    # Paired over the held-out posts: d_i = r_policy,i - r_ref,i (evaluate.py)
    gain, gain_se = paired_gain([s["reward"] for s in samples],
                                [s["reward"] for s in ref_samples])
    last20 = results["iterations"][-20:]
    final = {**summarize(samples), "gain_over_ref": gain, "gain_over_ref_se": gain_se,
             "ref": baseline["ref"], "human": baseline["human"],
             "value_loss_last20": sum(r["value_loss"] for r in last20) / len(last20),
             "samples": per_post(samples, ("length", "eos", "copied_bigrams", "kl", "text"),
                                 ref_samples),
             **base["baseline_posts"]}
    results["final"] = final
    write_json(run_dir / "results.json", results)
    plot_curves(results, run_dir / "curves.png")
    print_row_header()
    print_row(f"{beta:g}", final)
    print_row("(ref)", baseline["ref"])
    print_row("human", baseline["human"])
    print_gain(final)
    print_samples(samples, held_out, f"beta={beta:g} seed={seed}: held-out samples")
    if beta == 0:
        ranked = sorted(zip(samples, held_out), key=lambda sp: -sp[0]["reward"])
        print_samples([s for s, _ in ranked], [p for _, p in ranked],
                      "beta=0: the highest-reward samples (watch KL and length)")
    print(f"results in {run_dir}/results.json, curves in {run_dir}/curves.png")
