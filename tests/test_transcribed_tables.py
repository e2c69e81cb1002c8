"""tools/analysis/transcribed_tables.py: the sweep's and estimators' pages are their transcribed
files' tables, cell for cell, and the numbers computed from them are computed right.

Test: pytest tests/test_transcribed_tables.py
"""
import json

import pytest

from support import cli
from tools.analysis import transcribed_tables as tt


def test_the_pages_tables_are_the_transcribed_files():
    assert tt.main(["--check"]) == 0


def test_every_record_names_its_machine_and_its_source():
    for name in ("sweep.json", "estimators.json"):
        data = json.loads((tt.DATA / name).read_text())
        records = [r for value in data.values() if isinstance(value, list) for r in value]
        assert len(records) >= 8                # the estimators: 4 settings, 4 fixed rows
        assert all(r["machine"] and "transcribed" in r["source"] for r in records)


def test_a_cell_is_printed_as_the_page_prints_it():
    record = {"gain": -0.0, "gain_se": 0.06, "mrr": 0.6449, "rouge_l": None, "copied": 0.125}
    assert tt.number(record, "gain", "+.2f") == "-0.00 ± 0.06"    # a small loss stays one
    assert tt.number(record, "mrr", ".3f") == "0.645"
    assert tt.number(record, "rouge_l", ".3f") == "—"             # not measured
    assert tt.number(record, "kl", ".2f") == ""                   # no such column here
    assert tt.number(record, "copied", ".0%") == "12%"            # half to even, as Python


def test_spearman_by_hand():
    assert tt.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # x ranks (1.5, 1.5, 3.5, 3.5), y ranks 1..4: cov 4, variances 4 and 5 -> 4 / sqrt(20)
    assert tt.spearman([0, 0, 1, 1], [1, 2, 3, 4]) == pytest.approx(0.894427, abs=1e-6)


def test_a_block_with_no_table_or_a_table_with_no_block_is_one_line():
    text = "<!-- transcribed: nothing -->\nold\n<!-- /transcribed -->\n"
    with pytest.raises(cli.UserError, match="no transcribed table named 'nothing'"):
        tt.filled(text, {"sweep": "| a |"}, "page.md")
    with pytest.raises(cli.UserError, match="not once each"):
        tt.filled("no blocks\n", {"sweep": "| a |"}, "page.md")
    assert tt.filled(text.replace("nothing", "sweep"), {"sweep": "| a |"}, "p") == \
        "<!-- transcribed: sweep -->\n| a |\n<!-- /transcribed -->\n"
