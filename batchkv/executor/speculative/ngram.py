"""N-gram prompt lookup: a model-free proposer.

The last n tokens of a sample's history (prompt + output, n from `ngram_max` down to 1) are looked
up among its earlier tokens; the most recent earlier occurrence of the longest matching suffix
proposes the tokens that followed it. Host only (numpy over the sample's history); the proposals
are plain token ids, so their proposal distribution is a point mass.
"""

from __future__ import annotations

import numpy as np


def ngram_propose(history: np.ndarray, count: int, ngram_max: int) -> list[int]:
    """Up to `count` tokens continuing `history` (int64 [L]) by lookup; [] when nothing matches.

    >>> ngram_propose(np.array([5, 6, 7, 1, 5, 6]), 2, ngram_max=3)   # "5 6" was followed by 7, 1
    [7, 1]
    """
    length = len(history)
    if count <= 0 or length < 2:
        return []
    for n in range(min(ngram_max, length - 1), 0, -1):
        suffix = history[length - n :]
        # Windows starting at i < length - n: every earlier occurrence of the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(history[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return history[start : start + count].tolist()
    return []
