//! Bindings of the control-message decoder (`disagg_core::wire::control`).

use disagg_core::wire::control;
use disagg_core::wire::msgpack::Value;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::IntoPyObjectExt;

use crate::args::Int;
use crate::error::IntoPyResult;

fn to_py(py: Python<'_>, v: &Value) -> PyResult<Py<PyAny>> {
    Ok(match v {
        Value::Nil => py.None(),
        Value::Bool(b) => b.into_py_any(py)?,
        Value::Int(i) => i.into_py_any(py)?,
        Value::UInt(u) => u.into_py_any(py)?,
        Value::Float(f) => f.into_py_any(py)?,
        Value::Str(s) => s.into_py_any(py)?,
        Value::Bin(b) => PyBytes::new(py, b).into_any().unbind(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_py(py, item)?)?;
            }
            list.into_any().unbind()
        }
        Value::Map(pairs) => {
            let dict = PyDict::new(py);
            for (k, v) in pairs {
                dict.set_item(to_py(py, k)?, to_py(py, v)?)?;
            }
            dict.into_any().unbind()
        }
    })
}

/// Decode one control frame and check it against its type's schema; returns the message as a
/// dict (`type` as its wire name). Raises `MetadataError` naming the bad field.
#[pyfunction]
#[pyo3(signature = (data, to_coordinator = false))]
pub fn decode_control_message<'py>(
    py: Python<'py>,
    data: &[u8],
    to_coordinator: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let msg = control::decode_message(data, to_coordinator).py()?;
    let dict = PyDict::new(py);
    dict.set_item("type", msg.kind.name())?;
    for (k, v) in &msg.fields {
        dict.set_item(k, to_py(py, v)?)?;
    }
    Ok(dict)
}

/// An engine's view of its coordinator (`disagg_core::wire::control::LinkLiveness`): liveness
/// through acknowledged heartbeats, and the requests to abort when it is lost. Times are
/// seconds on the caller's clock.
#[pyclass(module = "disagg_rs._core")]
pub struct LinkLiveness(control::LinkLiveness);

#[pymethods]
impl LinkLiveness {
    #[new]
    #[pyo3(signature = (timeout_s, now))]
    fn new(timeout_s: Option<f64>, now: f64) -> PyResult<Self> {
        Ok(Self(control::LinkLiveness::new(timeout_s, now).py()?))
    }

    /// The engine sent (or dropped, `delivered` false) a `kind` message about `request_id`.
    #[pyo3(signature = (kind, request_id, delivered, now))]
    fn sent(&mut self, kind: &str, request_id: Option<Int>, delivered: bool, now: f64) {
        self.0.sent_named(kind, request_id.map(|r| r.0).as_ref(), delivered, now);
    }

    /// A message arrived; returns whether the coordinator was lost and is back.
    #[pyo3(signature = (kind, request_id, epoch, now))]
    fn received(
        &mut self,
        kind: &str,
        request_id: Option<Int>,
        epoch: Option<Int>,
        now: f64,
    ) -> bool {
        let (r, e) = (request_id.map(|r| r.0), epoch.map(|e| e.0));
        self.0.received_named(kind, r.as_ref(), e.as_ref(), now)
    }

    /// Whether a heartbeat is due (taken as sent when it is).
    fn heartbeat_due(&mut self, interval_s: f64, now: f64) -> bool {
        self.0.heartbeat_due(interval_s, now)
    }

    /// The `(request_id, epoch)` pairs to abort when the coordinator has just been declared
    /// lost at `now`; empty otherwise.
    fn check(&mut self, now: f64) -> Vec<(i64, i64)> {
        self.0.check(now)
    }

    /// Whether the coordinator is declared lost now.
    #[getter]
    fn lost(&self) -> bool {
        self.0.lost()
    }

    /// When the coordinator was last heard from.
    #[getter]
    fn last_heard(&self) -> f64 {
        self.0.last_heard()
    }

    /// `losses` (times the coordinator was declared lost) and `abandoned` (requests handed
    /// back to abort).
    fn counters(&self) -> std::collections::HashMap<&'static str, u64> {
        [("losses", self.0.losses()), ("abandoned", self.0.abandoned())].into()
    }
}
