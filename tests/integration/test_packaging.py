"""The built wheel, installed into fresh virtualenvs as a user would install it.

- The wheel holds one top-level package, ``kinference``, and its metadata declares the extras.
- The base install (``pip install kinference``) is the client: torch cannot be imported there, the public
  API imports, and the client gets a reply from a running service.
- ``pip install 'kinference[serve]'`` runs ``kinference serve --help``.

Marked slow: the venvs are installed from the package index (the ``serve`` one with torch, about a minute).
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

import pytest

import kinference
from kinference.consumer.service import Service
from tests.integration.kafka_io import service_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
# What a build needs: the same list as deploy/Dockerfile's COPY lines.
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "kinference", "consumer", "handlers", "loadgen"]


def run(*command: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # Away from the repository, as a user's project would be: there, ./kinference would shadow the install.
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout,
                            cwd=tempfile.gettempdir())
    print(f"$ {' '.join(map(str, command))}\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of just the sources, as the image does."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    result = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, source)
    assert result.returncode == 0, result.stderr
    (built,) = dist.glob("kinference-*.whl")
    return built


def venv(path: Path, *requirements: str) -> Path:
    """A fresh virtualenv at ``path`` (or the one there) with ``requirements`` installed; returns its bin
    directory."""
    if not path.exists():
        assert run(sys.executable, "-m", "venv", path).returncode == 0
    result = run(path / "bin" / "python", "-m", "pip", "install", "--quiet", *requirements)
    assert result.returncode == 0, result.stderr
    return path / "bin"


def test_the_wheel_holds_one_top_level_package_and_declares_its_extras(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(archive.read(f"kinference-{kinference.__version__}.dist-info/METADATA"))
        entry_points = archive.read(f"kinference-{kinference.__version__}.dist-info/entry_points.txt").decode()
    assert {name.split("/")[0] for name in names} == {"kinference", f"kinference-{kinference.__version__}.dist-info"}
    for module in ("kinference/__init__.py", "kinference/protocol.py", "kinference/consumer/service.py",
                   "kinference/handlers/base.py", "kinference/loadgen/client.py",
                   "kinference/loadgen/bench/bench.py"):
        assert module in names
    assert f"kinference-{kinference.__version__}.dist-info/licenses/LICENSE" in names
    assert "kinference = kinference.cli:main" in entry_points
    requires = metadata.get_all("Requires-Dist")
    base = {r.split(">")[0] for r in requires if "extra ==" not in r}
    assert base == {"confluent-kafka", "orjson"}
    assert set(metadata.get_all("Provides-Extra")) == {"serve", "generate", "loadgen", "embedded", "onnx", "torchserve",
                                                       "schema-registry", "otel", "gpu", "reference", "dev"}
    assert any(r.startswith("torch") and 'extra == "serve"' in r for r in requires)
    assert metadata["License-Expression"] == "Apache-2.0"


def test_the_base_install_is_a_client_without_torch(wheel: Path, tmp_path: Path, broker):
    bin_dir = venv(tmp_path / "base", str(wheel))
    probe = run(bin_dir / "python", "-c", "import torch")
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    version = run(bin_dir / "kinference", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kinference {kinference.__version__}"
    serve = run(bin_dir / "kinference", "serve", "--help")
    assert serve.returncode == 2 and "pip install 'kinference[serve]'" in serve.stderr

    topics = broker.topics(requests=1, replies=1, dead=1)
    with Service(service_config(broker.bootstrap_servers, topics)) as service:
        assert service.wait_ready(30)
        script = textwrap.dedent(f"""
            import sys
            from kinference import Client, Handler, HandlerContext, InvalidInput, Reply
            with Client({broker.bootstrap_servers!r}, {topics["requests"]!r}, {topics["replies"]!r},
                        timeout_s=30) as client:
                reply = client.request({{"text": "from a bare venv"}})
            assert isinstance(reply, Reply)
            print(reply.result())
            print(sorted(name for name in ("torch", "transformers", "pydantic", "kinference.consumer")
                         if name in sys.modules))
        """)
        result = run(bin_dir / "python", "-c", script, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["{'text': 'from a bare venv'}", "[]"]


def torch_requirement() -> list[str]:
    """pip arguments for torch, as ``make install`` gives them (``make test`` passes them on): without them a
    resolver would pick PyPI's torch, the CUDA build on Linux."""
    import torch

    return os.environ.get("KINFERENCE_TEST_TORCH", f"torch=={torch.__version__}").split()


def test_the_serve_extra_runs_kinference_serve_help(wheel: Path, tmp_path: Path):
    venv(tmp_path / "serve", *torch_requirement())
    bin_dir = venv(tmp_path / "serve", f"{wheel}[serve]")
    result = run(bin_dir / "kinference", "serve", "--help")
    assert result.returncode == 0 and "--max-batch-size" in result.stdout
    imports = run(bin_dir / "python", "-c", "import kinference.consumer.service, kinference.handlers.embedding")
    assert imports.returncode == 0, imports.stderr
