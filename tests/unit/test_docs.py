"""The docs agree with the code: every command line in README.md, docs/ and deploy/README.md parses with the
real parsers, every flag they name exists, and the code they show runs (the handler of docs/handlers.md)."""

from __future__ import annotations

import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

from kinference.handlers import HandlerContext, load_handler

ROOT = Path(__file__).resolve().parents[2]
HANDLERS_DOC = ROOT / "docs" / "handlers.md"


def code_blocks(text: str, language: str = "") -> list[str]:
    """The fenced code blocks of ``language`` (any language when empty)."""
    return [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if not language or lang == language]


# --- the handler example of docs/handlers.md ----------------------------------------------------------


@pytest.fixture
def sentiment_module(tmp_path, monkeypatch):
    """docs/handlers.md's example handler, written where the docs say (my_handlers/sentiment.py) and importable."""
    (source,) = [block for block in code_blocks(HANDLERS_DOC.read_text(), "python") if "class Sentiment" in block]
    package = tmp_path / "handlers_path" / "my_handlers"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sentiment.py").write_text(source)
    monkeypatch.syspath_prepend(str(package.parent))
    yield "my_handlers.sentiment:Sentiment"
    for name in [name for name in sys.modules if name.startswith("my_handlers")]:
        del sys.modules[name]


@pytest.mark.model
def test_the_handler_example_of_the_docs_serves_a_batch(sentiment_module, tmp_path):
    from tests.models import TINY_LABELS, build_tiny_classifier

    model = build_tiny_classifier(tmp_path / "sentiment")
    handler = load_handler(sentiment_module)
    handler.setup(HandlerContext(device="cpu", model=model, options={"max_length": 16}))
    handler.warm_up()
    items = handler.validate_many([{"text": "the cat sat on the mat"}, {"txt": "no"}, {"text": "a dog"}, "plain"])
    assert [type(item).__name__ for item in items] == ["list", "InvalidInput", "list", "InvalidInput"]
    good = [items[0], items[2]]
    assert [handler.cost(item) for item in good] == [len(item) for item in good] and handler.cost(good[0]) > 2
    results = handler.postprocess(handler.inference(handler.preprocess(good)), good)
    assert len(results) == 2 and all(r["label"] in TINY_LABELS.values() and 0 < r["score"] <= 1 for r in results)
    assert handler.describe()["handler"] == "sentiment"


def test_the_handler_example_imports_only_the_contract(sentiment_module):
    source = importlib.util.find_spec(sentiment_module.split(":")[0]).origin
    imported = set(re.findall(r"^(?:from|import) (\S+)", Path(source).read_text(), re.M))
    assert imported <= {"torch", "transformers", "kinference"}, imported


def test_the_image_recipe_builds_on_the_image_and_runs_as_its_user():
    (recipe,) = code_blocks(HANDLERS_DOC.read_text(), "dockerfile")
    lines = [line for line in re.sub(r"\\\n", " ", recipe).splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == "FROM kinference:cpu"
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert users[-1] == re.search(r"^USER (\S+)", dockerfile, re.M).group(1), "end as the image's non-root user"
    env = dict(shlex.split(item)[0].split("=", 1) for line in lines if line.startswith("ENV ")
               for item in line[4:].split())
    from kinference.consumer.config import ENV_PREFIX, ServiceConfig

    assert {name for name in env if name.startswith(ENV_PREFIX)} <= {ENV_PREFIX + f.upper()
                                                                    for f in ServiceConfig.model_fields}
    module = env["KINFERENCE_HANDLER"].split(":")[0].replace(".", "/")
    copied = {line.split()[-1] for line in lines if line.startswith("COPY ")}
    assert any(f"{env['PYTHONPATH']}/{module.split('/')[0]}" == target for target in copied)
    assert env["KINFERENCE_MODEL"] in copied
