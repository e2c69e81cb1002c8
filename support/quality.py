"""Measures of PPO's summaries that the reward model (the judge) never saw.

PPO maximises the judge's score, so the judge's score alone cannot tell a better summary
from a better exploit of the judge. These pure functions look at the same summaries from
outside it:

    rouge_l            ROUGE-L F1 against the human TL;DR of the same post: how much of the
                       person's summary the sample says, in the same order
    retrieval_ranks    pick the summary's own post out of all held-out posts by TF-IDF cosine:
                       a specific summary finds its post (rank 1), a generic one ("I need
                       advice about my relationship") fits every post and ranks low
    relevance_gap      the judge's score of a summary under its own post minus under another
                       post: a judge that pays for content gives a clear positive gap; one
                       that pays for form (length, tone, a question) gives about 0
    asks_for_help      does the summary ask the reader for advice, and does it end in "?":
    ends_with_question the shape a judge trained on Reddit TL;DRs can be gamed with
    paired_difference  mean and standard error of a_i - b_i over the same posts (policy minus
                       reference), for any of the numbers above
    samples_page       a static HTML page of every held-out post with its human, reference
                       and policy summaries and their numbers, to read the samples themselves

The post has none of these; they are additions for judging its results. Nothing here loads
a model or a tensor; ROUGE-L comes from the `rouge-score` package, the rest is the
standard library.

Choices, each repeated where it is made:
  1. One tokenizer, `words`, for retrieval and the question and help flags: lowercase runs
     of letters and digits (any script), apostrophes kept inside a word ("don't"), curly
     apostrophes read as straight ones; no stemming, no stop words.
  2. ROUGE-L is not ours: it is `rouge-score`'s ROUGE-L F1 with the Porter stemmer, the
     number summarisation papers (Stiennon et al. among them) report, so that ours can sit
     beside theirs. F1 is the beta = 1 form of Lin's F_lcs; Lin's DUC runs weighted recall.
  3. Retrieval ties count against the summary: a summary that scores its own post no higher
     than another post has not found it, and a summary with no word of any post ranks last.

Papers:
  ROUGE-L: Lin 2004, "ROUGE: A Package for Automatic Evaluation of Summaries", Sec. 3
  TF-IDF:  Salton & Buckley 1988, "Term-weighting approaches in automatic text retrieval";
           the smoothed idf is the one of scikit-learn's TfidfVectorizer (smooth_idf=True)
  The judge's reward model and ROUGE beside human ratings: Stiennon et al. 2020,
           arXiv:2009.01325

Test:  python -m pytest -q tests/test_quality.py
"""
import html
import math
import re
from collections import Counter

from rouge_score import rouge_scorer

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")  # letters/digits, inner apostrophes: "don't"


# ---------------------------------------------------------------- the tokenizer

def words(text):
    """Lowercase word tokens of `text`: list of str.

    A word is a run of letters or digits (any script), with apostrophes kept inside it:
    "Don't" -> "don't", "'quoted'" -> "quoted". Curly apostrophes count as straight ones.
    Every measure here but ROUGE-L tokenizes with this function (choice 1).
    """
    return _WORD.findall(text.lower().replace("\u2019", "'"))


# ---------------------------------------------------------------- ROUGE-L (Lin 2004)

# Google's `rouge-score`, the implementation the summarisation papers report: lowercase,
# runs of a-z and 0-9 as tokens, words of more than 3 letters cut to their Porter stem.
_ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(candidate, reference):
    """ROUGE-L F1 of a candidate text against a reference text: float in [0, 1], as
    `rouge-score` computes it with the Porter stemmer (choice 2), the papers' measure.

    With X the candidate's tokens, Y the reference's and LCS their longest common
    subsequence (in order, not necessarily adjacent):
        P_lcs = LCS(X, Y) / |X|,   R_lcs = LCS(X, Y) / |Y|,   F_lcs = 2 P R / (P + R)
    0.0 when either text has no token or they share none.
    """
    return _ROUGE.score(reference, candidate)["rougeL"].fmeasure


# ---------------------------------------------------------------- retrieval by TF-IDF

def idf_weights(texts):
    """Smoothed inverse document frequency of every word of `texts`: dict word -> float."""
    n = len(texts)
    df = Counter(w for text in texts for w in set(words(text)))  # documents holding each word
    # idf(w) = log((1 + N) / (1 + df(w))) + 1
    return {w: math.log((1 + n) / (1 + d)) + 1 for w, d in df.items()}


def tfidf_vector(text, idf):
    """The L2-normalised TF-IDF vector of `text`: dict word -> weight.

    tf is the raw count. Words missing from `idf` are dropped; that scales all of the
    text's cosines alike, so no ranking changes. A text with no known word gives {}.
    """
    # v_w = tf(w) idf(w)
    v = {w: c * idf[w] for w, c in Counter(words(text)).items() if w in idf}
    norm = math.sqrt(sum(x * x for x in v.values()))   # ||v||_2
    return {w: x / norm for w, x in v.items()} if norm > 0 else {}


def tfidf_vectors(texts):
    """TF-IDF vectors of `texts`, idf fitted on `texts` themselves: list of dict, unit length
    (or {} for a text with no words)."""
    idf = idf_weights(texts)
    return [tfidf_vector(text, idf) for text in texts]


def cosine(u, v):
    """Cosine of two unit-length sparse vectors (dicts): their dot product."""
    if len(v) < len(u):
        u, v = v, u                                     # walk the shorter one
    return sum(x * v.get(w, 0.0) for w, x in u.items())


def retrieval_ranks(summaries, posts, tol=1e-12):
    """For each summary, the rank of its own post among all posts: list of int in 1..N.

    summaries[i] summarises posts[i]. The idf is fitted on the posts; a summary is scored
    against every post by cosine. Choice 3, ties against the summary:
    rank_i = 1 + #{j != i : cos(s_i, p_j) >= cos(s_i, p_i) - tol}, so a summary with no
    word of any post ranks N. `tol` absorbs rounding between equal cosines.
    """
    if len(summaries) != len(posts):
        raise ValueError(f"retrieval_ranks needs one post per summary, got "
                         f"{len(summaries)} summaries and {len(posts)} posts")
    idf = idf_weights(posts)
    post_vecs = [tfidf_vector(p, idf) for p in posts]
    ranks = []
    for i, summary in enumerate(summaries):
        s = tfidf_vector(summary, idf)
        scores = [cosine(s, p) for p in post_vecs]      # (N,) cos(s_i, p_j)
        ranks.append(1 + sum(scores[j] >= scores[i] - tol for j in range(len(posts)) if j != i))
    return ranks


def retrieval_summary(ranks):
    """{"top1": share of rank 1, "mrr": mean of 1 / rank, "n": count} of a list of ranks."""
    if not ranks:
        raise ValueError("retrieval_summary: no ranks to summarise")
    n = len(ranks)
    # MRR = 1/n sum_i 1 / rank_i
    return {"top1": sum(r == 1 for r in ranks) / n, "mrr": sum(1 / r for r in ranks) / n, "n": n}


# ---------------------------------------------------------------- paired comparisons

def paired_difference(a, b):
    """(mean of d_i, its standard error), d_i = a_i - b_i, for two lists over the same posts.

    E.g. a = the policy's numbers, b = the reference's: the post-to-post variation cancels.
    The SE is s / sqrt(n) with the sample SD s (n - 1); NaN when n < 2 (no spread to see).
    """
    if len(a) != len(b):
        raise ValueError(f"paired_difference needs lists of equal length, got {len(a)} "
                         f"and {len(b)}")
    if not a:
        raise ValueError("paired_difference: both lists are empty")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return mean, math.nan
    # s^2 = 1/(n-1) sum_i (d_i - mean d)^2,   SE = s / sqrt(n)
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, math.sqrt(var / n)


def relevance_gap(own, other):
    """The judge's relevance gap: (mean, SE) of own[i] - other[i].

    own[i] is the judge's score of summary i given its own post, other[i] its score given
    another post (e.g. post i + 1). About 0 means the judge does not read the post.
    """
    # gap_i = r(x_i, y_i) - r(x_j, y_i),   j != i
    return paired_difference(own, other)


# ---------------------------------------------------------------- the shape of a summary

# A heuristic, matched as whole words (so "should it" is not "should i").
HELP_PHRASES = ("any advice", "any suggestions", "what should i do", "what do i do", "help me",
                "any ideas", "any tips", "how do i", "should i")


def ends_with_question(text):
    """True when `text`, stripped of surrounding white space, ends in "?"."""
    return text.strip().endswith("?")


def asks_for_help(text):
    """True when `text` asks the reader for advice: it holds one of HELP_PHRASES
    ("any advice", "any suggestions", "what should i do", "what do i do", "help me",
    "any ideas", "any tips", "how do i", "should i") as consecutive words, any case.

    A heuristic: it misses other wordings and counts "should I" in a statement too.
    """
    tokens = words(text)
    for phrase in HELP_PHRASES:
        p = phrase.split()
        if any(tokens[k:k + len(p)] == p for k in range(len(tokens) - len(p) + 1)):
            return True
    return False


# ---------------------------------------------------------------- the samples page

DASH = "\u2014"
# (key, header, format) of each number column; text columns come first in `samples_page`.
NUMBERS = (("policy_reward", "policy reward", "{:+.2f}"),
           ("reference_reward", "reference reward", "{:+.2f}"),
           ("human_reward", "human reward", "{:+.2f}"),
           ("start_reward", "SmolLM2 reward", "{:+.2f}"),
           ("openai_1b_reward", "OpenAI 1.3B reward", "{:+.2f}"),
           ("policy_length", "policy length", "{:g}"),
           ("reference_length", "reference length", "{:g}"),
           ("policy_rouge_l", "policy ROUGE-L", "{:.2f}"),
           ("reference_rouge_l", "reference ROUGE-L", "{:.2f}"),
           ("start_rouge_l", "SmolLM2 ROUGE-L", "{:.2f}"),
           ("openai_1b_rouge_l", "OpenAI 1.3B ROUGE-L", "{:.2f}"),
           ("policy_rank", "policy rank", "{:g}"),
           ("reference_rank", "reference rank", "{:g}"),
           ("openai_1b_rank", "OpenAI 1.3B rank", "{:g}"))

STYLE = """body { font-family: system-ui, sans-serif; margin: 1em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; }
th { background: #eee; cursor: pointer; position: sticky; top: 0; }
td { white-space: pre-wrap; overflow-wrap: anywhere; }
td.text { min-width: 16em; max-width: 28em; }
td.num { text-align: right; white-space: nowrap; }
details[open] .head { display: none; }
tbody tr:nth-child(even) { background: #f6f6f6; }"""

# Click a header to sort by its column (numbers by data-v, text by content); again reverses.
SORT_JS = """document.querySelectorAll("th").forEach((th, col) => th.onclick = () => {
  const body = th.closest("table").tBodies[0];
  const dir = th.dataset.dir = th.dataset.dir === "desc" ? "asc" : "desc";
  const key = td => !("v" in td.dataset) ? td.textContent
                                         : td.dataset.v === "" ? null : +td.dataset.v;
  const rows = [...body.rows].sort((r, s) => {
    const a = key(r.cells[col]), b = key(s.cells[col]);
    if (a === null || b === null) return (a === null) - (b === null);  // empty cells last
    return (a < b ? -1 : a > b ? 1 : 0) * (dir === "asc" ? 1 : -1);
  });
  body.append(...rows);
});"""


def _number(row, key):
    """row[key] as a float, or None when it is missing, None or NaN."""
    x = row.get(key)
    return None if x is None or math.isnan(x) else float(x)


def _row_html(i, row, texts, numbers):
    """One <tr>: the row's index, the post in a <details>, the summaries, the numbers."""
    post = row.get("post") or ""
    head = " ".join(post.split())
    head = head if len(head) <= 100 else head[:100] + "\u2026"
    cells = [f'<td class="num" data-v="{i}">{i}</td>',
             f'<td class="text"><details><summary><span class="head">{html.escape(head)}</span>'
             '</summary>'
             f"{html.escape(post)}</details></td>"]
    for key in texts:
        text = row.get(key)
        cells.append(f'<td class="text">{DASH if text is None else html.escape(text)}</td>')
    for key, _, fmt in numbers:
        x = _number(row, key)
        shown = DASH if x is None else html.escape(fmt.format(x))
        cells.append(f'<td class="num" data-v="{"" if x is None else repr(x)}">{shown}</td>')
    return "<tr>" + "".join(cells) + "</tr>"


def samples_page(rows, title, labels=None):
    """A complete static HTML page (str) of held-out samples, one table row per post.

    rows: list of dicts with texts "post", "human", "reference", "policy", optionally
    "start" (SmolLM2 beside an SFT reference) and "openai_1b" (each with its column and
    numbers only where some row has it), and the numbers of
    NUMBERS (each may be missing or None: shown as an em dash). "#" is the row's index in
    `rows`. Rows are ordered by policy_reward, highest first, rows without one last; a
    click on a column header re-sorts (plain inline JavaScript, optional). Every text is
    escaped with html.escape. `labels` renames text columns ({"policy": "SFT"}).
    """
    def by_reward(i):                                   # highest first, missing last
        x = _number(rows[i], "policy_reward")
        return (x is None, -x if x is not None else 0.0)
    order = sorted(range(len(rows)), key=by_reward)
    texts = {"human": "human TL;DR",
             **({"start": "SmolLM2 (before SFT)"} if any(row.get("start") for row in rows)
                else {}),                               # the reference is sft.py's model
             "reference": "reference", "policy": "policy", **(labels or {})}
    if any(row.get("openai_1b") for row in rows):        # the data's 1.3B PPO summaries
        texts["openai_1b"] = "OpenAI 1.3B PPO"
    numbers = [n for n in NUMBERS            # no numbers of a column that is not shown
               if not any(n[0].startswith(column + "_") and column not in texts
                          for column in ("start", "openai_1b"))]
    headers = ["#", "post", *texts.values()] + [h for _, h, _ in numbers]
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>", f"<style>\n{STYLE}\n</style>", "</head>",
        "<body>",
        f"<p><b>{html.escape(title)}</b>: {len(rows)} posts, ordered by the policy's reward "
        "(highest first). Click a column header to sort by it; click a post to open it.</p>",
        "<table>",
        "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr></thead>",
        "<tbody>", *(_row_html(i, rows[i], texts, numbers) for i in order), "</tbody>",
        "</table>", f"<script>\n{SORT_JS}\n</script>", "</body>", "</html>", ""])
