//! Python class `CoordinatorCore`: the coordinator's state machine (`disagg_core::coordinator`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::coordinator::{self, Coordinator, Outgoing};
use disagg_core::wire::control::Kind;
use disagg_core::wire::msgpack::Value;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyDict, PyInt, PyList};

use crate::args::{Raw, Real};
use crate::control::to_py;
use crate::error::IntoPyResult;
use crate::pool::{core_methods, lock, lock_with, outs};

/// A Python object the coordinator forwards unread.
#[derive(Debug)]
struct Obj(Py<PyAny>);

impl Clone for Obj {
    fn clone(&self) -> Self {
        Python::attach(|py| Self(self.0.clone_ref(py)))
    }
}

/// Outgoing messages as Python receives them: `(to_engine, to_client, type, frame)` each.
pub struct Outs(Vec<Outgoing<Value>>);

outs! {
    Vec<Outgoing<Value>> => Outs = |v| Outs(v);
}

impl<'py> IntoPyObject<'py> for Outs {
    type Target = PyList;
    type Output = Bound<'py, PyList>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let row = |o: Outgoing<Value>| {
            let (engine, client, kind, frame) = o.into_wire();
            (engine, client.map(|c| PyBytes::new(py, &c)), kind, PyBytes::new(py, &frame))
        };
        PyList::new(py, self.0.into_iter().map(row))
    }
}

/// The coordinator's routing and bookkeeping (wrapped by `disagg_rs.control.CoordinatorState`).
#[pyclass(module = "disagg_rs._core", frozen)]
pub struct CoordinatorCore(Mutex<Coordinator<Value>>);

core_methods!(CoordinatorCore, lock_with, 0,
ctors {
    #[new]
    #[pyo3(signature = (request_timeout_s, push_transport, engine_timeout_s))]
    fn new(request_timeout_s: Raw<f64>, push_transport: Raw<bool>,
        engine_timeout_s: Raw<Option<f64>>)
        = Coordinator::new(request_timeout_s, push_transport, engine_timeout_s).py()?.into();
}
calls {
    /// Liveness and deadlines at `now`.
    fn poll(now: Raw<f64>) -> Outs = poll(now);
    /// Declare `engine_id` lost (`why`).
    fn fence(engine_id: Raw<String>, why: Raw<String>) -> Outs = fence(&engine_id, &why);
    /// Tell every engine to stop.
    fn shutdown() -> Outs = shutdown();
}
methods {
    /// `Coordinator::handle_frame`: a frame standing for a message handed over directly.
    fn handle(&self, identity: &[u8], frame: &[u8], now: f64) -> PyResult<Outs> {
        Ok(Outs(lock(&self.0)?.handle_frame(identity, frame, now)))
    }

    /// `Coordinator::receive`: a frame off the socket; `(receipt name, outgoing)`.
    #[pyo3(signature = (identity, frame, now, auth = None))]
    fn receive(&self, identity: &[u8], frame: &[u8], now: f64,
        auth: Option<(String, BTreeMap<String, String>)>) -> PyResult<(&'static str, Outs)> {
        let auth = auth.as_ref().map(|(key, keys)| (key.as_str(), keys));
        let (receipt, out) = lock(&self.0)?.receive(identity, frame, now, auth);
        Ok((receipt.name(), Outs(out)))
    }

    /// Count a message dict that cannot be encoded as malformed; a usable `SUBMIT` is answered
    /// `FAILED`.
    fn refused(&self, identity: &[u8], msg: &Bound<'_, PyAny>, error: &str) -> PyResult<Outs> {
        let msg_class = msg.py().import("disagg_rs.control.messages")?.getattr("Msg")?;
        let dict = msg.cast::<PyDict>().ok();
        let get = |k: &str| dict.and_then(|d| d.get_item(k).ok().flatten());
        let kind = get("type").filter(|k| k.is_instance(&msg_class).unwrap_or(false));
        let kind = kind.and_then(|k| k.extract::<String>().ok()).and_then(|k| Kind::from_name(&k));
        let rid = get("request_id").filter(PyAnyMethods::is_exact_instance_of::<PyInt>);
        let rid = rid.and_then(|r| r.extract::<i128>().ok());
        let mut core = lock(&self.0)?;
        core.count_malformed(kind.map_or("<unknown>", Kind::name));
        Ok(Outs(core.refused(identity, kind, rid, error)))
    }

    /// `Coordinator::refused_frame`.
    fn refused_frame(&self, identity: &[u8], data: &[u8], error: &str) -> PyResult<Outs> {
        Ok(Outs(lock(&self.0)?.refused_frame(identity, data, error)))
    }

    /// The identity a message goes to (`None`: its engine is gone).
    fn address<'py>(&self, py: Python<'py>, to_engine: Option<&str>, to_client: Option<&[u8]>)
        -> PyResult<Option<Bound<'py, PyBytes>>> {
        let core = lock(&self.0)?;
        Ok(core.address(to_engine, to_client).map(|a| PyBytes::new(py, a)))
    }

    /// `Coordinator::authentic` of a message of type `kind` claiming engine id `claimed`.
    fn authentic(&self, identity: &[u8], kind: &str, claimed: Option<String>, user_key: &str,
        keys: BTreeMap<String, String>) -> PyResult<bool> {
        let no_type = || pyo3::exceptions::PyValueError::new_err(format!("no message type {kind}"));
        let kind = Kind::from_name(kind).ok_or_else(no_type)?;
        Ok(lock(&self.0)?.authentic(identity, kind, claimed.as_deref(), user_key, &keys))
    }

    /// `{engine id: (engine_id, role, incarnation, meta, identity, last_seen)}`.
    fn engines<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = lock(&self.0)?;
        let rows = core.engines().iter().map(|(id, e)| {
            let (meta, identity) = (to_py(py, &e.meta)?, PyBytes::new(py, &e.identity));
            Ok((id, (&e.engine_id, &e.role, e.incarnation, meta, identity, e.last_seen)))
        });
        rows.collect::<PyResult<Vec<_>>>()?.into_py_dict(py)
    }

    /// `{request id: (epoch, phase, prefill, decode, pinned, ticket_sent, deadline)}`.
    fn requests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = lock(&self.0)?;
        let rows = core.requests().iter().map(|(rid, r)| {
            let (epoch, phase, prefill, decode, pinned, ticket_sent, deadline) = r.state();
            let phase = format!("{phase:?}").to_lowercase();
            (rid, (epoch, phase, prefill, decode, pinned, ticket_sent, deadline))
        });
        rows.into_py_dict(py)
    }

    /// The coordinator's counters by name.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = lock(&self.0)?;
        let c = core.counters();
        let dict = [("ignored", &c.ignored), ("malformed", &c.malformed), ("lost", &c.lost)]
            .into_py_dict(py)?;
        let totals = [
            ("completed", c.completed),
            ("failed", c.failed),
            ("aborted_pushes", c.aborted_pushes),
            ("left_to_lease", c.left_to_lease),
        ];
        totals.iter().try_for_each(|(name, n)| dict.set_item(name, n))?;
        dict.set_item("shutting_down", core.shutting_down())?;
        Ok(dict)
    }
});

/// `disagg_core::coordinator::timeout_seconds` (`ArgumentError` naming `field`).
#[pyfunction]
#[pyo3(signature = (value, field = "timeout_s"))]
pub fn timeout_seconds(value: Real, field: &str) -> PyResult<f64> {
    coordinator::timeout_seconds(field, &value.0).py()
}

/// Whether `what` runs CURVE or, with `insecure`, plain TCP (`ArgumentError` for neither or both).
#[pyfunction]
pub fn curve_mode(what: &str, have: bool, insecure: bool) -> PyResult<bool> {
    coordinator::curve_mode(what, have, insecure).py()
}

/// A coordinator's fault injection (`disagg_core::coordinator::FaultPlan`).
#[pyclass(module = "disagg_rs._core", frozen)]
pub struct FaultPlan(Mutex<coordinator::FaultPlan<Obj>>);

core_methods!(FaultPlan, lock_with, 0,
ctors {
    #[new]
    fn new(rate: Raw<f64>, seed: Raw<u64>, max_delay_rounds: Raw<u64>)
        = coordinator::FaultPlan::new(rate, seed, max_delay_rounds).into();
}
calls {
    /// Faults injected so far.
    #[getter] fn injected() -> u64 = injected();
}
methods {
    /// One round: the delayed messages due, then `out` with faults.
    fn apply(&self, py: Python<'_>, out: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<Py<PyAny>>> {
        let mut tagged = Vec::with_capacity(out.len());
        for o in out {
            let to_engine = !o.getattr("to_engine")?.is_none();
            let kind = Kind::from_name(&o.getattr("kind")?.extract::<String>()?);
            tagged.push((Obj(o.unbind()), to_engine, kind));
        }
        let kept = lock(&self.0)?.pass(tagged);
        Ok(kept.into_iter().map(|o| o.0.clone_ref(py)).collect())
    }
});
