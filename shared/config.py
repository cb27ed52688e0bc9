"""Engine configuration: one frozen dataclass per concern, validated on creation.

A field made with ``setting(default, help)`` is a command-line flag: ``--field-name``,
defaulting to the environment variable ``FIELD_NAME``, else to the field's default
(``shared/cli.py`` builds the flags and the config back from them). Fields made
otherwise have no flag. Nothing deep in the engine reads the environment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shared.config_error import ConfigError
from shared.cpu_sets import check_bind


def setting(default, help: str):
    """A dataclass field that is also a flag (``--name``, env ``NAME``) described by ``help``."""
    return field(default=default, metadata={"help": help})


def model_setting():
    return setting("", "GGUF file or Hugging Face folder ('' = the default SmolLM2 model)")


def max_model_len_setting():
    return setting(None, "context length cap (default: the model's)")


def structured_outputs_warmup_setting():
    # Off, the first constrained request after a start waits for the import and the
    # vocabulary: ~4.5 s of CPU in a tokenizer (xgrammar imports torch and transformers),
    # ~1.5 s in a worker, whose step (every running request) waits for it.
    return setting(True, "build the structured-output backend (import xgrammar, read the vocabulary) in the "
                         "background at start-up, so the first constrained request does not wait for it; off: "
                         "on the first such request (a tokenizer replica that never sees one then stays ~230 MiB "
                         "smaller)")


def check_max_model_len(value: int | None) -> None:
    if value is not None and value < 2:
        raise ConfigError(f"max_model_len must be >= 2, got {value}")


@dataclass(frozen=True)
class EngineServiceConfig:
    """What an engine's scheduler and workers share besides the engine configs."""

    engine_id: str = setting("0", "engine (model replica) id shared by its scheduler and workers")
    profile_steps: bool = setting(False, "time each step's phases (scripts/bench_overhead.py)")


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, pool size and prefix caching."""

    block_size: int = setting(16, "tokens per KV cache block")
    # Either an explicit block count, or a fraction of the device's memory.
    num_gpu_blocks: int | None = setting(None, "explicit KV cache size in blocks")
    gpu_memory_utilization: float = setting(0.9, "fraction of GPU memory to use")
    # On CPU the pool is sized from this many GiB unless num_gpu_blocks is set.
    cpu_kv_cache_gib: float = setting(1.0, "KV cache size on CPU in GiB")
    enable_prefix_caching: bool = setting(True, "prefix caching")
    prefix_cache_protected_fraction: float = setting(
        0.8, "of the KV blocks, at most this fraction wait free as prefix-cache blocks that were hit, evicted after "
             "those never hit (segmented LRU: a shared prompt prefix outlives each request's own blocks); 0 = plain "
             "LRU")
    kv_cache_dtype: str = setting(
        "auto", "KV cache storage: auto (the model's dtype) | bfloat16 (also under a float32 model on CPU) | float32")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype.startswith("fp8"):
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype!r}: fp8 KV caches are not supported; "
                              f"choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ConfigError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if not 0.0 <= self.prefix_cache_protected_fraction <= 1.0:
            raise ConfigError(f"prefix_cache_protected_fraction must be in [0, 1], "
                              f"got {self.prefix_cache_protected_fraction}")


# Speculative decoding: the keys each method of --speculative-config takes (vLLM's names).
_SPECULATIVE_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size"},
    "draft_model": {"method", "model", "num_speculative_tokens", "disable_by_batch_size"},
}
# Keys whose value is a string; every other key but "method" takes an integer.
_SPECULATIVE_STRING_KEYS = {"method", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` draft tokens per request and step, proposed by ``method``.

    ngram (prompt lookup): the last n tokens of the request (n from ``prompt_lookup_max``
    down to ``prompt_lookup_min``) are looked up earlier in its tokens, and the tokens that
    followed there are the drafts. draft_model: ``model`` (a GGUF file or Hugging Face
    folder with the target's tokenizer) runs beside the target on every worker rank and
    proposes the drafts autoregressively. ``disable_by_batch_size``: no drafts are
    scheduled while more requests than this run or wait (0: no limit), as in vLLM.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 0
    model: str = ""


def json_object_setting(name: str, text: str) -> dict | None:
    """The JSON object a setting such as --speculative-config holds (None for ""); a
    ConfigError naming the setting for anything else."""
    if not text.strip():
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{name} must be a JSON object, got {text!r}")
    return values


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The config in ``text`` (JSON object), None for ""; ConfigError naming what is wrong."""
    values = json_object_setting("speculative_config", text)
    if values is None:
        return None
    method = values.get("method")
    if method not in _SPECULATIVE_KEYS:
        raise ConfigError(f"speculative_config: method must be one of {', '.join(_SPECULATIVE_KEYS)}, "
                          f"got {method!r}")
    unknown = sorted(set(values) - _SPECULATIVE_KEYS[method])
    if unknown:
        raise ConfigError(f"speculative_config: method {method!r} takes no key(s) {', '.join(unknown)}; "
                          f"it takes {', '.join(sorted(_SPECULATIVE_KEYS[method]))}")
    for key, value in values.items():
        if key in _SPECULATIVE_STRING_KEYS:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"speculative_config: {key} must be a non-empty string, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"speculative_config: {key} must be an integer, got {value!r}")
    if "num_speculative_tokens" not in values:
        raise ConfigError("speculative_config: num_speculative_tokens is required")
    if method == "draft_model" and "model" not in values:
        raise ConfigError("speculative_config: method 'draft_model' needs model (a GGUF file or Hugging Face folder)")
    config = SpeculativeConfig(**values)
    if not 1 <= config.num_speculative_tokens <= 16:
        raise ConfigError(f"speculative_config: num_speculative_tokens must be in [1, 16], "
                          f"got {config.num_speculative_tokens}")
    if config.disable_by_batch_size < 0:
        raise ConfigError(f"speculative_config: disable_by_batch_size must be >= 0, "
                          f"got {config.disable_by_batch_size}")
    if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
        raise ConfigError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                          f"{config.prompt_lookup_min} and {config.prompt_lookup_max}")
    return config


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget and batch limits of one engine step (V1: no prefill/decode phases)."""

    max_num_batched_tokens: int = setting(2048, "token budget per step")
    max_num_seqs: int = setting(128, "max requests per step")
    long_prefill_token_threshold: int = setting(0, "max prompt chunk per request and step (0 = no cap)")
    enable_chunked_prefill: bool = setting(
        True, "split a prompt over steps; off: a prompt is scheduled whole or waits"
    )
    # The scheduler service sends step N+1 before step N's result is back (see
    # services/scheduler/scheduler.py); off: one step at a time.
    async_scheduling: bool = setting(True, "schedule and send step N+1 while step N runs")
    speculative_config: str = setting(
        "", 'speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft_model", "model": PATH, '
            '"num_speculative_tokens": 4} (turns async scheduling off)'
    )
    # The parsed speculative_config (None: no speculative decoding).
    speculative: SpeculativeConfig | None = field(init=False, default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
        object.__setattr__(self, "speculative", parse_speculative_config(self.speculative_config))

    @property
    def schedules_ahead(self) -> bool:
        """Whether steps are scheduled before the previous step's tokens are known. Not with
        speculative decoding: a step's drafts are proposed from the tokens the step before
        sampled, and how many of its drafts were accepted decides the next step's positions."""
        return self.async_scheduling and self.speculative is None


# --quantization's methods (vLLM's flag; "auto" and "none" are ours).
QUANTIZATION_METHODS = ("none", "auto", "gguf")
OMP_WAIT_POLICIES = ("passive", "active", "default")
SMALL_STEP_THREADS = ("auto", "one", "all")


@dataclass(frozen=True)
class ModelRunConfig:
    """How a worker runs the model: which weights, dtype, device, kernels."""

    model: str = model_setting()
    dtype: str = setting("auto", "auto|float32|bfloat16|float16 (auto: bfloat16 on CUDA, on CPUs with native bf16 dot "
                                 "products, and where the GGUF weights stay quantized; else float32)")
    device: str = setting("auto", "auto|cpu|cuda|cuda:N")
    kernel_backend: str = setting("auto", "auto|torch|triton")
    # CPU: services/worker/linear.py weight_packer.
    cpu_prepack: bool = setting(True, "CPU: float weight matrices laid out once for their products (oneDNN's "
                                      "prepacking, or the batch-invariant kernel's tiles); off: F.linear")
    # vLLM's flag name; services/worker/layers/linear.py, shared/gguf_quants.py. auto by
    # default: on the benchmark CPU the quantized products (int8 activations from 4 rows on)
    # are ~1.8x bfloat16 oneDNN's at 1 row and 1.0-1.3x from 8 rows on, in 1/3 of the
    # memory (docs/BENCHMARKS.md, "int8 activations"); the exact-vs-HF tests run with none.
    quantization: str = setting(
        "auto", "none|auto|gguf: auto keeps a GGUF file's Q8_0 matrices as int8 and Q4_0/Q4_1/Q4_K as int4 "
                "(~5x less weight memory; one rank only); gguf (vLLM's name) the same, refused for a "
                "Hugging Face folder or under TP; none dequantizes every weight to --dtype")
    max_model_len: int | None = max_model_len_setting()
    seed: int = setting(0, "seed of the worker's shared sampling generator")
    structured_outputs_warmup: bool = structured_outputs_warmup_setting()
    # Applied by the worker before torch loads OpenMP (services/worker/openmp_wait.py). The
    # flag's environment variable is OpenMP's own, so an OMP_WAIT_POLICY already set wins.
    # libgomp's default (idle threads spin ~3 ms, then sleep) is the fastest when the worker
    # has its cores to itself: served at concurrency 32 on the 2-core benchmark machine,
    # passive gave 0.83-0.84x of its throughput when quiet, but 2-9x of it beside other work,
    # where spinning threads hold the cores that the thread ending their wait needs
    # (docs/BENCHMARKS.md, "Concurrency 32 served"). Passive is for workers sharing cores.
    omp_wait_policy: str = setting(
        "default", "CPU: OpenMP wait policy of the worker's threads: default (libgomp's: an idle thread spins "
                   "~3 ms, then sleeps; fastest on cores of its own) | passive (it sleeps at once; far faster "
                   "when other processes share the cores) | active (it spins); GOMP_SPINCOUNT, if set, overrides "
                   "the spin time of any of them")

    # services/worker/cpu_binding.py; scripts/serve gives each of several workers its share.
    cpu_omp_threads_bind: str = setting(
        "auto", "CPU: the cores this worker's threads run on (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto|nobind (every "
                "core it may use), a list such as 0-3,8, or one list per TP rank separated by | (rank r takes "
                "entry r); its OpenMP pool gets one thread per core")

    # On by default: it costs no throughput here (docs/BENCHMARKS.md, "Batch invariance"). vLLM's
    # counterpart is the opt-in VLLM_BATCH_INVARIANT; kernels/paged_attention_torch.py, services/worker/linear.py.
    batch_invariant: bool = setting(
        True, "CPU: a request's tokens do not depend on the other requests in its steps nor on how its prompt "
              "was chunked or cached (every query token attended alone, products computed row by row in one "
              "order); off: attention of prompt chunks by padded SDPA calls and products chosen by row count")

    # services/worker/small_step_threads.py: whether a second thread shortens a batch-1
    # decode step served depends on the machine (one thread faster on the AVX-512 benchmark
    # CPU, both 1.1-1.3x faster on an AVX2-only one), so by default the worker measures both.
    cpu_single_thread_max_tokens: int = setting(
        1, "CPU: steps of at most this many tokens (1: one request decoding) are small steps, run on the "
           "threads --cpu-small-step-threads chooses; 0: every step on all threads")
    cpu_small_step_threads: str = setting(
        "auto", "CPU: threads of a small step: auto (the worker times runs of small steps on one thread and on "
                "all, keeps the faster, and measures the other again every few thousand) | one (the other cores "
                "left to the stack's other services) | all")

    def __post_init__(self) -> None:
        object.__setattr__(self, "omp_wait_policy", self.omp_wait_policy.lower())
        if self.cpu_single_thread_max_tokens < 0:
            raise ConfigError(f"cpu_single_thread_max_tokens must be >= 0, got {self.cpu_single_thread_max_tokens}")
        if self.cpu_small_step_threads not in SMALL_STEP_THREADS:
            raise ConfigError(f"cpu_small_step_threads must be {'|'.join(SMALL_STEP_THREADS)}, "
                              f"got {self.cpu_small_step_threads!r}")
        try:
            check_bind(self.cpu_omp_threads_bind)
        except ValueError as e:
            raise ConfigError(f"cpu_omp_threads_bind {self.cpu_omp_threads_bind!r}: {e}") from None
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ConfigError(f"omp_wait_policy must be passive|active|default, got {self.omp_wait_policy!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"kernel_backend must be auto|torch|triton, got {self.kernel_backend!r}"
            )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                              f"got {self.quantization!r}")
        check_max_model_len(self.max_model_len)

    def keeps_gguf_quantized(self, model_kind: str, tensor_parallel_size: int) -> bool:
        """Whether the worker keeps a GGUF file's Q8_0 / Q4_* matrices quantized, for a model
        of ``model_kind`` ("gguf" or "hf") run on that many ranks. ``gguf`` (vLLM's method
        name) asks for exactly that and stops start-up where it cannot be done; ``auto``
        does it where it can (a rank's shard is not a whole quantized tensor)."""
        if self.quantization == "gguf" and model_kind != "gguf":
            raise ConfigError(f"quantization 'gguf' needs a GGUF model file; {self.model or 'the model'} is a "
                              f"Hugging Face folder (use --quantization none)")
        if self.quantization == "gguf" and tensor_parallel_size > 1:
            raise ConfigError("quantization 'gguf' keeps whole quantized matrices, which tensor parallelism "
                              "does not shard: use --quantization auto (dequantizes under TP) or none")
        return self.quantization in ("auto", "gguf") and model_kind == "gguf" and tensor_parallel_size == 1


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags): adapters over the base model, mixed in one batch."""

    enable_lora: bool = setting(False, "serve LoRA adapters")
    max_loras: int = setting(1, "distinct LoRA adapters in one step (the workers' adapter slots)")
    max_lora_rank: int = setting(16, "largest LoRA rank accepted")
    max_cpu_loras: int | None = setting(None, "adapters each worker keeps in host memory (default: max_loras)")
    lora_modules: str = setting("", "adapters served from the start, space-separated: 'name=path', "
                                      "'name=path:pinned' (never evicted) or vLLM's JSON "
                                      "'{\"name\": .., \"path\": .., \"base_model_name\": .., \"pinned\": true}'")

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self.modules()  # a malformed --lora-modules stops start-up

    @property
    def host_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def modules(self) -> list:
        """``lora_modules`` as ``LoRARequest``s (``shared.lora.parse_lora_modules``: name=path,
        name=path:pinned or vLLM's JSON objects), checked for the pinned ones to fit the slots."""
        from shared.lora import check_pinning, parse_lora_modules

        try:
            modules = parse_lora_modules(self.lora_modules)
            check_pinning(modules, self.max_loras)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return modules


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: this process's rank among the engine's workers."""

    tensor_parallel_size: int = setting(1, "ranks per engine")
    rank: int = setting(0, "this worker's tensor-parallel rank")
    dist_init_method: str = setting("", "torch.distributed rendezvous, e.g. tcp://host:29500")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ConfigError(
                f"rank must be in [0, {self.tensor_parallel_size}), got {self.rank}"
            )


# P/D disaggregation roles (vLLM's kv_role values).
KV_PRODUCER = "kv_producer"  # a prefill engine: takes new requests, hands them off after the first token
KV_CONSUMER = "kv_consumer"  # a decode engine: takes hand-offs only, pulls their prompt KV
KV_BOTH = "kv_both"  # takes new requests and decodes them itself, and takes hand-offs
KV_ROLES = ("", KV_PRODUCER, KV_CONSUMER, KV_BOTH)
# The one KV connector (services/scheduler/kv_connector.py, services/worker/kv_transfer/): decode
# ranks pull prompt KV from the same prefill rank over the NATS bus. vLLM's connectors
# (NixlConnector, P2pNcclConnector, LMCacheConnectorV1, ...) name transports and stores it lacks.
NATS_CONNECTOR = "NatsConnector"
# The --kv-transfer-config keys (vLLM's names) this connector honours. Any other key (kv_ip,
# kv_port, kv_rank, kv_parallel_size, kv_buffer_size, kv_buffer_device, engine_id,
# kv_connector_module_path, ...) configures something it does not have and stops start-up.
_KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_load_failure_policy", "kv_connector_extra_config")


def kv_transfer_config_json(kv_role: str) -> str:
    """The ``--kv-transfer-config`` value that gives an engine ``kv_role``."""
    return json.dumps({"kv_connector": NATS_CONNECTOR, "kv_role": kv_role})


def parse_kv_transfer_config(text: str) -> str:
    """The kv_role of vLLM's ``--kv-transfer-config`` JSON ("" for ""); ConfigError naming
    what this engine cannot honour."""
    values = json_object_setting("kv_transfer_config", text)
    if values is None:
        return ""
    unknown = sorted(set(values) - set(_KV_TRANSFER_KEYS))
    if unknown:
        raise ConfigError(f"kv_transfer_config: {NATS_CONNECTOR} cannot honour {', '.join(unknown)} (KV moves over "
                          f"the NATS bus, each decode rank pulling from the same prefill rank; the engine's id is "
                          f"--engine-id); it takes {', '.join(_KV_TRANSFER_KEYS)}")
    connector = values.get("kv_connector")
    if connector != NATS_CONNECTOR:
        raise ConfigError(f"kv_transfer_config: kv_connector must be {NATS_CONNECTOR!r} (KV over the NATS bus, the "
                          f"only connector this engine has), got {connector!r}")
    role = values.get("kv_role")
    if role not in KV_ROLES[1:]:
        raise ConfigError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES[1:])}, got {role!r}")
    policy = values.get("kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ConfigError(f"kv_transfer_config: kv_load_failure_policy must be 'recompute' ({NATS_CONNECTOR} "
                          f"recomputes a prompt whose KV load failed), got {policy!r}")
    if values.get("kv_connector_extra_config", {}) != {}:
        raise ConfigError(f"kv_transfer_config: {NATS_CONNECTOR} takes no kv_connector_extra_config (its timeouts "
                          f"are --kv-transfer-timeout, --kv-hold-timeout, --kv-chunk-timeout), got "
                          f"{values['kv_connector_extra_config']!r}")
    return role


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation through the NATS KV connector (docs/ARCHITECTURE.md).

    ``kv_transfer_config`` is vLLM's flag (a JSON object); ``kv_role`` its shorthand, and
    after creation the role either of them gave."""

    kv_transfer_config: str = setting(
        "", f'P/D as vLLM\'s JSON, e.g. {{"kv_connector": "{NATS_CONNECTOR}", "kv_role": "kv_producer"}} '
            f'(kv_role: kv_producer = prefill engine, kv_consumer = decode engine, kv_both; also '
            f'"kv_load_failure_policy": "recompute"); any other key is refused. \'\' = no KV transfer')
    kv_role: str = setting("", "shorthand for --kv-transfer-config with this kv_role "
                               "(kv_producer | kv_consumer | kv_both); '' = no KV transfer")
    kv_transfer_timeout: float = setting(
        10.0, "seconds a decode engine waits for a hand-off's prompt KV before it recomputes the prompt")
    kv_hold_timeout: float = setting(
        30.0, "seconds a prefill engine holds a handed-off request's blocks when no release comes")
    kv_chunk_timeout: float = setting(2.0, "seconds a decode worker waits for one chunk of KV blocks")

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role must be one of kv_producer|kv_consumer|kv_both or '', got {self.kv_role!r}")
        role = parse_kv_transfer_config(self.kv_transfer_config)
        if role and self.kv_role and role != self.kv_role:
            raise ConfigError(f"kv_role {self.kv_role!r} contradicts kv_transfer_config's {role!r}: give one")
        if role:
            object.__setattr__(self, "kv_role", role)
        for name in ("kv_transfer_timeout", "kv_hold_timeout", "kv_chunk_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def takes_new_requests(self) -> bool:
        """Tokenizers reach this engine (every engine but a decode-only one)."""
        return self.kv_role != KV_CONSUMER

    @property
    def hands_off(self) -> bool:
        return self.kv_role == KV_PRODUCER

    @property
    def takes_handoffs(self) -> bool:
        return self.kv_role in (KV_CONSUMER, KV_BOTH)


# The tiered KV cache (services/scheduler/kv_offload/, services/worker/kv_offload/). vLLM's
# --kv-offloading-backend names "native" (its own CPU tier: this one) and "lmcache" (a store
# this engine does not have).
KV_OFFLOADING_BACKENDS = ("native",)
PREEMPTION_MODES = ("recompute", "swap")
# When the disk tier takes a unit of blocks (SGLang HiCache's policy names): write_through when
# the request that computed it frees it (so other engines and a restart find it at once),
# write_back only when the host tier evicts it, write_through_selective once it was hit
# kv_offloading_disk_hit_threshold times (and on host eviction past that count).
DISK_WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")


@dataclass(frozen=True)
class KVOffloadConfig:
    """Tiers below the paged KV cache: host memory and a folder on disk (docs/ARCHITECTURE.md,
    "Tiered KV cache"). Blocks go down when the device pool evicts them; a prompt whose blocks
    a tier holds loads them instead of computing them. ``kv_offloading_size`` and
    ``kv_offloading_backend`` are vLLM's flags; the disk tier's are ours."""

    kv_offloading_size: float = setting(
        0.0, "host (CPU memory) KV tier in GiB, summed over the TP ranks (vLLM's flag); 0 = no host tier")
    kv_offloading_backend: str = setting("native", "native (this engine's tiers); lmcache is not available")
    kv_offloading_path: str = setting(
        "", "folder of the disk KV tier, shareable by every engine of the host and kept across restarts; '' = none")
    kv_offloading_disk_size: float = setting(
        10.0, "GiB the disk tier may fill in --kv-offloading-path (least recently used files go first)")
    kv_offloading_block_size: int = setting(
        64, "tokens per offloaded unit, a multiple of --block-size: the blocks moved (and filed) together")
    kv_offloading_disk_write_policy: str = setting(
        "write_through", "write_through (a request's blocks reach disk when it frees them: shared and kept at "
                         "once) | write_back (only what the host tier evicts) | write_through_selective (blocks hit "
                         "--kv-offloading-disk-hit-threshold times)")
    kv_offloading_disk_hit_threshold: int = setting(
        2, "write_through_selective: hits a block needs before it is written to disk")
    kv_offloading_load_timeout: float = setting(
        10.0, "seconds a load from the host or disk tier may take; past it the request recomputes its prompt")
    preemption_mode: str = setting(
        "recompute", "recompute (a preempted request's blocks are freed; with tiers their eviction still stores "
                     "them) | swap (they are copied to the host tier at once, kept there and loaded back when it "
                     "resumes; needs --kv-offloading-size)")

    def __post_init__(self) -> None:
        if self.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ConfigError(f"kv_offloading_backend must be native (this engine's host and disk tiers; LMCache is "
                              f"not available here), got {self.kv_offloading_backend!r}")
        for name in ("kv_offloading_size", "kv_offloading_disk_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 GiB, got {getattr(self, name)}")
        if self.kv_offloading_path and self.kv_offloading_disk_size <= 0:
            raise ConfigError("kv_offloading_disk_size must be > 0 GiB with a kv_offloading_path")
        if self.kv_offloading_block_size < 1:
            raise ConfigError(f"kv_offloading_block_size must be >= 1 token, got {self.kv_offloading_block_size}")
        if self.kv_offloading_disk_write_policy not in DISK_WRITE_POLICIES:
            raise ConfigError(f"kv_offloading_disk_write_policy must be one of {', '.join(DISK_WRITE_POLICIES)}, "
                              f"got {self.kv_offloading_disk_write_policy!r}")
        if self.kv_offloading_disk_hit_threshold < 1:
            raise ConfigError(f"kv_offloading_disk_hit_threshold must be >= 1, got "
                              f"{self.kv_offloading_disk_hit_threshold}")
        if self.kv_offloading_load_timeout <= 0:
            raise ConfigError(f"kv_offloading_load_timeout must be > 0 seconds, got {self.kv_offloading_load_timeout}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be recompute|swap, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not self.kv_offloading_size:
            raise ConfigError("preemption_mode swap copies a preempted request's blocks to the host tier: set "
                              "--kv-offloading-size (GiB)")

    @property
    def enabled(self) -> bool:
        return bool(self.kv_offloading_size or self.kv_offloading_path)

    @property
    def swaps(self) -> bool:
        return self.preemption_mode == "swap"

    def unit_blocks(self, block_size: int) -> int:
        """Device blocks per offloaded unit; ConfigError unless a whole number of them."""
        if self.kv_offloading_block_size % block_size:
            raise ConfigError(f"kv_offloading_block_size ({self.kv_offloading_block_size}) must be a multiple of "
                              f"block_size ({block_size})")
        return self.kv_offloading_block_size // block_size

    def check_speculative(self, speculative: SpeculativeConfig | None) -> None:
        """A draft model's KV cache is not offloaded: loaded blocks would hold stale drafts' KV."""
        if self.enabled and speculative is not None and speculative.method == "draft_model":
            raise ConfigError("the KV offloading tiers do not carry a draft model's KV cache: speculative decoding "
                              "with method draft_model cannot run with --kv-offloading-size / --kv-offloading-path "
                              "(ngram can)")
