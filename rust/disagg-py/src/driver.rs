//! Python class `EngineDriverState`: the engine-side driver's decisions (`disagg_core::driver`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use disagg_core::{EngineDriver, Inbound, MsgKind, PeerIncarnations, Role};
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict, PyList};

use crate::args::{conv, Int, Kind, Raw, U64};
use crate::pool::{core_methods, lock, lock_with};

/// A value as a non-negative int, `None` when it is missing or anything else.
fn lenient(v: Option<Bound<'_, PyAny>>) -> Option<u64> {
    let int = v.and_then(|v| v.extract::<Int>().ok())?;
    int.to_u64(Kind::Argument, "").ok()
}

/// `d[key]`, `None` when `d` is no dict or lacks it.
fn item<'py>(d: &Bound<'py, PyAny>, key: &str) -> Option<Bound<'py, PyAny>> {
    d.cast::<PyDict>().ok()?.get_item(key).ok().flatten()
}

/// `str(d[key])`, `None` when missing.
fn text(d: &Bound<'_, PyAny>, key: &str) -> Option<String> {
    item(d, key).and_then(|v| v.str().ok()).map(|s| s.to_string())
}

/// A message's type name (`""` when it has none that is a string).
fn kind(msg: &Bound<'_, PyAny>) -> MsgKind {
    MsgKind::parse(&item(msg, "type").and_then(|t| t.extract::<String>().ok()).unwrap_or_default())
}

/// The message's ticket, when it is a dict.
fn ticket<'py>(msg: &Bound<'py, PyAny>) -> Option<Bound<'py, PyDict>> {
    item(msg, "ticket").and_then(|t| t.cast_into::<PyDict>().ok())
}

/// One import report: `(request_id, epoch, ok, quiet, error)`.
type Report = (u64, u64, bool, bool, String);

/// One engine's handoff driver state (`disagg_core::driver`).
#[pyclass(name = "EngineDriverState", module = "disagg_rs", frozen)]
pub struct PyEngineDriverState {
    inner: Mutex<EngineDriver>,
}

core_methods!(PyEngineDriverState, lock_with, inner,
calls {
    /// `SHUTDOWN` at `now_ns`: drain for `grace_ns` at most.
    fn shutdown(now_ns: U64, grace_ns: U64) -> () = shutdown(now_ns, grace_ns);
    /// Whether a shutdown was asked for.
    #[getter] fn stopping() -> bool = stopping();
    /// Whether the serving loop goes on at `now_ns` with the engine `busy`.
    fn running(now_ns: U64, busy: Raw<bool>) -> bool = running(now_ns, busy);
    /// End a serving turn; returns the next poll's wait in milliseconds.
    fn turn(busy: Raw<bool>) -> u32 = turn(busy);
    /// `{"duplicates": n, "malformed": n, "unknown": n, "forged": n}`.
    fn counters() -> BTreeMap<&'static str, u64> = counters().named();
}
methods {
    #[new]
    #[pyo3(signature = (capacity = Int::of(1 << 16)), text_signature = "(capacity=65536)")]
    fn new(capacity: Int) -> PyResult<Self> {
        conv!(capacity: U64);
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        Ok(Self { inner: Mutex::new(EngineDriver::new(capacity)) })
    }

    /// The messages every rank acts on, with the peer metadata they name attached from `peers`.
    fn inbox<'py>(&self, msgs: Vec<Bound<'py, PyAny>>, peers: &Bound<'py, PyDict>,
        peers_type: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let py = peers.py();
        let table: PeerIncarnations = peers.iter()
            .map(|(k, v)| Ok((k.str()?.to_string(), lenient(item(&v, "incarnation")))))
            .collect::<PyResult<_>>()?;
        let meta = |id: &str| peers.as_any().get_item(id)?.get_item("meta");
        let out = PyList::empty(py);
        let mut core = lock(&self.inner)?;
        let fresh = core.announce(&table);
        if fresh {
            out.append([("type", peers_type), ("peers", peers.clone().into_any())].into_py_dict(py)?)?;
        }
        for m in msgs {
            let t = ticket(&m);
            let named = t.as_ref().map(|t| (text(t.as_any(), "prefill_engine_id"), lenient(item(t.as_any(), "prefill_incarnation"))));
            let decode = item(&m, "decode_engine_id").and_then(|d| d.extract::<String>().ok());
            let named = named.as_ref().map(|(e, i)| (e.as_deref(), *i));
            match (core.inbound(kind(&m), named, decode.as_deref(), &table, fresh), t) {
                (Inbound::Drop, _) => continue,
                (Inbound::Ticket { source }, Some(t)) => {
                    t.call_method1("pop", ("prefill_meta", py.None()))?;
                    if let Some(s) = source {
                        t.set_item("prefill_meta", meta(&s)?)?;
                    }
                }
                (Inbound::DecodeMeta(d), _) => m.set_item("decode_meta", meta(&d)?.get_item("ranks")?)?,
                _ => {}
            }
            out.append(m)?;
        }
        Ok(out)
    }

    /// What an engine of `role` does with `msg` (`None`: dropped, counted).
    fn dispatch(&self, msg: &Bound<'_, PyAny>, role: &str) -> PyResult<Option<&'static str>> {
        let ids = (lenient(item(msg, "request_id")), lenient(item(msg, "epoch")));
        let peers_ok = item(msg, "peers").is_some_and(|p| p.is_instance_of::<PyDict>());
        let source = ticket(msg).and_then(|t| text(t.as_any(), "prefill_engine_id"));
        let mut core = lock(&self.inner)?;
        let action = core.dispatch(Role::parse(role), kind(msg), ids, peers_ok, source.as_deref());
        Ok(action.map(disagg_core::Action::name))
    }

    /// The prefill engine the ticket of `request_id` named, until its import settled.
    fn source_of(&self, request_id: Bound<'_, PyAny>) -> PyResult<Option<String>> {
        let request_id = lenient(Some(request_id));
        let d = lock(&self.inner)?;
        Ok(request_id.and_then(|r| d.source_of(r)).map(str::to_owned))
    }

    /// The epoch to stamp on an outcome of `request_id` (`None`: unknown, counted).
    #[pyo3(signature = (request_id, epoch = None))]
    fn stamp(&self, request_id: Bound<'_, PyAny>, epoch: Option<u64>) -> PyResult<Option<u64>> {
        let request_id = lenient(Some(request_id));
        let mut d = lock(&self.inner)?;
        Ok(request_id.and_then(|r| d.stamp(r, epoch)))
    }

    /// `(request_id, epoch, ok, quiet, error)` of each report of the `settled` imports, once per
    /// attempt.
    fn imports_settled(&self, settled: Vec<(u64, bool)>, quarantined: &Bound<'_, PyAny>,
        reasons: std::collections::HashMap<u64, Option<String>>)
        -> PyResult<Vec<Report>> {
        let quarantined: BTreeSet<u64> =
            quarantined.try_iter()?.map(|r| r?.extract()).collect::<PyResult<_>>()?;
        let reports = lock(&self.inner)?.imports_settled(&settled, &quarantined, &reasons);
        Ok(reports.into_iter().map(|(r, x, why)| (r, x.epoch, x.ok, x.quiet, why)).collect())
    }
});
