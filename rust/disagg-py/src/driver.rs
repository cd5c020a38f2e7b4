//! Python class `EngineDriverState`: the engine-side driver's decisions (`disagg_core::driver`).

use std::sync::Mutex;

use disagg_core::{EngineDriver, MsgKind};
use pyo3::prelude::*;

use crate::args::{conv, convs, Int, Kind, Raw, U64};
use crate::pool::{core_methods, lock, lock_with};

convs! {
    /// A field as a non-negative int, `None` when it is anything else (the core counts it).
    Lenient: Int => Option<u64> = |f, v| Ok(v.to_u64(Kind::Argument, f).ok());
}

/// De-duplication by (kind, request, epoch), attempt epochs, once-only import reports, the
/// shutdown horizon and the idle back-off of one engine's handoff driver.
#[pyclass(name = "EngineDriverState", module = "disagg_rs", frozen)]
pub struct PyEngineDriverState {
    inner: Mutex<EngineDriver>,
}

core_methods!(PyEngineDriverState, lock_with, inner,
calls {
    /// Whether a ticket naming its source at incarnation `named` may be read, given the peer
    /// table's incarnation `known` of that engine (`None` or a non-int: missing); a refusal is
    /// counted as `forged`.
    fn ticket_source_ok(named: Lenient, known: Lenient) -> bool = ticket_source_ok(named, known);
    /// `SHUTDOWN` at `now_ns`: drain for `grace_ns` at most.
    fn shutdown(now_ns: U64, grace_ns: U64) -> () = shutdown(now_ns, grace_ns);
    /// Whether a shutdown was asked for.
    #[getter] fn stopping() -> bool = stopping();
    /// Whether the serving loop goes on at `now_ns` with the engine `busy`.
    fn running(now_ns: U64, busy: Raw<bool>) -> bool = running(now_ns, busy);
    /// End a serving turn; returns the next poll's wait in milliseconds.
    fn turn(had_messages: Raw<bool>, busy: Raw<bool>) -> u32 = turn(had_messages, busy);
}
methods {
    #[new]
    #[pyo3(signature = (capacity = Int::of(1 << 16)), text_signature = "(capacity=65536)")]
    fn new(capacity: Int) -> PyResult<Self> {
        conv!(capacity: U64);
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        Ok(Self { inner: Mutex::new(EngineDriver::new(capacity)) })
    }

    /// `"act"`, `"duplicate"`, `"malformed"` or `"ignore"` for a message of type `kind`.
    fn accept(&self, kind: &Bound<'_, PyAny>, request_id: Int, epoch: Int)
        -> PyResult<&'static str> {
        let name: String = kind.extract().unwrap_or_default();
        conv!(request_id: Lenient, epoch: Lenient);
        Ok(lock(&self.inner)?.accept(MsgKind::parse(&name), request_id, epoch).name())
    }

    /// The attempt epoch of `request_id`, if known.
    fn epoch_of(&self, request_id: Int) -> PyResult<Option<u64>> {
        conv!(request_id: Lenient);
        let d = lock(&self.inner)?;
        Ok(request_id.and_then(|r| d.epoch_of(r)))
    }

    /// The epoch to stamp on an outcome of `request_id` (`None`: unknown, counted).
    fn outcome_epoch(&self, request_id: Int) -> PyResult<Option<u64>> {
        conv!(request_id: Lenient);
        let mut d = lock(&self.inner)?;
        Ok(request_id.and_then(|r| d.outcome_epoch(r)))
    }

    /// `(epoch, ok, quiet)` of the one report of a settled import, or `None` (repeat/unknown).
    fn import_settled(&self, request_id: Int, failed: bool, quarantined: bool)
        -> PyResult<Option<(u64, bool, bool)>> {
        conv!(request_id: U64);
        let rep = lock(&self.inner)?.import_settled(request_id, failed, quarantined);
        Ok(rep.map(|x| (x.epoch, x.ok, x.quiet)))
    }

    /// `{"duplicates": n, "malformed": n, "unknown": n, "forged": n}`.
    fn counters(&self) -> PyResult<std::collections::BTreeMap<&'static str, u64>> {
        let c = lock(&self.inner)?.counters();
        let named = [("duplicates", c.duplicates), ("malformed", c.malformed)];
        Ok(named.into_iter().chain([("unknown", c.unknown), ("forged", c.forged)]).collect())
    }
});
