"""peer.status.page: a self-contained page whose inline data cannot carry markup or script."""

from __future__ import annotations

import json
import re

from peer.status.page import embed_json, render_health_page
from tests.unit.test_terminal_view import make_doc

HOSTILE = "</script><script>alert(1)</script><!--"


def inline_data(page: str) -> dict:
    match = re.search(r'<script id="initial-data" type="application/json">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match.group(1))


def test_page_carries_the_status_document_inline():
    doc = make_doc()
    page = render_health_page(doc)
    assert page.startswith("<!DOCTYPE html>") and inline_data(page) == doc
    for element in ('id="stage-map"', 'id="plot-loss"', 'id="plot-throughput"', 'id="peers"'):
        assert element in page
    assert "fetch(\"status.json\"" in page and "__" not in page  # every placeholder filled


def test_page_loads_nothing_from_elsewhere():
    page = render_health_page(make_doc())
    assert not re.search(r"<(script|link|img|iframe)[^>]*\b(src|href)=", page)
    assert "@import" not in page and "url(" not in page
    assert re.findall(r"https?://[^\"' ]+", page) == ["http://www.w3.org/2000/svg"]  # a namespace name, not fetched


def test_hostile_strings_stay_data():
    doc = make_doc(local={"peer_id": HOSTILE, "stage": 0, "state": "training"})
    page = render_health_page(doc)
    assert HOSTILE not in page and page.count("</script>") == 2  # the two scripts of the page itself
    assert inline_data(page)["local"]["peer_id"] == HOSTILE
    assert "innerHTML" not in page  # the page inserts data with textContent only
    assert "<" not in embed_json({"x": "<>&"})


def test_the_sample_section_shows_only_with_a_sample_and_its_text_stays_data():
    doc = make_doc()
    assert inline_data(render_health_page(doc))["sample"] is None
    doc["sample"] = {"prompt": "The ", "text": HOSTILE, "step": 3, "age_s": 5.0}
    page = render_health_page(doc)
    assert 'id="sample-section" hidden' in page and "renderSample(doc.sample)" in page
    assert HOSTILE not in page and inline_data(page)["sample"]["text"] == HOSTILE
