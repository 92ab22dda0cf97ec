"""Which KV heads each prefill rank sends to which decode rank (kv_transfer/head_slices.py),
over every split the models allow: each decode rank gets exactly the heads its cache holds,
each head once, from a prefill rank that holds it; a head several prefill ranks hold is sent
by one of them only."""

from __future__ import annotations

import itertools

import pytest

from kv_transfer.head_slices import slices_to_send
from pdserve.models.tp_layout import kv_head_range

DEGREES = [1, 2, 4, 8]


def splits(kv_heads: int) -> list[tuple[int, int]]:
    """(P TP, D TP) pairs whose every degree splits `kv_heads` (divides it, or a multiple)."""
    fits = [n for n in DEGREES if kv_heads % n == 0 or n % kv_heads == 0]
    return list(itertools.product(fits, repeat=2))


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_every_decode_rank_gets_its_heads_once_from_a_holder(kv_heads):
    for prefill_tp, decode_tp in splits(kv_heads):
        received = {d: [] for d in range(decode_tp)}
        senders_of_head: dict[int, set[int]] = {}
        for p in range(prefill_tp):
            held = range(*kv_head_range(kv_heads, p, prefill_tp))
            for part in slices_to_send(kv_heads, p, prefill_tp, decode_tp):
                heads = range(part.first_head, part.end_head)
                assert set(heads) <= set(held), (prefill_tp, decode_tp, p, part)
                received[part.decode_rank].extend(heads)
                for head in heads:
                    senders_of_head.setdefault(head, set()).add(p)
        for d, heads in received.items():
            assert sorted(heads) == list(range(*kv_head_range(kv_heads, d, decode_tp))), (
                prefill_tp,
                decode_tp,
                d,
            )
        # One prefill rank sends each head, however many hold it.
        assert all(len(ranks) == 1 for ranks in senders_of_head.values())
        assert sorted(senders_of_head) == list(range(kv_heads))
