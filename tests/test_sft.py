"""sft.py, the pipeline's first stage, and PPO started from what it writes.

- The merge W' = W + (alpha/r) B A gives the wrapped model's logits, with no adapter left.
- The loss (13) in micro-batches has the whole batch's gradient; a few steps lower it.
- The data: no post of ppo.py's evaluation reserve and no compared post is trained on.
- ppo.py's start: runs/sft when it holds a model, else SmolLM2 with one line; never at the
  tiny preset unless a folder is named.
- End to end (slow): `sft.py --preset tiny`, its files and rows; then ppo.py from that
  model: the ratio is exactly 1 and the KL exactly 0 at the first step, and its table
  carries the model SFT began from as sft.py sampled it. A full disk and a
  held folder each stop it in one line, leaving nothing.
Run:  python -m pytest -q tests/test_sft.py          (and -m slow for the end-to-end ones)
"""
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import loaders
import ppo
import reward_model as rm
import sft
from lora import LoRALinear, merge_lora, with_lora
from support import cli, disk

ROOT = Path(__file__).resolve().parent.parent


def noisy_adapter(model, seed=0, scale=0.05, top_layers=None):
    """`with_lora(model)` with random non-zero adapters (a trained one's stand-in)."""
    policy = with_lora(copy.deepcopy(model), top_layers=top_layers)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.copy_(scale * torch.randn(p.shape, generator=generator))
    return policy


def test_the_merge_gives_the_wrapped_models_logits(tiny, tokenizer):
    ids = tokenizer(["SUBREDDIT: r/test\n\nTITLE: a title\n\nPOST: some words.\n\nTL;DR:"],
                    return_tensors="pt").input_ids
    policy = noisy_adapter(tiny)
    with torch.no_grad():
        wrapped = policy(ids).logits
        merged_model = merge_lora(policy)
        merged = merged_model(ids).logits
        base = tiny(ids).logits
    assert not any(isinstance(m, LoRALinear) for m in merged_model.modules())
    assert torch.allclose(merged, wrapped, atol=1e-5)
    assert (merged - base).abs().max() > 1e-3          # the update is in the weights
    layer = merged_model.model.layers[0].self_attn
    assert type(layer.q_proj) is torch.nn.Linear and type(layer.k_proj) is torch.nn.Linear


def test_the_merge_with_the_adapter_on_the_top_layers_only(tiny, tokenizer):
    ids = tokenizer(["TITLE: a title\n\nPOST: some words.\n\nTL;DR:"],
                    return_tensors="pt").input_ids
    policy = noisy_adapter(tiny, top_layers=1)
    wrapped_layers = [any(isinstance(m, LoRALinear) for m in layer.modules())
                      for layer in policy.model.layers]
    assert wrapped_layers == [False] * (len(wrapped_layers) - 1) + [True]
    with torch.no_grad():
        wrapped = policy(ids).logits
        merged_model = merge_lora(policy)
        assert torch.allclose(merged_model(ids).logits, wrapped, atol=1e-5)
    assert not any(isinstance(m, LoRALinear) for m in merged_model.modules())
    for before, after in zip(tiny.model.layers[:-1], merged_model.model.layers[:-1]):
        assert torch.equal(before.self_attn.q_proj.weight, after.self_attn.q_proj.weight)


def test_the_learning_rate_schedules():
    assert [sft.learning_rate_factor(s, 4, "constant") for s in range(4)] == [1.0] * 4
    assert [sft.learning_rate_factor(s, 4, "linear") for s in range(4)] == [1, 0.75, 0.5, 0.25]


def test_micro_batches_give_the_whole_batchs_loss_and_gradient(tiny, tokenizer, tldr_posts):
    posts = tldr_posts[:4]
    grads, losses = [], []
    for micro_batch in (4, 1, 3):
        policy = noisy_adapter(tiny)
        losses.append(sft.sft_loss(policy, tokenizer, posts, micro_batch, "cpu"))
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()
                                if p.requires_grad]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)
    assert torch.allclose(grads[1], grads[0], atol=1e-6, rtol=1e-4)
    assert torch.allclose(grads[2], grads[0], atol=1e-6, rtol=1e-4)
    with torch.no_grad():                      # (13) as ppo.py computes it, on the whole batch
        expected = ppo.ptx_loss(noisy_adapter(tiny), tokenizer, posts, "cpu").item()
    assert losses[0] == pytest.approx(expected, rel=1e-5)


def test_a_few_steps_lower_the_loss(tiny, tokenizer, tldr_posts):
    cfg = sft.Config(**{**sft.PRESETS["tiny"], "steps": 8, "lr": 1e-2, "eval_every": 8})
    posts = tldr_posts[:2]
    torch.manual_seed(0)
    policy = with_lora(copy.deepcopy(tiny))
    curve = sft.train(policy, tokenizer, posts, posts, cfg, "cpu")
    assert [row["step"] for row in curve] == [0, 8]
    assert curve[1]["heldout_loss"] < curve[0]["heldout_loss"] - 2     # nats per summary


@pytest.mark.slow
def test_no_evaluation_or_compared_post_is_trained_on(tokenizer, tldr_posts, data_dir):
    cfg = sft.Config(**sft.PRESETS["tiny"])
    comparisons = loaders.load_comparisons(data_dir)
    train, held_out = sft.training_posts(cfg, tokenizer, tldr_posts, comparisons)
    reserved = {tldr_posts[i]["title"].strip()
                for i in loaders.tldr_order(tldr_posts)[:loaders.EVAL_RESERVE]}
    compared = {c["title"].strip() for c in comparisons}
    titles = {p["title"].strip() for p in train}
    assert not titles & reserved and not titles & compared
    assert {p["title"].strip() for p in held_out} <= reserved      # ppo.py's evaluation posts
    assert len(train) > 1000


def test_ppo_starts_from_runs_sft_when_it_holds_a_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = ppo.parse_args(["--preset", "cpu"])
    assert cfg.model == loaders.POLICY_NAME
    assert capsys.readouterr().out.count(f"no SFT model in {loaders.SFT_MODEL}") == 1
    folder = tmp_path / loaders.SFT_MODEL
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert ppo.parse_args(["--preset", "cpu"]).model == loaders.POLICY_NAME   # no weights
    assert "no SFT model" in capsys.readouterr().out
    (folder / "model.safetensors").write_bytes(b"")
    assert ppo.parse_args(["--preset", "cpu"]).model == loaders.SFT_MODEL
    # the tiny preset keeps its random model unless a folder is named, and says nothing
    assert ppo.parse_args(["--preset", "tiny"]).model == loaders.POLICY_NAME
    assert "no SFT model" not in capsys.readouterr().out
    assert ppo.parse_args(["--preset", "tiny", "--model", str(folder)]).model == str(folder)
    assert ppo.parse_args(["--preset", "cpu", "--model", loaders.POLICY_NAME]).model == \
        loaders.POLICY_NAME


def test_sft_starts_from_smollm2_and_the_judge_from_runs_sft(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sft.parse_args(["--preset", "cpu"]).model == loaders.POLICY_NAME
    assert rm.parse_config(["--preset", "cpu"]).model == loaders.POLICY_NAME   # no runs/sft
    folder = tmp_path / loaders.SFT_MODEL
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert sft.parse_args(["--preset", "cpu"]).model == loaders.POLICY_NAME
    assert rm.parse_config(["--preset", "cpu"]).model == loaders.SFT_MODEL


# ----------------------------------------------------------------------- end to end

def run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory, data_dir):
    """`sft.py --preset tiny` at a learning rate high enough to move the tiny model."""
    out = tmp_path_factory.mktemp("sft") / "sft"
    done = run("sft.py", "--preset", "tiny", "--lr", "1e-2", "--steps", "6", "--out", str(out),
               "--reward-model", str(out.parent / "no_judge"))
    assert done.returncode == 0, done.stderr
    return out, done.stdout


@pytest.mark.slow
def test_sft_end_to_end(tiny_sft, tokenizer):
    out, printed = tiny_sft
    assert {"config.json", "model.safetensors", "tokenizer.json", "results.json",
            "samples.html", "curve.png"} <= {p.name for p in out.iterdir()}
    results = json.loads((out / "results.json").read_text())
    assert [row["step"] for row in results["curve"]] == [0, 2, 4, 6]
    assert results["curve"][-1]["heldout_loss"] < results["curve"][0]["heldout_loss"]
    assert set(results["rows"]) == {"start", "sft"}
    for row in results["rows"].values():
        assert row["reward"] is None                    # no judge: no reward, no gap
        assert {"retrieval_mrr", "rouge_l", "words", "eos_fraction", "copied_bigrams",
                "kl"} <= set(row) and "relevance_gap" not in row
    assert results["rows"]["start"]["kl"] == 0.0
    assert "rouge_l_gain_over_ref" in results["rows"]["sft"]
    assert [s["post"] for s in results["samples"]["sft"]] == [0, 1, 2, 3]
    page = (out / "samples.html").read_text()
    assert page.count("<tr>") == 1 + 4 and "start (SmolLM2)" in page and ">SFT<" in page
    assert "no judge in" in printed and "SFT over its start, paired by post" in printed
    # the saved model is the merged one: no adapter tensor, and not the tiny model it began as
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~disk.UMASK
    saved = load_file(str(out / "model.safetensors"))
    assert not any(name.endswith(("down.weight", "up.weight")) for name in saved)
    start = loaders.tiny_model(tokenizer, seed=0)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (saved[name] - start.state_dict()[name]).abs().max() > 1e-4


@pytest.mark.slow
def test_ppo_from_the_sft_model_starts_with_ratio_one_and_kl_zero(tiny_sft, tiny_reward_model,
                                                                   tmp_path):
    out, _ = tiny_sft
    done = run("ppo.py", "--preset", "tiny", "--model", str(out), "--beta", "0.1",
               "--iterations", "2", "--reward-model", str(tiny_reward_model),
               "--out", str(tmp_path / "ppo"))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "ppo" / "results.json").read_text())
    assert results["config"]["model"] == str(out)
    first = results["iterations"][0]
    assert first["ratio_min"] == first["ratio_max"] == 1.0
    assert first["kl"] == 0.0                           # the reference is the SFT model itself
    # and the reference really is the SFT model, not the tiny model it began as: its held-out
    # samples are the SFT model's under the same seed
    sft_texts = [s["text"] for s in json.loads((out / "results.json").read_text())
                 ["samples"]["sft"]]
    assert [s["text"] for s in results["final"]["ref_samples"]] == sft_texts
    # the post's start beside it: the model sft.py began from, sampled as sft.py sampled it
    start_texts = [s["text"] for s in json.loads((out / "results.json").read_text())
                   ["samples"]["start"]]
    assert results["final"]["start"]["model"] == loaders.POLICY_NAME
    assert [s["text"] for s in results["final"]["start_samples"]] == start_texts
    assert start_texts != sft_texts
    page = (tmp_path / "ppo" / "samples.html").read_text()
    assert "SmolLM2 (before SFT)" in page and "reference (SFT)" in page
    assert "SmolLM2 reward" in page
    assert f"the samples sft.py drew in {out}, scored here" in done.stdout


@pytest.mark.slow
def test_ppo_reads_sft_draws_back_to_the_same_rows_it_would_sample(tiny_sft, tiny_reward_model,
                                                                    tmp_path):
    """ppo.py scores the ids sft.py drew for its reference and start rows rather than
    drawing them again: every number of those rows, per post too, is the one a fresh draw
    gives (a copy of the SFT folder without the key samples from scratch). Another sampler
    setting does not read them back. RLOO's 2 prompts x 2 samples share PPO's rows (held-out
    batches of 4 either way): it reads back the judge's copy of the "read" run's."""
    out, _ = tiny_sft
    judge = tmp_path / "judge"                          # no rows kept beside it by other tests
    shutil.copytree(tiny_reward_model, judge, ignore=shutil.ignore_patterns("baselines"))
    fresh = tmp_path / "sft_copy"
    shutil.copytree(out, fresh)
    saved = json.loads((fresh / "results.json").read_text())
    del saved["draws_key"]                              # an older sft.py's: draw again
    (fresh / "results.json").write_text(json.dumps(saved))
    finals = {}
    grouped = ["--estimator", "rloo", "--batch", "2", "--samples-per-prompt", "2"]
    for name, model, extra in (("read", out, []), ("drawn", fresh, []),
                               ("hotter", out, ["--temperature", "0.9"]),
                               ("grouped", out, grouped)):
        done = run("ppo.py", "--preset", "tiny", "--model", str(model), "--iterations", "1",
                   "--reward-model", str(judge), "--out", str(tmp_path / name), *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("sft.py drew" in done.stdout) == (name == "read")
        assert ("rows: from" in done.stdout) == (name == "grouped")    # the judge's copy
        finals[name] = json.loads((tmp_path / name / "results.json").read_text())["final"]
    for key in ("ref", "start", "ref_samples", "start_samples"):
        for name in ("drawn", "grouped"):
            read, other = finals["read"][key], finals[name][key]
            if key == "start":
                read, other = {**read, "model": None}, {**other, "model": None}
            assert read == other, (key, name)


@pytest.mark.slow
def test_bench_heldout_scores_the_draws_of_both_models_to_the_same_rows(tiny_sft,
                                                                        tiny_reward_model):
    out, _ = tiny_sft
    done = run("-m", "tools.bench_heldout", "--preset", "tiny", "--model", str(out),
               "--reward-model", str(tiny_reward_model))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "preset tiny, 4 posts, 2 models sampled" in done.stdout
    assert done.stdout.rstrip().endswith("the same numbers: True")


@pytest.mark.slow
def test_no_room_and_a_held_folder_stop_it_in_one_line(tmp_path, monkeypatch, capsys,
                                                        data_dir):
    monkeypatch.setattr(cli, "free_bytes", lambda path: (1_000_000, str(tmp_path)))
    with pytest.raises(SystemExit) as stop:
        cli.run_script(sft.main, ["--preset", "tiny", "--out", str(tmp_path / "sft")])
    assert "no room for the SFT model in" in str(stop.value.code)
    assert list(tmp_path.iterdir()) == []               # nothing made, no lock file left
    monkeypatch.undo()
    with disk.holding([tmp_path / "held"]):
        with pytest.raises(SystemExit) as stop:
            cli.run_script(sft.main, ["--preset", "tiny", "--out", str(tmp_path / "held")])
    assert "is in use by process" in str(stop.value.code)
    assert not (tmp_path / "held").exists()


@pytest.mark.slow
def test_a_judge_is_read_on_the_sft_models_samples(tiny_sft, tiny_reward_model):
    """tools/rm_relevance --samples-from: the third set holds the SFT model's samples, which
    metrics.json (the judge's own start's samples) has no number for."""
    out, _ = tiny_sft
    done = run("-m", "tools.rm_relevance", "--reward-model", str(tiny_reward_model),
               "--samples-from", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"samples from {out})" in done.stdout
    row = next(line.split() for line in done.stdout.splitlines()
               if line.startswith("samples, held-out posts"))
    assert row[-4] == "-"                               # not the draw metrics.json scored
    assert 0 <= float(row[-7]) <= 1


def test_a_nan_loss_stops_sft_in_one_line_and_saves_nothing(tmp_path, monkeypatch, sft_data):
    """A non-finite loss at step 2 (as a broken GPU kernel would give) ends the script with
    one line naming the step, before the optimizer steps on it; no folder is written."""
    real, calls = sft.sft_loss, []

    def sft_loss(*args):
        calls.append(real(*args))
        return float("nan") if len(calls) == 2 else calls[-1]
    monkeypatch.setattr(sft, "sft_loss", sft_loss)
    out = tmp_path / "sft"
    with pytest.raises(SystemExit) as stop:
        cli.run_script(sft.main, ["--preset", "tiny", "--out", str(out),
                                  "--reward-model", str(tmp_path / "no_judge"),
                                  "--data-dir", str(sft_data)])
    assert str(stop.value.code).startswith("sft.py: error: step 2: the loss is NaN or inf")
    assert "\n" not in str(stop.value.code) and len(calls) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_nan_gradient_stops_sft_before_its_step_and_saves_nothing(tmp_path, monkeypatch,
                                                                      sft_data):
    """The loss finite but one gradient value NaN at step 2: one line naming the gradient,
    before AdamW steps on it (the adapter stays finite); no folder is written."""
    real, adapters = sft.sft_loss, []

    def sft_loss(policy, *args):
        loss = real(policy, *args)
        adapters.append([p for p in policy.parameters() if p.requires_grad])
        if len(adapters) == 2:
            adapters[-1][0].grad.view(-1)[5] = float("nan")
        return loss
    monkeypatch.setattr(sft, "sft_loss", sft_loss)
    with pytest.raises(SystemExit) as stop:
        cli.run_script(sft.main, ["--preset", "tiny", "--out", str(tmp_path / "sft"),
                                  "--reward-model", str(tmp_path / "no_judge"),
                                  "--data-dir", str(sft_data)])
    total = sum(p.numel() for p in adapters[-1])
    assert str(stop.value.code).startswith(
        f"sft.py: error: step 2: the gradient is NaN or inf in 1 of {total} values")
    assert all(torch.isfinite(p).all() for p in adapters[-1])
    assert list(tmp_path.iterdir()) == []
