"""The docs agree with the code: every command line in README.md, docs/ and deploy/README.md parses with the
real parsers, every flag they name exists, and the code they show runs (the handler of docs/handlers.md)."""

from __future__ import annotations

import argparse
import ast
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
    from kinference.consumer.config import ENV_PREFIX, OPTIONS

    assert {name for name in env if name.startswith(ENV_PREFIX)} <= {ENV_PREFIX + f.upper()
                                                                    for f in OPTIONS}
    module = env["KINFERENCE_HANDLER"].split(":")[0].replace(".", "/")
    copied = {line.split()[-1] for line in lines if line.startswith("COPY ")}
    assert any(f"{env['PYTHONPATH']}/{module.split('/')[0]}" == target for target in copied)
    assert env["KINFERENCE_MODEL"] in copied


# --- command lines, flags and defaults in README.md, docs/ and deploy/README.md -------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
NOT_OURS = {"--build-arg", "--scale", "--index-url", "--gpus", "--wait", "--rm", "--command-config",
            "--allow-principal", "--operation", "--topic", "--group", "--transactional-id", "--resource-pattern-type",
            "--from-literal", "--from-file", "--local-dir", "--add", "--bootstrap-server", "--profile",
            "--archive-format", "--model-file"}
"""Flags of docker, pip, kubectl, kafka-acls.sh, huggingface-cli and torch-model-archiver that the docs show."""


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every kinference command's real parser, by the words that follow ``kinference``."""
    from kinference.consumer.ops.cli import build_parser as service
    from kinference.loadgen import demo
    from kinference.loadgen.bench import bench, cpu_paths, drain, generative, gpu, image
    from kinference.loadgen.cli import build_parser as loadgen

    found = {"loadgen": loadgen(), "demo": demo.build_parser(), "bench": bench.build_parser(),
             "bench image": image.build_parser(), "bench gpu": gpu.build_parser(),
             "bench generate": generative.build_parser(), "drain": drain.build_parser(),
             "cpu-paths": cpu_paths.build_parser()}
    (commands,) = [action for action in service()._actions if isinstance(action, argparse._SubParsersAction)]
    found |= dict(commands.choices)
    return found


_INVOCATION = re.compile(r"(?:^|&&|;|\|)\s*(?:\$ )?(?:[A-Z_]+=\S+ )*kinference ([a-z][a-z-]*)(.*)$")


def command_lines(text: str) -> list[tuple[str, list[str]]]:
    """(command, arguments) of each ``kinference COMMAND ...`` run in a shell code block or inline code; an
    argument ``...`` stands for more and is dropped."""
    lines = [line for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if lang in ("", "bash", "sh")
             for line in block.replace("\\\n", " ").splitlines()]
    # Inline code names other things too (the `kinference batch` span): only commands are checked there.
    from kinference.cli import COMMANDS

    lines += [span for span in re.findall(r"`(kinference [a-z][^`]*)`", text) if span.split()[1] in COMMANDS]
    found = []
    for line in lines:
        match = _INVOCATION.search(line.split("  #")[0])
        if match is None:
            continue
        command, rest = match.groups()
        try:
            words = shlex.split(rest)
        except ValueError:  # a JSON value spread over several lines: its first line alone does not parse
            continue
        if command == "bench" and words[:1] in (["image"], ["gpu"], ["generate"]):
            command, words = f"bench {words[0]}", words[1:]
        found.append((command, [word for word in words if word not in ("...", "&")]))
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_of_the_docs_parses_with_the_cli(path):
    from kinference.cli import COMMANDS

    known = parsers()
    for command, words in command_lines(path.read_text()):
        assert command.split()[0] in COMMANDS, f"{path.name}: kinference {command} is not a command"
        parser = known[command]
        try:
            parser.parse_args(words)
        except SystemExit as exc:
            if exc.code:
                raise AssertionError(f"{path.name}: `kinference {command} {' '.join(words)}` does not parse") from None


def all_flags() -> dict[str, set[str]]:
    """Each flag of every command, with the defaults it has in the commands that take it."""
    flags: dict[str, set[str]] = {}
    for parser in parsers().values():
        for action in parser._actions:
            for option in action.option_strings:
                flags.setdefault(option, set()).add(str(action.default))
    from kinference.consumer.config import OPTIONS

    for name, field in OPTIONS.items():  # serve's flags show the config's defaults
        flags.setdefault("--" + name.replace("_", "-"), set()).add(str(field.default))
    return flags


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_the_docs_name_exists_and_stated_defaults_are_the_clis(path):
    text = path.read_text()
    flags = all_flags()
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", text))
    assert not named - set(flags) - NOT_OURS, f"{path.name} names flags no command has: {sorted(named - set(flags))}"
    for flag, stated in re.findall(r"`(--[a-z][a-z0-9-]+)[^`]*`[^.;\n`]{0,60}?\(default:? `?([^`),;\s]+)", text):
        # Only flags with one plain default everywhere: None means "see the help" (an effective default), a
        # list is a sweep.
        if flag in flags and re.fullmatch(r"[\d.:]+", stated) and not any(
                default == "None" or default.startswith("[") for default in flags[flag]):
            defaults = flags[flag]
            assert any(default == stated or _same_number(default, stated) for default in defaults), \
                f"{path.name}: {flag} says default {stated}, the CLI's is {sorted(defaults)}"


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False



def test_the_quick_start_against_the_embedded_broker_sets_what_it_needs():
    """README's broker quick start: `kinference broker`'s own port (not a local Kafka's 9092), and every consumer
    of it with fetch.wait.max.ms=10, as README says it needs."""
    from kinference.consumer.brokers.broker import LOW_LATENCY_CONSUMER

    readme = (ROOT / "README.md").read_text()
    (block,) = [block for block in code_blocks(readme, "bash") if "kinference broker" in block]
    broker = parsers()["broker"].parse_args([])
    assert broker.port != 9092, "a local Kafka holds 9092"
    lines: dict[str, list[str]] = {}
    for command, words in command_lines(f"```bash\n{block}```"):
        if "--embedded-broker" not in words:  # the one-process alternative brings its own broker
            lines.setdefault(command, words)
    for command in ("topics", "serve"):
        config = parsers()[command].parse_args(lines[command])
        assert config.bootstrap_servers == f"127.0.0.1:{broker.port}", command
    serve = parsers()["serve"].parse_args(lines["serve"])
    assert [f"{key}={value}" for key, value in LOW_LATENCY_CONSUMER.items()] == serve.kafka_consumer
    (producer,) = re.findall(r'"bootstrap.servers": "([^"]+)"', readme)
    assert producer == f"127.0.0.1:{broker.port}"


# --- README's flow diagram -----------------------------------------------------------------------------

def request_path() -> list[str]:
    """The modules of README's flow diagram, top to bottom (its left column), as ``subpackage.module`` of
    ``kinference.consumer``."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How a request flows", 1)[1]
    (diagram,) = code_blocks(section)[:1]
    found = re.findall(r"^(?:request topics ──> |\s+)consumer/(\w+)/(\w+)\.py", diagram, re.M)
    return [f"{package}.{module}" for package, module in found]


def module_file(module: str) -> Path:
    return ROOT / "consumer" / f"{module.replace('.', '/')}.py"


def consumer_imports(module: str) -> set[str]:
    """The ``kinference.consumer`` modules ``module`` imports (as ``subpackage.module``), those under
    ``if TYPE_CHECKING`` too."""
    tree = ast.parse(module_file(module).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kinference.consumer"):
            inside = node.module.removeprefix("kinference.consumer").lstrip(".")
            names |= ({inside} if inside and module_file(inside).is_file()  # from a module: that module
                      else {f"{inside}.{alias.name}".lstrip(".") for alias in node.names})
    return names


def test_the_flow_diagram_follows_a_request_through_each_module_once_and_never_back():
    path = request_path()
    assert path[:2] == ["path.source", "path.intake"], path
    assert path[-3:] == ["delivery.publisher", "delivery.at_least_once", "delivery.exactly_once"], path
    assert len(path) == len(set(path)), f"a module comes twice: {path}"
    for module in path:
        assert module_file(module).is_file(), module
    for index, module in enumerate(path):
        # The value that travels through every stage, the Request, is the floor's (ledger.request), not the path's.
        back = consumer_imports(module) & set(path[:index])
        assert not back, f"{module} reaches back to {sorted(back)}, before it on the request's path"


def built_service(delivery: str, handler=None, device_socket: Path | None = None):
    """What ``Service._build`` wires for ``delivery``, nothing started (no broker: a client connects once used; nor
    a device process: its link connects once used). ``handler``: a handler object to serve instead of ``echo``."""
    from kinference.consumer.config import ServiceConfig
    from kinference.consumer.service import Service

    config = ServiceConfig(request_topics=["requests"], handler="echo", delivery=delivery, transactional_id="tid",
                           bootstrap_servers="127.0.0.1:9")
    service = Service(config, handler, device_socket=device_socket)
    service.models.setup("cpu", service.metrics, None, service._link)
    publisher, source = service._build(config)
    return service, publisher, source


def handed_on(service, publisher, source) -> list[tuple[str, object]]:
    """The objects a request goes through, each found from the one before it in what the service built (not from
    the diagram): the source's intake, its decoder and the models it routes to, the model's runner, what it runs
    (a batch model's batcher and the stage threads that pull from it), the publisher it hands finished requests to,
    and its delivery mode."""
    intake = source._intake
    (model,) = service.models.loaded
    runner = model.runner
    assert intake._models is service.models and service.models._answer.__self__ is publisher
    return [("source", source), ("intake", intake), ("request", intake._decoder), ("models", intake._models),
            ("runner", runner), *runs(runner, publisher), ("delivery", publisher._delivery)]


def runs(runner, publisher) -> list[tuple[str, object]]:
    """What a model's runner hands a request through, down to the publisher."""
    if not hasattr(runner, "batcher"):  # a generative runner hands its records to the publisher itself
        assert runner._outlet is publisher
        return [("publisher", runner._outlet)]
    pipeline = runner.pipeline
    assert pipeline._batches is runner.batcher
    # Bound methods, so that where they go is an object, not a closure over the wiring.
    assert pipeline._emit.__self__ is publisher
    assert runner.batcher._reject.__self__ is publisher  # what the batcher refuses goes straight to its answer
    return [("batcher", runner.batcher), ("stages", pipeline), ("publisher", pipeline._emit.__self__)]


def diagram_path(mode: str, generative: bool = False) -> list[str]:
    """README's path for one delivery mode; a generative model's runner (``generations``) in place of the runner,
    batcher and stages of a batch model's."""
    modes = {"delivery.at_least_once", "delivery.exactly_once"}
    path = [module for module in request_path() if module not in modes - {f"delivery.{mode}"}]
    if generative:
        start = path.index("path.runner")
        path[start:path.index("path.stages") + 1] = ["path.generations"]
    return path


def built_modules(chain: list[tuple[str, object]]) -> list[str]:
    return [type(obj).__module__.removeprefix("kinference.consumer.") for _, obj in chain]


def close_clients(service, publisher, source) -> None:
    """The clients Service made: their threads and connection attempts end here."""
    source._consumer.close()
    publisher._producer = service.lag._admin = None


@pytest.mark.parametrize(("delivery", "mode"), [("at-least-once", "at_least_once"), ("exactly-once", "exactly_once")])
def test_the_service_wires_a_request_s_path_in_the_flow_diagram_s_order(delivery, mode):
    """Issue 30, item 5: imports alone miss a hop that an injected callable takes (a closure in the service, a
    protocol). Here each hop is an object the one before it holds, defined in the diagram's next module; the
    commits on the poll thread work on the ledger the intake tracks requests in."""
    from kinference.consumer.ledger.commits import OffsetCommits, TransactionCommits

    service, publisher, source = built_service(delivery)
    try:
        path = diagram_path(mode)
        modules = built_modules(handed_on(service, publisher, source))
        assert modules == path, f"Service builds {modules}; the diagram says {path}"
        # The ledger the intake tracks each request in is the one the delivery mode hands it back to, answered, and
        # the one the mode's poll-thread side commits from (exactly-once: the two sides share their transactions).
        tracker, delivery_mode, commits = source._intake._tracker, publisher._delivery, source._commits
        assert source._tracker is tracker and source.rebalance._tracker is tracker
        if mode == "exactly_once":
            assert delivery_mode._tracker is tracker and isinstance(commits, TransactionCommits)
            assert commits._transactions is delivery_mode._transactions
        else:
            assert delivery_mode._ledger is tracker and isinstance(commits, OffsetCommits)
        assert commits._tracker is tracker
        assert source.rebalance._commits is commits
    finally:
        close_clients(service, publisher, source)


@pytest.mark.parametrize(("delivery", "mode"), [("at-least-once", "at_least_once"), ("exactly-once", "exactly_once")])
def test_a_generative_model_s_runner_hands_its_records_to_the_publisher_of_the_diagram(delivery, mode):
    """Issue 37, item 4: a generative model's requests go from the models to its runner (``generations``), which
    hands its chunks and finals to the publisher, and makes chunks only where the delivery mode produces them."""
    from tests.unit.consumer.path.test_generations import ScriptedEngine

    service, publisher, source = built_service(delivery, ScriptedEngine())
    try:
        path = diagram_path(mode, generative=True)
        modules = built_modules(handed_on(service, publisher, source))
        assert modules == path, f"Service builds {modules}; the diagram says {path}"
        (model,) = service.models.loaded
        assert model.runner._settings.chunks is publisher._delivery.streams is (mode == "at_least_once")
    finally:
        close_clients(service, publisher, source)


def test_a_device_linked_model_s_stages_run_its_inference_through_the_device_process_s_link(tmp_path):
    """Issue 37, item 4: a handler that runs in a device process gets the batch path of the diagram, with its
    inference through the service's one link to the device process (one inference thread per micro-batch there)."""
    from kinference.consumer.accelerator.worker_link import DeviceInference
    from kinference.handlers.echo import EchoHandler

    class DeviceEcho(EchoHandler):
        device_process = True

    service, publisher, source = built_service("at-least-once", DeviceEcho(), device_socket=tmp_path / "device.sock")
    try:
        modules = built_modules(handed_on(service, publisher, source))
        assert modules == diagram_path("at_least_once")
        (model,) = service.models.loaded
        port = model.runner.pipeline._inference_port
        assert service._link is not None and isinstance(port, DeviceInference) and port._link is service._link
        assert model.batching.parallelism.inference == service.config.device_in_flight
    finally:
        close_clients(service, publisher, source)


def test_without_a_device_process_a_model_runs_its_inference_here():
    from kinference.consumer.path.stages import InProcessInference

    service, publisher, source = built_service("at-least-once")
    try:
        (model,) = service.models.loaded
        assert service._link is None and isinstance(model.runner.pipeline._inference_port, InProcessInference)
    finally:
        close_clients(service, publisher, source)
