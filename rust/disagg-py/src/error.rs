//! The one mapping from core errors to the Python classes of `disagg_rs.exceptions`.

use std::collections::BTreeMap;

use disagg_core::DisaggError;
use pyo3::exceptions::PyBaseException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Import the exception classes of `disagg_rs.exceptions` this mapping raises.
macro_rules! exceptions {
    ($($name:ident),*) => {$(pyo3::import_exception!(disagg_rs.exceptions, $name);)*};
}

exceptions! {
    LayoutError, PlanCoverageError, BlockIdError, GeometryMismatchError, AddressOverflowError,
    MetadataError, HandoffMetadataError, UnknownRequestError, DuplicateRequestError,
    CapacityError, HandoffStateError, ResetRefusedError, ArgumentError, ArgumentTypeError,
    ConservationError, MessageOrderError, PushAbortedError
}

/// A core error as its Python exception `(message, field)`; exhaustive over the variants.
pub fn to_pyerr(e: DisaggError) -> PyErr {
    let msg = e.to_string();
    match e {
        DisaggError::Layout { field, .. } => LayoutError::new_err((msg, field)),
        DisaggError::Coverage { .. } => PlanCoverageError::new_err((msg, "dsts")),
        DisaggError::Block { field, .. } => BlockIdError::new_err((msg, field)),
        DisaggError::Geometry { field, .. } => GeometryMismatchError::new_err((msg, field)),
        DisaggError::AddressOverflow { .. } => AddressOverflowError::new_err((msg, None::<String>)),
        DisaggError::Wire { field, .. } => MetadataError::new_err((msg, field)),
        DisaggError::HandoffMetadata { field, .. } => HandoffMetadataError::new_err((msg, field)),
        DisaggError::UnknownRequest { .. } => UnknownRequestError::new_err((msg, "request_id")),
        DisaggError::DuplicateRequest { .. } => DuplicateRequestError::new_err((msg, "request_id")),
        DisaggError::Capacity { resource, .. } => CapacityError::new_err((msg, resource)),
        DisaggError::State { .. } => HandoffStateError::new_err((msg, None::<String>)),
        DisaggError::HandoffState { field, .. } => HandoffStateError::new_err((msg, field)),
        DisaggError::ResetRefused { .. } => ResetRefusedError::new_err((msg, None::<String>)),
        DisaggError::Argument { field, .. } => ArgumentError::new_err((msg, field)),
        DisaggError::MessageOrder { field, .. } => MessageOrderError::new_err((msg, field)),
        DisaggError::PushAborted { .. } => PushAbortedError::new_err((msg, "tag")),
        DisaggError::ArgumentType { field, .. } => ArgumentTypeError::new_err((msg, field)),
        DisaggError::Conservation { .. } => ConservationError::new_err((msg, None::<String>)),
    }
}

/// A `MetadataError` raised while converting a handoff's own metadata (a ticket) into wire
/// values, as the `HandoffMetadataError` it is; any other error is kept.
pub fn in_handoff_metadata(py: Python<'_>, e: PyErr) -> PyErr {
    if !e.is_instance_of::<MetadataError>(py) || e.is_instance_of::<HandoffMetadataError>(py) {
        return e;
    }
    let value = e.value(py);
    let field: Option<String> = value.getattr("field").ok().and_then(|f| f.extract().ok());
    let msg = value.str().map_or_else(|_| String::new(), |s| s.to_string());
    HandoffMetadataError::new_err((msg, field))
}

/// `?`-friendly conversion of core results.
pub trait IntoPyResult<T> {
    /// Map the error through [`to_pyerr`].
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, DisaggError> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}

/// Each core error variant's sample as the exception the mapping makes, by kind (for the
/// mapping test).
#[pyfunction]
pub fn _sample_errors(py: Python<'_>) -> BTreeMap<&'static str, Py<PyBaseException>> {
    DisaggError::samples().into_iter().map(|e| (e.kind(), to_pyerr(e).into_value(py))).collect()
}

/// A `MetadataError` naming `field`.
pub fn wire_err(field: &str, detail: String) -> PyErr {
    to_pyerr(DisaggError::wire(field, detail))
}

/// A wire value that must be a dict: `MetadataError` naming `field` for anything else.
pub fn wire_dict<'a, 'py>(
    v: &'a Bound<'py, PyAny>,
    field: &str,
) -> PyResult<&'a Bound<'py, PyDict>> {
    v.cast::<PyDict>().map_err(|_| {
        let kind = v.get_type().name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
        wire_err(field, format!("expected a dict, got a {kind}"))
    })
}

/// A frozen Python class `$name` around its core value `inner`, compared and hashed by it.
macro_rules! record_class {
    ($(#[$doc:meta])* $name:literal $ty:ident($core:ty) $(, $opt:ident)?) => {
        $(#[$doc])*
        #[::pyo3::pyclass(name = $name, module = "disagg_rs", frozen, eq, hash $(, $opt)?)]
        #[derive(Clone, PartialEq, Eq, Hash)]
        pub struct $ty {
            /// The core value.
            pub inner: $core,
        }
    };
}
pub(crate) use record_class;

/// One `#[pymethods]` block listing the read-only accessors of `self.inner`: `get { name: T =
/// (path); }` getters, optional `fields { name, .. }` getters of the `u32` fields of the same
/// name (`ranks { name, .. }`: of the same name in `ranks`, the rank coordinates), optional `span`/`range` `{ name = (path); }` spans as `(lo, hi)` (getter / method),
/// then the hand-written `methods`. A leading `wire $ty => $core` adds `from_dict`,
/// `to_dict`, `__reduce__` (the core's [`WireRecord`](disagg_core::wire::layout::WireRecord))
/// and `__repr__`.
macro_rules! py_methods {
    (
        wire $ty:ty => $core:ty,
        get $g:tt $(fields $f:tt)? $(ranks $k:tt)? $(span $s:tt)? $(range $r:tt)? methods { $($m:tt)* }
    ) => {
        impl $ty {
            /// Decode a wire dict (`MetadataError` on a missing, unknown or mistyped field).
            pub fn from_wire(
                d: &::pyo3::Bound<'_, ::pyo3::types::PyDict>,
            ) -> ::pyo3::PyResult<Self> {
                use $crate::error::IntoPyResult;
                use ::disagg_core::wire::layout::WireRecord;
                let v = $crate::wire::to_wire(d.as_any(), "<dict>")?;
                let obj = ::disagg_core::wire::value::Obj::of(&v, "").py()?;
                Ok(Self { inner: <$core>::from_obj(&obj).py()? })
            }
        }

        $crate::error::py_methods!($ty, get $g $(fields $f)? $(ranks $k)? $(span $s)? $(range $r)? methods {
            $($m)*
            /// Rebuild from `to_dict()` output (or the reference design's field dict).
            #[classmethod]
            fn from_dict(
                _cls: &::pyo3::Bound<'_, ::pyo3::types::PyType>,
                d: &::pyo3::Bound<'_, ::pyo3::PyAny>,
            ) -> ::pyo3::PyResult<Self> {
                Self::from_wire($crate::error::wire_dict(d, "<dict>")?)
            }
            fn __reduce__<'py>(
                slf: &::pyo3::Bound<'py, Self>,
            ) -> ::pyo3::PyResult<(
                ::pyo3::Bound<'py, ::pyo3::PyAny>,
                (::pyo3::Bound<'py, ::pyo3::types::PyDict>,),
            )> {
                use ::pyo3::types::PyAnyMethods;
                let from_dict = slf.get_type().getattr("from_dict")?;
                Ok((from_dict, (slf.get().to_dict(slf.py())?,)))
            }
            /// Plain dict for the wire (JSON/msgpack safe); `from_dict(to_dict())` round-trips.
            fn to_dict<'py>(
                &self,
                py: ::pyo3::Python<'py>,
            ) -> ::pyo3::PyResult<::pyo3::Bound<'py, ::pyo3::types::PyDict>> {
                let wire = ::disagg_core::wire::layout::WireRecord::to_wire(&self.inner);
                $crate::args::wire_dict_to_py(py, &wire)
            }
            fn __repr__(&self) -> String {
                self.inner.to_string()
            }
        });
    };
    (
        $ty:ty,
        get { $($(#[$gm:meta])* $g:ident: $gt:ty = ($($gp:tt)+);)* }
        $(fields { $($(#[$fm:meta])* $f:ident),* })?
        $(ranks { $($(#[$km:meta])* $k:ident),* })?
        $(span { $($(#[$sm:meta])* $s:ident = ($($sp:tt)+);)* })?
        $(range { $($(#[$rm:meta])* $r:ident = ($($rp:tt)+);)* })?
        methods { $($m:tt)* }
    ) => {
        #[::pyo3::pymethods]
        impl $ty {
            $($(#[$gm])* #[getter] fn $g(&self) -> $gt { self.inner.$($gp)+ })*
            $($($(#[$fm])* #[getter] fn $f(&self) -> u32 { self.inner.$f })*)?
            $($($(#[$km])* #[getter] fn $k(&self) -> u32 { self.inner.ranks.$k })*)?
            $($($(#[$sm])* #[getter] fn $s(&self) -> (u32, u32) {
                let s = self.inner.$($sp)+;
                (s.lo, s.hi)
            })*)?
            $($($(#[$rm])* fn $r(&self) -> (u32, u32) {
                let s = self.inner.$($rp)+;
                (s.lo, s.hi)
            })*)?
            $($m)*
        }
    };
}
pub(crate) use py_methods;
