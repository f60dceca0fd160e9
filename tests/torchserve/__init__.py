"""TorchServe archives for the tests, built with torch-model-archiver as TorchServe users build them.

The handlers are ordinary TorchServe handler files (this folder): ``vector_classifier.py`` (a ``BaseHandler``
subclass), ``function_handler.py`` (a module-level ``handle`` function); TorchServe's stock ``text_classifier`` is used
by name, with the eager-mode model of ``text_model.py``. Models are tiny random TorchScript modules.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
VECTOR_SIZE = 4
CLASSES = 3


def vector_model(path: Path, seed: int = 0) -> Path:
    """A TorchScript linear classifier of 4-number vectors into 3 classes."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(VECTOR_SIZE, 8), torch.nn.ReLU(), torch.nn.Linear(8, CLASSES)).eval()
    torch.jit.script(model).save(str(path))
    return path


def build_archive(  # noqa: PLR0913 - torch-model-archiver's own options, each optional
    export_dir: Path, name: str, handler: str, serialized_file: Path, *, config_file: Path | None = None,
    extra_files: list[Path] | None = None, model_file: Path | None = None, archive_format: str = "default",
) -> Path:
    """``torch-model-archiver`` into ``export_dir``: the .mar (or .tar.gz, or the directory for no-archive)."""
    export_dir.mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).parent / "torch-model-archiver"), "--model-name", name, "--version", "1.0",
               "--handler", handler, "--serialized-file", str(serialized_file), "--export-path", str(export_dir),
               "--archive-format", archive_format, "--force"]
    if config_file is not None:
        command += ["--config-file", str(config_file)]
    if model_file is not None:
        command += ["--model-file", str(model_file)]
    if extra_files:
        command += ["--extra-files", ",".join(str(path) for path in extra_files)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    suffix = {"default": ".mar", "zip-store": ".mar", "tgz": ".tar.gz", "no-archive": ""}[archive_format]
    return export_dir / f"{name}{suffix}"


def vector_archive(directory: Path, *, config: str | None = None, archive_format: str = "default",
                   handler: str = "vector_classifier.py") -> Path:
    """The VectorClassifier (or another handler file of this folder) over a tiny model."""
    directory.mkdir(parents=True, exist_ok=True)
    config_file = None
    if config is not None:
        config_file = directory / "model-config.yaml"
        config_file.write_text(config)
    return build_archive(directory / "export", "vectors", str(HERE / handler), vector_model(directory / "model.pt"),
                         config_file=config_file, archive_format=archive_format)
