"""kinference bench gpu's parts that need no broker: the contenders and their flags, the models from a config,
the plain-model ceiling, NVML's busy fraction (a fake NVML), the drain's figures and the tables."""

from __future__ import annotations

import http.server
import sys
import threading
import time
import types

import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertConfig

from kinference.loadgen.bench import ceiling, gpu, gpu_busy, model_dirs

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


def options(argv: list[str]) -> gpu.GpuBenchOptions:
    return gpu.options_from(gpu.build_parser().parse_args(argv), argv)


def test_the_contenders_are_the_defaults_then_each_worker_count_then_the_named_ones(monkeypatch):
    monkeypatch.setattr(gpu.os, "cpu_count", lambda: 4)
    chosen = options(["--contender", "fp16-w4=--workers 4 --handler-options dtype=float16"]).contenders
    assert [(c.name, c.flags) for c in chosen] == [
        ("defaults", ()),
        ("workers=1", ("--workers", "1", "--max-batch-size", "256")),
        ("workers=2", ("--workers", "2", "--max-batch-size", "256")),
        ("workers=4", ("--workers", "4", "--max-batch-size", "256")),  # 8 is more than the 4 cores
        ("fp16-w4", ("--workers", "4", "--handler-options", "dtype=float16")),
    ]
    named = options(["--workers", "8", "--worker-flags", ""]).contenders
    assert [(c.name, c.flags) for c in named] == [("defaults", ()), ("workers=8", ("--workers", "8"))]


@pytest.mark.parametrize("argv, message", [
    (["--contender", "--workers 2"], "NAME=FLAGS"),
    (["--contender", "x=--model /elsewhere"], "--model: the bench sets"),
    (["--worker-flags=--metrics-port=9"], "--metrics-port: the bench sets"),
    (["--contender", "defaults=--workers 2"], "contender names must differ"),
    (["--reference", "relay,nope"], "unknown reference contender(s) nope"),
    (["--drain-seconds", "0"], "--drain-seconds"),
])
def test_a_contender_or_setting_the_bench_cannot_run_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu.parse_options(gpu.build_parser(), argv, lambda args: gpu.options_from(args, argv))
    assert message in capsys.readouterr().err


def test_reference_none_drains_no_reference():
    assert options(["--reference", "none"]).reference == ()


def test_a_directory_with_only_a_config_gets_seeded_random_weights_and_the_bundled_tokenizer(tmp_path):
    BertConfig(**TINY).save_pretrained(tmp_path / "tiny")
    (first,) = model_dirs.prepare_models([str(tmp_path / "tiny")], tmp_path / "a", random_init=False)
    (again,) = model_dirs.prepare_models([str(tmp_path / "tiny")], tmp_path / "b", random_init=False)
    assert first.name == "tiny" and first.source == str(tmp_path / "tiny") and first.random_init
    assert first.directory == tmp_path / "a" / "tiny"
    weights = [AutoModel.from_pretrained(model.directory).embeddings.word_embeddings.weight for model in (first, again)]
    assert torch.equal(*weights)
    tokenizer = AutoTokenizer.from_pretrained(first.directory)
    assert tokenizer.is_fast and len(tokenizer) == 30522  # the bundled MiniLM WordPiece
    assert first.parameters == AutoModel.from_pretrained(first.directory).num_parameters()


def test_random_init_replaces_the_weights_of_a_complete_directory(tmp_path):
    (bundled,) = model_dirs.prepare_models(["minilm-l6"], tmp_path / "a", random_init=False)
    assert not bundled.random_init and bundled.parameters > 20e6  # used where it lies, with its weights
    (random,) = model_dirs.prepare_models(["minilm-l6"], tmp_path / "b", random_init=True)
    assert random.random_init and random.directory == tmp_path / "b" / "minilm-l6"
    original, replaced = (AutoModel.from_pretrained(m.directory).encoder.layer[0].output.dense.weight
                          for m in (bundled, random))
    assert original.shape == replaced.shape and not torch.equal(original, replaced)


def test_a_model_the_bench_cannot_build_is_named(tmp_path):
    with pytest.raises(ValueError, match="not a preset"):
        model_dirs.prepare_models([str(tmp_path)], tmp_path / "out", random_init=False)
    BertConfig(vocab_size=100, **TINY).save_pretrained(tmp_path / "small-vocab")
    with pytest.raises(ValueError, match="vocabulary"):
        model_dirs.prepare_models([str(tmp_path / "small-vocab")], tmp_path / "out", random_init=False)
    (tmp_path / "x" / "tiny").mkdir(parents=True)
    with pytest.raises(ValueError, match="same name"):
        model_dirs.prepare_models([str(tmp_path / "x" / "tiny"), str(tmp_path / "tiny")], tmp_path / "o", False)


def test_the_plain_model_ceiling_counts_the_rows_it_ran_in_turn_after_one_untimed_call(monkeypatch):
    torch.manual_seed(0)
    model = AutoModel.from_config(BertConfig(vocab_size=50, **TINY)).eval()
    batches = [{"input_ids": torch.randint(0, 50, (rows, 7)), "attention_mask": torch.ones(rows, 7, dtype=torch.long)}
               for rows in (3, 5)]
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(len(output.last_hidden_state)))
    clock = iter(0.1 * tick for tick in range(100))  # each reading of the clock 0.1 s after the last
    monkeypatch.setattr(ceiling.time, "monotonic", lambda: next(clock))
    rate = ceiling.measure_plain_model(model, batches, seconds=0.25)
    # Started at 0.0; batches of 3, 5 and 3 rows (read at 0.1, 0.2, 0.3: past 0.25); stopped at 0.4.
    assert calls == [3, 3, 5, 3] and rate == round(11 / 0.4, 1)


class FakeNvml(types.ModuleType):
    """pynvml's calls the sampler makes: utilisation 40% then 60%, over and over."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.readings = iter([40, 60] * 1000)
        self.handles: list[int] = []
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.handles.append(index)
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=next(self.readings), memory=0)


def test_the_busy_fraction_is_the_mean_of_nvml_samples_of_the_devices_gpu(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    with gpu_busy.BusySampler("cuda:1", interval_s=0.01) as busy:
        deadline = time.monotonic() + 10
        while len(busy._samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert fake.handles == [1] and fake.shut  # torch's cuda:1 is NVML's GPU 1 here
    samples = busy._samples
    assert busy.fraction() == round(sum(samples) / len(samples) / 100, 3) and 0.4 <= busy.fraction() <= 0.6


def test_no_busy_fraction_on_a_cpu_or_without_the_nvml_binding(monkeypatch):
    with gpu_busy.BusySampler("cpu") as busy:
        pass
    assert busy.fraction() is None and busy.note == "no GPU: cpu"
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with gpu_busy.BusySampler("cuda") as busy:
        pass
    assert busy.fraction() is None and "nvidia-ml-py" in busy.note


def test_nvml_counts_every_gpu_and_torch_only_the_visible_ones(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [gpu_busy.nvml_index(d) for d in ("cuda", "cuda:0", "cuda:2")] == [0, 0, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert gpu_busy.nvml_index("cuda") == 5


def test_a_drain_cut_at_its_time_limit_reports_what_was_answered_by_then():
    row = gpu.drain_row(gpu.ServeContender("workers=2", ("--workers", "2")), requests=10_000, answered=4_000,
                        seconds=2.0, cpu_s=3.0)
    assert row["msgs_per_s"] == 2000 and row["cpu_cores"] == 1.5 and row["cpu_us_per_msg"] == 750
    assert not row["complete"]
    none = gpu.drain_row(gpu.ServeContender("defaults"), requests=10, answered=0, seconds=1.0, cpu_s=0.5)
    assert none["msgs_per_s"] == 0 and none["cpu_us_per_msg"] is None


def test_the_tables_set_each_drain_beside_its_models_best_ceiling_and_the_relays_cpu():
    drains = [{**gpu.drain_row(gpu.ServeContender("defaults"), 1000, 1000, 1.0, 0.5), "gpu_busy": None},
              {**gpu.drain_row(gpu.ServeContender("workers=2", ("--workers", "2")), 4000, 1500, 1.0, 1.5),
               "gpu_busy": 0.42}]
    report = {"machine": {"gpu": None, "device": "cpu"},
              "settings": {"drain_s": 20.0, "contenders": [{"name": "defaults", "flags": []},
                                                           {"name": "workers=2", "flags": ["--workers", "2"]}]},
              "reference": [{"contender": "relay", "requests": 5000, "msgs_per_s": 20000.0, "cpu_us_per_msg": 50.0}],
              "models": [{"model": "tiny", "device": "cpu",
                          "plain_ceilings": [{"dtype": "float32", "batch_size": 256, "items_per_s": 2000.0,
                                              "gpu_busy": None}],
                          "handler_ceilings": [{"dtype": "float32", "batch_size": 32, "items_per_s": 1500.0,
                                                "gpu_busy": None}],
                          "drains": drains}]}
    ceilings, contenders, served, reference = gpu.tables(report)
    assert ceilings[2] == [["tiny", "plain model, float32, batch 256", "2,000", ""],
                           ["tiny", "handler in-process, float32, batch 32", "1,500", ""]]
    assert contenders[2] == [["defaults", "(none: the defaults)"], ["workers=2", "--workers 2"]]
    assert served[2] == [["tiny", "defaults", "1,000", "1,000", "0.50", "", "0.50", "500", "10.0"],
                         ["tiny", "workers=2", "1,500 of 4,000", "1,500", "0.75", "42%", "1.50", "1,000", "20.0"]]
    assert reference[2] == [["relay", "5,000", "20,000", "50.0"]]


def test_the_replies_of_a_serve_are_read_from_its_metrics_every_status_summed():
    text = (b"# TYPE kinference_replies counter\n"
            b'kinference_replies_total{status="ok"} 40.0\nkinference_replies_total{status="error"} 2.0\n'
            b"# TYPE kinference_commits counter\nkinference_commits_total 7.0\n")

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert gpu.replies(f"http://127.0.0.1:{server.server_address[1]}/metrics") == 42
    finally:
        server.shutdown()
        server.server_close()
