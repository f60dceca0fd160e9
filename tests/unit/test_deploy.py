"""Static checks of deploy/: the files parse, and every flag, env var, metric name and install step they
use exists in the code (checked against the real parsers and metrics), so deploy/ cannot drift from the
service unnoticed. With a working Docker engine, the last test builds the image and runs the stack."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kinference.consumer.config import ENV_PREFIX, OPTIONS, ServiceConfig, load_config
from kinference.consumer.ops.cli import build_parser
from kinference.consumer.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kinference.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
CONFIG_ENV_VARS = {ENV_PREFIX + name.upper() for name in OPTIONS}
# What Grafana defines itself, plus the dashboard's own variables (checked below).
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__all"}
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "gauge": ("",), "info": ("_info",), "summary": ("", "_sum", "_count", "_created")}


# --- readers -------------------------------------------------------------------------------------------


def interpolate(text: str) -> str:
    """Compose's variable substitution with nothing set: ``${NAME:-default}`` -> default, ``$$`` -> ``$``.
    A bare ``${NAME}`` fails: ``docker compose up`` must work without a .env file."""
    bare = re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text)
    assert not bare, f"compose variables without a default: {bare}"
    text = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", text)
    return text.replace("$$", "$")


def compose() -> dict[str, Any]:
    return yaml.safe_load(interpolate((DEPLOY / "docker-compose.yml").read_text()))


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    """Every Kubernetes object under deploy/k8s by (kind, name); the patches (``*-patch.yaml``) are left out."""
    objects = {}
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "prometheus-adapter-values.yaml") or path.name.endswith("-patch.yaml"):
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (kinference,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "kinference"]
    return kinference


def literal_env(env: list[dict[str, Any]]) -> dict[str, str]:
    return {item["name"]: str(item["value"]) for item in env if "value" in item}


def serve_config(args: list[str], environ: dict[str, str]) -> ServiceConfig:
    """What ``kinference serve ARGS`` would run with: the real parser, then the real config loader."""
    parsed = build_parser().parse_args(["serve", *args])
    return load_config({name: getattr(parsed, name) for name in OPTIONS}, parsed.config, environ)


def k8s_config(tmp_path: Path, extra_env: dict[str, str] | None = None) -> ServiceConfig:
    """The Deployment's args with --config pointing at the ConfigMap file it mounts."""
    objects = k8s_objects()
    deployment = objects[("Deployment", "kinference")]
    kinference = container(deployment)
    args = list(kinference["args"])
    config_path = Path(args[args.index("--config") + 1])
    (mount,) = [m for m in kinference["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    data = objects[("ConfigMap", volume["configMap"]["name"])]["data"][config_path.name]
    local = tmp_path / config_path.name
    local.write_text(data)
    args[args.index("--config") + 1] = str(local)
    return serve_config(args, {**literal_env(kinference.get("env", [])), **(extra_env or {})})


def topics_config(args: list[str], environ: dict[str, str]) -> ServiceConfig:
    """What ``kinference topics create ARGS`` would make topics with: the real parser and config loader."""
    parsed = build_parser().parse_args(["topics", "create", *args])
    return load_config({name: getattr(parsed, name) for name in OPTIONS}, parsed.config, environ)


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    return {key: str(value) for key, value in service["environment"].items()}


def k8s_workload_config(tmp_path: Path, workload: dict[str, Any], name: str, command: list[str]) -> ServiceConfig:
    """The config a pod of ``workload`` runs with: its args, the ConfigMap file it mounts, its literal env."""
    (pod_container,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    args = list(pod_container["args"])
    config_path = Path(args[args.index("--config") + 1])
    (mount,) = [m for m in pod_container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    data = k8s_objects()[("ConfigMap", volume["configMap"]["name"])]["data"][config_path.name]
    local = tmp_path / f"{name}-{config_path.name}"
    local.write_text(data)
    args[args.index("--config") + 1] = str(local)
    environ = literal_env(pod_container.get("env", []))
    return topics_config(args, environ) if command == ["kinference", "topics", "create"] else serve_config(
        args, environ)


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def dockerfile_args() -> dict[str, str]:
    return dict(value.split("=", 1) for op, value in dockerfile_instructions() if op == "ARG" and "=" in value)


def exposed_metric_names() -> set[str]:
    """Every sample name a service's /metrics can show, from a real ``Metrics`` registry."""
    names = set()
    for family in Metrics().registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def exposed_metric_labels() -> dict[str, set[str]]:
    """The label names of every sample name a service's /metrics shows: those declared by each metric of a
    real ``Metrics`` (a labelled metric shows no sample before its first use), and those of the samples of
    the rest of its registry (the process collector's)."""
    labels: dict[str, set[str]] = {}
    for family in Metrics().registry.collect():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    for metric in vars(Metrics()).values():
        declared = getattr(metric, "_labelnames", None)
        if declared is not None:
            for suffix in _SUFFIXES[metric._type]:
                # An info metric's labels are its values' keys (build_info's versions), seen on its sample only.
                seen = labels.get(metric._name + suffix, set()) if metric._type == "info" else set()
                labels[metric._name + suffix] = seen | set(declared) | ({"le"} if suffix == "_bucket" else set())
    return labels


def dashboard_panels() -> list[dict[str, Any]]:
    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return panels


def command_lines(text: str, program: str) -> list[list[str]]:
    """Arguments after ``kinference <program>`` on each line of the README's code blocks."""
    found = []
    for block in re.findall(r"```(?:bash)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0]
            if f"kinference {program}" in line:
                found.append(shlex.split(line.split(f"kinference {program}", 1)[1]))
    return found


# --- everything parses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_files_parse(path):
    docs = [doc for doc in yaml.safe_load_all(interpolate(path.read_text())) if doc is not None]
    assert docs and all(isinstance(doc, dict) for doc in docs)


def test_k8s_objects_are_complete_and_kustomization_lists_existing_files():
    objects = k8s_objects()
    assert {kind for kind, _ in objects} >= {"Deployment", "Service", "ConfigMap", "Job", "ScaledObject",
                                             "HorizontalPodAutoscaler"}
    assert all(doc.get("apiVersion") for doc in objects.values())
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / resource).is_file() for resource in kustomization["resources"])
    # One autoscaler at a time: neither is applied by the kustomization.
    assert not any("autoscaling" in resource for resource in kustomization["resources"])


def test_compose_stack_has_its_parts():
    services = compose()["services"]
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["kinference"]["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert services["kinference"]["build"]["dockerfile"] == "deploy/Dockerfile"
    build = services["kinference"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    (device,) = services["kinference-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert services["kinference-gpu"]["profiles"] == ["gpu"] and services["loadgen"]["profiles"] == ["load"]
    assert "profiles" not in services["kinference"]  # plain `docker compose up` serves
    # The image's health check probes `kinference serve`: the loadgen container must not inherit it.
    assert services["loadgen"]["healthcheck"] == {"disable": True}
    # The CUDA wheels bring their own CUDA libraries: the GPU image keeps the default base.
    assert "BASE_IMAGE" not in services["kinference-gpu"]["build"]["args"]
    assert "cu" in services["kinference-gpu"]["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[-1]
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            assert (DEPLOY / volume.split(":")[0]).exists(), volume


# --- flags and env vars exist --------------------------------------------------------------------------


def test_every_kinference_env_var_named_in_deploy_is_a_config_option():
    files = [*YAML_FILES, DEPLOY / "Dockerfile", DEPLOY / "README.md"]
    unknown = {(path.name, name) for path in files
               for name in re.findall(r"\bKINFERENCE_[A-Z0-9_]+\b", path.read_text()) if name not in CONFIG_ENV_VARS}
    assert not unknown, f"not a ServiceConfig env var (docs/configuration.md): {sorted(unknown)}"


def test_compose_kinference_services_configure_a_valid_service():
    services = compose()["services"]
    topics = services["topics"]
    assert topics["entrypoint"] == ["kinference", "topics", "create"] and topics["image"] == services["kinference"][
        "image"]
    created = topics_config([str(arg) for arg in topics.get("command", [])], compose_environment(topics))
    for name in ("kinference", "kinference-gpu"):
        service = services[name]
        config = serve_config([str(arg) for arg in service.get("command", [])], compose_environment(service))
        assert config.topics() == list(created.topic_partitions()), name
        assert config.kafka == created.kafka and config.bootstrap_servers == created.bootstrap_servers
        # Readiness on whatever port the service was given: a URL written here would miss KINFERENCE_METRICS_PORT.
        assert service["healthcheck"]["test"] == ["CMD", "kinference", "healthcheck", "--ready"], name
    assert created.dead_letter_partitions == OPTIONS["dead_letter_partitions"].default
    assert created.replication_factor == 1  # one broker
    assert services["kinference-gpu"]["environment"]["KINFERENCE_DEVICE"] == "cuda"


def test_compose_binds_loopback_keeps_data_and_bounds_threads():
    """A stack a user can run on a laptop and keep: nothing listens beyond 127.0.0.1, Kafka's data survives a
    restart, each replica's torch and OpenMP threads are bounded, and the health check waits out a compile."""
    spec = compose()
    services = spec["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond the loopback"
    published = {str(port).split(":")[1].split("-")[0]: name for name, service in services.items()
                 for port in service.get("ports", [])}
    assert published == {"9094": "kafka", "9400": "kinference", "9090": "prometheus", "3000": "grafana"}
    assert "kafka-data:/var/lib/kafka/data" in services["kafka"]["volumes"] and "kafka-data" in spec["volumes"]
    assert services["kafka"]["environment"]["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"
    for name in ("kinference", "kinference-gpu"):
        env = compose_environment(services[name])
        assert int(env["OMP_NUM_THREADS"]) == serve_config([], env).torch_threads >= 1, name
        assert "./models:/models:ro" in services[name]["volumes"]
        assert {"path": "./kinference.env", "required": False} in services[name]["env_file"]
        start = services[name]["healthcheck"]["start_period"]
        assert int(start.rstrip("s")) >= 214 + 60, "a cold warm-up with compile=true took 214 s"
    assert {"path": "./kinference.env", "required": False} in services["loadgen"]["env_file"]
    dockerfile_start = re.search(r"--start-period=(\d+)s", (DEPLOY / "Dockerfile").read_text()).group(1)
    assert int(dockerfile_start) >= 214 + 60
    ignored = (ROOT / ".gitignore").read_text().split()
    assert {"deploy/kinference.env", "deploy/models/"} <= set(ignored), "a user's settings and models stay out of git"


def test_every_host_port_and_mount_the_docs_name_is_in_compose():
    services = compose()["services"]
    published = {str(port).split(":")[1].split("-")[0] for service in services.values()
                 for port in service.get("ports", [])}
    # deploy/README.md is about the stack: each host port it names must be published. README.md's compose section
    # too; its other sections name the local broker of `kinference broker` (9092), which compose does not run.
    readme = (ROOT / "README.md").read_text()
    stack = readme[readme.index("## Running the stack with Docker"):readme.index("## Operating it")]
    for name, text in (("deploy/README.md", (DEPLOY / "README.md").read_text()), ("README.md", stack)):
        for port in set(re.findall(r"(?:localhost|127\.0\.0\.1):(\d+)", text)):
            assert port in published, f"{name} names host port {port}, which compose does not publish"
    docs = {path: path.read_text() for path in (ROOT / "docs" / "handlers.md",)}
    handlers_doc = docs[ROOT / "docs" / "handlers.md"]
    assert "deploy/models/" in handlers_doc and "deploy/kinference.env" in handlers_doc
    for value in re.findall(r"KINFERENCE_MODEL=(\S+?)\\n", handlers_doc):
        assert value.startswith("/models/"), "the compose example's model is under the /models mount"


def test_compose_loadgen_and_readme_commands_parse():
    loadgen_cli = pytest.importorskip("kinference.loadgen.cli")
    services = compose()["services"]
    loadgen = services["loadgen"]
    assert loadgen["entrypoint"] == ["kinference", "loadgen"]
    args = loadgen_cli.build_parser().parse_args([str(arg) for arg in loadgen["command"]])
    kinference_env = services["kinference"]["environment"]
    assert args.request_topic in kinference_env["KINFERENCE_REQUEST_TOPICS"].split(",")
    assert args.reply_topic == kinference_env["KINFERENCE_REPLY_TOPIC"]
    # loadgen's --bootstrap-servers default reads the same env var as kinference serve.
    assert loadgen["environment"]["KINFERENCE_BOOTSTRAP_SERVERS"] == kinference_env["KINFERENCE_BOOTSTRAP_SERVERS"]
    readme = (DEPLOY / "README.md").read_text()
    for argv in command_lines(readme, "loadgen"):
        loadgen_cli.build_parser().parse_args(argv)
    for argv in command_lines(readme, "serve"):
        build_parser().parse_args(["serve", *argv])


def test_k8s_deployment_configures_a_valid_service(tmp_path):
    config = k8s_config(tmp_path)
    assert config.bootstrap_servers and config.metrics_port > 0
    gpu = yaml.safe_load((K8S / "gpu-patch.yaml").read_text())
    gpu_config = k8s_config(tmp_path, literal_env(container(gpu).get("env", [])))
    assert gpu_config.device == "cuda"
    assert container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_k8s_probes_ports_and_grace_agree_with_the_config(tmp_path):
    config = k8s_config(tmp_path)
    objects = k8s_objects()
    deployment = objects[("Deployment", "kinference")]
    kinference = container(deployment)
    ports = {port["name"]: port["containerPort"] for port in kinference["ports"]}
    assert ports["metrics"] == config.metrics_port
    assert kinference["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert kinference["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert kinference["resources"]["requests"]["cpu"] and kinference["resources"]["requests"]["memory"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.shutdown_grace_s
    # A member with no partitions is ready (a standby), so a surge pod never stalls a rollout: start the new pod
    # first and keep every old one serving until it is ready.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = objects[("Service", "kinference-metrics")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["metrics"]


def test_autoscalers_follow_the_group_and_stop_at_the_partition_count(tmp_path):
    config = k8s_config(tmp_path)
    objects = k8s_objects()
    job = objects[("Job", "kinference-topics")]
    topics = k8s_workload_config(tmp_path, job, "topics", job["spec"]["template"]["spec"]["containers"][0]["command"])
    partitions = topics.topic_partitions()
    assert topics.bootstrap_servers == config.bootstrap_servers
    assert list(partitions) == config.topics()

    keda = objects[("ScaledObject", "kinference")]
    (trigger,) = keda["spec"]["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka" and keda["spec"]["scaleTargetRef"]["name"] == "kinference"
    assert meta["consumerGroup"] == config.group_id and meta["bootstrapServers"] == config.bootstrap_servers
    assert meta["topic"] in config.request_topics
    assert keda["spec"]["maxReplicaCount"] <= partitions[meta["topic"]]

    hpa = objects[("HorizontalPodAutoscaler", "kinference")]
    (metric,) = hpa["spec"]["metrics"]
    selector = metric["external"]["metric"]["selector"]["matchLabels"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kinference"
    assert hpa["spec"]["maxReplicas"] <= partitions[selector["topic"]] and selector["topic"] in config.request_topics
    (rule,) = yaml.safe_load((K8S / "autoscaling" / "prometheus-adapter-values.yaml").read_text())["rules"]["external"]
    assert rule["name"]["as"] == metric["external"]["metric"]["name"]
    assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def test_no_replicas_where_an_autoscaler_owns_the_count_and_a_budget_for_disruptions():
    objects = k8s_objects()
    targets = {(o["spec"]["scaleTargetRef"].get("kind", "Deployment"), o["spec"]["scaleTargetRef"]["name"])
               for kind, _ in objects if kind in ("ScaledObject", "HorizontalPodAutoscaler")
               for o in [objects[(kind, "kinference")]]}
    assert ("Deployment", "kinference") in targets
    for kind in ("Deployment", "StatefulSet"):
        assert "replicas" not in objects[(kind, "kinference")]["spec"], f"{kind}: the autoscaler owns replicas"
    pdb = objects[("PodDisruptionBudget", "kinference")]
    labels = objects[("Deployment", "kinference")]["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items() and pdb["spec"]["maxUnavailable"] == 1
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "pdb.yaml" in kustomization["resources"]
    job_labels = objects[("Job", "kinference-topics")]["spec"]["template"]["metadata"]["labels"]
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= job_labels.items(), "the budget is for consumers"


def test_exactly_once_recipe_is_a_statefulset_with_stable_transactional_ids(tmp_path):
    objects = k8s_objects()
    statefulset, deployment = objects[("StatefulSet", "kinference")], objects[("Deployment", "kinference")]
    member = container(statefulset)
    env = {item["name"]: item for item in member["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # kinference derives transactional.id from group.instance.id, here the StatefulSet's stable pod name.
    config = serve_config(list(member["args"][:0]), {"KINFERENCE_DELIVERY": env["KINFERENCE_DELIVERY"]["value"],
                                                     "KINFERENCE_KAFKA_CONSUMER": env["KINFERENCE_KAFKA_CONSUMER"][
                                                         "value"].replace("$(POD_NAME)", "kinference-0")})
    assert config.delivery == "exactly-once" and config.consumer_config()["group.instance.id"] == "kinference-0"
    assert statefulset["spec"]["serviceName"] == objects[("Service", "kinference-metrics")]["metadata"]["name"]
    # The same pod as the Deployment's otherwise: config, Secret, certificates, probes, resources.
    same = ("args", "ports", "startupProbe", "livenessProbe", "readinessProbe", "resources", "securityContext",
            "volumeMounts")
    assert {key: member[key] for key in same} == {key: container(deployment)[key] for key in same}
    assert pod_spec(statefulset)["volumes"] == pod_spec(deployment)["volumes"]
    assert env["KINFERENCE_KAFKA"] == {item["name"]: item for item in container(deployment)["env"]}["KINFERENCE_KAFKA"]
    kustomization = yaml.safe_load((K8S / "exactly-once" / "kustomization.yaml").read_text())
    assert all((K8S / "exactly-once" / resource).is_file() for resource in kustomization["resources"])
    assert "../deployment.yaml" not in kustomization["resources"]


def test_the_topics_job_runs_kinference_with_the_services_config_secret_and_certificates():
    objects = k8s_objects()
    job, deployment = objects[("Job", "kinference-topics")], objects[("Deployment", "kinference")]
    (topics,) = pod_spec(job)["containers"]
    assert topics["image"] == container(deployment)["image"]
    assert topics["command"] == ["kinference", "topics", "create"]
    assert topics["args"] == container(deployment)["args"]
    secret = {item["name"]: item for item in container(deployment)["env"]}["KINFERENCE_KAFKA"]
    assert secret in topics["env"]
    volumes = {volume["name"]: volume for volume in pod_spec(deployment)["volumes"]}
    for mount in topics["volumeMounts"]:
        assert mount in container(deployment)["volumeMounts"] and volumes[mount["name"]] in pod_spec(job)["volumes"]
    assert pod_spec(job)["securityContext"]["runAsNonRoot"] is True


def test_keda_authenticates_with_a_trigger_authentication_and_the_model_patch_mounts_what_it_serves(tmp_path):
    objects = k8s_objects()
    (trigger,) = objects[("ScaledObject", "kinference")]["spec"]["triggers"]
    auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    parameters = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
    assert {"sasl", "username", "password", "tls", "ca", "cert", "key"} <= parameters
    patch = yaml.safe_load((K8S / "model-patch.yaml").read_text())
    env = literal_env(container(patch)["env"])
    (mount,) = container(patch)["volumeMounts"]
    assert env["KINFERENCE_MODEL"].startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    config = k8s_config(tmp_path, env)
    assert str(config.model) == env["KINFERENCE_MODEL"] and config.handler == env["KINFERENCE_HANDLER"]
    (volume,) = patch["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"] and volume["persistentVolumeClaim"]["readOnly"] is True


def test_prometheus_scrapes_the_metrics_port_of_every_kinference_service():
    services = compose()["services"]
    (job,) = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert set(sd["names"]) == {"kinference", "kinference-gpu"}
    assert all(str(sd["port"]) == services[name]["environment"]["KINFERENCE_METRICS_PORT"] for name in sd["names"])


# --- metric names exist --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [DASHBOARD, *sorted((K8S / "autoscaling").glob("*.yaml")), ALERTS, ALERT_TESTS],
                         ids=lambda p: p.name)
def test_metric_names_exist_in_the_service(path):
    used = set(re.findall(r"\b(?:kinference|process)_[a-z_]+\b", path.read_text()))
    exposed = exposed_metric_names()
    assert not used - exposed, f"{path.name} uses metrics the service does not expose: {sorted(used - exposed)}"
    if path.name in ("kinference.json", "hpa.yaml", ALERTS.name):
        assert used, "expected metric names"


# --- alert rules ---------------------------------------------------------------------------------------


def test_alert_tests_use_series_labelled_as_the_service_labels_them():
    """Each input series of the promtool test has the labels the service gives that metric, plus the job and
    instance labels Prometheus adds: no more, no fewer."""
    labels = exposed_metric_labels()
    for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for series in test["input_series"]:
            name, given = re.fullmatch(r"(\w+)\{(.*)\}", series["series"]).groups()
            keys = set(re.findall(r"(\w+)=", given))
            assert keys == labels[name] | {"job", "instance"}, f"{series['series']}: the service labels {name} " \
                                                                 f"with {sorted(labels[name])}"


def test_every_alert_is_tested_and_kubernetes_carries_the_same_rules():
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"]}
    assert alerts == {"KinferenceLagGrowing", "KinferenceErrorRatioHigh", "KinferenceNoReplies",
                      "KinferenceProducerReplaced", "KinferenceConsumerFatal", "KinferenceReadinessFlapping",
                      "KinferenceDeadLettersHigh", "KinferenceAbsent"}
    tested = {case["alertname"] for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert tested == alerts, f"alerts never seen firing in {ALERT_TESTS.name}: {sorted(alerts - tested)}"
    assert k8s_objects()[("PrometheusRule", "kinference")]["spec"]["groups"] == groups
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == [ALERTS.name]
    assert f"./prometheus/{ALERTS.name}:/etc/prometheus/{ALERTS.name}:ro" in compose()["services"]["prometheus"][
        "volumes"]


def test_alert_rules_name_no_job_so_they_work_under_plain_prometheus_and_the_operator():
    """compose's Prometheus names the job `kinference`, the Prometheus Operator after the Service
    (`kinference-metrics`): a rule that matched one job name would never fire under the other."""
    service = k8s_objects()[("Service", "kinference-metrics")]["metadata"]["name"]
    (scrape,) = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    assert {scrape["job_name"], service} == {"kinference", "kinference-metrics"}
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            assert not re.search(r"\bjob\s*=~?", rule["expr"]), f"{rule['alert']} matches a job name"
            if "process_" in rule["expr"]:
                assert "kinference_build_info" in rule["expr"], f"{rule['alert']}: process_* of any job, not only ours"
    tested_jobs = {re.search(r'job="([^"]+)"', series["series"]).group(1)
                   for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for series in test["input_series"]}
    assert {"kinference", "kinference-metrics"} <= tested_jobs


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus' package) is not installed: "
                    ".ci/run installs it from Debian's prometheus package")
def test_alert_rules_pass_promtool():
    for command in (["check", "rules", ALERTS.name], ["test", "rules", ALERT_TESTS.name]):
        done = subprocess.run(["promtool", *command], cwd=ALERTS.parent, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    (provisioned,) = datasource["datasources"]
    panels = dashboard_panels()
    assert len({panel["id"] for panel in panels}) == len(panels)
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    for panel in panels:
        assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == provisioned["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == provisioned["uid"] and target["expr"].strip()
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= variables | GRAFANA_BUILTINS, target["expr"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/kinference.yaml").read_text())
    grafana = compose()["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    assert mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]


# --- the image -----------------------------------------------------------------------------------------


def test_dockerfile_installs_kinference_the_way_the_makefile_does():
    makefile = (ROOT / "Makefile").read_text()
    torch_spec = re.search(r"^TORCH_SPEC \?= (\S+)$", makefile, re.M).group(1)
    args = dockerfile_args()
    assert args["TORCH_SPEC"] == torch_spec, "deploy/Dockerfile's TORCH_SPEC must equal the Makefile's default"
    runs = [value for op, value in dockerfile_instructions() if op == "RUN" and "pip install" in value]
    torch_step = next(i for i, run in enumerate(runs) if '"${TORCH_SPEC}"' in run)
    kinference_step = next(i for i, run in enumerate(runs) if "/src${EXTRAS:+[${EXTRAS}]}" in run)
    assert torch_step < kinference_step, "torch first, then kinference (which leaves the installed torch alone)"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert set(filter(None, args["EXTRAS"].split(","))) <= set(extras)
    copied = {Path(source).name for op, value in dockerfile_instructions() if op == "COPY"
              for source in value.split()[:-1]}
    packages = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert copied >= packages | {"pyproject.toml", pyproject["project"]["readme"]}


@pytest.mark.parametrize("index_url", ["", "https://download.pytorch.org/whl/cu128"])
def test_dockerfile_installs_torch_with_or_without_an_index_url(index_url):
    """An empty TORCH_INDEX_URL (pip's own configuration, as the Makefile allows) must not give pip an empty
    --index-url: the torch step runs in sh with pip replaced by a printer of its arguments."""
    (step,) = [value for op, value in dockerfile_instructions() if op == "RUN" and '"${TORCH_SPEC}"' in value]
    script = step.replace("pip install", "printf '%s\\n'", 1)
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10,
                          env={"TORCH_INDEX_URL": index_url, "TORCH_SPEC": "torch==2.13.0", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    args = done.stdout.split("\n")[:-1]
    assert args == ["--no-cache-dir", *(["--index-url", index_url] if index_url else []), "torch==2.13.0"]


def test_dockerfile_runs_kinference_serve_as_non_root_with_a_health_check():
    instructions = dockerfile_instructions()
    ops = dict(instructions)
    assert json.loads(ops["ENTRYPOINT"]) == ["kinference", "serve"]
    user = ops["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root USER (Kubernetes runAsNonRoot checks it)"
    assert json.loads(ops["HEALTHCHECK"].split("CMD", 1)[1]) == ["kinference", "healthcheck"]
    assert ops["EXPOSE"] == str(OPTIONS["metrics_port"].default)
    assert ops["FROM"] == "${BASE_IMAGE}" and "BASE_IMAGE" in dockerfile_args()


def test_dockerignore_keeps_what_the_image_copies():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert {".git", ".venv"} <= set(patterns)
    for op, value in dockerfile_instructions():
        if op == "COPY":
            for source in value.split()[:-1]:
                hits = [p for p in patterns if fnmatch.fnmatch(source, p) or fnmatch.fnmatch(source, p + "/*")]
                assert not hits, f"{source} is copied but .dockerignore excludes it ({hits})"
