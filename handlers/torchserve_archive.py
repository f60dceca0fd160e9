"""TorchServe model archives: a ``.mar`` file (zip, or tar.gz from ``--archive-format tgz``) or its extracted
directory, its ``MAR-INF/MANIFEST.json``, and the batch settings TorchServe would have applied to it.

Standard library and PyYAML only: the batch settings (``TorchServeHandler.batching_defaults``) are read without
TorchServe and without extracting the archive (``kinference.handlers.torchserve`` serves it).
"""

from __future__ import annotations

import json
import re
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from kinference.errors import HandlerLoadError

MANIFEST = "MAR-INF/MANIFEST.json"

# TorchServe's per-model settings (model-config.yaml, config.properties' models=) -> ServiceConfig fields.
_BATCH_KEYS = {"batchSize": "max_batch_size", "maxBatchDelay": "max_batch_delay_ms"}
_STAGES = ("preprocess", "inference", "postprocess")


@dataclass(frozen=True)
class Archive:
    """An archive ready to load: the directory that holds its files, and its manifest."""

    directory: Path
    manifest: dict[str, Any]

    @property
    def model(self) -> dict[str, Any]:
        model: dict[str, Any] = self.manifest.get("model", {})
        return model

    @property
    def name(self) -> str:
        return str(self.model.get("modelName") or self.directory.name)

    @property
    def handler(self) -> str:
        handler = self.model.get("handler")
        if not handler:
            raise HandlerLoadError(f"torchserve: {MANIFEST} of {self.directory} names no handler")
        return str(handler)

    def config(self) -> dict[str, Any]:
        """The archive's model-config YAML (``--config-file`` of torch-model-archiver); empty when none."""
        name = self.model.get("configFile")
        return _yaml(name, _read_member(_directory_reader(self.directory), name, self.directory)) if name else {}


@contextmanager
def opened(model: Path) -> Iterator[Archive]:
    """The archive at ``model``, extracted to a temporary directory (removed on exit) when it is a file."""
    if model.is_dir():
        yield Archive(model, _manifest(model, _directory_reader(model)))
        return
    scratch = Path(tempfile.mkdtemp(prefix="kinference-mar-"))
    try:
        _extract(model, scratch)
        entries = list(scratch.iterdir())
        # tgz archives hold one top-level folder named after the model; zip archives hold the files themselves.
        nested = len(entries) == 1 and entries[0].is_dir() and not (scratch / MANIFEST).exists()
        root = entries[0] if nested else scratch
        yield Archive(root, _manifest(model, _directory_reader(root)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def batch_settings(model: Path, ts_config: Path | None = None) -> dict[str, Any]:
    """The ``ServiceConfig`` fields TorchServe's settings for this archive map to: ``batchSize``,
    ``maxBatchDelay`` and ``micro_batching`` (``micro_batch_size``, ``parallelism``) from the archive's
    model-config YAML, then ``batchSize``/``maxBatchDelay`` of this model in ``ts_config``'s ``models=``
    (config.properties), which win as they do in TorchServe. Read without extracting the archive."""
    read = _reader(model)
    manifest = _manifest(model, read)
    config_file = manifest.get("model", {}).get("configFile")
    model_config = _yaml(config_file, _read_member(read, config_file, model)) if config_file else {}
    settings = _from_model_config(model_config)
    if ts_config is not None:
        name = manifest.get("model", {}).get("modelName") or model.stem
        version = manifest.get("model", {}).get("modelVersion")
        settings.update(_from_properties(ts_config, name, version))
    return settings


def _from_model_config(config: dict[str, Any]) -> dict[str, Any]:
    settings = {field: config[key] for key, field in _BATCH_KEYS.items() if key in config}
    micro = config.get("micro_batching") or {}
    if not isinstance(micro, dict):
        raise HandlerLoadError(f"torchserve: micro_batching in the model config must be a mapping, not {micro!r}")
    if "micro_batch_size" in micro:
        settings["micro_batch_size"] = micro["micro_batch_size"]
    parallelism = micro.get("parallelism") or {}
    if not isinstance(parallelism, dict):
        raise HandlerLoadError(f"torchserve: micro_batching.parallelism must be a mapping, not {parallelism!r}")
    if parallelism:
        settings["parallelism"] = {stage: parallelism[stage] for stage in _STAGES if stage in parallelism}
    return settings


def _from_properties(path: Path, name: str, version: str | None) -> dict[str, Any]:
    """This model's ``batchSize``/``maxBatchDelay`` in a config.properties' ``models={...}`` JSON."""
    try:
        properties = _properties(path.read_text())
    except OSError as exc:
        raise HandlerLoadError(f"torchserve: cannot read {path}: {exc}") from exc
    if "models" not in properties:
        return {}
    try:
        versions = json.loads(properties["models"]).get(name, {})
    except (json.JSONDecodeError, AttributeError) as exc:
        raise HandlerLoadError(f"torchserve: models= in {path} is not a JSON object: {exc}") from exc
    chosen = versions.get(version) if version in versions else next(iter(versions.values()), {})
    return {field: chosen[key] for key, field in _BATCH_KEYS.items() if key in chosen}


_CONTINUED = re.compile(r"\\\n[ \t]*")
_PROPERTY = re.compile(r"([^=:\s]+)\s*[=:\s]\s*(.*)")


def _properties(text: str) -> dict[str, str]:
    """A Java properties file: ``key=value`` or ``key: value``, ``#``/``!`` comments, ``\\`` continues a line."""
    properties = {}
    for line in _CONTINUED.sub("", text).splitlines():
        match = _PROPERTY.fullmatch(line.strip())
        if match and not line.lstrip().startswith(("#", "!")):
            properties[match[1]] = match[2]
    return properties


def _manifest(model: Path, read: Callable[[str], bytes]) -> dict[str, Any]:
    try:
        manifest = json.loads(read(MANIFEST))
    except (KeyError, FileNotFoundError) as exc:
        raise HandlerLoadError(f"torchserve: {model} has no {MANIFEST}: is it a TorchServe model archive "
                               "(torch-model-archiver)?") from exc
    except (ValueError, OSError) as exc:
        raise HandlerLoadError(f"torchserve: cannot read {MANIFEST} of {model}: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("model"), dict):
        raise HandlerLoadError(f"torchserve: {MANIFEST} of {model} has no \"model\" object")
    return manifest


def _read_member(read: Callable[[str], bytes], name: Any, model: Path) -> bytes:
    """A file the manifest names (``configFile``), read from inside the archive only: a path that is not relative,
    or climbs out with ``..``, is refused, as is one the archive does not hold."""
    if not isinstance(name, str) or not _inside_name(name):
        raise HandlerLoadError(f"torchserve: {MANIFEST} of {model} names {name!r}, which is not a path inside the "
                               "archive")
    try:
        return read(name)
    except (KeyError, OSError) as exc:
        raise HandlerLoadError(f"torchserve: {MANIFEST} of {model} names {name!r}, which the archive does not "
                               f"hold ({exc!r})") from exc


def _inside_name(name: str) -> bool:
    """A member name that stays inside the directory it is extracted to, whatever that directory holds: relative,
    not empty, with no ``..`` part."""
    path = PurePosixPath(name.replace("\\", "/"))
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _yaml(name: str, data: bytes) -> dict[str, Any]:
    try:
        config = yaml.safe_load(data) or {}
    except yaml.YAMLError as exc:
        raise HandlerLoadError(f"torchserve: the model config {name} is not valid YAML: {exc}") from exc
    if not isinstance(config, dict):
        raise HandlerLoadError(f"torchserve: the model config {name} must be a mapping")
    return config


def _reader(model: Path) -> Callable[[str], bytes]:
    """Reads one member of the archive by its path inside the model directory."""
    if model.is_dir():
        return _directory_reader(model)
    if not model.is_file():
        raise HandlerLoadError(f"torchserve: --model {model} does not exist")
    if zipfile.is_zipfile(model):
        def read_zip(name: str) -> bytes:
            with zipfile.ZipFile(model) as archive:
                return archive.read(name)
        return read_zip
    if tarfile.is_tarfile(model):
        def read_tar(name: str) -> bytes:
            with tarfile.open(model) as archive:
                for member in archive.getmembers():
                    if member.isfile() and (member.name == name or member.name.endswith("/" + name)):
                        extracted = archive.extractfile(member)
                        assert extracted is not None  # a regular file
                        return extracted.read()
            raise KeyError(name)
        return read_tar
    raise HandlerLoadError(f"torchserve: {model} is neither a .mar (zip), a tar.gz archive nor a directory")


def _directory_reader(directory: Path) -> Callable[[str], bytes]:
    root = directory.resolve()

    def read(name: str) -> bytes:
        path = (directory / name).resolve()
        if not path.is_relative_to(root):  # a symlink in an extracted directory pointing out of it
            raise FileNotFoundError(f"{name} resolves outside {directory}")
        return path.read_bytes()
    return read


def _extract(model: Path, into: Path) -> None:
    """Every member checked first, then extracted: an archive holding a link (symbolic or hard), a device or any
    other special file, or a name that leaves ``into``, is refused before anything is written. tarfile's own
    ``filter="data"`` is not enough: on Python before 3.11.13/3.12.11 a chain of symlinks longer than PATH_MAX
    gets past it and writes outside (CVE-2025-4517), and a TorchServe archive needs no links."""
    _reader(model)  # the same checks and messages as for reading
    if zipfile.is_zipfile(model):
        with zipfile.ZipFile(model) as archive:
            _check_members(model, [(info.filename, True) for info in archive.infolist()])
            archive.extractall(into)
    else:
        with tarfile.open(model) as archive:
            members = archive.getmembers()
            _check_members(model, [(member.name, member.isfile() or member.isdir()) for member in members])
            archive.extractall(into, members=members, filter="data")


def _check_members(model: Path, members: list[tuple[str, bool]]) -> None:
    """``members``: (name, whether it is a plain file or directory) of each member."""
    for name, plain in members:
        if not plain:
            raise HandlerLoadError(f"torchserve: {model} holds {name!r}, a link or special file: refused (a model "
                                   "archive needs none, and links can write outside the extraction directory)")
        if not _inside_name(name):
            raise HandlerLoadError(f"torchserve: {model} holds {name!r}, a path outside the archive: refused")
