"""Channels bind each subject to its message type: a wrong pairing is refused before it is sent."""

import pytest

from shared import protocol
from shared.protocol import (
    ABORT_CHANNEL,
    KV_PULL_CHANNEL,
    PING_CHANNEL,
    STEP_CHANNEL,
    AbortRequest,
    Channel,
    KVPull,
    ModelRunnerOutput,
    SchedulerOutput,
)


def test_a_channel_names_its_subjects_as_the_subject_functions_do():
    assert STEP_CHANNEL.subject("e0") == protocol.engine_step_subject("e0") == "llm.engine.e0.step"
    assert KV_PULL_CHANNEL.subject("e0", 1) == "llm.engine.e0.kv.pull.1"
    assert ABORT_CHANNEL.subject("*") == "llm.abort.*"
    assert PING_CHANNEL.subject("tokenizer") == protocol.ping_subject("tokenizer") == "llm.ping.tokenizer"
    assert protocol.ENGINE_STATS_CHANNEL.subject() == protocol.ENGINE_STATS


def test_a_channel_encodes_only_its_own_message_type():
    step = SchedulerOutput(step_id=7)
    assert STEP_CHANNEL.decode(STEP_CHANNEL.encode(step)) == step
    assert STEP_CHANNEL.encode(step) == protocol.SCHEDULER_OUTPUT.encode(step)  # the same bytes as before
    with pytest.raises(TypeError, match="llm.engine.{}.step carries SchedulerOutput, not ModelRunnerOutput"):
        STEP_CHANNEL.encode(ModelRunnerOutput(step_id=7))
    with pytest.raises(TypeError, match="carries KVPull, not AbortRequest"):
        KV_PULL_CHANNEL.encode(AbortRequest(["r"]))
    with pytest.raises(TypeError, match="carries nothing"):
        ABORT_CHANNEL.encode_reply(AbortRequest(["r"]))  # nobody answers an abort
    assert KV_PULL_CHANNEL.decode(KV_PULL_CHANNEL.encode(KVPull("r", "i", 0, 1, 0, 2))).req_id == "r"


def test_every_subject_has_exactly_one_channel():
    channels = [v for v in vars(protocol).values() if isinstance(v, Channel)]
    patterns = [c.pattern for c in channels]
    assert len(patterns) == len(set(patterns))
    assert len(channels) >= 25
