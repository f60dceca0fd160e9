"""A built-in generated text corpus: what a text handler calibrates on, and what loadgen and the benchmarks send.

It needs no download: it composes English-like text from a small vocabulary with
a chosen mix of lengths (``PROFILES``). The same seed always gives the same corpus, so runs compare.
"""

from __future__ import annotations

import random

_VOCABULARY = """
the a of to and in is for on with that as it at by from this be are was an or which model data
stream kafka request reply batch latency throughput service consumer producer partition offset
topic message queue server client network memory cache disk query search result document index
vector embedding token sentence paragraph language text user customer order payment account price
product shipping delivery review rating weather city river mountain forest ocean history science
music film book article news report market energy health doctor patient school student teacher
research paper experiment method system design engineer team project release version bug fix test
deploy cluster node region cloud storage database table column record event log metric alert error
fast slow large small new old good better best simple complex open secure reliable stable early
late often never always quickly carefully usually recently today yesterday tomorrow morning night
find show explain compare describe improve reduce increase measure build run send read write learn
how what why when where who which best cheap near
"""
_WORDS = _VOCABULARY.split()

# (share of requests, min words, max words) per length class.
PROFILES = {
    # The mixed-length workload of the benchmark's issue: mostly short texts, some paragraphs, a few long
    # passages. A FIFO batch of these is padded to its longest text, which length-aware batching avoids.
    "mixed": ((0.70, 5, 20), (0.25, 40, 80), (0.05, 150, 250)),
    # Search queries and single sentences only: online query embedding.
    "short": ((0.60, 2, 8), (0.40, 9, 40)),
}
BUILTIN_SIZE = 1000


def builtin_corpus(profile: str = "mixed", size: int = BUILTIN_SIZE, seed: int = 0) -> list[dict[str, str]]:
    """``size`` payloads ``{"text": ...}`` (the embedding handler's request format) with the length
    mix of ``profile`` (a key of ``PROFILES``)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown corpus {profile!r}; choose one of {', '.join(PROFILES)}")
    lengths = PROFILES[profile]
    rng = random.Random(seed)
    payloads = []
    for _ in range(size):
        _, low, high = rng.choices(lengths, weights=[share for share, _, _ in lengths])[0]
        payloads.append({"text": _text(rng, rng.randint(low, high))})
    return payloads


def _text(rng: random.Random, words: int) -> str:
    if words <= 8:  # a search query: lower case, no punctuation
        return " ".join(rng.choices(_WORDS, k=words))
    sentences = []
    while words > 0:
        length = min(words, rng.randint(6, 24))
        words -= length
        sentence = " ".join(rng.choices(_WORDS, k=length))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
    return " ".join(sentences)
