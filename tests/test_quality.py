"""Tests for quality.py: each number below is worked out by hand in the comment above it.

Run:  python -m pytest -q tests/test_quality.py
"""
import math
from html.parser import HTMLParser

import pytest

from support.quality import (asks_for_help, ends_with_question, idf_weights,
                             paired_difference, relevance_gap, retrieval_ranks, retrieval_summary,
                     rouge_l, samples_page, tfidf_vectors, words)


# ---------------------------------------------------------------- words

def test_words_lowercases_and_keeps_inner_apostrophes():
    # "—" and "." split words; quotes around a word go, the one inside "don't" stays;
    # the curly apostrophe of "I’m" reads as a straight one; "_" splits like punctuation.
    assert words("Don't STOP—it's 2 a.m.!") == ["don't", "stop", "it's", "2", "a", "m"]
    assert words("'quoted' I’m snake_case") == ["quoted", "i'm", "snake", "case"]
    assert words("  ?! ") == []


# ---------------------------------------------------------------- ROUGE-L

def test_rouge_l_identical_disjoint_and_empty():
    # Same words (case and punctuation do not count): P = R = 1 -> F1 = 1.
    assert rouge_l("The CAT sat!", "the cat sat") == 1.0
    assert rouge_l("red blue", "green yellow") == 0.0       # LCS 0
    assert rouge_l("", "the cat") == 0.0                    # no words on one side
    assert rouge_l("the cat", "...") == 0.0
    assert isinstance(rouge_l("a", "a"), float)


def test_rouge_l_worked_examples():
    # "the cat sat on the mat" vs "the cat is on the mat": LCS = "the cat on the mat" = 5,
    # P = 5/6, R = 5/6, F1 = 2 (25/36) / (10/6) = 5/6.
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # "the cat" vs "the cat sat on the mat": LCS 2, P = 2/2 = 1, R = 2/6 = 1/3,
    # F1 = 2 (1/3) / (4/3) = 1/2.
    assert rouge_l("the cat", "the cat sat on the mat") == pytest.approx(0.5)
    # Order matters: "mat the on" vs "the cat on the mat" share all 3 words, but "mat" ends
    # the reference, so the LCS is "the on" = 2: P = 2/3, R = 2/5,
    # F1 = 2 (4/15) / (16/15) = 1/2.
    assert rouge_l("mat the on", "the cat on the mat") == pytest.approx(0.5)


def test_rouge_l_stems_as_the_papers_do():
    # rouge-score's tokens: lowercase a-z0-9 runs, words of more than 3 letters cut to their
    # Porter stem. X = the cat(s) run(ning), Y = a cat run(s): "the" and "a" differ, the
    # stems meet, LCS = "cat run" = 2 of 3 tokens on each side: P = R = 2/3, F1 = 2/3.
    assert rouge_l("the cats running", "a cat runs") == pytest.approx(2 / 3, abs=1e-12)
    # Unstemmed, "cats"/"cat" and "running"/"runs" would not match: F1 0.
    # Apostrophes split tokens: "don't" is "don" "t" in both, so the two texts agree fully.
    assert rouge_l("Don't stop", "don't STOP!") == 1.0
    # A word of 3 letters or fewer is not stemmed: "ran" and "run" stay apart, LCS = "i"
    # of 2 and 2 tokens: P = R = 1/2, F1 = 1/2.
    assert rouge_l("i ran", "i run") == pytest.approx(0.5, abs=1e-12)


# ---------------------------------------------------------------- TF-IDF and retrieval

POSTS = ["apple banana", "car truck", "rain snow"]             # no word in common


def test_idf_and_unit_vectors_by_hand():
    # N = 2 documents. "apple" is in both: idf = log(3/3) + 1 = 1. "banana" and "cherry"
    # are in one each: idf = log(3/2) + 1. Document 0 = (apple 1, banana 1 + log 1.5) / norm.
    idf = idf_weights(["apple banana apple", "apple cherry"])
    assert idf["apple"] == pytest.approx(1.0)
    assert idf["banana"] == pytest.approx(math.log(1.5) + 1)
    v = tfidf_vectors(["apple banana", "apple cherry"])
    b = math.log(1.5) + 1
    assert v[0]["apple"] == pytest.approx(1 / math.sqrt(1 + b * b))
    assert v[0]["banana"] == pytest.approx(b / math.sqrt(1 + b * b))
    # tf is the raw count: "apple" twice weighs 2 before normalising (2 * 1 vs b).
    v = tfidf_vectors(["apple banana apple", "apple cherry"])
    assert v[0]["apple"] / v[0]["banana"] == pytest.approx(2 / b)
    for vec in tfidf_vectors(POSTS + ["apple apple car", "the cat sat on the mat"]):
        assert sum(x * x for x in vec.values()) == pytest.approx(1.0)
    assert tfidf_vectors(["apple", ""])[1] == {}               # no words: no vector


def test_retrieval_each_summary_finds_its_post():
    # Each summary shares a word with its own post only: cosine > 0 there, 0 elsewhere.
    ranks = retrieval_ranks(["banana", "truck car", "snow"], POSTS)
    assert ranks == [1, 1, 1]
    assert retrieval_summary(ranks) == {"top1": 1.0, "mrr": 1.0, "n": 3}


def test_retrieval_swapped_summaries():
    # Summaries 0 and 1 swapped: summary 0 ("truck") scores 0 on its own post 0, and post 1
    # (> 0) and post 2 (0, a tie) both count against it -> rank 3; summary 1 likewise 3;
    # summary 2 is still 1. top1 = 1/3, MRR = (1/3 + 1/3 + 1) / 3 = 5/9.
    ranks = retrieval_ranks(["truck", "banana", "snow"], POSTS)
    assert ranks == [3, 3, 1]
    s = retrieval_summary(ranks)
    assert s["top1"] == pytest.approx(1 / 3) and s["mrr"] == pytest.approx(5 / 9)
    assert s["n"] == 3


def test_retrieval_ties_and_unknown_words_rank_last():
    # "apple" is in posts 0 and 1 once each; "banana" and "cherry" have the same idf, so the
    # two cosines are equal: the tie counts against summary 0 -> rank 2. "apple banana" picks
    # post 0 alone -> 1. "zebra" is in no post: every cosine 0, all N-1 ties -> rank N = 3.
    posts = ["apple banana", "apple cherry", "grape"]
    assert retrieval_ranks(["apple", "cherry apple", "zebra"], posts) == [2, 1, 3]
    assert retrieval_ranks(["apple banana", "", "grape"], posts) == [1, 3, 1]


def test_retrieval_bad_input():
    with pytest.raises(ValueError):
        retrieval_ranks(["a", "b"], ["a"])
    with pytest.raises(ValueError):
        retrieval_summary([])


# ---------------------------------------------------------------- paired differences

def test_paired_difference_by_hand():
    # d = 2, 3, 4: mean 3; s^2 = ((-1)^2 + 0 + 1^2) / (3 - 1) = 1; SE = 1 / sqrt(3).
    mean, se = paired_difference([3, 5, 7], [1, 2, 3])
    assert mean == pytest.approx(3.0) and se == pytest.approx(1 / math.sqrt(3))
    # Pairing: the posts' own spread (here +-10) cancels; unpaired, the SE would be ~6.
    ref = [10.0, -10.0, 0.0]
    mean, se = paired_difference([r + d for r, d in zip(ref, [2, 3, 4])], ref)
    assert mean == pytest.approx(3.0) and se == pytest.approx(1 / math.sqrt(3))
    # One pair: d = 3, no spread to measure -> SE NaN.
    mean, se = paired_difference([5], [2])
    assert mean == 3.0 and math.isnan(se)


def test_paired_difference_bad_input():
    with pytest.raises(ValueError):
        paired_difference([1, 2], [1])
    with pytest.raises(ValueError):
        paired_difference([], [])


def test_relevance_gap_by_hand():
    # gaps 2 - 0.5 = 1.5 and 1 - 1.5 = -0.5: mean 0.5; s^2 = (1^2 + 1^2) / 1 = 2;
    # SE = sqrt(2 / 2) = 1.
    mean, se = relevance_gap([2.0, 1.0], [0.5, 1.5])
    assert mean == pytest.approx(0.5) and se == pytest.approx(1.0)


# ---------------------------------------------------------------- questions and help

def test_ends_with_question():
    assert ends_with_question("Is this normal?  \n")
    assert ends_with_question("?")
    assert not ends_with_question("Is this normal? I think so.")
    assert not ends_with_question("")


@pytest.mark.parametrize("text", ["Any advice?", "what should I do", "HELP ME please",
                                  "How do I tell her", "Should I stay", "any tips for a first job",
                                  "got any ideas, reddit?", "any suggestions", "what do i do now"])
def test_asks_for_help_positive(text):
    assert asks_for_help(text)


@pytest.mark.parametrize("text", ["I should tell her.", "should it matter", "She helped me move",
                                  "no advice given", "how do you do", ""])
def test_asks_for_help_negative(text):
    # Whole words only: "should it" is not "should i", "helped me" is not "help me".
    assert not asks_for_help(text)


# ---------------------------------------------------------------- the samples page

class TableWalker(HTMLParser):
    """Checks that container tags nest and close, and collects each body row's cell texts."""
    NESTED = {"html", "head", "body", "table", "thead", "tbody", "tr", "td", "th", "details",
              "summary", "script", "style", "p", "b"}

    def __init__(self):
        super().__init__()
        self.stack, self.rows, self.starts = [], [], []
        self.in_body = False

    def handle_starttag(self, tag, attrs):
        self.starts.append(tag)
        if tag in self.NESTED:
            self.stack.append(tag)
        if tag == "tbody":
            self.in_body = True
        elif tag == "tr" and self.in_body:
            self.rows.append([])
        elif tag == "td" and self.in_body:
            self.rows[-1].append("")

    def handle_endtag(self, tag):
        if tag in self.NESTED:
            assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
            self.stack.pop()
        if tag == "tbody":
            self.in_body = False

    def handle_data(self, data):
        if self.in_body and self.stack[-1:] in (["td"], ["summary"], ["details"]):
            self.rows[-1][-1] += data


def walk(page):
    walker = TableWalker()
    walker.feed(page)
    walker.close()
    assert walker.stack == [], f"unclosed: {walker.stack}"
    return walker


LONG = "My (24F) boyfriend (25M) " + "keeps forgetting things " * 10   # > 100 characters
ROWS = [
    {"post": "a post about money", "human": "money", "reference": "ref 0", "policy": "low",
     "policy_reward": -1.0, "reference_reward": 0.25, "human_reward": 1.5,
     "policy_length": 12, "reference_length": 20, "policy_rouge_l": 0.3333,
     "reference_rouge_l": 0.1, "policy_rank": 2, "reference_rank": 7},
    {"post": "<script>alert('post')</script>", "human": "x & y", "reference": "<b>bold</b>",
     "policy": "<script>alert(1)</script>", "policy_reward": 2.0},
    {"post": LONG, "human": None, "reference": "ref 2", "policy": "unscored",
     "policy_reward": None, "human_reward": float("nan")},
    {"post": "short", "policy": "middle", "policy_reward": 0.5},
]
POLICY, POLICY_REWARD, HUMAN_REWARD = 4, 5, 7                  # column indices


def test_samples_page_orders_by_policy_reward():
    rows = walk(samples_page(ROWS, "beta 0.1, seed 0")).rows
    # Rewards 2.0, 0.5, -1.0, then the row without one; "#" is the index in ROWS.
    assert [r[POLICY] for r in rows] == ["<script>alert(1)</script>", "middle", "low", "unscored"]
    assert [r[0] for r in rows] == ["1", "3", "0", "2"]
    assert [r[POLICY_REWARD] for r in rows] == ["+2.00", "+0.50", "-1.00", "\u2014"]
    assert rows[2][5:] == ["-1.00", "+0.25", "+1.50", "12", "20", "0.33", "0.10", "2", "7"]


def test_samples_page_escapes_and_dashes():
    page = samples_page(ROWS, "<i>title</i>")
    walker = walk(page)
    # Only the page's own <script> is a tag; the samples' are text.
    assert walker.starts.count("script") == 1 and "b" in walker.starts  # <b> of the header
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<i>" not in page and "&lt;i&gt;title&lt;/i&gt;" in page
    assert "x &amp; y" in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    assert "4 posts" in page
    rows = walker.rows
    # Missing, None and NaN all show the dash: row 3 has only policy_reward of the numbers.
    assert rows[1][POLICY_REWARD + 1:] == ["\u2014"] * 8
    assert rows[3][2] == "\u2014" and rows[3][HUMAN_REWARD] == "\u2014"   # None text, NaN


def test_samples_page_post_collapsed_with_a_short_summary():
    page = samples_page(ROWS, "t")
    assert "<details open" not in page
    head = " ".join(LONG.split())[:100] + "\u2026"               # first 100 characters + "..."
    # The short head shows while the post is closed; open, the CSS hides it (.head).
    assert f'<details><summary><span class="head">{head}</span></summary>' in page
    assert '<summary><span class="head">short</span></summary>short</details>' in page
    assert "details[open] .head { display: none; }" in page
    walk(samples_page([], "empty"))                              # no rows: still a valid page


def test_samples_page_shows_the_openai_column_only_where_the_data_has_it():
    """The data's OpenAI 1.3B PPO summaries get a text column and three numbers; a page of
    rows without them has neither (another dataset: absent, not an error)."""
    with_big = [{**ROWS[0], "openai_1b": "a real summariser's TL;DR", "openai_1b_reward": 0.75,
                 "openai_1b_rouge_l": 0.5, "openai_1b_rank": 1}, *ROWS[1:]]
    page = samples_page(with_big, "t")
    assert "OpenAI 1.3B PPO" in page and "a real summariser&#x27;s TL;DR" in page
    rows = walk(page).rows
    low = next(r for r in rows if r[0] == "0")
    assert low[4:6] == ["low", "a real summariser's TL;DR"]
    assert low[6:] == ["-1.00", "+0.25", "+1.50", "+0.75", "12", "20", "0.33", "0.10", "0.50",
                       "2", "7", "1"]
    assert next(r for r in rows if r[0] == "3")[5] == "\u2014"       # this post has none
    assert "OpenAI" not in samples_page(ROWS, "t")
