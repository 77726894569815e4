"""The prefix cache: a prompt that starts like a history the store already holds skips its prefill.

An executor policy over the BatchControl verbs (host bookkeeping only). It indexes two kinds of
history, each a column of the cache:
- *live*: the prompt of a request being served, as far as its prefill has written it;
- *cached*: a finished sample's column (prompt and generated tokens), kept resident until its
  columns or rows are needed (then evicted least recently used first).
A new request's prompt is matched at token granularity against both; the last prompt token is
always computed (it gives the first logits); a request with `prompt_logprobs` reuses nothing (the
logits of every prompt position score a token; vLLM skips its prefix cache for them too), though
others may reuse what it writes. The request's column then:
- *adopts* a cached history that the match covers whole (a conversation continuing its own
  history: no copy; the column is rewound to the match and grown to the request's reach),
- or *clones* the matched prefix (`seq_clone`, a device copy: ~0.13 ms for 1,536 positions of the
  8B model, where recomputing them is ~25 ms) from a cached history it covers in part or from a
  live one,
- or *waits* while a live request still prefilling a longer shared prefix will write at least one
  more chunk of it (prefix-aware admission: many requests sharing a system prompt prefill it once).
Matches are indexed by 16-token blocks (a chain hash per block, verified against the tokens) and
then extended token by token; a prompt that matches no block is compared only with the histories that
start with its first token (also indexed), so admitting N requests at once costs O(N), not O(N^2).
A history is matched only under the same RoPE offset (its keys were rotated at those indexes), and
only as far back as every ring layer still holds (the ring floor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from batchkv.cache import BatchedSequenceCache
from batchkv.executor.state import RequestState, SampleState

BLOCK = 16  # tokens per indexed block


@dataclass(eq=False)
class History:
    """One indexed history: its column and the tokens whose K/V it holds (prompt, then generated)."""

    seq: int
    rope_offset: int
    prompt: tuple[int, ...]
    generated: list[int]  # a finished sample's tokens (the engine appends them as they are read)
    written: int  # positions of K/V the column holds; for a live request, updated from its prefill
    live: RequestState | None = None
    used: int = 0  # last use (a tick), for LRU eviction
    blocks: list[int] = field(default_factory=list)  # chain hashes of the indexed full blocks

    def matchable(self) -> int:
        """Positions whose K/V are written and whose tokens are known (what a clone may copy)."""
        if self.live is not None:
            return min(self.live.prefilled, len(self.prompt))
        return min(self.written, len(self.prompt) + len(self.generated))

    def indexable(self) -> int:
        """Tokens indexed: a live request's whole prompt (to see what it will write), else the matchable."""
        return len(self.prompt) if self.live is not None else self.matchable()

    def token(self, i: int) -> int:
        return self.prompt[i] if i < len(self.prompt) else self.generated[i - len(self.prompt)]

    def tokens(self, lo: int, hi: int) -> tuple[int, ...]:
        cut = len(self.prompt)
        if hi <= cut:
            return self.prompt[lo:hi]
        return self.prompt[lo:cut] + tuple(self.generated[max(lo, cut) - cut : hi - cut])


@dataclass(frozen=True)
class Match:
    """The reuse a prompt can make: `length` positions of `history` (0: none); `wait`: better to wait
    for a live request still writing the shared prefix."""

    history: History | None
    length: int
    wait: bool = False
    take: bool = False  # adopt the cached history even though the match covers only part of it

    @property
    def adopts(self) -> bool:
        """The request takes a cached history's column over (no copy): the match covers it whole, or
        the store has no room for a copy beside it (`take`)."""
        h = self.history
        return h is not None and h.live is None and (self.take or self.length == h.matchable())


NO_MATCH = Match(None, 0)


class PrefixCache:
    """Histories by their prompts' 16-token blocks, and the cached (finished) ones in LRU order."""

    def __init__(self, cache: BatchedSequenceCache, prefill_chunk: int) -> None:
        self.cache = cache
        self.prefill_chunk = prefill_chunk  # a wait must save at least this many positions
        self._index: dict[int, dict[History, None]] = {}  # chain hash -> histories through that block
        self._live: dict[RequestState, History] = {}
        self.cached: dict[History, None] = {}  # finished histories, least recently used first
        # (rope offset, first token) -> the live and cached histories starting with it: the candidates
        # of a prompt whose first block matches no indexed one (a match shorter than a block)
        self._heads: dict[tuple[int, int], dict[History, None]] = {}  # keys: `_head`
        # cached histories whose column holds K/V of tokens not read yet (overlap reads a step behind):
        # their matchable part still grows, so a lookup indexes what it gained first
        self._growing: dict[History, None] = {}
        self._tick = 0
        self.admitted = self.hits = self.lookups = self.reused = self.evictions = 0

    # ---- histories -------------------------------------------------------------------------------
    def add_live(self, state: RequestState) -> None:
        """A request just admitted: its prompt is indexed whole (so others see what it will write)
        and matchable as far as its prefill has written it."""
        seq = state.samples[0].seq
        history = History(seq, state.request.rope_offset, state.prompt, [], 0, live=state)
        self._live[state] = history
        self._track(history)
        self.admitted += 1

    def counts(self) -> tuple[int, int, int, int]:
        """(requests admitted, of them reusing a prefix, positions reused, histories evicted) so far."""
        return self.admitted, self.hits, self.reused, self.evictions

    def end_live(self, state: RequestState) -> None:
        """The request's prompt column is gone (finished into the cache, or cancelled)."""
        history = self._live.pop(state, None)
        if history is not None:
            self._unindex(history)

    def keep(self, sample: SampleState) -> bool:
        """Keep a finished sample's column as a cached history instead of freeing it; False when
        there is nothing worth keeping (the caller frees the column)."""
        state, seq = sample.owner, sample.seq
        if sample.index == 0:
            self.end_live(state)
        written = self.cache.pos(seq)
        if written < BLOCK:
            return False
        history = History(seq, state.request.rope_offset, state.prompt, sample.tokens, written, used=self._use())
        self.cached[history] = None
        self._track(history)
        if history.matchable() < written:
            self._growing[history] = None
        return True

    def evict(self, columns: int, rows: int, keep: History | None = None) -> int:
        """Free cached histories but `keep`, least recently used first, until `columns` columns and
        `rows` rows more are free than now (or none is left). Returns how many were freed."""
        freed_cols = freed_rows = done = 0
        for history in list(self.cached):
            if freed_cols >= columns and freed_rows >= rows:
                break
            if history is keep:
                continue
            freed_rows += self.cache.reach(history.seq)
            freed_cols += 1
            self._drop(history)
            done += 1
        self.evictions += done
        return done

    def clear(self) -> None:
        """Free every cached history."""
        for history in list(self.cached):
            self._drop(history)

    def blocks(self) -> list[int]:
        """The chain hashes of every indexed block (live prompts and kept histories)."""
        return list(self._index)

    @property
    def held_columns(self) -> int:
        return len(self.cached)

    # ---- matching --------------------------------------------------------------------------------
    def lookup(self, state: RequestState) -> Match:
        """The longest reusable prefix of `state`'s prompt (at most its length less one), and whether
        a live request still prefilling, no less urgent, will write at least one chunk more of it.
        None for a request with `prompt_logprobs`: every prompt position's logits score a token, so
        it computes them all."""
        self.lookups += 1
        if state.request.params.prompt_logprobs is not None:
            return NO_MATCH
        prompt, offset = state.prompt, state.request.rope_offset
        for history in list(self._growing):  # tokens read since it was cached make more of it matchable
            if history.matchable() // BLOCK > len(history.blocks):
                self._refresh(history)
            if history.matchable() == history.written:
                del self._growing[history]
        limit = len(prompt) - 1
        chain, depth = 0, 0
        found: list[History] = list(self._heads.get(_head(offset, prompt), ()))
        for b in range(limit // BLOCK):
            chain = _chain(chain, offset, prompt[b * BLOCK : (b + 1) * BLOCK])
            through = self._index.get(chain)
            if not through:
                break
            found, depth = list(through), (b + 1) * BLOCK
        shared = {}  # history -> tokens it shares with the prompt (a live one: its whole prompt)
        for history in found:
            if history.rope_offset == offset:
                most = min(limit, history.indexable())
                shared[history] = _extend(history, prompt, min(depth, most), most)
        best, best_len = None, 0
        for history, n in shared.items():
            n = min(n, history.matchable())
            n = n if n >= self.cache.ring_floor(history.seq) else 0
            if n > best_len or (n == best_len and n and history.live is None):  # ties: a cached one
                best, best_len = history, n
        if best is not None and depth and best.tokens(0, min(depth, best_len)) != prompt[: min(depth, best_len)]:
            return Match(None, 0)  # a chain-hash collision (never seen; checked all the same)
        # Worth waiting for: a prompt still being written that will give at least a chunk more, and
        # runs meanwhile (a less urgent one is paused while this request's peers hold columns).
        wait = any(
            h.live is not None and h.live.remaining > 0 and n >= best_len + self.prefill_chunk
            and h.live.request.priority <= state.request.priority
            for h, n in shared.items()
        )  # fmt: skip
        return Match(best, best_len, wait)

    def place(self, match: Match, reach: int) -> int:
        """The column of a request reusing `match` (a history): the cached history's own, rewound to
        the match and grown to `reach` (adopted), or a clone of the match's positions."""
        history = match.history
        assert history is not None and match.length
        self.touch(history, match.length)
        if not match.adopts:
            return self.cache.seq_clone(history.seq, upto=match.length, reach=reach)
        self._unindex(history)
        del self.cached[history]
        self.cache.rewind(history.seq, match.length)
        self.cache.reserve(history.seq, max(reach, self.cache.reach(history.seq)))
        return history.seq

    def room(self, match: Match, columns: int, rows: int) -> tuple[int, int]:
        """Columns and rows a request of `columns` samples of `rows` positions in all needs beyond
        what adopting `match`'s column brings."""
        if not match.adopts:
            return columns, rows
        held = self.cache.reach(match.history.seq)  # type: ignore[union-attr]
        return columns - 1, rows - min(held, rows // max(columns, 1))

    def touch(self, history: History, reused: int) -> None:  # (place counts every hit through here)
        """Count a hit of `reused` positions; a cached history becomes the most recently used."""
        self.hits += 1
        self.reused += reused
        if history in self.cached:
            del self.cached[history]
            self.cached[history] = None
            history.used = self._use()

    # ---- index -----------------------------------------------------------------------------------
    def _track(self, history: History) -> None:
        """Index a new history: its full blocks, and its first token (a prompt sharing no block with it can
        share only a prefix that starts with that token)."""
        self._heads.setdefault(_head(history.rope_offset, history.prompt), {})[history] = None
        self._refresh(history)

    def _refresh(self, history: History) -> None:
        """Index the full blocks of `history` that were not indexed yet."""
        full = history.indexable() // BLOCK
        while len(history.blocks) < full:
            b = len(history.blocks)
            prev = history.blocks[-1] if history.blocks else 0
            chain = _chain(prev, history.rope_offset, history.tokens(b * BLOCK, (b + 1) * BLOCK))
            history.blocks.append(chain)
            self._index.setdefault(chain, {})[history] = None

    def _unindex(self, history: History) -> None:
        """Take `history` out of the index (blocks and first token): it is no longer live nor cached."""
        self._growing.pop(history, None)
        head = _head(history.rope_offset, history.prompt)
        if head in self._heads:
            self._heads[head].pop(history, None)
            if not self._heads[head]:
                del self._heads[head]
        for chain in history.blocks:
            through = self._index.get(chain)
            if through is not None:
                through.pop(history, None)
                if not through:
                    del self._index[chain]
        history.blocks = []

    def _drop(self, history: History) -> None:
        self._unindex(history)
        del self.cached[history]
        self.cache.seq_rm(history.seq)

    def _use(self) -> int:
        self._tick += 1
        return self._tick


def block_hashes(prompt: Sequence[int], rope_offset: int = 0) -> list[int]:
    """The chain hashes of `prompt`'s full 16-token blocks, as the index keys them: what a router
    outside the engine compares with `PrefixCache.blocks()` (Python's hash of int tuples is the
    same in every process of one platform)."""
    out, chain = [], 0
    for b in range(len(prompt) // BLOCK):
        chain = _chain(chain, rope_offset, tuple(prompt[b * BLOCK : (b + 1) * BLOCK]))
        out.append(chain)
    return out


class NoPrefixCache:
    """The prefix cache when reuse is off (`Engine(prefix_cache=False)`, or under a DFlash drafter):
    it matches nothing and keeps nothing, so the scheduler calls it as it calls `PrefixCache`."""

    def __init__(self) -> None:
        self.cached: dict[History, None] = {}  # always empty

    def add_live(self, state: RequestState) -> None:
        """Nothing to index."""

    def counts(self) -> tuple[int, int, int, int]:
        """Nothing admitted through it, reused or evicted."""
        return 0, 0, 0, 0

    def end_live(self, state: RequestState) -> None:
        """Nothing was indexed."""

    def keep(self, sample: SampleState) -> bool:
        """Keeps nothing: the caller frees the column."""
        return False

    def evict(self, columns: int, rows: int, keep: History | None = None) -> int:
        """Nothing cached to free."""
        return 0

    def clear(self) -> None:
        """Nothing cached."""

    held_columns = 0

    def blocks(self) -> list[int]:
        """No block is indexed."""
        return []

    def lookup(self, state: RequestState) -> Match:
        """No reuse."""
        return NO_MATCH

    def place(self, match: Match, reach: int) -> int:
        """Never called: a match from `lookup` has no history."""
        raise AssertionError("NoPrefixCache.place: no match has a history")

    def room(self, match: Match, columns: int, rows: int) -> tuple[int, int]:
        """All of it: no column is adopted."""
        return columns, rows


def _head(offset: int, prompt: tuple[int, ...]) -> tuple[int, int]:
    """The first-token index's key of a prompt (never empty: an empty prompt is refused at submission)."""
    return offset, prompt[0]


def _chain(prev: int, offset: int, block: tuple[int, ...]) -> int:
    """The chain hash of a block after the blocks `prev` hashes (the RoPE offset in the first)."""
    return hash((prev, offset, block))


def _extend(history: History, prompt: tuple[int, ...], start: int, most: int) -> int:
    """Common prefix of `history` and `prompt` up to `most`, taking the first `start` tokens as equal
    (their block hashes matched; the chosen history is verified once), extended token by token."""
    n = start
    while n < most and history.token(n) == prompt[n]:
        n += 1
    return n
