//! Python class `EngineDriverState`: the engine-side driver's decisions (`disagg_core::driver`).

use std::sync::Mutex;

use disagg_core::{EngineDriver, MsgKind};
use pyo3::prelude::*;

use crate::args::{Int, Kind};
use crate::pool::{lock, u64_arg};

/// A field as a non-negative int, `None` when it is anything else (the core counts it).
fn id_of(v: &Int) -> Option<u64> {
    v.to_u64(Kind::Argument, "request_id").ok()
}

/// De-duplication by (kind, request, epoch), attempt epochs, once-only import reports, the
/// shutdown horizon and the idle back-off of one engine's handoff driver.
#[pyclass(name = "EngineDriverState", module = "disagg_rs", frozen)]
pub struct PyEngineDriverState {
    inner: Mutex<EngineDriver>,
}

#[pymethods]
impl PyEngineDriverState {
    #[new]
    #[pyo3(signature = (capacity = Int::of(1 << 16)), text_signature = "(capacity=65536)")]
    fn new(capacity: Int) -> PyResult<Self> {
        let n = usize::try_from(u64_arg("capacity", capacity)?).unwrap_or(usize::MAX);
        Ok(Self { inner: Mutex::new(EngineDriver::new(n)) })
    }

    /// `"act"`, `"duplicate"`, `"malformed"` or `"ignore"` for a message of type `kind`.
    fn accept(
        &self,
        kind: &Bound<'_, PyAny>,
        request_id: Int,
        epoch: Int,
    ) -> PyResult<&'static str> {
        let name: String = kind.extract().unwrap_or_default();
        let v = lock(&self.inner)?.accept(MsgKind::parse(&name), id_of(&request_id), id_of(&epoch));
        Ok(v.name())
    }

    /// Whether a ticket naming its source at incarnation `named` may be read, given the peer
    /// table's incarnation `known` of that engine (`None` or a non-int: missing); a refusal is
    /// counted as `forged`.
    fn ticket_source_ok(&self, named: Int, known: Int) -> PyResult<bool> {
        Ok(lock(&self.inner)?.ticket_source_ok(id_of(&named), id_of(&known)))
    }

    /// The attempt epoch of `request_id`, if known.
    fn epoch_of(&self, request_id: Int) -> PyResult<Option<u64>> {
        let d = lock(&self.inner)?;
        Ok(id_of(&request_id).and_then(|r| d.epoch_of(r)))
    }

    /// The epoch to stamp on an outcome of `request_id` (`None`: unknown, counted).
    fn outcome_epoch(&self, request_id: Int) -> PyResult<Option<u64>> {
        let mut d = lock(&self.inner)?;
        Ok(match id_of(&request_id) {
            Some(r) => d.outcome_epoch(r),
            None => None,
        })
    }

    /// `(epoch, ok, quiet)` of the one report of a settled import, or `None` (repeat/unknown).
    fn import_settled(
        &self,
        request_id: Int,
        failed: bool,
        quarantined: bool,
    ) -> PyResult<Option<(u64, bool, bool)>> {
        let r = u64_arg("request_id", request_id)?;
        let rep = lock(&self.inner)?.import_settled(r, failed, quarantined);
        Ok(rep.map(|x| (x.epoch, x.ok, x.quiet)))
    }

    /// `SHUTDOWN` at `now_ns`: drain for `grace_ns` at most.
    fn shutdown(&self, now_ns: Int, grace_ns: Int) -> PyResult<()> {
        let (now, grace) = (u64_arg("now_ns", now_ns)?, u64_arg("grace_ns", grace_ns)?);
        lock(&self.inner)?.shutdown(now, grace);
        Ok(())
    }

    /// Whether a shutdown was asked for.
    #[getter]
    fn stopping(&self) -> PyResult<bool> {
        Ok(lock(&self.inner)?.stopping())
    }

    /// Whether the serving loop goes on at `now_ns` with the engine `busy`.
    fn running(&self, now_ns: Int, busy: bool) -> PyResult<bool> {
        Ok(lock(&self.inner)?.running(u64_arg("now_ns", now_ns)?, busy))
    }

    /// End a serving turn; returns the next poll's wait in milliseconds.
    fn turn(&self, had_messages: bool, busy: bool) -> PyResult<u32> {
        Ok(lock(&self.inner)?.turn(had_messages, busy))
    }

    /// `{"duplicates": n, "malformed": n, "unknown": n, "forged": n}`.
    fn counters(&self) -> PyResult<std::collections::BTreeMap<&'static str, u64>> {
        let c = lock(&self.inner)?.counters();
        Ok([
            ("duplicates", c.duplicates),
            ("malformed", c.malformed),
            ("unknown", c.unknown),
            ("forged", c.forged),
        ]
        .into_iter()
        .collect())
    }
}

/// Where a coordinator sends a `KV_RECV_POSTED`: `(prefill, abort)` for a `SEND_KV`, or
/// `None` (see `disagg_core::driver::recv_posted_route`). `sender` and `named`: `(engine id,
/// role)`, role `""` when unregistered; `request`: `(decode, epoch, pinned, prefill)` of the
/// live request, `(None, 0, False, None)` without one.
#[pyfunction]
pub fn recv_posted_route(
    push_transport: bool,
    sender: (String, String),
    epoch: u64,
    request: (Option<String>, u64, bool, Option<String>),
    named: (String, String),
) -> Option<(String, bool)> {
    disagg_core::driver::recv_posted_route(&disagg_core::driver::RecvPosted {
        push_transport,
        sender: (&sender.0, &sender.1),
        epoch,
        request: (request.0.as_deref(), request.1, request.2, request.3.as_deref()),
        named: (&named.0, &named.1),
    })
}
