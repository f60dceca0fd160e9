"""The dashboard's and the autoscaler's PromQL, run by a real Prometheus against running services.

Prometheus (Debian's ``prometheus`` package; .ci/run installs it) runs on loopback with a 1 s scrape
interval and scrapes two services: ``echo`` answering a few hundred requests and some malformed ones
(error outcomes and dead letters), and ``text-classification`` with a tiny local model (only text
handlers report the padding metrics). Then every expression of deploy/grafana/dashboards/kinference.json,
the dashboard's variable and the prometheus-adapter rule behind the HPA must parse and return a finite
value in the window of the run, and every alert rule of deploy/prometheus/alerts.yml must evaluate without
error on the services' real series (the error-ratio alert goes pending: 14% of the echo requests are
malformed). Without a ``prometheus`` binary on PATH the tests skip.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from kinference.consumer.service import Service
from tests.integration.kafka_io import produce, read, service_config
from tests.models import build_tiny_classifier

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.model]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kinference.json"
ADAPTER = DEPLOY / "k8s" / "autoscaling" / "prometheus-adapter-values.yaml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
HPA = DEPLOY / "k8s" / "autoscaling" / "hpa.yaml"
PROMETHEUS = shutil.which("prometheus")
NO_PROMETHEUS = "needs the `prometheus` binary on PATH (Debian: apt-get install prometheus; .ci/run tries)"
SCRAPE_S = 1
# Grafana's $__rate_interval is max(4 x scrape interval, ...): 4 s here; a little more rides out jitter.
RATE_INTERVAL = "5s"
NAMESPACE = "kinference"  # what Kubernetes service discovery would add, for the adapter rule
# The only series no run of this test can produce: the broker never refuses a reply here.
MAY_BE_ABSENT = ("kinference_delivery_failures_total",)
FALLBACK = " or on() vector(0)"
WORDS = ("kafka", "stream", "inference", "batch", "latency")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrometheusServer:
    """A Prometheus process that this object started and alone stops (by PID)."""

    def __init__(self, config: dict[str, Any], workdir: Path, ready_timeout_s: float = 30.0) -> None:
        self.port = free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.log_file = workdir / "prometheus.log"
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config_file}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready within {self.ready_timeout_s} s: {self.log()}")

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: Any) -> dict[str, Any]:
        """GET /api/v1/PATH; returns the JSON body, errors (e.g. a PromQL parse error) included."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            return json.loads(error.read())

    def instant(self, expr: str) -> list[dict[str, Any]]:
        body = self.api("query", query=expr)
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def finite_values(self, expr: str, start: float, end: float) -> tuple[str | None, int]:
        """(error, number of finite values) of EXPR over [start, end] at the scrape resolution."""
        body = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{SCRAPE_S}s")
        if body["status"] != "success":
            return f"{body.get('errorType')}: {body.get('error')}", 0
        values = [float(v) for series in body["data"]["result"] for _, v in series["values"]]
        return None, sum(math.isfinite(v) for v in values)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


# --- what is evaluated ---------------------------------------------------------------------------------


def dashboard_queries() -> dict[str, str]:
    """Every target of every panel, Grafana variables substituted: {"panel / refId": PromQL}."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = {"__rate_interval": RATE_INTERVAL}
    # Each variable as its "All" selection, which is what the dashboard opens with.
    values.update({variable["name"]: variable["allValue"] for variable in dashboard["templating"]["list"]})
    queries = {}
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                expr = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], target["expr"])
                queries[f"{inner['title']} / {target['refId']}"] = expr
    return queries


def variable_queries() -> list[tuple[str, str]]:
    """(label, series selector) of each ``label_values(SELECTOR, LABEL)`` variable, the variables it depends on
    at their "All" selection."""
    found = []
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    everything = {variable["name"]: variable["allValue"] for variable in variables}
    for variable in variables:
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
        assert match, f"unsupported variable query {variable['definition']!r}"
        found.append((match.group(2), re.sub(r"\$(\w+)", lambda m: everything[m.group(1)], match.group(1))))
    return found


def adapter_query(request_topic: str) -> tuple[str, str]:
    """(seriesQuery, metricsQuery) of the prometheus-adapter rule, expanded as the adapter does for the
    HPA's metric: the HPA's selector plus its namespace as label matchers (its topic: this test's)."""
    (rule,) = yaml.safe_load(ADAPTER.read_text())["rules"]["external"]
    hpa = yaml.safe_load(HPA.read_text())
    (metric,) = hpa["spec"]["metrics"]
    labels = {"namespace": NAMESPACE, **metric["external"]["metric"]["selector"]["matchLabels"],
              "topic": request_topic}
    series = re.match(r"\w+", rule["seriesQuery"]).group(0)
    matchers = ",".join(f'{key}="{value}"' for key, value in labels.items())
    expr = rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
    assert "<<" not in expr, f"unexpanded template in {rule['metricsQuery']!r}"
    return rule["seriesQuery"], expr


def scrape_config(targets: list[str]) -> dict[str, Any]:
    """The compose stack's kinference job with these static targets and a 1 s interval."""
    (job,) = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    job = {key: value for key, value in job.items() if not key.endswith("_sd_configs")}
    job.update(scrape_interval=f"{SCRAPE_S}s", scrape_timeout=f"{SCRAPE_S}s",
               static_configs=[{"targets": targets, "labels": {"namespace": NAMESPACE}}])
    return {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(ALERTS)], "scrape_configs": [job]}


# --- the load ------------------------------------------------------------------------------------------


def send_rounds(bootstrap: str, echo_topic: str, text_topic: str, rounds: int = 6) -> tuple[int, int, int]:
    """Spread requests over a few seconds so that rates are non-zero in several scrape windows.
    Returns (echo records, malformed among them, text records)."""
    echo = malformed = texts = 0
    for i in range(rounds):
        records = [(None, orjson.dumps({"round": i, "i": j}), []) for j in range(50)]
        records += [(None, b"{broken", [])] * 8
        produce(bootstrap, echo_topic, records)
        # Texts of different lengths, so batches are padded.
        text_records = [(None, orjson.dumps({"text": " ".join(WORDS[: 1 + (i + j) % 5] * (1 + j))}), [])
                        for j in range(8)]
        text_records.append((None, orjson.dumps({"txt": "not the text field"}), []))  # bad_request
        produce(bootstrap, text_topic, text_records)
        echo, malformed, texts = echo + len(records), malformed + 8, texts + len(text_records)
        time.sleep(1.0)
    return echo, malformed, texts


# --- tests ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_dashboard_and_autoscaler_queries_return_data(broker, tmp_path):
    echo_topics = broker.topics(requests=3, replies=1, dead=1)
    text_topics = broker.topics(requests=2, replies=1, dead=1)
    model_dir = build_tiny_classifier(tmp_path / "tiny")
    echo_config = service_config(broker.bootstrap_servers, echo_topics, metrics_host="127.0.0.1", metrics=True,
                                 metrics_port=0, max_batch_size=16)
    text_config = service_config(broker.bootstrap_servers, text_topics, metrics_host="127.0.0.1", metrics=True,
                                 metrics_port=0, handler="text-classification", model=model_dir, max_batch_size=8)
    with Service(echo_config) as echo, Service(text_config) as text:
        assert echo.wait_ready(30) and text.wait_ready(30)
        targets = [f"127.0.0.1:{echo.endpoints.port}", f"127.0.0.1:{text.endpoints.port}"]
        with PrometheusServer(scrape_config(targets), tmp_path / "prometheus") as prometheus:
            # Both targets up and scraped a few times before the load, so rates start from a baseline.
            assert wait_for(lambda: len(prometheus.instant("count_over_time(up[1m]) >= 3 and up == 1")) == 2,
                            30), prometheus.instant("up")
            start = time.time() - 3 * SCRAPE_S
            sent, malformed, texts = send_rounds(broker.bootstrap_servers, echo_topics["requests"],
                                                 text_topics["requests"])
            assert len(read(broker.bootstrap_servers, echo_topics["replies"], sent)) == sent
            assert len(read(broker.bootstrap_servers, echo_topics["dead"], malformed)) == malformed
            assert len(read(broker.bootstrap_servers, text_topics["replies"], texts)) == texts
            # Everything answered and committed: lag series exist and are 0, seen by Prometheus too.
            assert wait_for(lambda: [s["value"][1] for s in prometheus.instant(
                f'sum by (topic) (kinference_consumer_lag{{topic="{echo_topics["requests"]}"}})')] == ["0"], 30)
            time.sleep(3 * SCRAPE_S)
            end = time.time()
            failures = check_queries(prometheus, start, end, echo_topics["requests"])
    assert not failures, "queries without data or in error:\n" + "\n".join(failures) + "\n" + prometheus.log()


def check_queries(prometheus: PrometheusServer, start: float, end: float, request_topic: str) -> list[str]:
    failures = []

    def expect_data(name: str, expr: str, may_be_absent: bool = False) -> None:
        error, finite = prometheus.finite_values(expr, start, end)
        if error or (finite == 0 and not may_be_absent):
            failures.append(f"{name}: {error or 'no finite value'}: {expr}")

    for name, expr in dashboard_queries().items():
        expect_data(name, expr)
        if FALLBACK in expr:
            # The fallback must not hide a broken query: without it, data too (unless truly absent).
            expect_data(f"{name} (without fallback)", expr.replace(FALLBACK, ""),
                        may_be_absent=any(metric in expr for metric in MAY_BE_ABSENT))
    for label, selector in variable_queries():
        values = prometheus.api(f"label/{label}/values", **{"match[]": selector})
        if values["status"] != "success" or len(values["data"]) != 2:
            failures.append(f"variable {label}: {values}")
    series_query, lag_query = adapter_query(request_topic)
    series = prometheus.api("series", **{"match[]": series_query, "start": f"{start:.3f}", "end": f"{end:.3f}"})
    if series["status"] != "success" or not series["data"]:
        failures.append(f"adapter seriesQuery: {series}")
    expect_data("adapter metricsQuery (HPA lag)", lag_query)
    failures += check_alerts(prometheus)
    return failures


def check_alerts(prometheus: PrometheusServer) -> list[str]:
    """Every alert rule evaluated without error on the real series; the error-ratio alert pending (or firing)
    on the malformed requests, and the no-replies alert quiet while replies flow."""
    body = prometheus.api("rules", type="alert")
    rules = {rule["name"]: rule for group in body["data"]["groups"] for rule in group["rules"]}
    failures = [f"alert {name}: {rule['health']} {rule.get('lastError', '')}" for name, rule in rules.items()
                if rule["health"] != "ok"]
    expected = {rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}
    if set(rules) != expected:
        failures.append(f"alert rules loaded: {sorted(rules)}; in {ALERTS.name}: {sorted(expected)}")
    if rules.get("KinferenceErrorRatioHigh", {}).get("state") not in ("pending", "firing"):
        failures.append(f"KinferenceErrorRatioHigh: {rules.get('KinferenceErrorRatioHigh')}")
    if rules.get("KinferenceNoReplies", {}).get("state") != "inactive":
        failures.append(f"KinferenceNoReplies: {rules.get('KinferenceNoReplies')}")
    return failures


@pytest.mark.skipif(shutil.which("promtool") is None, reason=NO_PROMETHEUS.replace("`prometheus`", "`promtool`"))
def test_promtool_accepts_the_compose_prometheus_config():
    result = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
