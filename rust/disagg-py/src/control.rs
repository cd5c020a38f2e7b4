//! Bindings of the control-message decoder (`disagg_core::wire::control`).

use std::sync::Mutex;

use disagg_core::wire::control;
use disagg_core::wire::msgpack::Value;
use disagg_core::{coordinator, link};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::IntoPyObjectExt;

use crate::args::{convs, Int, Raw, Real};
use crate::error::IntoPyResult;
use crate::pool::{core_methods, lock, lock_with};

pyo3::import_exception!(disagg_rs.exceptions, TransferTimeout);

pub fn to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Nil => py.None(),
        Value::Bool(b) => b.into_py_any(py)?,
        Value::Int(i) => i.into_py_any(py)?,
        Value::UInt(u) => u.into_py_any(py)?,
        Value::Float(f) => f.into_py_any(py)?,
        Value::Str(s) => s.into_py_any(py)?,
        Value::Bin(b) => PyBytes::new(py, b).into_any().unbind(),
        Value::Array(items) => {
            let items = items.iter().map(|x| to_py(py, x)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any().unbind()
        }
        Value::Ints(items) => PyList::new(py, items)?.into_any().unbind(),
        Value::Map(pairs) => {
            let dict = PyDict::new(py);
            for (k, v) in pairs {
                dict.set_item(to_py(py, k)?, to_py(py, v)?)?;
            }
            dict.into_any().unbind()
        }
    })
}

/// A decoded message as a dict, `type` as given (its wire name or a `Msg`).
fn message<'py>(
    py: Python<'py>,
    msg: &control::ControlMessage,
    kind: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("type", kind)?;
    for (k, v) in &msg.fields {
        dict.set_item(k, to_py(py, v)?)?;
    }
    Ok(dict)
}

/// Decode one control frame and check its schema (`MetadataError` naming the bad field).
#[pyfunction]
#[pyo3(signature = (data, to_coordinator = false))]
pub fn decode_control_message<'py>(
    py: Python<'py>,
    data: &[u8],
    to_coordinator: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let msg = control::decode_message(data, to_coordinator).py()?;
    message(py, &msg, msg.kind.name().into_pyobject(py)?.into_any())
}

convs! {
    /// A request's timeout in seconds (`None`: the default; else `ArgumentError`).
    Timeout: Option<Real> => Option<f64> =
        |f, v| v.map(|t| coordinator::timeout_seconds(f, &t.0)).transpose().py();
}

/// A client's request deadlines (`disagg_core::link::ClientDeadlines`), in seconds.
#[pyclass(module = "disagg_rs._core", frozen)]
pub struct ClientDeadlines(Mutex<link::ClientDeadlines>);

core_methods!(ClientDeadlines, lock_with, 0,
ctors {
    #[new]
    fn new(default_timeout_s: Raw<f64>, grace_s: Raw<f64>)
        = link::ClientDeadlines::new(default_timeout_s, grace_s).into();
}
calls {
    /// `request_id` submitted at `now` (`timeout_s` `None`: the default).
    #[pyo3(signature = (request_id, timeout_s, now))]
    fn submit(request_id: Raw<i64>, timeout_s: Timeout, now: Raw<f64>) -> ()
        = submit(request_id, timeout_s, now);
    /// A message named `kind` about `request_id` arrived (`DONE` and `FAILED` end it).
    #[pyo3(signature = (kind, request_id))]
    fn answered(kind: Raw<String>, request_id: Raw<Option<i64>>) -> ()
        = answered(&kind, request_id);
    fn expired(now: Raw<f64>) -> Vec<i64> = expired(now);
}
methods {});

/// An engine's view of its coordinator (`disagg_core::wire::control::LinkLiveness`), in seconds.
#[pyclass(module = "disagg_rs._core", frozen)]
pub struct LinkLiveness(Mutex<link::EngineInbox>);

core_methods!(LinkLiveness, lock_with, 0,
calls {
    #[getter] fn awaiting_registered() -> bool = awaiting_registered();
    /// Times the coordinator fenced this engine (it then registered again).
    #[getter] fn fenced() -> u64 = fenced();
    #[getter] fn malformed() -> u64 = malformed();
}
methods {
    #[new]
    #[pyo3(signature = (timeout_s, now))]
    fn new(timeout_s: Option<f64>, now: f64) -> PyResult<Self> {
        Ok(Self(Mutex::new(link::EngineInbox::new(timeout_s, now).py()?)))
    }

    /// The `frames` that arrived by `now`: `(messages, newest peer table, register again)`.
    fn receive<'py>(&self, py: Python<'py>, frames: Vec<Bound<'py, PyBytes>>,
        peers: Bound<'py, PyAny>, now: f64)
        -> PyResult<(Vec<Bound<'py, PyDict>>, Bound<'py, PyAny>, bool)> {
        let frames: Vec<&[u8]> = frames.iter().map(PyBytesMethods::as_bytes).collect();
        let got = lock(&self.0)?.receive(&frames, now);
        let msg_class = py.import("disagg_rs.control.messages")?.getattr("Msg")?;
        let kind = |m: &control::ControlMessage| msg_class.call1((m.kind.name(),));
        let msgs =
            got.messages.iter().map(|m| message(py, m, kind(m)?)).collect::<PyResult<_>>()?;
        let peers =
            got.peers.map(|p| to_py(py, &p)).transpose()?.map_or(peers, |p| p.into_bound(py));
        Ok((msgs, peers, got.register))
    }

    /// Whether the `REGISTER` sent at `since` is still unanswered at `now` (``False`` once
    /// `REGISTERED` came); ``TransferTimeout`` naming ``timeout_s`` when it is unanswered
    /// `timeout_s` after `since`.
    fn awaiting_registration(&self, since: f64, timeout_s: f64, now: f64) -> PyResult<bool> {
        match lock(&self.0)?.registration(since, timeout_s, now) {
            link::Registration::Answered => Ok(false),
            link::Registration::Awaited => Ok(true),
            link::Registration::Overdue => Err(TransferTimeout::new_err((
                format!("coordinator did not answer REGISTER within {timeout_s} s"),
                "timeout_s",
            ))),
        }
    }

    /// The engine sent (or dropped, `delivered` false) a `kind` message about `request_id`.
    #[pyo3(signature = (kind, request_id, delivered, now))]
    fn sent(&self, kind: &str, request_id: Option<Int>, delivered: bool, now: f64) -> PyResult<()> {
        lock(&self.0)?.sent_named(kind, request_id.map(|r| r.0).as_ref(), delivered, now);
        Ok(())
    }

    fn heartbeat_due(&self, interval_s: f64, now: f64) -> PyResult<bool> {
        Ok(lock(&self.0)?.liveness.heartbeat_due(interval_s, now))
    }

    /// The `(request_id, epoch)` pairs to abort when the coordinator was just declared lost.
    fn check(&self, now: f64) -> PyResult<Vec<(i64, i64)>> {
        Ok(lock(&self.0)?.liveness.check(now))
    }

    #[getter]
    fn lost(&self) -> PyResult<bool> {
        Ok(lock(&self.0)?.liveness.lost())
    }

    #[getter]
    fn last_heard(&self) -> PyResult<f64> {
        Ok(lock(&self.0)?.liveness.last_heard())
    }

    /// `losses` and `abandoned` (requests handed back to abort).
    fn counters(&self) -> PyResult<std::collections::HashMap<&'static str, u64>> {
        let live = &lock(&self.0)?.liveness;
        Ok([("losses", live.losses()), ("abandoned", live.abandoned())].into())
    }
});
