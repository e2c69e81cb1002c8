"""Tests for dpo.py: the implicit reward (D1), the loss (D2), and the run end to end.

Run:  pytest tests/test_dpo.py            (the end-to-end run: pytest -m slow tests/test_dpo.py)

The oracles are written out here: (D1) and (D2) on numbers worked by hand with math.log
and math.exp, and log pi(y|x) from a plain log_softmax of the model's logits on the
unpadded sequence.
"""
import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import dpo  # noqa: E402
from lora import with_lora  # noqa: E402
from support import cli  # noqa: E402
from support.kept import machine  # noqa: E402

BETA = 0.1


def test_implicit_reward_and_loss_on_hand_computed_values():
    # pair 1: log pi -3 and -4, log pi_ref -5 and -4 -> r_w = 0.1 * 2 = 0.2, r_l = 0
    # pair 2: log pi -6 and -2, log pi_ref -5 and -3 -> r_w = -0.1, r_l = 0.1
    logp_w, ref_w = torch.tensor([-3.0, -6.0]), torch.tensor([-5.0, -5.0])
    logp_l, ref_l = torch.tensor([-4.0, -2.0]), torch.tensor([-4.0, -3.0])
    assert dpo.implicit_reward(logp_w, ref_w, BETA).tolist() == pytest.approx([0.2, -0.1])
    assert dpo.implicit_reward(logp_l, ref_l, BETA).tolist() == pytest.approx([0.0, 0.1])
    # -log sigmoid(m) = log(1 + e^-m), margins +0.2 and -0.2, averaged
    expected = (math.log(1 + math.exp(-0.2)) + math.log(1 + math.exp(0.2))) / 2
    assert dpo.dpo_loss(logp_w, logp_l, ref_w, ref_l, BETA).item() == pytest.approx(expected)
    row = dpo.curve_row(logp_w, logp_l, ref_w, ref_l, BETA)
    assert row["rewards/chosen"] == pytest.approx(0.05)            # (0.2 - 0.1) / 2
    assert row["rewards/rejected"] == pytest.approx(0.05)          # (0 + 0.1) / 2
    assert row["rewards/margins"] == pytest.approx(0.0)
    assert row["rewards/accuracies"] == 0.5                        # one pair of two right
    assert row["logps/chosen"] == -4.5 and row["logps/rejected"] == -3.0
    assert row["loss"] == pytest.approx(expected)
    assert set(row) == set(dpo.CURVE)


def test_the_gradient_raises_the_chosen_and_lowers_the_rejected():
    logp_w = torch.tensor([-3.0, -6.0], requires_grad=True)
    logp_l = torch.tensor([-4.0, -2.0], requires_grad=True)
    dpo.dpo_loss(logp_w, logp_l, torch.tensor([-5.0, -5.0]), torch.tensor([-4.0, -3.0]),
                 BETA).backward()
    # dL/dlogp_w = -beta sigmoid(-m) / N: a step down the loss raises log pi(y_w|x)
    assert logp_w.grad.tolist() == pytest.approx([-BETA / (1 + math.exp(0.2)) / 2,
                                                  -BETA / (1 + math.exp(-0.2)) / 2])
    assert (logp_w.grad < 0).all() and (logp_l.grad > 0).all()
    assert (logp_l.grad == -logp_w.grad).all()


def pairs_of(tokenizer):
    """Three comparisons as token ids, prompts and summaries of different lengths (so the
    batch pads on both sides), each summary ending in EOS as rm_data.encode makes them."""
    eos = tokenizer.eos_token_id
    text = [("SUBREDDIT: r/a\n\nTITLE: my cat\n\nPOST: it sleeps all day.\n\nTL;DR:",
             " cat sleeps", " I have a cat that does nothing but sleep all day long"),
            ("SUBREDDIT: r/b\n\nTITLE: a long question about rent\n\nPOST: my landlord "
             "raised the rent twice this year and I do not know what to do.\n\nTL;DR:",
             " rent went up twice, what do I do?", " landlord")]
    return [{"prompt": tokenizer(p).input_ids, "chosen": tokenizer(w).input_ids + [eos],
             "rejected": tokenizer(l).input_ids + [eos]} for p, w, l in text]


def policy_of(reference):
    """The policy as dpo.run makes it: the reference plus a fresh LoRA adapter."""
    torch.manual_seed(0)
    return with_lora(copy.deepcopy(reference, memo={id(p): p for p in reference.parameters()}))


def test_sequence_log_probs_are_the_summed_log_softmax_of_the_unpadded_sequence(tiny,
                                                                                 tokenizer):
    pairs = pairs_of(tokenizer)
    with torch.no_grad():
        logp_w, logp_l = dpo.pair_log_probs(tiny, pairs, tokenizer.pad_token_id, "cpu")
        for got, side in ((logp_w, "chosen"), (logp_l, "rejected")):
            for value, p in zip(got.tolist(), pairs):
                ids = torch.tensor([p["prompt"] + p[side]])                    # (1, P+T)
                logits = tiny(input_ids=ids).logits[0]                          # (P+T, V)
                P = len(p["prompt"])
                # log pi(y_t | x, y_<t) is read from the logits one position earlier
                logp = torch.log_softmax(logits[P - 1:-1].double(), -1)        # (T, V)
                expected = logp.gather(1, ids[0, P:, None]).sum().item()
                assert value == pytest.approx(expected, abs=1e-4)


def test_before_the_first_step_the_policy_is_the_reference(tiny, tokenizer):
    pairs = pairs_of(tokenizer)
    policy = policy_of(tiny)
    with torch.no_grad():
        ref_w, ref_l = dpo.pair_log_probs(tiny, pairs, tokenizer.pad_token_id, "cpu")
        logp_w, logp_l = dpo.pair_log_probs(policy, pairs, tokenizer.pad_token_id, "cpu")
    assert torch.equal(logp_w, ref_w) and torch.equal(logp_l, ref_l)    # to the last bit
    row = dpo.curve_row(logp_w, logp_l, ref_w, ref_l, BETA)
    assert row["rewards/chosen"] == 0 and row["rewards/rejected"] == 0
    assert row["rewards/margins"] == 0 and row["rewards/accuracies"] == 0
    assert row["loss"] == pytest.approx(math.log(2), abs=1e-7)


def test_a_few_steps_widen_the_margin(tiny, tokenizer):
    pairs = pairs_of(tokenizer)
    policy = policy_of(tiny)
    cfg = dpo.Config(**{**dpo.PRESETS["tiny"], "micro_batch": 2, "beta": BETA})
    pad_id = tokenizer.pad_token_id
    ref_w, ref_l = dpo.log_probs_of(tiny, pairs, 2, pad_id, "cpu")
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        dpo.dpo_gradients(policy, pairs, ref_w, ref_l, cfg, pad_id, "cpu")
        optimizer.step()
    logp_w, logp_l = dpo.log_probs_of(policy, pairs, 2, pad_id, "cpu")
    row = dpo.curve_row(logp_w, logp_l, ref_w, ref_l, BETA)
    assert row["rewards/margins"] > 0 and row["rewards/accuracies"] == 1
    assert row["loss"] < math.log(2)


def test_the_micro_batches_give_the_whole_batchs_gradient(tiny, tokenizer):
    pairs, pad_id = pairs_of(tokenizer), tokenizer.pad_token_id
    grads = []
    for micro_batch in (1, 2):
        policy = policy_of(tiny)
        with torch.no_grad():                       # a non-zero adapter: B = 0 has no A grad
            for name, p in policy.named_parameters():
                if p.requires_grad:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator()
                                               .manual_seed(len(name))))
        ref_w, ref_l = dpo.log_probs_of(tiny, pairs, 2, pad_id, "cpu")
        cfg = dpo.Config(**{**dpo.PRESETS["tiny"], "micro_batch": micro_batch})
        dpo.dpo_gradients(policy, pairs, ref_w, ref_l, cfg, pad_id, "cpu")
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()
                                if p.requires_grad]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_a_bad_beta_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.run_script(dpo.main, ["--preset", "tiny", "--beta", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--beta" in err.splitlines()[-1] and "Traceback" not in err


@pytest.mark.slow
def test_tiny_preset_end_to_end(tiny_judge, data_dir, tmp_path):
    out = tmp_path / "dpo"
    result = subprocess.run([sys.executable, "dpo.py", "--preset", "tiny", "--reward-model",
                             str(tiny_judge), "--out", str(out), "--steps", "4",
                             "--log-every", "2"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert [row["step"] for row in results["curve"]] == [2, 4]
    assert results["machine"] == machine()          # the CPU a kept copy names
    assert all(set(row) == {"step", *dpo.CURVE} for row in results["curve"])
    final = results["final"]
    judges = final["judges"]
    assert judges["pairs"] == 8                                       # the tiny preset's
    for name in ("implicit", "content", "full"):
        m = judges[name]
        assert m["wilson_low"] <= m["heldout_accuracy"] <= m["wilson_high"]
    # issue 75: the three judges beside the system, length and SFT rules, paired
    every = judges["baselines"]["groups"]["all"]
    assert every["rows"] == 8 and set(every["paired"]) == {"implicit", "content", "full"}
    assert set(every["paired"]["implicit"]) == {"system", "length", "sft"}
    assert len(judges["baselines"]["per_pair"]["implicit"]) == 8
    assert judges["split_fingerprint"] == json.loads(
        (tiny_judge / "config.json").read_text())["split"]["fingerprint"]
    # the policy's row is ppo.py's: paired over ppo.py's 4 held-out posts, beside the reference
    assert {"reward", "reward_se", "retrieval_mrr", "rouge_l", "words", "eos_fraction",
            "copied_bigrams", "kl", "ref", "human", "gain_over_ref"} <= set(final)
    assert [s["post"] for s in final["samples"]] == [0, 1, 2, 3]
    assert final["gain_over_ref"] == pytest.approx(final["reward"] - final["ref"]["reward"],
                                                   abs=1e-6)
    assert {p.name for p in out.iterdir()} == {"results.json", "samples.html", "curve.png",
                                               "adapter.safetensors"}
    assert [p.name for p in tmp_path.iterdir()] == ["dpo"]           # no staging folder left


@pytest.mark.slow
def test_steps_0_makes_one_pass_over_every_training_comparison_of_the_judge(tiny_judge,
                                                                             tmp_path):
    """Issue 75's like-for-like run: all the judge's training comparisons, once."""
    out = tmp_path / "dpo"
    result = subprocess.run([sys.executable, "dpo.py", "--preset", "tiny", "--reward-model",
                             str(tiny_judge), "--out", str(out), "--steps", "0",
                             "--heldout-pairs", "0"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    split = json.loads((tiny_judge / "config.json").read_text())["split"]
    assert results["train_pairs"] == split["max_pairs"] == 16           # the tiny judge's
    assert results["steps"] == 8 == len(results["curve"])               # 16 pairs of 2, once
    assert 8 < results["final"]["judges"]["pairs"] <= 32    # the judge's cap (32), not 8


def test_a_nan_gradient_with_a_finite_loss_stops_dpo_before_its_step(tiny_judge_small,
                                                                     judge_data, tmp_path,
                                                                     monkeypatch):
    """The loss and log-probs finite, one gradient value NaN at step 2: dpo.py stops with one
    line naming the gradient, before AdamW steps on it (the adapter stays finite), and
    writes nothing."""
    real_gradients, adapters = dpo.dpo_gradients, []

    def dpo_gradients(policy, *args):
        logps = real_gradients(policy, *args)
        adapters.append([p for p in policy.parameters() if p.requires_grad])
        if len(adapters) == 2:
            adapters[-1][0].grad.view(-1)[0] = float("nan")
        return logps
    monkeypatch.setattr(dpo, "dpo_gradients", dpo_gradients)
    with pytest.raises(SystemExit) as stop:
        cli.run_script(dpo.main, ["--preset", "tiny", "--reward-model", str(tiny_judge_small),
                                  "--data-dir", str(judge_data), "--steps", "4",
                                  "--out", str(tmp_path / "dpo")])
    message = str(stop.value.code)
    assert message.startswith("dpo.py: error: step 2: the gradient is NaN or inf in 1 of ")
    assert "\n" not in message and len(adapters) == 2
    assert all(torch.isfinite(p).all() for p in adapters[-1])
    assert list(tmp_path.iterdir()) == []
