"""Command-line tools built on the library: the end-to-end demo (:mod:`.demo`), the fault soak
(:mod:`.soak`) and the quick benchmark (:mod:`.quickbench`). Not part of the library's API:
``disagg-rs demo``, ``disagg-rs bench`` and ``python -m disagg_rs.tools.soak`` run them."""
