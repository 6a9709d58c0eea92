"""Keyword retrieval over a small document collection: an Okapi BM25 index and the ``search`` tool.

BM25 (Robertson & Zaragoza 2009, "The Probabilistic Relevance Framework: BM25 and Beyond") scores a
document D for a query q₁…qₙ as

    score(D, q) = Σᵢ idf(qᵢ) · f(qᵢ, D) · (k1 + 1) / (f(qᵢ, D) + k1 · (1 − b + b · |D| / avgdl))
    idf(q)      = log(1 + (N − df(q) + 0.5) / (df(q) + 0.5))

with f the term frequency, |D| the document length in tokens, avgdl the mean length, N the number of
documents and df(q) the number holding q. This idf (Lucene's) stays positive for terms in most documents.

The index is ``bm25s``'s (sparse-matrix BM25, Lucene's idf) over this module's own tokens: lowercased
alphanumeric runs without a few stopwords.

A collection is a ``.jsonl`` file with one ``{"id", "title", "text"}`` object per line; the title and the
text are both indexed. Bundled collections live in ``unipg/tools/data/<name>.jsonl``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unipg.tools.base import TOOLS, Tool, tool

BUNDLED_DIR = Path(__file__).resolve().parent / "data"

# Function words so frequent that they only add noise to the ranking of short documents.
STOPWORDS = frozenset("a an and are as at be by for from in is it of on or the to was were which who with".split())
_NON_ALPHANUMERIC = re.compile(r"[^a-z0-9]+")


@dataclass(frozen=True)
class Document:
    """One retrievable document."""

    id: str  # unique within its collection, e.g. "person-17"
    title: str  # a short name, shown in brackets in search results
    text: str  # the body, one or a few sentences


def tokenize(text: str, stopwords: frozenset[str] = STOPWORDS) -> list[str]:
    """Lowercased alphanumeric runs of ``text``, without ``stopwords``."""
    return [token for token in _NON_ALPHANUMERIC.split(text.lower()) if token and token not in stopwords]


class BM25Index:
    """An in-memory Okapi BM25 index over ``documents`` (title and text together), built with ``bm25s``."""

    def __init__(
        self, documents: list[Document], *, k1: float = 1.5, b: float = 0.75, stopwords: frozenset[str] = STOPWORDS
    ):
        import bm25s
        from bm25s.tokenization import Tokenized

        if k1 < 0 or not 0.0 <= b <= 1.0:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.documents = list(documents)
        self.k1, self.b, self.stopwords = k1, b, stopwords
        self.vocabulary: dict[str, int] = {}
        token_ids = [
            [
                self.vocabulary.setdefault(token, len(self.vocabulary))
                for token in tokenize(f"{doc.title} {doc.text}", stopwords)
            ]
            for doc in self.documents
        ]
        self.retriever = bm25s.BM25(k1=k1, b=b, method="lucene", dtype="float64")
        if self.documents:
            self.retriever.index(Tokenized(ids=token_ids, vocab=dict(self.vocabulary)), show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """(N,) BM25 score of every document; a term repeated in the query counts once per occurrence."""
        terms = [term for term in tokenize(query, self.stopwords) if term in self.vocabulary]
        if not self.documents or not terms:
            return np.zeros(len(self.documents), dtype=np.float64)
        # bm25s's Lucene variant leaves out the constant factor (k1 + 1) of the numerator; put back, the scores
        # are the formula's above (the ranking is the same either way).
        return (self.k1 + 1.0) * np.asarray(self.retriever.get_scores(terms), dtype=np.float64)

    def search(self, query: str, k: int = 2) -> list[tuple[Document, float]]:
        """The ``k`` best documents holding at least one query term, best first; ties keep collection order."""
        scores = self.scores(query)
        ranked = np.argsort(-scores, kind="stable")[:k]
        return [(self.documents[i], float(scores[i])) for i in ranked if scores[i] > 0.0]


def load_documents(path: str | Path) -> list[Document]:
    """The documents of a ``.jsonl`` collection (one ``{"id", "title", "text"}`` object per line)."""
    path = Path(path)
    documents, seen = [], set()
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                missing = [key for key in ("id", "title", "text") if not isinstance(record.get(key), str)]
                if missing:
                    raise ValueError(f"missing or non-text field(s) {', '.join(missing)}")
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                raise ValueError(
                    f"{path}, line {line_number}: {err}; expected one JSON object "
                    '{"id": ..., "title": ..., "text": ...} per line'
                ) from None
            if record["id"] in seen:
                raise ValueError(f"{path}, line {line_number}: duplicate document id '{record['id']}'")
            seen.add(record["id"])
            documents.append(Document(record["id"], record["title"], record["text"]))
    return documents


def bundled_collections() -> list[str]:
    """Names of the collections shipped in ``unipg/tools/data``."""
    return sorted(path.stem for path in BUNDLED_DIR.glob("*.jsonl"))


def resolve_collection(collection: str) -> Path:
    """The file of ``collection``: a bundled name such as "multihop", or a path to a ``.jsonl`` file."""
    looks_like_path = collection.endswith(".jsonl") or "/" in collection or "\\" in collection
    path = Path(collection).expanduser() if looks_like_path else BUNDLED_DIR / f"{collection}.jsonl"
    if not path.is_file():
        bundled = ", ".join(bundled_collections()) or "none"
        what = f"file '{path}' does not exist" if looks_like_path else f"there is no bundled collection '{collection}'"
        raise ValueError(
            f"search: {what}; pass the name of a bundled collection ({bundled}) "
            'or the path of a .jsonl file with one {"id", "title", "text"} object per line'
        )
    return path.resolve()


_INDEX_CACHE: dict[tuple[str, int, int], BM25Index] = {}


def index_for(collection: str) -> BM25Index:
    """The BM25 index of ``collection``, built once per file version and then shared by every tool instance."""
    path = resolve_collection(collection)
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)  # an edited file gets a fresh index
    if key not in _INDEX_CACHE:
        _INDEX_CACHE[key] = BM25Index(load_documents(path))
    return _INDEX_CACHE[key]


def format_results(results: list[tuple[Document, float]], max_chars: int) -> str:
    """Results as "[title] text" lines, cut to at most ``max_chars`` characters (ending in "...")."""
    text = "\n".join(f"[{document.title}] {document.text}" for document, _ in results)
    if len(text) > max_chars:
        text = text[: max(0, max_chars - 3)] + "..."
    return text


@TOOLS.register("search")
def search_tool(collection: str = "multihop", k: int = 2, max_chars: int = 400) -> Tool:
    """A ``search`` tool returning the ``k`` best BM25 matches in ``collection`` as compact text."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"search: k must be a positive integer, got {k!r}")
    if not isinstance(max_chars, int) or max_chars < 4:
        raise ValueError(f"search: max_chars must be an integer >= 4, got {max_chars!r}")
    index = index_for(collection)  # fail at construction, not at the first call, on a bad collection

    def search(query: str) -> str:
        """Search the documents by keywords and return the best matches as "[title] text" lines.

        Args:
            query: keywords to look for, e.g. a name.
        """
        if not query.strip():
            return "The query is empty; pass keywords to search for, e.g. a name."
        results = index.search(query, k)
        return format_results(results, max_chars) if results else "No document matches the query."

    return tool(search, name="search")
