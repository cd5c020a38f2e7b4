"""Control-message decode cost: the Rust decoder (msgpack + schema) against the plain-Python
decoder it replaced (msgpack.unpackb + the Python schema table, loaded from git history).

Run: ``python benches/bench_control.py [--write benches/RESULTS.md]`` from the repository root
(needs git).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import bench_args, publish, table_section
from disagg_rs.control import Msg, check_fields, decode_message, encode_message

OLD_COMMIT = "5417454"  # the last commit with the Python schema table
OLD_VERSION = 2  # its control protocol version
INTRO = """Python: `msgpack.unpackb` + the per-type Python schema check the library used before
(loaded from git history; the frames re-packed under its protocol version); Rust:
`disagg_rs.control.decode_message` (bounded msgpack decoder + per-type schema in `disagg-core`,
dict built by the bindings). Best of 5 repeats. Command: `python benches/bench_control.py`.
The Rust path checks every message type (the Python one checked only the types the
coordinator accepts, and nested payloads not at all). Nested maps are slower in Rust: the
bindings build the Python dict item by item from the decoded tree, where msgpack's C unpacker
builds it directly."""


def _old_module() -> object:
    src = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:python/disagg_rs/control.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "old_control.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_control", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_control"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    args = bench_args(__doc__, "control")
    old = _old_module()
    frames = {
        "HEARTBEAT": encode_message(Msg.HEARTBEAT, engine_id="decode-0", incarnation=1 << 40),
        "SUBMIT, 16-token prompt": encode_message(
            Msg.SUBMIT, request_id=7, prompt=list(range(16)), max_new_tokens=64, timeout_s=30.0
        ),
        "SUBMIT, 4096-token prompt": encode_message(
            Msg.SUBMIT, request_id=7, prompt=list(range(4096)), max_new_tokens=64
        ),
        "PREFILL_DONE, 20-field ticket": encode_message(
            Msg.PREFILL_DONE,
            request_id=7,
            epoch=3,
            ticket={f"k{i}": list(range(8)) for i in range(20)},
        ),
    }
    rows = []
    for name, frame in frames.items():
        # The old decoder speaks the protocol version of its day: the same fields under it.
        old_frame = msgpack.packb({**msgpack.unpackb(frame), "v": OLD_VERSION}, use_bin_type=True)

        def py(frame: bytes = old_frame) -> None:
            old.check_fields(old.decode_message(frame))  # type: ignore[attr-defined]

        def rs(frame: bytes = frame) -> None:
            decode_message(frame)

        rs()  # the Rust check runs inside decode; check_fields is only for hand-built dicts
        check_fields(decode_message(frame))
        n = 2000 if len(frame) > 1000 else 20000
        t_py = min(timeit.repeat(py, number=n, repeat=5)) / n * 1e6
        t_rs = min(timeit.repeat(rs, number=n, repeat=5)) / n * 1e6
        rows.append(f"| {name} | {len(frame)} | {t_py:.2f} | {t_rs:.2f} | {t_py / t_rs:.2f}x |")
    title = "Control-message decode (benches/bench_control.py)"
    columns = ["message", "bytes", "Python us", "Rust us", "ratio"]
    publish(args.write, "control", table_section(title, [INTRO], columns, rows))


if __name__ == "__main__":
    main()
