"""What the post claims about the PPO loop (ppo.py), tested.

- The ratio is exactly 1 at the first inner step (real SmolLM2 + a fresh adapter), in
  fp32 and under --precision bf16.
- Micro-batches cut to their own padding give the log-probs of the whole padded batch.
- The post's two failure modes (decode-then-encode, summed ratios) trip the check.
- Tokens after EOS change nothing: not the loss, not the KL, not the advantages.
- The clip's asymmetry (the concept lesson's rho = 1.5 example).
- --reward picks the reward model's score, and `score` passes it through.
- The held-out statistics (evaluate.py) on known answers: the EOS flag, copied bigrams,
  standard errors and the paired gain over the reference, and the table that prints them.
- A tiny run end to end through a subprocess, and resume == uninterrupted.
"""

import copy
import csv
import json
import math
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import loaders
import ppo
import reward_model as rm
from support import cli, heldout, measures, report, tables
from tools import floors, same_numbers
from tools.analysis import compare_estimators
from gae import advantages_and_returns, response_mask, shaped_rewards, whiten
from lora import with_lora

EOS = 2


def fake_batch(tokenizer, n=3, T=6, seed=0):
    """Left-padded prompts and random responses, row 0 ending early at EOS (then EOS padding)."""
    g = torch.Generator().manual_seed(seed)
    prompts = ["SUBREDDIT: r/a\n\nTITLE: b\n\nPOST: c d e\n\nTL;DR:",
               "SUBREDDIT: r/x\n\nTITLE: y\n\nPOST: a much longer post, with more words\n\nTL;DR:",
               "SUBREDDIT: r/q\n\nTITLE: w\n\nPOST: e\n\nTL;DR:"][:n]
    prompt_ids, prompt_mask = loaders.encode(tokenizer, prompts, "cpu")         # (B, P)
    actions = torch.randint(100, 5000, (n, T), generator=g)                 # (B, T)
    actions[0, 2:] = EOS                                                    # ends at t = 2
    return prompt_ids, prompt_mask, actions


def fake_sequences(tokenizer):
    """fake_batch as the passes take it: prompt mask, sequences, attention mask, actions."""
    prompt_ids, prompt_mask, actions = fake_batch(tokenizer)
    sequences = torch.cat([prompt_ids, actions], 1)                         # (B, P+T)
    return prompt_mask, sequences, ppo.full_mask(prompt_mask, actions), actions


def test_ratio_is_one_with_a_fresh_adapter_on_the_tiny_model(tiny, tokenizer):
    _, sequences, attention, actions = fake_sequences(tokenizer)
    policy, head = with_lora(copy.deepcopy(tiny)), ppo.ValueHead(tiny.config.hidden_size)
    with torch.no_grad():
        logp_ref = ppo.token_log_probs(tiny, sequences, attention, actions)
        logp, _, _ = ppo.policy_forward(policy, head, sequences, attention, actions)
    assert torch.equal(logp, logp_ref)
    assert ppo.check_ratio((logp - logp_ref).exp()) == (1.0, 1.0)


def test_ratio_is_one_under_bf16_autocast_and_log_probs_stay_fp32(tiny, tokenizer):
    _, sequences, attention, actions = fake_sequences(tokenizer)
    policy, head = with_lora(copy.deepcopy(tiny)), ppo.ValueHead(tiny.config.hidden_size)
    cfg = ppo.parse_args(["--preset", "tiny", "--precision", "bf16"])
    with torch.no_grad():
        fp32 = ppo.token_log_probs(tiny, sequences, attention, actions)
        with loaders.precision(cfg, "cpu"):
            logp_ref = ppo.token_log_probs(tiny, sequences, attention, actions)
            logp, values, _ = ppo.policy_forward(policy, head, sequences, attention, actions)
    assert logp.dtype == values.dtype == torch.float32
    assert torch.equal(logp, logp_ref)                       # the check holds in bf16 too
    assert not torch.equal(logp_ref, fp32)                   # ... and bf16 did take effect
    assert torch.allclose(logp_ref, fp32, atol=0.05)


def test_micro_batches_cover_each_row_once_and_cut_only_padding():
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1],
                                [0, 0, 1, 1]])
    groups = loaders.micro_batches(prompt_mask, 2)
    rows = torch.cat([r for r, _ in groups])
    assert sorted(rows.tolist()) == [0, 1, 2, 3, 4]
    assert [len(r) for r, _ in groups] == [2, 2, 1]
    for r, first in groups:
        assert prompt_mask[r, :first].sum() == 0                 # only padding is cut
        assert prompt_mask[r, first].any()                       # and all of it
    assert [first for _, first in groups] == [0, 2, 3]           # least padding first


def test_cut_micro_batches_give_the_padded_batch_log_probs(tiny, tokenizer):
    prompt_mask, sequences, attention, actions = fake_sequences(tokenizer)
    groups = loaders.micro_batches(prompt_mask, 1)
    assert max(first for _, first in groups) > 0                 # something is cut
    with torch.no_grad():
        whole = ppo.token_log_probs(tiny, sequences, attention, actions)            # (B, T)
        parts = torch.zeros_like(whole)
        for rows, first in groups:
            parts[rows] = ppo.token_log_probs(tiny, sequences[rows, first:],
                                              attention[rows, first:], actions[rows])
    assert torch.allclose(parts, whole, atol=1e-5)


@pytest.fixture(scope="module")
def real_samples(smollm2, tokenizer, tldr_posts):
    """64 real SmolLM2 summaries of held-out TL;DR posts, sampled as ppo.py samples them."""
    cfg = ppo.parse_args(["--preset", "tiny", "--max-new-tokens", "48"])
    posts = tldr_posts[:64]
    prompts = [loaders.fit_prompt(tokenizer, p, 160) for p in posts]
    torch.manual_seed(0)
    out = []
    for i in range(0, len(prompts), 32):
        prompt_ids, prompt_mask = loaders.encode(tokenizer, prompts[i:i + 32], "cpu")
        sequences, actions = ppo.generate(smollm2, prompt_ids, prompt_mask, cfg, EOS)
        out.append((prompts[i:i + 32], prompt_ids, prompt_mask, sequences, actions))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ratio_is_exactly_one_on_real_smollm2(smollm2, real_samples, precision):
    """The post's probe: reference (generation side) vs a fresh policy (training path)."""
    if precision == "bf16" and not loaders.native_bf16("cpu"):
        # Emulated bf16 ran at ~1 GFLOP/s on a CPU without AVX512-BF16: this pass would take
        # most of CI's time. The tiny-model bf16 test above checks the same invariant.
        pytest.skip("this CPU has no native bf16 matmuls (AVX512-BF16 or AMX)")
    policy = with_lora(copy.deepcopy(smollm2))
    head = ppo.ValueHead(smollm2.config.hidden_size)
    _, _, prompt_mask, sequences, actions = real_samples[0]
    attention = ppo.full_mask(prompt_mask, actions)
    mask = response_mask(actions, EOS).bool()
    cfg = ppo.parse_args(["--preset", "tiny", "--precision", precision])
    with loaders.precision(cfg, "cpu"):
        with torch.no_grad():                                # the old pass
            logp_old = ppo.token_log_probs(smollm2, sequences, attention, actions)
        logp, _, _ = ppo.policy_forward(policy, head, sequences, attention, actions)  # with grad
    assert logp.requires_grad
    ratio = (logp - logp_old).exp()[mask]
    assert ratio.numel() > 100
    assert ratio.min().item() == 1.0 and ratio.max().item() == 1.0     # exactly, in fp32


@pytest.mark.slow
def test_decode_then_encode_is_not_a_round_trip_and_trips_the_check(smollm2, tokenizer,
                                                                    real_samples):
    changed, total, tripped = 0, 0, 0
    for prompts, _, prompt_mask, sequences, actions in real_samples:
        mask = response_mask(actions, EOS).bool()
        for b in range(len(prompts)):
            ids = actions[b][mask[b]].tolist()
            text = tokenizer.decode(ids)
            again = tokenizer(text, add_special_tokens=False).input_ids
            total += 1
            if again == ids:
                continue
            changed += 1
            # Score the re-encoded ids as "old" and the sampled ids as "new", position by
            # position as far as both go: the two sides now see different tokens.
            n = min(len(ids), len(again))
            seq_new = torch.tensor([tokenizer(prompts[b]).input_ids + ids])
            seq_old = torch.tensor([tokenizer(prompts[b]).input_ids + again])
            with torch.no_grad():
                new = ppo.token_log_probs(smollm2, seq_new, torch.ones_like(seq_new),
                                          torch.tensor([ids]))[:, :n]
                old = ppo.token_log_probs(smollm2, seq_old, torch.ones_like(seq_old),
                                          torch.tensor([again]))[:, :n]
            with pytest.raises(ppo.RatioError, match="decoded"):
                ppo.check_ratio((new - old).exp())
            tripped += 1
    fraction = changed / total
    print(f"\ndecode-then-encode changed {changed} of {total} sampled summaries "
          f"({fraction:.1%}); the post says about one in twenty")
    assert 0 < fraction < 0.5 and tripped == changed


def test_summing_ratios_gives_the_length_and_trips_the_check():
    logp = torch.randn(4, 6)
    logp_old = logp.clone()                                  # before any step: identical
    ratio = (logp - logp_old).exp()                          # (B, T) all exactly 1
    wrong = ratio.sum(-1)                                    # (B,) summed ratios
    right = (logp - logp_old).sum(-1).exp()                  # (B,) exp of summed log-ratios
    assert torch.equal(wrong, torch.full((4,), 6.0))        # the sequence length
    assert ppo.check_ratio(right) == (1.0, 1.0)
    with pytest.raises(ppo.RatioError, match="summed"):
        ppo.check_ratio(wrong)


def test_tokens_after_eos_change_nothing(tiny, tokenizer):
    """Perturb every id after row 0's EOS: log-probs on real tokens, KL, advantages,
    loss and its gradient are unchanged, and the score sits on the EOS position."""
    prompt_ids, prompt_mask, actions = fake_batch(tokenizer)
    policy = with_lora(copy.deepcopy(tiny))
    with torch.no_grad():                                    # a non-trivial adapter
        for p in policy.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    torch.manual_seed(0)
    head = ppo.ValueHead(tiny.config.hidden_size)
    perturbed = actions.clone()
    perturbed[0, 3:] = torch.tensor([777, 1234, 4321])       # after the EOS at t = 2

    def everything(acts):
        mask = response_mask(acts, EOS)
        sequences = torch.cat([prompt_ids, acts], 1)
        attention = ppo.full_mask(prompt_mask, acts)
        with torch.no_grad():
            logp_ref = ppo.token_log_probs(tiny, sequences, attention, acts)
        policy.zero_grad()
        head.zero_grad()
        logp, values, entropy = ppo.policy_forward(policy, head, sequences, attention, acts,
                                                   with_entropy=True)
        logp_old = logp.detach() - 0.1                       # a moved policy
        rewards = shaped_rewards(logp_old, logp_ref, torch.tensor([1.0, 2.0, 3.0]), 0.1, mask)
        adv, ret = advantages_and_returns(rewards, values.detach(), mask)
        adv = whiten(adv, mask)
        pl, vl, el, _ = ppo.ppo_losses(logp, logp_old, adv, values, ret, mask=mask, clip=0.2,
                                       entropy=entropy)
        (pl + vl + el).backward()
        grad = torch.cat([p.grad.flatten() for p in policy.parameters() if p.requires_grad])
        return mask, rewards, adv, ret, pl, vl, el, grad

    a, b = everything(actions), everything(perturbed)
    assert torch.equal(a[0], b[0]) and a[0][0].tolist() == [1, 1, 1, 0, 0, 0]
    for x, y in zip(a[1:4], b[1:4]):                         # rewards, adv, ret
        assert torch.allclose(x, y, atol=1e-6)
        assert (x[0, 3:] == 0).all()                         # nothing after the EOS
    assert a[1][0, 2] > 0.9                                  # the score 1.0 sits on the EOS
    for x, y in zip(a[4:], b[4:]):                           # losses and the gradient
        assert torch.allclose(x, y, atol=1e-6)


@pytest.mark.parametrize("adv, objective, has_grad", [(2.0, 2.4, False), (-2.0, -3.0, True)])
def test_clip_asymmetry(adv, objective, has_grad):
    """rho = 1.5, eps = 0.2: A = +2 gives 2.4 with no gradient, A = -2 gives -3.0 with one."""
    logp_old = torch.zeros(1, 1)
    logp = torch.full((1, 1), torch.tensor(1.5).log().item(), requires_grad=True)
    mask, adv_t = torch.ones(1, 1), torch.full((1, 1), adv)
    pl, _, _, stats = ppo.ppo_losses(logp, logp_old, adv_t, torch.zeros(1, 1),
                                     torch.zeros(1, 1), mask=mask, clip=0.2)
    assert -pl.item() == pytest.approx(objective, abs=1e-5)   # (10) L = -J
    pl.backward()
    assert (logp.grad.abs().item() > 0.1) == has_grad
    assert stats["clipfrac"].item() == 1.0                    # |rho - 1| > eps either way


def test_micro_batches_add_up_to_the_full_batch_loss():
    torch.manual_seed(0)
    logp, logp_old, adv = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)
    values, ret = torch.randn(4, 5), torch.randn(4, 5)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    full = ppo.ppo_losses(logp, logp_old, adv, values, ret, mask=mask, entropy=logp.exp())
    n_tok = mask.sum()
    halves = [ppo.ppo_losses(logp[r], logp_old[r], adv[r], values[r], ret[r], mask=mask[r],
                             entropy=logp[r].exp(), n_seq=4, n_tok=n_tok)
              for r in (slice(0, 2), slice(2, 4))]
    for k in range(3):                                       # policy, value, entropy terms
        assert halves[0][k] + halves[1][k] == pytest.approx(full[k].item(), abs=1e-6)


def test_reward_flag_picks_a_part_and_defaults_to_content():
    assert rm.DEFAULT_PART == "content" and set(rm.PARTS) == {"content", "full"}
    assert ppo.parse_args(["--preset", "tiny"]).reward == "content"
    assert ppo.parse_args(["--preset", "tiny", "--reward", "full"]).reward == "full"
    with pytest.raises(SystemExit):
        ppo.parse_args(["--preset", "tiny", "--reward", "length"])


def test_score_passes_the_part_to_the_reward_model(tokenizer, monkeypatch):
    prompt_ids, prompt_mask, actions = fake_batch(tokenizer)
    mask = response_mask(actions, EOS)
    parts = []

    def score_ids(model, p_ids, p_mask, r_ids, r_mask, part):
        parts.append(part)
        return torch.full((len(r_ids),), 1.0 if part == "full" else -1.0)

    monkeypatch.setattr(rm, "score_ids", score_ids)
    assert ppo.score(None, prompt_ids, prompt_mask, actions, mask).tolist() == [-1.0] * 3
    full = ppo.score(None, prompt_ids, prompt_mask, actions, mask, part="full")
    assert full.tolist() == [1.0] * 3
    assert parts == ["content", "full"]


def test_ended_with_eos():
    actions = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 9, 9]])     # (B, T)
    mask = response_mask(actions, EOS)
    assert measures.ended_with_eos(actions, mask, EOS).tolist() == [True, False, True]
    # An EOS outside the mask does not count.
    assert not measures.ended_with_eos(torch.tensor([[5, 6, 2]]), torch.tensor([[1, 1, 0]]),
                                       EOS).item()


def test_copied_bigrams():
    prompt = [1, 2, 3, 4]                                   # bigrams (1,2) (2,3) (3,4)
    # (2,3) (3,9) (9,2) (2,3): the two (2,3) are in the prompt, counted with repeats
    assert measures.copied_bigrams([2, 3, 9, 2, 3], prompt) == 0.5
    assert measures.copied_bigrams([1, 2, 3, 4], prompt) == 1.0
    assert measures.copied_bigrams([4, 3, 2, 1], prompt) == 0.0   # order matters
    assert measures.copied_bigrams([2], prompt) == measures.copied_bigrams([], prompt) == 0.0


def test_standard_error():
    assert measures.standard_error([1.0, 2.0, 3.0]) == pytest.approx(1 / 3 ** 0.5)   # s = 1
    assert measures.standard_error([4.0]) != measures.standard_error([4.0])          # NaN


def test_summarize_and_per_post_rows():
    samples = [{"reward": 1.0, "fluency": -2.0, "kl": 0.5, "length": 3, "ids": [7, 8, 2],
                "eos": True, "copied_bigrams": 0.5, "text": "a"},
               {"reward": 3.0, "fluency": -4.0, "kl": 1.5, "length": 4, "ids": [7, 8, 9, 9],
                "eos": False, "copied_bigrams": 0.0, "text": "b"}]
    got = measures.summarize(samples)
    assert got["reward"] == 2.0 and got["reward_se"] == pytest.approx(1.0)  # s = sqrt(2)
    assert got["eos_fraction"] == 0.5 and got["copied_bigrams"] == 0.25
    assert got["distinct_2"] == pytest.approx(4 / 5)                          # (7,8) twice
    ref = [{"reward": 0.5}, {"reward": 0.25}]
    rows = measures.per_post(samples, ("length", "eos", "text"), ref)
    assert rows == [{"post": 0, "reward": 1.0, "ref_reward": 0.5, "length": 3, "eos": True,
                     "text": "a"},
                    {"post": 1, "reward": 3.0, "ref_reward": 0.25, "length": 4, "eos": False,
                     "text": "b"}]


def test_the_table_prints_the_standard_error_and_the_gain(capsys):
    from support import report
    row = {"reward": 0.24, "reward_se": 0.18, "fluency": -41.5, "kl": 1.25, "length": 30.0,
           "eos_fraction": 0.75, "copied_bigrams": 0.5, "distinct_2": 0.8,
           "gain_over_ref": 0.32, "gain_over_ref_se": 0.23, "samples": [{}] * 32}
    report.print_row("0.1", row)
    report.print_row("human", {"reward": 1.5, "reward_se": 0.1})
    report.print_gain(row)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["0.1", "0.24", "±", "0.18", "-41.5", "1.25", "30.0", "0.75",
                                "0.50", "0.800"]
    assert lines[1].split() == ["human", "1.50", "±", "0.10"]
    assert lines[2] == "gain over (ref): +0.32 ± 0.23 (1.4 SE, paired over 32 posts)"


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, check=True).stdout


@pytest.mark.parametrize("part", ["content", "full"])
def test_score_is_the_reward_models_score_of_that_part(tiny_judge, tokenizer, part):
    """Exactly, with the rows in their own order (`micro_batches` sorts them by padding,
    which moves the last bit, ~2e-7 here); that `score` passes `part` at all is checked
    by the test above (the tiny reward model's two parts may well agree)."""
    model = rm.load_reward_model(tiny_judge)
    prompt_ids, prompt_mask, actions = fake_batch(tokenizer)
    mask = response_mask(actions, EOS)
    expected = rm.score_ids(model, prompt_ids, prompt_mask, actions, mask, part=part).float()
    in_order = [(torch.arange(len(actions)), 0)]                 # one group, nothing cut
    got = ppo.score(model, prompt_ids, prompt_mask, actions, mask, groups=in_order, part=part)
    assert torch.equal(got, expected)
    sorted_rows = ppo.score(model, prompt_ids, prompt_mask, actions, mask, part=part)
    assert torch.allclose(sorted_rows, expected, atol=1e-6)


@pytest.mark.slow
def test_tiny_run_end_to_end_and_resume(tiny_reward_model, tmp_path):
    common = ["ppo.py", "--preset", "tiny", "--reward-model", str(tiny_reward_model),
              "--beta", "0.1", "--checkpoint-every", "2"]
    out = run(*common, "--iterations", "4", "--out", str(tmp_path / "straight"))
    assert "ratio" in out and "human" in out and "reward=content" in out
    assert "gain over (ref): " in out and "paired over 4 posts" in out
    straight = json.loads((tmp_path / "straight" / "results.json").read_text())
    assert set(straight) == {"config", "commits", "iterations", "final", "machine"}
    kept = json.loads((tmp_path / "straight" / "summary.json").read_text())  # support/kept.py
    assert set(kept) == {"config", "iterations", "final", "machine"}
    assert kept["iterations"] == straight["iterations"]
    assert [s["reward"] for s in kept["final"]["samples"]] == \
        [s["reward"] for s in straight["final"]["samples"]]
    assert straight["config"]["reward"] == "content"
    final = straight["final"]
    assert {"reward_se", "eos_fraction", "copied_bigrams", "gain_over_ref",
            "gain_over_ref_se", "samples", "ref_samples", "human_samples"} <= set(final)
    assert {"reward_se", "eos_fraction", "copied_bigrams"} <= set(final["ref"])
    assert "reward_se" in final["human"]
    assert [s["post"] for s in final["samples"]] == [0, 1, 2, 3]      # eval_prompts 4
    assert set(final["samples"][0]) == {"post", "reward", "ref_reward", "length", "eos",
                                        "copied_bigrams", "kl", "text", "rouge_l",
                                        "retrieval_rank", "relevance_gap", "question",
                                        "asks_help"}
    # the measures the judge never saw (issue 25), for the policy, the reference and people
    outside = {"retrieval_top1", "retrieval_mrr", "relevance_gap", "relevance_gap_se",
               "question_fraction", "asks_for_help"}
    assert outside | {"rouge_l", "rouge_l_gain_over_ref", "retrieval_mrr_gain_over_ref",
                      "relevance_gap_gain_over_ref_se"} <= set(final)
    assert outside | {"rouge_l"} <= set(final["ref"]) and outside <= set(final["human"])
    assert all(1 <= s["retrieval_rank"] <= 4 for s in final["samples"])
    assert final["rouge_l_gain_over_ref"] == pytest.approx(
        final["rouge_l"] - final["ref"]["rouge_l"], abs=1e-9)        # paired mean
    page = (tmp_path / "straight" / "samples.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<tr>") == 1 + 4
    assert [s["ref_reward"] for s in final["samples"]] == \
        [s["reward"] for s in final["ref_samples"]]
    assert final["gain_over_ref"] == pytest.approx(
        final["reward"] - final["ref"]["reward"], abs=1e-6)           # paired mean = difference
    assert len(final["human_samples"]) == 4
    # the data's OpenAI 1.3B PPO summaries: a row scored by the judge, with the measures it
    # never saw, its length and copying, and a column of samples.html
    assert {"reward", "reward_se", "rouge_l", "retrieval_mrr", "length",
            "copied_bigrams"} <= set(final["openai_1b"])
    assert [s["post"] for s in final["openai_1b_samples"]] == [0, 1, 2, 3]
    assert final["openai_1b"]["reward"] == pytest.approx(
        sum(s["reward"] for s in final["openai_1b_samples"]) / 4)
    assert "OpenAI 1.3B PPO" in page and "OpenAI" in out
    keys = {"iteration", "reward", "kl", "response_length", "entropy", "clipfrac", "approx_kl",
            "value_loss", "ratio_min", "ratio_max", "beta", "seconds", "threads"}
    assert len(straight["iterations"]) == 4
    for row in straight["iterations"]:
        assert keys <= set(row)
        assert row["ratio_min"] == row["ratio_max"] == 1.0
    assert (tmp_path / "straight" / "curves.png").stat().st_size > 1000

    # Stop after 2 iterations (a checkpoint), then resume to 4: the same numbers. The
    # reference and human rows come from the judge's folder, where the first run left them.
    first = run(*common, "--iterations", "2", "--out", str(tmp_path / "resumed"))
    assert f"reference and human rows: from {tiny_reward_model / 'baselines'}" in first
    run(*common, "--iterations", "4", "--out", str(tmp_path / "resumed"), "--resume")
    resumed = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert len(resumed["commits"]) == 2 and resumed["commits"][0] == straight["commits"][0]
    assert report.differences(resumed, straight) == []      # iterations and final, all
    assert report.differences(resumed, {**straight, "final": {}}) != []   # it can tell


@pytest.mark.slow
def test_tiny_sweep_prints_the_posts_table(tiny_reward_model, tmp_path):
    out = run("ppo.py", "--preset", "tiny", "--reward-model", str(tiny_reward_model),
              "--beta", "0", "0.5", "--seeds", "0", "1", "--iterations", "1",
              "--out", str(tmp_path))
    assert ("| beta | runs | judge's reward: mean ± SE over seeds | worst to best "
            "| judge's gain over (ref) | MRR | MRR gain | ROUGE-L | ROUGE-L gain |") in out
    assert "| (ref) |" in out and "| people |" in out and "Spearman's rho" in out
    assert "Means over seeds peak at: judge's reward, beta = " in out
    assert "(highest judge's reward) | beta " in out                # the samples side by side
    assert "| beta | seed | judge's reward | judge's gain over (ref) |" in out     # every run
    assert "| beta | above (ref) by 2 SE: judge | MRR | ROUGE-L | all three |" in out
    assert (tmp_path / "sweep.md").read_text().strip() in out
    lines = out.splitlines()
    table = [line for line in lines if line.startswith(("| 0 | 2 |", "| 0.5 | 2 |",
                                                         "| OpenAI 1.3B PPO |"))]
    more = [line for line in lines if line.startswith(("| 0 | ", "| 0.5 | ")) and " of 2 |" in line]
    assert len(table) == 3 and {line.count("|") for line in table} == {17}      # 16 columns
    assert len(more) == 2 and {line.count("|") for line in more} == {12}
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["commits"] == [report.git_commit()]          # the code that made the table
    assert f"Code: {report.git_commit()} (git commits" in out
    assert sweep["summary"]["by_beta"]["0.5"]["runs"] == 2
    assert sorted((r["beta"], r["seed"]) for r in sweep["runs"]) == \
        [(0.0, 0), (0.0, 1), (0.5, 0), (0.5, 1)]
    for r in sweep["runs"]:                              # per-post rows stay in run_dir
        assert {"reward_se", "gain_over_ref", "gain_over_ref_se", "eos_fraction",
                "copied_bigrams"} <= set(r) and "samples" not in r
    assert "reward_se" in sweep["baseline"]["human"]
    assert (tmp_path / "sweep.png").exists()
    assert (tmp_path / "beta0.5_seed1" / "results.json").exists()


def test_a_nan_score_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_judge, data_dir,
                                                                      tiny, tokenizer,
                                                                      tmp_path, monkeypatch):
    """A NaN injected into one score of iteration 2: the run stops there with a message that
    names the quantity and the iteration; the checkpoint of iteration 1 is untouched and
    results.json holds iterations 0 and 1 only. (Without the guard the NaN reaches the
    adapter, and sampling fails on NaN probabilities one iteration later.)"""
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", "4", "--checkpoint-every", "1",
                          "--out", str(tmp_path)])
    posts = loaders.load_tldr()[:30]
    pool = [{**p, "prompt": prompt} for p in posts
            if (prompt := loaders.fit_prompt(tokenizer, p, cfg.prompt_tokens))][:8]
    models = (tiny, rm.load_reward_model(tiny_judge), tokenizer, torch.device("cpu"))
    real_score, real_save, saved = ppo.score, ppo.save_checkpoint, {}

    def score(*args, **kwargs):                 # the third call is iteration 2
        scores = real_score(*args, **kwargs)
        score.calls = getattr(score, "calls", 0) + 1
        return scores.index_fill(0, torch.tensor([1]), float("nan")) if score.calls == 3 \
            else scores

    def save_checkpoint(run_dir, *args, **kwargs):      # the last checkpoint's files
        real_save(run_dir, *args, **kwargs)
        saved.clear()
        saved.update({p.name: p.read_bytes() for p in (run_dir / "checkpoint").iterdir()})

    monkeypatch.setattr(ppo, "score", score)
    monkeypatch.setattr(ppo, "save_checkpoint", save_checkpoint)
    with pytest.raises(report.NonFiniteError, match=r"iteration 2: the score is NaN or inf in 1 "
                                                 r"of 4 values"):
        ppo.train(cfg, 0.1, 0, models, pool, tmp_path, progress=False)
    checkpoint = tmp_path / "checkpoint"
    assert json.loads((checkpoint / "state.json").read_text())["iteration"] == 1
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == saved
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["iteration"] for row in results["iterations"]] == [0, 1]


def test_a_nan_gradient_with_a_finite_loss_stops_the_run_before_the_step(
        tiny_judge, data_dir, tiny, tokenizer, tmp_path, monkeypatch):
    """The loss finite and one gradient value NaN in iteration 2: the run stops there before
    AdamW steps on it (every weight stays finite), naming the gradient; the checkpoint of
    iteration 1 and results.json's rows 0 and 1 are all that is saved."""
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", "4", "--checkpoint-every", "1",
                          "--out", str(tmp_path)])
    posts = loaders.load_tldr()[:30]
    pool = [{**p, "prompt": prompt} for p in posts
            if (prompt := loaders.fit_prompt(tokenizer, p, cfg.prompt_tokens))][:8]
    models = (tiny, rm.load_reward_model(tiny_judge), tokenizer, torch.device("cpu"))
    real_accumulate, held = ppo.accumulate_gradients, {}

    def accumulate_gradients(policy, value_head, batch, *args):
        log, ratios = real_accumulate(policy, value_head, batch, *args)
        held["weights"] = [*policy.parameters(), *value_head.parameters()]
        if batch.iteration == 2:
            value_head.project.bias.grad.fill_(float("nan"))       # the loss stays finite
        return log, ratios

    monkeypatch.setattr(ppo, "accumulate_gradients", accumulate_gradients)
    with pytest.raises(report.NonFiniteError,
                       match=r"^iteration 2: the gradient is NaN or inf in 1 of \d+ values"):
        ppo.train(cfg, 0.1, 0, models, pool, tmp_path, progress=False)
    assert all(torch.isfinite(p).all() for p in held["weights"])
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["iteration"] == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["iteration"] for row in results["iterations"]] == [0, 1]


def test_check_finite_names_the_quantity():
    ppo.check_finite(0, loss=torch.tensor(1.0), advantage=torch.zeros(2, 3))
    with pytest.raises(report.NonFiniteError, match="iteration 7: the advantage is NaN or inf "
                                                 "in 2 of 6"):
        ppo.check_finite(7, loss=torch.tensor(1.0),
                         advantage=torch.tensor([[0, float("inf"), 0], [float("nan"), 0, 0]]))


@pytest.mark.slow
def test_a_killed_sweep_resumes_to_the_uninterrupted_table(tiny_reward_model, small_data,
                                                           tmp_path):
    """Kill a sweep in its second run, resume it: the first run is skipped, the second
    continues from its checkpoint, the reference rows are read back rather than sampled,
    and every number equals an uninterrupted sweep's."""
    common = ["ppo.py", "--preset", "tiny", "--reward-model", str(tiny_reward_model),
              "--data-dir", str(small_data), "--beta", "0", "0.5", "--iterations", "4",
              "--checkpoint-every", "1"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(*common, "--out", str(straight))
    process = subprocess.Popen([sys.executable, *common, "--out", str(killed)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = killed / "beta0.5_seed0" / "checkpoint" / "state.json"
    deadline = time.time() + 300
    while not second.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.kill()
    process.wait()
    assert second.exists() and not (killed / "sweep.json").exists()     # killed mid-sweep
    out = run(*common, "--out", str(killed), "--resume")
    assert "beta0_seed0: finished before, skipped" in out
    assert "resumed " in out and "reference and human rows: from " in out
    for name in ("beta0_seed0", "beta0.5_seed0"):
        a, b = (json.loads((d / name / "results.json").read_text()) for d in (straight, killed))
        assert report.differences(a, b) == []
    a, b = (json.loads((d / "sweep.json").read_text()) for d in (straight, killed))
    assert report.differences(a, b) == []


@pytest.mark.slow
def test_a_failed_run_is_a_row_of_the_sweep(tiny_judge, small_data, tmp_path,
                                            monkeypatch, capsys):
    """A run that goes NaN in a sweep is recorded, shown and skipped on --resume; the
    others run. (The NaN guard itself: the test above the sweep's.)"""
    real_train = ppo.train

    def train(cfg, beta, seed, *args, **kwargs):
        if beta == 0.5:
            raise report.NonFiniteError("iteration 0: the score is NaN or inf in 1 of 4 values")
        return real_train(cfg, beta, seed, *args, **kwargs)

    monkeypatch.setattr(ppo, "train", train)
    argv = ["--preset", "tiny", "--reward-model", str(tiny_judge), "--data-dir",
            str(small_data), "--beta", "0", "0.5", "--iterations", "1", "--out", str(tmp_path)]
    ppo.main(argv)
    out = capsys.readouterr().out
    assert "beta=0.5 seed 0: failed: iteration 0: the score is NaN" in out
    assert "| 0.5 | 0 | — |" in out                     # its beta, with no finished run
    assert "(highest judge's reward)" not in out        # one beta done: no best beside worst
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [(r["beta"], "failed" in r) for r in sweep["runs"]] == [(0.0, False), (0.5, True)]
    assert "openai_1b" not in sweep["baseline"]     # small_data's CSV has no 1.3B summaries
    ppo.main(argv + ["--resume"])
    assert "beta0.5_seed0: finished before, skipped" in capsys.readouterr().out


def test_differences_ignore_circumstances_and_rounding_but_nothing_else():
    run = {"config": {"beta": 0.1, "out": "a"}, "commits": ["abc"], "final": {"text": "hi"},
           "iterations": [{"reward": 1.0, "seconds": 3.0, "seconds_update": 1.0,
                           "threads": 2, "peak_memory_gb": 1.5, "eos": True}]}
    other = json.loads(json.dumps(run))
    other["commits"], other["iterations"][0].update(seconds=9.0, threads=1, peak_memory_gb=2)
    assert report.differences(run, other) == []                   # circumstances only
    other["iterations"][0]["reward"] = 1.0 + 1e-8                # a last-bit rounding
    assert report.differences(run, other) == []
    other["iterations"][0]["reward"] = 1.0 + 1e-4                # a real difference
    assert report.differences(run, other) == [".iterations[0].reward: 1.0 != 1.0001"]
    for change in ({"text": "ho"}, {"eos": False}, {}):
        broken = json.loads(json.dumps(run))
        broken["final"] = change
        assert report.differences(run, broken)
    assert report.differences([1, 2], [1, 2, 3]) and report.differences({"a": 1}, {"b": 1})


def tables_run(seed, reward, kl, **changes):
    """A finished run's row as the tables read it (finished_row with its words)."""
    return {"beta": 0.0, "seed": seed, "reward": reward, "kl": kl, "reward_se": 0.1,
            "gain_over_ref": reward + 1, "gain_over_ref_se": 0.2, "retrieval_mrr": 0.4,
            "retrieval_mrr_gain_over_ref": 0.1, "retrieval_mrr_gain_over_ref_se": 0.04,
            "rouge_l": 0.2, "rouge_l_gain_over_ref": 0.05, "rouge_l_gain_over_ref_se": 0.03,
            "words": 20.0, "eos_fraction": 0.5, "copied_bigrams": 0.25, "asks_for_help": 0.0,
            **changes}


def test_tables_mean_over_seeds_with_their_se():
    """Two seeds: rewards -0.5 and -0.3 (mean -0.40, SE = SD 0.1414 / sqrt 2 = 0.10), ROUGE-L
    gains 0.05 and 0.07 (+0.060 ± 0.010); one seed has no SE; a run without a measure (from
    before it existed) makes its cell a dash."""
    runs = [tables_run(0, -0.5, 7.0), tables_run(1, -0.3, 5.0, rouge_l=0.3,
                                                  rouge_l_gain_over_ref=0.07, words=31.0)]
    assert tables.group_cells(runs) == [
        "-0.40 ± 0.10", "-0.50 to -0.30", "+0.60 ± 0.10", "0.400", "+0.100 ± 0.000", "0.250",
        "+0.060 ± 0.010", "26", "50%", "25%", "0%", "6.00", "—", "—"]
    # the clip statistics (tables.with_words): mean share clipped, the ratio's widest range
    clipped = [{**r, "clipfrac": c, "ratio_after": after} for r, c, after in zip(
        runs, (0.01, 0.03), ((0.9, 1.2), (0.8, 1.1)))]
    assert tables.group_cells(clipped)[-2:] == ["2.00%", "0.80 to 1.20"]
    assert tables.group_cells(runs[:1])[:3] == ["-0.50", "-0.50 to -0.50", "+0.50"]
    old = {k: v for k, v in runs[0].items() if not k.startswith("rouge_l")}
    assert tables.group_cells([old, runs[1]])[5:7] == ["—", "—"]


def test_tables_fixed_rows_and_the_groups_line_up():
    measures = {"reward": -1.0, "reward_se": 0.25, "retrieval_mrr": 0.6, "asks_for_help": 0.5,
                "copied_bigrams": 0.125}
    base = {"baseline": {"ref": {**measures, "rouge_l": 0.15, "eos_fraction": 0.75, "kl": 0.0},
                         "start": {**measures, "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                   "rouge_l": 0.1, "eos_fraction": 0.0, "kl": 3.0},
                         "human": measures},
            "baseline_posts": {name: [{"text": "one two"}, {"text": "three"}] for name in
                               ("ref_samples", "start_samples", "human_samples")}}
    text = tables.markdown("beta", [("0", [tables_run(0, -0.5, 7.0)]), ("2", [])], base,
                           extra=[("more", ["a", "b"])])
    lines = text.splitlines()
    assert len({line.count("|") for line in lines}) == 1                # the columns line up
    assert lines[3].startswith("| 2 | 0 | — |") and lines[3].endswith("| b |")
    assert lines[4] == ("| SFT (ref) | | -1.00 ± 0.25 (over posts) | | | 0.600 | | 0.150 "
                        "| | 2 | 75% | 12% | 50% | 0.00 | | | |")
    assert lines[5].startswith("| SmolLM2-135M-Instruct (start) | | -1.00")
    assert lines[6].startswith("| people |") and "| — | | 2 | — |" in lines[6]    # 1.5 words


def test_tables_count_the_runs_above_sft_and_name_the_peaks():
    """Above SFT by 2 SE: the judge's gain 0.5 > 2 x 0.2 and 0.3 < 0.4; MRR 0.1 > 0.08 in
    both; ROUGE-L 0.05 < 0.06 in one, 0.07 > 0.06 in the other."""
    runs = [tables_run(0, -0.5, 7.0), tables_run(1, -0.7, 5.0, rouge_l_gain_over_ref=0.07)]
    assert tables.beside_sft(runs) == {"judge's reward": 1, "MRR": 2, "ROUGE-L": 1,
                                       "all three": 0}
    high_mrr = [tables_run(0, -1.0, 1.0, retrieval_mrr=0.9)]
    assert tables.peaks([("0", runs), ("2", high_mrr), ("5", [])]) == {
        "judge's reward": "0", "MRR": "2", "ROUGE-L": "0"}


def test_spearman_on_known_ranks():
    assert measures.ranks([10, 30, 20, 20]) == [1, 4, 2.5, 2.5]
    assert measures.spearman([0, 0.01, 0.1, 0.5, 2], [9, 7, 5, 3, 1]) == pytest.approx(-1)
    assert measures.spearman([1, 2, 3], [1, 4, 9]) == pytest.approx(1)     # monotone, not linear
    # x ranks 1,2,3,4, y ranks 2,1,4,3: rho = 1 - 6 * 4 / (4 * 15) = 0.6
    assert measures.spearman([1, 2, 3, 4], [5, 1, 9, 7]) == pytest.approx(0.6)
    assert math.isnan(measures.spearman([1, 1, 1], [1, 2, 3]))


def test_sweep_summary_on_known_runs():
    def run(beta, reward, kl):
        return {"beta": beta, "reward": reward, "kl": kl, "gain_over_ref": reward + 1,
                "fluency": -reward, "length": 10, "distinct_2": 0.5, "eos_fraction": 1,
                "copied_bigrams": 0.1, "value_loss_last20": 2}
    table = [run(0, 1.0, 9), run(0, 2.0, 8), run(0, 3.0, 7), run(2, 0.0, 1), run(2, 0.5, 2)]
    baseline = {"ref": {"reward": -1.0}, "human": {"reward": 5.0}}
    summary = report.sweep_summary(table, baseline)
    zero = summary["by_beta"][0]
    assert (zero["runs"], zero["reward"], zero["reward_worst"], zero["reward_best"]) == \
        (3, 2.0, 1.0, 3.0)
    assert zero["reward_se_seeds"] == pytest.approx(1 / math.sqrt(3))     # sd 1 over 3 seeds
    assert zero["fluency_per_token"] == pytest.approx(-0.2)     # -0.1, -0.2, -0.3 a token
    assert summary["best_beta"] == 0
    assert summary["best_fraction_of_ref_to_human"] == pytest.approx((2 - -1) / (5 - -1))
    # ranks: beta 2,2,2,4.5,4.5 and KL 5,4,3,1,2; centred: (-1,-1,-1,1.5,1.5), (2,1,0,-2,-1)
    assert summary["spearman_beta_kl"] == pytest.approx(-7.5 / math.sqrt(7.5 * 10))



def test_fluency_per_token_is_each_runs_ratio_then_the_mean():
    """Two seeds at -10 nats over 5 tokens (-2 a token) and -30 over 10 (-3): the column is
    -2.5, not the ratio of the means (-40 / 15 = -2.67). An empty sample has no rate."""
    def run(fluency, length):
        return {"beta": 0, "reward": 0.0, "kl": 0.0, "gain_over_ref": 0.0, "fluency": fluency,
                "length": length, "distinct_2": 0.5, "eos_fraction": 1,
                "copied_bigrams": 0.1, "value_loss_last20": 1}
    baseline = {"ref": {"reward": -1.0}, "human": {"reward": 1.0}}
    summary = report.sweep_summary([run(-10.0, 5), run(-30.0, 10)], baseline)
    assert summary["by_beta"][0]["fluency_per_token"] == pytest.approx(-2.5)
    assert report.fluency_per_token({"fluency": -4.0, "length": 2}) == -2.0
    assert math.isnan(report.fluency_per_token({"fluency": 0.0, "length": 0}))


def test_question_fraction_and_median_sample():
    assert measures.question_fraction(["Why?", "ok.", "what now? \n", "?!"]) == 0.5
    assert measures.question_fraction([]) == 0.0
    samples = [{"reward": r, "text": t} for r, t in ((3, "c"), (1, "a"), (4, "d"), (2, "b"))]
    assert measures.median_sample(samples)["text"] == "b"           # lower of the middle two
    assert measures.median_sample(samples[:3])["text"] == "c"


def test_sweep_samples_pools_seeds_and_names_the_median():
    def sample(post, reward, text):
        return {"post": post, "reward": reward, "text": text}
    results = {"a": {"final": {"samples": [sample(0, 1.0, "Help?"), sample(1, 3.0, "ok")]}},
               "b": {"final": {"samples": [sample(0, 2.0, "fine | done"),
                                           sample(1, 0.0, "Why?")]}}}
    table = [{"beta": 0.0, "run_dir": "a"}, {"beta": 0.0, "run_dir": "b"}]
    posts = {"human_samples": [sample(0, 0.5, "people's zero?"), sample(1, 0.1, "one")],
             "ref_samples": [sample(0, -2.0, "long"), sample(1, -1.0, "longer")]}
    lines = report.sweep_samples(table, results, posts).splitlines()
    # rewards 0, 1, 2, 3 pooled over both seeds: the median is "Help?" (1.0), on post 0
    assert lines[2] == ("| 0 | 0.50 (0.50, 0.50) | 'Help?' (+1.00) | \"people's zero?\" |")
    assert lines[3] == "| (ref) | 0.00 | 'long' (-2.00) | |"
    assert lines[4] == "| human | 0.50 | 'one' (+0.10) | |"

def test_per_run_table_gives_each_gain_with_its_se_over_posts():
    runs = [tables_run(1, -0.7, 5.0, beta=0.1), tables_run(0, -0.5, 7.0, beta=0.1),
            {**tables_run(0, 0.2, 9.0), "words": 12.4}]
    lines = report.per_run_markdown(runs).splitlines()
    assert [line.split(" | ")[:2] for line in lines[2:]] == [["| 0", "0"], ["| 0.1", "0"],
                                                             ["| 0.1", "1"]]
    assert lines[2] == ("| 0 | 0 | 0.20 ± 0.10 | +1.20 ± 0.20 | +0.100 ± 0.040 "
                        "| +0.050 ± 0.030 | 9.00 | 12 |")


def test_side_by_side_shows_the_best_and_worst_betas_lowest_seed_on_the_first_posts():
    def sample(post, reward, text):
        return {"post": post, "reward": reward, "text": text}
    results = {d: {"final": {"samples": [sample(0, r, f"{d} zero"), sample(1, r, f"{d} one")]}}
               for d, r in (("b0s1", 1.0), ("b0s0", 3.0), ("b2s0", -1.0), ("b1s0", 0.0))}
    table = [{"beta": 0.0, "seed": 1, "reward": 1.0, "run_dir": "b0s1"},
             {"beta": 0.0, "seed": 0, "reward": 3.0, "run_dir": "b0s0"},   # beta 0: mean 2
             {"beta": 2.0, "seed": 0, "reward": -1.0, "run_dir": "b2s0"},
             {"beta": 1.0, "seed": 0, "reward": 0.0, "run_dir": "b1s0"}]
    posts = {"ref_samples": [sample(1, -2.0, "ref one"), sample(0, -1.0, "ref | zero")],
             "human_samples": [sample(0, 0.5, "people zero"), sample(1, 0.1, "people one")]}
    lines = report.side_by_side(table, results, posts, n=1).splitlines()
    assert lines[0] == ("| post | beta 0, seed 0 (highest judge's reward) | beta 2, seed 0 "
                        "(lowest) | the reference | people |")
    assert lines[2] == ("| 0 | 'b0s0 zero' (+3.00) | 'b2s0 zero' (-1.00) | 'ref / zero' (-1.00) "
                        "| 'people zero' (+0.50) |") and len(lines) == 3


# ------------------------------------------- --estimator, --samples-per-prompt, value options

def test_value_clipping_on_a_hand_computed_example():
    """eps_v = 0.2, V_old = 1, R = 2. V = 1.5: plain (1.5-2)^2 = 0.25, clipped V_old+0.2 = 1.2,
    (1.2-2)^2 = 0.64, the max is 0.64. V = 2.5: 0.25 against (1.2-2)^2 = 0.64 -> 0.64.
    V = 0.9: 1.21 against (0.9-2)^2 = 1.21 (inside the clip range) -> 1.21."""
    values = torch.tensor([[1.5, 2.5, 0.9]], requires_grad=True)
    ones = torch.ones(1, 3)
    _, vl, _, _ = ppo.ppo_losses(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3),
                                 values, 2 * ones, mask=ones, values_old=ones, value_clip=0.2)
    assert vl.item() == pytest.approx((0.64 + 0.64 + 1.21) / 3)
    # where the clipped term is the max, the value gets no gradient from it
    (grad,) = torch.autograd.grad(vl, values)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0, 2 * (0.9 - 2) / 3])
    _, plain, _, _ = ppo.ppo_losses(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3),
                                    values, 2 * ones, mask=ones)
    assert plain.item() == pytest.approx((0.25 + 0.25 + 1.21) / 3)


@pytest.mark.parametrize("argv, flag", [
    (["--estimator", "rloo"], "--samples-per-prompt"),
    (["--estimator", "grpo", "--samples-per-prompt", "1"], "--samples-per-prompt"),
    (["--estimator", "rloo", "--samples-per-prompt", "2", "--value-clip", "0.2"],
     "--value-clip"),
    (["--estimator", "reinforce", "--whiten-rewards"], "--whiten-rewards"),
])
def test_estimator_flags_that_make_no_sense_are_refused(argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        ppo.parse_args(["--preset", "tiny", *argv])
    assert stop.value.code == 2 and flag in capsys.readouterr().err.splitlines()[-1]


def tiny_pool(tokenizer, n=8, tokens=64):
    posts = loaders.load_tldr()[:30]
    return [{**p, "prompt": prompt} for p in posts
            if (prompt := loaders.fit_prompt(tokenizer, p, tokens))][:n]


@pytest.mark.parametrize("argv", [
    ["--estimator", "gae"],
    ["--estimator", "gae", "--value-clip", "0.2", "--value-init", "reward", "--whiten-rewards"],
    ["--estimator", "rloo", "--samples-per-prompt", "2"],
    ["--estimator", "reinforce"],
    ["--estimator", "grpo", "--samples-per-prompt", "2"],
    ["--estimator", "grpo", "--samples-per-prompt", "2", "--grpo-unbiased"],
])
def test_every_estimator_trains_with_the_ratio_exactly_one(argv, tiny_judge, data_dir, tiny,
                                                           tokenizer, tmp_path):
    """Two iterations on the tiny model: the ratio is exactly 1 at every first inner step
    (check_ratio would raise otherwise), the batch holds --batch x k responses, and only
    gae has a value head."""
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", "2", "--batch", "2",
                          "--out", str(tmp_path), *argv])
    reward = rm.load_reward_model(tiny_judge)
    models = (tiny, reward, tokenizer, torch.device("cpu"))
    _, value_head, results = ppo.train(cfg, 0.1, 0, models, tiny_pool(tokenizer), tmp_path,
                                       progress=False)
    assert (value_head is None) == (cfg.estimator != "gae")
    for row in results["iterations"]:
        assert row["ratio_min"] == row["ratio_max"] == 1.0
        assert (row["explained_variance"] is None) == (cfg.estimator != "gae")
        assert row["value_loss"] == 0.0 or cfg.estimator == "gae"


def test_value_init_reward_copies_the_reward_models_head(tiny_judge):
    reward = rm.load_reward_model(tiny_judge)
    head = ppo.init_value_head(ppo.ValueHead(reward.head.in_features), "reward", reward)
    hidden = torch.randn(3, reward.head.in_features)
    with torch.no_grad():
        assert torch.allclose(head(hidden), reward.head(hidden).squeeze(-1) + reward.bias)
        assert ppo.init_value_head(head, "zero", reward)(hidden).abs().max().item() == 0.0


@pytest.mark.slow
def test_rloo_and_reinforce_resume_to_the_same_numbers(tiny_judge, data_dir, tiny, tokenizer,
                                                       tmp_path):
    """RLOO with k = 2 and a REINFORCE run, each stopped after one iteration and resumed:
    the same numbers as straight through (the REINFORCE baseline is in the checkpoint)."""
    reward = rm.load_reward_model(tiny_judge)
    models = (tiny, reward, tokenizer, torch.device("cpu"))
    pool = tiny_pool(tokenizer)
    for argv in (["--estimator", "rloo", "--samples-per-prompt", "2"],
                 ["--estimator", "reinforce"]):
        common = ["--preset", "tiny", "--batch", "2", "--checkpoint-every", "1", *argv]
        straight, resumed = tmp_path / f"{argv[1]}_a", tmp_path / f"{argv[1]}_b"
        for folder in (straight, resumed):
            folder.mkdir()
        cfg = ppo.parse_args(common + ["--iterations", "3"])
        _, _, a = ppo.train(cfg, 0.1, 0, models, pool, straight, progress=False)
        ppo.train(ppo.parse_args(common + ["--iterations", "1"]), 0.1, 0, models, pool,
                  resumed, progress=False)
        cfg = ppo.parse_args(common + ["--iterations", "3", "--resume"])
        _, _, b = ppo.train(cfg, 0.1, 0, models, pool, resumed, progress=False)
        assert report.differences(a["iterations"], b["iterations"]) == []


def test_each_sample_keeps_its_prompts_group(tiny_judge, data_dir, tiny, tokenizer, tmp_path,
                                             monkeypatch):
    """k = 3: the rows that share a group id were sampled from the same prompt, and rows of
    different groups from different prompts, whatever order micro-batching runs them in."""
    seen = {}
    real_generate, real_advantages = ppo.generate, ppo.sequence_advantages

    def generate(model, prompt_ids, *args):
        seen["prompts"] = prompt_ids.clone()
        return real_generate(model, prompt_ids, *args)

    def sequence_advantages(estimator, R, group, *args):
        seen["group"] = group.clone()
        return real_advantages(estimator, R, group, *args)

    monkeypatch.setattr(ppo, "generate", generate)
    monkeypatch.setattr(ppo, "sequence_advantages", sequence_advantages)
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", "1", "--batch", "3",
                          "--micro-batch", "2", "--estimator", "rloo",
                          "--samples-per-prompt", "3"])
    models = (tiny, rm.load_reward_model(tiny_judge), tokenizer, torch.device("cpu"))
    ppo.train(cfg, 0.1, 0, models, tiny_pool(tokenizer), tmp_path, progress=False)
    prompts, group = seen["prompts"], seen["group"]
    assert len(prompts) == 9 and group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for i in range(9):
        for j in range(9):
            assert torch.equal(prompts[i], prompts[j]) == (group[i] == group[j]).item()


@pytest.mark.slow
def test_compare_estimators_runs_a_setting_and_prints_the_table(tiny_reward_model, small_data,
                                                                tmp_path):
    out = run("-m", "tools.analysis.compare_estimators", "--preset", "tiny", "--reward-model",
              str(tiny_reward_model), "--seeds", "0", "--settings", "rloo_4x2", "--out",
              str(tmp_path), "--data-dir", str(small_data), "--iterations", "1")
    assert "--estimator rloo --batch 4 --samples-per-prompt 2" in out
    table = (tmp_path / "estimators.md").read_text()
    assert table.strip() in out
    assert "| rloo_4x2 | 1 |" in table and "| (ref) |" in table and "| people |" in table
    assert len({line.count("|") for line in table.splitlines()}) == 1     # columns line up
    assert (tmp_path / "estimators.png").stat().st_size > 1000
    again = run("-m", "tools.analysis.compare_estimators", "--preset", "tiny", "--reward-model",
                str(tiny_reward_model), "--seeds", "0", "--settings", "rloo_4x2", "--out",
                str(tmp_path), "--data-dir", str(small_data), "--iterations", "1")
    assert "=== rloo_4x2: every run is over, nothing to run" in again


def test_compare_estimators_table_means_over_seeds_and_the_shared_objective():
    run = {"seconds": 600.0, "failed": None, "setting": "rloo_2x4"}
    runs = [{**tables_run(0, -0.5, 7.0), **run}, {**tables_run(1, -0.3, 5.0), **run},
            {"setting": "reinforce", "seed": 0, "failed": "NaN in the loss"}]
    text = compare_estimators.table(runs, None, 0.1, ["gae", "rloo_2x4", "reinforce"])
    # rewards -0.5, -0.3: mean -0.40, SE 0.10; reward - 0.1 KL: -1.2, -0.8: mean -1.00, SE 0.20
    assert "| rloo_2x4 | 2 | -0.40 ± 0.10 | -0.50 to -0.30 |" in text
    assert text.splitlines()[3].endswith("| 6.00 | — | — | -1.00 ± 0.20 | 10.0 |")
    assert "| reinforce (1 failed) (0 of 1) | 0 | — |" in text and "| gae (0 of 0) | 0 |" in text
    assert "reinforce seed 0: failed: NaN in the loss" in text
    assert len({line.count("|") for line in text.splitlines() if "|" in line}) == 1


def test_compare_estimators_takes_ppo_from_the_beta_sweep_at_its_budget(tmp_path):
    """--gae-runs: PPO's runs are the sweep's beta{b}_seed{s} folders, read, not rerun; a
    run at another budget or beta is refused in one line."""
    sweep = tmp_path / "sweep"
    for seed in (0, 1):
        final = {**tables_run(seed, -0.5, 7.0), "samples": [{"text": "a b c"}]}
        config = {"estimator": "gae", "batch": 8, "samples_per_prompt": 1, "beta": 0.1,
                  "preset": "cpu", "seed": seed}
        (sweep / f"beta0.1_seed{seed}").mkdir(parents=True)
        (sweep / f"beta0.1_seed{seed}" / "results.json").write_text(json.dumps(
            {"config": config, "iterations": [{"seconds": 60.0}], "final": final}))
    args = SimpleNamespace(gae_runs=str(sweep), out=str(tmp_path / "out"), beta=0.1,
                           seeds=[0, 1], preset="cpu")
    got = compare_estimators.rows("gae", args)
    assert [(r["seed"], r["words"], r["seconds"]) for r in got] == [(0, 3.0, 60.0), (1, 3.0, 60.0)]
    assert compare_estimators.run_setting("gae", args) == 0          # nothing to run
    with pytest.raises(cli.UserError, match=r"the gae run of seed 0 has preset cpu \(not blog\)"):
        compare_estimators.rows("gae", SimpleNamespace(**{**vars(args), "preset": "blog"}))


@pytest.mark.slow
def test_compare_estimators_times_each_setting(tiny_reward_model, small_data, tmp_path):
    out = run("-m", "tools.analysis.compare_estimators", "--preset", "tiny", "--reward-model",
              str(tiny_reward_model), "--time", "2", "--settings", "rloo_4x2", "reinforce",
              "--data-dir", str(small_data), "--out", str(tmp_path / "unused"))
    assert "tiny preset, beta 0.1, seed 0, 2 iterations each: mean seconds an iteration" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["iteration", "±"])
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["rloo_4x2",
                                                                          "reinforce"]
    numbers = [float(x) for x in lines[header + 1].split()[1:]]
    assert len(numbers) == 8 and numbers[0] > 0         # s/it, SE, 4 phases, length, wall
    assert not (tmp_path / "unused").exists()                    # temporary folders only


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["gae", "rloo", "reinforce", "grpo"])
def test_the_ratio_is_exactly_one_for_every_estimator_on_real_smollm2(
        estimator, smollm2, tiny_reward_model, tokenizer, tmp_path):
    """One iteration of each estimator with the real SmolLM2 as reference and policy: the
    ratio at the first inner step is exactly 1 (fp32), as check_ratio enforces."""
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", "1", "--batch", "2",
                          "--estimator", estimator, "--samples-per-prompt", "2",
                          "--out", str(tmp_path)])
    models = (smollm2, rm.load_reward_model(tiny_reward_model), tokenizer,
              torch.device("cpu"))
    _, _, results = ppo.train(cfg, 0.1, 0, models, tiny_pool(tokenizer), tmp_path,
                              progress=False)
    row = results["iterations"][0]
    assert row["ratio_min"] == row["ratio_max"] == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("estimator", ["gae", "rloo"])
def test_the_ratio_is_exactly_one_on_cuda_in_bf16(estimator, tiny_reward_model, tokenizer,
                                                  tmp_path):
    """Two iterations of the loop on the GPU, bf16 bodies and compiled Triton kernels: the
    ratio is exactly 1 at every first inner step (check_ratio would raise otherwise)."""
    device = torch.device("cuda")
    cfg = ppo.parse_args(["--preset", "tiny", "--iterations", "2", "--batch", "2",
                          "--precision", "bf16", "--estimator", estimator,
                          "--samples-per-prompt", "2", "--out", str(tmp_path)])
    models = (loaders.tiny_model(tokenizer, device=device),
              rm.load_reward_model(tiny_reward_model, device=device), tokenizer, device)
    _, _, results = ppo.train(cfg, 0.1, 0, models, tiny_pool(tokenizer), tmp_path,
                              progress=False)
    for row in results["iterations"]:
        assert row["ratio_min"] == row["ratio_max"] == 1.0


def test_same_numbers_finds_a_moved_number_and_lists_added_keys(tmp_path, capsys):
    """tools/same_numbers, the redesign's check: the same bits pass; a changed number, text
    or iteration fails; a key only the new run has is an addition, not a difference; the
    time a run took is ignored."""
    run = {"config": {"out": "a"}, "commits": ["x"], "iterations": [{"reward": 0.5}],
           "final": {"reward": -0.14, "samples": [{"text": "hi", "reward": 1.0}]}}
    metrics = {"heldout_accuracy": 0.672, "seconds": 1599.0, "extra": {"sampling_seconds": 9}}
    for name, data in (("before", (run, metrics)), ("after", (run, metrics))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(data[0]))
        (tmp_path / name / "metrics.json").write_text(json.dumps(data[1]))
    before, after = str(tmp_path / "before"), str(tmp_path / "after")
    assert same_numbers.main([before, after]) == 0
    changed = {**run, "config": {"out": "b"}, "final": {**run["final"], "new_measure": 3}}
    (tmp_path / "after" / "results.json").write_text(json.dumps(changed))
    (tmp_path / "after" / "metrics.json").write_text(json.dumps({**metrics, "seconds": 9.0}))
    assert same_numbers.main([before, after]) == 0       # another --out, a new key, the time
    assert "added: results.json.final.new_measure" in capsys.readouterr().out
    for broken in ({**run, "final": {**run["final"], "reward": -0.15}},
                   {**run, "iterations": []},
                   {**run, "final": {**run["final"], "samples": [{"text": "ho", "reward": 1.0}]}}):
        (tmp_path / "after" / "results.json").write_text(json.dumps(broken))
        assert same_numbers.main([before, after]) == 1
    assert "DIFFERS: results.json.final.samples[0].text: 'hi' != 'ho'" in capsys.readouterr().out


def test_the_csv_keeps_openais_summaries_where_it_has_them(tmp_path):
    query = "SUBREDDIT: r/a\n\nTITLE: b\n\nPOST: c d e\n\nTL;DR:"
    for header, row, expected in (
            (["", "query", "postprocessed_response", "reference_responses"],
             ["0", query, "  theirs ", " ours"], {"summary": "ours", "openai_1b": "theirs"}),
            (["", "query", "reference_responses"], ["0", query, " ours"], {"summary": "ours"})):
        path = tmp_path / "posts.csv"
        with open(path, "w", newline="") as sink:
            csv.writer(sink).writerows([header, row])
        post = loaders.read_tldr_csv(path)[0]
        assert {k: post[k] for k in ("summary", "openai_1b") if k in post} == expected


def test_floors_count_smollm2s_weights_and_each_phases_work():
    """tools/floors.py on SmolLM2's shape: 106.2M weights in the layers (30 x (2 x 576^2 +
    2 x 576 x 192 + 3 x 576 x 1536)), 28.3M in the head; at 1 GFLOP/s and 0.5 GB/s each
    phase's floor is its GFLOPs or its GB / 0.5, worked by hand."""
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    body, head = floors.layer_params(config)
    assert (body, head) == (106_168_320, 28_311_552)
    cfg = {"batch": 2, "max_new_tokens": 3, "inner_steps": 2}
    got = floors.phase_floors(config, cfg, prompt_tokens=10, gflops=1.0, gbs=0.5)
    one_pass = (2 * body * 2 * 13 + 2 * head * 2 * 3) / 1e9
    assert got["score"] == (pytest.approx(2 * body * 2 * 13 / 1e9), "FLOPs")
    assert got["forward"][0] == pytest.approx(2 * one_pass)
    assert got["update"][0] == pytest.approx(2 * 3 * one_pass)
    # generate: the prompt's FLOPs, then 2 steps, each reading 4 bytes a weight at 0.5 GB/s
    # (longer than its 2 x 2 FLOPs a weight at 1 GFLOP/s)
    prefill = (2 * body * 2 * 10 + 2 * head * 2) / 1e9
    assert got["generate"] == (pytest.approx(prefill + 2 * 4 * (body + head) / 0.5e9),
                               "weight reads")


def test_the_rows_kept_beside_the_judge_are_keyed_by_what_made_them(tiny_judge, tiny, tmp_path,
                                                                     capsys):
    """heldout.fingerprint changes with the judge's weights, the reference, the posts; a
    judge folder that cannot be written costs one line, not the run."""
    cfg = SimpleNamespace(reward_model=str(tiny_judge))
    posts = [{"prompt": "a post", "summary": "a TL;DR"}]
    models = (tiny, None, None, torch.device("cpu"))
    before = heldout.fingerprint(cfg, models, posts)
    assert heldout.fingerprint(cfg, models, posts) == before            # it is a function
    assert heldout.fingerprint(cfg, models, [{**posts[0], "summary": "other"}]) != before
    other = loaders.tiny_model(loaders.load_tokenizer(), seed=1)
    assert heldout.fingerprint(cfg, (other, None, None, torch.device("cpu")), posts) != before
    judge = tmp_path / "judge"
    shutil.copytree(tiny_judge, judge)
    (judge / "head.safetensors").write_bytes(b"another head")
    assert heldout.fingerprint(SimpleNamespace(reward_model=str(judge)), models, posts) != before
    key = {"fingerprint": before}
    path = heldout.judge_copy(SimpleNamespace(reward_model=str(judge)), key)
    heldout.keep_for_judge(SimpleNamespace(reward_model=str(judge)), {"key": key})
    assert json.loads(path.read_text()) == {"key": key}
    blocked = judge / "blocked"
    blocked.write_text("a file where the folder would be")
    heldout.keep_for_judge(SimpleNamespace(reward_model=str(blocked)), {"key": key})
    assert "not kept beside the judge" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_heldout_reads_back_the_same_rows(tiny_reward_model):
    kept = lambda: sorted((tiny_reward_model / "baselines").glob("*"))  # noqa: E731
    before = kept()
    out = run("-m", "tools.bench_heldout", "--reward-model", str(tiny_reward_model),
              "--preset", "tiny")
    assert "preset tiny, 4 posts, 1 model sampled" in out and "scored from the draws" in out
    assert out.rstrip().endswith("the same numbers: True")
    assert kept() == before                      # it worked on a copy of the judge's folder
