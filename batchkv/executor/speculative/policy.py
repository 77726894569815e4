"""Draft lengths that follow acceptance: how many drafts each speculating sample proposes next.

A rejected draft is not free: it is one more target row in the verify step (past 4 rows the 8B's
projections leave the few-row kernel for cuBLAS, and at 32 sequences rows are compute), and a
DFlash block costs a drafter forward and an LM head over its rows. On the H200 at one sequence
(bench/results/spec-h200.json of 2026-11-30, 8B) a 16-row verify took 6.3 ms and the drafter 1.5 ms
against a 5.5 ms plain step, so drafts that all fail decoded at 0.66x. Per sample (host only,
after each verify):

- start at k = block_size - 1 (a trained drafter accepts most of a block);
- all k drafts accepted: k doubles, up to block_size - 1;
- a < k accepted: keep the accepted drafts and half of the rejected tail, k = a + (k - a) // 2;
  a steady acceptance length a + 1 is tracked within log2(block_size) steps and never cut below;
- k reaches 0: the sample decodes without drafts for `wait` steps (no drafter block, a one-row
  segment; a DFlash drafter still writes its committed context), then probes with one draft. A
  failed probe doubles `wait` (2, 4, ... MAX_WAIT); an accepted one resumes at k = 2 (1 for a
  block of 2) and resets it.

Only the draft count changes, never what is verified or accepted: output stays lossless.
`SpeculativeConfig(adaptive=False)` keeps k at block_size - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchkv.executor.state import SampleState

FIRST_WAIT = 2  # steps without drafts after k first reaches 0
MAX_WAIT = 16  # longest wait between probes: bounds the tokens a burst of acceptance can miss


@dataclass
class _Length:
    k: int  # drafts of the next verify; 0 while waiting
    wait: int = FIRST_WAIT  # steps without drafts after the next failure at k = 0 or a failed probe
    idle: int = 0  # steps left before the next probe (while k == 0)
    counted: int = -1  # tokens the sample held when a step last counted toward `idle`


class DraftLengths:
    """Per-sample draft lengths (see the module docstring). `fixed=True`: always `longest`."""

    def __init__(self, longest: int, *, fixed: bool = False) -> None:
        self.longest, self.fixed = longest, fixed
        self._states: dict[SampleState, _Length] = {}

    def next(self, sample: SampleState) -> int:
        """Drafts the policy gives `sample` in the step being planned (called once per planned step;
        a step planned again after a launch that raised counts once: every step that completes
        adds tokens, so the sample's token count names the step)."""
        if self.fixed:
            return self.longest
        st = self._states.setdefault(sample, _Length(self.longest))
        if st.k == 0:
            if st.counted != len(sample.tokens):
                st.idle -= 1
                st.counted = len(sample.tokens)
            if st.idle <= 0:
                return 1  # probe
        return st.k

    def update(self, sample: SampleState, proposed: int, accepted: int) -> None:
        """A verify segment of `sample` with `proposed` >= 1 drafts accepted `accepted` of them."""
        st = self._states.get(sample)
        if st is None:
            return
        if accepted == proposed:
            if st.k == 0:  # a probe passed
                st.k, st.wait = min(self.longest, 2), FIRST_WAIT  # block_size 2 drafts one at most
            else:  # proposed may be cut short by capacity or max_new_tokens: never shrink on it
                st.k = min(self.longest, max(st.k, 2 * proposed))
            return
        st.k = accepted + (proposed - accepted) // 2
        if st.k == 0:
            st.idle = st.wait
            st.wait = min(MAX_WAIT, 2 * st.wait)

    def release(self) -> None:
        """Forget finished and cancelled samples."""
        for sample in [s for s in self._states if s.finish is not None]:
            del self._states[sample]
