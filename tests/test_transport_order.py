"""Two-sided messages match by post order per peer pair (NCCL ignores tags): gloo run with
``match_by_order=True`` in spawned processes shows what happens when a posted receive never
gets its own send, and that the in-band headers and the filler keep it from becoming a
wrong answer.

Without headers, a decode receive posted for request A that the prefill never answers takes
the prefill's next send on the pair, B's, and B's bytes are scattered and admitted as A's
(same sizes: nothing else notices). Now the header check refuses them (``MessageOrderError``
naming ``tag``, both values), nothing is scattered and the pair is marked out of step; and a
prefill that answers A with a filler keeps the pair in step, so B lands byte-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import transport_workers as tw
from transport_workers import Case, Side, Worker, WorkerError

pytestmark = pytest.mark.slow

KV = Case("kv_tp1_to_tp1", (Side(),), (Side(),))
CONV = Case("conv_tp1_to_tp1", (Side(num_blocks=4),), (Side(num_blocks=4),), kind="conv")
TAG_A, TAG_B = 4 * 11, 4 * 12  # two requests' KV tags (two_sided_tag(11 / 12, "kv"))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode process in one gloo group; chunks of 4 KiB, so a KV handoff
    moves in several messages. One pair per test: a pair left out of step stays so."""
    for workers in tw.worker_pool("gloo-small", ["pre0", "dec0"], str(tmp_path / "store")):
        yield workers[0], workers[1]


@pytest.fixture(params=[KV, CONV], ids=lambda c: c.name)
def case(request: pytest.FixtureRequest) -> Case:
    """Each test runs for a KV cache and for SSM conv state."""
    param: Case = request.param
    return param


class Wired(NamedTuple):
    """The pair with ``case`` set up on both sides, matching by order, and its metadata."""

    pre: Worker
    dec: Worker
    src_meta: Any
    dst_meta: Any


@pytest.fixture
def wired(pair: tuple[Worker, Worker], case: Case) -> Wired:
    pre, dec = pair
    src = pre("setup", case.name, case, case.srcs[0], "src", match_by_order=True)
    dst = dec("setup", case.name, case, case.dsts[0], "dst", match_by_order=True)
    return Wired(pre, dec, src, dst)


def _other_dst_ids(case: Case) -> list[int]:
    """Destination blocks of request A: disjoint from B's (``tw.dst_ids``)."""
    side = case.dsts[0]
    taken = set(tw.dst_ids(case, side))
    free = [b for b in range(side.num_blocks) if b not in taken]
    return free[: len(taken)]


def _num_tokens(case: Case) -> int | None:
    return case.num_tokens if case.kind == "kv" else None


def _post(dec: Worker, case: Case, src_meta: Any, handle: str, dst: list[int], tag: int) -> None:
    dec(
        "call_as",
        case.name,
        handle,
        "begin_pull_blocks",
        [src_meta],
        tw.src_ids(case, case.srcs[0]),
        dst,
        num_tokens=_num_tokens(case),
        tag=tag,
    )


def _push(pre: Worker, case: Case, src_meta: Any, dst_meta: Any, tag: int, **kw: Any) -> None:
    pre(
        "call_as",
        case.name,
        f"push{tag}",
        "begin_push_blocks",
        [dst_meta],
        tw.src_ids(case, case.srcs[0]),
        src_metas=[src_meta],
        num_tokens=_num_tokens(case),
        tag=tag,
        **kw,
    )


def test_a_receive_that_never_got_its_send_refuses_the_next_requests_bytes(
    wired: Wired, case: Case
) -> None:
    pre, dec, src_meta, dst_meta = wired
    # The decode posts request A's receives; the prefill never sends A (its pin expired, the
    # coordinator dropped the request...) and pushes request B, of the same size, next.
    _post(dec, case, src_meta, "A", tw.dst_ids(case, case.dsts[0]), TAG_A)
    _push(pre, case, src_meta, dst_meta, TAG_B)
    with pytest.raises(WorkerError) as info:
        dec("wait", "A")
    # B's first message landed in A's receive: refused by its header, naming both tags.
    assert info.value.kind == "TransferError"
    assert "out of step" in info.value.message
    assert f"`tag` is {TAG_B}, the receive was posted for {TAG_A}" in info.value.message
    # Nothing was scattered: A's destination still holds the sentinel, not B's bytes.
    got = dec("buffer", case.name)
    assert np.array_equal(got, tw.make_buffer(case, case.dsts[0], fill=False).numpy())
    # The pair is marked out of step; the next receive from that peer is refused unposted.
    marked = dec("attr", case.name, "out_of_step")
    assert list(marked) == [src_meta["dist_rank"]]
    with pytest.raises(WorkerError, match="out of step") as again:
        _post(dec, case, src_meta, "C", _other_dst_ids(case), 4 * 13)
    assert again.value.kind == "HandoffStateError"


def test_a_filler_for_an_unsendable_request_keeps_the_pair_in_step(
    wired: Wired, case: Case
) -> None:
    pre, dec, src_meta, dst_meta = wired
    _post(dec, case, src_meta, "A", _other_dst_ids(case), TAG_A)
    _post(dec, case, src_meta, "B", tw.dst_ids(case, case.dsts[0]), TAG_B)
    # The prefill cannot send A: it answers A's receives with a filler of the posted sizes,
    # then pushes B.
    _push(pre, case, src_meta, dst_meta, TAG_A, filler=True)
    _push(pre, case, src_meta, dst_meta, TAG_B)
    with pytest.raises(WorkerError, match="aborted the handoff") as info:
        dec("wait", "A")
    assert info.value.kind == "TransferError"
    dec("wait", "B")
    pre("wait", f"push{TAG_A}")
    pre("wait", f"push{TAG_B}")
    # B landed byte-exact, A's blocks were never written, and the pair is still in step.
    got = dec("buffer", case.name)
    assert np.array_equal(got, tw.expected_dst(case, case.dsts[0]).numpy())
    assert dec("attr", case.name, "out_of_step") == {}
