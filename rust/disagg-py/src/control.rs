//! Bindings of the control-message decoder (`disagg_core::wire::control`).

use disagg_core::wire::control;
use disagg_core::wire::msgpack::Value;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3::IntoPyObjectExt;

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
