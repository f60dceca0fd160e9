"""``kinference loadgen`` flags: the public names parse, contradictions fail with a usage error."""

from __future__ import annotations

import pytest

from kinference.loadgen.cli import _plan, build_parser, main


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_public_flags_parse():
    args = parse("--bootstrap-servers", "h:1", "--request-topic", "rq", "--reply-topic", "rp", "--rate", "50",
                 "--duration", "3", "--payloads", "p.jsonl", "--timeout", "2", "--out", "o.json", "--plot",
                 "o.png")
    plan = _plan(args)
    assert (plan.rate, plan.duration_s, plan.timeout_s, plan.concurrency) == (50, 3, 2, None)
    assert (args.bootstrap_servers, args.request_topic, args.reply_topic) == ("h:1", "rq", "rp")


def test_sweep_takes_a_list_and_defaults_to_closed_loop():
    args = parse("--sweep-concurrency", "1,4,16", "--requests", "10")
    assert args.sweep_concurrency == [1, 4, 16]
    assert _plan(args).concurrency == 1
    assert _plan(parse()).concurrency == 1, "no mode given: one request at a time"


@pytest.mark.parametrize("argv", [
    ["--sweep-concurrency", "1,x"],
    ["--sweep-concurrency", "0,4"],
    ["--sweep-concurrency", "1,4", "--rate", "5"],
    ["--concurrency", "2", "--rate", "5"],
    ["--requests", "5", "--duration", "1"],
    ["--compare", "a.json"],
    ["--kafka", "novalue"],
])
def test_contradictions_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("env", [
    '{"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.password": "a,b=c", '
    '"enable.ssl.certificate.verification": false, "socket.timeout.ms": 30000}',
    "security.protocol=SSL,ssl.ca.location=/etc/kinference-tls/ca.crt\nssl.endpoint.identification.algorithm=https",
    "partition.assignment.strategy=range,roundrobin,client.id=a",
])
def test_loadgen_and_the_client_read_kinference_kafka_as_serve_does(env):
    from kinference import Client
    from kinference.consumer.config import load_config
    from kinference.loadgen.cli import kafka_properties

    served = load_config(environ={"KINFERENCE_KAFKA": env}).admin_config()
    assert kafka_properties([], {"KINFERENCE_KAFKA": env}) == served
    assert kafka_properties(["client.id=loadgen"], {"KINFERENCE_KAFKA": env}) == {**served, "client.id": "loadgen"}
    client = Client.from_env("requests", "replies", environ={"KINFERENCE_KAFKA": env,
                                                             "KINFERENCE_BOOTSTRAP_SERVERS": "kafka-1:9093"},
                             kafka={"client.id": "app"}, timeout_s=5)
    assert client._kafka == {**served, "client.id": "app"} and client._bootstrap_servers == "kafka-1:9093"


def test_a_malformed_kinference_kafka_is_refused_without_echoing_it():
    from kinference.loadgen.cli import kafka_properties

    with pytest.raises(ValueError, match="KINFERENCE_KAFKA: expected key=value") as raised:
        kafka_properties([], {"KINFERENCE_KAFKA": "sasl.password:S3cret"})
    assert "S3cret" not in str(raised.value)


def test_generative_requests_from_the_corpus_or_a_file():
    from kinference.loadgen.cli import generation_requests

    bodies = generation_requests([{"text": "kafka is"}, {"messages": [{"role": "user", "content": "hi"}]},
                                  {"prompt": "x", "max_completion_tokens": 3}], 16)
    assert bodies == [{"prompt": "kafka is", "max_tokens": 16},
                      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
                      {"prompt": "x", "max_completion_tokens": 3}]
    with pytest.raises(ValueError, match="JSON objects"):
        generation_requests(["plain text"], 16)
    with pytest.raises(ValueError, match="--max-tokens"):
        generation_requests([{"text": "a"}], 0)


def test_generative_plan_streams_and_waits_longer_by_default():
    plan = _plan(parse("--generative", "--concurrency", "4"))
    assert plan.generative and plan.timeout_s == 60.0
    assert _plan(parse("--generative", "--timeout", "5")).timeout_s == 5.0
    assert not _plan(parse()).generative and _plan(parse()).timeout_s == 10.0
