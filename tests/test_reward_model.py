"""Tests for reward_model.py: what the Bradley-Terry reward model has to get right.

Run:  python -m pytest -q tests/test_reward_model.py     (~1 min on 2 CPU cores)

Everything runs offline on the tiny model (SmolLM2's tokenizer, two random layers of
width 64), except one padding check on the real SmolLM2-135M, skipped when it is absent.
The only arithmetic written out here is the oracles: log(1 + e^-1) for (R1), a textbook
Wilson interval for (R4), log(1 + tokens) for (R5), and small hand-counted metrics.
"""
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # no 3 s wait for an unreachable hub

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import loaders  # noqa: E402
import lora  # noqa: E402
import ppo  # noqa: E402
import reward_model as rm  # noqa: E402
from support import cli, report, rm_data, rm_report  # noqa: E402

METRIC_KEYS = {"heldout_accuracy", "wilson_low", "wilson_high", "heldout_pairs",
               "length_baseline_accuracy", "shorter_preferred_accuracy", "train_pairs",
               "seconds", "default_part", "length_weight", "length_matched_accuracy",
               "reference_pairs", "off_post_pairs", "off_post_sample_pairs",
               "relevance_gap_sd", "relevance_gap_sd_se"} | {
    f"{kind}_{key}" for kind in ("relevance", "relevance_sample", "lead")
    for key in ("accuracy", "wilson_low", "wilson_high", "pairs", "tfidf_accuracy")} | {
    f"{part}_{key}" for part in ("content", "full")
    for key in ("heldout_accuracy", "wilson_low", "wilson_high", "shorter_preferred_accuracy",
                "score_length_correlation", "human_minus_reference_sd")}


def tiny_settings(seed=0):
    return {"base_model": loaders.POLICY_NAME, "tiny": True, "seed": seed, "lora_layers": 0,
            "lora_r": 16, "lora_alpha": 32, "max_prompt_tokens": 64,
            "max_summary_tokens": 24, "resolved_from": "test", "pad_id": 2, "eos_id": 2}


def tiny_model(seed=0):
    """The tiny reward model with a non-zero adapter, so LoRA takes part in every check."""
    model, tokenizer = rm.build_reward_model(tiny_settings(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, lora.LoRALinear):
                module.up.weight.copy_(0.1 * torch.randn(module.up.weight.shape, generator=g))
    return model, tokenizer


@pytest.fixture(scope="module")
def comparisons(data_dir):
    return loaders.load_comparisons(data_dir)


# ------------------------------------------------------------------ (R1) and (R4)

def test_bt_loss_is_unchanged_by_a_constant_added_to_both_scores():
    g = torch.Generator().manual_seed(0)
    r_w = torch.randn(64, generator=g, dtype=torch.float64)
    r_l = torch.randn(64, generator=g, dtype=torch.float64)
    loss = rm.bt_loss(r_w, r_l)
    for c in (-7.0, 0.5, 300.0):
        assert abs(rm.bt_loss(r_w + c, r_l + c).item() - loss.item()) < 1e-12
    # ...but not by a constant added to one side, and its value is -log sigmoid(1) at margin 1
    assert rm.bt_loss(r_w + 1, r_l).item() < loss.item() - 0.1
    assert rm.bt_loss(torch.tensor([1.0]), torch.tensor([0.0])).item() == pytest.approx(
        math.log1p(math.exp(-1)), abs=1e-7)


def test_wilson_interval_matches_the_textbook_value():
    low, high = rm_report.wilson_interval(0.5, 100)          # p = 1/2, n = 100: 0.4038 to 0.5962
    assert (low, high) == pytest.approx((0.40383, 0.59617), abs=1e-5)
    low, high = rm_report.wilson_interval(1.0, 10)           # 10 of 10: low = n / (n + z^2), not 1
    assert low == pytest.approx(10 / (10 + 1.96 ** 2), abs=1e-9) and high == pytest.approx(1.0)


# ------------------------------------------------------------------ (R5) and (R6)

def test_length_weight_is_recovered_from_synthetic_pairs_with_f_at_zero():
    """(R6): choices drawn from sigmoid(w g_w - w g_l) with f = 0 give back w."""
    g = torch.Generator().manual_seed(0)
    for w in (0.0, 0.8, 2.0, -1.5):
        a, b = torch.randint(1, 60, (2, 40000), generator=g)               # token counts
        dg = rm.length_feature(a) - rm.length_feature(b)                    # (N,)
        first_wins = torch.rand(40000, generator=g, dtype=torch.float64) < torch.sigmoid(w * dg)
        fitted = rm.fit_length_weight(torch.where(first_wins, dg, -dg))     # winner minus loser
        assert fitted == pytest.approx(w, abs=0.06), (w, fitted)
    assert rm.fit_length_weight(torch.zeros(10)) == 0.0   # no length difference: no weight
    assert rm.length_feature([0, 1, 47]).tolist() == pytest.approx(
        [0.0, math.log(2), math.log(48)])


def response_batch(tokenizer):
    """Two left-padded prompts; one response ends in EOS, the other runs to the limit."""
    prompts = ["SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: short.\n\nTL;DR:",
               "SUBREDDIT: r/b\n\nTITLE: a longer title\n\nPOST: one. two.\n\nTL;DR:"]
    prompt_ids, prompt_mask = rm_data.pad([tokenizer(p).input_ids for p in prompts], 2, "left",
                                     "cpu")                                  # (2, P)
    response_ids = torch.tensor([[500, 600, 2, 2, 2], [700, 800, 900, 1000, 1100]])  # (2, 5)
    response_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])         # up to the EOS
    return prompt_ids, prompt_mask, response_ids, response_mask


def test_content_and_full_differ_by_exactly_w_g():
    model, tokenizer = tiny_model()
    with torch.no_grad():
        model.length_weight.fill_(0.7)
    batch = response_batch(tokenizer)
    content = rm.score_ids(model, *batch, part="content")
    full = rm.score_ids(model, *batch, part="full")
    tokens = torch.tensor([2, 5])                 # the EOS is not a summary token
    assert torch.equal(full, content + 0.7 * torch.log1p(tokens.double()).float())
    assert (full - content).tolist() == pytest.approx([0.7 * math.log(3), 0.7 * math.log(6)],
                                                      abs=1e-6)
    assert torch.equal(rm.score_ids(model, *batch), content)       # content is the default
    with pytest.raises(ValueError, match="part must be one of"):
        rm.score_ids(model, *batch, part="length")


def test_a_response_cut_at_the_limit_is_scored_at_an_appended_eos():
    """Departure 8: [prompt][y_1..y_T] scores as [prompt][y_1..y_T, EOS], like training."""
    model, tokenizer = tiny_model()
    prompt_ids, prompt_mask, response_ids, response_mask = response_batch(tokenizer)
    got = rm.score_ids(model, prompt_ids, prompt_mask, response_ids, response_mask)
    with torch.no_grad():
        for i, response in enumerate(([500, 600, 2], [700, 800, 900, 1000, 1100, 2])):
            prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
            ids = torch.tensor([prompt + response])
            assert got[i].item() == pytest.approx(model(ids, torch.ones_like(ids)).item(),
                                                  abs=1e-5)
        cut = torch.tensor([prompt + [700, 800, 900, 1000, 1100]])   # the old reading point
        assert abs(got[1].item() - model(cut, torch.ones_like(cut)).item()) > 1e-4
    ids, mask, tokens = rm.with_eos(response_ids, response_mask, 2)
    assert ids[:, -1].tolist() == [2, 2] and mask[:, -1].tolist() == [0, 1]
    assert tokens.tolist() == [2, 5]


def test_pair_metrics_on_hand_counted_pairs():
    r_w = torch.tensor([1.0, 2.0, 0.0, 5.0, 1.0])
    r_l = torch.tensor([0.0, 3.0, 0.0, 4.0, 2.0])        # right, wrong, tie, right, wrong
    len_w = torch.tensor([10, 5, 20, 30, 8])
    len_l = torch.tensor([12, 20, 20, 10, 8])             # |dlen| 2, 15, 0, 20, 0
    m = rm_report.pair_metrics(r_w, r_l, len_w, len_l)
    assert m["heldout_accuracy"] == pytest.approx(2.5 / 5)
    assert (m["wilson_low"], m["wilson_high"]) == pytest.approx(rm_report.wilson_interval(0.5, 5))
    assert m["shorter_preferred_accuracy"] == pytest.approx(0.5)    # pairs 1 and 2: 1 of 2
    bins = m["accuracy_by_length_difference"]
    assert [bins[b]["pairs"] for b in ("0-3", "4-10", ">10")] == [3, 0, 2]
    assert bins["0-3"]["accuracy"] == pytest.approx(1.5 / 3)        # right, tie, wrong
    assert bins[">10"]["accuracy"] == pytest.approx(0.5)
    scores, lengths = torch.cat([r_w, r_l]), torch.cat([len_w, len_l]).double()
    want = torch.corrcoef(torch.stack([scores.double(), lengths]))[0, 1].item()
    assert m["score_length_correlation"] == pytest.approx(want)
    perfect = rm_report.pair_metrics(len_w.float(), len_l.float(), len_w, len_l)
    assert perfect["score_length_correlation"] == pytest.approx(1.0)


def test_human_minus_reference_sd_on_known_numbers():
    # reference 1, 2, 3: mean 2, sample SD 1; human mean 4 -> 2 SDs above
    assert rm_report.human_minus_reference_sd([3.0, 5.0], [1.0, 2.0, 3.0]) == pytest.approx(2.0)
    assert rm_report.human_minus_reference_sd([0.0], [1.0, 3.0]) == pytest.approx(-2 / math.sqrt(2))


def test_reference_pairs_carry_no_length_difference_and_skip_evaluation_posts():
    tokenizer = loaders.load_tokenizer()
    config = rm.Config(**rm.PRESETS["tiny"])
    post = {"id": "p", "prompt": "SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: x.\n\nTL;DR:",
            "summary": "my cat ate my homework"}
    human = tokenizer(" my cat ate my homework").input_ids
    samples = [(list(range(1000, 1030)), False), ([1000, 1001], True), ([], True)]
    pairs = rm_data.reference_pairs(tokenizer, [post] * 3, samples, config)
    assert len(pairs) == 2                                    # the empty sample is skipped
    long, short = pairs
    assert long["chosen"] == human + [2] and long["rejected"] == list(range(1000, 1000 +
                                                                           len(human))) + [2]
    assert long["chosen_tokens"] == long["rejected_tokens"] == len(human)   # dg = 0
    assert short["rejected"] == [1000, 1001, 2] and short["rejected_tokens"] == 2
    c = {"title": " t ", "chosen_policy": "ref", "rejected_policy": "sup4"}
    assert rm_data.serves_in_evaluation(c, {"t"})
    assert not rm_data.serves_in_evaluation({**c, "chosen_policy": "sup2"}, {"t"})
    assert not rm_data.serves_in_evaluation(c, {"another title"})


def test_training_moves_f_but_never_w(comparisons):
    model, tokenizer = tiny_model()
    with torch.no_grad():
        model.length_weight.fill_(1.3)
    config = rm.Config(**{**rm.PRESETS["tiny"], "lr": 1e-2, "head_lr": 1e-2})
    pairs = rm_data.prepare_pairs(tokenizer, comparisons[:4], config)
    head = model.head.weight.detach().clone()
    rm.train_step(model, rm.make_optimizer(model, config), pairs)
    assert model.length_weight.item() == pytest.approx(1.3)
    assert not torch.equal(head, model.head.weight)


# ------------------------------------------------------------------ the score itself

def test_loss_decreases_on_a_tiny_fixed_set(comparisons):
    model, tokenizer = tiny_model()
    config = rm.Config(**{**rm.PRESETS["tiny"], "lr": 1e-2, "head_lr": 1e-2})
    pairs = rm_data.prepare_pairs(tokenizer, comparisons[:4], config)
    optimizer = rm.make_optimizer(model, config)
    losses = [rm.train_step(model, optimizer, pairs)[0] for _ in range(15)]
    assert len(pairs) == 4
    assert losses[-1] < 0.5 * losses[0], losses
    final_loss, final_acc = rm.train_step(model, optimizer, pairs)
    assert final_acc == 1.0


def rows(n_tokens, seed):
    """Random id lists of the given lengths, each ending in EOS (id 2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() + [2] for n in n_tokens]


def check_padding(model, sequences, tol):
    """Right, left, and extra padding on both sides all give the unpadded scores."""
    ones = lambda s: torch.ones(1, len(s), dtype=torch.long)
    with torch.no_grad():
        alone = torch.cat([model(torch.tensor([s]), ones(s)) for s in sequences])  # (B,)
        for side in ("right", "left"):
            ids, mask = rm_data.pad(sequences, 2, side, "cpu")                  # (B, L)
            assert (model(ids, mask) - alone).abs().max().item() < tol, side
            junk = torch.full((len(sequences), 5), 2)                      # (B, 5) more pads
            zeros = torch.zeros(len(sequences), 5, dtype=torch.long)
            ids, mask = torch.cat([junk, ids, junk], 1), torch.cat([zeros, mask, zeros], 1)
            assert (model(ids, mask) - alone).abs().max().item() < tol, side + " + 10 pads"
    return alone


def test_score_is_the_same_with_left_or_right_padding_and_extra_padding():
    model, _ = tiny_model()
    alone = check_padding(model, rows((4, 17, 30), seed=3), tol=1e-5)
    assert alone.std() > 1e-3                     # the rows really do score differently


def test_shared_prompt_pass_equals_full_passes_in_value_and_gradient():
    """The training path (prompt read once, K/V copied) is the PPO path, exactly."""
    model, _ = tiny_model()
    prompts = rows((9, 25, 14), seed=5)
    summaries = rows((3, 11, 7, 20, 1), seed=6)
    owner = torch.tensor([0, 2, 0, 1, 2])
    shared = model.forward_shared(prompts, summaries, owner)               # (5,)
    shared.sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    ids, mask = rm_data.pad([prompts[o] + s for o, s in zip(owner, summaries)], 2, "right", "cpu")
    full = model(ids, mask)                                                # (5,)
    full.sum().backward()
    assert (shared - full).abs().max().item() < 1e-5
    for g, p in zip(grads, [p for p in model.parameters() if p.requires_grad]):
        assert (g - p.grad).abs().max().item() < 1e-5 * max(1.0, p.grad.abs().max().item())


def test_a_training_step_reads_each_prompt_once_with_the_loss_of_full_passes():
    """Pairs under the same post share one prompt pass in train_step; the loss is (R1) of
    the scores that full passes over prompt + summary give."""
    model, _ = tiny_model()
    prompts, summaries = rows((9, 25), seed=7), rows((3, 11, 7, 20, 5, 8), seed=8)
    which = [(0, 0, 1), (1, 2, 3), (0, 4, 5)]          # (prompt, chosen, rejected): post 0 twice
    batch = [{"prompt": prompts[p], "chosen": summaries[w], "rejected": summaries[l],
              "chosen_tokens": len(summaries[w]) - 1, "rejected_tokens": len(summaries[l]) - 1}
             for p, w, l in which]
    with torch.no_grad():
        model.length_weight.fill_(0.7)
        full = []                                          # [(2,)] x 3: chosen, rejected
        for p, w, l in which:
            ids, mask = rm_data.pad([prompts[p] + summaries[w], prompts[p] + summaries[l]],
                                    2, "right", "cpu")
            full.append(model.score_part(model(ids, mask),
                                         [len(summaries[w]) - 1, len(summaries[l]) - 1], "full"))
    expected = rm.bt_loss(torch.stack([r[0] for r in full]), torch.stack([r[1] for r in full]))
    read, forward_shared = [], model.forward_shared
    model.forward_shared = lambda p, s, o: read.append(len(p)) or forward_shared(p, s, o)
    config = rm.Config(**rm.PRESETS["tiny"])
    loss, _ = rm.train_step(model, rm.make_optimizer(model, config), batch)
    assert read == [2]                                      # two distinct prompts, not three
    assert loss == pytest.approx(expected.item(), abs=1e-5)


def post_batch():
    """Three pairs of post 0 (people compared its summaries 0-1, 0-2 and 1-2) and one of
    post 1: the rows a step reads, with and without merging."""
    prompts, summaries = rows((9, 25), seed=11), rows((3, 11, 7, 20, 5), seed=12)
    which = [(0, 0, 1), (0, 0, 2), (0, 1, 2), (1, 3, 4)]    # (prompt, chosen, rejected)
    return [{"post_id": p, "prompt": prompts[p], "chosen": summaries[w],
             "rejected": summaries[l], "chosen_tokens": len(summaries[w]) - 1,
             "rejected_tokens": len(summaries[l]) - 1} for p, w, l in which]


def test_summary_rows_merge_a_posts_repeated_summaries_and_point_each_pair_at_its_own():
    batch = post_batch()
    prompts, summaries, owner, tokens, w, l = rm.summary_rows(batch)
    assert len(prompts) == 2 and len(summaries) == 8         # every pair's two rows
    assert w.tolist() == [0, 1, 2, 3] and l.tolist() == [4, 5, 6, 7]
    prompts, summaries, owner, tokens, w, l = rm.summary_rows(batch, merge=True)
    assert len(summaries) == 5                               # post 0's three, post 1's two
    for pair, i, j in zip(batch, w.tolist(), l.tolist()):
        assert summaries[i] == pair["chosen"] and summaries[j] == pair["rejected"]
        assert prompts[owner[i]] == pair["prompt"] == prompts[owner[j]]
        assert tokens[i] == pair["chosen_tokens"] and tokens[j] == pair["rejected_tokens"]


def test_a_merged_step_takes_the_same_loss_and_gradient_as_an_unmerged_one():
    """Reading a repeated summary once changes how much is computed, not what."""
    batch, after = post_batch(), []
    for merge in (False, True):
        model, _ = tiny_model()
        with torch.no_grad():
            model.length_weight.fill_(0.7)
            model.head.bias.fill_(0.3)
        config = rm.Config(**rm.PRESETS["tiny"])
        loss, accuracy = rm.train_step(model, rm.make_optimizer(model, config), batch, merge)
        after.append((loss, accuracy, [p.grad.clone() for p in model.parameters()
                                       if p.requires_grad]))
    (loss, accuracy, grads), (merged_loss, merged_accuracy, merged_grads) = after
    assert merged_loss == pytest.approx(loss, abs=1e-6) and merged_accuracy == accuracy
    assert any(g.abs().max() > 0 for g in grads)
    for a, b in zip(grads, merged_grads):
        assert (a - b).abs().max().item() < 1e-5 * max(1.0, a.abs().max().item())


def bf16(on=True):
    """The context reward_model.main runs in with --precision bf16 (on) or fp32 (off)."""
    return loaders.precision(rm.Config(precision="bf16" if on else "fp32"), "cpu")


def test_under_bf16_the_head_reads_in_fp32_and_scores_stay_near_fp32s():
    """--precision bf16 runs the body in bf16, never the head (R2): the head gives the same
    fp32 number to the same hidden state with autocast on or off."""
    model, _ = tiny_model()
    sequences = rows((4, 17, 30, 9), seed=21)
    ids, mask = rm_data.pad(sequences, 2, "right", "cpu")                  # (B, L)
    hidden = torch.randn(len(sequences), ids.shape[1], 64, generator=torch.Generator()
                         .manual_seed(22))                                 # (B, L, d)
    with torch.no_grad():
        fp32 = model(ids, mask)                                            # (B,)
        model.settings["precision"] = "bf16"                # as trained with --precision bf16
        with bf16():
            half = model(ids, mask)
            head_on = model.read_score(hidden, mask)
        head_off = model.read_score(hidden, mask)
    assert half.dtype == torch.float32 and torch.equal(head_on, head_off)
    assert not torch.equal(half, fp32)                      # the body did run in bf16
    assert (half - fp32).abs().max().item() < 0.05 * max(1.0, fp32.abs().max().item())


def test_a_judge_scores_at_the_precision_it_was_trained_in_whatever_the_caller_sets():
    """One judge, one precision: trained in fp32, it scores the same bits inside PPO's bf16
    bodies (autocast on) as outside, through both of its passes; trained in bf16, it scores
    in bf16 without the caller asking."""
    model, _ = tiny_model()
    sequences = rows((4, 17, 30, 9), seed=23)
    ids, mask = rm_data.pad(sequences, 2, "right", "cpu")                  # (B, L)
    prompts, summaries = sequences[:2], [s[:5] + [2] for s in sequences]
    owner = torch.tensor([0, 0, 1, 1])
    with torch.no_grad():
        fp32, shared = model(ids, mask), model.forward_shared(prompts, summaries, owner)
        with bf16():
            assert torch.equal(model(ids, mask), fp32)
            assert torch.equal(model.forward_shared(prompts, summaries, owner), shared)
        model.settings["precision"] = "bf16"
        assert not torch.equal(model(ids, mask), fp32)      # bf16 with no caller's autocast


def test_a_bf16_training_step_moves_the_adapter_as_an_fp32_step_does():
    """The same batch, fp32 and under bf16 autocast: the loss within bf16's rounding and
    each trained tensor's gradient pointing the same way (cosine > 0.99)."""
    batch, after = post_batch(), []
    for on in (False, True):
        model, _ = tiny_model()
        model.settings["precision"] = "bf16" if on else "fp32"
        with torch.no_grad():
            model.length_weight.fill_(0.7)
        config = rm.Config(**rm.PRESETS["tiny"])
        with bf16(on):
            loss, _ = rm.train_step(model, rm.make_optimizer(model, config), batch)
        after.append((loss, [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (loss, grads), (half_loss, half_grads) = after
    assert half_loss == pytest.approx(loss, abs=0.02)
    # The head's bias has no gradient in either (R1 sees differences only): left out.
    moved = [(a, b) for a, b in zip(grads, half_grads) if a.norm() > 1e-6]
    assert len(moved) == len(grads) - 1
    for a, b in moved:
        assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_precision_auto_is_bf16_exactly_where_bf16_matmuls_are_native(tmp_path):
    out = str(tmp_path / "rm")
    assert rm.parse_config(["--out", out]).precision == "fp32"           # the default
    native = loaders.native_bf16(loaders.pick_device())
    assert rm.parse_config(["--out", out, "--precision", "auto"]).precision == \
        ("bf16" if native else "fp32")


def test_batches_by_post_keep_each_posts_comparisons_together():
    pairs = [{"post_id": i, "prompt": [7] * (5 + i % 3) + [i], "chosen": [1] * (1 + j),
              "rejected": [1] * (2 + j)} for i, n in enumerate((1, 3, 2, 11, 1, 4, 2))
             for j in range(n)]
    batches = rm.batches_by_post(pairs, 8)
    assert sorted(id(p) for b in batches for p in b) == sorted(id(p) for p in pairs)
    where = {}
    for i, batch in enumerate(batches):
        assert len(batch) <= 8 or len({p["post_id"] for p in batch}) == 1   # 11 alone
        for p in batch:
            assert where.setdefault(p["post_id"], i) == i
    assert len(batches) < len(pairs) / 4                    # whole posts fill the batches


def test_score_ids_reads_the_response_eos_after_a_left_padded_prompt():
    """PPO's layout, [pads, prompt][response, EOS, pads], scores like the bare sequence."""
    model, tokenizer = tiny_model()
    prompts = ["SUBREDDIT: r/a\n\nTITLE: t\n\nPOST: short.\n\nTL;DR:",
               "SUBREDDIT: r/b\n\nTITLE: a longer title\n\nPOST: one. two. three.\n\nTL;DR:"]
    summaries = ["ok", "a somewhat longer summary here"]
    encoded = [rm_data.encode(tokenizer, p, s, 24) for p, s in zip(prompts, summaries)]
    prompt_ids, prompt_mask = rm_data.pad([p for p, _ in encoded], 2, "left", "cpu")   # (B, P)
    response_ids, _ = rm_data.pad([s + [2, 2] for _, s in encoded], 2, "right", "cpu")  # (B, T)
    response_mask = torch.zeros_like(response_ids)                         # (B, T)
    for i, (_, s) in enumerate(encoded):
        response_mask[i, :len(s)] = 1             # up to and including the first EOS only
    got = rm.score_ids(model, prompt_ids, prompt_mask, response_ids, response_mask)
    with torch.no_grad():
        want = torch.cat([model(torch.tensor([p + s]), torch.ones(1, len(p + s), dtype=torch.long))
                          for p, s in encoded])
    assert (got - want).abs().max().item() < 1e-5
    texts = rm.score_texts(model, tokenizer, prompts, summaries)
    assert (texts - want).abs().max().item() < 1e-5
    assert encoded[0][1] == tokenizer(" ok").input_ids + [2]     # " " + summary, then EOS


@pytest.mark.slow
def test_padding_on_the_real_model():
    try:
        model, _ = rm.build_reward_model({**tiny_settings(), "tiny": False, "lora_layers": 2})
    except (RuntimeError, OSError) as error:
        pytest.skip(f"SmolLM2-135M not available offline: {error}")
    with torch.no_grad():
        sequences = rows((5, 19), seed=4)
        right = model(*rm_data.pad(sequences, 2, "right", "cpu"))
        left = model(*rm_data.pad(sequences, 2, "left", "cpu"))
    assert (right - left).abs().max().item() < 1e-4   # fp32 through 30 layers: ~1e-6 seen


# ------------------------------------------------------------------ data and the script

def test_no_heldout_post_appears_in_training(comparisons):
    train, heldout = rm_data.split_comparisons(comparisons, 0.25, seed=0)
    train_posts = {c["post_id"] for c in train}
    heldout_posts = {c["post_id"] for c in heldout}
    assert train_posts.isdisjoint(heldout_posts)
    assert len(train) + len(heldout) == len(comparisons)
    assert len(heldout) >= 300                    # the minimum, with the default split
    # the split depends on the post id only: a comparison's side never changes with order
    again, _ = rm_data.split_comparisons(list(reversed(comparisons)), 0.25, seed=0)
    assert {c["post_id"] for c in again} == train_posts


def test_save_and_load_give_identical_scores(tmp_path):
    model, tokenizer = tiny_model()
    with torch.no_grad():
        model.bias.fill_(0.37)
        model.length_weight.fill_(1.9)
    rm.save_reward_model(model, tmp_path)
    loaded = rm.load_reward_model(tmp_path)
    ids = torch.randint(3, 40000, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        assert torch.equal(model(ids, mask), loaded(ids, mask))
    assert loaded.bias.item() == pytest.approx(0.37)
    assert loaded.length_weight.item() == pytest.approx(1.9)
    assert not any(p.requires_grad for p in loaded.parameters())


@pytest.mark.slow
def test_tiny_preset_runs_end_to_end_in_under_a_minute(tmp_path, comparisons):
    out = tmp_path / "rm"
    start = time.time()
    result = subprocess.run([sys.executable, "reward_model.py", "--preset", "tiny",
                             "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    seconds = time.time() - start
    assert result.returncode == 0, result.stderr[-2000:]
    assert seconds < 60
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) - {"extra"} == METRIC_KEYS
    assert metrics["wilson_low"] <= metrics["heldout_accuracy"] <= metrics["wilson_high"]
    assert metrics["train_pairs"] == (16 + metrics["reference_pairs"] + metrics["off_post_pairs"]
                                      + metrics["off_post_sample_pairs"])
    assert 0 < metrics["reference_pairs"] <= 4 and 0 < metrics["heldout_pairs"] <= 32
    assert metrics["default_part"] == "content"
    assert metrics["off_post_pairs"] == 8 and 0 < metrics["off_post_sample_pairs"] <= 4   # on
    # relevance on ppo.py's evaluation posts that no training comparison holds (~200 here)
    assert metrics["relevance_pairs"] > 100 and 0 <= metrics["relevance_accuracy"] <= 1
    assert (metrics["relevance_wilson_low"] <= metrics["relevance_accuracy"]
            <= metrics["relevance_wilson_high"])
    assert set(metrics["extra"]["relevance"]) == {"human_reserve", "human_heldout",
                                                  "samples_heldout"}
    gap = metrics["extra"]["reference_gap"]
    for part in ("content", "full"):
        assert metrics[f"{part}_human_minus_reference_sd"] == pytest.approx(
            (gap[part]["human_mean"] - gap[part]["reference_mean"]) / gap[part]["reference_sd"])
    # (R3) puts the held-out human TL;DRs' mean content score at 0
    assert gap["content"]["human_mean"] == pytest.approx(0.0, abs=1e-5)
    for name in ("loss.png", "margins.png", "config.json", "adapter.safetensors",
                 "head.safetensors", "base.safetensors"):
        assert (out / name).is_file(), name
    assert [p.name for p in tmp_path.iterdir()] == ["rm"]     # no staging folder left
    # The saved model reproduces the run's own scores of the first held-out pair, from text.
    model = rm.load_reward_model(out)
    probe = metrics["extra"]["probe"]
    _, heldout = rm_data.split_comparisons(comparisons, 0.25, seed=0)
    first = heldout[0]
    assert first["post_id"] == probe["post_id"]
    tokenizer = loaders.load_tokenizer()
    scores = rm.score_texts(model, tokenizer, [first["prompt"]] * 2,
                            [first["chosen"], first["rejected"]], part="content")
    assert scores.tolist() == pytest.approx(probe["scores"], abs=1e-5)


# ------------------------------------------------------------ off-post pairs and relevance

def test_length_neighbours_pair_each_item_with_the_next_longer():
    lengths = [5, 1, 3, 3, 9]
    pairs = rm_data.length_neighbours(lengths, seed=0)
    assert len(pairs) == 4                                     # all but the longest lead once
    assert sorted(lengths[i] for i, _ in pairs) == [1, 3, 3, 5]
    for i, j in pairs:
        assert lengths[j] >= lengths[i] and i != j
    # by hand, in length order 1, 3, 3, 5, 9: each step up is at most one rank
    assert sorted(lengths[j] - lengths[i] for i, j in pairs) == [0, 2, 2, 4]


def test_length_neighbours_with_k_take_the_k_next_longer_grouped_by_item():
    lengths = [5, 1, 3, 3, 9]
    pairs = rm_data.length_neighbours(lengths, seed=0, k=2)
    # in length order 1, 3, 3, 5, 9: two after each but the last two, one after 5, none after 9
    assert len(pairs) == 2 + 2 + 2 + 1
    firsts = [i for i, _ in pairs]
    assert firsts == sorted(firsts, key=lambda i: (lengths[i], firsts.index(i)))   # grouped
    for i, j in pairs:
        assert lengths[j] >= lengths[i] and i != j
    assert sorted(lengths[j] for i, j in pairs if lengths[i] == 1) == [3, 3]
    assert rm_data.length_neighbours(lengths, 0, k=1) == rm_data.length_neighbours(lengths, 0)


def test_cut_to_shorter_ends_both_sides_in_eos_at_the_same_length():
    assert rm_data.cut_to_shorter([1, 2, 3], [4, 5], eos_id=9) == ([1, 2, 9], [4, 5, 9])
    assert rm_data.cut_to_shorter([4], [1, 2, 3], eos_id=9) == ([4, 9], [1, 9])
    assert rm_data.cut_to_shorter([1, 2, 3], [1, 2], eos_id=9) is None      # same once cut
    assert rm_data.cut_to_shorter([], [1, 2], eos_id=9) is None             # nothing to cut


def test_off_post_pairs_put_the_posts_own_summary_first_at_equal_length():
    """Under post p (its prompt), p's summary beats q's, both cut to the shorter and ended in
    EOS: equal *_tokens, so g(y) of (R5) cancels. Identical cut summaries make no pair."""
    prompts = [[100], [200], [300], [400]]
    summaries = [[1, 1, 1], [2, 2, 2, 2, 2], [3, 3], [1, 1]]    # post 3's cut = post 0's cut
    pairs = rm_data.off_post_pairs(prompts, summaries, ["a", "b", "c", "d"], eos_id=9, seed=0)
    owner = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert 1 <= len(pairs) <= 3
    for p in pairs:
        i = owner[p["post_id"]]
        assert p["prompt"] == prompts[i] and p["kind"] == "off_post"
        cut = p["chosen_tokens"]
        assert p["chosen"] == summaries[i][:cut] + [9]
        assert p["rejected"][-1] == 9 and p["rejected"][:-1] != summaries[i][:cut]
        assert p["chosen_tokens"] == p["rejected_tokens"] == len(p["rejected"]) - 1 == cut
        assert any(p["rejected"][:-1] == s[:cut] for j, s in enumerate(summaries) if j != i)
    assert not [p for p in pairs if p["chosen"] == p["rejected"]]


def test_off_post_negatives_give_each_post_its_nearest_in_the_given_order():
    prompts = [[100], [200], [300], [400], [500]]
    summaries = [[1] * 6, [2] * 2, [3] * 4, [4] * 3, [5] * 5]      # lengths 6, 2, 4, 3, 5
    pairs = rm_data.off_post_pairs(prompts, summaries, list("abcde"), eos_id=9, seed=0,
                                   negatives=2)
    # by hand, length order b(2) d(3) c(4) e(5) a(6): b beats d, c; d beats c, e; c beats
    # e, a; e beats a; a is the longest. Pairs come in the posts' given order: a b c d e.
    got = [(p["post_id"], p["rejected"][0]) for p in pairs]
    assert got == [("b", 4), ("b", 3), ("c", 5), ("c", 1), ("d", 3), ("d", 5), ("e", 1)]
    for p in pairs:
        assert p["chosen_tokens"] == p["rejected_tokens"] == len(p["chosen"]) - 1
        assert p["chosen"][-1] == p["rejected"][-1] == 9


def judge(reads_post):
    """A stand-in for the reward model's scores: +1 for each summary token equal to the
    prompt's first token (a judge that reads the post), or the summary's length (one that
    does not)."""
    def score(prompts, summaries):
        return torch.tensor([float(sum(t == p[0] for t in s)) if reads_post else float(len(s))
                             for p, s in zip(prompts, summaries)])
    return score


def test_relevance_tells_a_judge_that_reads_the_post_from_one_that_does_not():
    prompts = [[1], [2], [3], [4], [5]]
    summaries = [[1] * 2, [2] * 3, [3] * 3, [4] * 5, [5] * 2]
    got = rm_report.relevance(judge(reads_post=True), 0, prompts, summaries, seed=0)
    # own summary: every token matches its post; a neighbour's: none does
    assert got["accuracy"] == 1.0 and got["pairs"] == 4 and got["posts"] == 5
    assert got["wilson_low"] == pytest.approx(rm_report.wilson_interval(1.0, 4)[0])
    # home scores of the 4 leading posts are their lengths, away scores 0: gap = mean / SD
    moved = rm_data.length_neighbours([len(s) for s in summaries], 0)
    home = torch.tensor([float(len(summaries[p])) for p, _ in moved], dtype=torch.float64)
    assert got["gap_sd"] == pytest.approx((home.mean() / home.std()).item())
    got = rm_report.relevance(judge(reads_post=False), 0, prompts, summaries, seed=0)
    assert got["accuracy"] == 0.5                              # equal lengths: every pair a tie
    assert got["gap_sd"] == 0.0 and got["gap_sd_se"] == 0.0


def test_relevance_scores_every_row_in_one_call_under_the_given_posts():
    """One call, so score_grouped reads each post once for all four kinds of row."""
    prompts = [[1], [2], [3], [4], [5]]
    summaries = [[1] * 2, [2] * 3, [3] * 3, [4] * 5, [5] * 2]
    calls = []

    def counting(p, s):
        calls.append((p, s))
        return judge(reads_post=True)(p, s)
    rm_report.relevance(counting, 0, prompts, summaries, seed=0)
    rows_p, rows_s, sizes = rm_report.relevance_rows(prompts, summaries, 0, seed=0)
    assert len(calls) == 1 and calls[0] == (rows_p, rows_s) and sizes == [4, 4, 4, 4]
    assert {tuple(p) for p in rows_p} <= {tuple(p) for p in prompts}
    # home and away: the same uncut summary (with EOS) under its own post, then another's
    home, away = rows_s[8:12], rows_s[12:]
    assert home == away and all(s[-1] == 0 for s in home)
    assert all(a != b for a, b in zip(rows_p[8:12], rows_p[12:]))


class WordTokenizer:
    """Ids are words: 0 is the EOS (dropped with skip_special_tokens), 1 cat, 2 dog, 3 fish."""
    eos_token_id = 0
    vocab = ["<eos>", "cat", "dog", "fish"]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.vocab[i] for i in ids if i or not skip_special_tokens)


def test_tfidf_score_is_the_cosine_with_the_post_worked_by_hand():
    prompts, tok = [[1, 1, 3], [2, 3]], WordTokenizer()        # "cat cat fish", "dog fish"
    got = rm_report.tfidf_score(tok, [prompts[0], prompts[0], prompts[1]], [[1, 0], [2, 0], [3, 0]])
    # idf over the 2 posts: cat, dog in one: log(3/2) + 1 = a; fish in both: log(3/3) + 1 = 1
    a = math.log(1.5) + 1
    # post 0 = (cat 2a, fish 1) / sqrt(4a^2 + 1); "cat" = (cat 1); "dog" shares no word
    # post 1 = (dog a, fish 1) / sqrt(a^2 + 1); "fish" = (fish 1)
    assert got.tolist() == pytest.approx([2 * a / math.sqrt(4 * a * a + 1), 0.0,
                                          1 / math.sqrt(a * a + 1)])
    # as relevance's yardstick: each post's own one-word summary beats its neighbour's
    got = rm_report.relevance(functools.partial(rm_report.tfidf_score, tok), 0,
                              [[1, 1], [2, 2], [3, 3]], [[1], [2], [3]], seed=0)
    assert got["accuracy"] == 1.0 and got["pairs"] == 2


def test_lead_test_pits_the_tldr_against_the_posts_opening_cut_to_the_same_length():
    prompts = [[1], [2], [3], [4]]
    tldrs = [[7, 7], [2, 7, 7], [7], [4, 4]]
    openings = [[1, 1, 1], [2, 2], [3, 3], [4, 4, 4]]
    calls = []

    def copy_lover(p, s):                     # +1 per summary token equal to the post's
        calls.append((p, s))
        return judge(reads_post=True)(p, s)
    got = rm_report.lead_test(copy_lover, 0, prompts, tldrs, openings)
    # post 3's TL;DR is its opening's first two tokens: no pair. The others, cut to the
    # shorter, end in EOS 0: [7 7 0] v [1 1 0], [2 7 0] v [2 2 0], [7 0] v [3 0]
    assert calls == [([[1], [2], [3]] * 2,
                      [[7, 7, 0], [2, 7, 0], [7, 0], [1, 1, 0], [2, 2, 0], [3, 0]])]
    assert got["pairs"] == 3 and got["accuracy"] == 0.0     # the copy wins every pair
    assert (got["wilson_low"], got["wilson_high"]) == pytest.approx(
        rm_report.wilson_interval(0.0, 3))

    def summary_lover(p, s):                  # +1 per 7, a word no post uses; ties at 0
        return torch.tensor([float(x.count(7)) for x in s])
    got = rm_report.lead_test(summary_lover, 0, prompts[:3], tldrs[:3],
                              [[1, 1, 1], [2, 2], [5]])
    assert got["accuracy"] == 1.0 and got["pairs"] == 3


def test_post_openings_are_the_post_field_of_the_prompt(tokenizer):
    body = "I moved out last week.\n\nNow my roommate wants the deposit back."
    prompt = tokenizer(loaders.format_prompt("relationships", "A title", body)).input_ids
    assert rm_report.post_openings(tokenizer, [prompt]) == [tokenizer(" " + body).input_ids]


def test_off_post_training_pairs_leak_no_reserved_or_heldout_post(tldr_posts, tokenizer):
    """The human and sample off-post pairs come only from posts departure 7 may use: none of
    ppo.py's evaluation posts, none of this split's held-out posts."""
    config = rm.parse_config(["--preset", "tiny", "--reference-pairs", "6", "--off-post-pairs",
                              "40", "--off-post-sample-pairs", "4"])
    posts = tldr_posts[:120]
    data = rm_data.Data(comparisons=[], tldr_posts=posts, train=[],
                        heldout=[{"title": p["title"]} for p in posts[30:50]],
                        reserved={p["title"].strip() for p in posts[:30]})
    _, human, own, _, _ = rm_data.sample_reference_phase(config, tokenizer, data, [], "cpu")
    allowed = {p["id"] for p in posts[50:]}
    assert len(human) == 40 and 1 <= len(own) <= 4
    for pair in human + own:
        assert pair["post_id"] in allowed
        assert pair["chosen_tokens"] == pair["rejected_tokens"]
    assert {p["kind"] for p in human} == {"off_post"} and {p["kind"] for p in own} == {
        "off_post_sample"}


def test_the_reference_is_sampled_with_ppos_settings():
    """support/rm_data samples SmolLM2 with the post's settings itself (it does not import
    ppo.py): they must stay ppo.py's defaults."""
    cfg = ppo.Config()
    assert rm_data.POST_SAMPLING == {"max_new_tokens": cfg.max_new_tokens,
                                     "temperature": cfg.temperature, "top_k": cfg.top_k,
                                     "top_p": cfg.top_p}


@pytest.mark.slow
def test_rm_relevance_reruns_a_saved_judges_test_and_repeats_its_numbers(tiny_reward_model):
    """tools/rm_relevance rebuilds the three sets from the saved seed and preset: on the
    machine that trained the judge, its accuracies are the ones in metrics.json."""
    result = subprocess.run([sys.executable, "-m", "tools.rm_relevance", "--reward-model",
                             str(tiny_reward_model)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    stored = json.loads((tiny_reward_model / "metrics.json").read_text())["extra"]["relevance"]
    rows = [line.split() for line in result.stdout.splitlines() if "posts" in line
            and line.split()[-1].endswith("]")]
    assert len(rows) == len(stored) + 2 == 5        # relevance on 3 sets, then the lead on 2
    names = ("human_reserve", "human_heldout", "samples_heldout")
    expect = [stored[n] for n in names] + [stored[n]["lead"] for n in names[:2]]
    for row, want in zip(rows, expect):
        # ... pairs, judge, [low, high], in metrics.json, TF-IDF, [low, high]
        pairs, judge, before, tfidf = int(row[-8]), float(row[-7]), float(row[-4]), float(row[-3])
        assert pairs == want["pairs"]
        assert judge == before == round(want["accuracy"], 3)
        assert tfidf == round(want["tfidf"]["accuracy"], 3)


def test_a_nan_loss_stops_the_judge_before_its_step_in_one_line_and_saves_nothing(
        tmp_path, monkeypatch, judge_data):
    """A NaN loss at step 3: the script stops with one line naming it, before AdamW steps on
    it (the weights stay finite); no folder is written."""
    real_loss, real_optimizer, calls, made = rm.bt_loss, rm.make_optimizer, [], []

    def bt_loss(r_w, r_l):
        calls.extend([1] if r_w.requires_grad else [])      # training steps only
        loss = real_loss(r_w, r_l)
        return loss * float("nan") if len(calls) == 3 and r_w.requires_grad else loss
    monkeypatch.setattr(rm, "bt_loss", bt_loss)
    monkeypatch.setattr(rm, "make_optimizer",
                        lambda *args: made.append(real_optimizer(*args)) or made[0])
    with pytest.raises(SystemExit) as stop:
        cli.run_script(rm.main, ["--preset", "tiny", "--out", str(tmp_path / "judge"),
                                 "--data-dir", str(judge_data)])
    assert str(stop.value.code).startswith("reward_model.py: error: step 3: the loss is NaN")
    assert "\n" not in str(stop.value.code) and len(calls) == 3
    assert all(torch.isfinite(p).all() for group in made[0].param_groups for p in group["params"])
    assert list(tmp_path.iterdir()) == []


def test_a_nan_gradient_stops_the_step_before_adamw_moves_anything(comparisons):
    """The loss finite, the head's gradient NaN: step 7 stops naming the gradient and how
    many of its values are bad, and no weight has moved."""
    model, tokenizer = tiny_model()
    config = rm.Config(**rm.PRESETS["tiny"])
    pairs = rm_data.prepare_pairs(tokenizer, comparisons[:4], config)
    optimizer = rm.make_optimizer(model, config)
    weights = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in weights]
    model.head.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    bad, total = model.head.weight.numel(), sum(p.numel() for p in weights)
    with pytest.raises(report.NonFiniteError,
                       match=rf"^step 7: the gradient is NaN or inf in {bad} of {total} values"):
        rm.train_step(model, optimizer, pairs, step=7)
    assert all(torch.equal(p, q) for p, q in zip(weights, before))


def test_a_rank_with_no_pairs_in_a_short_last_batch_takes_its_step(comparisons, monkeypatch):
    """No pairs (rank 0 of 2's share of a one-pair batch): the step runs, moving nothing."""
    model, tokenizer = tiny_model()
    config = rm.Config(**rm.PRESETS["tiny"])
    pairs = rm_data.prepare_pairs(tokenizer, comparisons[:1], config)
    optimizer = rm.make_optimizer(model, config)
    weights = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in weights]
    monkeypatch.setattr(rm.parallel, "mine", lambda items: items[:0])
    assert rm.train_step(model, optimizer, pairs, step=5) == (0.0, 0.0)
    assert all(torch.equal(p, q) for p, q in zip(weights, before))
