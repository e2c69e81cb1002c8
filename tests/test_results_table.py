"""tools/analysis/results_table.py: the README's table from results.json files, by hand-made runs.

Run:  python -m pytest -q tests/test_results_table.py
"""
import json

import pytest

from tools.analysis import results_table


def sample(text, reward, rank, **more):
    return {"text": text, "reward": reward, "retrieval_rank": rank, **more}


def results(beta, texts, humans=("the cat sat", "a dog ran")):
    """A finished run on two posts: its policy's texts, SmolLM2's, people's, OpenAI's."""
    return {"config": {"beta": beta, "seed": 0}, "final": {
        "samples": [sample(texts[0], 1.0, 1, eos=True, copied_bigrams=0.5),
                    sample(texts[1], 3.0, 2, eos=False, copied_bigrams=0.0)],
        "ref_samples": [sample("x y", -1.0, 2, eos=False, copied_bigrams=0.0),
                        sample("z", -1.0, 2, eos=False, copied_bigrams=0.0)],
        "human_samples": [sample(h, 0.0, 1, copied_bigrams=0.25) for h in humans],
        "openai_1b_samples": [sample(h, 2.0, 1, copied_bigrams=1.0) for h in humans]}}


def test_rows_by_hand():
    lines = results_table.table([results(0, ["the cat sat", "nothing here"]),
                                 results(0.1, ["cats sat", "a dog ran"])]).splitlines()
    assert len(lines) == 2 + 5                      # header, rule; ref, two runs, OpenAI, people
    # beta 0: rewards 1, 3: mean 2, SE = sd / sqrt 2 = sqrt(2) / sqrt(2) = 1; MRR (1 + 1/2)/2;
    # ROUGE-L (1 + 0) / 2; words (3 + 2) / 2 = 2.5 -> "2" (round half to even); EOS 1 of 2;
    # copied (0.5 + 0) / 2.
    assert lines[3] == "| PPO, β = 0 (seed 0) | +2.00 ± 1.00 | 0.75 | 0.500 | 2 | 50% | 25% |"
    # "cats sat" against "the cat sat": stems cat, sat; LCS 2, P = 1, R = 2/3, F1 = 0.8;
    # the second is the TL;DR itself: 1. Mean 0.9.
    assert lines[4].split(" | ")[3] == "0.900"
    assert lines[2].startswith("| SmolLM2-135M-Instruct (the reference) | -1.00 ± 0.00 | 0.50 |")
    assert lines[5] == "| OpenAI's 1.3B PPO policy (10x our size, 64k+ human labels) | +2.00 ± 0.00 | 1.00 | 1.000 | 3 | — | 100% |"
    assert lines[6] == "| people's TL;DRs | +0.00 ± 0.00 | 1.00 | — | 3 | — | 25% |"


def test_runs_on_other_posts_are_refused():
    with pytest.raises(SystemExit, match="different posts"):
        results_table.table([results(0, ["a", "b"]), results(0, ["a", "b"], humans=("c", "d"))])


def test_no_openai_row_without_its_samples():
    run = results(0, ["a", "b"])
    del run["final"]["openai_1b_samples"]
    assert "OpenAI" not in results_table.table([run])


def test_an_unfinished_run_gives_one_line(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"config": {}, "iterations": []}))
    with pytest.raises(SystemExit, match="no final evaluation"):
        results_table.read_results(tmp_path)
    with pytest.raises(SystemExit, match="no results.json"):
        results_table.read_results(tmp_path / "missing")


def test_the_reference_row_names_the_model_ppo_started_from():
    assert results_table.reference_name({}) == "SmolLM2-135M-Instruct (the reference)"
    assert results_table.reference_name({"model": "runs/sft"}) == "SFT, runs/sft (the reference)"


def test_from_sft_the_post_start_comes_first_then_the_sft_reference():
    run = results(0, ["the cat sat", "nothing here"])
    run["config"]["model"] = "runs/sft"
    run["final"]["start"] = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    run["final"]["start_samples"] = [sample("a b c d", -3.0, 2, eos=False, copied_bigrams=0.0),
                                     sample("dog", -1.0, 1, eos=True, copied_bigrams=1.0)]
    lines = results_table.table([run]).splitlines()
    assert len(lines) == 2 + 5                      # start, SFT, the run, OpenAI, people
    # rewards -3, -1: mean -2, SE 1; MRR (1/2 + 1)/2; ROUGE-L 0 and 0 ("dog" against "a dog
    # ran": LCS 1, P 1, R 1/3, F1 0.5): 0.25; words 4 and 1; EOS 1 of 2; copied 50%
    assert lines[2] == ("| SmolLM2-135M-Instruct (the post's start, before SFT) | -2.00 ± 1.00 "
                        "| 0.75 | 0.250 | 2 | 50% | 50% |")
    assert lines[3].startswith("| SFT, runs/sft (the reference) | -1.00 ± 0.00 |")
    samples = results_table.samples_table([run], [1]).splitlines()
    assert samples[0] == "| human TL;DR | SmolLM2 | SFT | PPO, β = 0 | OpenAI 1.3B |"
    assert samples[2] == '| "a dog ran" | "dog" | "z" | "nothing here" | "a dog ran" |'
