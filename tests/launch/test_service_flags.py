"""scripts/serve's extra flags go only to the services that take them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.launch.service_flags import SERVICES, split_service_args
from services.launch.stack import Stack, StackConfig
from shared.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def takers(args: list[str]) -> set[str]:
    return {service for service, share in split_service_args(args).items() if share}


def test_each_flag_goes_to_the_services_that_take_it():
    assert takers(["--served-model-name", "X"]) == {"gateway"}
    assert takers(["--api-key=k"]) == {"gateway"}
    assert takers(["--max-num-seqs", "4"]) == {"worker", "scheduler"}
    assert takers(["--no-async-scheduling"]) == {"worker", "scheduler"}
    assert takers(["--step-timeout", "9"]) == {"scheduler"}
    assert takers(["--scheduler-timeout", "9"]) == {"tokenizer"}
    assert takers(["--max-model-len", "64"]) == {"worker", "scheduler", "tokenizer"}
    assert takers(["--log-level", "DEBUG"]) == set(SERVICES)
    assert takers(["--chat-template", "t.jinja"]) == {"tokenizer"}
    assert takers(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == {"gateway"}
    assert takers(["--enable-prompt-tokens-details"]) == {"gateway"}
    for flag in ("--kv-offloading-size", "--kv-offloading-backend", "--kv-offloading-path", "--preemption-mode"):
        assert takers([flag, "x"]) == {"worker", "scheduler"}


def test_a_share_keeps_the_flags_values_and_order():
    shares = split_service_args(["--max-num-seqs", "4", "--served-model-name", "a,b", "--max-model-len", "64"])
    assert shares["scheduler"] == ["--max-num-seqs", "4", "--max-model-len", "64"]
    assert shares["tokenizer"] == ["--max-model-len", "64"]
    assert shares["gateway"] == ["--served-model-name", "a,b"]
    assert shares["detokenizer"] == []


def test_a_flag_no_service_takes_is_an_error():
    with pytest.raises(ConfigError, match="--no-such-flag"):
        split_service_args(["--max-num-seqs", "4", "--no-such-flag", "1"])
    with pytest.raises(ConfigError, match="'4'"):
        split_service_args(["4"])
    with pytest.raises(ConfigError, match="--no-such-flag"):
        Stack(StackConfig(args=["--no-such-flag"]))


def test_serve_rejects_an_unknown_flag_before_starting_anything():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "--no-such-flag"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "no service takes the flag --no-such-flag" in result.stderr
