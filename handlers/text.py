"""What the transformers text handlers share: the ``{"text": str}`` request, options, loading, the forward pass.

A subclass names the transformers ``Auto`` class to load and implements ``reduce`` (model output -> one
row per item) and ``postprocess`` (row -> JSON result); everything else lives here once.

A text is tokenised once, in ``validate`` (so the batcher knows its ``cost`` in tokens), and ``preprocess``
only pads the token ids of a batch into tensors. How the batch then runs on the device (shape buckets, AMP,
``torch.compile``, CUDA streams) is in handlers/accelerate.py.
"""

from __future__ import annotations

import copy
import logging
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import tokenizers
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from kinference.errors import HandlerLoadError, InputTooLong, InvalidInput
from kinference.handlers.accelerate import Accelerator, CudaGraphs, agreement
from kinference.handlers.base import Handler, HandlerContext
from kinference.handlers.corpus import PROFILES, builtin_corpus
from kinference.handlers.options import boolean, one_of, positive_int, with_defaults
from kinference.handlers.runtime import forward_for

log = logging.getLogger(__name__)

AGREEMENT = 0.999
"""``dtype=auto``: the lowest cosine to float32, over a warm-up batch, at which reduced-precision weights serve."""

CALIBRATION_CORPORA = tuple(PROFILES)
"""The built-in corpora (handlers/corpus.py) a device process can calibrate on: search queries, or mixed lengths."""

POOLING_MASK = "pooling_mask"
"""A batch tensor that is no model input: the attention mask without each row's prompt, for a model whose pooling
leaves the prompt out (sentence-transformers' ``include_prompt: false``)."""

UNBOUNDED = 1_000_000
"""A tokenizer's ``model_max_length`` at or past this is transformers' "no limit" (it writes 1e30)."""

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model")
SAVE_HINT = "save both with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR) (docs/handlers.md)"

_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def validate_text(payload: Any, max_chars: int) -> str:
    """Return the text of a ``{"text": "..."}`` request; raise ``InvalidInput`` saying what to send instead."""
    if not isinstance(payload, dict):
        raise InvalidInput(f'expected a JSON object like {{"text": "..."}}, got {_json_type(payload)}')
    if "text" not in payload:
        raise InvalidInput(f'missing "text": expected {{"text": "..."}}, got keys {sorted(payload)}')
    text = payload["text"]
    if not isinstance(text, str):
        raise InvalidInput(f'"text" must be a string, got {_json_type(text)}')
    if not text.strip():
        raise InvalidInput('"text" is empty or only whitespace')
    if len(text) > max_chars:
        raise InvalidInput(
            f'"text" has {len(text)} characters, more than the limit of {max_chars} (handler option max_chars)'
        )
    return text


def check_model_dir(handler: str, model_dir: Path) -> None:
    """Fail with the missing piece named before transformers tries to load ``model_dir``: a local directory
    with ``config.json``, the weights and a tokenizer. A model hub id is never downloaded at run time."""
    if not model_dir.is_dir():
        hub_id = not model_dir.is_absolute() and len(model_dir.parts) == 2 and not str(model_dir).startswith(".")
        hint = (f": {model_dir} looks like a model hub id, and kinference downloads nothing at run time (the image "
                f"sets HF_HUB_OFFLINE=1); fetch it first (huggingface-cli download {model_dir} --local-dir DIR) "
                "and pass --model DIR") if hub_id else ""
        raise HandlerLoadError(f"{handler}: model directory {model_dir} does not exist{hint}")
    names = {path.name for path in model_dir.iterdir()}
    missing = []
    if "config.json" not in names:
        missing.append("config.json (the model's configuration)")
    if not names & set(WEIGHT_FILES):
        missing.append(f"the weights ({' or '.join(WEIGHT_FILES[::2])})")
    if not names & set(TOKENIZER_FILES):
        missing.append("the tokenizer (tokenizer.json)")
    if missing:
        raise HandlerLoadError(f"{handler}: the model directory {model_dir} lacks {', '.join(missing)}: {SAVE_HINT}")


def _loaded(handler: str, model_dir: Path, load: Callable[[], Any]) -> Any:
    """``load()``: whatever fails while loading, the service cannot start, and says which directory."""
    try:
        return load()
    except HandlerLoadError:
        raise
    except Exception as exc:
        raise HandlerLoadError(f"{handler}: cannot load the model in {model_dir}: {exc}") from exc


def _load_tokenizer(handler: str, model_dir: Path) -> PreTrainedTokenizerBase:
    # local_files_only: a directory without the files must fail here, not reach for the model hub.
    tokenizer: PreTrainedTokenizerBase = _loaded(
        handler, model_dir, lambda: AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    if not getattr(tokenizer, "is_fast", False):
        raise HandlerLoadError(f"{handler}: the tokenizer in {model_dir} has no fast (Rust) version: save "
                               "its tokenizer.json (AutoTokenizer.from_pretrained(..., use_fast=True)"
                               ".save_pretrained(DIR))")
    if tokenizer.pad_token_id is None:
        raise HandlerLoadError(f"{handler}: the tokenizer in {model_dir} has no pad token to pad batches with: "
                               "set one and save it (tokenizer.pad_token = tokenizer.eos_token; "
                               "tokenizer.save_pretrained(DIR))")
    return tokenizer


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)


@dataclass(frozen=True, slots=True)
class TextItem:
    """A validated text: its token ids, special tokens included, at most ``max_length`` of them."""

    text: str
    input_ids: list[int]
    token_type_ids: list[int] | None
    """Only for models that take them (``token_type_ids`` in the tokenizer's ``model_input_names``)."""
    prompt_tokens: int = 0
    """The leading tokens (special ones included) that are the request's prompt, where pooling leaves them out."""


@dataclass(frozen=True, slots=True)
class TextBatch:
    """What ``preprocess`` hands to ``inference``: padded tensors on the host, and which rows are requests."""

    tensors: dict[str, torch.Tensor]
    real_rows: int
    """The first ``real_rows`` rows are the items; any rows after them only pad the batch up to a shape bucket."""
    real_tokens: int
    item_rows: tuple[int, ...] = ()
    """How many of the rows each item takes, in order, where an item takes several (an OpenAI embeddings body's
    texts); empty: one each. A device process hands outputs back by item."""

    def __reduce__(self) -> tuple[type[TextBatch], tuple[Any, ...]]:
        """Pickled as its fields, in order (a device process's arena, once per micro-batch): the slotted dataclass's
        own state functions walk its fields in Python."""
        return TextBatch, (self.tensors, self.real_rows, self.real_tokens, self.item_rows)


def _shaped(batch: TextBatch, shape: tuple[int, int], pads: dict[str, int]) -> bool:
    """``batch`` is already a device batch of ``shape`` with the tensors ``pads`` names: as the merge would build it,
    since the worker's collation padded it with the same pads on the same side."""
    return batch.tensors.keys() == pads.keys() and all(tuple(tensor.shape) == shape
                                                       for tensor in batch.tensors.values())


def encoder(tokenizer: PreTrainedTokenizerBase, max_length: int | None,
            lowercase: bool = False) -> tokenizers.Tokenizer:
    """A copy of the tokenizer's Rust backend that encodes one text as ``tokenizer(text, truncation=True,
    max_length=max_length)`` does (``None``: as ``tokenizer(text)`` does, uncut), without the Python layer around it.
    ``lowercase``: lower-case the text first, as sentence-transformers' ``do_lower_case`` does.

    A copy, because the transformers tokenizer writes its truncation settings into its backend when they
    differ from the call's, and a backend changed while another thread encodes with it raises "Already
    borrowed" (huggingface/tokenizers#537). This copy is set once, here, and then only read.
    """
    backend: tokenizers.Tokenizer = copy.deepcopy(tokenizer.backend_tokenizer)
    if max_length is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(max_length, stride=0, strategy="longest_first", direction=tokenizer.truncation_side)
    if lowercase:
        normalizer = backend.normalizer
        steps = [tokenizers.normalizers.Lowercase(), *([] if normalizer is None else [normalizer])]
        backend.normalizer = tokenizers.normalizers.Sequence(steps)
    backend.no_padding()  # tokenizer.json may ask for fixed-length padding: collation pads instead
    backend.encode_special_tokens = tokenizer.split_special_tokens
    return backend


class TextHandler(Handler):
    """Base of the handlers that run a transformers model on ``{"text": str}`` requests.

    Options (``--handler-options key=value``): ``max_length`` (the most tokens of a text, special tokens included,
    default 256), ``truncate`` (default true: a longer text is cut to ``max_length``; false: refused with
    ``input_too_long``), ``max_chars`` (longer requests are rejected, default 20000), ``dtype`` (auto, float32,
    float16 or bfloat16; auto: float16 or bfloat16 weights on CUDA where a warm-up batch agrees with float32,
    float32 elsewhere), and, described in handlers/accelerate.py, ``amp`` (none, float16 or bfloat16; default
    none), ``compile`` (default false), ``compile_backend`` (default inductor), ``cuda_graphs`` (default auto: on with
    CUDA) and ``shape_buckets`` (default: on when compiling or capturing CUDA graphs);
    in handlers/runtime.py, ``runtime`` (torch or onnxruntime) and ``quantize`` (none or int8);
    ``calibration_corpus`` (short or mixed, default short: the lengths a device process calibrates on, see
    docs/configuration.md); plus each subclass's own ``defaults``.
    """

    device_process = True

    model_class: ClassVar[Any]
    """The transformers ``Auto`` class that loads the model, e.g. ``AutoModel``."""

    defaults: ClassVar[dict[str, Any]] = {
        "max_length": 256,
        "max_chars": 20_000,
        "dtype": "auto",
        "amp": "none",
        "compile": False,
        "compile_backend": "inductor",
        "cuda_graphs": "auto",
        "shape_buckets": None,  # None: on when compiling or capturing CUDA graphs
        "runtime": "torch",
        "quantize": "none",
        "calibration_corpus": "short",
        "truncate": True,
    }
    """Every option the handler knows, with its default; anything else is a typo and fails setup."""

    lowercase = False
    """Whether texts are lower-cased before tokenising (a subclass sets it in ``read_model_dir``)."""

    pooling_mask = False
    """Whether batches carry ``POOLING_MASK`` (a subclass sets it in ``read_model_dir``)."""

    def setup(self, context: HandlerContext) -> None:
        options = with_defaults(self.name, self.defaults, context.options)
        self.max_chars = positive_int(self.name, "max_chars", options["max_chars"])
        self.truncate = boolean(self.name, "truncate", options["truncate"])
        self.calibration_corpus = one_of(self.name, "calibration_corpus", options["calibration_corpus"],
                                         CALIBRATION_CORPORA)
        dtype_name = one_of(self.name, "dtype", options["dtype"], ("auto", *DTYPES))
        if context.model is None:
            self.model_name, model_dir = self.default_model()
        else:
            self.model_name, model_dir = context.model.resolve().name, context.model
        model_dir = self.read_model_dir(model_dir, options)
        check_model_dir(self.name, model_dir)
        self.tokenizer = _load_tokenizer(self.name, model_dir)
        self.config = _loaded(self.name, model_dir, lambda: AutoConfig.from_pretrained(model_dir,
                                                                                       local_files_only=True))
        self.max_length = self._max_length(options["max_length"])
        self._encoder = encoder(self.tokenizer, self.max_length, self.lowercase)
        self._counter = encoder(self.tokenizer, None, self.lowercase)
        self._token_types = "token_type_ids" in self.tokenizer.model_input_names
        self._left = self.tokenizer.padding_side == "left"
        self._onnx = None
        self.configure(options)  # before the weights: dtype=auto's check below calls reduce, which may read options
        if context.role == "host":
            # A worker beside a device process: tokenise, collate on the host, write replies; no weights, and the
            # device options (buckets, AMP, compile) are the device process's.
            self.device = torch.device("cpu")
            self.accelerator = Accelerator(self.device)
            self._placement = "device process"
        else:
            self.device = torch.device(context.device)
            self._placement = str(self.device)
            self.accelerator = Accelerator.from_options(
                self.name, options, self.device, context.max_batch_size, self.max_length
            )
            dtype = DTYPES.get(dtype_name, torch.float32)
            self.model = _loaded(self.name, model_dir, lambda: self._load_model(model_dir, dtype))
            if dtype_name == "auto" and self.device.type == "cuda":
                self.model, dtype = self._reduced_precision(self.model)
            self.dtype = dtype
            self._onnx = forward_for(self.name, options, self.model, self._export_example, self.device, dtype)
            self._forward = self._onnx or self.accelerator.compile(self.model)

    def default_model(self) -> tuple[str, Path]:
        """Name and directory of the model used without ``--model``."""
        raise HandlerLoadError(f"{self.name} needs --model <local dir>")

    def read_model_dir(self, model_dir: Path, options: dict[str, Any]) -> Path:
        """Read what the directory says beyond the transformers model, before anything is loaded; return the
        directory of the transformers model (config.json, weights, tokenizer)."""
        return model_dir

    def natural_max_length(self) -> int:
        """The ``max_length`` without the option: the tokenizer is loaded by then."""
        return int(self.defaults["max_length"])

    def _max_length(self, option: Any) -> int:
        max_length = self.natural_max_length() if option is None else positive_int(self.name, "max_length", option)
        positions = getattr(self.config, "max_position_embeddings", None)
        if positions is not None and max_length > positions:
            raise HandlerLoadError(f"{self.name}: max_length={max_length} is more than the {positions} positions of "
                                   "the model")
        if max_length >= UNBOUNDED:
            raise HandlerLoadError(f"{self.name}: neither the model nor its tokenizer gives a token limit: set the "
                                   "handler option max_length")
        return max_length

    def configure(self, options: dict[str, Any]) -> None:
        """Read the subclass's own options; the tokenizer and the model's configuration are loaded by then, not its
        weights."""

    def _export_example(self) -> dict[str, torch.Tensor]:
        """A batch for the ONNX exporter to trace: two rows, 16 tokens (no size 1, which tracing could fix)."""
        item = self._cut("an example")
        return self._model_inputs(self._collate([item, item], 2, 16).tensors)

    def _reduced_precision(self, model: Any) -> tuple[Any, torch.dtype]:
        """``dtype=auto`` on CUDA: float16 weights, or else bfloat16, where a warm-up batch's results agree with
        float32 (cosine >= ``AGREEMENT`` for every row); float32 where neither does. Half the memory and bandwidth,
        and tensor cores."""
        rows = self.sample_rows(16)
        longest = max(len(row.input_ids) for row in rows)
        batch = self.accelerator.to_device(self._collate(rows, len(rows), longest).tensors)
        inputs = self._model_inputs(batch)
        with torch.inference_mode():
            reference = self.reduce(model(**inputs), batch)
            for candidate in (torch.float16, torch.bfloat16):
                reduced = copy.deepcopy(model).to(candidate)
                worst = agreement(reference, self.reduce(reduced(**inputs), batch))
                if worst >= AGREEMENT:
                    log.info("%s: %s weights (the warm-up batch agrees with float32: cosine >= %.5f)", self.name,
                             str(candidate).removeprefix("torch."), worst)
                    return reduced, candidate
                log.info("%s: not %s (the warm-up batch's cosine to float32 fell to %.5f)", self.name, candidate, worst)
        return model, torch.float32

    def _load_model(self, model_dir: Path, dtype: torch.dtype) -> Any:
        """The model, in eval mode on the handler's device (the tokenizer is loaded by then)."""
        return self.model_class.from_pretrained(model_dir, local_files_only=True, dtype=dtype).eval().to(self.device)

    def validate(self, payload: Any) -> Any:
        (item,) = self.validate_many([payload])
        if isinstance(item, InvalidInput):
            raise item
        return item

    def validate_many(self, payloads: list[Any]) -> list[Any]:
        """The ``{"text": ...}`` requests of a poll, tokenised together (``tokenize``)."""
        results: list[Any] = []
        texts, slots = [], []
        for payload in payloads:
            try:
                texts.append(validate_text(payload, self.max_chars))
            except InvalidInput as exc:
                results.append(exc)
            else:
                slots.append(len(results))
                results.append(None)
        for slot, item in zip(slots, self.tokenize(texts, self.truncate), strict=True):
            results[slot] = item
        return results

    def tokenize(self, texts: Sequence[str], truncate: bool | Sequence[bool]) -> list[TextItem | InputTooLong]:
        """Each text's item, or ``InputTooLong`` for a text past ``max_length`` that may not be cut (``truncate``:
        for all, or per text). A cut text is cut as ``tokenizer(text, truncation=True, max_length=...)`` cuts it.

        All in one ``encode_batch_fast``: the Rust tokenizer works on them in parallel, without the GIL, instead of
        one Python call each in the poll thread. The fast variant leaves out the character offsets of each token,
        which nothing here reads; the ids are the same. Tokenising is the largest cost of a short text's host path,
        and the offsets were about a fifth of it (issue 27). Texts are tokenised uncut, to count them (a cut text
        is tokenised again, cut)."""
        items: list[TextItem | InputTooLong] = []
        limit = self.max_length
        for index, (text, encoding) in enumerate(zip(texts, self._counter.encode_batch_fast(texts), strict=True)):
            count = len(encoding.ids)
            if count <= limit:
                items.append(self._item(text, encoding))
            elif truncate if isinstance(truncate, bool) else truncate[index]:
                items.append(self._cut(text))
            else:
                items.append(InputTooLong(f"the text has {count} tokens, more than the limit of {limit} (max_length, "
                                          'special tokens included); send "truncate": true to cut it'))
        return items

    def _item(self, text: str, encoding: tokenizers.Encoding) -> TextItem:
        return TextItem(text, encoding.ids, encoding.type_ids if self._token_types else None)

    def _cut(self, text: str) -> TextItem:
        """``text``'s item, cut to ``max_length``."""
        return self._item(text, self._encoder.encode(text))

    def cost(self, item: TextItem) -> int:
        return len(item.input_ids)

    def preprocess(self, items: Sequence[TextItem]) -> TextBatch:
        longest = max(len(item.input_ids) for item in items)
        buckets = self.accelerator.buckets
        rows, length = (len(items), longest) if buckets is None else buckets.shape(len(items), longest)
        return self._collate(items, rows, length)

    def _collate(self, items: Sequence[TextItem], rows: int, length: int) -> TextBatch:
        """Pad ``items`` into ``rows`` x ``length`` tensors, on the tokenizer's padding side (a decoder's is often the
        left); rows past the items are all padding."""
        # Filled in numpy, then one torch.from_numpy per tensor: about 5 us an item, against 40 for torch rows.
        arrays = {name: np.full((rows, length), pad, dtype=np.int64) for name, pad in self._pads().items()}
        input_ids, attention_mask = arrays["input_ids"], arrays["attention_mask"]
        pooling_mask = arrays.get(POOLING_MASK)
        for row, item in enumerate(items):
            size = len(item.input_ids)
            start = length - size if self._left else 0
            input_ids[row, start : start + size] = item.input_ids
            attention_mask[row, start : start + size] = 1
            if item.token_type_ids is not None:
                arrays["token_type_ids"][row, start : start + size] = item.token_type_ids
            if pooling_mask is not None:
                pooling_mask[row, start + item.prompt_tokens : start + size] = 1
        tensors = {name: self.accelerator.host(torch.from_numpy(array)) for name, array in arrays.items()}
        return TextBatch(tensors, real_rows=len(items), real_tokens=sum(len(item.input_ids) for item in items))

    def _pads(self) -> dict[str, int]:
        """Each input tensor's padding value: what fills the columns past a text's end and the rows past the items."""
        pads = {"input_ids": self.tokenizer.pad_token_id, "attention_mask": 0}
        if self._token_types:
            pads["token_type_ids"] = self.tokenizer.pad_token_type_id
        if self.pooling_mask:
            pads[POOLING_MASK] = 0
        return pads

    def _model_inputs(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of a batch that the model takes."""
        if not self.pooling_mask:
            return tensors
        return {name: tensor for name, tensor in tensors.items() if name != POOLING_MASK}

    def merge(self, inputs: list[TextBatch]) -> TextBatch:
        """The device process's batch: the real rows of every micro-batch, in order, padded to the longest and (with
        shape buckets) up to a bucket shape, in pinned memory on CUDA. Each worker collated only its own rows."""
        rows = sum(batch.real_rows for batch in inputs)
        longest = max(batch.tensors["input_ids"].shape[1] for batch in inputs)
        buckets = self.accelerator.buckets
        shape = (rows, longest) if buckets is None else buckets.shape(rows, longest)
        pads = self._pads()
        if len(inputs) == 1 and _shaped(only := inputs[0], shape, pads):  # one worker's micro-batch as it is: no copy
            return TextBatch({name: self.accelerator.host(tensor) for name, tensor in only.tensors.items()},
                             only.real_rows, only.real_tokens, only.item_rows)
        merged = {name: torch.full(shape, pad, dtype=torch.int64) for name, pad in pads.items()}
        row = 0
        for batch in inputs:
            count = batch.real_rows
            for name, tensor in batch.tensors.items():
                columns = slice(shape[1] - tensor.shape[1], None) if self._left else slice(0, tensor.shape[1])
                merged[name][row : row + count, columns] = tensor[:count]
            row += count
        tensors = {name: self.accelerator.host(tensor) for name, tensor in merged.items()}
        item_rows = () if not any(batch.item_rows for batch in inputs) else tuple(
            count for batch in inputs for count in (batch.item_rows or (1,) * batch.real_rows))
        return TextBatch(tensors, real_rows=rows, real_tokens=sum(batch.real_tokens for batch in inputs),
                         item_rows=item_rows)

    def rows(self, inputs: TextBatch) -> int:
        """``inference``'s outputs for ``inputs``: one per item (an item of several texts gets one tensor of rows)."""
        return len(inputs.item_rows) if inputs.item_rows else inputs.real_rows

    def sample_rows(self, count: int) -> list[TextItem]:
        """``count`` rows of the expected traffic, tokenised (cut to ``max_length``): what ``dtype=auto`` compares
        precisions on."""
        return [self._cut(payload["text"]) for payload in self.calibration_payloads(count)]

    def calibration_payloads(self, count: int) -> list[dict[str, Any]]:
        return builtin_corpus(self.calibration_corpus, count)

    def warm_up(self) -> None:
        """Run one tiny batch; with shape buckets, one batch of every bucket shape (this compiles them all)."""
        item = self._cut("warm up")  # a row, whatever a request looks like
        buckets = self.accelerator.buckets
        for rows, length in [(1, len(item.input_ids))] if buckets is None else buckets.all():
            self.forward_rows(self._collate([item], rows, length))
        if isinstance(self._forward, CudaGraphs):  # every bucket shape is captured: nothing new while serving
            self._forward.capturing = False

    def token_counts(self, inputs: TextBatch) -> tuple[int, int]:
        # Padded counts every row and column computed, bucket padding included: what the padding metric is for.
        return inputs.real_tokens, inputs.tensors["input_ids"].numel()

    def inference(self, inputs: TextBatch) -> Any:
        """One row per text; where an item holds several texts (``item_rows``), one tensor of rows per item: the
        contract's one output per item, by which a device process hands outputs back to their micro-batches."""
        rows = self.forward_rows(inputs)
        return list(torch.split(rows, list(inputs.item_rows))) if inputs.item_rows else rows

    def forward_rows(self, inputs: TextBatch) -> Any:
        """The batch run through the model, its real rows brought to the host (``to_host``)."""
        accelerator = self.accelerator
        with accelerator.stream(), torch.inference_mode(), accelerator.autocast():
            tensors = accelerator.to_device(inputs.tensors)
            rows = self.reduce(self._forward(**self._model_inputs(tensors)), tensors)[: inputs.real_rows]
            return self.to_host(rows)

    def to_host(self, rows: torch.Tensor) -> Any:
        """``reduce``'s rows, still on the device, as ``inference`` returns them: float32 on the CPU. A handler whose
        rows are wide and mostly zero (sparse) brings back less."""
        # A blocking copy, issued on this thread's stream: it returns once that stream has finished the batch, so
        # postprocess reads final values.
        return rows.float().cpu()

    @abstractmethod
    def reduce(self, output: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Turn the model output into one row per batch row (still on the device). Padding rows have an
        all-zero ``attention_mask``; they are sliced off afterwards, but must not raise. ``inputs`` holds the model's
        inputs and, where the handler asks for it, ``POOLING_MASK``."""

    def describe(self) -> dict[str, str]:
        labels = {"handler": self.name, "model": self.model_name, "device": self._placement}
        runtime = "torch" if self._onnx is None else "onnxruntime" + ("-int8" if self._onnx.quantized else "")
        return {**labels, **self.accelerator.describe(), "runtime": runtime}
