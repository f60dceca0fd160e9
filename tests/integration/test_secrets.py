"""Secrets passed as librdkafka properties never appear in logs or error messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kinference.consumer.config import load_config
from kinference.errors import ConfigError

pytestmark = pytest.mark.integration

SECRET = "S3cr3t-Pa55w0rd-do-not-log"


def test_config_errors_and_repr_never_show_secrets():
    config = load_config({"kafka": [f"sasl.password={SECRET}"]}, environ={})
    assert SECRET not in repr(config) and SECRET not in str(config.model_dump())
    assert config.consumer_config()["sasl.password"] == SECRET  # only the librdkafka dict has it
    for bad in ({"kafka": [f"sasl.password:{SECRET}"]}, {"kafka": [f"sasl.password={SECRET}"], "max_batch_size": 0}):
        with pytest.raises(ConfigError) as info:
            load_config(bad, environ={})
        assert SECRET not in str(info.value)


def test_a_failing_sasl_login_does_not_log_the_password(broker):
    # Tansu has no SASL: the handshake fails, and the service keeps retrying and logging errors.
    env = {**os.environ, "KINFERENCE_KAFKA": f'{{"sasl.password": "{SECRET}"}}'}
    process = subprocess.Popen(
        [sys.executable, "-m", "kinference", "serve", "--handler", "echo", "--no-metrics",
         "--bootstrap-servers", broker.bootstrap_servers, "--log-level", "DEBUG", "--log-format", "json",
         "--kafka", "security.protocol=SASL_PLAINTEXT", "--kafka", "sasl.mechanism=PLAIN",
         "--kafka", "sasl.username=kinference"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        time.sleep(6)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "kinference" in output and len(output) > 200, output  # it did log, including errors
    assert SECRET not in output
