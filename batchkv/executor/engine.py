"""The engine: requests in, tokens streamed out, many sequences decoding together.

One `step()` launches a step and finishes one. Launching: admit waiting requests while columns are
free, pack a step (decode tokens first, then prompt chunks), begin it on the cache (`begin_step`),
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

from batchkv.cache import BatchedSequenceCache
from batchkv.checks import int_arg
from batchkv.errors import RequestError, StepError
from batchkv.executor import build
from batchkv.executor.constraints import Grammars
from batchkv.executor.launch import start, stops_ranks_on_failure
from batchkv.executor.metrics import Metrics
from batchkv.executor.pipeline import InFlight, Pipeline
from batchkv.executor.request import Event, Request, SamplingParams, StepModel, fit_problem
from batchkv.executor.roles import Role
from batchkv.executor.scheduler import RequestState
from batchkv.executor.sizing import DEFAULT_STEP_TOKENS
from batchkv.executor.speculative import NoSpeculation, SpeculativeConfig


class Engine:
    """Continuous batching of `Request`s over one `BatchedSequenceCache`.

    model: callable as model(input_ids [W] int64, indexes [3, W] int64, cache, logits_rows [R]
        int64) -> float32 [R, vocab]; exposes cache_spec() -> dict(num_layers, kv_heads, head_dim, [value_dim,]
        layers, dtype), vocab_size and device (and optionally max_positions).
    max_seqs: resident sequences (columns); a request with n samples holds n of them. Every
        running sample decodes in every step, up to MAX_SAMPLE_ROWS (1,024) logits rows a step
        (past that, or past max_step_tokens, they take turns; 256 when speculating). "auto": with
        `kv_positions="auto"`, the store's positions first, then as many sequences as a step can
        decode (1,024, at most max_step_tokens) and the store holds at a reach of 512 positions
        (`batchkv.executor.sizing.auto_rows`). The same min(max_seqs, 1,024) rows bound how many
        prompt tokens a step scores for `prompt_logprobs`. Past 256 rows the LM head runs in chunks
        of at most 256 rows (`batchkv.executor.rows.HEAD_CHUNK`).
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
        `DEFAULT_STEP_TOKENS` (1,024). "auto" (`batchkv run` and `batchkv serve`'s default): 1,024 for
        16 GB of weights, off CUDA and under tensor parallelism, more for smaller models, up to 8,192
        (`sizing.auto_step_tokens`).
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
        `max_step_tokens` (the widths reach max_step_tokens + min(256, max_seqs) * (block_size - 1),
        256 being MAX_SPECULATIVE_ROWS),
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
        max_step_tokens: int | str = DEFAULT_STEP_TOKENS,
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
        if max_step_tokens == "auto" and tensor_parallel > 1:  # every rank the same budget, whatever its shard
            max_step_tokens = DEFAULT_STEP_TOKENS
        options = {k: v for k, v in locals().items() if k not in ("self", "model", "tensor_parallel", "_role")}
        if _role is None:  # a model or a source; more ranks started by batchkv.tp (executor.launch)
            _role, model = start(model, tensor_parallel, options)
        self.role: Role = _role
        self._stop = weakref.finalize(self, _role.close)  # stops the other ranks if construction fails
        shape = build.check_shape(model, max_seqs=max_seqs, capacity=capacity, max_step_tokens=max_step_tokens,
                                  prefill_chunk=prefill_chunk, width_buckets=width_buckets, use_graphs=use_graphs,
                                  row_buckets=row_buckets, row_step=row_step, seed=seed, kv_dtype=kv_dtype,
                                  speculative=speculative, kv_positions=kv_positions)  # fmt: skip
        self.device = build.engine_device(model, device)
        self.pipeline = Pipeline.for_engine(overlap, speculating=speculative is not None, device=self.device)
        config, self.sizing = build.size_store(model, shape, memory_fraction, self.role)
        self.cache: BatchedSequenceCache = self.role.cache(config, self.device, attention=attention)
        graphs = build.graph_set(self.cache, use_graphs, self.role)
        self.buckets = shape.buckets
        self.vocab_size = int(model.vocab_size)
        self.eos_token_ids = tuple(getattr(model, "eos_token_ids", None) or ())  # merged into requests' stops
        self.scheduler = build.build_scheduler(self.cache, shape, prefill_budget, prefix_cache, speculative)
        self.metrics = Metrics(config.max_seqs, generation=self.cache.generation)
        self.runner, self.speculator = build.build_runner(
            model, self.cache, shape, graphs, speculative, self.metrics, self.role
        )
        self._seeds = random.Random(shape.seed)
        self.grammars: Grammars | None = None  # use_tokenizer: constrained decoding
        self._next_id = 0
        self._idle = False
        self.role.ready()  # every rank has built its engine

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
        params, speculating = request.params, not isinstance(self.speculator, NoSpeculation)
        problem = fit_problem(request, self.cache, self.vocab_size, self.scheduler.max_step_tokens, speculating)
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
        if not isinstance(self.speculator, NoSpeculation) and self.speculator.config.method != "ngram":
            only_constraint = params.constraint is not None and not params.adjusts_logits and not params.min_p
            what = "a constraint is" if only_constraint else "penalties, min_p, min_tokens and logit_bias are"
            return (
                f"{what} not applied under {self.speculator.config.method} speculation (its drafts never reach the "
                "host); drop them, or serve this request from an engine with n-gram speculation or none"
            )
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
        """Admit and plan (the scheduler), draft (the speculator), begin it on the cache (declared
        and staged in one verb), queue it on the device (the runner), commit. None: no step."""
        self.scheduler.admit()
        batch = self.scheduler.plan()
        if batch is None:
            return None
        self.speculator.extend(batch)  # decode rows become verify segments [anchor, drafts...]
        # At least as wide as its logits rows: the LM head runs on min(width, sample rows) rows.
        width = self._bucket(max(len(batch.seq_ids), batch.logits_rows))
        self.cache.begin_step(batch.ints("seq_ids"), width)  # (an array: faster than a list)
        previous = self.pipeline.in_flight
        tokens = self.runner.launch(batch, width, previous.tokens if previous is not None else None)
        self.cache.commit_step()
        self.scheduler.launched(batch)
        return InFlight(batch, tokens, width, self.cache.num_sequences)

    def _finish(self, step: InFlight) -> list[Event]:
        """Read a launched step's tokens (the wait for the device), accept drafts, record tokens,
        finish and free."""
        batch, table = step.batch, self.scheduler.table
        runs = self.role.read(step.tokens)
        self.speculator.accept(batch, runs)  # rewind verify segments to their accepted end
        now = time.perf_counter()
        read, emit = table.read[batch.slots], table.emit[batch.slots]  # before the step's tokens
        events = self.scheduler.complete(batch, runs, now, step.tokens.logprobs())
        self.speculator.release()
        self.metrics.observe_finish(now, table, batch.slots, read, emit, self.scheduler.finishes)
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
        """Capture the graphs of every step width now (with prompt chunks and, where those are long, short),
        so that no step of the serving that follows pays for a capture, as a server does before it listens.
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
