"""`int_args` checks a list of plain ints in bounds in one pass and everything else item by item: both
ways must accept exactly what `int_arg` accepts item by item, and refuse with its message."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchkv.checks import int_arg, int_args
from batchkv.errors import BatchKVError, RequestError

ITEMS = st.one_of(
    st.integers(-3, 9),
    st.integers(-(2**70), 2**70),  # past int64
    st.booleans(),
    st.integers(-3, 9).map(np.int64),
    st.integers(0, 9).map(np.uint8),
    st.sampled_from([2.0, 1.5, float("nan"), "3", None, np.bool_(True)]),
)


def outcome(call):
    try:
        return call()
    except BatchKVError as exc:
        return type(exc), str(exc)


@settings(max_examples=300, deadline=None)
@given(st.lists(ITEMS, max_size=6), st.sampled_from([list, tuple]), st.sampled_from([(0, 7), (None, 7), (0, None)]))
def test_int_args_accepts_and_refuses_exactly_what_int_arg_does_item_by_item(values, kind, bounds):
    lo, hi = bounds
    whole = outcome(lambda: int_args("prompt_ids", kind(values), lo, hi, error=RequestError))
    each = outcome(
        lambda: tuple(int_arg(f"prompt_ids[{i}]", v, lo, hi, error=RequestError) for i, v in enumerate(values))
    )
    assert whole == each
    if isinstance(whole, tuple) and whole and not isinstance(whole[0], type):
        assert all(type(x) is int for x in whole)  # Python ints, whatever came in
