"""P/D disaggregation: a prefilled request and its prompt's KV, from a prefill engine to a
decode engine (docs/ARCHITECTURE.md).

    prefill scheduler -> decode scheduler: KVHandoff -> KVHandoffReply
    decode scheduler -> prefill scheduler: KVRelease (the held blocks may go)
    decode worker rank -> the same prefill worker rank: KVPull -> KVChunk
    scheduler -> its workers: KVConnectorMetadata (in each step, and at once on kv.serve)
    decode worker rank -> rank 0 -> scheduler: KVRecvDone, KVLoadsDone
"""

from __future__ import annotations

import msgspec

from shared.protocol.codec import SUBJECT_PREFIX, Channel, Codec
from shared.protocol.client import EngineRequest
from shared.protocol.kv_offload import KVOffloadLoad, KVOffloadSpill, KVOffloadStore


class KVRecvSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """P/D, decode side: one request whose prompt KV the workers pull into ``block_ids``
    (the local blocks to fill, in order): blocks ``first_block ..`` of the request held by
    engine ``remote_engine_id`` (its scheduler incarnation ``remote_incarnation``); each
    rank pulls its own shard from the same rank there."""

    req_id: str
    block_ids: list[int]
    first_block: int
    remote_engine_id: str
    remote_incarnation: str


class KVSendSpec(msgspec.Struct, array_like=True, gc=False):
    """P/D, prefill side: a finished request whose blocks the workers may serve to the
    decode side until told to stop (``KVConnectorMetadata.reqs_not_to_send``)."""

    req_id: str
    block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The scheduler's connectors -> the workers' (vLLM's ``KVConnectorMetadata``; both the
    P/D connector's and the offloading connector's parts, as vLLM's MultiConnector carries
    one per connector), carried by the step diff. Workers apply it before the step's
    forward pass, in this order: cancel loads (either connector's), spill and store to the
    tiers (done before the pass), stop serving, start serving, start loads."""

    reqs_to_recv: list[KVRecvSpec] = []
    reqs_to_send: list[KVSendSpec] = []
    # Released or timed out: the blocks are free again, never serve them after this step.
    reqs_not_to_send: list[str] = []
    # Loads given up (timed out, aborted): never write into their blocks after this step.
    reqs_to_cancel: list[str] = []
    # The tiered KV cache (kv_offload.py): host units to write to disk before their slots
    # are reused, device blocks to copy down, requests' blocks to load back.
    offload_spills: list[KVOffloadSpill] = []
    offload_stores: list[KVOffloadStore] = []
    offload_loads: list[KVOffloadLoad] = []

    def is_empty(self) -> bool:
        return not (self.reqs_to_recv or self.reqs_to_send or self.reqs_not_to_send or self.reqs_to_cancel
                    or self.offload_spills or self.offload_stores or self.offload_loads)


class KVTransferParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """Where a handed-off request's prompt KV lies (vLLM's ``kv_transfer_params``): the
    first ``num_remote_tokens`` tokens, in ``num_remote_blocks`` blocks held by engine
    ``remote_engine_id`` (scheduler incarnation ``remote_incarnation``) with ``remote_world_size``
    TP ranks and ``remote_block_size`` tokens per block."""

    remote_engine_id: str
    remote_incarnation: str
    num_remote_tokens: int
    num_remote_blocks: int
    remote_world_size: int = 1
    remote_block_size: int = 16


class KVHandoff(msgspec.Struct, omit_defaults=True):
    """prefill scheduler -> decode scheduler (``engine_kv_handoff_subject``, request/reply):
    go on with this request; its prompt's KV is held for you (``kv_transfer_params``) and its
    first output token(s) are already sent to the client. Idempotent: a known id is taken
    as accepted."""

    request: EngineRequest
    output_token_ids: list[int]
    kv_transfer_params: KVTransferParams
    num_cached_tokens: int = 0


class KVHandoffReply(msgspec.Struct, omit_defaults=True):
    """decode scheduler -> prefill scheduler: taken (by the engine and incarnation named), or
    why not (the prefill side then tries another engine or decodes it itself)."""

    accepted: bool
    error: str = ""
    engine_id: str = ""
    incarnation: str = ""
    admission: int = 0  # as EngineRequestReply.admission


class KVRelease(msgspec.Struct, omit_defaults=True):
    """decode scheduler -> prefill scheduler (``engine_kv_release_subject``): the held blocks
    of these requests (of scheduler incarnation ``incarnation``) may go. Idempotent; a lost
    one costs the hold until its timeout."""

    request_ids: list[str]
    incarnation: str


class KVPull(msgspec.Struct, array_like=True, gc=False):
    """decode worker rank -> the same prefill worker rank (``engine_kv_pull_subject``): the
    KV of blocks ``first_block .. first_block + num_blocks`` of held request ``req_id``, layers
    ``first_layer .. first_layer + num_layers``."""

    req_id: str
    incarnation: str
    first_block: int
    num_blocks: int
    first_layer: int
    num_layers: int


class KVChunk(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to a ``KVPull``: per layer, keys then values of the blocks, raw
    (``services/worker/kv_transfer/block_io.py``); or an error, ``retry`` when the blocks are
    not served yet (the step that starts serving them is still on its way)."""

    data: bytes = b""
    error: str = ""
    retry: bool = False


class KVRecvDone(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """decode worker rank -> rank 0 of its engine (``engine_kv_recvd_subject``): loads this
    rank finished and failed. Idempotent."""

    rank: int
    finished: list[str] = []
    failed: list[str] = []


class KVLoadsDone(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """decode worker rank 0 -> its scheduler (``engine_kv_loaded_subject``): loads every rank
    finished and loads some rank failed, pushed when they end while no step runs there (a
    step's ``ModelRunnerOutput`` carries them otherwise), and the bytes rank 0 pulled. The next
    step's result repeats the ids (the scheduler ignores loads it no longer waits for), so a
    lost push costs the wait for the scheduler's next step."""

    incarnation: str
    finished: list[str] = []
    failed: list[str] = []
    kv_bytes: int = 0


KV_HANDOFF = Codec(KVHandoff)
KV_HANDOFF_REPLY = Codec(KVHandoffReply)
KV_RELEASE = Codec(KVRelease)
KV_PULL = Codec(KVPull)
KV_CHUNK = Codec(KVChunk)
KV_RECV_DONE = Codec(KVRecvDone)
KV_LOADS_DONE = Codec(KVLoadsDone)
KV_CONNECTOR_METADATA = Codec(KVConnectorMetadata)

_ENGINE_KV = f"{SUBJECT_PREFIX}.engine.{{}}.kv"
# A prefill engine's scheduler hands a prefilled request to decode engine ``{}``'s
# scheduler (request/reply).
KV_HANDOFF_CHANNEL = Channel(f"{_ENGINE_KV}.handoff", KV_HANDOFF, KV_HANDOFF_REPLY)
# A decode engine's scheduler tells prefill engine ``{}``'s scheduler that it may free a
# request's held blocks (no reply).
KV_RELEASE_CHANNEL = Channel(f"{_ENGINE_KV}.release", KV_RELEASE)
# A decode worker rank asks prefill worker rank ``{1}`` of engine ``{0}`` for a chunk of a
# held request's KV blocks (request/reply).
KV_PULL_CHANNEL = Channel(f"{_ENGINE_KV}.pull.{{}}", KV_PULL, KV_CHUNK)
# A prefill engine's scheduler tells every worker rank at once which held requests they
# may serve (``reqs_to_send`` only), not waiting for the next step to reach them behind a
# long prefill; the step carries it too.
KV_SERVE_CHANNEL = Channel(f"{_ENGINE_KV}.serve", KV_CONNECTOR_METADATA)
# Under TP: a decode worker rank tells rank 0 of its engine which loads it ended; rank 0
# reports a load once every rank ended it.
KV_RECV_DONE_CHANNEL = Channel(f"{_ENGINE_KV}.recvd", KV_RECV_DONE)
# Rank 0 of a decode engine tells its scheduler at once that loads ended while no step was
# running, so the scheduler need not send steps to learn it.
KV_LOADS_DONE_CHANNEL = Channel(f"{_ENGINE_KV}.loaded", KV_LOADS_DONE)

engine_kv_handoff_subject = KV_HANDOFF_CHANNEL.subject
engine_kv_release_subject = KV_RELEASE_CHANNEL.subject
engine_kv_pull_subject = KV_PULL_CHANNEL.subject
engine_kv_serve_subject = KV_SERVE_CHANNEL.subject
engine_kv_recvd_subject = KV_RECV_DONE_CHANNEL.subject
engine_kv_loaded_subject = KV_LOADS_DONE_CHANNEL.subject
