"""Coverage-guided fuzzing (atheris) of every decoder that takes bytes or dicts from a peer.

Each input is a msgpack frame. It goes to ``control.decode_message`` as is, and, when it
unpacks (to a map or any other value), to ``KVShardLayout.from_dict``, ``SSMShardLayout.from_dict``,
``KVGeometry.from_dict``, ``SSMGeometry.from_dict``, the ticket's integrity table and the
transport metadata check. Every
call must either succeed or raise a :class:`disagg_rs.exceptions.DisaggError`; anything else
(another exception, a PyO3 panic, a crash) is a finding and stops the fuzzer.

Run: ``python tests/fuzz_atheris.py -runs=20000`` (``tests/test_fuzz_atheris.py`` does, in
``make test``); add a corpus directory to keep what it learns.
"""

from __future__ import annotations

import contextlib
import sys

import atheris

# Heavy dependencies (torch via the transport metadata check) are imported before the
# instrumented block: instrumenting them costs minutes and adds no coverage of our code.
import disagg_rs
from disagg_rs.exceptions import DisaggError
from disagg_rs.integrity import IntegrityTable
from disagg_rs.transfer_backends.base import check_meta_fields

with atheris.instrument_imports():
    import msgpack

    from disagg_rs import control

INTEGRITY_SHAPES = IntegrityTable.shapes(disagg_rs.KVShardLayout(3, 2), None)

DECODERS = (
    lambda d: IntegrityTable.from_wire(d, INTEGRITY_SHAPES),
    disagg_rs.KVShardLayout.from_dict,
    disagg_rs.SSMShardLayout.from_dict,
    disagg_rs.KVGeometry.from_dict,
    disagg_rs.SSMGeometry.from_dict,
    lambda d: check_meta_fields(d, "nixl"),
)


def _state() -> control.CoordinatorState:
    state = control.CoordinatorState(engine_timeout_s=1e9)
    for ident, eid, role in ((b"prefill:p0:1", "p0", "prefill"), (b"decode:d0:1", "d0", "decode")):
        frame = control.encode_message(
            control.Msg.REGISTER, engine_id=eid, role=role, incarnation=1, meta={}
        )
        state.handle(ident, control.decode_message(frame), 0.0)
    return state


STATE = _state()


def one_input(data: bytes) -> None:
    """Fuzz target: every decoder accepts or raises a typed error."""
    try:
        msg = control.decode_message(data)
    except DisaggError:
        msg = None
    if msg is not None:
        # A decoded frame reaches the coordinator, with engines registered so that every
        # message type finds a state to act on; handle() must never raise.
        STATE.handle(b"prefill:p0:1", msg, 1.0)
        STATE.handle(b"decode:d0:1", msg, 2.0)
        STATE.poll(3.0)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # not a frame at all: nothing more to decode
        return
    for decode in DECODERS:  # a map or anything else a peer could send
        with contextlib.suppress(DisaggError):
            decode(obj)


def main() -> None:
    """Entry point (libFuzzer flags pass through)."""
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
