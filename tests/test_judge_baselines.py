"""Tests for support/judge_baselines.py and the judge's saved split (issue 75).

Run:  pytest tests/test_judge_baselines.py

Every input is made by hand: a few comparisons with named systems and lengths, a pair voted
twice, scores with ties; the expected accuracies and intervals are worked out in the tests.
"""
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import dpo  # noqa: E402
import reward_model as rm  # noqa: E402
from support import cli, rm_data  # noqa: E402
from support import judge_baselines as jb  # noqa: E402
from tools.analysis import judge_baselines as tool  # noqa: E402


def pair(pid, chosen, rejected, lw, ll, post="t3_a"):
    """A held-out or training pair as rm_data.prepare_pairs makes it (the fields used here)."""
    return {"post_id": post, "pair": f"{post}:{pid}", "chosen_policy": chosen,
            "rejected_policy": rejected, "chosen_len": lw, "rejected_len": ll}


# Training: "ppo" beats "sft" 3 times of 4; "ref" beats "6b" once, loses once.
TRAIN = [pair("1", "ppo", "sft", 30, 20), pair("2", "ppo", "sft", 30, 20),
         pair("3", "ppo", "sft", 10, 20), pair("4", "sft", "ppo", 20, 30),
         pair("5", "ref", "6b", 10, 12), pair("6", "6b", "ref", 12, 10)]


def test_system_win_rates_count_every_comparison_a_system_took_part_in():
    rates = jb.system_win_rates(TRAIN)
    assert rates == {"ppo": 0.75, "sft": 0.25, "ref": 0.5, "6b": 0.5}


def test_the_rules_score_each_side_and_a_tie_or_an_unseen_system_counts_one_half():
    rates = jb.system_win_rates(TRAIN)
    held = [pair("a", "ppo", "sft", 5, 9),        # system right, length wrong
            pair("b", "sft", "ppo", 9, 9),        # system wrong, length a tie
            pair("c", "new", "ppo", 7, 3),        # unseen system (1/2) against 0.75: wrong
            pair("d", "ref", "6b", 4, 3)]         # system a tie (both 0.5), length right
    scores = jb.rule_scores(held, rates, logp=(torch.tensor([-1., -2, -3, -4]),
                                              torch.tensor([-2., -2, -1, -5])))
    assert jb.correct(*scores["system"]).tolist() == [1, 0, 0, 0.5]
    assert jb.correct(*scores["length"]).tolist() == [0, 0.5, 1, 1]
    assert jb.correct(*scores["sft"]).tolist() == [1, 0.5, 0, 1]


def test_a_pair_voted_twice_counts_once_with_its_votes_averaged():
    ids, values = jb.by_pair(["x", "y", "x", "z", "x"], [1, 0, 0, 1, 1])
    assert ids == ["x", "y", "z"]
    assert values.tolist() == pytest.approx([2 / 3, 0, 1])


def test_pair_id_is_the_post_and_the_two_texts_unordered():
    assert rm_data.pair_id("t3_a", "one", " two ") == rm_data.pair_id("t3_a", "two", "one")
    assert rm_data.pair_id("t3_a", "one", "two") != rm_data.pair_id("t3_b", "one", "two")
    assert rm_data.pair_id("t3_a", "one", "two") != rm_data.pair_id("t3_a", "one", "three")


def test_the_paired_interval_is_the_mean_difference_and_its_t_interval():
    # d = [1, 0, 0, 1]: mean 1/2, SD sqrt(4 * 0.25 / 3), SE SD / 2; t_{0.975, 3} = 3.1824
    got = jb.paired_interval([1, 1, 0, 1], [0, 1, 0, 0])
    se = math.sqrt(1 / 3) / 2
    assert got["difference"] == pytest.approx(0.5)
    assert got["se"] == pytest.approx(se) and got["df"] == pytest.approx(3)
    assert (got["low"], got["high"]) == pytest.approx((0.5 - 3.1824 * se, 0.5 + 3.1824 * se),
                                                      rel=1e-4)
    assert got["pairs"] == 4
    assert math.isnan(jb.paired_interval([1], [0])["se"])       # one pair: no spread to see


def test_near_chance_keeps_contrasts_where_neither_rule_reaches_the_threshold():
    strength = {"a vs b": {"comparisons": 30, "system": 0.55, "length": 0.62},
                "c vs d": {"comparisons": 30, "system": 0.71, "length": 0.50},   # system
                "e vs f": {"comparisons": 30, "system": 0.50, "length": 0.70},   # length
                "g vs h": {"comparisons": 5, "system": 0.50, "length": 0.50}}    # too few
    assert jb.near_chance(strength, threshold=0.70, least=20) == ["a vs b"]


def test_contrast_strength_measures_each_rule_on_the_training_comparisons_of_a_contrast():
    got = jb.contrast_strength(TRAIN, jb.system_win_rates(TRAIN))
    assert got["ppo vs sft"] == {"comparisons": 4, "system": 0.75, "length": 0.5}
    assert got["6b vs ref"] == {"comparisons": 2, "system": 0.5, "length": 0.5}


def test_the_report_counts_distinct_pairs_and_pairs_each_judge_with_each_rule(monkeypatch):
    monkeypatch.setattr(jb, "MIN_CONTRAST", 2)
    ids = ["p1", "p1", "p2", "p3", "q1", "q2"]
    contrasts = ["A vs B"] * 4 + ["C vs D"] * 2
    right = {"judge": torch.tensor([1., 0, 1, 1, 0, 1]),
             "system": torch.tensor([1., 1, 1, 0, 1, 0]),
             "length": torch.tensor([0., 0, 1, 1, 0.5, 0.5])}
    got = jb.report(ids, contrasts, right, ["judge"], near=["C vs D"])
    assert set(got) == {"all", "all but A vs B", "near chance", "A vs B", "C vs D"}
    every = got["all"]
    assert (every["rows"], every["pairs"]) == (6, 5)
    # per distinct pair: judge [1/2, 1, 1, 0, 1], system [1, 1, 0, 1, 0]
    assert every["accuracy"]["judge"]["accuracy"] == pytest.approx(3.5 / 5)
    assert every["accuracy"]["system"]["accuracy"] == pytest.approx(3 / 5)
    assert every["paired"]["judge"]["system"]["difference"] == pytest.approx(0.5 / 5)
    assert "judge" not in every["paired"]["judge"]                # a judge is not a rule
    assert got["near chance"]["pairs"] == 2
    assert got["near chance"]["accuracy"]["length"]["accuracy"] == 0.5
    assert got["A vs B"]["accuracy"]["judge"]["accuracy"] == pytest.approx(2.5 / 3)


def test_baselines_from_pairs_carry_every_vote_and_the_near_chance_contrasts(monkeypatch):
    monkeypatch.setattr(jb, "MIN_CONTRAST", 2)
    held = [pair("a", "ppo", "sft", 5, 9), pair("a", "sft", "ppo", 9, 5),   # voted both ways
            pair("b", "ref", "6b", 4, 3)]
    judge = (torch.tensor([2., 2, 1]), torch.tensor([1., 1, 1]))         # right, right, tie
    got = jb.baselines(TRAIN, held, {"content": judge})
    assert got["near_chance"] == ["6b vs ref"]                # 0.5 and 0.5 on training
    assert got["per_pair"]["pair"] == ["t3_a:a", "t3_a:a", "t3_a:b"]
    assert got["per_pair"]["system"] == [1, 0, 0.5]
    assert got["per_pair"]["content"] == [1, 1, 0.5]
    assert got["groups"]["all"]["pairs"] == 2
    assert (got["most_votes_on_a_pair"], got["pairs_voted_both_ways"]) == (2, 1)
    # the pair voted both ways: the system rule is right on one vote of two
    assert got["groups"]["all"]["accuracy"]["system"]["accuracy"] == pytest.approx(0.5)
    assert got["groups"]["all"]["accuracy"]["content"]["accuracy"] == pytest.approx(0.75)


def dpo_run(seed, implicit, fingerprint="f1"):
    """A results.json of dpo.py as far as `dpo_near_chance` reads it."""
    per = {"pair": ["x", "x", "y", "z"], "contrast": ["A vs B", "A vs B", "C vs D", "A vs B"],
           "implicit": implicit, "content": [1, 0, 1, 0], "full": [1, 1, 1, 1]}
    return {"config": {"seed": seed, "out": f"runs/dpo_s{seed}"},
            "final": {"judges": {"baselines": {"per_pair": per},
                                 "split_fingerprint": fingerprint}}}


def test_dpo_near_chance_pairs_the_implicit_judge_with_the_explicit_one_per_seed_and_pooled():
    kept = {"near_chance": ["A vs B"], "split_fingerprint": "f1", "judge": "runs/rm"}
    runs = [dpo_run(0, [1, 1, 0, 1]), dpo_run(1, [0, 0, 0, 1])]
    got = jb.dpo_near_chance(runs, kept)
    first = got["seeds"][0]
    # near chance: pairs x (votes 1, 0 for content) and z; implicit [1, 1], content [1/2, 0]
    assert first["implicit"]["accuracy"] == 1.0 and first["implicit"]["pairs"] == 2
    assert first["content"]["accuracy"] == pytest.approx(0.25)
    assert first["implicit_minus_content"]["difference"] == pytest.approx(0.75)
    assert first["implicit_minus_full"]["difference"] == 0.0
    # seed 1: implicit [0, 1], so d = [[1/2, 1], [-1/2, 1]] (seed, pair); by (V2) of
    # support/intervals.py: MS_seed 1/4, MS_post 1, MS_rest 1/4, V = (1/4 + 3/4) / 4
    pooled = got["pooled_implicit_minus_content"]
    assert pooled["difference"] == pytest.approx(0.5) and pooled["pairs"] == 2
    assert pooled["seeds"] == 2 and pooled["se"] == pytest.approx(0.5)


def test_dpo_near_chance_with_no_near_chance_contrast_has_no_pair_and_says_nan():
    got = jb.dpo_near_chance([dpo_run(0, [1, 1, 0, 1])], {"near_chance": [],
                                                          "split_fingerprint": "f1"})
    assert got["seeds"][0]["implicit"]["pairs"] == 0
    assert got["pooled_implicit_minus_content"]["pairs"] == 0
    assert math.isnan(got["pooled_implicit_minus_content"]["difference"])


def test_dpo_near_chance_refuses_a_run_without_pairs_or_of_another_split():
    kept = {"near_chance": ["A vs B"], "split_fingerprint": "f1", "judge": "runs/rm"}
    old = {"config": {"seed": 0, "out": "runs/old"}, "final": {"judges": {"pairs": 128}}}
    with pytest.raises(ValueError, match="runs/old holds no per-pair data"):
        jb.dpo_near_chance([old], kept)
    with pytest.raises(ValueError, match="another split"):
        jb.dpo_near_chance([dpo_run(0, [1, 1, 1, 1], fingerprint="f2")], kept)


# ------------------------------------------------------------------ the judge's split

class Judge:
    """What dpo.judge_split and dpo.check_split read of a loaded judge."""
    def __init__(self, split):
        self.settings = {"seed": 0, "max_prompt_tokens": 64, "max_summary_tokens": 24}
        if split is not None:
            self.settings["split"] = split


def test_dpo_stops_with_one_line_when_the_judge_does_not_say_how_it_split():
    cfg = dpo.parse_args(["--preset", "tiny", "--reward-model", "runs/rm_old"])
    with pytest.raises(cli.UserError, match="^runs/rm_old/config.json does not say how the "
                                            "judge split its comparisons"):
        dpo.judge_split(cfg, Judge(None))
    partial = {"seed": 0, "max_summary_tokens": 24, "fingerprint": "f"}   # no fraction
    with pytest.raises(cli.UserError, match="heldout_fraction"):
        dpo.judge_split(cfg, Judge(partial))


def test_dpo_rebuilds_the_split_from_the_judges_settings():
    cfg = dpo.parse_args(["--preset", "tiny", "--reward-model", "runs/rm"])   # 8 held out
    split = {"seed": 3, "heldout_fraction": 0.4, "max_pairs": 16, "max_heldout_pairs": 5,
             "max_prompt_tokens": 64, "max_summary_tokens": 20, "fingerprint": "f"}
    got = dpo.judge_split(cfg, Judge(split))
    assert (got.seed, got.heldout_fraction, got.max_pairs, got.max_summary_tokens) == \
        (3, 0.4, 16, 20)
    assert got.max_heldout_pairs == 5                 # the judge's 5 within this run's 8
    assert dpo.judge_split(cfg, Judge({**split, "max_heldout_pairs": 0})).max_heldout_pairs == 8


def comparison(i):
    return {"post_id": f"t3_{i}", "chosen": f"a{i}", "rejected": f"b{i}"}


def test_the_split_fingerprint_changes_with_the_split_and_dpo_refuses_another():
    one = rm_data.Data([], [], [comparison(1), comparison(2)], [comparison(3)], set())
    other = rm_data.Data([], [], [comparison(1)], [comparison(2), comparison(3)], set())
    assert rm_data.split_fingerprint(one) != rm_data.split_fingerprint(other)
    config = rm.Config(seed=2, heldout_fraction=0.3, max_pairs=7)
    saved = rm_data.split_settings(config, one)
    assert (saved["seed"], saved["heldout_fraction"], saved["max_pairs"]) == (2, 0.3, 7)
    cfg = dpo.parse_args(["--preset", "tiny", "--reward-model", "runs/rm"])
    dpo.check_split(one, Judge(saved), cfg)           # the same split: nothing said
    with pytest.raises(cli.UserError, match="do not split as runs/rm's did"):
        dpo.check_split(other, Judge(saved), cfg)


# ------------------------------------------------------------------ the page

def test_reward_model_md_holds_the_table_the_tool_makes_from_the_kept_file():
    """docs/reward_model.md's table is `tools.analysis.judge_baselines --table` on the file it names."""
    page = (ROOT / "docs" / "reward_model.md").read_text()
    found = re.findall(r"<!-- python -m tools.analysis.judge_baselines --table (\S+) -->\n(.*?)\n"
                       r"<!-- end of the table -->", page, re.S)
    assert found
    for path, text in found:
        assert text == tool.table(json.loads((ROOT / path).read_text())), path


def test_reward_model_md_holds_dpos_like_for_like_lines_from_the_kept_runs():
    """The DPO block of docs/reward_model.md is `judge_baselines --dpo` on the kept like-for-like
    runs it names, every one of them; 'not kept yet' only while none is kept."""
    page = (ROOT / "docs" / "reward_model.md").read_text()
    block = re.search(r"<!-- dpo like for like -->\n(.*?)\n<!-- end of the dpo lines -->",
                      page, re.S).group(1)
    kept = sorted((ROOT / "docs" / "runs" / "claims").glob("dpo_human_s*.json"))
    if not kept:
        assert block == "DPO's runs are not kept yet."
        return
    command, _, lines = block.partition("\n\n")
    runs = re.search(r"--dpo (.*?) --table", command).group(1).split()
    table = re.search(r"--table (\S+)", command).group(1)
    assert sorted(ROOT / r for r in runs) == kept
    expected = tool.dpo_lines([ROOT / r for r in runs], ROOT / table)
    assert lines == "\n".join("    " + x for x in expected.splitlines())


def test_the_sft_log_probs_come_back_from_a_kept_file_of_the_same_split_only(tmp_path):
    path = tmp_path / "kept.json"
    path.write_text(json.dumps({"split_fingerprint": "f1", "sft": "runs/sft",
                                "sft_logp": [[-1.0, -2.0], [-3.0, -0.5]]}))
    (w, l), sft, where = tool.sft_from(path, "f1", 2)
    assert w.tolist() == [-1.0, -3.0] and l.tolist() == [-2.0, -0.5] and sft == "runs/sft"
    assert where is None                                  # the file names no CPU
    with pytest.raises(cli.UserError, match="another split"):
        tool.sft_from(path, "f2", 2)


def test_the_readme_and_the_pages_opening_quote_the_kept_file_it_shows():
    page = (ROOT / "docs" / "reward_model.md").read_text()
    path = re.search(r"<!-- python -m tools.analysis.judge_baselines --table (\S+) -->", page).group(1)
    every = json.loads((ROOT / path).read_text())["groups"]["all"]["accuracy"]
    line = next(l for l in (ROOT / "README.md").read_text().splitlines()
                if "means little alone" in l)
    start = page.index("That agreement means little alone")        # the page's own line
    opening = page[start:page.index("Back to the [README]", start)]
    for scorer in ("system", "length", "content", "full"):
        if scorer in every:
            assert f"{every[scorer]['accuracy']:.3f}" in line, scorer
            assert f"{every[scorer]['accuracy']:.3f}" in opening, scorer



# ------------------------------------------------------------------ the scripts

@pytest.mark.slow
def test_the_judges_run_keeps_its_split_and_the_rules_beside_its_scores(tiny_reward_model):
    """`reward_model.py --preset tiny`: the rules beside both scores, every vote, on distinct
    pairs, in metrics.json; the split's settings in config.json, for dpo.py."""
    metrics = json.loads((tiny_reward_model / "metrics.json").read_text())
    base = metrics["extra"]["baselines"]
    every = base["groups"]["all"]
    assert every["rows"] == metrics["heldout_pairs"] >= every["pairs"]
    assert set(every["paired"]) == {"content", "full"}
    assert set(every["paired"]["full"]) == {"system", "length"}
    votes = base["per_pair"]
    assert sum(votes["length"]) / len(votes["length"]) == pytest.approx(
        metrics["length_baseline_accuracy"])            # the same rule, counted by vote
    assert sum(votes["content"]) / len(votes["content"]) == pytest.approx(
        metrics["content_heldout_accuracy"])
    split = json.loads((tiny_reward_model / "config.json").read_text())["split"]
    assert (split["seed"], split["heldout_fraction"], split["max_pairs"]) == (0, 0.25, 16)
    assert len(split["fingerprint"]) == 16
