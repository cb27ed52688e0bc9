"""Flags generated from config dataclasses: names, env defaults, types, and back to the config."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from shared.cli import add_config_flags, config_from_args
from shared.config import (
    CacheConfig,
    ConfigError,
    EngineServiceConfig,
    ModelRunConfig,
    ParallelConfig,
    SchedulerConfig,
    setting,
)
from shared.engine_args import ENGINE_CONFIGS, add_engine_args


@dataclass(frozen=True)
class Example:
    block_count: int = setting(4, "blocks")
    ratio: float = setting(0.5, "a fraction")
    name: str = setting("x", "a name")
    enabled: bool = setting(True, "a switch")
    cap: int | None = setting(None, "an optional cap")
    internal: float = 1.0  # no flag


def parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Example)
    return parser.parse_args(list(args))


def test_each_setting_is_a_flag_with_the_fields_default():
    assert config_from_args(Example, parse()) == Example()
    assert not hasattr(parse(), "internal")


def test_flags_are_typed_and_named_after_the_fields():
    args = parse("--block-count", "8", "--ratio", "0.25", "--name", "y", "--no-enabled", "--cap", "32")
    assert config_from_args(Example, args) == Example(8, 0.25, "y", False, 32)
    assert parse("--cap", "none").cap is None


def test_environment_variables_are_the_defaults(monkeypatch):
    monkeypatch.setenv("BLOCK_COUNT", "2")
    monkeypatch.setenv("ENABLED", "off")
    monkeypatch.setenv("CAP", "")
    assert config_from_args(Example, parse()) == Example(block_count=2, enabled=False)
    assert parse("--block-count", "3").block_count == 3  # a flag beats the environment


def test_a_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("RATIO", "half")
    with pytest.raises(ConfigError, match="RATIO='half'"):
        parse()


def test_config_from_args_takes_fields_without_flags():
    assert config_from_args(Example, parse(), internal=2.0).internal == 2.0


@pytest.fixture
def no_engine_env(monkeypatch):
    """The engine flags' environment variables unset (scripts/test sets OMP_WAIT_POLICY)."""
    for config_cls in ENGINE_CONFIGS:
        for field in dataclasses.fields(config_cls):
            monkeypatch.delenv(field.name.upper(), raising=False)


def test_the_engine_flags_default_to_the_configs_defaults(no_engine_env):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    for config_cls in ENGINE_CONFIGS:
        assert config_from_args(config_cls, args) == config_cls()


def test_engine_flags_fill_the_engine_configs(no_engine_env):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([
        "--engine-id", "e1", "--profile-steps", "--model", "m.gguf", "--max-model-len", "64", "--dtype", "bfloat16",
        "--no-cpu-prepack", "--block-size", "32", "--num-gpu-blocks", "100", "--no-enable-prefix-caching",
        "--max-num-seqs", "4", "--no-enable-chunked-prefill", "--no-async-scheduling",
        "--tensor-parallel-size", "2", "--rank", "1",
    ])
    assert config_from_args(EngineServiceConfig, args) == EngineServiceConfig("e1", True)
    assert config_from_args(ModelRunConfig, args) == ModelRunConfig(
        model="m.gguf", max_model_len=64, dtype="bfloat16", cpu_prepack=False
    )
    assert config_from_args(CacheConfig, args) == CacheConfig(
        block_size=32, num_gpu_blocks=100, enable_prefix_caching=False
    )
    assert config_from_args(SchedulerConfig, args) == SchedulerConfig(
        max_num_seqs=4, enable_chunked_prefill=False, async_scheduling=False
    )
    assert config_from_args(ParallelConfig, args) == ParallelConfig(tensor_parallel_size=2, rank=1)


def test_an_invalid_flag_value_fails_in_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(ConfigError, match="block_size"):
        config_from_args(CacheConfig, parser.parse_args(["--block-size", "12"]))
