"""BM25 retrieval: scores against hand-computed values, the collection loader and the ``search`` tool."""

from __future__ import annotations

import json
import math

import pytest

from unipg.tools.base import TOOLS
from unipg.tools.retrieval import (
    BM25Index,
    Document,
    index_for,
    load_documents,
    search_tool,
    tokenize,
)

# N = 3 documents of lengths 3, 2 and 4 tokens: avgdl = 3
DOCS = [
    Document("d0", "", "apple apple banana"),
    Document("d1", "", "apple cherry"),
    Document("d2", "", "banana cherry cherry date"),
]


def test_tokenize_lowercases_splits_on_punctuation_and_drops_stopwords():
    assert tokenize("The Apple-pie, of Zorn's 2 towns!") == ["apple", "pie", "zorn", "s", "2", "towns"]


def test_bm25_scores_match_hand_computation():
    index = BM25Index(DOCS)  # k1 = 1.5, b = 0.75
    idf_apple = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))  # df = 2
    # d0: tf 2, |D| = avgdl so the length norm is 1: 2·2.5 / (2 + 1.5) = 10/7
    # d1: tf 1, norm 0.25 + 0.75·2/3 = 0.75: 2.5 / (1 + 1.125) = 20/17
    results = index.search("apple", k=3)
    assert [document.id for document, _ in results] == ["d0", "d1"]  # d2 lacks the term: not returned
    assert results[0][1] == pytest.approx(idf_apple * 10 / 7, rel=1e-12)
    assert results[1][1] == pytest.approx(idf_apple * 20 / 17, rel=1e-12)


def test_bm25_sums_over_query_terms_and_ignores_unknown_ones():
    index = BM25Index(DOCS)
    idf_date, idf_cherry = math.log(1 + 2.5 / 1.5), math.log(1 + 1.5 / 2.5)
    # d2: norm 0.25 + 0.75·4/3 = 1.25; date tf 1 → 2.5/2.875 = 20/23, cherry tf 2 → 5/3.875 = 40/31
    expected_d2 = idf_date * 20 / 23 + idf_cherry * 40 / 31
    scores = index.scores("date cherry zebra")
    assert scores[2] == pytest.approx(expected_d2, rel=1e-12)
    assert scores[1] == pytest.approx(idf_cherry * 20 / 17, rel=1e-12)
    assert scores[0] == 0.0
    assert index.search("zebra") == [] and index.search("the of") == []


def test_bm25_ties_keep_collection_order_and_k_limits_results():
    index = BM25Index([Document("x", "", "same words"), Document("y", "", "same words")])
    assert [document.id for document, _ in index.search("same", k=2)] == ["x", "y"]
    assert [document.id for document, _ in index.search("same", k=1)] == ["x"]


def test_bm25_indexes_titles():
    index = BM25Index([Document("a", "Maribo", "a small town"), Document("b", "Other", "a small town")])
    assert [document.id for document, _ in index.search("maribo")] == ["a"]


def _write_collection(path, documents):
    path.write_text("".join(json.dumps(document) + "\n" for document in documents), encoding="utf-8")
    return path


def test_search_tool_returns_title_and_text_of_the_top_k(tmp_path):
    path = _write_collection(
        tmp_path / "fruit.jsonl",
        [
            {"id": "1", "title": "Apples", "text": "Apples grow on trees."},
            {"id": "2", "title": "Bananas", "text": "Bananas grow in bunches; apples do not."},
            {"id": "3", "title": "Cherries", "text": "Cherries are red."},
        ],
    )
    search = search_tool(collection=str(path), k=2).function
    assert search("apples") == "[Apples] Apples grow on trees.\n[Bananas] Bananas grow in bunches; apples do not."
    assert search("cherries") == "[Cherries] Cherries are red."
    assert search("durian") == "No document matches the query."
    assert "empty" in search("   ")  # an observation the agent can read, not an exception
    truncated = search_tool(collection=str(path), k=2, max_chars=20).function("apples")
    assert truncated == "[Apples] Apples g..." and len(truncated) == 20


def test_search_tool_schema_takes_a_query():
    search = TOOLS.get("search")(k=1)
    assert search.name == "search"
    assert search.parameters["properties"]["query"]["type"] == "string"
    assert search.required == ["query"]
    assert search.check_arguments({"query": "Maribo"}) is None
    assert search.schema()["function"]["name"] == "search"


def test_unknown_collection_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match=r"no bundled collection 'wiki'.*multihop.*\.jsonl"):
        search_tool(collection="wiki")
    with pytest.raises(ValueError, match="does not exist"):
        search_tool(collection=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="k must be a positive integer"):
        search_tool(k=0)


def test_loader_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "1", "title": "A", "text": "a"}\n{"id": "2", "title": "B"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2: missing or non-text field\(s\) text"):
        load_documents(path)
    path.write_text('{"id": "1", "title": "A", "text": "a"}\n{"id": "1", "title": "B", "text": "b"}\n')
    with pytest.raises(ValueError, match="duplicate document id '1'"):
        load_documents(path)


def test_index_is_built_once_per_collection_file(tmp_path):
    path = _write_collection(tmp_path / "c.jsonl", [{"id": "1", "title": "A", "text": "alpha"}])
    assert index_for(str(path)) is index_for(str(path))
    assert index_for("multihop") is index_for("multihop")
