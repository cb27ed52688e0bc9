"""Keeping the services together: membership, health, stats, restarts, LoRA adapters.

    worker -> scheduler: WorkerReady (its announcement and heartbeat)
    scheduler -> workers: hello (announce yourselves), WorkerRetire (exit)
    scheduler -> anyone: EngineStats, every second
    anyone -> a service: ping -> Pong
    launcher -> gateways: ServiceRestarts
    every service -> gateways: ServiceStatus, every heartbeat (the fleet on /dashboard)
    gateway -> gateways and workers: LoRAAdapters loaded and unloaded
"""

from __future__ import annotations

import msgspec

from shared.protocol.codec import RAW, SUBJECT_PREFIX, Channel, Codec
from shared.protocol.common import LoRARequest
from shared.protocol.kv_offload import KVOffloadWorkerInfo

ENGINE_STATS = f"{SUBJECT_PREFIX}.engine.stats"
PING = f"{SUBJECT_PREFIX}.ping"
# The launcher publishes how often it restarted each service (gateways show it in /metrics).
SERVICE_RESTARTS = f"{SUBJECT_PREFIX}.launcher.restarts"
# LoRA adapters loaded / unloaded at runtime: a gateway broadcasts each change to every
# gateway (their registries) and worker (which reads a loaded adapter ahead); a starting
# gateway asks the others for their adapters (request/reply).
# Every service replica says what it is and does, every heartbeat (no queue group: the
# gateways' /dashboard lists every replica).
SERVICE_STATUS = f"{SUBJECT_PREFIX}.status"
LORA_ADAPTERS = f"{SUBJECT_PREFIX}.lora.adapters"
LORA_LIST = f"{SUBJECT_PREFIX}.lora.list"


class EngineStats(msgspec.Struct, omit_defaults=True):
    """scheduler -> anyone (gateways for /metrics), published every second."""

    engine_id: str
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    ready: bool = False
    timestamp: float = 0.0
    incarnation: str = ""
    # Speculative decoding (vLLM's names): draft runs verified, their draft tokens, the
    # accepted ones, and acceptances by draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # P/D (KVTransferConfig): the engine's role, requests whose prompt KV is being pulled,
    # and the KV transfers so far (decode side: bytes pulled by every rank, seconds from
    # hand-off to loaded summed over requests, loads, failed loads, recomputed prompts).
    kv_role: str = ""
    num_requests_waiting_for_remote_kv: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_requests: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_fallbacks: int = 0
    # LoRA (vLLM's lora_requests_info): names of the adapters with running / waiting
    # requests, and --max-loras (0: LoRA off).
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    max_lora: int = 0
    # Where prompt tokens' KV came from, counted when a request first runs (vLLM's
    # prompt_tokens_by_source): computed, the device prefix cache, a KV connector (tiers).
    prompt_tokens_local_compute: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external_kv_transfer: int = 0
    # The tiered KV cache (vLLM's names; tiers by medium, "CPU" / "DISK"): prompt tokens
    # looked up past the device prefix cache and found; blocks looked up and found per tier;
    # bytes and seconds per transfer type (kv_offload.KV_OFFLOAD_TRANSFERS); the host tier's
    # use; the disk tier's bytes in use and its limit; stores not done; loads that failed or
    # timed out (recomputed); unit files found corrupt.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_block_queries: dict[str, int] = {}
    kv_offload_block_hits: dict[str, int] = {}
    kv_offload_bytes: dict[str, int] = {}
    kv_offload_seconds: dict[str, float] = {}
    kv_offload_cpu_cache_usage_perc: float = 0.0
    kv_offload_disk_bytes_used: int = 0
    kv_offload_disk_bytes_limit: int = 0
    kv_offload_stores_skipped: int = 0
    kv_offload_load_failures: int = 0
    kv_offload_corrupt_files: int = 0
    # Routing (services/router/): the block size its prefix cache hashes by and its blocks
    # (vLLM's num_gpu_blocks), the prompt tokens its waiting and running requests have yet
    # to compute, the requests it admitted (new and handed off: a router's count of what it
    # sent and the stats do not show yet ends there), and the sequence number of its last
    # KV event batch (0: events are off).
    block_size: int = 0
    num_gpu_blocks: int = 0
    num_prefill_tokens_pending: int = 0
    num_requests_admitted: int = 0
    kv_events_seq: int = 0


class WorkerReady(msgspec.Struct, omit_defaults=True):
    """worker -> scheduler: this rank is up, with its share of the KV cache."""

    engine_id: str
    rank: int
    world_size: int
    instance_id: str
    num_blocks: int
    max_model_len: int
    block_size: int
    vocab_size: int = 0  # the scheduler refuses token ids outside it (0: unknown)
    # Its progress through the steps of scheduler incarnation ``step_incarnation``: the last
    # step it finished (rank 0 had published its result by then) and the one it is on
    # (0: idle). The scheduler sees from them a step or a result lost on the bus.
    step_incarnation: str = ""
    last_step_id: int = 0
    running_step_id: int = 0
    # Per KV cache group, its sliding window (0: full attention); empty: one
    # full-attention group (shared/kv_cache_groups.py).
    sliding_windows: list[int] = []
    kv_offload: KVOffloadWorkerInfo | None = None  # its KV offloading tiers (None: off)


class WorkerRetire(msgspec.Struct, omit_defaults=True):
    """scheduler -> workers: these instances belong to a failed TP group and must exit."""

    engine_id: str
    instance_ids: list[str]


class ServiceRestarts(msgspec.Struct, omit_defaults=True):
    """launcher -> gateways: restarts so far, by service process name (e.g. "worker-0")."""

    counts: dict[str, int]


class ServiceStatus(msgspec.Struct, omit_defaults=True):
    """every service replica -> gateways on ``llm.status.<service>``, every heartbeat: its
    name and instance, what it is doing (``phase``: "serving", or what it waits for), its
    counters (``Service.info()``, what a ping answers) and where its Prometheus metrics are
    (``metrics_port``: 0 for none; a gateway's are on its HTTP port)."""

    service: str
    instance_id: str
    phase: str = "serving"
    info: dict = {}
    metrics_port: int = 0
    started_at: float = 0.0  # time.time() when the process started
    host: str = ""  # the host name the process runs on


class LoRAAdapters(msgspec.Struct, omit_defaults=True):
    """gateway -> every gateway and worker on ``LORA_ADAPTERS``: adapters loaded and names
    unloaded (idempotent: applying it twice changes nothing); also a gateway's answer on
    ``LORA_LIST`` (``loaded`` only: all it serves)."""

    loaded: list[LoRARequest] = []
    unloaded: list[str] = []


class Ping(msgspec.Struct, omit_defaults=True):
    pass


class Pong(msgspec.Struct, omit_defaults=True):
    service: str
    instance_id: str
    info: dict = {}


ENGINE_STATS_MSG = Codec(EngineStats)
WORKER_READY = Codec(WorkerReady)
WORKER_RETIRE = Codec(WorkerRetire)
SERVICE_RESTARTS_MSG = Codec(ServiceRestarts)
LORA_ADAPTERS_MSG = Codec(LoRAAdapters)
PONG = Codec(Pong)
SERVICE_STATUS_MSG = Codec(ServiceStatus)

ENGINE_STATS_CHANNEL = Channel(ENGINE_STATS, ENGINE_STATS_MSG)
# Every replica of service ``{}`` answers health pings here (queue group).
PING_CHANNEL = Channel(f"{PING}.{{}}", RAW, PONG)
# Workers of engine ``{}`` announce themselves here (and answer the scheduler's hello).
WORKER_READY_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.ready", WORKER_READY)
# The scheduler asks every worker rank of its engine to announce itself (empty).
WORKER_HELLO_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.hello", RAW)
# The scheduler tells the ranks of a failed TP group to exit (and be restarted).
WORKER_RETIRE_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.retire", WORKER_RETIRE)
# The scheduler answers with its step profile summary (JSON, asked in JSON) when profiling.
PROFILE_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.profile", RAW, RAW)
SERVICE_RESTARTS_CHANNEL = Channel(SERVICE_RESTARTS, SERVICE_RESTARTS_MSG)
# Every replica of service ``{}`` says what it does (gateways read ``subject("*")``).
SERVICE_STATUS_CHANNEL = Channel(f"{SERVICE_STATUS}.{{}}", SERVICE_STATUS_MSG)
LORA_ADAPTERS_CHANNEL = Channel(LORA_ADAPTERS, LORA_ADAPTERS_MSG)
# A gateway's answer: ``loaded`` only, all it serves.
LORA_LIST_CHANNEL = Channel(LORA_LIST, RAW, LORA_ADAPTERS_MSG)

ping_subject = PING_CHANNEL.subject
service_status_subject = SERVICE_STATUS_CHANNEL.subject
engine_ready_subject = WORKER_READY_CHANNEL.subject
engine_hello_subject = WORKER_HELLO_CHANNEL.subject
engine_retire_subject = WORKER_RETIRE_CHANNEL.subject
engine_profile_subject = PROFILE_CHANNEL.subject
