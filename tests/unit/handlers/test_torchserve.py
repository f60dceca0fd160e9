"""The torchserve handler and archive reader called directly: archive formats, batch settings and their place in
the configuration, the stage split against TorchServe's own ``handle``, per-request statuses, per-thread context,
metrics. End to end through a broker: tests/integration/test_torchserve.py."""

from __future__ import annotations

import io
import sys
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from prometheus_client import CollectorRegistry

from kinference.consumer.config import load_config
from kinference.errors import ConfigError, HandlerLoadError, RequestError
from kinference.handlers import HandlerContext, load_handler
from kinference.handlers import torchserve as adapter
from kinference.handlers.base import Record
from kinference.handlers.torchserve_archive import batch_settings, opened
from kinference.protocol import ErrorCode
from tests.torchserve import build_archive, vector_archive

pytest.importorskip("ts", reason="TorchServe's Python package (kinference[torchserve]) is not installed")
from ts.context import RequestProcessor

MICRO = """batchSize: 24
maxBatchDelay: 35
micro_batching:
  micro_batch_size: 6
  parallelism:
    preprocess: 3
    postprocess: 2
"""


def served(model: Path, **options: Any) -> Any:
    handler = load_handler("torchserve")
    handler.setup(HandlerContext(device="cpu", model=model, options=options, registry=CollectorRegistry(),
                                 max_batch_size=8))
    return handler


def request(body: Any, **headers: str) -> Record:
    return Record(orjson.dumps(body), None, {"content-type": "application/json", **headers}, f"id-{id(body)}")


def run(handler: Any, records: list[Record]) -> list[Any]:
    items = handler.validate_many(records)
    return handler.postprocess(handler.inference(handler.preprocess(items)), items)


@pytest.mark.parametrize("archive_format", ["default", "tgz", "no-archive"])
def test_every_archive_format_opens_and_gives_the_batch_settings(tmp_path, archive_format):
    archive = vector_archive(tmp_path, config=MICRO, archive_format=archive_format)
    assert batch_settings(archive) == {"max_batch_size": 24, "max_batch_delay_ms": 35, "micro_batch_size": 6,
                                       "parallelism": {"preprocess": 3, "postprocess": 2}}
    with opened(archive) as contents:
        assert contents.name == "vectors" and contents.handler == "vector_classifier.py"
        assert (contents.directory / "model.pt").is_file() and contents.config()["batchSize"] == 24
        extracted = contents.directory
    assert extracted.exists() == (archive_format == "no-archive")  # a temporary extraction is removed


def test_config_properties_models_override_the_archives_own_settings(tmp_path):
    archive = vector_archive(tmp_path, config=MICRO)
    properties = tmp_path / "config.properties"
    properties.write_text('inference_address=http://0.0.0.0:8080\nmodels={\\\n  "vectors": {\\\n'
                          '    "0.9": {"batchSize": 2},\\\n'
                          '    "1.0": {"batchSize": 12, "maxBatchDelay": 80}\\\n  }\\\n}\n')
    assert batch_settings(archive, properties) == {"max_batch_size": 12, "max_batch_delay_ms": 80,
                                                   "micro_batch_size": 6,
                                                   "parallelism": {"preprocess": 3, "postprocess": 2}}


def test_the_archives_settings_sit_below_every_layer_the_user_sets(tmp_path):
    archive = vector_archive(tmp_path, config=MICRO)
    (config,) = load_config({"handler": "torchserve", "model": str(archive)}, environ={}).model_configs()
    batching = config.batching
    assert (batching.max_batch_size, batching.max_batch_delay_ms, batching.micro_batch_size) == (24, 35, 6)
    assert (batching.parallelism.preprocess, batching.parallelism.inference,
            batching.parallelism.postprocess) == (3, 1, 2)
    yaml_file = tmp_path / "kinference.yaml"
    yaml_file.write_text("max_batch_delay_ms: 5\n")
    (config,) = load_config({"handler": "torchserve", "model": str(archive), "micro_batch_size": "4"}, yaml_file,
                            environ={"KINFERENCE_MAX_BATCH_SIZE": "16"}).model_configs()
    batching = config.batching
    assert (batching.max_batch_size, batching.max_batch_delay_ms, batching.micro_batch_size) == (16, 5, 4)
    # Other handlers never look at the model's settings.
    (config,) = load_config({"handler": "echo", "model": str(archive)}, environ={}).model_configs()
    assert config.batching.max_batch_size == 32


def test_with_several_models_an_archives_settings_are_its_models_under_what_the_entry_sets(tmp_path):
    archive = vector_archive(tmp_path, config=MICRO)
    config = load_config({"max_batch_size": "16", "models": orjson.dumps([
        {"name": "echo", "handler": "echo"},
        {"name": "vectors", "handler": "torchserve", "model": str(archive), "micro_batch_size": 4},
    ]).decode()}, environ={})
    echo, vectors = (model.batching for model in config.model_configs())
    assert (echo.max_batch_size, echo.micro_batch_size) == (16, None)  # the service's own
    assert (vectors.max_batch_size, vectors.max_batch_delay_ms, vectors.micro_batch_size) == (24, 35, 4)
    assert (vectors.parallelism.preprocess, vectors.parallelism.postprocess) == (3, 2)


def test_a_file_that_is_not_an_archive_is_a_configuration_error(tmp_path):
    not_an_archive = tmp_path / "model.mar"
    not_an_archive.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=r"neither a \.mar"):
        load_config({"handler": "torchserve", "model": str(not_an_archive)}, environ={}).model_configs()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HandlerLoadError, match=r"no MAR-INF/MANIFEST\.json"):
        batch_settings(empty)


def test_the_stage_split_equals_torchserves_own_handle_with_per_request_statuses(tmp_path):
    archive = vector_archive(tmp_path)
    records = [request({"x": [1, 2, 3, 4]}), request({"x": [1]}), request({"x": [0.5, -1, 2, 0]}, **{"x-scale": "3"})]
    split, whole = served(archive), served(archive, stages="whole")
    try:
        assert (split.describe()["stages"], whole.describe()["stages"]) == ("split", "whole")
        by_stages, by_handle = run(split, records), run(whole, records)
    finally:
        split.close()
        whole.close()
    assert isinstance(by_stages[1], RequestError) and by_stages[1].code == ErrorCode.BAD_REQUEST
    assert "answered 400" in by_stages[1].message and "4 numbers" in by_stages[1].message
    assert by_stages[0] == by_handle[0] and by_stages[2] == by_handle[2]
    assert by_stages[0] != by_stages[2]  # the x-scale header reached its own request


def test_prediction_exception_fails_its_micro_batch_with_the_code_it_names(tmp_path):
    handler = served(vector_archive(tmp_path, handler="function_handler.py"))
    try:
        assert handler.describe()["stages"] == "whole"
        results = run(handler, [request([0, 0, 0, 0]), request("fail")])
        ok = run(handler, [request({"x": [1, 2, 3, 4]})])
    finally:
        handler.close()
    assert all(isinstance(r, RequestError) and r.code == ErrorCode.BAD_REQUEST and r.message == "asked to fail"
               for r in results)
    assert len(ok[0]) == 3 and abs(sum(ok[0]) - 1) < 1e-6


def test_split_is_refused_for_a_handler_without_basehandlers_handle(tmp_path):
    with pytest.raises(HandlerLoadError, match="stages=split needs a BaseHandler"):
        served(vector_archive(tmp_path, handler="function_handler.py"), stages="split")


def test_bad_options_and_a_missing_package_fail_setup_with_the_fix(tmp_path, monkeypatch):
    archive = vector_archive(tmp_path)
    with pytest.raises(HandlerLoadError, match="unknown handler option"):
        served(archive, stage="split")
    with pytest.raises(HandlerLoadError, match="needs --model"):
        load_handler("torchserve").setup(HandlerContext(device="cpu"))
    monkeypatch.setattr(adapter, "_MISSING", ImportError("No module named 'ts'"))
    with pytest.raises(HandlerLoadError, match=r"pip install 'kinference\[torchserve\]'"):
        served(archive)


def test_a_value_that_does_not_decode_as_its_content_type_is_a_bad_request(tmp_path):
    handler = served(vector_archive(tmp_path))
    try:
        rejected = handler.validate_many([Record(b"{not json", None, {"Content-Type": "application/json"}, "c"),
                                          Record(b"\xff", None, {"content-type": "text/plain"}, "c")])
        raw = handler.validate(Record(b"\xff", None, {}, "c"))
    finally:
        handler.close()
    assert all(isinstance(error, Exception) and "content-type" in str(error) for error in rejected)
    assert raw.row == {"body": b"\xff"}  # no content type: bytes, as TorchServe passes them


def test_results_map_bytes_and_tensors_to_json_and_statuses_to_error_codes():
    processor = RequestProcessor({})
    processor.add_response_property("content-type", "image/png")
    assert adapter._result(b"\x89PNG", processor) == {"content_type": "image/png", "base64": "iVBORw=="}
    assert adapter._result(torch.tensor([1.5, 2.0]), RequestProcessor({})) == [1.5, 2.0]
    failed = RequestProcessor({})
    failed.report_status(503, "busy")
    error = adapter._result("ignored", failed)
    assert error.code == ErrorCode.HANDLER_ERROR and error.message == "the handler answered 503: busy"


def test_each_thread_sees_the_requests_of_its_own_micro_batch(tmp_path):
    """Two stage threads inside ``serving`` at the same time: each reads its own micro-batch's headers and ids."""
    handler = served(vector_archive(tmp_path))
    context, both_inside, seen = handler.context, threading.Barrier(2), {}

    def stage(name: str) -> None:
        requests = [adapter.TorchServeRequest({}, RequestProcessor({"who": name}), f"{name}-0")]
        with context.serving(requests):
            both_inside.wait(5)
            seen[name] = (context.get_request_header(0, "who"), context.get_request_id(0))

    try:
        threads = [threading.Thread(target=stage, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    finally:
        handler.close()
    assert seen == {"a": ("a", "a-0"), "b": ("b", "b-0")}
    assert context.request_processor is None  # nothing left behind in this thread


def test_torchserve_metrics_land_in_the_registry_by_type(tmp_path):
    from ts.metrics.metric_type_enum import MetricTypes

    registry = CollectorRegistry()
    metrics = adapter.PrometheusMetrics(registry, "m")
    metrics.add_time("HandlerTime", 12.5)
    metrics.add_time("HandlerTime", 7.5)
    metrics.add_counter("Rows", 3)
    metrics.add_counter("Rows", 2)
    metrics.add_metric("Sizes", 4, "count", metric_type=MetricTypes.HISTOGRAM)
    metrics.add_error("Oops", 1)
    metrics.get_metric("Rows", MetricTypes.COUNTER).add_or_update(1, ["only-one-dimension"])  # wrong arity: dropped
    labels = {"ModelName": "m", "Level": "Model"}
    assert registry.get_sample_value("kinference_ts_HandlerTime_ms", labels) == 7.5  # a gauge, as in TorchServe
    assert registry.get_sample_value("kinference_ts_Rows_total", labels) == 5
    assert registry.get_sample_value("kinference_ts_Sizes_count", labels) == 1
    assert registry.get_sample_value("kinference_ts_Oops_total", {"Level": "Error"}) == 1


def test_archives_that_reuse_a_module_name_each_get_their_own(tmp_path):
    """TorchServe runs one model per process, so archives commonly name their handler ``handler.py``; two of them
    in one process must not share the first one's module."""
    model = tmp_path / "model.pt"
    torch.jit.script(torch.nn.Identity()).save(str(model))
    answers = []
    for name in ("first", "second"):
        source = tmp_path / name / "handler.py"
        source.parent.mkdir()
        source.write_text(f"def handle(data, context):\n    return None if data is None else [{name!r}] * len(data)\n")
        handler = served(build_archive(tmp_path / name / "export", name, str(source), model))
        try:
            answers.append(run(handler, [request(1)]))
        finally:
            handler.close()
    assert answers == [["first"], ["second"]]


def symlink_chain_archive(path: Path) -> Path:
    """CVE-2025-4517's archive: a chain of symlinks longer than PATH_MAX, so that ``os.path.realpath`` (and with it
    tarfile's ``filter="data"``) stops resolving, then a link through it to the extraction directory's parent and a
    file written through that link."""
    component, steps, at = "d" * 247, "abcdefghijklmnop", ""
    with tarfile.open(path, "w:gz") as tar:
        manifest = orjson.dumps({"model": {"modelName": "x", "handler": "handler.py"}})
        member = tarfile.TarInfo("MAR-INF/MANIFEST.json")
        member.size = len(manifest)
        tar.addfile(member, io.BytesIO(manifest))
        for step in steps:
            directory = tarfile.TarInfo(f"{at}{component}")
            directory.type = tarfile.DIRTYPE
            link = tarfile.TarInfo(f"{at}{step}")
            link.type, link.linkname = tarfile.SYMTYPE, component
            tar.addfile(directory)
            tar.addfile(link)
            at += component + "/"
        deep = "/".join(steps) + "/" + "l" * 254
        for name, target in ((deep, "../" * len(steps)), ("escape", deep + "/..")):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, target
            tar.addfile(link)
        payload = tarfile.TarInfo("escape/written-outside")
        payload.size = 3
        tar.addfile(payload, io.BytesIO(b"pwn"))
    return path


def test_an_archive_with_links_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Issue 20, defect 4: on Python 3.11.7 the archive above got past ``filter="data"`` and wrote a file outside
    the extraction directory (the start then failed, but the file was written)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where opened() extracts: scratch/kinference-mar-*
    archive = symlink_chain_archive(tmp_path / "evil.tar.gz")
    with pytest.raises(HandlerLoadError, match="a link or special file"), opened(archive):
        pass
    assert sorted(path.name for path in scratch.iterdir()) == []


@pytest.mark.parametrize("config_file", ["../outside.yaml", "/etc/hostname", "missing.yaml"])
def test_a_config_file_outside_the_archive_or_missing_is_a_configuration_error(tmp_path, config_file):
    """Issue 20, defect 10: ``configFile: "../x.yaml"`` was read from outside the archive (by ``Archive.config()``
    and TorchServe's ``get_yaml_config``), and one missing from a zip escaped ``load_config`` as a KeyError."""
    (tmp_path / "outside.yaml").write_text("batchSize: 7\n")
    mar = tmp_path / "model.mar"
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", orjson.dumps({"model": {
            "modelName": "x", "handler": "handler.py", "configFile": config_file}}))
    with pytest.raises(ConfigError, match=r"not a path inside the archive|does not hold"):
        load_config({"handler": "torchserve", "model": str(mar)}, environ={}).model_configs()
    with pytest.raises(HandlerLoadError), opened(mar) as opened_archive:
        opened_archive.config()
    directory = tmp_path / "extracted"
    (directory / "MAR-INF").mkdir(parents=True)
    (directory / "MAR-INF" / "MANIFEST.json").write_bytes(orjson.dumps({"model": {
        "modelName": "x", "handler": "handler.py", "configFile": config_file}}))
    with pytest.raises(HandlerLoadError), opened(directory) as opened_archive:
        opened_archive.config()


def test_two_archives_served_at_once_each_run_their_own_helper_modules(tmp_path):
    """Issue 20, defect 5: archives A and B both ship ``helpers.py``; B's replies said ``{"archive": "A"}``, since
    only handler and model-file modules were cleared and every archive stayed on ``sys.path``."""
    handlers = []
    try:
        for name in ("A", "B"):
            mar = tmp_path / f"{name}.mar"
            with zipfile.ZipFile(mar, "w") as archive:
                archive.writestr("MAR-INF/MANIFEST.json", orjson.dumps({"model": {
                    "modelName": name, "handler": "handler.py"}}))
                archive.writestr("handler.py", "import helpers\n\ndef handle(data, context):\n"
                                               "    return None if data is None else [helpers.ARCHIVE] * len(data)\n")
                archive.writestr("helpers.py", f"ARCHIVE = {name!r}\n")
            handlers.append(served(mar))
        assert [run(handler, [request(1)]) for handler in handlers] == [["A"], ["B"]]
        assert "helpers" not in sys.modules and not any("kinference-mar-" in entry for entry in sys.path)
    finally:
        for handler in handlers:
            handler.close()
