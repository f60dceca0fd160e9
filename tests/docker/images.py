"""The images the docker tests run, built here from local parts, each once and then reused.

Docker Hub cannot be reached from the test machines, so none of deploy/'s public images can be pulled:
- ``base_image``: Debian bookworm from Debian's own registry (``debootstrap --variant=minbase``) with Debian's
  python3, imported as an image. It stands in for ``python:3.12-slim-bookworm`` (deploy/Dockerfile's BASE_IMAGE).
- ``wheelhouse``: torch and every other wheel the image installs, downloaded once (pip's cache and find-links
  serve most of it) into a directory that ``serve_wheels`` offers to the image build over 127.0.0.1, so a build
  downloads nothing.
- ``kinference_image``: deploy/Dockerfile itself, on that base, with those wheels.
- ``kafka_image`` and ``prometheus_image``: stand-ins for ``apache/kafka`` and ``prom/prometheus`` built from
  the same software: the Apache Kafka jars from Maven Central that ``kinference.consumer.brokers.apache_kafka`` runs,
  and Debian's prometheus package. They keep the public images' layout where compose relies on it (Kafka's
  ``KAFKA_*`` variables and ``/opt/kafka/bin/kafka-broker-api-versions.sh``, Prometheus' entrypoint).

Each image is tagged by a hash of what it is built from; an image already there is reused, across sessions too.
A lock file serialises builds between processes (pytest-xdist workers, ``python -m tests.docker.images``).
``python -m tests.docker.images`` builds them all: .ci/docker.sh runs it while the other tests run.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kinference.consumer.brokers.apache_kafka import broker_jars, kafka_version

ROOT = Path(__file__).parents[2]
HERE = Path(__file__).parent
DEBIAN_SUITE = "bookworm"
# python3-venv: deploy/Dockerfile makes a virtualenv; ca-certificates: apt over https in the stand-ins' builds.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
BUILD_TIMEOUT_S = 1800


class DockerUnavailable(Exception):
    """Why the docker tests cannot run here: they skip with this reason."""


def cache_dir() -> Path:
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kinference" / "docker"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def build_lock() -> Iterator[None]:
    with open(cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run(command: list[str], timeout: float = BUILD_TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess:
    """A command that must succeed: its output's tail is in the error when it does not."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[:6])} ...` failed (exit {done.returncode}): "
                           f"{(done.stdout + done.stderr)[-4000:]}")
    return done


def docker_problem() -> str | None:
    """None when a Docker engine answers, else why not (the docker tests' skip reason)."""
    if shutil.which("docker") is None:
        return "no docker CLI (.ci/docker.sh installs Debian's docker.io and starts dockerd)"
    try:
        done = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                              timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 30 s"
    if done.returncode != 0:
        return f"no Docker engine answers (.ci/docker.sh starts one): {(done.stderr or done.stdout).strip()[:300]}"
    return None


def compose_problem() -> str | None:
    """None when Compose v2 answers as ``docker compose``, else why not."""
    try:
        done = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True,
                              timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "`docker compose version` did not answer in 30 s"
    if done.returncode != 0 or not done.stdout.strip().lstrip("v").startswith("2"):
        return ("Compose v2 is not installed as a docker CLI plugin (.ci/docker.sh builds it from the Go module "
                f"proxy): {(done.stderr or done.stdout).strip()[:300]}")
    return None


def _digest(*parts: bytes | str) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part.encode() if isinstance(part, str) else part)
        hasher.update(b"\0")
    return hasher.hexdigest()[:12]


def _files_digest(*paths: Path) -> str:
    files = sorted(file for path in paths for file in ([path] if path.is_file() else path.rglob("*"))
                   if file.is_file() and "__pycache__" not in file.parts)
    return _digest(*(f"{file.relative_to(ROOT)}" for file in files), *(file.read_bytes() for file in files))


def _image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True, timeout=60,
                          check=False).returncode == 0


@functools.cache
def base_image() -> str:
    """Debian bookworm (minbase) with Debian's python3, from Debian's registry: deploy/Dockerfile's BASE_IMAGE. Its
    root filesystem is kept as a tarball in the cache too: debootstrap takes minutes, a fresh Docker engine has no
    images, and the import takes seconds."""
    name = f"{DEBIAN_SUITE}-{_digest(*BASE_PACKAGES)}"
    tag = f"kinference-test-base:{name}"
    tarball = cache_dir() / f"rootfs-{name}.tar"
    with build_lock():
        if _image_exists(tag):
            return tag
        if not tarball.exists():
            _debootstrap(tarball)
        with open(tarball, "rb") as rootfs:
            run(["docker", "import", "--change", "ENV LANG=C.UTF-8", "-", tag], stdin=rootfs)
    return tag


def _debootstrap(tarball: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise DockerUnavailable("debootstrap is not installed (.ci/docker.sh installs it): the local base image is "
                                "made with it, as Docker Hub's python image cannot be pulled")
    with tempfile.TemporaryDirectory(prefix="kinference-rootfs-") as rootfs:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE, rootfs,
             "http://deb.debian.org/debian"])
        # The packages debootstrap fetched: the image has no use for them (its builds run apt-get update).
        shutil.rmtree(Path(rootfs) / "var/cache/apt/archives", ignore_errors=True)
        run(["tar", "-C", rootfs, "--numeric-owner", "-cf", f"{tarball}.part", "."])
    Path(f"{tarball}.part").rename(tarball)


def _makefile_default(name: str) -> str:
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith(f"{name} ?="):
            return line.split("?=", 1)[1].strip()
    raise LookupError(f"the Makefile sets no {name}")


def _image_python(image: str) -> str:
    return run(["docker", "run", "--rm", "--network", "none", image, "python3", "-c",
                "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"], timeout=120).stdout.strip()


@functools.cache
def wheelhouse() -> Path:
    """Every wheel deploy/Dockerfile installs (TORCH_SPEC, kinference's extras, its build backend), for the base
    image's Python, downloaded once through pip's own configuration into a directory keyed by what decides them."""
    base = base_image()
    python = _image_python(base)
    torch = _makefile_default("TORCH_SPEC")
    pyproject = (ROOT / "pyproject.toml").read_bytes()
    directory = cache_dir() / f"wheelhouse-{_digest(python, torch, pyproject)}"
    with build_lock():
        if (directory / ".complete").exists():
            return directory
        shutil.rmtree(directory, ignore_errors=True)
        requirements = [torch, *image_requirements(), build_backend()]
        # Every manylinux the base's glibc (Debian bookworm: 2.36) runs, by its new and its old names.
        tags = [*(f"manylinux_2_{minor}_x86_64" for minor in range(5, 37)), "manylinux2014_x86_64",
                "manylinux2010_x86_64", "manylinux1_x86_64"]
        platforms = [arg for tag in tags for arg in ("--platform", tag)]
        run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(directory), "--only-binary", ":all:",
             "--python-version", python, "--implementation", "cp", *platforms, *requirements], cwd=ROOT)
        (directory / ".complete").touch()
    return directory


def image_requirements() -> list[str]:
    """What ``pip install /src[EXTRAS]`` asks for, EXTRAS as deploy/Dockerfile sets it: read from pyproject.toml,
    since a download for another Python than this one (``--python-version``) cannot build the project itself."""
    extras = next(line.split("=", 1)[1] for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
                  if line.startswith("ARG EXTRAS="))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"],
            *(requirement for extra in extras.split(",") for requirement in project["optional-dependencies"][extra])]


def build_backend() -> str:
    (requirement,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    return requirement


@contextmanager
def serve_wheels(directory: Path) -> Iterator[str]:
    """The wheelhouse as pip's find-links page on a free port of 127.0.0.1 (an image build with --network host
    reaches it there), for as long as the block runs."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # the wheel requests: not worth a line each
        pass


@functools.cache
def kinference_image() -> str:
    """deploy/Dockerfile on the local base, with its wheels from the wheelhouse: no index is asked."""
    base, wheels = base_image(), wheelhouse()
    sources = [ROOT / name for name in ("pyproject.toml", "README.md", "LICENSE", "kinference", "consumer", "handlers",
                                        "loadgen", "deploy/Dockerfile", ".dockerignore")]
    tag = f"kinference-test:{_digest(base, wheels.name, _files_digest(*sources))}"
    with build_lock():
        if _image_exists(tag):
            return tag
        with serve_wheels(wheels) as url:
            run(["docker", "build", "--network", "host", "--file", str(ROOT / "deploy" / "Dockerfile"), "--tag", tag,
                 "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "TORCH_INDEX_URL=",
                 "--build-arg", "PIP_NO_INDEX=1", "--build-arg", f"PIP_FIND_LINKS={url}", str(ROOT)])
        _remove_other_tags(tag)
    return tag


def _remove_other_tags(tag: str) -> None:
    """The images of earlier sources (GBs each): the layers the new one shares stay."""
    repository = tag.split(":")[0]
    listed = run(["docker", "image", "ls", repository, "--format", "{{.Repository}}:{{.Tag}}"], timeout=60)
    for old in set(listed.stdout.split()) - {tag}:
        subprocess.run(["docker", "image", "rm", old], capture_output=True, timeout=300, check=False)


def kafka_tools_jar() -> Path:
    """kafka-tools (kafka-broker-api-versions.sh, compose's health check of Kafka), from Maven Central: the broker's
    jars leave it out."""
    version = kafka_version()
    directory = broker_jars().parent / f"kafka-tools-{version}"
    jar = directory / f"kafka-tools-{version}.jar"
    with build_lock():
        if not jar.exists():
            run(["mvn", "-q", "-B", "dependency:copy", f"-Dartifact=org.apache.kafka:kafka-tools:{version}:jar",
                 f"-DoutputDirectory={directory}"], timeout=900)
    return jar


@functools.cache
def kafka_image() -> str:
    """Apache Kafka from Maven Central's jars on the local base with Debian's JRE, configured as apache/kafka is."""
    base, jars, tools = base_image(), broker_jars(), kafka_tools_jar()
    context = HERE / "kafka"
    tag = f"kinference-test-kafka:{kafka_version()}-{_digest(base, jars.name, _files_digest(context))}"
    with build_lock():
        if _image_exists(tag):
            return tag
        with tempfile.TemporaryDirectory(prefix="kinference-kafka-image-") as build:
            shutil.copytree(context, build, dirs_exist_ok=True)
            shutil.copytree(jars, Path(build) / "libs", ignore=shutil.ignore_patterns(".*"))
            shutil.copy(tools, Path(build) / "libs")
            run(["docker", "build", "--network", "host", "--tag", tag, "--build-arg", f"BASE_IMAGE={base}", build])
        _remove_other_tags(tag)
    return tag


@functools.cache
def prometheus_image() -> str:
    """Debian's prometheus package on the local base, with prom/prometheus' entrypoint, user and directory."""
    base = base_image()
    context = HERE / "prometheus"
    tag = f"kinference-test-prometheus:{_digest(base, _files_digest(context))}"
    with build_lock():
        if not _image_exists(tag):
            run(["docker", "build", "--network", "host", "--tag", tag, "--build-arg", f"BASE_IMAGE={base}",
                 str(context)])
            _remove_other_tags(tag)
    return tag


def main() -> int:
    """Build every image the docker tests use (each at most once), or say why it cannot be done here."""
    problem = docker_problem()
    if problem:
        print(f"docker images not built: {problem}", file=sys.stderr)
        return 1
    for build in (kinference_image, kafka_image, prometheus_image):
        print(f"{build.__name__}: {build()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
