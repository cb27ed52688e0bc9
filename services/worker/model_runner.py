"""Runs one engine step on this worker: diff in, sampled tokens out.

``execute_model`` applies the step diff to the cached request state and the
persistent batch, builds the flat model inputs with vectorised gathers (token
ids, positions, and the step's ``AttentionMetadata``: slot mapping, block tables,
query start offsets, sequence lengths, built once and read by every layer), runs
the model over the paged KV cache and samples the last position of every request
whose prompt is complete.

Under tensor parallelism (``ParallelConfig``) every rank builds the same runner over
its shard of the model and of the KV cache (its KV heads only), receives the same
step diffs and runs the same code: the LM head all-gathers the full logits onto every
rank, and the shared and per-request generators are seeded alike on every rank, so
every rank samples the same tokens and keeps the same request state. Only the driver
(rank 0) computes logprobs, which draw no randomness. A draft model (speculative
decoding's draft_model method, ``draft_model.py``) is not sharded: every rank holds it
whole, with its own KV cache under the target's block ids.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels import AttentionMetadata, get_kernel_ops
from shared import startup
from shared.config import (
    CacheConfig,
    ConfigError,
    LoRAConfig,
    ModelRunConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from shared.model_config import ModelConfig, resolve_max_model_len, resolve_model_path
from shared.model_files import default_model_path, load_model_config, open_weights
from shared.protocol import ModelRunnerOutput, SchedulerOutput
from shared.step_profile import NULL_CLOCK

from .draft_model import DraftModel
from .dtype_choice import resolve_dtype, resolve_kv_cache_dtype
from .input_batch import CachedRequestState, InputBatch
from .kv_cache import allocate_kv_caches, kv_block_bytes, layer_kv_caches
from .linear import weight_packer
from .lora.slots import LoRASlots
from .models.base import CausalLM
from .models.registry import model_class
from .parallel import ShardLayout, TensorParallel, init_distributed, tp_device
from .prompt_logprobs import compute_prompt_logprobs, wanted
from .sampler import Sampler, skip_draws
from .small_step_threads import SmallStepThreads
from .spec_decode import SpecDecoder
from .structured_output import StructuredOutputRunner

logger = logging.getLogger(__name__)


def resolve_device(name: str, parallel_config: ParallelConfig = ParallelConfig()) -> torch.device:
    """``auto``: CUDA when available, else CPU; under TP each rank takes GPU ``rank % count``."""
    return tp_device(name, parallel_config)


@dataclass
class ModelInputs:
    """One step's flat model inputs, built by ``ModelRunner._prepare_inputs``."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: list[AttentionMetadata]  # per KV cache group
    logits_indices: torch.Tensor  # [B]: each request's last token
    seq_lens_np: np.ndarray  # [B]: the attention's seq_lens, on the host


class ModelRunner:
    def __init__(
        self,
        run_config: ModelRunConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        parallel_config: ParallelConfig = ParallelConfig(),
        lora_config: LoRAConfig = LoRAConfig(),
    ) -> None:
        self.run_config = run_config
        self.cache_config = cache_config
        self.parallel_config = parallel_config
        self.device = resolve_device(run_config.device, parallel_config)
        self.model_path = run_config.model or default_model_path()
        # A rank's shard of a matrix is not a whole quantized tensor: under tensor
        # parallelism the weights are dequantized.
        model_kind, _ = resolve_model_path(self.model_path)
        self.keep_quantized = run_config.keeps_gguf_quantized(model_kind, parallel_config.tensor_parallel_size)
        self.dtype = resolve_dtype(run_config.dtype, self.device, keep_quantized=self.keep_quantized)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        self.max_model_len = resolve_max_model_len(self.model_config, run_config.max_model_len)
        self.block_size = cache_config.block_size
        # This rank's heads / columns / vocabulary rows (checked before joining the group).
        self.shard = ShardLayout.for_rank(
            self.model_config, parallel_config.rank, parallel_config.tensor_parallel_size
        )
        # Joins the engine's ranks (a no-op with one rank; the worker service joins first).
        self.tp = init_distributed(parallel_config, self.device)
        if run_config.batch_invariant:
            self.tp = dataclasses.replace(self.tp, ordered_sums=True)
        self.rank = self.tp.rank
        self.is_driver = self.rank == 0

        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        torch.manual_seed(run_config.seed)
        # How float weight matrices are laid out for their products (services/worker/linear.py).
        self.pack = weight_packer(self.device, self.dtype, run_config.cpu_prepack, run_config.batch_invariant)
        # The threads the model runs on; a CPU step of few tokens may take one (_set_threads).
        self.num_threads = torch.get_num_threads()
        self.small_step_threads = SmallStepThreads(self.num_threads, run_config.cpu_small_step_threads)
        if run_config.quantization == "auto" and self.tp.enabled:
            logger.info("quantization auto: weights dequantized (tensor_parallel_size > 1)")
        # Dequantized weights keep Hugging Face's float32 operation order (greedy parity);
        # quantized ones differ from Hugging Face's results anyway and take the C kernels.
        self.ops = get_kernel_ops(run_config.kernel_backend, float32_hf_order=not self.keep_quantized,
                                  batch_invariant=run_config.batch_invariant)
        self.kv_cache_dtype = resolve_kv_cache_dtype(cache_config.kv_cache_dtype, self.dtype, self.device)
        # Each rank reads only its rows / columns of the sharded tensors.
        startup.phase(f"loading weights of {self.model_path}")
        self.model = self._load_model(self.model_path, self.model_config, self.tp)
        # KV cache groups (shared/kv_cache_groups.py): their windows, for the scheduler.
        self.kv_layout = self.model.kv_layout
        self.kv_sliding_windows = self.kv_layout.sliding_windows
        self.max_num_seqs = scheduler_config.max_num_seqs
        # Seeded alike on every rank: unseeded random requests draw the same uniforms everywhere.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(run_config.seed))
        # The draft_model method's model, loaded before the KV cache is sized: its cache
        # takes the same number of blocks.
        self.draft_model: DraftModel | None = None
        speculative = scheduler_config.speculative
        if speculative is not None and speculative.method == "draft_model":
            self.draft_model = self._load_draft_model(speculative)

        startup.phase("profiling memory: sizing the KV cache")
        self.num_blocks = self._num_kv_blocks()
        startup.phase(f"allocating {self.num_blocks} KV cache blocks")
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.layer_kv_caches = layer_kv_caches(self.kv_caches, self.kv_layout)
        if self.draft_model is not None:
            self.draft_model.allocate_kv_cache(self.num_blocks)
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(
            scheduler_config.max_num_seqs, self.max_model_len, max_blocks_per_req, self.device,
            num_kv_groups=len(self.kv_layout.groups),
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.spec_decoder: SpecDecoder | None = None
        self.use_speculative(speculative)
        self.lora: LoRASlots | None = None
        self.use_lora(lora_config)
        self.structured_output = StructuredOutputRunner(
            self.model_path, self.model_config.vocab_size, scheduler_config.max_num_seqs
        )
        logger.info(
            "model %s loaded: %s on %s, kernels=%s, prepacked=%s, rank %d/%d (%d q heads, %d KV heads), "
            "%d KV blocks of %d tokens in %s",
            self.model_path, self.dtype, self.device, self.ops.name, getattr(self.pack, "__name__", None), self.rank, self.tp.world_size,
            self.shard.num_heads, self.shard.num_kv_heads, self.num_blocks, self.block_size, self.kv_cache_dtype,
        )

    def _load_model(self, path: str, config: ModelConfig, tp: TensorParallel) -> CausalLM:
        with torch.device(self.device):
            model = model_class(config)(config, self.ops, tp)
        with open_weights(path) as weights:
            model.load_weights_from(weights, dtype=torch.float32, keep_quantized=self.keep_quantized)
        model.to(dtype=self.dtype)
        model.eval()
        if self.pack is not None:
            model.prepack_linears(self.pack)
        logger.info("%s: %.1f MiB of weights, %d matrices kept quantized", path, model.weight_bytes() / 2**20,
                    model.num_quantized())
        return model

    def _load_draft_model(self, config: SpeculativeConfig) -> DraftModel:
        """The draft model, whole on this rank (never sharded), its vocabulary checked. Its
        cache follows the target's KV cache group 0, which must be full attention."""
        if self.model.kv_layout.groups[0].sliding_window is not None:
            raise ConfigError(f"speculative_config: the draft_model method needs a target with full-attention "
                              f"layers; {self.model_path} has only sliding-window ones")
        draft_config = DraftModel.load_config(config, self.model_path, self.model_config)
        model = self._load_model(config.model, draft_config, TensorParallel.single())
        logger.info("draft model %s loaded on rank %d: %d layers, %d KV heads", config.model, self.rank,
                    draft_config.num_hidden_layers, draft_config.num_key_value_heads)
        return DraftModel(config, model, draft_config, self.ops, self.sampler.generator, self.block_size,
                          self.max_num_seqs, self.max_model_len)

    def use_speculative(self, config: SpeculativeConfig | None) -> None:
        """Verify and propose draft tokens per ``config`` (None: no speculative decoding).
        A draft model not loaded at start-up (an engine reusing this runner) gets a cache of
        this runner's block count, outside its memory sizing."""
        draft = None
        if config is not None and config.method == "draft_model":
            if self.draft_model is None or (self.draft_model.path, self.draft_model.k) != (
                    config.model, config.num_speculative_tokens):
                self.draft_model = self._load_draft_model(config)
                self.draft_model.allocate_kv_cache(self.num_blocks)
            draft = self.draft_model
        self.spec_decoder = (None if config is None
                             else SpecDecoder(config, self.sampler.generator, self.device, draft))

    def use_lora(self, config: LoRAConfig) -> None:
        """Serve LoRA adapters per ``config`` (``enable_lora`` off: none)."""
        if self.lora is not None:
            self.lora.detach()
            self.lora = None
        if not config.enable_lora:
            return
        if not self.model.supports_lora:
            raise ConfigError(f"enable_lora: LoRA adapters on {self.model_config.architecture} models "
                              "(mixture of experts) are not supported")
        self.lora = LoRASlots(self.model, self.model_config, config, self.device, self.dtype)

    # ------------------------------------------------------------------ KV cache

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this rank (its KV heads only, the layers of one KV cache
        group), the draft model's block included."""
        spec = self.model.kv_cache_spec()
        target = kv_block_bytes(self.block_size, spec.num_kv_heads, spec.head_dim, spec.layout.group_size,
                                self.kv_cache_dtype)
        return target + (self.draft_model.kv_block_bytes() if self.draft_model is not None else 0)

    def _num_kv_blocks(self) -> int:
        if self.cache_config.num_gpu_blocks is not None:
            return self.cache_config.num_gpu_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * self.cache_config.gpu_memory_utilization - (total - free)
            # Leave room for activations of the largest step.
            budget -= 2 << 30
        else:
            budget = self.cache_config.cpu_kv_cache_gib * (1 << 30)
        if self.draft_model is not None:
            budget -= self.draft_model.scratch_bytes()
        num_blocks = int(budget // self.kv_block_bytes())
        if num_blocks < 1:
            raise RuntimeError(
                "no memory left for the KV cache: raise gpu_memory_utilization / "
                "cpu_kv_cache_gib or set num_gpu_blocks"
            )
        return num_blocks

    def _allocate_kv_caches(self, num_blocks: int):
        """The pool's (key, value) tensor pairs (``kv_cache.py``)."""
        spec = self.model.kv_cache_spec()
        return allocate_kv_caches(num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                                  spec.layout.group_size, self.kv_cache_dtype, self.device)

    @torch.inference_mode()
    def time_prefill(self, num_tokens: int) -> float:
        """Seconds one prompt chunk of ``num_tokens`` tokens takes (the second of two runs),
        for the KV tiers' load-or-recompute choice. At start-up only: it writes garbage KV into
        the first blocks. Under TP every rank must call it (the pass has collectives)."""
        num_tokens = max(1, min(num_tokens, self.num_blocks * self.block_size, self.max_model_len))
        num_blocks = -(-num_tokens // self.block_size)
        dev = self.device
        positions = torch.arange(num_tokens, device=dev)
        attn = [AttentionMetadata(  # one per KV cache group, on the same first blocks
            slot_mapping=positions.clone(),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev).unsqueeze(0),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            sliding_window=group.sliding_window,
        ) for group in self.kv_layout.groups]
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        if self.lora is not None:
            self.lora.set_step([None], np.array([num_tokens]))
        seconds = 0.0
        for _ in range(2):
            for group_attn in attn:
                group_attn.decode_plan = group_attn.token_decodes = group_attn.prefill_plan = None
            start = time.perf_counter()
            self.model(input_ids, positions, attn, self.layer_kv_caches)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - start
        return seconds

    # ------------------------------------------------------------------ state

    def _check_step(self, out: SchedulerOutput) -> None:
        """Refuse a step whose block ids fall outside this worker's pool before any state
        changes or any kernel reads them (the C kernels do not bounds-check)."""
        num_groups = len(self.kv_layout.groups)
        block_lists = [new.block_ids for new in out.scheduled_new_reqs]
        block_lists += out.scheduled_cached_reqs.new_block_ids
        for groups in block_lists:
            if len(groups) != num_groups:
                raise ValueError(f"step {out.step_id} names block tables of {len(groups)} KV cache groups, "
                                 f"this worker's model has {num_groups}")
            block_ids = [b for ids in groups for b in ids]
            if block_ids and not (0 <= min(block_ids) and max(block_ids) < self.num_blocks):
                raise ValueError(f"step {out.step_id} names KV blocks outside this worker's "
                                 f"{self.num_blocks} blocks")
        if self.lora is None and any(new.lora_request for new in out.scheduled_new_reqs):
            raise ValueError(f"step {out.step_id} names a LoRA adapter, but this worker runs without enable_lora")

    def _update_states(self, out: SchedulerOutput) -> None:
        self._check_step(out)
        batch = self.input_batch
        if out.reset_state:
            for req_id in list(self.requests):
                batch.remove_request(req_id)
            self.requests.clear()
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)

        for new in out.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                # Past the draws of the tokens it brings (below): it draws on as it would have.
                skip_draws(generator, len(new.output_token_ids), self.device)
            # A request resumed after a worker restart or on another engine, or handed off
            # by a prefill engine, brings the tokens it generated.
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
                generator=generator,
                output_token_ids=list(new.output_token_ids),
                grammar=self.structured_output.request_grammar(params, new.eos_token_id),
                lora_request=new.lora_request,
            )
            if new.lora_request is not None:
                self.lora.prefetch(new.lora_request)

        cached = out.scheduled_cached_reqs
        for req_id, resumed, new_block_ids, num_computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            # Blocks past the computed tokens held only rejected drafts; the scheduler freed them.
            keep = -(-num_computed // self.block_size)
            if resumed:
                state.block_ids = [list(ids) for ids in new_block_ids]
            else:
                for ids, new_ids in zip(state.block_ids, new_block_ids):
                    ids[keep:] = new_ids
            index = batch.req_id_to_index.get(req_id)
            if index is not None:
                batch.num_computed_tokens[index] = num_computed
                if resumed:
                    batch.set_block_ids(index, new_block_ids)
                else:
                    batch.append_block_ids(index, new_block_ids, keep)

        # Rows of requests not scheduled this step (preempted, or out of budget) go;
        # scheduled requests without a row (new, resumed, back in budget) come.
        scheduled = set(out.scheduled_req_ids)
        for req_id in list(batch.req_id_to_index):
            if req_id not in scheduled:
                batch.remove_request(req_id)
        batch.condense()
        for req_id in out.scheduled_req_ids:
            if req_id not in batch.req_id_to_index:
                batch.add_request(self.requests[req_id])

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, clock=NULL_CLOCK) -> ModelRunnerOutput:
        """``clock``: a step_profile.PhaseClock to time the phases, when profiling."""
        self._update_states(out)
        self._set_threads(out.total_num_scheduled_tokens)
        clock.lap("update_states")
        batch = self.input_batch
        num_reqs = batch.num_reqs
        if out.total_num_scheduled_tokens == 0 or num_reqs == 0:
            return ModelRunnerOutput(step_id=out.step_id)

        num_scheduled = np.zeros(num_reqs, dtype=np.int64)
        for req_id, n in zip(out.scheduled_req_ids, out.num_scheduled_tokens):
            num_scheduled[batch.req_id_to_index[req_id]] = n
        # Draft tokens are the last scheduled tokens of their requests (speculative decoding).
        num_spec = self.spec_decoder.place_drafts(batch, out) if out.num_spec_tokens else None
        inputs = self._prepare_inputs(num_scheduled)
        if self.lora is not None:
            self.lora.set_step([state.lora_request for state in batch.states[:num_reqs]], num_scheduled)
        clock.lap("prepare_inputs")
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.layer_kv_caches)
        prompt_logprobs = self._prompt_logprobs(hidden, num_scheduled)

        # Only requests whose every known token is now computed get a sample; a
        # prompt chunk gets none (and draws no randomness from a seeded generator).
        seq_lens = inputs.seq_lens_np if num_spec is None else inputs.seq_lens_np - num_spec
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        states = batch.states[:num_reqs]
        # Row -> its sampled tokens (several when drafts were accepted) and their logprobs.
        sampled_by_row: dict[int, tuple[list[int], list]] = {}
        if len(sample_rows) and num_spec is not None:
            sampled_by_row = self.spec_decoder.sample(self.model.compute_logits, hidden, batch, num_scheduled,
                                                      num_spec, sample_rows, want_logprobs=self.is_driver,
                                                      mask_logits=self._mask_positions)
            clock.lap("forward")
        elif len(sample_rows):
            logits_indices = inputs.logits_indices[torch.from_numpy(sample_rows).to(self.device)]
            logits = self.model.compute_logits(hidden[logits_indices])
            clock.lap("forward")
            logits = self._mask_by_grammars(logits, [states[row] for row in sample_rows.tolist()])
            sampling = batch.make_sampling_metadata(sample_rows)
            if not self.is_driver:
                sampling.num_logprobs = None  # only rank 0 replies; logprobs draw no randomness
            sampled, logprobs = self.sampler(logits, sampling)
            for j, (row, token) in enumerate(zip(sample_rows.tolist(), sampled.tolist())):
                sampled_by_row[row] = ([token], [logprobs[j]] if logprobs and logprobs[j] else [])
        clock.lap("sampling")

        req_ids, sampled_token_ids, out_logprobs = [], [], []
        for i, state in enumerate(states):
            req_ids.append(state.req_id)
            tokens, lps = sampled_by_row.get(i, ([], []))
            state.token_ids.extend(tokens)
            state.output_token_ids.extend(tokens)
            for token in tokens:
                batch.append_token(i, token)
                self.structured_output.accept_token(state, token)
            sampled_token_ids.append(tokens)
            out_logprobs.append(lps)
        output = ModelRunnerOutput(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled_token_ids)
        if self.spec_decoder is not None:
            num_drafts = self.spec_decoder.propose(batch, sampled_by_row, num_scheduled)
            output.num_draft_tokens = [num_drafts.get(i, 0) for i in range(num_reqs)]
            if any(out_logprobs):
                output.token_logprobs = out_logprobs
        elif any(out_logprobs):
            output.logprobs = [lps[0] if lps else None for lps in out_logprobs]
        if prompt_logprobs:
            output.prompt_logprobs = [prompt_logprobs.get(i) for i in range(num_reqs)]
        clock.lap("output")
        return output

    def _set_threads(self, num_tokens: int) -> None:
        """On CPU, a step of at most ``cpu_single_thread_max_tokens`` tokens on the threads
        ``small_step_threads`` chooses, all of them otherwise (``ModelRunConfig``)."""
        if self.device.type != "cpu":
            return
        threads = self.small_step_threads.threads(num_tokens <= self.run_config.cpu_single_thread_max_tokens)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _prompt_logprobs(self, hidden: torch.Tensor, num_scheduled: np.ndarray) -> dict:
        """Row -> the prompt logprobs this step's chunk yields, for requests that want them
        (``prompt_logprobs.py``); before the states advance."""
        batch = self.input_batch
        states = batch.states[:batch.num_reqs]
        num_computed = batch.num_computed_tokens[:batch.num_reqs]
        rows = wanted(states, num_computed, num_scheduled)
        if not rows:
            return {}
        return compute_prompt_logprobs(self.model.compute_logits, hidden, rows, states, num_computed, num_scheduled,
                                       want_logprobs=self.is_driver)

    def _mask_by_grammars(self, logits: torch.Tensor, states: list[CachedRequestState]) -> torch.Tensor:
        """The logits with each constrained row's disallowed tokens at -inf."""
        if all(state.grammar is None for state in states):
            return logits
        logits = logits.float()
        self.structured_output.mask_logits(logits, states)
        return logits

    def _mask_positions(self, logits: torch.Tensor, states_by_row: dict[int, CachedRequestState]) -> None:
        """Grammar masks on some rows of ``logits`` (float32), in place."""
        constrained = {row: state for row, state in states_by_row.items() if state.grammar is not None}
        if not constrained:
            return
        rows = torch.tensor(list(constrained), device=logits.device)
        selected = logits[rows]
        self.structured_output.mask_logits(selected, list(constrained.values()))
        logits[rows] = selected

    def _prepare_inputs(self, num_scheduled: np.ndarray) -> ModelInputs:
        batch = self.input_batch
        num_reqs = len(num_scheduled)
        cu = np.cumsum(num_scheduled)
        total = int(cu[-1])
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = np.arange(total) - np.repeat(cu - num_scheduled, num_scheduled)
        positions = batch.num_computed_tokens[req_indices] + offsets
        input_ids = batch.token_ids[req_indices, positions]
        seq_lens = batch.num_computed_tokens[:num_reqs] + num_scheduled

        dev = self.device
        query_start_loc = torch.from_numpy(np.concatenate([[0], cu]).astype(np.int32)).to(dev)
        seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32)).to(dev)
        max_query_len, max_seq_len = int(num_scheduled.max()), int(seq_lens.max())
        in_block = positions % self.block_size
        attn = []
        for group, table, num_blocks in zip(self.kv_layout.groups, batch.block_tables, batch.group_num_blocks):
            block_numbers = table[req_indices, positions // self.block_size]
            slot_mapping = block_numbers.astype(np.int64) * self.block_size + in_block
            max_blocks = int(num_blocks[:num_reqs].max())
            attn.append(AttentionMetadata(
                slot_mapping=torch.from_numpy(slot_mapping).to(dev),
                block_tables=torch.from_numpy(np.ascontiguousarray(table[:num_reqs, :max_blocks])).to(dev),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_t,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                sliding_window=group.sliding_window,
            ))
        return ModelInputs(
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            attn=attn,
            logits_indices=torch.from_numpy(cu - 1).to(dev),
            seq_lens_np=seq_lens,
        )
