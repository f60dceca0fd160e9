"""The handler contract is an SDK: a handler module imports ``kinference`` and nothing of the service."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ["kinference.consumer", "kinference.loadgen", "torch", "transformers", "numpy", "pydantic", "yaml",
           "prometheus_client", "confluent_kafka"]


def run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where importing any of ``BLOCKED`` raises ImportError."""
    blocker = textwrap.dedent(f"""
        import sys
        from importlib.abc import MetaPathFinder

        class Block(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if any(name == blocked or name.startswith(blocked + ".") for blocked in {BLOCKED!r}):
                    raise ImportError(f"blocked: {{name}}")
                return None

        sys.meta_path.insert(0, Block())
    """)
    return subprocess.run([sys.executable, "-c", blocker + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_a_handler_is_written_and_run_with_the_service_blocked():
    result = run_blocked("""
        from kinference import ErrorCode, Handler, HandlerContext, InvalidInput, RequestError

        class Upper(Handler):
            def validate(self, payload):
                if not isinstance(payload, str):
                    raise InvalidInput("send a string")
                return payload

            def preprocess(self, items):
                return items

            def inference(self, inputs):
                return [text.upper() for text in inputs]

            def postprocess(self, outputs, items):
                return outputs

        handler = Upper()
        handler.setup(HandlerContext(device="cpu"))
        items = [handler.validate(text) for text in ("a", "b")]
        print(handler.postprocess(handler.inference(handler.preprocess(items)), items))
        try:
            handler.validate(3)
        except RequestError as exc:
            print(exc.code is ErrorCode.BAD_REQUEST, exc.message)
        import sys
        print(sorted(name for name in sys.modules if name.startswith("kinference")))
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "['A', 'B']"
    assert lines[1] == "True send a string"
    # Only the contract, its errors and the wire format were loaded.
    assert lines[2] == "['kinference', 'kinference.errors', 'kinference.handlers', 'kinference.handlers.base', " \
                       "'kinference.protocol']"


def test_the_blocker_really_blocks():
    """Without this the first test could pass with the service importable."""
    result = run_blocked("import kinference.consumer.service")
    assert result.returncode != 0 and "blocked: kinference.consumer" in result.stderr


def test_the_client_is_loaded_on_first_use_only():
    result = run_blocked("import kinference; kinference.Client")
    assert result.returncode != 0 and "blocked: kinference.loadgen" in result.stderr
