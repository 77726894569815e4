"""The engine: requests in, tokens streamed out, many sequences decoding together.

One `step()` launches a step and finishes one. Launching: admit waiting requests while columns are
free, pack a step (decode tokens first, then prompt chunks), declare and prepare it on the cache,
queue the forward and sampling on the device (eager, or a replayed CUDA graph), commit, fork n > 1
requests after their prompt. Finishing: read the step's tokens, record them, and free the columns of
finished samples. With overlap (`batchkv.executor.pipeline`) a call finishes the step the previous
call launched, so the host plans step N+1 while the device runs step N.
"""

from __future__ import annotations

import random
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.cache.config import MAX_POSITIONS, MAX_STEP_TOKENS
from batchkv.checks import allocating, device_arg, int_arg, int_args
from batchkv.errors import ConfigError, RequestError, StepError
from batchkv.executor.constraints import Grammars
from batchkv.executor.graphs import GraphSet
from batchkv.executor.launch import start, stops_ranks_on_failure
from batchkv.executor.metrics import Metrics
from batchkv.executor.pipeline import InFlight, Pipeline
from batchkv.executor.request import MAX_SAMPLE_ROWS, Event, Request, SamplingParams
from batchkv.executor.roles import Role
from batchkv.executor.runner import ModelRunner, StepModel
from batchkv.executor.scheduler import RequestState, Scheduler
from batchkv.executor.sizing import (
    DEFAULT_STEP_TOKENS,
    Sizing,
    check_fraction,
    default_buckets,
    default_prefill_chunk,
    model_capacity,
    size_store,
)
from batchkv.executor.speculative import NoSpeculation, SpeculativeConfig, Speculator, build_speculator


class Engine:
    """Continuous batching of `Request`s over one `BatchedSequenceCache`.

    model: callable as model(input_ids [W] int64, indexes [3, W] int64, cache, logits_rows [R]
        int64) -> float32 [R, vocab]; exposes cache_spec() -> dict(num_layers, kv_heads, head_dim,
        layers, dtype), vocab_size and device (and optionally max_positions).
    max_seqs: resident sequences (columns); a request with n samples holds n of them. Every
        running sample decodes in every step, up to MAX_SAMPLE_ROWS (256) logits rows a step (past
        that they take turns). "auto": 256, with `kv_positions="auto"`. The same min(max_seqs, 256)
        rows bound how many prompt tokens a step scores for `prompt_logprobs`.
    kv_positions: positions the store holds for all sequences together, each request taking what it
        can reach (prompt + max_new_tokens). "auto": as many as fit in `memory_fraction` of the
        device, allocated whole up front (`Engine.sizing` says what it chose); an int: that many,
        allocated whole; None (the default unless max_seqs is "auto"): grown on demand, up to every
        sequence at full capacity. With a whole store a request waits until its rows are free.
    memory_fraction: with kv_positions="auto", the share of the device's total memory this process
        may use for everything (weights, activations, graphs, K/V), like vLLM's gpu_memory_utilization.
    capacity: most positions (prompt + generated) one sequence may hold; None: the model's
        `max_positions` when it has one, else `DEFAULT_CAPACITY` (4096).
    max_step_tokens: token budget of one step (decode tokens + prompt chunks); default
        `DEFAULT_STEP_TOKENS` (1,024), as `batchkv run` and `batchkv serve`.
    prefill_chunk: most prompt tokens one sequence writes in one step (the cache's max_write);
        None: `DEFAULT_PREFILL_CHUNK` (512) within capacity and max_step_tokens.
    prefill_budget: most prompt tokens per step, all prompts together, while samples are running
        (with none running a step fills the step budget). None: half of max_step_tokens, at least one
        prefill_chunk (`default_prefill_budget`, measured on the H200). Lower keeps steps short while
        prompts arrive (inter-token latency); higher finishes prompts in fewer steps (time to first
        token).
    overlap: plan and queue step N+1 while the device runs step N ("auto": on CUDA unless
        speculating; True is refused with `speculative`, whose plans need the last step's accepted
        counts; on the CPU, True runs the same pipeline, which only hands tokens out a step later).
    width_buckets: packed widths a step is padded up to (default `default_buckets`: 1, 2, 4, ..., 32,
        48, 64, then every 64 to 512 and every 128 to the budget).
    use_graphs: "auto" (CUDA graphs when on CUDA with capturable attention), True or False.
    kv_dtype: K/V storage dtype (default: the model's `cache_spec()["kv_dtype"]`, else its dtype);
        `torch.float8_e4m3fn` halves the bytes per position (see `CacheConfig.kv_dtype`).
    row_buckets, row_step: the cache's row growth schedule (see CacheConfig.buckets/tail_step).
    seed: draws the sampling seed of requests that do not set one.
    speculative: a `SpeculativeConfig` (n-gram lookup or a DFlash drafter), or None. Each decode
        sample then verifies up to block_size - 1 drafts a step; drafts ride on top of
        `max_step_tokens` (the widths reach max_step_tokens + min(256, max_seqs) * (block_size - 1)),
        the cache's max_write is at least block_size, and a step has at most
        min(256, max_seqs) * block_size logits rows (see `batchkv.executor.speculative`).
    prefix_cache: reuse the K/V of prompt prefixes the store already holds (a finished request's
        history kept until its memory is needed, or a live request's written prompt), so a request
        prefills only what is new (see `batchkv.executor.prefix`). On by default; off under a DFlash
        drafter (its own cache would lack the reused positions' context features).
    tensor_parallel: processes, one per GPU of this host (gloo processes on the CPU), that hold the
        model sharded Megatron-style (`batchkv.tp`). `model` is then a model *source*, which each
        rank builds its share of: a preset name, a model directory (SenseNova-U1, a transformers
        Llama or Qwen3; read slice by slice), a GGUF file, or a picklable factory(shard) -> model;
        a DFlash drafter is a factory(target). This process is rank 0 (the scheduler, sampling
        and the API); it starts the others, which `close()` stops. Under torchrun every rank runs
        the same script and `Engine(...)` returns on rank 0 only (the others serve it, then exit).
        A rank that raises or dies stops every rank: the step raises TensorParallelError.

    Example:
        engine = Engine(model, max_seqs=8, capacity=512)
        rid = engine.submit(Request(prompt, SamplingParams(max_new_tokens=32)))
        for event in engine.stream():
            print(event.request_id, event.token, event.finish_reason)
    """

    @stops_ranks_on_failure
    def __init__(
        self,
        model: StepModel,
        *,
        max_seqs: int | str = 8,
        capacity: int | None = None,
        max_step_tokens: int = DEFAULT_STEP_TOKENS,
        prefill_chunk: int | None = None,
        width_buckets: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        use_graphs: bool | str = "auto",
        attention: str = "auto",
        row_buckets: tuple[int, ...] = (),
        row_step: int = 0,
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,
        speculative: SpeculativeConfig | None = None,
        overlap: bool | str = "auto",
        prefill_budget: int | None = None,
        memory_fraction: float = 0.9,
        kv_positions: int | str | None = None,
        prefix_cache: bool = True,
        tensor_parallel: int = 1,
        _role: Role | None = None,  # batchkv.tp's: the role of a rank > 0
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "model", "tensor_parallel", "_role")}
        if _role is None:  # a model or a source; more ranks started by batchkv.tp (executor.launch)
            _role, model = start(model, tensor_parallel, options)
        self.tp: Role = _role
        self._stop = weakref.finalize(self, _role.close)  # stops the other ranks if construction fails
        if max_seqs == "auto":
            max_seqs, kv_positions = MAX_SAMPLE_ROWS, "auto" if kv_positions is None else kv_positions
        capacity = model_capacity(model) if capacity is None else capacity
        max_seqs = int_arg("Engine max_seqs", max_seqs, 1, MAX_POSITIONS, why=" (or 'auto')")
        why = " (one step's tokens: static buffers are sized by it)"
        max_step_tokens = int_arg("Engine max_step_tokens", max_step_tokens, 1, MAX_STEP_TOKENS, why=why)
        why = " (a prompt and a generated token; positions are int32)"
        capacity = int_arg("Engine capacity", capacity, 2, MAX_POSITIONS, why=why)
        why = f" (at most capacity={capacity} and max_step_tokens={max_step_tokens})"
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(capacity, max_step_tokens)
        prefill_chunk = int_arg("Engine prefill_chunk", prefill_chunk, 1, min(capacity, max_step_tokens), why=why)
        seed = int_arg("Engine seed", seed)
        row_buckets = int_args("Engine row_buckets", row_buckets, 1, MAX_POSITIONS)
        row_step = int_arg("Engine row_step", row_step, 0, MAX_POSITIONS)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ConfigError(f"speculative is a {type(speculative).__name__}; pass a SpeculativeConfig or None")
        block = speculative.block_size if speculative is not None else 1
        if block > capacity:
            raise ConfigError(f"speculative block_size {block} exceeds capacity {capacity}; lower block_size")
        widest = max_step_tokens + min(MAX_SAMPLE_ROWS, max_seqs) * (block - 1)
        if width_buckets is not None:
            buckets = int_args("Engine width_buckets", width_buckets, 1, MAX_STEP_TOKENS)
        else:
            buckets = default_buckets(widest)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[-1] < widest:
            raise ConfigError(
                f"width_buckets {buckets} must be positive, strictly increasing and reach "
                f"{widest} (max_step_tokens, plus drafts when speculating; add {widest})"
            )
        if use_graphs != "auto" and not isinstance(use_graphs, bool):
            raise ConfigError(f"use_graphs is {use_graphs!r}; use 'auto', True or False")
        spec = model.cache_spec()
        config = CacheConfig(
            num_layers=spec["num_layers"],
            kv_heads=spec["kv_heads"],
            head_dim=spec["head_dim"],
            max_seqs=max_seqs,
            capacity=capacity,
            max_write=max(prefill_chunk, block),  # type: ignore[type-var]
            layers=tuple(spec.get("layers") or ()),
            dtype=spec.get("dtype", torch.bfloat16),
            kv_dtype=kv_dtype or spec.get("kv_dtype"),
            max_width=buckets[-1],
            buckets=tuple(row_buckets),
            tail_step=row_step,
        )
        self.device = device_arg(device if device is not None else model.device, "Engine device")
        if torch.device(model.device).type != self.device.type:
            raise ConfigError(f"the model is on {model.device} but the engine's device is {self.device}; move one")
        self.pipeline = Pipeline.for_engine(overlap, speculating=speculative is not None, device=self.device)
        check_fraction(memory_fraction)
        self.sizing: Sizing | None = None
        sample_rows = min(MAX_SAMPLE_ROWS, max_seqs)
        if kv_positions == "auto":  # as many positions as fit, allocated whole now: no growth while serving
            config, self.sizing = size_store(model, config, memory_fraction, sample_rows, agree=self.tp.agree)
        elif kv_positions is not None:
            why = " (or 'auto', or None: grown on demand)"
            kv_positions = int_arg("Engine kv_positions", kv_positions, capacity, MAX_POSITIONS, why=why)
            config = replace(config, pool_rows=kv_positions + config.scratch_rows)
        self.cache: BatchedSequenceCache = self.tp.cache(config, self.device, attention=attention)
        capturable = self.device.type == "cuda" and self.cache.attention != "reference"
        if use_graphs is True and not capturable:
            raise ConfigError(
                f"use_graphs=True needs CUDA and capturable attention; device is {self.device}, "
                f"attention is {self.cache.attention!r} (use use_graphs='auto' or False)"
            )
        graphs = (
            GraphSet(self.device, capture_error_mode=self.tp.capture_error_mode)
            if use_graphs is not False and capturable
            else None
        )
        self.buckets = buckets
        self.vocab_size = int(model.vocab_size)
        self.eos_token_ids = tuple(getattr(model, "eos_token_ids", None) or ())  # merged into requests' stops
        if not isinstance(prefix_cache, bool):
            raise ConfigError(f"prefix_cache is {prefix_cache!r}; use True or False")
        reuse = prefix_cache and not (speculative is not None and speculative.method == "dflash")
        self.scheduler = Scheduler(
            self.cache, max_step_tokens, prefill_chunk, buckets, prefill_budget, sample_rows, prefix_cache=reuse
        )
        self.metrics = Metrics(max_seqs, generation=self.cache.generation)
        what, nbytes = "the step inputs and logits", ModelRunner.nbytes(buckets[-1], self.vocab_size, sample_rows)
        with allocating(what, nbytes, "lower max_step_tokens, or free device memory"):
            if speculative is None:
                pad_rows = self.device.type == "cuda"
                self.runner = ModelRunner(
                    model, self.cache, buckets[-1], graphs=graphs, pad_rows=pad_rows, rows=sample_rows, tp=self.tp
                )
                self.speculator: Speculator | NoSpeculation = NoSpeculation()
            else:
                self.speculator = build_speculator(
                    speculative,
                    model,
                    graphs,
                    cache=self.cache,
                    metrics=self.metrics,
                    buckets=buckets,
                    prefill_chunk=prefill_chunk,
                    role=self.tp,
                )
                self.runner = self.speculator.runner
        self._seeds = random.Random(seed)
        self.grammars: Grammars | None = None  # use_tokenizer: constrained decoding
        self._next_id = 0
        self._idle = False
        self.tp.ready()  # every rank has built its engine

    closed = False  # set by close(); the instance then holds nothing else

    def close(self) -> None:
        """Free the store, the CUDA graphs and every buffer now; what leaving `with Engine(...)` does.

        Live requests are dropped without events. Afterwards every use of the engine is a StepError.
        (Without close, the engine's memory is freed when the last reference to it goes: it holds no
        reference cycle, so no `gc.collect()` is needed.)
        """
        if self.closed:
            return
        self._stop()  # the other tensor-parallel ranks stop (nothing with one process)
        graphs = self.runner.graphs
        if graphs is not None:
            graphs.retain(lambda key: False)  # destroy the captured graphs (and their pool's hold) now
        self.__dict__.clear()
        self.closed = True

    def __getattr__(self, name: str) -> object:
        if self.__dict__.get("closed"):
            raise StepError(f"the engine is closed (Engine.close() or its `with` block ended); {name} is gone")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def uses_graphs(self) -> bool:
        return self.runner.graphs is not None

    @property
    def overlap(self) -> bool:
        """True when a step is planned and queued while the previous one runs on the device."""
        return self.pipeline.overlap

    @property
    def has_work(self) -> bool:
        """True while a request is waiting, prefilling or decoding, a step is in flight, or events are pending."""
        return self.scheduler.has_work or self.pipeline.in_flight is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.live) - len(self.scheduler.waiting)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a request; returns its id. Refuses (RequestError, engine unchanged) one that can never fit."""
        if not isinstance(request, Request):
            raise RequestError(f"submit takes a Request, not a {type(request).__name__}")
        prompt, params = request.prompt_ids, request.params
        cache = self.cache
        problem = None
        if not prompt:
            problem = "the prompt is empty; give at least one token id"
        elif len(prompt) + 1 > cache.capacity:
            problem = (
                f"the prompt has {len(prompt)} tokens and capacity is {cache.capacity}, leaving no position "
                f"for a generated token (shorten the prompt to {cache.capacity - 1} or raise capacity)"
            )
        elif params.n > cache.max_seqs:
            problem = f"n={params.n} samples need {params.n} columns; max_seqs is {cache.max_seqs} (lower n)"
        elif (
            cache.config.pool_rows
            and params.n * self._reach(request) > cache.config.pool_rows - cache.config.scratch_rows
        ):
            held = cache.config.pool_rows - cache.config.scratch_rows
            problem = (
                f"its {params.n} sample(s) can reach {self._reach(request)} positions each, more than the store's "
                f"{held} together (lower max_new_tokens or n, or give the store more positions)"
            )
        elif params.n > self.scheduler.max_step_tokens:
            problem = (
                f"n={params.n} samples sample in one step, whose budget is max_step_tokens="
                f"{self.scheduler.max_step_tokens} (lower n or raise max_step_tokens)"
            )
        elif min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            problem = f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        elif params.scores and not isinstance(self.speculator, NoSpeculation):
            problem = (
                "logprobs and prompt_logprobs are not computed under speculative decoding (a verify step keeps "
                "no logits); drop them, or serve this request from an engine without speculative="
            )
        if problem is None:
            problem = self._sampling_problem(params)
        if problem is not None:
            self.metrics.refused += 1
            raise RequestError(f"request refused: {problem}")
        grammar = None
        if params.constraint is not None:
            try:
                grammar = self.grammars.compile(params.constraint)  # type: ignore[union-attr]  # cached
            except RequestError:
                self.metrics.refused += 1
                raise
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = replace(request, params=params.stopping_at(self.eos_token_ids))  # unless ignore_eos
        request_id = self._next_id
        self._next_id += 1
        self.scheduler.add(RequestState(request_id, request, seed, time.perf_counter(), grammar=grammar))
        self.metrics.submitted += 1
        return request_id

    def _sampling_problem(self, params: SamplingParams) -> str | None:
        """Why this engine cannot apply `params`' logit adjustments or constraint, or None."""
        bad = [token for token, _ in params.logit_bias if token >= self.vocab_size]
        if bad:
            return f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        if not params.adjusts_sampling:
            return None
        where = None
        if self.tp.world > 1:
            where = "under tensor parallelism"
        elif not isinstance(self.speculator, NoSpeculation):
            if params.adjusts_logits or params.min_p > 0:
                where = "under speculative decoding"
            elif self.speculator.config.method != "ngram":
                where = f"under {self.speculator.config.method} speculation (its drafts never reach the host)"
        if where is not None:
            what = (
                "a constraint"
                if params.constraint is not None and not params.adjusts_logits
                else ("penalties, min_p, min_tokens and logit_bias")
            )
            return f"{what} are not applied {where}; drop them, or serve this request from a plain engine"
        if params.constraint is not None and self.grammars is None:
            return "a constraint needs the engine's tokenizer: call engine.use_tokenizer(tokenizer) first"
        return None

    def use_tokenizer(self, tokenizer: object) -> None:
        """Bind the tokenizer (transformers', or an `xgrammar.TokenizerInfo`) that constrained
        requests (`SamplingParams.constraint`) are compiled against. Needs xgrammar
        (`batchkv[structured]`)."""
        self.grammars = Grammars(tokenizer, self.vocab_size)
        self.runner.grammars = self.grammars

    def compile_constraint(self, constraint: object) -> None:
        """Compile `constraint` now (cached), so that `submit` finds it ready; RequestError naming
        its field when it is malformed, unsupported or compiles too long. Thread-safe: the server
        runs it off its event loop."""
        if self.grammars is None:
            raise RequestError("a constraint needs the engine's tokenizer: call engine.use_tokenizer(tokenizer) first")
        self.grammars.compile(constraint)  # type: ignore[arg-type]

    def _reach(self, request: Request) -> int:
        return min(self.cache.capacity, len(request.prompt_ids) + request.params.max_new_tokens - 1)

    @property
    def cached_columns(self) -> int:
        """Columns the prefix cache keeps (finished histories, freed when their memory is needed)."""
        return self.scheduler.prefix.held_columns

    @property
    def kv_usage(self) -> tuple[int, int]:
        """(positions the columns of live requests hold, positions the store holds): the flat pool's
        rows less the scratch rows, as far as a store grown on demand may grow. Columns the prefix
        cache keeps count as free (they are freed when their memory is needed), as vLLM counts its
        cached blocks in `vllm:kv_cache_usage_perc`."""
        prefix, cache = self.scheduler.prefix, self.cache
        kept = {h.seq for h in prefix.cached}
        held = sum(cache.reach(seq) for seq in cache.sequences if seq not in kept)
        return held, cache.config.max_pool_rows() - cache.config.scratch_rows

    def prefix_blocks(self) -> list[int]:
        """The chain hashes of the 16-token blocks the prefix cache indexes, live prompts and kept
        histories (`batchkv.executor.prefix.block_hashes` hashes a prompt the same way): what a router
        asks to send a prompt where its prefix is. Empty without a prefix cache."""
        return self.scheduler.prefix.blocks()

    def cached_tokens(self, request_id: int) -> int | None:
        """Prompt tokens a live, admitted request reused from the prefix cache (None: not live or not
        admitted yet): what OpenAI's `usage.prompt_tokens_details.cached_tokens` reports."""
        state = self.scheduler.live.get(request_id)
        return None if state is None or state in self.scheduler.waiting else state.cached

    def cancel(self, request_id: int) -> bool:
        """Stop a request now and free its columns; False when it is not live (finished or unknown).

        Its samples' "cancelled" events come out of the next `step()`.
        """
        cancelled = self.scheduler.cancel(int_arg("cancel: request_id", request_id, error=RequestError))
        self.speculator.release()
        return cancelled

    # ---- stepping ------------------------------------------------------------------------------
    def _bucket(self, tokens: int) -> int:
        return self.buckets[bisect_left(self.buckets, tokens)]

    def step(self) -> list[Event]:
        """Launch one step and finish one (the previous with overlap, else this one); returns the
        cancellations since the last call, then the finished step's tokens and finishes."""
        start = time.perf_counter()
        launched = self._launch()  # schedule and run (queued on the device)
        done = self.pipeline.swap(launched)
        events = self._finish(done) if done is not None else []  # postprocess
        cancelled = self.scheduler.take_cancelled()  # taken once the step succeeded, else a later one's
        self.metrics.observe_call(start, time.perf_counter(), launched, cancelled, self)
        self._idle = launched is None and done is None
        return cancelled + events

    def _launch(self) -> InFlight | None:
        """Admit and plan (the scheduler), draft (the speculator), declare and prepare it on the
        cache, queue it on the device (the runner), commit. None: no step."""
        self.scheduler.admit()
        batch = self.scheduler.plan()
        if batch is None:
            return None
        self.speculator.extend(batch)  # decode rows become verify segments [anchor, drafts...]
        # At least as wide as its logits rows: the LM head runs on min(width, sample rows) rows.
        width = self._bucket(max(len(batch.seq_ids), batch.logits_rows))
        self.cache.declare_step(batch.seq_ids)
        self.cache.prepare_step(width)
        previous = self.pipeline.in_flight
        tokens = self.runner.launch(batch, width, previous.tokens if previous is not None else None)
        self.cache.commit_step()
        self.scheduler.launched(batch)
        return InFlight(batch, tokens, width, self.cache.num_sequences)

    def _finish(self, step: InFlight) -> list[Event]:
        """Read a launched step's tokens (the wait for the device), accept drafts, record tokens,
        finish and free."""
        batch, table = step.batch, self.scheduler.table
        runs = self.tp.read(step.tokens)
        self.speculator.accept(batch, runs)  # rewind verify segments to their accepted end
        now = time.perf_counter()
        read, emit = table.read[batch.slots], table.emit[batch.slots]  # before the step's tokens
        events = self.scheduler.complete(batch, runs, now, step.tokens.logprobs())
        self.speculator.release()
        self.metrics.observe_finish(now, table, batch.slots, read, emit, events)
        return events

    def stream(self) -> Iterator[Event]:
        """Step until every submitted request has finished, yielding events as they come."""
        while self.has_work:
            events = self.step()
            if self._idle and not events and self.has_work:
                raise StepError(f"no step could be planned with requests {sorted(self.scheduler.live)} live")
            yield from events

    def run_until_done(self) -> list[Event]:
        """Drain `stream()`; returns every event in order."""
        return list(self.stream())

    def warm_up(self) -> float:
        """Capture the graph of every step width now (compiling the kernels it launches), so that no
        step of the serving that follows pays for a capture, as a server does before it listens.
        Needs an engine that holds nothing yet; returns the seconds it took (0 without graphs).
        Storage that later grows or moves (`kv_positions` not allocated whole) captures again."""
        if not self.uses_graphs:
            return 0.0
        if self.has_work or self.cache.sequences:
            raise StepError(
                f"warm_up needs an engine that holds no sequences; this one holds {len(self.cache.sequences)} "
                "(call it before submitting requests, or after run_until_done() and clear_prefix_cache())"
            )
        start = time.perf_counter()
        self.runner.warm(self.buckets)
        return time.perf_counter() - start

    def clear_prefix_cache(self) -> None:
        """Free every cached prefix now (they are freed anyway when their memory is needed)."""
        self.scheduler.prefix.clear()

    def assert_idle(self) -> None:
        """Raise StepError unless no request is live and every column is free but those the prefix
        cache keeps (a leak check)."""
        cached = {h.seq for h in self.scheduler.prefix.cached}
        held = [s for s in self.cache.sequences if s not in cached] + self.speculator.sequences()
        if self.scheduler.live or held or self.pipeline.in_flight is not None:
            raise StepError(
                f"engine not idle: live requests {sorted(self.scheduler.live)}, held columns {held}, "
                f"a step in flight: {self.pipeline.in_flight is not None}"
            )
