"""Payloads: the built-in corpora (deterministic, their length mixes) and JSON-lines files."""

from __future__ import annotations

import pytest

from kinference.loadgen.corpus import builtin_corpus, read_jsonl


def _words(corpus):
    return [len(payload["text"].split()) for payload in corpus]


def test_builtin_corpus_is_deterministic():
    corpus = builtin_corpus()
    assert corpus == builtin_corpus() and corpus != builtin_corpus(seed=1)
    assert all(set(payload) == {"text"} and payload["text"] for payload in corpus)


def test_mixed_corpus_is_the_issues_length_mix():
    """70% of 5-20 words, 25% of 40-80, 5% of 150-250, nothing else (the bounds allow ~3 sigma at n=1000)."""
    words = _words(builtin_corpus("mixed"))
    share = lambda low, high: sum(low <= n <= high for n in words) / len(words)  # noqa: E731
    assert 0.65 < share(5, 20) < 0.75
    assert 0.20 < share(40, 80) < 0.30
    assert 0.03 < share(150, 250) < 0.08
    assert all(5 <= n <= 20 or 40 <= n <= 80 or 150 <= n <= 250 for n in words)


def test_short_corpus_holds_only_short_texts():
    assert max(_words(builtin_corpus("short"))) <= 40


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
