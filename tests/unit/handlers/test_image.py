"""The image-classification handler, on tiny random models (TorchScript and torch.export) from tests/models.py.

No torchvision: images are made and decoded with Pillow, as the handler does.
"""

from __future__ import annotations

import base64
import io
import re
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from kinference.errors import HandlerLoadError, InvalidInput
from kinference.handlers import HandlerContext, load_handler
from kinference.handlers.image import ImageClassificationHandler
from tests.models import build_tiny_image_classifier, make_picture, reference_image_scores

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_image_classifier(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def handler(scripted: Path) -> ImageClassificationHandler:
    return set_up(scripted, top_k=3)


def set_up(model: Path, **options: Any) -> ImageClassificationHandler:
    handler = load_handler("image-classification")
    assert isinstance(handler, ImageClassificationHandler)
    handler.setup(HandlerContext(device="cpu", model=model, options=options, max_batch_size=8))
    return handler


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims ``width`` x ``height``: what a decompression bomb's header looks like."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    header = struct.pack(">II", width, height) + bytes(data[24:29])  # IHDR: size, then depth, colour, ...
    data[16:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return bytes(data)


def classify(handler: ImageClassificationHandler, payloads: list[bytes]) -> list[Any]:
    items = [handler.validate(payload) for payload in payloads]
    return handler.postprocess(handler.inference(handler.preprocess(items)), items)


def as_dict(result: dict[str, Any]) -> dict[str, float]:
    return {entry["label"]: entry["score"] for entry in result["labels"]}


@pytest.mark.parametrize("image_format", ["JPEG", "PNG", "WEBP"])
def test_results_equal_the_model_called_by_hand(scripted: Path, image_format: str) -> None:
    exact = set_up(scripted, fast_jpeg=False, top_k=3)
    images = [make_picture(320, 240, image_format), make_picture(1920, 1080, image_format, seed=1),
              make_picture(500, 900, seed=2)]
    results = classify(exact, images)
    for result, data in zip(results, images, strict=True):
        assert as_dict(result) == pytest.approx(reference_image_scores(scripted, data), abs=1e-5)
        scores = [entry["score"] for entry in result["labels"]]
        assert scores == sorted(scores, reverse=True) and sum(scores) == pytest.approx(1.0)


def test_a_json_request_with_base64_is_the_same_image(handler: ImageClassificationHandler) -> None:
    data = make_picture(640, 480)
    wrapped = b'{"image": "' + base64.b64encode(data) + b'"}'
    raw, from_json = classify(handler, [data, wrapped])
    assert raw == from_json


def test_fast_jpeg_decodes_large_photos_at_a_reduced_scale_with_nearly_the_same_pixels(scripted: Path) -> None:
    data = make_picture(1920, 1080)
    item = set_up(scripted).validate(data)
    fast, exact = set_up(scripted).preprocess([item]), set_up(scripted, fast_jpeg=False).preprocess([item])
    assert fast.pixels is not None and exact.pixels is not None
    difference = (fast.pixels - exact.pixels).abs().mean().item()
    print(f"\nfast_jpeg: mean abs difference {difference:.4f} (normalised units)")
    assert difference < 0.05


def test_the_torch_export_program_gives_the_same_scores_as_torchscript(tmp_path: Path, handler) -> None:
    exported = set_up(build_tiny_image_classifier(tmp_path / "exported", exported=True), top_k=3)
    images = [make_picture(320, 240), make_picture(800, 600, seed=1), make_picture(400, 400, "PNG", seed=3)]
    for mine, theirs in zip(classify(exported, images), classify(handler, images), strict=True):
        assert as_dict(mine) == pytest.approx(as_dict(theirs), abs=1e-5)
    assert exported.describe() == {"handler": "image-classification", "model": "exported", "device": "cpu"}


def test_a_truncated_file_fails_alone_and_its_neighbours_succeed(handler: ImageClassificationHandler) -> None:
    good, broken = make_picture(640, 480), make_picture(1024, 768, seed=1)
    results = classify(handler, [good, broken[: len(broken) // 3], good])
    assert isinstance(results[1], InvalidInput) and "cannot be decoded" in str(results[1])
    assert results[0] == results[2] and [entry["label"] for entry in results[0]["labels"]] != []


def test_a_batch_of_only_broken_files_gets_an_error_each(handler: ImageClassificationHandler) -> None:
    whole = make_picture(640, 480)
    broken = whole[: len(whole) // 2]  # the header is whole: only decoding finds the damage
    results = classify(handler, [broken, broken])
    assert all(isinstance(result, InvalidInput) for result in results)


@pytest.mark.parametrize(("payload", "message"), [
    (b"", "empty request"),
    (b"this is not an image", "not a JPEG, PNG, WEBP image"),
    (b'{"text": "hello"}', 'expected {"image": "<base64 of the image bytes>"}'),
    (b'{"image": "***"}', '"image" is not valid base64'),
    (b'{"image": ', "starts like JSON but is not valid JSON"),
    (make_picture(64, 64, "GIF"), "not a JPEG, PNG, WEBP image"),
    (png_claiming(8000, 6000), "8000x6000: more than the limit of 40,000,000 pixels"),
    (png_claiming(100_000, 100_000), "DecompressionBombError"),
    (png_claiming(30_000, 20), "a side is over 20000"),
    (png_claiming(5000, 100), "an aspect ratio over 20:1"),
])
def test_bad_requests_are_refused_from_the_header_alone(handler, payload: bytes, message: str) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidInput) as refused:
        handler.validate(payload)
    assert message in str(refused.value)
    assert time.perf_counter() - started < 0.05  # nothing was decoded


@pytest.mark.parametrize(("options", "message"), [
    ({"crop": 300}, "crop=300 is larger than resize=256"),
    ({"top_k": 4}, "top_k=4 but there are 3 labels"),
    ({"mean": [0.5, 0.5]}, "mean must be 3 numbers"),
    ({"std": [1, 0, 1]}, "std must be positive"),
    ({"resize_to": 256}, "unknown handler option(s) resize_to"),
])
def test_bad_options_fail_setup(scripted: Path, options: dict[str, Any], message: str) -> None:
    with pytest.raises(HandlerLoadError, match=re.escape(message)):
        set_up(scripted, **options)


def test_model_files_and_labels_are_found_or_their_absence_explained(tmp_path: Path, scripted: Path) -> None:
    with pytest.raises(HandlerLoadError, match="needs --model"):
        load_handler("image-classification").setup(HandlerContext(device="cpu"))
    with pytest.raises(HandlerLoadError, match=r"holds none of model\.pt2, model\.pt"):
        set_up(tmp_path)
    (tmp_path / "model.pt").write_bytes((scripted / "model.pt").read_bytes())
    with pytest.raises(HandlerLoadError, match="no labels next to the model"):
        set_up(tmp_path)
    (tmp_path / "labels.txt").write_text("red\ngreen\nblue\n")
    assert set_up(tmp_path / "model.pt").labels == ["red", "green", "blue"]  # a file path works too
    (tmp_path / "model.pt").write_bytes(b"not a model")
    with pytest.raises(HandlerLoadError, match="cannot load"):
        set_up(tmp_path)


def test_any_decoder_error_fails_only_its_own_image(scripted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow's plugins raise more than OSError on damaged files (struct.error, IndexError...): still one image."""
    handler = set_up(scripted)
    decode = handler._pixels
    damaged = make_picture(300, 300, seed=5)

    def pixels(item):
        if item.data == damaged:
            raise IndexError("tuple index out of range")
        return decode(item)

    monkeypatch.setattr(handler, "_pixels", pixels)
    results = classify(handler, [make_picture(320, 240), damaged])
    assert "labels" in results[0]
    assert isinstance(results[1], InvalidInput) and "IndexError" in str(results[1])


def with_extra_scans(jpeg: bytes, extra: int) -> bytes:
    """A progressive JPEG with its last scan (SOS segment and data) repeated ``extra`` times before the EOI."""
    last = jpeg.rindex(b"\xff\xda")
    return jpeg[:last] + jpeg[last:-2] * (extra + 1) + jpeg[-2:]


def test_a_jpeg_with_more_scans_than_the_limit_is_refused_from_its_bytes_alone(handler) -> None:
    """Issue 20, defect 6: a 319 KB progressive JPEG (4000x4000 header, within max_pixels) with 8,000 extra scans
    held a preprocess thread for 9.1 s, and the cost grows with the scans. The scans are counted at validate."""
    progressive = io.BytesIO()
    Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48).save(progressive, "JPEG", progressive=True)
    normal = progressive.getvalue()
    assert handler.validate(normal).format == "JPEG"  # libjpeg's own progressive script: 10 scans
    bomb = with_extra_scans(normal, 8000)
    with pytest.raises(InvalidInput, match="more than the limit of 64"):
        handler.validate(bomb)
