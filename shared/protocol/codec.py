"""How a message goes on the bus: a ``Codec`` per message type, a ``Channel`` per subject.

A ``Codec`` is the msgpack encoder/decoder pair of one message type, made once. A
``Channel`` binds a subject, or a family of subjects (``{}`` in its pattern stands for
an engine id, a gateway id, a rank...), to the codec of the one message type published
there and, for request/reply subjects, to the reply's: ``shared/bus.py``'s ``publish``
and ``request`` take a channel and a message, and a message of another type is refused
before anything is sent, so a subject is never paired with the wrong type. The bytes
are msgspec's, whichever module the type lives in.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

SUBJECT_PREFIX = "llm"

M = TypeVar("M")
R = TypeVar("R")


class Codec(Generic[M]):
    """A msgpack encoder/decoder pair for one message type, made once."""

    __slots__ = ("type", "_encoder", "_decoder")

    def __init__(self, message_type: type[M]) -> None:
        self.type = message_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: M) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> M:
        return self._decoder.decode(data)


class RawCodec:
    """The payload as it is: empty (a hello, a ping), or JSON that both ends read
    themselves (the step profile)."""

    __slots__ = ()
    type = bytes

    def encode(self, message: bytes) -> bytes:
        return message

    def decode(self, data: bytes) -> bytes:
        return data


RAW = RawCodec()


class Channel(Generic[M, R]):
    """A subject pattern and the codecs of what goes over it: ``message`` published (or
    asked), ``reply`` answered (None: nobody answers)."""

    __slots__ = ("pattern", "message", "reply")

    def __init__(self, pattern: str, message: Codec[M] | RawCodec, reply: Codec[R] | RawCodec | None = None) -> None:
        self.pattern = pattern
        self.message = message
        self.reply = reply

    def subject(self, *parts: Any) -> str:
        """The subject for these parts of the pattern (``"*"`` for a wildcard)."""
        return self.pattern.format(*parts) if parts else self.pattern

    def encode(self, message: M) -> bytes:
        return _checked(self.message, message, self.pattern)

    def decode(self, data: bytes) -> M:
        return self.message.decode(data)

    def encode_reply(self, reply: R) -> bytes:
        return _checked(self.reply, reply, self.pattern)

    def decode_reply(self, data: bytes) -> R:
        return self.reply.decode(data)


def _checked(codec: Codec | RawCodec | None, message: Any, pattern: str) -> bytes:
    if codec is None or type(message) is not codec.type:
        expected = "nothing" if codec is None else codec.type.__name__
        raise TypeError(f"{pattern} carries {expected}, not {type(message).__name__}")
    return codec.encode(message)
