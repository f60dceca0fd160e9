"""How a model directory says its sentence embeddings are made: the sentence-transformers layout, read once at setup.

A directory saved by sentence-transformers has ``modules.json``: its modules in order, a ``Transformer`` (the model
in the directory, or in a sub-folder), a ``Pooling`` (``1_Pooling/config.json``), optionally ``Dense`` layers
(``2_Dense/``...) and a ``Normalize``. Beside it, ``sentence_bert_config.json`` may give ``max_seq_length`` and
``do_lower_case``, and ``config_sentence_transformers.json`` the ``prompts`` and ``default_prompt_name``. A plain
transformers directory (no ``modules.json``) is served as kinference always served it: mean pooling, normalised.

``read_layout`` returns a ``Layout``, or raises ``HandlerLoadError`` naming what it cannot serve: a module type
other than those four (and ``Dropout``, which does nothing at inference), a ``Dense`` with a residual or reading
another feature, an activation that is not a ``torch.nn`` module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kinference.errors import HandlerLoadError

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
"""sentence-transformers' pooling modes; a model that names several gets them concatenated, in its order."""

_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
"""The boolean keys of a ``1_Pooling/config.json`` saved before sentence-transformers 6 (MiniLM's)."""

_SERVED = ("Transformer", "Pooling", "Dense", "Normalize", "Dropout")
_SENTENCE_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                     "sentence_camembert_config.json", "sentence_albert_config.json",
                     "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")
"""Where a ``Transformer`` module's settings are, the first that exists (sentence-transformers' own order)."""


@dataclass(frozen=True, slots=True)
class DenseLayer:
    """A ``Dense`` module: ``activation(linear(x))``, its weights in ``path``."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """The name of a ``torch.nn`` module class, e.g. ``Tanh`` or ``Identity``."""

    def build(self) -> torch.nn.Module:
        """The layer as a torch module, its weights loaded (float32, on the CPU)."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias)
        state = _weights(self.path)
        try:
            linear.load_state_dict({key.removeprefix("linear."): value for key, value in state.items()})
        except RuntimeError as exc:
            raise HandlerLoadError(f"the Dense layer in {self.path} does not match its config.json: {exc}") from exc
        return torch.nn.Sequential(linear, getattr(torch.nn, self.activation)())


@dataclass(frozen=True, slots=True)
class Layout:
    """What turns a text into its embedding: which model, which tokens, pooled how, then which layers."""

    source: str
    """Which layout was read and why, for the start-up log."""
    model_dir: Path
    """The transformers model (config.json, weights, tokenizer)."""
    sentence_transformers: bool = False
    """Whether sentence-transformers saved the directory (else it is a plain transformers one)."""
    pooling: tuple[str, ...] = ("mean",)
    """One mode of ``POOLING_MODES``, or several, concatenated in that order."""
    include_prompt: bool = True
    """False: pooling leaves out the prompt's tokens (they still take part in attention)."""
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = True
    max_seq_length: int | None = None
    """The model's token limit, special tokens included; None: the tokenizer's, within the model's positions."""
    do_lower_case: bool = False
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    def width(self, hidden_size: int) -> int:
        """How many numbers one embedding has."""
        return self.dense[-1].out_features if self.dense else hidden_size * len(self.pooling)


def read_layout(model_dir: Path) -> Layout:
    """The layout of ``model_dir``: sentence-transformers' where it has ``modules.json``, else plain transformers."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return Layout(f"transformers (no modules.json in {model_dir}): mean pooling, normalised", model_dir)
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(module, dict) for module in modules):
        raise HandlerLoadError(f"{modules_file} is not a list of modules as sentence-transformers saves it")
    kinds = [(str(module.get("type", "")).rsplit(".", 1)[-1], model_dir / str(module.get("path", "")))
             for module in modules]
    unserved = [kind for kind, _ in kinds if kind not in _SERVED]
    if unserved:
        raise HandlerLoadError(f"{modules_file} lists module(s) {', '.join(unserved)}, which kinference does not "
                               f"serve: it reads {', '.join(_SERVED[:-1])} (docs/handlers.md)")
    found = [kind for kind, _ in kinds if kind != "Dropout"]
    if found[:2] != ["Transformer", "Pooling"] or set(found[2:]) - {"Dense", "Normalize"}:
        raise HandlerLoadError(f"{modules_file} lists {', '.join(found)}: kinference serves a Transformer, then a "
                               "Pooling, then Dense layers and Normalize")
    transformer_dir, pooling_dir = (next(path for kind, path in kinds if kind == name) for name in found[:2])
    pooling, include_prompt = _pooling(pooling_dir / "config.json")
    settings = _sentence_config(transformer_dir)
    _check_text_transformer(settings, transformer_dir)
    prompts = _json_or_empty(model_dir / "config_sentence_transformers.json")
    steps = found[2:]
    return Layout(
        source=f"sentence-transformers ({modules_file}): {' + '.join(found)}, pooling {'+'.join(pooling)}",
        model_dir=transformer_dir,
        sentence_transformers=True,
        pooling=pooling,
        include_prompt=include_prompt,
        dense=tuple(_dense(path) for kind, path in kinds if kind == "Dense"),
        normalize=bool(steps) and steps[-1] == "Normalize",
        max_seq_length=_optional_int(settings.get("max_seq_length"), "max_seq_length", transformer_dir),
        do_lower_case=bool(settings.get("do_lower_case", False)),
        **_prompts(prompts, model_dir),
    )


def _pooling(path: Path) -> tuple[tuple[str, ...], bool]:
    config = _json(path)
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)) or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown:
        raise HandlerLoadError(f"{path}: pooling mode(s) {', '.join(map(str, unknown))} are not sentence-transformers' "
                               f"({', '.join(POOLING_MODES)})")
    return modes, bool(config.get("include_prompt", True))


def _dense(path: Path) -> DenseLayer:
    config = _json(path / "config.json")
    if config.get("use_residual"):
        raise HandlerLoadError(f"{path}: a Dense layer with use_residual, which kinference does not serve")
    if config.get("module_input_name", "sentence_embedding") != "sentence_embedding":
        raise HandlerLoadError(f"{path}: a Dense layer on {config['module_input_name']}, not on the sentence "
                               "embedding, which kinference does not serve")
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    name = activation.rsplit(".", 1)[-1]
    module = getattr(torch.nn, name, None)
    if not activation.startswith("torch.") or not (isinstance(module, type) and issubclass(module, torch.nn.Module)):
        raise HandlerLoadError(f"{path}: activation {activation} is not a torch.nn module (sentence-transformers "
                               "too loads only those without trust_remote_code)")
    try:
        return DenseLayer(path, int(config["in_features"]), int(config["out_features"]),
                          bool(config.get("bias", True)), name)
    except (KeyError, TypeError, ValueError) as exc:
        raise HandlerLoadError(f"{path}/config.json lacks in_features or out_features: {exc!r}") from exc


def _sentence_config(transformer_dir: Path) -> dict[str, Any]:
    for name in _SENTENCE_CONFIGS:
        if (transformer_dir / name).is_file():
            return _json_or_empty(transformer_dir / name)
    return {}


def _check_text_transformer(settings: dict[str, Any], where: Path) -> None:
    """A ``Transformer`` that reads plain text with the model's forward pass: sentence-transformers 6 can also render
    texts through a chat template (the ``message`` modality, which it prefers where a model has it) or run another
    task's head, neither of which kinference serves."""
    task = settings.get("transformer_task", "feature-extraction")
    modalities = settings.get("modality_config") or {"text": {}}
    if task != "feature-extraction" or "message" in modalities or "text" not in modalities:
        raise HandlerLoadError(f"{where}: a Transformer module with transformer_task {task!r} and modalities "
                               f"{', '.join(map(str, modalities))}, which kinference does not serve: it reads the "
                               "text modality of a feature-extraction model")


def _prompts(config: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(text, str | None) for text in prompts.values()):
        raise HandlerLoadError(f"{model_dir}/config_sentence_transformers.json: prompts must map names to texts")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise HandlerLoadError(f"{model_dir}/config_sentence_transformers.json: default_prompt_name {default!r} is "
                               f"not one of its prompts ({', '.join(prompts)})")
    return {"prompts": {name: text or "" for name, text in prompts.items()}, "default_prompt_name": default}


def _optional_int(value: Any, key: str, where: Path) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HandlerLoadError(f"{where}: {key} must be an integer >= 1, not {value!r}")
    return value


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        loaded: dict[str, torch.Tensor] = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return loaded
    raise HandlerLoadError(f"the Dense layer in {path} has no weights (model.safetensors or pytorch_model.bin)")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HandlerLoadError(f"cannot read {path}: {exc}") from exc


def _json_or_empty(path: Path) -> dict[str, Any]:
    loaded = _json(path) if path.is_file() else {}
    return loaded if isinstance(loaded, dict) else {}
