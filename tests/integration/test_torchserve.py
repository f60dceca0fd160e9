"""TorchServe model archives served unchanged through Kafka (``--handler torchserve``), each compared with the same
handler called by hand through TorchServe's own loader and Context."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from kinference import protocol
from kinference.consumer.service import Service
from tests.conftest import TEST_CONSUMER_PROPERTIES
from tests.integration.kafka_io import headers_of, produce, read, service_config
from tests.integration.test_cli import ServeProcess
from tests.torchserve import HERE, build_archive, vector_archive
from tests.torchserve.text_model import save_weights, token_vocabulary

pytest.importorskip("ts", reason="TorchServe's Python package (kinference[torchserve]) is not installed")
from ts.context import Context, RequestProcessor
from ts.model_loader import TsModelLoader

pytestmark = [pytest.mark.integration, pytest.mark.model]
JSON = [("content-type", b"application/json")]


def by_hand(archive_dir: Path, rows: list[dict[str, Any]], headers: list[dict[str, str]]) -> list[Any]:
    """The archive's handler as TorchServe's worker runs it: its loader, its Context, ``handle`` on one batch."""
    sys.path.insert(0, str(archive_dir))
    try:
        manifest = orjson.loads((archive_dir / "MAR-INF" / "MANIFEST.json").read_bytes())
        service = TsModelLoader().load(manifest["model"]["modelName"], str(archive_dir), manifest["model"]["handler"],
                                       None, len(rows), metrics_cache=_NullMetrics())
        context: Context = service.context
        context.request_processor = [RequestProcessor(h) for h in headers]
        results = service._entry_point(rows, context)
        statuses = [context.get_response_status(i)[0] for i in range(len(rows))]
        return [result if status == 200 else status for result, status in zip(results, statuses, strict=True)]
    finally:
        sys.path.remove(str(archive_dir))
        for name in ("vector_classifier", "function_handler", "text_model"):
            sys.modules.pop(name, None)


class _NullMetrics:
    """TorchServe's metrics API, recording nothing (the reference run needs only the results)."""

    request_ids = None

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _extracted(archive: Path, into: Path) -> Path:
    zipfile.ZipFile(archive).extractall(into)
    return into


def test_a_base_handler_archive_runs_on_the_stages_with_headers_statuses_and_metrics(broker, tmp_path):
    """VectorClassifier (BaseHandler's handle, its own preprocess/postprocess) split over kinference's stages:
    2 preprocess and 2 postprocess threads, micro-batches of 4. Each reply equals the handler by hand; the
    x-scale header reaches preprocess of the right request; a malformed request gets bad_request alone; the
    handler's own metric lands on the service's registry."""
    archive = vector_archive(tmp_path / "a")
    topics = broker.topics(requests=2, replies=1, dead=1)
    rows, headers, records = [], [], []
    for i in range(60):
        body = {"x": [i % 5, -i % 3, 0.5 * i, 1.0]} if i % 17 else {"x": [1, 2]}  # 0, 17, 34, 51 are malformed
        scale = str(1 + i % 3)
        rows.append({"body": body})
        headers.append({"content-type": "application/json", "x-scale": scale})
        records.append((str(i).encode(), orjson.dumps(body),
                        [*JSON, ("x-scale", scale.encode()), (protocol.CORRELATION_ID, str(i).encode())]))
    expected = by_hand(_extracted(archive, tmp_path / "by-hand"), rows, headers)
    config = service_config(broker.bootstrap_servers, topics, handler="torchserve", model=archive, max_batch_size=16,
                            micro_batch_size=4, parallelism={"preprocess": 2, "inference": 1, "postprocess": 2})
    with Service(config) as service:
        assert service.wait_ready(30)
        assert service.handler.describe()["stages"] == "split"
        produce(broker.bootstrap_servers, topics["requests"], records)
        replies = read(broker.bootstrap_servers, topics["replies"], len(records), timeout_s=60)
        rows_seen = service.metrics.registry.get_sample_value(
            "kinference_ts_RowsSeen_total", {"ModelName": "vectors", "Level": "Model"})
    assert rows_seen == len(records)
    served = {int(headers_of(m)[protocol.CORRELATION_ID]): orjson.loads(m.value()) for m in replies}
    assert len(served) == len(records)
    for i, want in enumerate(expected):
        if i % 17 == 0:
            assert want == 400
            assert served[i]["error"]["code"] == "bad_request" and "4 numbers" in served[i]["error"]["message"]
        else:
            assert served[i]["result"]["label"] == want["label"]
            assert served[i]["result"]["scores"] == pytest.approx(want["scores"], abs=1e-6)


def test_a_function_handler_runs_whole_and_its_prediction_exception_fails_its_batch(broker, tmp_path):
    archive = vector_archive(tmp_path / "f", handler="function_handler.py", archive_format="tgz")
    topics = broker.topics(requests=1, replies=1, dead=1)
    rows = [{"body": {"x": [i, 1.0, -i, 0.25]}} for i in range(20)]
    expected = by_hand(vector_archive(tmp_path / "ref", handler="function_handler.py", archive_format="no-archive"),
                       rows, [{}] * len(rows))
    config = service_config(broker.bootstrap_servers, topics, handler="torchserve", model=archive, max_batch_size=8)
    with Service(config) as service:
        assert service.wait_ready(30)
        assert service.handler.describe()["stages"] == "whole"
        produce(broker.bootstrap_servers, topics["requests"],
                [(str(i).encode(), orjson.dumps(row["body"]), JSON) for i, row in enumerate(rows)])
        replies = {m.key(): orjson.loads(m.value()) for m in read(broker.bootstrap_servers, topics["replies"], 20)}
        produce(broker.bootstrap_servers, topics["requests"], [(b"fail", b'"fail"', JSON)])
        failed = read(broker.bootstrap_servers, topics["replies"], 21)[-1]
    for i, want in enumerate(expected):
        assert replies[str(i).encode()]["result"] == pytest.approx(want, abs=1e-6)
    assert orjson.loads(failed.value())["error"] == {"code": "bad_request", "message": "asked to fail"}


def test_torchserves_stock_text_classifier_with_an_eager_model_file(broker, tmp_path):
    """A stock handler by name (``text_classifier``: BaseHandler's handle, batch size 1 as TorchServe's docs
    say) over an eager-mode archive (``--model-file`` + state dict), with its vocabulary and labels as extra
    files. Text arrives as text/plain. Each reply equals the handler by hand."""
    texts = ["A fine day, isn't it?", "the worst service", "<b>Great</b> food", "fine food"]
    vocab = tmp_path / "source_vocab.pt"
    torch.save(token_vocabulary(texts), vocab)
    labels = tmp_path / "index_to_name.json"
    labels.write_text('{"0": "negative", "1": "positive"}')
    weights = save_weights(tmp_path / "weights.pt")

    def archive(archive_format: str) -> Path:
        return build_archive(tmp_path / archive_format, "texts", "text_classifier", weights,
                             model_file=HERE / "text_model.py", extra_files=[vocab, labels],
                             archive_format=archive_format)

    served_archive, reference = archive("default"), archive("no-archive")
    expected = [by_hand(reference, [{"body": text}], [{"content-type": "text/plain"}])[0] for text in texts]
    topics = broker.topics(requests=1, replies=1, dead=1)
    config = service_config(broker.bootstrap_servers, topics, handler="torchserve", model=served_archive,
                            max_batch_size=1)
    with Service(config) as service:
        assert service.wait_ready(30)
        assert service.handler.describe()["stages"] == "split"
        produce(broker.bootstrap_servers, topics["requests"],
                [(str(i).encode(), text.encode(), [("content-type", b"text/plain")]) for i, text in enumerate(texts)])
        replies = {m.key(): orjson.loads(m.value()) for m in read(broker.bootstrap_servers, topics["replies"], 4)}
    for i, want in enumerate(expected):
        assert set(want) == {"negative", "positive"}
        assert replies[str(i).encode()]["result"] == pytest.approx(want, abs=1e-6)


def _torchvision() -> Any:
    try:
        import torchvision
    except Exception as exc:  # not installed (ImportError), or a build for another torch (RuntimeError)
        pytest.skip("TorchServe's stock vision handlers (image_classifier, object_detector, image_segmenter) import "
                    f"torchvision, which does not import here: {exc!r}. The registry's torchvision wheels are CUDA "
                    "builds that fail with the CPU torch 2.13 this project's CI uses")
    return torchvision


def test_torchserves_stock_image_classifier(broker, tmp_path):
    torchvision = _torchvision()

    from tests.models import make_picture

    model = torchvision.models.resnet18(weights=None, num_classes=3).eval()
    torch.jit.script(model).save(str(tmp_path / "model.pt"))
    labels = tmp_path / "index_to_name.json"
    labels.write_text('{"0": "a", "1": "b", "2": "c"}')
    archive = build_archive(tmp_path / "export", "resnet", "image_classifier", tmp_path / "model.pt",
                            extra_files=[labels])
    topics = broker.topics(requests=1, replies=1, dead=1)
    config = service_config(broker.bootstrap_servers, topics, handler="torchserve", model=archive)
    with Service(config) as service:
        assert service.wait_ready(30)
        produce(broker.bootstrap_servers, topics["requests"], [(b"0", make_picture(64, 48, "JPEG"), [])])
        reply = orjson.loads(read(broker.bootstrap_servers, topics["replies"], 1)[0].value())
    assert set(reply["result"]) <= {"a", "b", "c"}


def test_serve_reads_the_archives_batch_settings(broker, tmp_path, unique_id):
    """``kinference serve --handler torchserve --model x.mar`` as users run it: the archive's model-config YAML
    sets the batch size (no reply reports a larger batch) unless a flag overrides it."""
    archive = vector_archive(tmp_path / "cfg", config="batchSize: 4\nmaxBatchDelay: 200\n")
    topics = broker.topics(requests=1, replies=1, dead=1)
    serve = ServeProcess(["--handler", "torchserve", "--model", str(archive), "--no-metrics",
                          "--bootstrap-servers", broker.bootstrap_servers, "--request-topics", topics["requests"],
                          "--reply-topic", topics["replies"], "--dead-letter-topic", topics["dead"],
                          "--group-id", f"ts-{unique_id}", "--batch-policy", "static",
                          *(f"--kafka-consumer={k}={v}" for k, v in TEST_CONSUMER_PROPERTIES.items())])
    try:
        assert serve.assigned.wait(60), serve.log
        produce(broker.bootstrap_servers, topics["requests"],
                [(str(i).encode(), orjson.dumps({"x": [i, 0, 0, 1]}), JSON) for i in range(40)])
        replies = read(broker.bootstrap_servers, topics["replies"], 40)
        assert serve.terminate_and_wait() == 0, serve.log
    finally:
        serve.kill()
    assert "batching: static policy, max_batch_size=4, max_batch_delay_ms=200," in serve.log
    sizes = [int(headers_of(m)[protocol.BATCH_SIZE]) for m in replies]
    assert max(sizes) == 4, sizes  # 40 requests at once under a static policy fill batches of exactly 4
