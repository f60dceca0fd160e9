"""deploy/docker-compose.yml run for real with Compose v2: up, 100 requests answered through the stack, Prometheus
scraping kinference, down leaving nothing behind.

The public images cannot be pulled here, so tests/docker/compose.override.yml swaps in local ones built from the same
software, with host networking. Grafana's image cannot be had at all: its data source, dashboard provider and
every panel's query are checked instead against the running stack (the metrics in kinference's real /metrics, the
queries accepted and answered by the real Prometheus).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kinference.consumer.brokers.broker import free_port
from tests.docker import images
from tests.docker.conftest import wait_healthy

# The images are built in the first test's fixtures when they are not there yet (minutes: images.py).
pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

DEPLOY = images.ROOT / "deploy"
OVERRIDE = Path(__file__).with_name("compose.override.yml")
REQUESTS = 100


@dataclass
class Stack:
    project: str
    environment: dict[str, str]
    metrics_port: int
    prometheus_port: int

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        command = ["docker", "compose", "--project-name", self.project, "--file", str(DEPLOY / "docker-compose.yml"),
                   "--file", str(OVERRIDE), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=self.environment)

    def must(self, *args: str, timeout: float = 600) -> str:
        done = self.compose(*args, timeout=timeout)
        assert done.returncode == 0, f"docker compose {' '.join(args)}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done.stdout

    def leftovers(self) -> dict[str, list[str]]:
        """The project's containers, volumes and networks that Docker still has."""
        found = {}
        for kind in ("container", "volume", "network"):
            listed = subprocess.run(["docker", kind, "ls", *(["--all"] if kind == "container" else []), "--quiet",
                                     "--filter", f"label=com.docker.compose.project={self.project}"],
                                    capture_output=True, text=True, timeout=60, check=True).stdout.split()
            if listed:
                found[kind] = listed
        return found


class ComposeLoader(yaml.SafeLoader):
    """YAML with compose's merge tags (``!reset``): read as the value they carry."""


ComposeLoader.add_constructor("!reset", lambda loader, node: loader.construct_sequence(node))


def compose_yaml() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def host_prometheus_config(metrics_port: int) -> dict:
    """deploy/prometheus/prometheus.yml with the kinference job's DNS discovery written out as its one target on
    127.0.0.1 (compose's DNS needs compose's network); the rest as it is."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (discovery,) = job.pop("dns_sd_configs")
    assert "kinference" in discovery["names"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    return config


@pytest.fixture
def stack(kinference_image, kafka_image, prometheus_image, kafka_jars, tmp_path) -> Iterator[Stack]:
    problem = images.compose_problem()
    if problem:
        pytest.skip(problem)
    ports = {name: free_port() for name in ("KAFKA_PORT", "CONTROLLER_PORT", "METRICS_PORT", "PROMETHEUS_PORT")}
    prometheus_config = tmp_path / "prometheus.yml"
    prometheus_config.write_text(yaml.safe_dump(host_prometheus_config(ports["METRICS_PORT"])))
    environment = {**os.environ, **{name: str(port) for name, port in ports.items()},
                   "KINFERENCE_IMAGE": kinference_image, "KAFKA_IMAGE": kafka_image,
                   "PROMETHEUS_IMAGE": prometheus_image, "PROMETHEUS_CONFIG": str(prometheus_config)}
    stack = Stack(f"kinference-test-{uuid.uuid4().hex[:8]}", environment, ports["METRICS_PORT"],
                  ports["PROMETHEUS_PORT"])
    models = DEPLOY / "models"
    models_existed = models.exists()
    try:
        yield stack
    finally:
        logs = stack.compose("logs", "--no-color", "--tail", "40", timeout=120)  # shown when the test fails
        print(logs.stdout[-12000:], logs.stderr[-2000:])
        down = stack.compose("--profile", "load", "down", "--volumes", "--remove-orphans", "--timeout", "45")
        print(down.stdout[-2000:], down.stderr[-2000:])
        if not models_existed and models.is_dir() and not any(models.iterdir()):
            models.rmdir()  # the bind mount's source, which Docker made


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def prometheus_query(stack: Stack, query: str) -> dict:
    url = f"http://127.0.0.1:{stack.prometheus_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        answer = json.loads(get(url))
    except urllib.error.HTTPError as exc:
        answer = json.loads(exc.read())
    assert answer["status"] == "success", f"Prometheus rejects {query!r}: {answer}"
    return answer["data"]


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(2)
    return result


def test_the_override_keeps_the_stack_but_images_networks_and_ports():
    """What the stack test changes, and no more: the override's Prometheus command is compose's plus a port."""
    override = yaml.load(OVERRIDE.read_text(), Loader=ComposeLoader)["services"]
    services = compose_yaml()["services"]
    assert set(override) <= set(services) - {"grafana", "kinference-gpu"}
    command = override["prometheus"]["command"]
    assert command[:-1] == services["prometheus"]["command"] and command[-1].startswith("--web.listen-address=")


def test_the_stack_answers_requests_and_prometheus_scrapes_kinference(stack, tmp_path):
    stack.must("config", "--quiet")
    # Dependencies first, as compose orders them: Kafka healthy, then the topics job done, then kinference.
    stack.must("up", "--detach", "--no-build", "kinference", "prometheus", timeout=900)
    wait_healthy(f"{stack.project}-kinference-1", timeout_s=420)

    out = tmp_path / "loadgen"
    out.mkdir(mode=0o777)
    out.chmod(0o777)  # the image's user 10001 writes the report
    stack.must("--profile", "load", "run", "--rm", "--no-deps", "--volume", f"{out}:/out", "loadgen",
               "--requests", str(REQUESTS), "--concurrency", "4", "--warmup", "0", "--timeout", "30",
               "--no-progress", "--out", "/out/report.json", timeout=600)
    report = json.loads((out / "report.json").read_text())
    assert (report["sent"], report["ok"], report["lost"], report["errors"]) == (REQUESTS, REQUESTS, 0, {})

    targets = wait_for(lambda: [target for target in json.loads(get(
        f"http://127.0.0.1:{stack.prometheus_port}/api/v1/targets"))["data"]["activeTargets"]
        if target["labels"]["job"] == "kinference" and target["health"] == "up"], 60, "kinference's target up")
    assert targets[0]["scrapeUrl"] == f"http://127.0.0.1:{stack.metrics_port}/metrics"
    def counted() -> float:
        samples = prometheus_query(stack, 'kinference_requests_total{outcome="ok"}')["result"]
        return sum(float(sample["value"][1]) for sample in samples)

    wait_for(lambda: counted() >= REQUESTS, 60, f"Prometheus counts {REQUESTS} ok requests")

    check_grafana_files_against_the_stack(stack)

    stack.must("--profile", "load", "down", "--volumes", "--remove-orphans", "--timeout", "45", timeout=300)
    assert stack.leftovers() == {}


GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$instance": ".*", "$model": ".*"}


def check_grafana_files_against_the_stack(stack: Stack) -> None:
    """Grafana itself cannot run here (no image): its provisioning files are checked against the compose file, and
    each panel's query against the stack: every metric it names is in kinference's /metrics, and the real Prometheus
    accepts the query."""
    grafana = DEPLOY / "grafana"
    services = compose_yaml()["services"]
    (source,) = yaml.safe_load((grafana / "provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    url = urllib.parse.urlparse(source["url"])
    assert url.hostname in services and url.port == 9090, "the data source names compose's Prometheus on its port"
    (provider,) = yaml.safe_load((grafana / "provisioning/dashboards/kinference.yaml").read_text())["providers"]
    mounts = dict(volume.split(":")[:2] for volume in services["grafana"]["volumes"])
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert mounts["./grafana/dashboards"] == provider["options"]["path"] == str(Path(home).parent)
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    assert (grafana / "dashboards" / Path(home).name).exists()

    exposed = exposed_names(get(f"http://127.0.0.1:{stack.metrics_port}/metrics").decode())
    dashboard = json.loads((grafana / "dashboards" / "kinference.json").read_text())
    panels = [nested for panel in dashboard["panels"] for nested in (panel, *panel.get("panels", []))]
    queries = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    variables = [variable["query"]["query"] for variable in dashboard["templating"]["list"]]
    assert queries and variables
    for query in [*queries, *variables]:
        named = set(re.findall(r"\b(?:kinference|process)_[a-z_]+\b", query))
        assert named and named <= exposed, f"{query}: not in kinference's /metrics: {sorted(named - exposed)}"
    for query in queries:
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        prometheus_query(stack, query)


def exposed_names(metrics: str) -> set[str]:
    """Every sample name of a /metrics page, and those its histograms and counters show once they have samples."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "summary": ("_sum", "_count")}
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", metrics, re.M))
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", metrics, re.M):
        names.add(name)
        names.update(name.removesuffix("_total") + suffix for suffix in suffixes.get(kind, ()))
    return names
