//! Typed extraction of Python arguments, shared by every binding.
//!
//! `PyO3`'s own conversions raise bare `TypeError` / `OverflowError` for a float, `None`, a
//! string, a negative number given to an unsigned parameter or an int past 2**64, and they
//! accept `True` as 1. A parameter typed [`Int`], [`Text`], [`Real`] or [`IntList`] never
//! fails to extract: it keeps what was given, and the conversion that needs the value raises
//! one `DisaggError` subclass naming the field: `ArgumentTypeError` (also a `TypeError`) for a
//! wrong type, the field's class (`LayoutError`, `ArgumentError`, `BlockIdError`) for a value
//! out of range, with the value given and the valid range. So every bad argument, of any type,
//! gives one typed error with `.field` set.

use disagg_core::wire::value::WireValue;
use disagg_core::DisaggError;
use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::error::to_pyerr;

/// Which error class a bad value raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `LayoutError`: a layout or dims field.
    Layout,
    /// `ArgumentError`: a plain argument (counts, ranks, modes, sizes).
    Argument,
    /// `BlockIdError`: a block or slot id or id list.
    Block,
}

/// The Python error of `kind` naming `field`.
pub fn err(kind: Kind, field: &str, detail: String) -> PyErr {
    to_pyerr(match kind {
        Kind::Layout => DisaggError::layout(field, detail),
        Kind::Argument => DisaggError::argument(field, detail),
        Kind::Block => DisaggError::block(field, detail),
    })
}

mod py_exc {
    pyo3::import_exception!(disagg_rs.exceptions, DisaggError);
    pyo3::import_exception!(disagg_rs.exceptions, ArgumentTypeError);
}

/// An `ArgumentTypeError` (an `ArgumentError` and a `TypeError`) naming `field`.
pub fn type_err(field: &str, detail: String) -> PyErr {
    py_exc::ArgumentTypeError::new_err((
        format!("invalid argument `{field}`: {detail}"),
        field.to_owned(),
    ))
}

/// `e` if it is already a `DisaggError`, else the typed error `typed()` builds: a failure of
/// Python code the bindings call (an attribute lookup on a caller's object) never escapes as
/// a bare `AttributeError` or `TypeError`.
pub fn retype(py: Python<'_>, e: PyErr, typed: impl FnOnce() -> PyErr) -> PyErr {
    if e.is_instance_of::<py_exc::DisaggError>(py) {
        e
    } else {
        let t = typed();
        t.set_cause(py, Some(e));
        t
    }
}

/// `a float (1.5)`: the type and a short repr of a value, for error messages.
pub fn describe(obj: &Bound<'_, PyAny>) -> String {
    let kind = obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
    let mut repr = obj.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string());
    if repr.len() > 40 {
        let cut = (0..=37).rev().find(|&i| repr.is_char_boundary(i)).unwrap_or(0);
        repr.truncate(cut);
        repr.push_str("...");
    }
    if obj.is_none() {
        "None".to_owned()
    } else {
        let article = if kind.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" };
        format!("{article} {kind} ({repr})")
    }
}

/// An integer argument as given: the value, or what was given instead of an int.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Int(Result<i128, String>);

impl Int {
    /// A default value in a `#[pyo3(signature)]` (whose text signature then needs spelling
    /// out with `text_signature`, as `PyO3` renders only literal defaults).
    pub fn of(v: i64) -> Self {
        Self::from(v)
    }
    /// The value in `[lo, hi]`, else the error of `kind` naming `field`.
    pub fn in_range(
        &self,
        kind: Kind,
        field: &str,
        lo: i128,
        hi: i128,
        hi_text: &str,
    ) -> PyResult<i128> {
        match &self.0 {
            Ok(v) if (lo..=hi).contains(v) => Ok(*v),
            Ok(v) => Err(err(kind, field, format!("{field}={v} must be in [{lo}, {hi_text})"))),
            Err(what) => Err(type_err(field, format!("{field} must be an int, got {what}"))),
        }
    }
    /// A value in `[0, 2**32)`.
    pub fn to_u32(&self, kind: Kind, field: &str) -> PyResult<u32> {
        let v = self.in_range(kind, field, 0, i128::from(u32::MAX), "2**32")?;
        u32::try_from(v).map_err(|_| err(kind, field, format!("{field}={v} out of range")))
    }
    /// A value in `[-2**63, 2**63)`.
    pub fn to_i64(&self, kind: Kind, field: &str) -> PyResult<i64> {
        let v = self.in_range(kind, field, i128::from(i64::MIN), i128::from(i64::MAX), "2**63")?;
        i64::try_from(v).map_err(|_| err(kind, field, format!("{field}={v} out of range")))
    }
    /// A value in `[0, 2**64)`.
    pub fn to_u64(&self, kind: Kind, field: &str) -> PyResult<u64> {
        let v = self.in_range(kind, field, 0, i128::from(u64::MAX), "2**64")?;
        u64::try_from(v).map_err(|_| err(kind, field, format!("{field}={v} out of range")))
    }
}

impl From<i64> for Int {
    fn from(v: i64) -> Self {
        Self(Ok(i128::from(v)))
    }
}

impl From<i128> for Int {
    fn from(v: i128) -> Self {
        Self(Ok(v))
    }
}

impl From<u64> for Int {
    fn from(v: u64) -> Self {
        Self(Ok(i128::from(v)))
    }
}

/// Read one Python value as an integer: ints and objects with `__index__` (numpy and torch
/// integer scalars); never a bool, a float or a string.
fn int_of(obj: &Bound<'_, PyAny>) -> Result<i128, String> {
    if obj.is_instance_of::<PyBool>() {
        return Err(describe(obj));
    }
    match obj.extract::<i128>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() => {
            Err(format!("{} (beyond 128 bits)", describe(obj)))
        }
        Err(_) => Err(describe(obj)),
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(int_of(&obj.to_owned())))
    }
}

/// A list of integers as given: a list or tuple of ints, or a 1-D integer numpy array or torch
/// tensor (on any device; copied to the host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntList(Result<Vec<i128>, String>);

impl IntList {
    /// Every value in `[0, 2**32)`; errors name `field[i]`.
    pub fn to_u32s(&self, kind: Kind, field: &str) -> PyResult<Vec<u32>> {
        self.each(kind, field, "must be in [0, 2**32)")
    }
    /// Every value in `[0, 2**64)`; errors name `field[i]`.
    pub fn to_u64s(&self, kind: Kind, field: &str) -> PyResult<Vec<u64>> {
        self.each(kind, field, "must be in [0, 2**64)")
    }
    /// Every value in `[-2**63, 2**63)`; errors name `field[i]`.
    pub fn to_i64s(&self, kind: Kind, field: &str) -> PyResult<Vec<i64>> {
        self.each(kind, field, "must fit a signed 64-bit int")
    }
    /// Every value converted to `T`; the first that does not fit is named with `range`.
    fn each<T: TryFrom<i128>>(&self, kind: Kind, field: &str, range: &str) -> PyResult<Vec<T>> {
        let values = self.values(field)?;
        let bad = |i: usize, v: i128| err(kind, field, format!("{field}[{i}]={v} {range}"));
        values.iter().enumerate().map(|(i, &v)| T::try_from(v).map_err(|_| bad(i, v))).collect()
    }
    fn values(&self, field: &str) -> PyResult<&[i128]> {
        match &self.0 {
            Ok(v) => Ok(v),
            Err(what) => Err(type_err(field, format!("{field} must be {what}"))),
        }
    }
}

const LIST_EXPECTED: &str = "a list of ints or a 1-D integer numpy array or torch tensor";

/// Read a 1-D integer array (numpy, or torch through `.numpy()` on the host) without a Python
/// object per element.
fn array_of(obj: &Bound<'_, PyAny>) -> Result<Vec<i128>, String> {
    let host = if obj.hasattr("data_ptr").unwrap_or(false) && obj.hasattr("numpy").unwrap_or(false)
    {
        obj.call_method0("detach")
            .and_then(|t| t.call_method0("cpu"))
            .and_then(|t| t.call_method0("numpy"))
            .map_err(|_| format!("{LIST_EXPECTED}, got {}", describe(obj)))?
    } else {
        obj.clone()
    };
    let bad = || format!("{LIST_EXPECTED}, got {}", describe(obj));
    let ndim: usize = host.getattr("ndim").and_then(|n| n.extract()).map_err(|_| bad())?;
    let kind: String = host
        .getattr("dtype")
        .and_then(|d| d.getattr("kind"))
        .and_then(|k| k.extract())
        .map_err(|_| bad())?;
    if ndim != 1 || !(kind == "i" || kind == "u") {
        return Err(format!("{LIST_EXPECTED}, got an array with ndim={ndim}, dtype kind {kind:?}"));
    }
    if kind == "u" {
        let arr = host.call_method1("astype", ("uint64",)).map_err(|_| bad())?;
        let ro: PyReadonlyArray1<'_, u64> = arr.extract().map_err(|_| bad())?;
        return Ok(ro.as_array().iter().map(|&v| i128::from(v)).collect());
    }
    let arr = host.call_method1("astype", ("int64",)).map_err(|_| bad())?;
    let ro: PyReadonlyArray1<'_, i64> = arr.extract().map_err(|_| bad())?;
    debug_assert_eq!(ro.ndim(), 1);
    Ok(ro.as_array().iter().map(|&v| i128::from(v)).collect())
}

fn list_of(obj: &Bound<'_, PyAny>) -> Result<Vec<i128>, String> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return array_of(obj);
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            int_of(item).map_err(|what| format!("{LIST_EXPECTED}; item {i} is {what}"))
        })
        .collect()
}

impl<'a, 'py> FromPyObject<'a, 'py> for IntList {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(list_of(&obj.to_owned())))
    }
}

/// A string argument as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text(Result<String, String>);

impl Text {
    /// A default value in a `#[pyo3(signature)]`.
    pub fn of(v: &str) -> Self {
        Self(Ok(v.to_owned()))
    }
    /// The string, else an `ArgumentTypeError` naming `field`.
    pub fn get(&self, field: &str) -> PyResult<&str> {
        match &self.0 {
            Ok(s) => Ok(s),
            Err(what) => Err(type_err(field, format!("{field} must be a str, got {what}"))),
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Text {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let obj = obj.to_owned();
        Ok(Self(match obj.cast::<PyString>() {
            Ok(s) => s.to_str().map(str::to_owned).map_err(|_| describe(&obj)),
            Err(_) => Err(describe(&obj)),
        }))
    }
}

/// A real-number argument as given (an int or a float; never a bool or a string).
#[derive(Debug, Clone, PartialEq)]
pub struct Real(Result<f64, String>);

impl Real {
    /// A default value in a `#[pyo3(signature)]`.
    pub fn of(v: f64) -> Self {
        Self(Ok(v))
    }
    /// A finite value `> 0`, else an `ArgumentError` naming `field`.
    pub fn positive(&self, field: &str) -> PyResult<f64> {
        match &self.0 {
            Ok(v) if v.is_finite() && *v > 0.0 => Ok(*v),
            Ok(v) => Err(err(Kind::Argument, field, format!("{field}={v} must be finite and > 0"))),
            Err(what) => Err(type_err(field, format!("{field} must be a number, got {what}"))),
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Real {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let obj = obj.to_owned();
        if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyString>() {
            return Ok(Self(Err(describe(&obj))));
        }
        Ok(Self(obj.extract::<f64>().map_err(|_| describe(&obj))))
    }
}

/// Any other argument as given (a layout, a list of layouts, a `(layout, geometry)` pair):
/// `PyO3`'s conversion, with its `TypeError` turned into the typed error naming the field.
#[derive(Debug, Clone)]
pub struct Typed<T>(Result<T, String>);

impl<T> Typed<T> {
    /// The converted value, else an `ArgumentTypeError` naming `field` and what was `expected`.
    pub fn get(self, field: &str, expected: &str) -> PyResult<T> {
        self.0.map_err(|what| type_err(field, format!("{field} must be {expected}, got {what}")))
    }
}

impl<'a, 'py, T: FromPyObject<'a, 'py>> FromPyObject<'a, 'py> for Typed<T> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(T::extract(obj).map_err(|_| describe(&obj.to_owned()))))
    }
}

/// A bool argument as given (`True`/`False` or a numpy bool; never an int, `None` or a string).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag(Result<bool, String>);

impl Flag {
    /// A default value in a `#[pyo3(signature)]`.
    pub fn of(v: bool) -> Self {
        Self(Ok(v))
    }
    /// The bool, else an `ArgumentTypeError` naming `field`.
    pub fn get(&self, field: &str) -> PyResult<bool> {
        match &self.0 {
            Ok(v) => Ok(*v),
            Err(what) => Err(type_err(field, format!("{field} must be a bool, got {what}"))),
        }
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for Flag {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(obj.extract::<bool>().map_err(|_| describe(&obj.to_owned()))))
    }
}

/// A core wire value as the Python value `to_wire` would read back as it.
pub fn wire_to_py<'py>(py: Python<'py>, v: &WireValue) -> PyResult<Bound<'py, PyAny>> {
    match v {
        WireValue::Null => Ok(py.None().into_bound(py)),
        WireValue::Bool(b) => b.into_bound_py_any(py),
        WireValue::Int(i) => i.into_bound_py_any(py),
        WireValue::Float(f) => f.into_bound_py_any(py),
        WireValue::Str(s) => s.into_bound_py_any(py),
        WireValue::Bytes(b) => Ok(PyBytes::new(py, b).into_any()),
        WireValue::List(items) => {
            let items = items.iter().map(|x| wire_to_py(py, x)).collect::<PyResult<Vec<_>>>()?;
            Ok(PyList::new(py, items)?.into_any())
        }
        WireValue::Map(entries) => {
            let d = PyDict::new(py);
            for (k, x) in entries {
                d.set_item(k, wire_to_py(py, x)?)?;
            }
            Ok(d.into_any())
        }
    }
}

/// A core wire map as a Python dict.
pub fn wire_dict_to_py<'py>(py: Python<'py>, v: &WireValue) -> PyResult<Bound<'py, PyDict>> {
    Ok(wire_to_py(py, v)?.cast_into::<PyDict>()?)
}
