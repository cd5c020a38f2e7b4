//! Reading Python arguments into the core's [`disagg_core::args`] values: an [`Arg`] or
//! [`Typed`] parameter never fails to extract (`PyO3` would raise a bare `TypeError`); it keeps
//! what was given and the core decides which typed error names the field.

pub use disagg_core::args::Kind;
use disagg_core::args::{self, Given};
use disagg_core::wire::value::WireValue;
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::error::{to_pyerr, IntoPyResult};

/// The Python error of `kind` naming `field`.
pub fn err(kind: Kind, field: &str, detail: String) -> PyErr {
    to_pyerr(kind.error(field, detail))
}

/// An `ArgumentTypeError` (an `ArgumentError` and a `TypeError`) naming `field`.
pub fn type_err(field: &str, detail: String) -> PyErr {
    to_pyerr(disagg_core::DisaggError::argument_type(field, detail))
}

pyo3::import_exception!(disagg_rs.exceptions, DisaggError);

/// `e` if it is already a `DisaggError`, else the typed error `typed()` builds (caused by `e`).
pub fn retype(py: Python<'_>, e: PyErr, typed: impl FnOnce() -> PyErr) -> PyErr {
    if e.is_instance_of::<DisaggError>(py) {
        return e;
    }
    let t = typed();
    t.set_cause(py, Some(e));
    t
}

/// `a float (1.5)`: the type and a short repr of a value, for error messages.
pub fn describe(obj: &Bound<'_, PyAny>) -> String {
    let kind = obj.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
    let repr = obj.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string());
    args::describe(&kind, &repr, obj.is_none())
}

/// A Python argument as given, for the core to check (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct Arg<T>(pub Given<T>);

/// An integer argument.
pub type Int = Arg<i128>;
/// A list of integers: a list or tuple of ints, or a 1-D integer numpy array or torch tensor.
pub type IntList = Arg<Vec<i128>>;
/// A string argument.
pub type Text = Arg<String>;
/// A real-number argument.
pub type Real = Arg<f64>;
/// A bool argument.
pub type Flag = Arg<bool>;

/// The core's checks of an argument, as Python errors.
macro_rules! checks {
    ($($t:ty { $(of($o:ty);)? $(fn $name:ident($($a:ident: $at:ty),*) -> $ret:ty;)* })*) => {$(
        impl Arg<$t> {
            $(/// A default value in a `#[pyo3(signature)]`.
            pub fn of(v: $o) -> Self {
                Self(Given::<$t>::of(v))
            })?
            $(#[allow(missing_docs)]
            pub fn $name(&self, $($a: $at),*) -> PyResult<$ret> {
                self.0.$name($($a),*).py()
            })*
        }
    )*};
}

checks! {
    i128 {
        of(i64);
        fn in_range(kind: Kind, field: &str, lo: i128, hi: i128, hi_text: &str) -> i128;
        fn to_u32(kind: Kind, field: &str) -> u32;
        fn to_i64(kind: Kind, field: &str) -> i64;
        fn to_u64(kind: Kind, field: &str) -> u64;
    }
    String { of(&str); fn get(field: &str) -> &str; }
    f64 { of(f64); fn positive(field: &str) -> f64; }
    bool { of(bool); fn get(field: &str) -> bool; }
    Vec<i128> {
        fn to_u32s(kind: Kind, field: &str) -> Vec<u32>;
        fn to_u64s(kind: Kind, field: &str) -> Vec<u64>;
        fn to_i64s(kind: Kind, field: &str) -> Vec<i64>;
    }
}

/// How one Python argument (`Py`) becomes the value a core call takes (`Out`).
pub trait Conv {
    /// The parameter type Python's value is read into.
    type Py;
    /// The converted value.
    type Out;
    /// Convert `v`, naming `field` in an error.
    fn conv(field: &str, v: Self::Py) -> PyResult<Self::Out>;
}

/// Marker types of the conversions (see [`Conv`]), each `Marker: Py => Out = |field, v| body`.
macro_rules! convs {
    ($($(#[$m:meta])* $name:ident: $py:ty => $out:ty = |$f:ident, $v:ident| $e:expr;)*) => {$(
        $(#[$m])*
        pub struct $name;
        impl $crate::args::Conv for $name {
            type Py = $py;
            type Out = $out;
            fn conv($f: &str, $v: $py) -> ::pyo3::PyResult<$out> {
                $e
            }
        }
    )*};
}

pub(crate) use convs;

convs! {
    /// A non-negative count, time or request id.
    U64: Int => u64 = |f, v| v.to_u64(Kind::Argument, f);
    /// A count that must fit `u32`.
    U32: Int => u32 = |f, v| v.to_u32(Kind::Argument, f);
    /// A signed 64-bit value.
    I64: Int => i64 = |f, v| v.to_i64(Kind::Argument, f);
    /// A block or slot id (`[0, 2**32)`, `BlockIdError`).
    Id: Int => u32 = |f, v| v.to_u32(Kind::Block, f);
    /// A list of block ids.
    Ids: IntList => Vec<u32> = |f, v| v.to_u32s(Kind::Block, f);
    /// A list of non-negative 64-bit values.
    U64s: IntList => Vec<u64> = |f, v| v.to_u64s(Kind::Argument, f);
    /// A list of signed 64-bit values.
    I64s: IntList => Vec<i64> = |f, v| v.to_i64s(Kind::Argument, f);
    /// A bool.
    Bool: Flag => bool = |f, v| v.get(f);
    /// A string.
    Str: Text => String = |f, v| v.get(f).map(str::to_owned);
}

/// An optional argument: `None` stays `None`.
pub struct Opt<C>(std::marker::PhantomData<C>);

impl<C: Conv> Conv for Opt<C> {
    type Py = Option<C::Py>;
    type Out = Option<C::Out>;
    fn conv(field: &str, v: Self::Py) -> PyResult<Self::Out> {
        v.map(|v| C::conv(field, v)).transpose()
    }
}

/// A list of arguments, each converted as `C`.
pub struct Each<C>(std::marker::PhantomData<C>);

impl<C: Conv> Conv for Each<C> {
    type Py = Vec<C::Py>;
    type Out = Vec<C::Out>;
    fn conv(field: &str, v: Self::Py) -> PyResult<Self::Out> {
        v.into_iter().map(|v| C::conv(field, v)).collect()
    }
}

/// An argument `PyO3` converts itself (`T`), passed on as it is.
pub struct Raw<T>(std::marker::PhantomData<T>);

impl<T> Conv for Raw<T> {
    type Py = T;
    type Out = T;
    fn conv(_: &str, v: T) -> PyResult<T> {
        Ok(v)
    }
}

/// `conv!(request_id: U64, rank: U32)` rebinds each name to its converted value.
macro_rules! conv {
    ($($a:ident: $c:ty),* $(,)?) => {
        $(let $a = <$c as $crate::args::Conv>::conv(stringify!($a), $a)?;)*
    };
}
pub(crate) use conv;

/// Read one Python value as an integer: ints and objects with `__index__` (numpy and torch
/// integer scalars); never a bool, a float or a string.
pub fn int_of(obj: &Bound<'_, PyAny>) -> Result<i128, String> {
    if obj.is_instance_of::<PyBool>() {
        return Err(describe(obj));
    }
    obj.extract::<i128>().map_err(|_| {
        let what = describe(obj);
        if obj.is_instance_of::<PyInt>() {
            args::beyond_128_bits(&what)
        } else {
            what
        }
    })
}

/// Read a 1-D integer array (numpy, or torch on the host) without a Python object per element.
pub fn array_of(obj: &Bound<'_, PyAny>) -> Result<Vec<i128>, String> {
    let bad = || format!("{}, got {}", args::LIST_EXPECTED, describe(obj));
    let host = if obj.hasattr("data_ptr").unwrap_or(false) && obj.hasattr("numpy").unwrap_or(false)
    {
        obj.call_method0("detach")
            .and_then(|t| t.call_method0("cpu"))
            .and_then(|t| t.call_method0("numpy"))
            .map_err(|_| bad())?
    } else {
        obj.clone()
    };
    let ndim: usize = host.getattr("ndim").and_then(|n| n.extract()).map_err(|_| bad())?;
    let kind: String = host
        .getattr("dtype")
        .and_then(|d| d.getattr("kind"))
        .and_then(|k| k.extract())
        .map_err(|_| bad())?;
    if args::int_array_kind(ndim, &kind)? {
        let arr = host.call_method1("astype", ("uint64",)).map_err(|_| bad())?;
        let ro: PyReadonlyArray1<'_, u64> = arr.extract().map_err(|_| bad())?;
        return Ok(ro.as_array().iter().map(|&v| i128::from(v)).collect());
    }
    let arr = host.call_method1("astype", ("int64",)).map_err(|_| bad())?;
    let ro: PyReadonlyArray1<'_, i64> = arr.extract().map_err(|_| bad())?;
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
    let int = |(i, item): (usize, &Bound<'_, PyAny>)| {
        int_of(item).map_err(|what| args::bad_list_item(i, &what))
    };
    items.iter().enumerate().map(int).collect()
}

/// How each argument type reads a Python value.
macro_rules! extract {
    ($($t:ty => |$obj:ident| $read:expr;)*) => {$(
        impl<'a, 'py> FromPyObject<'a, 'py> for Arg<$t> {
            type Error = PyErr;
            fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
                let $obj = obj.to_owned();
                Ok(Self(Given($read)))
            }
        }
    )*};
}

extract! {
    i128 => |obj| int_of(&obj);
    Vec<i128> => |obj| list_of(&obj);
    String => |obj| match obj.cast::<PyString>() {
        Ok(s) => s.to_str().map(str::to_owned).map_err(|_| describe(&obj)),
        Err(_) => Err(describe(&obj)),
    };
    f64 => |obj| if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyString>() {
        Err(describe(&obj))
    } else {
        obj.extract::<f64>().map_err(|_| describe(&obj))
    };
    bool => |obj| obj.extract::<bool>().map_err(|_| describe(&obj));
}

/// Any other argument as given: `PyO3`'s conversion, its `TypeError` kept for [`Typed::get`].
#[derive(Debug, Clone)]
pub struct Typed<T>(Given<T>);

impl<T> Typed<T> {
    /// The converted value, else an `ArgumentTypeError` naming `field` and what was `expected`.
    pub fn get(self, field: &str, expected: &str) -> PyResult<T> {
        self.0.typed(field, expected).py()
    }
}

impl<'a, 'py, T: FromPyObject<'a, 'py>> FromPyObject<'a, 'py> for Typed<T> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Self(Given(T::extract(obj).map_err(|_| describe(&obj.to_owned())))))
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
