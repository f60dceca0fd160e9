"""The device process's parts in one test process: the shared arena, the server that merges the micro-batches of
several worker threads into one device batch, and the link that survives a restart of the server."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kinference.consumer.accelerator.arena import Arena, ArenaFull
from kinference.consumer.accelerator.calibration import Calibration, calibrate, worker_cap
from kinference.consumer.accelerator.device_server import DeviceBatching, DeviceMetrics, DeviceServer
from kinference.consumer.accelerator.worker_link import DeviceError, DeviceLink, DeviceUnavailable
from kinference.handlers import Handler, HandlerContext
from kinference.handlers.classification import TextClassificationHandler
from kinference.handlers.text import TextBatch
from tests.fakes import wait_for
from tests.models import build_tiny_classifier, varied_texts


def test_the_arena_carries_tensors_and_arrays_in_place_and_the_rest_pickled() -> None:
    arena = Arena(1 << 20)
    try:
        ids = torch.arange(12, dtype=torch.int64).reshape(3, 4)
        value = {"ids": ids, "mask": np.ones((3, 4), dtype=np.int8), "empty": torch.empty(0, 5), "rows": 3,
                 "name": "x", "batch": TextBatch({"input_ids": ids[:, :2]}, real_rows=3, real_tokens=6)}
        meta = arena.write_inputs(value)
        assert len(meta) < 1000  # the tensors are not in the message
        read = arena.read_inputs(meta)
        assert torch.equal(read["ids"], ids) and read["mask"].tolist() == [[1] * 4] * 3
        assert read["empty"].shape == (0, 5) and read["rows"] == 3 and read["name"] == "x"
        assert torch.equal(read["batch"].tensors["input_ids"], ids[:, :2]) and read["batch"].real_rows == 3
        # The device side reads in place: a view of the arena, not a copy.
        ids.add_(100)
        arena.write_inputs({"ids": ids})
        assert read["ids"][0, 0].item() == 100
        # Outputs go to the other half and are copied out: the next call cannot change them.
        outputs = arena.read_outputs(arena.write_outputs(torch.ones(3, 2)))
        arena.write_outputs(torch.zeros(3, 2))
        assert outputs.sum().item() == 6
    finally:
        arena.close()


def test_the_arena_carries_every_dtype_and_its_pickle_reads_only_through_the_arena() -> None:
    arena = Arena(1 << 20)
    try:
        value = {"half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "flags": torch.tensor([True, False]),
                 "strided": torch.arange(12).reshape(3, 4)[:, 1], "array": np.arange(6, dtype=np.float16)[::2]}
        meta = arena.write_inputs(value)
        read = arena.read_outputs(arena.write_outputs(value))
        for name in ("half", "flags", "strided"):
            assert read[name].dtype == value[name].dtype and torch.equal(read[name], value[name])
        assert read["array"].tolist() == [0.0, 2.0, 4.0]
        with pytest.raises(pickle.UnpicklingError, match="read by Arena"):
            pickle.loads(meta)  # the tensors are not in it: only the arena's reader resolves them
    finally:
        arena.close()


def test_a_micro_batch_larger_than_the_arena_fails_saying_what_to_raise() -> None:
    arena = Arena(4096)
    try:
        with pytest.raises(ArenaFull, match="--device-arena-mb"):
            arena.write_inputs(torch.zeros(1024, dtype=torch.int64))
    finally:
        arena.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("tiny"))


def _handler(model: Path, role: str, **options: Any) -> TextClassificationHandler:
    handler = TextClassificationHandler()
    handler.setup(HandlerContext(device="cpu", model=model, options=options, max_batch_size=64, role=role))
    return handler


def test_one_micro_batch_already_of_the_device_shape_is_its_batch_as_it_is(tiny: Path) -> None:
    host, device = _handler(tiny, "host"), _handler(tiny, "device")
    batch = host.preprocess(host.validate_many([{"text": text} for text in varied_texts(5, max_words=20)]))
    merged = device.merge([batch])
    assert merged.real_rows == 5 and merged.tensors.keys() == batch.tensors.keys()
    assert all(merged.tensors[name].data_ptr() == tensor.data_ptr() for name, tensor in batch.tensors.items())
    # Shape buckets pad it to a bucket: then it is copied into the larger batch, its rows first.
    bucketed = _handler(tiny, "device", shape_buckets=True).merge([batch])
    ids, length = bucketed.tensors["input_ids"], batch.tensors["input_ids"].shape[1]
    assert ids.shape[0] > 5 and torch.equal(ids[:5, :length], batch.tensors["input_ids"])


def test_the_host_side_loads_no_weights_and_the_merged_batch_gives_the_in_process_results(tiny: Path) -> None:
    host, whole = _handler(tiny, "host"), _handler(tiny, "process")
    device = _handler(tiny, "device", shape_buckets=True)
    assert not hasattr(host, "model") and hasattr(device, "model")
    texts = varied_texts(10, max_words=30)
    parts = [texts[:3], texts[3:4], texts[4:]]
    batches = [host.preprocess(host.validate_many([{"text": text} for text in part])) for part in parts]
    merged = device.merge(batches)
    # Bucketed on the device side: padding rows and columns beyond the items, never in the results.
    assert merged.real_rows == 10 and merged.tensors["input_ids"].shape[0] == 16
    assert merged.tensors["input_ids"].shape[1] >= max(batch.tensors["input_ids"].shape[1] for batch in batches)
    outputs = device.inference(merged)
    expected = whole.inference(whole.preprocess(whole.validate_many([{"text": text} for text in texts])))
    assert outputs.shape == expected.shape
    torch.testing.assert_close(outputs, expected, atol=1e-5, rtol=1e-4)


class _Recorder(Handler):
    """Doubles each row; remembers the row count of every device batch; fails a batch holding -1."""

    device_process = True

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[int] = []
        self.gate = gate
        self.entered = threading.Event()

    def merge(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(inputs)

    def inference(self, inputs: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        if (inputs == -1).any():
            raise ValueError("a poison row")
        self.batches.append(len(inputs))
        return inputs * 2


def _server(tmp_path: Path, handler: Handler, max_rows: int = 64) -> DeviceServer:
    return DeviceServer({"m": handler}, tmp_path / "device.sock", DeviceBatching(max_rows),
                        DeviceMetrics(0, CollectorRegistry())).start()


def _queued_behind_one(server: DeviceServer, handler: _Recorder, calls: list[threading.Thread]) -> None:
    """The first call holds the device (in the handler, behind its gate) while the others queue up; then the gate
    opens and every call ends."""
    assert handler.gate is not None
    calls[0].start()
    assert handler.entered.wait(10)
    for call in calls[1:]:
        call.start()
    assert wait_for(lambda: server.waiting == len(calls) - 1, timeout_s=10)
    handler.gate.set()
    for call in calls:
        call.join(10)


def test_micro_batches_of_several_threads_run_as_one_device_batch_and_come_back_to_their_own(tmp_path: Path) -> None:
    gate = threading.Event()
    handler = _Recorder(gate)
    server = _server(tmp_path, handler)
    link = DeviceLink(server.path, 1 << 20, wait_s=10)
    results: dict[int, torch.Tensor] = {}

    def call(index: int) -> None:
        results[index] = link.infer("m", torch.full((4, 3), float(index)))

    try:
        link.wait_ready()
        # The four calls that queue behind the first are merged into one batch.
        _queued_behind_one(server, handler, [threading.Thread(target=call, args=(index,)) for index in range(5)])
        assert {index: result.tolist() for index, result in results.items()} == {
            index: [[2.0 * index] * 3] * 4 for index in range(5)}
        assert handler.batches == [4, 16]
    finally:
        link.close()
        server.stop(5)


def test_a_failing_micro_batch_fails_alone_in_a_merged_batch(tmp_path: Path) -> None:
    gate = threading.Event()
    handler = _Recorder(gate)
    server = _server(tmp_path, handler)
    link = DeviceLink(server.path, 1 << 20, wait_s=10)
    outcomes: dict[int, Any] = {}

    def call(index: int) -> None:
        try:
            outcomes[index] = link.infer("m", torch.full((2, 1), -1.0 if index == 2 else float(index)))
        except DeviceError as exc:
            outcomes[index] = exc

    try:
        _queued_behind_one(server, handler, [threading.Thread(target=call, args=(index,)) for index in range(4)])
        assert handler.batches == [2, 2, 2]  # the merged batch of 1, 2 and 3 failed: each ran again alone
        assert isinstance(outcomes[2], DeviceError) and "a poison row" in str(outcomes[2])
        assert all(outcomes[index].tolist() == [[2.0 * index]] * 2 for index in (0, 1, 3))
    finally:
        link.close()
        server.stop(5)


def test_a_call_is_sent_again_to_a_restarted_device_process_and_fails_only_after_the_wait(tmp_path: Path) -> None:
    handler = _Recorder()
    server = _server(tmp_path, handler)
    link = DeviceLink(server.path, 1 << 20, wait_s=10)
    try:
        assert link.infer("m", torch.ones(1, 1)).item() == 2
        server.stop(5)  # the device process dies: the call below waits for the next one
        answer: list[Any] = []
        caller = threading.Thread(target=lambda: answer.append(link.infer("m", torch.full((1, 1), 5.0))))
        caller.start()
        time.sleep(0.5)
        assert not answer
        server = _server(tmp_path, handler)
        caller.join(10)
        assert answer and answer[0].item() == 10
    finally:
        link.close()
        server.stop(5)
    impatient = DeviceLink(tmp_path / "nobody.sock", 1 << 20, wait_s=0.3)
    with pytest.raises(DeviceUnavailable, match=r"did not answer for 0\.3 s"):
        impatient.infer("m", torch.ones(1, 1))
    impatient.close()


def test_calibration_picks_the_knee_of_the_device_curve_and_sizes_workers(tiny: Path, tmp_path: Path) -> None:
    handler = _handler(tiny, "device", shape_buckets=True)
    result = calibrate(handler, max_rows=16)
    assert result is not None
    sizes, rates = list(result.curve), list(result.curve.values())
    assert sizes == [1, 2, 4, 8, 16][: len(sizes)]
    if len(sizes) < 5:  # it stopped early: the last two doublings gained less than a tenth
        assert rates[-1] < rates[-3] / 0.9 and rates[-2] < rates[-3] / 0.9
    best = max(rates)
    assert result.curve[result.batch_size] >= 0.9 * best
    assert all(rate < 0.9 * best for size, rate in result.curve.items() if size < result.batch_size)
    assert result.workers >= 1 and result.host_us_per_item > 35
    result.write(tmp_path / "calibration.json")
    assert Calibration.read(tmp_path / "calibration.json") == result
    assert "device batch size" in result.line()
    assert worker_cap(devices=1, cores=16) == 14 and worker_cap(devices=1, cores=2) == 1


def test_dtype_auto_keeps_float32_on_the_cpu_and_takes_half_precision_where_it_agrees(tiny: Path) -> None:
    handler = _handler(tiny, "process")
    assert handler.dtype == torch.float32
    # What dtype=auto does on CUDA at setup, run here on the CPU: float16 weights, since the tiny model's results
    # in float16 agree with float32 on the warm-up batch. (Setup on a CUDA device is the GPU's to run.)
    reduced, dtype = handler._reduced_precision(handler.model)
    assert dtype == torch.float16 and next(reduced.parameters()).dtype == torch.float16
    assert next(handler.model.parameters()).dtype == torch.float32  # a copy: the float32 model is left alone


def test_each_gpu_gets_its_own_device_process_and_a_named_device_is_kept() -> None:
    from kinference.consumer.accelerator.device_process import torch_device

    assert [torch_device("cuda", index) for index in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert torch_device("cuda:1", 0) == "cuda:1" and torch_device("cpu", 0) == "cpu"


def test_the_plan_puts_a_device_process_where_asked_and_sizes_workers_only_with_one() -> None:
    from kinference.consumer.config import ServiceConfig
    from kinference.consumer.ops.cli import Plan, plan_processes
    from kinference.errors import KinferenceError

    # On this CPU-only machine: auto means no device process, and one worker (one process, no supervisor).
    assert plan_processes(ServiceConfig(handler="sim")) == Plan(devices=0, workers=1)
    assert plan_processes(ServiceConfig(handler="sim", workers=3)) == Plan(devices=0, workers=3)
    assert plan_processes(ServiceConfig(handler="sim", device_process="on")) == Plan(devices=1, workers=None)
    assert plan_processes(ServiceConfig(handler="sim", device_process="on", workers=2)) == Plan(devices=1, workers=2)
    assert plan_processes(ServiceConfig(handler="echo")) == Plan(devices=0, workers=1)
    with pytest.raises(KinferenceError, match="no model's handler can run in a device process"):
        plan_processes(ServiceConfig(handler="echo", device_process="on"))


class _Texts(Handler):
    """An item is a list of texts, each a row (as an embeddings request with an ``input`` list); a row's output is its
    text and the device batch's size."""

    device_process = True

    def preprocess(self, items: list[Any]) -> list[str]:
        return [text for item in items for text in item]

    def merge(self, inputs: list[list[str]]) -> list[str]:
        return [text for batch in inputs for text in batch]

    def inference(self, inputs: list[str]) -> list[tuple[str, int]]:
        time.sleep(0.2)  # long enough for the other calls to queue behind the first
        return [(text, len(inputs)) for text in inputs]


def test_rows_are_counted_as_the_handler_makes_them_and_a_merged_batch_splits_by_them(tmp_path: Path) -> None:
    handler = _Texts()
    server = _server(tmp_path, handler)
    link = DeviceLink(server.path, 1 << 20, wait_s=10)
    items = {index: [[f"{index}.{item}.{text}" for text in range(index + 1)] for item in range(2)]
             for index in range(4)}
    results: dict[int, Any] = {}

    def call(index: int) -> None:
        results[index] = link.infer("m", handler.preprocess(items[index]))

    try:
        threads = [threading.Thread(target=call, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert {index: [text for text, _ in rows] for index, rows in results.items()} == {
            index: handler.preprocess(items[index]) for index in range(4)}
        assert max(size for rows in results.values() for _, size in rows) > 8  # some were merged
    finally:
        link.close()
        server.stop(5)


class _Bulky(Handler):
    """Each row's output is a string of ``size`` characters: plain data, in the message, not the arena's tensors."""

    device_process = True

    def merge(self, inputs: list[list[int]]) -> list[int]:
        return [size for batch in inputs for size in batch]

    def inference(self, inputs: list[int]) -> list[str]:
        return ["x" * size for size in inputs]


def test_a_call_and_a_reply_of_megabytes_cross_as_small_ones_do(tmp_path: Path) -> None:
    server = _server(tmp_path, _Bulky())
    link = DeviceLink(server.path, 1 << 20, wait_s=10)
    try:
        assert link.infer("m", [4 << 20]) == ["x" * (4 << 20)]  # a 4 MiB reply
        assert link.infer("m", [1] * 300_000) == ["x"] * 300_000  # a call of over a megabyte
    finally:
        link.close()
        server.stop(5)


def test_a_hung_device_batch_is_answered_device_hung_and_reported_while_other_batches_run(tmp_path: Path) -> None:
    from kinference.consumer.accelerator.worker_link import DeviceHung
    from kinference.protocol import ErrorCode

    gate = threading.Event()
    handler = _Recorder(gate)
    server = DeviceServer({"m": handler}, tmp_path / "device.sock", DeviceBatching(64, threads=2, hang_s=0.5),
                          DeviceMetrics(0, CollectorRegistry())).start()
    link = DeviceLink(server.path, 1 << 20, wait_s=10)
    try:
        started = time.monotonic()
        with pytest.raises(DeviceHung, match=r"past --device-hang-s \(0\.5 s\)") as hung:
            link.infer("m", torch.ones(2, 1))
        assert hung.value.code == ErrorCode.DEVICE_HUNG and 0.5 <= time.monotonic() - started < 3
        # Reported hung once its calls are answered (the supervisor kills it on seeing that).
        assert wait_for(lambda: server.hung is not None, timeout_s=5) and server.stalled_s() >= 0.5
        handler.gate = None  # the other slot still serves
        assert link.infer("m", torch.ones(1, 1)).item() == 2
    finally:
        gate.set()
        link.close()
        server.stop(5)


def test_a_stopping_device_process_serves_on_until_its_workers_have_gone(tmp_path: Path) -> None:
    server = _server(tmp_path, _Recorder())
    link = DeviceLink(server.path, 1 << 20, wait_s=10)
    try:
        link.wait_ready()
        assert not server.drain(0.3)
        assert link.infer("m", torch.ones(1, 1)).item() == 2  # still served meanwhile
        threading.Timer(0.3, link.close).start()
        assert server.drain(10)
    finally:
        server.stop(5)


def test_a_message_of_the_wrong_shape_is_refused_by_name(tmp_path: Path) -> None:
    import socket

    from kinference.consumer.accelerator import wire

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        wire.send(left, wire.Infer("m", b"x" * (3 * wire.FRAGMENT_BYTES)))  # several packets
        received = wire.receive_to_device(right)
        assert received == (wire.Infer("m", b"x" * (3 * wire.FRAGMENT_BYTES)), [])
        wire.send(left, wire.Ready())  # a worker's message, sent to a worker's side
        with pytest.raises(wire.WireError, match="wrong shape"):
            wire.receive_to_device(right)
    finally:
        left.close()
        right.close()


def test_the_device_side_imports_neither_the_worker_side_nor_the_path() -> None:
    import ast

    import kinference.consumer.accelerator as accelerator

    folder = Path(accelerator.__file__).parent
    for module in ("device_server", "device_engine", "device_process", "wire", "arena", "calibration"):
        tree = ast.parse((folder / f"{module}.py").read_text())
        imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not {name for name in imported if ".worker_" in name or name.startswith("kinference.consumer.path")}, (
            module, imported)


def test_the_hang_limit_is_ten_slowest_calibrated_batches_at_least_30_s_an_engine_60_s_unless_set() -> None:
    from kinference.consumer.config import hang_limit

    slow = Calibration(64, 16.0, 100.0, 1, {16: 8.0, 32: 12.0, 64: 16.0})  # the 64-item batch takes 4 s
    assert slow.slowest_batch_s() == 4.0 and hang_limit("auto", slow.slowest_batch_s()) == 40.0
    fast = Calibration(64, 40_000.0, 100.0, 1, {64: 40_000.0})
    assert hang_limit("auto", fast.slowest_batch_s()) == 30.0
    assert hang_limit("auto", Calibration(256, 0.0, 0.0, 1, {}).slowest_batch_s()) == 30.0  # nothing measured
    assert hang_limit("auto") == 60.0  # a generative engine: no calibration
    assert hang_limit(3.0, slow.slowest_batch_s()) == 3.0 and hang_limit(3.0) == 3.0
