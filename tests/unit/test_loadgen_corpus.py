"""Payloads: the built-in corpus (deterministic, a spread of lengths) and JSON-lines files."""

from __future__ import annotations

import pytest

from loadgen.corpus import builtin_corpus, read_jsonl


def test_builtin_corpus_is_deterministic_with_a_spread_of_lengths():
    corpus = builtin_corpus()
    assert corpus == builtin_corpus() and corpus != builtin_corpus(seed=1)
    words = [len(payload["text"].split()) for payload in corpus]
    share = lambda low, high: sum(low <= n <= high for n in words) / len(words)  # noqa: E731
    assert 0.35 < share(1, 8) < 0.55, "mostly short queries"
    assert 0.10 < share(41, 150) < 0.30, "some paragraphs"
    assert 0.02 < share(151, 400) < 0.10, "a few long passages"
    assert all(set(payload) == {"text"} and payload["text"] for payload in corpus)


def test_read_jsonl_skips_blank_lines_and_keeps_any_json(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a"}\n\n[1, 2]\n"plain"\n')
    assert read_jsonl(path) == [{"text": "a"}, [1, 2], "plain"]


def test_read_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        read_jsonl(path)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no payloads"):
        read_jsonl(empty)
