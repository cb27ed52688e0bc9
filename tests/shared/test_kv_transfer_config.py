"""vLLM's --kv-transfer-config (and its shorthand --kv-role): what is honoured, what stops start-up."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.launch.stack import Stack, StackConfig
from shared.cli import config_from_args
from shared.config import (
    KV_BOTH,
    KV_CONSUMER,
    KV_PRODUCER,
    NATS_CONNECTOR,
    ConfigError,
    KVTransferConfig,
    kv_transfer_config_json,
)
from shared.engine_args import add_engine_args

ROOT = Path(__file__).resolve().parents[2]


def from_flags(*args: str) -> KVTransferConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(KVTransferConfig, parser.parse_args(list(args)))


def config(**values) -> KVTransferConfig:
    return KVTransferConfig(kv_transfer_config=json.dumps(values))


@pytest.mark.parametrize("role", [KV_PRODUCER, KV_CONSUMER, KV_BOTH])
def test_vllms_json_sets_the_role(role):
    parsed = from_flags("--kv-transfer-config", json.dumps({"kv_connector": NATS_CONNECTOR, "kv_role": role}))
    assert parsed.kv_role == role
    assert KVTransferConfig(kv_transfer_config=kv_transfer_config_json(role)).kv_role == role


def test_the_honoured_optional_keys_are_taken():
    parsed = config(kv_connector=NATS_CONNECTOR, kv_role=KV_CONSUMER, kv_load_failure_policy="recompute",
                    kv_connector_extra_config={})
    assert parsed.kv_role == KV_CONSUMER and parsed.takes_handoffs and not parsed.takes_new_requests


def test_the_environment_variable_works_as_compose_sets_it(monkeypatch):
    monkeypatch.setenv("KV_TRANSFER_CONFIG", kv_transfer_config_json(KV_PRODUCER))
    parsed = from_flags()
    assert parsed.kv_role == KV_PRODUCER and parsed.hands_off


def test_kv_role_stays_a_shorthand_and_may_not_contradict():
    assert from_flags("--kv-role", KV_CONSUMER).kv_role == KV_CONSUMER
    assert from_flags().kv_role == ""
    agreeing = from_flags("--kv-role", KV_BOTH, "--kv-transfer-config", kv_transfer_config_json(KV_BOTH))
    assert agreeing.kv_role == KV_BOTH
    with pytest.raises(ConfigError, match="kv_role 'kv_producer' contradicts kv_transfer_config's 'kv_consumer'"):
        from_flags("--kv-role", KV_PRODUCER, "--kv-transfer-config", kv_transfer_config_json(KV_CONSUMER))


@pytest.mark.parametrize("field, value", [("kv_ip", "10.0.0.2"), ("kv_port", 14579), ("kv_buffer_size", 1e9),
                                          ("kv_rank", 0), ("engine_id", "p0"), ("kv_buffer_device", "cuda"),
                                          ("no_such_key", 1)])
def test_a_field_the_connector_cannot_honour_stops_start_up_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"cannot honour {field} .*it takes kv_connector, kv_role"):
        config(kv_connector=NATS_CONNECTOR, kv_role=KV_PRODUCER, **{field: value})


@pytest.mark.parametrize("values, message", [
    ({"kv_connector": NATS_CONNECTOR, "kv_role": "producer"}, "kv_role must be one of kv_producer, kv_consumer"),
    ({"kv_connector": NATS_CONNECTOR}, "kv_role must be one of .* got None"),
    ({"kv_connector": NATS_CONNECTOR, "kv_role": ""}, "kv_role must be one of"),
    ({"kv_connector": "NixlConnector", "kv_role": KV_PRODUCER}, "kv_connector must be 'NatsConnector'.*'NixlConnector'"),
    ({"kv_role": KV_PRODUCER}, "kv_connector must be 'NatsConnector'.* got None"),
    ({"kv_connector": NATS_CONNECTOR, "kv_role": KV_CONSUMER, "kv_load_failure_policy": "fail"},
     "kv_load_failure_policy must be 'recompute'"),
    ({"kv_connector": NATS_CONNECTOR, "kv_role": KV_CONSUMER, "kv_connector_extra_config": {"backend": "x"}},
     "takes no kv_connector_extra_config"),
])
def test_bad_values_stop_start_up(values, message):
    with pytest.raises(ConfigError, match=message):
        config(**values)


@pytest.mark.parametrize("text, message", [('{"kv_connector": "NatsConnector", kv_role}', "is not valid JSON"),
                                           ('["kv_producer"]', "must be a JSON object"),
                                           ("kv_producer", "is not valid JSON")])
def test_text_that_is_not_a_json_object_stops_start_up(text, message):
    with pytest.raises(ConfigError, match=f"kv_transfer_config {message}"):
        KVTransferConfig(kv_transfer_config=text)


def test_a_scheduler_started_with_an_unhonoured_field_exits_naming_it():
    bad = json.dumps({"kv_connector": NATS_CONNECTOR, "kv_role": KV_CONSUMER, "kv_port": 14579})
    done = subprocess.run([sys.executable, "-m", "services.scheduler", "--kv-transfer-config", bad], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "cannot honour kv_port" in done.stderr


def test_the_launcher_gives_pd_engines_their_roles_and_refuses_one_given_to_all():
    for flag in (["--kv-role", KV_BOTH], [f"--kv-transfer-config={kv_transfer_config_json(KV_BOTH)}"]):
        with pytest.raises(ConfigError, match="gives each engine its kv_role"):
            Stack(StackConfig(prefill_engines=1, decode_engines=1, args=flag))
    Stack(StackConfig(args=["--kv-transfer-config", kv_transfer_config_json(KV_BOTH)]))  # one engine: passed on
