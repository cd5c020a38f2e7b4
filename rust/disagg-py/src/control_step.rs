//! Python class `CoordinatorCore`: the coordinator's state machine (`disagg_core::coordinator`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::coordinator::{self, Coordinator, Outgoing};
use disagg_core::wire::control::Kind;
use disagg_core::wire::msgpack::Value;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyDict, PyInt};

use crate::args::Real;
use crate::control::to_py;
use crate::error::IntoPyResult;
use crate::pool::lock;

/// A Python object the coordinator forwards unread.
#[derive(Debug)]
struct Obj(Py<PyAny>);

impl Clone for Obj {
    fn clone(&self) -> Self {
        Python::attach(|py| Self(self.0.clone_ref(py)))
    }
}

/// One outgoing message as Python receives it: `(to_engine, to_client, type, fields)`.
type Out = (Option<String>, Option<Py<PyBytes>>, &'static str, Py<PyAny>);

fn outs(py: Python<'_>, out: Vec<Outgoing<Value>>) -> PyResult<Vec<Out>> {
    out.into_iter()
        .map(|o| {
            let client = o.to_client.map(|c| PyBytes::new(py, &c).unbind());
            Ok((o.to_engine, client, o.kind.name(), to_py(py, &o.fields.into_value())?))
        })
        .collect()
}

/// The coordinator's routing and bookkeeping (wrapped by `disagg_rs.control.CoordinatorState`).
#[pyclass(module = "disagg_rs._core", frozen)]
pub struct CoordinatorCore(Mutex<Coordinator<Value>>);

#[pymethods]
impl CoordinatorCore {
    #[new]
    #[pyo3(signature = (request_timeout_s, push_transport, engine_timeout_s))]
    fn new(
        request_timeout_s: f64,
        push_transport: bool,
        engine_timeout_s: Option<f64>,
    ) -> PyResult<Self> {
        let core = Coordinator::new(request_timeout_s, push_transport, engine_timeout_s).py()?;
        Ok(Self(Mutex::new(core)))
    }

    /// `Coordinator::handle_frame`: a frame standing for a message handed over directly.
    fn handle(&self, py: Python<'_>, identity: &[u8], frame: &[u8], now: f64) -> PyResult<Vec<Out>> {
        let out = lock(&self.0)?.handle_frame(identity, frame, now);
        outs(py, out)
    }

    /// `Coordinator::receive`: a frame off the socket; `(receipt name, outgoing)`.
    #[pyo3(signature = (identity, frame, now, user_key = None, keys = None))]
    fn receive(
        &self,
        py: Python<'_>,
        identity: &[u8],
        frame: &[u8],
        now: f64,
        user_key: Option<&str>,
        keys: Option<BTreeMap<String, String>>,
    ) -> PyResult<(&'static str, Vec<Out>)> {
        let auth = user_key.zip(keys.as_ref());
        let (receipt, out) = lock(&self.0)?.receive(identity, frame, now, auth);
        Ok((receipt.name(), outs(py, out)?))
    }

    /// Count a message dict that cannot be encoded as malformed; a usable `SUBMIT` is answered
    /// `FAILED`.
    fn refused(
        &self,
        py: Python<'_>,
        identity: &[u8],
        msg: &Bound<'_, PyAny>,
        error: &str,
    ) -> PyResult<Vec<Out>> {
        let msg_class = py.import("disagg_rs.control.messages")?.getattr("Msg")?;
        let dict = msg.cast::<PyDict>().ok();
        let get = |k: &str| dict.and_then(|d| d.get_item(k).ok().flatten());
        let kind = get("type").filter(|k| k.is_instance(&msg_class).unwrap_or(false));
        let kind = kind.and_then(|k| k.extract::<String>().ok()).and_then(|k| Kind::from_name(&k));
        let rid = get("request_id").filter(PyAnyMethods::is_exact_instance_of::<PyInt>);
        let rid = rid.and_then(|r| r.extract::<i128>().ok());
        let mut core = lock(&self.0)?;
        core.count_malformed(kind.map_or("<unknown>", Kind::name));
        outs(py, core.refused(identity, kind, rid, error))
    }

    /// `Coordinator::refused_frame`.
    fn refused_frame(
        &self,
        py: Python<'_>,
        identity: &[u8],
        data: &[u8],
        error: &str,
    ) -> PyResult<Vec<Out>> {
        let out = lock(&self.0)?.refused_frame(identity, data, error);
        outs(py, out)
    }

    /// Liveness and deadlines at `now`.
    fn poll(&self, py: Python<'_>, now: f64) -> PyResult<Vec<Out>> {
        let out = lock(&self.0)?.poll(now);
        outs(py, out)
    }

    /// Declare `engine_id` lost (`why`).
    fn fence(&self, py: Python<'_>, engine_id: &str, why: &str) -> PyResult<Vec<Out>> {
        let out = lock(&self.0)?.fence(engine_id, why);
        outs(py, out)
    }

    /// Tell every engine to stop.
    fn shutdown(&self, py: Python<'_>) -> PyResult<Vec<Out>> {
        let out = lock(&self.0)?.shutdown();
        outs(py, out)
    }

    /// The identity a message goes to (`None`: its engine is gone).
    fn address(
        &self,
        py: Python<'_>,
        to_engine: Option<&str>,
        to_client: Option<&[u8]>,
    ) -> PyResult<Option<Py<PyBytes>>> {
        let core = lock(&self.0)?;
        Ok(core.address(to_engine, to_client).map(|a| PyBytes::new(py, a).unbind()))
    }

    /// `Coordinator::authentic` of a message of type `kind` claiming engine id `claimed`.
    fn authentic(
        &self,
        identity: &[u8],
        kind: &str,
        claimed: Option<String>,
        user_key: &str,
        keys: BTreeMap<String, String>,
    ) -> PyResult<bool> {
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
}

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

#[pymethods]
impl FaultPlan {
    #[new]
    fn new(rate: f64, seed: u64, max_delay_rounds: u64) -> Self {
        Self(Mutex::new(coordinator::FaultPlan::new(rate, seed, max_delay_rounds)))
    }

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

    /// Faults injected so far.
    #[getter]
    fn injected(&self) -> PyResult<u64> {
        Ok(lock(&self.0)?.injected())
    }
}
