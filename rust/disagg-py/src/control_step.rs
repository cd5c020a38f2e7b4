//! Python class `CoordinatorCore`: the coordinator's state machine (`disagg_core::coordinator`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use disagg_core::coordinator::{self, Coordinator, Event, Field, Outgoing};
use disagg_core::wire::control::Kind;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyDict, PyInt, PyList};
use pyo3::IntoPyObjectExt;

use crate::args::Real;
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

fn obj(v: Bound<'_, PyAny>) -> Obj {
    Obj(v.unbind())
}

/// One outgoing message as Python receives it: `(to_engine, to_client, type, fields)`.
type Out = (Option<String>, Option<Py<PyBytes>>, &'static str, Py<PyAny>);

fn field(py: Python<'_>, f: &Field<Obj>) -> PyResult<Py<PyAny>> {
    let entries = |dict: &Bound<'_, PyDict>, pairs: &[(String, Field<Obj>)]| -> PyResult<()> {
        pairs.iter().try_for_each(|(k, v)| dict.set_item(k, field(py, v)?))
    };
    Ok(match f {
        Field::Nil => py.None(),
        Field::Int(i) => i.into_py_any(py)?,
        Field::Text(s) => s.into_py_any(py)?,
        Field::Bool(b) => b.into_py_any(py)?,
        Field::Payload(o) => o.0.clone_ref(py),
        Field::Map(pairs) => {
            let dict = PyDict::new(py);
            entries(&dict, pairs)?;
            dict.into_any().unbind()
        }
        Field::Amended(base, pairs) => {
            let dict = PyDict::new(py);
            dict.update(base.0.bind(py).cast::<pyo3::types::PyMapping>()?)?;
            entries(&dict, pairs)?;
            dict.into_any().unbind()
        }
    })
}

fn outs(py: Python<'_>, out: Vec<Outgoing<Obj>>) -> PyResult<Vec<Out>> {
    out.into_iter()
        .map(|o| {
            let client = o.to_client.map(|c| PyBytes::new(py, &c).unbind());
            Ok((o.to_engine, client, o.kind.name(), field(py, &o.fields)?))
        })
        .collect()
}

/// A ticket's resume tokens as a new list (empty without them), and their count.
fn resume_tokens(ticket: &Bound<'_, PyAny>) -> PyResult<(Obj, usize)> {
    let tokens = PyList::empty(ticket.py());
    let resume = ticket.cast::<PyDict>()?.get_item("resume_tokens")?;
    for t in resume.map(|r| r.try_iter()).transpose()?.into_iter().flatten() {
        tokens.append(t?)?;
    }
    let n = tokens.len();
    Ok((obj(tokens.into_any()), n))
}

/// What a client is told of a `DONE`: the message without `type`, `v` and `epoch`.
fn done_fields<'py>(msg: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyAny>> {
    let fields = msg.copy()?;
    for k in coordinator::DONE_WITHHELD {
        fields.call_method1("pop", (k, msg.py().None()))?;
    }
    Ok(fields.into_any())
}

/// The message type a message dict names (`ValueError` for none).
fn kind_of(msg: &Bound<'_, PyDict>) -> PyResult<Kind> {
    let name: String = msg.get_item("type")?.map_or(Ok(String::new()), |k| k.extract())?;
    let no_type = || pyo3::exceptions::PyValueError::new_err(format!("no message type {name}"));
    Kind::from_name(&name).ok_or_else(no_type)
}

/// The event a schema-checked message dict carries.
fn event<'py>(msg: &Bound<'py, PyDict>) -> PyResult<Event<Obj>> {
    let py = msg.py();
    let item = |k: &str| -> PyResult<Bound<'py, PyAny>> {
        msg.get_item(k)?.ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(k.to_owned()))
    };
    let opt = |k: &str| -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(msg.get_item(k)?.filter(|v| !v.is_none()))
    };
    let text = |k: &str| -> PyResult<String> { Ok(item(k)?.str()?.to_string()) };
    let opt_text = |k: &str| -> PyResult<Option<String>> {
        opt(k)?.map(|v| Ok(v.str()?.to_string())).transpose()
    };
    let id = |k: &str| -> PyResult<u64> { item(k)?.extract() };
    let epoch = || -> PyResult<Option<u64>> { opt("epoch")?.map(|e| e.extract()).transpose() };
    let quiet = || -> PyResult<Option<bool>> { Ok(opt("quiet")?.and_then(|q| q.extract().ok())) };
    let kind = kind_of(msg)?;
    let request_id = || id("request_id");
    Ok(match kind {
        Kind::Register => Event::Register {
            engine_id: text("engine_id")?,
            role: text("role")?,
            incarnation: id("incarnation")?,
            meta: obj(item("meta")?),
        },
        Kind::Submit => Event::Submit {
            request_id: request_id()?,
            prompt: obj(py.get_type::<PyList>().call1((item("prompt")?,))?),
            max_new_tokens: id("max_new_tokens")?,
            timeout_s: opt("timeout_s")?.map(|t| t.extract()).transpose()?,
        },
        Kind::Heartbeat => Event::Heartbeat { engine_id: text("engine_id")? },
        Kind::KvRecvPosted => Event::KvRecvPosted {
            request_id: request_id()?,
            epoch: id("epoch")?,
            prefill: opt_text("prefill_engine_id")?,
            transfer: opt("transfer")?.map(obj),
        },
        Kind::PrefillDone => {
            let ticket = item("ticket")?;
            Event::PrefillDone {
                request_id: request_id()?,
                epoch: id("epoch")?,
                resume: resume_tokens(&ticket)?,
                ticket: obj(ticket),
            }
        }
        Kind::PrefillFailed => Event::PrefillFailed {
            request_id: request_id()?,
            epoch: id("epoch")?,
            error: text("error")?,
        },
        Kind::KvImported => {
            let ok = item("ok")?.is_truthy()?;
            Event::kv_imported(request_id()?, id("epoch")?, ok, opt_text("error")?, quiet()?)
        }
        Kind::Tokens => Event::Tokens {
            request_id: request_id()?,
            epoch: epoch()?,
            tokens: obj(item("tokens")?),
        },
        Kind::Done => Event::Done {
            request_id: request_id()?,
            epoch: epoch()?,
            fields: obj(done_fields(msg)?),
        },
        Kind::Failed => Event::failed(request_id()?, epoch()?, text("error")?, quiet()?),
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "the coordinator takes no {} message",
                other.name()
            )))
        }
    })
}

/// The coordinator's routing and bookkeeping (wrapped by `disagg_rs.control.CoordinatorState`).
#[pyclass(module = "disagg_rs._core", frozen)]
pub struct CoordinatorCore(Mutex<Coordinator<Obj>>);

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

    /// Apply one schema-checked message (a dict whose `type` is a `Msg`) from `identity`.
    fn handle(
        &self,
        py: Python<'_>,
        identity: &[u8],
        msg: &Bound<'_, PyDict>,
        now: f64,
    ) -> PyResult<Vec<Out>> {
        let ev = event(msg)?;
        let out = lock(&self.0)?.handle(identity, ev, now);
        outs(py, out)
    }

    /// Count a message its schema refused as malformed; a usable `SUBMIT` is answered `FAILED`.
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

    /// The answer to a frame refused at decode (a `SUBMIT` whose id can be read: `FAILED`).
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

    /// Count a message of type `name` that failed to apply as malformed.
    fn count_malformed(&self, name: &str) -> PyResult<()> {
        lock(&self.0)?.count_malformed(name);
        Ok(())
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

    /// Whether `msg` from `identity` with CURVE key `user_key` speaks for the engine it claims.
    fn authentic(
        &self,
        identity: &[u8],
        msg: &Bound<'_, PyDict>,
        user_key: &str,
        keys: BTreeMap<String, String>,
    ) -> PyResult<bool> {
        let kind = kind_of(msg)?;
        // The core reads the claim of the kinds that make one (a checked text field of theirs).
        let claimed: Option<String> =
            msg.get_item("engine_id")?.map(|e| e.extract()).transpose()?;
        Ok(lock(&self.0)?.authentic(identity, kind, claimed.as_deref(), user_key, &keys))
    }

    /// `{engine id: (engine_id, role, incarnation, meta, identity, last_seen)}`.
    fn engines<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let core = lock(&self.0)?;
        let rows = core.engines().iter().map(|(id, e)| {
            let (meta, identity) = (e.meta.0.clone_ref(py), PyBytes::new(py, &e.identity));
            (id, (&e.engine_id, &e.role, e.incarnation, meta, identity, e.last_seen))
        });
        rows.into_py_dict(py)
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
            tagged.push((obj(o), to_engine, kind));
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
