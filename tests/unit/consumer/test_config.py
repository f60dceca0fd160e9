import math

import pytest

from kinference.consumer.config import OPTIONS, ServiceConfig, load_config
from kinference.consumer.ops.cli import build_parser
from kinference.errors import ConfigError


def test_defaults_are_valid_safe_and_incremental():
    config = ServiceConfig()
    consumer = config.consumer_config()
    assert consumer["enable.auto.commit"] == "false" and consumer["enable.auto.offset.store"] == "false"
    assert consumer["partition.assignment.strategy"] == "cooperative-sticky" and config.incremental_rebalancing
    # librdkafka's own fetch wait: a low one is for the embedded broker only (consumer.broker.LOW_LATENCY_CONSUMER).
    assert "fetch.wait.max.ms" not in consumer
    assert config.producer_config()["enable.idempotence"] == "true" and config.producer_config()["acks"] == "all"
    # A producer is replaced only after librdkafka's own delivery timeout (300 s) has passed.
    assert config.stall_timeout_s == 330.0


def test_kip848_protocol_drops_the_classic_assignor_and_is_incremental():
    config = load_config({"kafka_consumer": ["group.protocol=consumer"]}, environ={})
    assert "partition.assignment.strategy" not in config.consumer_config() and config.incremental_rebalancing
    eager = load_config({"kafka_consumer": ["partition.assignment.strategy=range"]}, environ={})
    assert not eager.incremental_rebalancing


@pytest.mark.parametrize("prop", ["acks=1", "acks=0", "enable.idempotence=false"])
def test_producer_guarantees_cannot_be_weakened(prop):
    with pytest.raises(ConfigError, match="must stay"):
        load_config({"kafka_producer": [prop]}, environ={})
    assert load_config({"kafka_producer": ["acks=-1"]}, environ={}).producer_config()["acks"] == "-1"


def test_the_stall_timeout_must_exceed_librdkafkas_delivery_timeout():
    with pytest.raises(ConfigError, match="must exceed librdkafka's delivery timeout"):
        load_config({"producer_stall_timeout_s": 15}, environ={})
    config = load_config({"kafka_producer": ["message.timeout.ms=5000"]}, environ={})
    assert config.stall_timeout_s == 35.0
    assert load_config({"kafka_producer": ["message.timeout.ms=5000"], "producer_stall_timeout_s": 6},
                       environ={}).stall_timeout_s == 6


def test_reply_topic_allow_list():
    config = load_config({"reply_topic": "replies", "request_topics": "requests", "dead_letter_topic": "dead",
                          "reply_topics_allowed": "team-a-*,audit,requests,dead"}, environ={})
    assert config.reply_topic_allowed("replies") and config.reply_topic_allowed("team-a-replies")
    assert config.reply_topic_allowed("audit") and not config.reply_topic_allowed("team-b-replies")
    # Never the service's own input or its dead letters, whatever the patterns say.
    assert not config.reply_topic_allowed("requests") and not config.reply_topic_allowed("dead")
    assert not ServiceConfig().reply_topic_allowed("anything-else")


def test_internal_topics_are_never_reply_topics_whatever_the_patterns():
    """Issue 29, item 7: a pattern such as ``*`` admitted ``__consumer_offsets``, ``__transaction_state`` and
    ``_schemas``."""
    config = load_config({"reply_topics_allowed": "*,__consumer_offsets"}, environ={})
    for internal in ("__consumer_offsets", "__transaction_state", "__share_group_state", "_schemas",
                     "_confluent-command", "_confluent_balancer_api_state"):
        assert not config.reply_topic_allowed(internal), internal
    assert config.reply_topic_allowed("my_replies") and config.reply_topic_allowed("replies-1")


def test_the_producer_never_auto_creates_topics():
    """Issue 29, item 7: librdkafka's producer asks the broker to create a topic it looks up (its default); a
    reply-to header must never create one."""
    assert ServiceConfig().producer_config()["allow.auto.create.topics"] == "false"
    with pytest.raises(ConfigError, match=r"allow\.auto\.create\.topics must stay false"):
        load_config({"kafka_producer": ["allow.auto.create.topics=true"]}, environ={})


def test_precedence_cli_over_env_over_yaml(tmp_path):
    yaml_file = tmp_path / "kinference.yaml"
    yaml_file.write_text("max_batch_size: 8\nmax-batch-delay-ms: 7\ngroup_id: from-yaml\n"
                         "micro_batch_size: 4\nparallelism: {preprocess: 2, inference: 1, postprocess: 2}\n")
    env = {"KINFERENCE_MAX_BATCH_SIZE": "16", "KINFERENCE_GROUP_ID": "from-env"}
    config = load_config({"group_id": "from-cli", "max_batch_size": None}, yaml_file, env)
    assert config.group_id == "from-cli"
    batching = config.batching
    assert batching.max_batch_size == 16
    assert batching.max_batch_delay_ms == 7
    assert batching.micro_batch_size == 4
    threads = batching.parallelism
    assert (threads.preprocess, threads.inference, threads.postprocess) == (2, 1, 2)


def test_cli_flags_follow_field_names_and_parse():
    args = build_parser().parse_args([
        "serve", "--request-topics", "a, b", "--max-batch-size", "8", "--kafka", "security.protocol=SASL_SSL",
        "--kafka", "sasl.password=s3cret=x", "--handler-options", "top_k=3", "--parallelism",
        "preprocess=2,inference=1,postprocess=2", "--embedded-broker",
    ])
    config = load_config({name: getattr(args, name) for name in OPTIONS}, environ={})
    assert config.request_topics == ["a", "b"]
    assert config.batching.max_batch_size == 8 and config.embedded_broker is True
    assert config.handler_options == {"top_k": 3}
    assert config.consumer_config()["sasl.password"] == "s3cret=x"
    assert "s3cret" not in repr(config)  # pass-through values are secrets


def test_every_field_has_a_flag_and_description():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for name, field in OPTIONS.items():
        assert "--" + name.replace("_", "-") in help_text
        assert field.description


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"micro_batch_size": 64, "max_batch_size": 32}, "micro_batch_size (64) must not exceed"),
        ({"request_topics": "a,a"}, "distinct"),
        ({"reply_topic": "kinference-requests"}, "both a request topic and a reply"),
        ({"batch_policy": "fifo"}, "batch_policy"),
        ({"max_in_flight": 4, "max_batch_size": 8}, "max_in_flight (4) must be at least"),
        ({"resume_in_flight": 100, "max_in_flight": 100}, "resume_in_flight must be below"),
        ({"kafka": ["enable.auto.commit=true"]}, "kinference commits offsets itself"),
        ({"kafka": ["novalue"]}, "expected key=value"),
        ({"parallelism": {"inference": 0}}, "parallelism.inference"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_values_fail_with_a_message_naming_the_fix(values, message):
    with pytest.raises(ConfigError, match="invalid configuration") as info:
        load_config(values, environ={})
    assert message in str(info.value)


def test_env_bad_value_names_the_env_var():
    with pytest.raises(ConfigError, match="KINFERENCE_MAX_BATCH_SIZE"):
        load_config(environ={"KINFERENCE_MAX_BATCH_SIZE": "lots"})


def test_config_is_frozen():
    config = ServiceConfig()
    with pytest.raises(Exception, match="frozen"):
        config.group_id = "other"
    with pytest.raises(Exception, match="frozen"):
        config.batching.max_batch_size = 3


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(config_file=path, environ={})


def test_every_option_is_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text()
    for name, field in OPTIONS.items():
        default = field.default.model_dump() if hasattr(field.default, "model_dump") else field.default
        row = f"| `--{name.replace('_', '-')}` | `{default!r}` | `KINFERENCE_{name.upper()}` |"
        assert row in doc, f"docs/configuration.md lacks or misstates: {row}"


def test_key_value_options_merge_across_layers(tmp_path):
    yaml_file = tmp_path / "kinference.yaml"
    yaml_file.write_text("kafka:\n  security.protocol: SASL_SSL\n  sasl.username: from-yaml\n")
    env = {"KINFERENCE_KAFKA": '{"sasl.password": "from-secret", "sasl.username": "from-env"}'}
    config = load_config({"kafka": ["sasl.mechanism=PLAIN"]}, yaml_file, env)
    assert {k: v for k, v in config.consumer_config().items() if k.startswith(("sasl", "security"))} == {
        "security.protocol": "SASL_SSL", "sasl.username": "from-env", "sasl.password": "from-secret",
        "sasl.mechanism": "PLAIN"}


def test_kafka_property_numbers_and_booleans_become_librdkafka_strings(tmp_path):
    yaml_file = tmp_path / "kinference.yaml"
    yaml_file.write_text("kafka:\n  session.timeout.ms: 6000\n  enable.ssl.certificate.verification: false\n"
                         "kafka_producer:\n  linger.ms: 0.5\n")
    env = {"KINFERENCE_KAFKA_CONSUMER": '{"fetch.min.bytes": 1, "check.crcs": true}'}
    config = load_config(config_file=yaml_file, environ=env)
    consumer, producer = config.consumer_config(), config.producer_config()
    assert consumer["session.timeout.ms"] == "6000" and consumer["enable.ssl.certificate.verification"] == "false"
    assert consumer["fetch.min.bytes"] == "1" and consumer["check.crcs"] == "true"
    assert producer["linger.ms"] == "0.5"
    with pytest.raises(ConfigError, match="must be a string, a number or a boolean"):
        load_config({"kafka": {"sasl.mechanism": ["PLAIN"]}}, environ={})


def test_log_level_is_case_insensitive():
    assert load_config(environ={"KINFERENCE_LOG_LEVEL": "info"}).log_level == "INFO"
    assert load_config({"log_level": "Debug"}, environ={}).log_level == "DEBUG"


def test_metrics_turn_off_with_a_switch():
    args = build_parser().parse_args(["serve", "--no-metrics"])
    assert load_config({name: getattr(args, name) for name in OPTIONS}, environ={}).metrics is False
    assert load_config(environ={"KINFERENCE_METRICS": "false"}).metrics is False
    assert ServiceConfig().metrics is True
    with pytest.raises(ConfigError, match="metrics_port"):
        load_config({"metrics_port": -1}, environ={})


@pytest.mark.parametrize(("option", "prop", "names"), [
    ("kafka", "group.id", "--group-id"),
    ("kafka_consumer", "bootstrap.servers", "--bootstrap-servers"),
    ("kafka_producer", "transactional.id", "KINFERENCE_TRANSACTIONAL_ID"),
])
def test_pass_through_properties_cannot_override_first_class_options(option, prop, names):
    with pytest.raises(ConfigError, match=f"{prop} is set by") as info:
        load_config({option: [f"{prop}=sneaky"]}, environ={})
    assert names in str(info.value) and f"remove it from {option}" in str(info.value)


def test_env_map_values_may_hold_commas():
    env = {"KINFERENCE_KAFKA_CONSUMER": "partition.assignment.strategy=range,roundrobin,client.id=a,b",
           "KINFERENCE_KAFKA": "security.protocol=SASL_SSL\nsasl.mechanism=PLAIN"}
    config = load_config(environ=env)
    consumer = config.consumer_config()
    assert consumer["partition.assignment.strategy"] == "range,roundrobin" and consumer["client.id"] == "a,b"
    assert consumer["security.protocol"] == "SASL_SSL" and consumer["sasl.mechanism"] == "PLAIN"
    # A repeated flag is one pair each: never split.
    flags = load_config({"kafka_consumer": ["partition.assignment.strategy=range,x=y"]}, environ={})
    assert flags.consumer_config()["partition.assignment.strategy"] == "range,x=y"


def test_topic_plan_and_max_message_bytes_hold_a_maximal_dead_letter():
    config = load_config({"request_topics": "a,b", "partitions": "12", "topic_config": ["retention.ms=60000"]},
                         environ={"KINFERENCE_TOPIC_CONFIG": "min.insync.replicas=2"})
    assert config.topic_partitions() == {"a": 12, "b": 12, "kinference-replies": 12, "kinference-dead-letters": 1}
    assert config.topic_config == {"min.insync.replicas": "2", "retention.ms": "60000"}
    assert load_config({"reply_partitions": "3"}, environ={}).topic_partitions()["kinference-replies"] == 3
    needed = config.dead_letter_max_bytes
    assert needed == config.max_request_bytes + config.max_header_bytes + config.max_key_bytes + 4096
    assert load_config({"topic_config": [f"max.message.bytes={needed}"]}, environ={}).topic_config
    with pytest.raises(ConfigError, match=f"must hold the dead letter of a maximal request.*= {needed}"):
        load_config({"topic_config": [f"max.message.bytes={needed - 1}"]}, environ={})


def test_handler_timeout_has_a_flag_an_env_var_and_a_per_model_value():
    assert ServiceConfig().batching.handler_timeout_s == 300.0
    assert load_config(environ={"KINFERENCE_HANDLER_TIMEOUT_S": "12.5"}).batching.handler_timeout_s == 12.5
    config = load_config({"handler_timeout_s": 60, "models": [{"name": "a", "handler": "echo", "handler_timeout_s": 5},
                                                              {"name": "b", "handler": "echo"}]}, environ={})
    assert [model.batching.handler_timeout_s for model in config.model_configs()] == [5.0, 60.0]
    with pytest.raises(ConfigError, match="handler_timeout_s"):
        load_config({"handler_timeout_s": 0}, environ={})


def test_an_infinite_delivery_timeout_never_counts_as_a_stalled_producer():
    """Issue 20, defect 11: message.timeout.ms=0 (librdkafka: no limit) gave a stall timeout of 30 s, so after any
    outage over 30 s the idempotent producer was replaced, against the documented rule."""
    unlimited = {"kafka_producer": {"message.timeout.ms": "0"}}
    assert load_config(unlimited, environ={}).stall_timeout_s == math.inf
    with pytest.raises(ConfigError, match=r"message\.timeout\.ms=0"):
        load_config({**unlimited, "producer_stall_timeout_s": 60}, environ={})
    assert load_config({"kafka_producer": {"delivery.timeout.ms": "10000"}}, environ={}).stall_timeout_s == 40.0


def test_settings_that_trade_guarantees_away_are_refused_or_warned_about():
    with pytest.raises(ConfigError, match="read_uncommitted with delivery exactly-once"):
        load_config({"delivery": "exactly-once", "kafka_consumer": {"isolation.level": "read_uncommitted"}},
                    environ={})
    assert load_config({"kafka_consumer": {"isolation.level": "read_uncommitted"}}, environ={}).warnings() == []
    assert ServiceConfig().warnings() == []
    (warning,) = load_config({"kafka": {"auto.offset.reset": "latest"}}, environ={}).warnings()
    assert "never answered" in warning
