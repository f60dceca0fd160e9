"""Image classification: JPEG, PNG or WebP in, the top-k labels out. Needs torch and Pillow, not torchvision.

Requests are the raw image bytes, or JSON ``{"image": "<base64>"}``. ``--model`` is a TorchScript file
(``torch.jit.save``) or a ``torch.export`` program (``.pt2``, exported with a dynamic batch dimension), or a
directory holding one (``model.pt``, ``model.pt2``) and the labels: TorchServe's ``index_to_name.json``
(``{"0": "tench"}`` or ``{"0": ["n01440764", "tench"]}``) or ``labels.txt`` (one label per line). The model
takes a float batch ``N x 3 x crop x crop``, normalised with ``mean``/``std``, and returns one logit per label.

Where the work happens, so that decoding overlaps inference (the stages' reason to exist):

- ``validate`` (poll thread, about 20-50 µs): reads only the image header (trying only JPEG, PNG and WebP), and
  counts a JPEG's scans. Not an image, a format other than JPEG/PNG/WebP, more than ``max_pixels`` pixels (a
  decompression bomb: a few KB that decode to GBs), a side over ``max_side``, an aspect ratio over
  ``max_aspect`` (a 1 x 100,000 image would resize to millions of pixels), or a JPEG of more than ``max_scans``
  scans (a CPU bomb: decoding is one pass over the pixels per scan) is rejected here, before any decoding, with
  ``bad_request``.
- ``preprocess`` (preprocess threads): decode, resize the shorter side to ``resize``, center-crop ``crop``,
  normalise. A JPEG is decoded at a reduced scale when it is at least twice the size needed (libjpeg's
  DCT scaling: ``fast_jpeg``, default on), a large saving on photos. A file that fails to decode (truncated,
  corrupt) fails that image alone: its slot carries the error to ``postprocess``.
- ``inference`` (inference threads): the model on the batch of decoded images.
- ``postprocess``: softmax, the ``top_k`` labels.

Options: ``top_k`` (5, or every label when there are fewer), ``resize`` (256), ``crop`` (224), ``mean`` and
``std`` (ImageNet's), ``max_pixels`` (40,000,000), ``max_side`` (20,000), ``max_aspect`` (20), ``max_scans``
(64: libjpeg's progressive JPEGs have 10, tuned encoders a few more), ``fast_jpeg`` (true).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
from PIL import Image, UnidentifiedImageError

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers.base import Handler, HandlerContext
from kinference.handlers.labels import top_labels
from kinference.handlers.options import boolean, positive_int, with_defaults

FORMATS = ("JPEG", "PNG", "WEBP")
MODEL_FILES = ("model.pt2", "model.pt")
LABEL_FILES = ("index_to_name.json", "labels.txt")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_START_OF_SCAN = b"\xff\xda"


@dataclass(frozen=True, slots=True)
class ImageItem:
    """A request that passed the header checks: its bytes and what the header said."""

    data: bytes
    format: str
    size: tuple[int, int]


@dataclass(frozen=True, slots=True)
class ImageBatch:
    """The decoded images of a micro-batch (``pixels`` holds only those that decoded), and the error of each
    slot that did not."""

    pixels: torch.Tensor | None
    errors: list[InvalidInput | None]


class ImageClassificationHandler(Handler):
    name = "image-classification"
    payload_format = "bytes"
    defaults: dict[str, Any] = {
        "top_k": 5, "resize": 256, "crop": 224, "mean": IMAGENET_MEAN, "std": IMAGENET_STD,
        "max_pixels": 40_000_000, "max_side": 20_000, "max_aspect": 20, "max_scans": 64, "fast_jpeg": True,
    }

    def setup(self, context: HandlerContext) -> None:
        options = with_defaults(self.name, self.defaults, context.options)
        self.top_k, self.resize, self.crop, self.max_pixels, self.max_side, self.max_aspect, self.max_scans = (
            positive_int(self.name, key, options[key])
            for key in ("top_k", "resize", "crop", "max_pixels", "max_side", "max_aspect", "max_scans"))
        if self.crop > self.resize:
            raise HandlerLoadError(f"{self.name}: crop={self.crop} is larger than resize={self.resize}")
        self.fast_jpeg = boolean(self.name, "fast_jpeg", options["fast_jpeg"])
        self.mean = _channels(self.name, "mean", options["mean"])
        self.std = _channels(self.name, "std", options["std"])
        if context.model is None:
            raise HandlerLoadError(f"{self.name} needs --model: a TorchScript (.pt) or torch.export (.pt2) file, "
                                   f"or a directory with one of {', '.join(MODEL_FILES)} and the labels")
        self.device = torch.device(context.device)
        model_file, label_file = _model_files(self.name, context.model)
        self.model_name = model_file.name if context.model.is_file() else context.model.resolve().name
        self.model = _load_model(self.name, model_file, self.device)
        self.labels = _load_labels(self.name, label_file)
        if "top_k" not in context.options:
            self.top_k = min(self.top_k, len(self.labels))
        elif self.top_k > len(self.labels):
            raise HandlerLoadError(f"{self.name}: top_k={self.top_k} but there are {len(self.labels)} labels")

    # --- poll thread: headers only

    def validate(self, payload: bytes) -> ImageItem:
        data = _image_bytes(payload)
        try:
            # Lazy: reads the header, decodes nothing. Only this handler's formats are tried: Pillow would try each
            # of its plugins in turn (a 940 KB JPEG of empty APP1 markers took 0.4 s of the poll thread).
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                image_format, size = image.format, image.size
            if image_format is None:  # Pillow names the format of whatever it opened: never, but said, not assumed
                raise ValueError("Pillow opened it without naming its format")
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as exc:
            raise InvalidInput(f"not a {', '.join(FORMATS)} image ({type(exc).__name__}: {exc})") from exc
        # Decoding costs one pass over the pixels per scan: a few KB of extra progressive scans made a 4000x4000
        # JPEG hold a preprocess thread for 9 s. Every scan starts with an SOS marker, which cannot occur inside
        # the entropy-coded data (0xFF is stuffed there), so one count bounds them (a marker inside an APPn payload,
        # an EXIF thumbnail's, counts too: a slight overcount).
        scans = data.count(_START_OF_SCAN) if image_format == "JPEG" else 0
        if scans > self.max_scans:
            raise InvalidInput(f"the JPEG has {scans} scans, more than the limit of {self.max_scans} (handler "
                               "option max_scans)")
        width, height = size
        if width < 1 or height < 1 or width * height > self.max_pixels:
            raise InvalidInput(f"image is {width}x{height}: more than the limit of {self.max_pixels:,} pixels "
                               "(handler option max_pixels)")
        if max(size) > self.max_side:
            raise InvalidInput(f"image is {width}x{height}: a side is over {self.max_side} (handler option max_side)")
        if max(size) > self.max_aspect * min(size):
            raise InvalidInput(f"image is {width}x{height}: an aspect ratio over {self.max_aspect}:1 "
                               "(handler option max_aspect)")
        return ImageItem(data, image_format, size)

    # --- preprocess threads: decode, resize, crop, normalise

    def preprocess(self, items: list[ImageItem]) -> ImageBatch:
        rows: list[np.ndarray] = []
        errors: list[InvalidInput | None] = []
        for item in items:
            try:
                rows.append(self._pixels(item))
                errors.append(None)
            except Exception as exc:  # whatever a decoder raises on one file (OSError, SyntaxError, struct.error...)
                errors.append(InvalidInput(f"the {item.format} image cannot be decoded ({type(exc).__name__}: "
                                           f"{exc})"))
        if not rows:
            return ImageBatch(None, errors)
        batch = np.stack(rows)  # N x crop x crop x 3, uint8
        pixels = torch.from_numpy(batch).permute(0, 3, 1, 2).float().div_(255)
        pixels = pixels.sub_(torch.tensor(self.mean).view(1, 3, 1, 1)).div_(torch.tensor(self.std).view(1, 3, 1, 1))
        return ImageBatch(pixels.contiguous(), errors)

    def _pixels(self, item: ImageItem) -> np.ndarray:
        with Image.open(io.BytesIO(item.data), formats=(item.format,)) as image:
            if self.fast_jpeg and item.format == "JPEG":
                # libjpeg decodes at 1/2, 1/4 or 1/8 scale, keeping both sides >= resize: the shorter side still
                # resizes down (never up) to ``resize`` below.
                image.draft("RGB", (self.resize, self.resize))
            rgb = image.convert("RGB")  # decodes; raises on a truncated or corrupt file
        width, height = rgb.size
        scale = self.resize / min(width, height)
        resized = rgb.resize((max(self.crop, round(width * scale)), max(self.crop, round(height * scale))),
                             Image.Resampling.BILINEAR)
        left = (resized.width - self.crop) // 2
        top = (resized.height - self.crop) // 2
        return np.asarray(resized.crop((left, top, left + self.crop, top + self.crop)))

    # --- inference threads

    def inference(self, inputs: ImageBatch) -> tuple[torch.Tensor | None, list[InvalidInput | None]]:
        if inputs.pixels is None:
            return None, inputs.errors
        with torch.inference_mode():
            logits = self.model(inputs.pixels.to(self.device, non_blocking=True))
            return logits.float().softmax(dim=-1).cpu(), inputs.errors

    # --- postprocess threads

    def postprocess(self, outputs: tuple[torch.Tensor | None, list[InvalidInput | None]],
                    items: list[ImageItem]) -> list[Any]:
        scores, errors = outputs
        decoded = iter(top_labels(scores, self.labels, self.top_k) if scores is not None else [])
        return [next(decoded) if error is None else error for error in errors]

    def warm_up(self) -> None:
        pixels = torch.zeros(1, 3, self.crop, self.crop)
        self.inference(ImageBatch(pixels, [None]))

    def describe(self) -> dict[str, str]:
        return {"handler": self.name, "model": self.model_name, "device": str(self.device)}


def _image_bytes(payload: bytes) -> bytes:
    """The image of a request: the value itself, or the base64 ``image`` of a JSON object."""
    if not payload:
        raise InvalidInput('empty request: send the image bytes, or {"image": "<base64>"}')
    if payload[:1] != b"{":
        return payload
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request starts like JSON but is not valid JSON: {exc}") from exc
    encoded = body.get("image") if isinstance(body, dict) else None
    if not isinstance(encoded, str):
        raise InvalidInput('expected {"image": "<base64 of the image bytes>"}')
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f'"image" is not valid base64: {exc}') from exc


def _channels(handler: str, key: str, value: Any) -> tuple[float, float, float]:
    if (not isinstance(value, list | tuple) or len(value) != 3
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
        raise HandlerLoadError(f"{handler}: handler option {key} must be 3 numbers (R, G, B), not {value!r}")
    if key == "std" and min(value) <= 0:
        raise HandlerLoadError(f"{handler}: handler option std must be positive, not {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


def _model_files(handler: str, model: Path) -> tuple[Path, Path | None]:
    """The model file and the labels file (None when there is none) that ``--model`` points at."""
    if model.is_file():
        directory, model_file = model.parent, model
    elif model.is_dir():
        directory = model
        found = [model / name for name in MODEL_FILES if (model / name).is_file()]
        if not found:
            raise HandlerLoadError(f"{handler}: {model} holds none of {', '.join(MODEL_FILES)}")
        model_file = found[0]
    else:
        raise HandlerLoadError(f"{handler}: --model {model} does not exist")
    labels = [directory / name for name in LABEL_FILES if (directory / name).is_file()]
    return model_file, labels[0] if labels else None


def _load_model(handler: str, path: Path, device: torch.device) -> Any:
    try:
        if path.suffix == ".pt2":
            model = torch.export.load(str(path)).module()
        else:
            model = torch.jit.load(str(path), map_location=device)
            model.eval()
        return model.to(device)
    except Exception as exc:  # whatever fails while loading, the service cannot start
        raise HandlerLoadError(f"{handler}: cannot load {path} (TorchScript .pt or torch.export .pt2): {exc}") from exc


def _load_labels(handler: str, path: Path | None) -> list[str]:
    if path is None:
        raise HandlerLoadError(f"{handler}: no labels next to the model: add {' or '.join(LABEL_FILES)}")
    try:
        if path.suffix == ".json":
            index = orjson.loads(path.read_bytes())
            names = [index[str(i)] for i in range(len(index))]
            return [str(name[-1] if isinstance(name, list) else name) for name in names]
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise HandlerLoadError(f"{handler}: cannot read the labels in {path}: {exc}") from exc
