//! Python classes of the reshard plans (`disagg_core::reshard`), planned with the GIL released.

use disagg_core::reshard::of_rank;
use disagg_core::{KvReshardPlan, KvReshardTransfer, Span, SsmReshardPlan, SsmReshardTransfer};
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyDict, PySlice};

use crate::args::{conv, Int, Typed, U32, U64};
use crate::error::{py_methods, record_class, IntoPyResult};

/// A Python `slice(lo, hi)` (step None, like the reference design's helpers return).
fn py_slice(py: Python<'_>, s: Span) -> PyResult<Bound<'_, PyAny>> {
    py.get_type::<PySlice>().call1((s.lo, s.hi))
}

/// Resolve a Python sequence index (negative counts from the end) against `len`.
fn seq_index(index: isize, len: usize) -> PyResult<usize> {
    disagg_core::reshard::seq_index(index, len).ok_or_else(|| {
        PyIndexError::new_err(format!("plan index {index} out of range for {len} transfers"))
    })
}
use crate::layout::{cores, PyKvShardLayout, PySsmShardLayout};

/// A list argument of layouts.
type Layouts<'py, T> = Typed<Vec<PyRef<'py, T>>>;

/// The `#[pymethods]` of a plan class: a sequence of `$tr` records (`self.$records`) made
/// from `$lay` layouts, plus the hand-written `methods`.
macro_rules! plan_methods {
    ($plan:ty, $tr:ident, $lay:ident, records ($($records:tt)+), methods { $($m:tt)* }) => {
        #[pymethods]
        impl $plan {
            fn __len__(&self) -> usize {
                self.$($records)+.len()
            }
            fn __getitem__(&self, index: isize) -> PyResult<$tr> {
                let records = &self.$($records)+;
                Ok($tr { inner: records[seq_index(index, records.len())?] })
            }
            /// All transfers as a list, in plan order.
            #[getter]
            fn transfers(&self) -> Vec<$tr> {
                self.$($records)+.iter().map(|&inner| $tr { inner }).collect()
            }
            /// Source layouts the plan was made from.
            #[getter]
            fn srcs(&self) -> Vec<$lay> {
                self.inner.srcs().iter().map(|&inner| $lay { inner }).collect()
            }
            /// Destination layouts the plan was made from.
            #[getter]
            fn dsts(&self) -> Vec<$lay> {
                self.inner.dsts().iter().map(|&inner| $lay { inner }).collect()
            }
            /// Transfers sent by one source rank, in plan order.
            fn for_src(&self, global_rank: Int) -> PyResult<Vec<$tr>> {
                conv!(global_rank: U32);
                Ok(of_rank(&self.$($records)+, true, global_rank).into_iter().map(|inner| $tr { inner }).collect())
            }
            /// Transfers received by one destination rank, in plan order.
            fn for_dst(&self, global_rank: Int) -> PyResult<Vec<$tr>> {
                conv!(global_rank: U32);
                Ok(of_rank(&self.$($records)+, false, global_rank).into_iter().map(|inner| $tr { inner }).collect())
            }
            /// Check exact-once coverage of every destination cell (`PlanCoverageError`).
            fn verify(&self, py: Python<'_>) -> PyResult<()> {
                py.detach(|| self.inner.verify()).py()
            }
            fn __repr__(&self) -> String {
                self.inner.to_string()
            }
            $($m)*
        }
    };
}

/// The transfer record classes: each a `record_class` header, then the `py_methods` sections
/// of its own accessors; every one also has `src_rank`, `dst_rank` and `__repr__`.
macro_rules! transfer_classes {
    ($($(#[$doc:meta])* $name:literal $ty:ident($core:ty) get { $($g:tt)* }
        span $s:tt range $r:tt methods { $($m:tt)* })*) => {$(
        record_class!($(#[$doc])* $name $ty($core));
        py_methods!($ty, get { src_rank: u32 = (src_rank); dst_rank: u32 = (dst_rank); $($g)* }
        span $s range $r methods {
            $($m)*
            fn __repr__(&self) -> String {
                self.inner.to_string()
            }
        });
    )*};
}

transfer_classes! {
/// One KV transfer: `src_rank` sends global `layers` x `heads` (half-open) to `dst_rank` for
/// every token of the handoff.
"KVReshardTransfer" PyKvReshardTransfer(KvReshardTransfer)
get {
    /// Global layers moved, `[global_layer_lo, global_layer_hi)` (the reference design's fields).
    global_layer_lo: u32 = (layers.lo);
    global_layer_hi: u32 = (layers.hi);
    /// Global KV heads moved, `[global_head_lo, global_head_hi)`.
    global_head_lo: u32 = (heads.lo);
    global_head_hi: u32 = (heads.hi);
    num_layers: u32 = (layers.len());
    num_heads: u32 = (heads.len());
}
span {
    /// Global layers moved, `[lo, hi)`.
    layers = (layers);
    /// Global KV heads moved, `[lo, hi)`.
    heads = (heads);
}
range {
    /// Layers in the source's local indexing.
    src_local_layers = (src_local_layers());
    src_local_heads = (src_local_heads());
    /// Layers in the destination's local indexing.
    dst_local_layers = (dst_local_layers());
    dst_local_heads = (dst_local_heads());
}
methods {
    /// The moved layers as a slice of `src`'s local layer axis (`LayoutError` if `src` lacks them).
    fn src_layer_slice<'py>(&self, py: Python<'py>, src: Kv<'py>) -> PyResult<Bound<'py, PyAny>> {
        py_slice(py, self.inner.layers_in(&src.inner).py()?)
    }
    /// The moved heads as a slice of `src`'s local head axis.
    fn src_head_slice<'py>(&self, py: Python<'py>, src: Kv<'py>) -> PyResult<Bound<'py, PyAny>> {
        py_slice(py, self.inner.heads_in(&src.inner).py()?)
    }
    /// The moved layers as a slice of `dst`'s local layer axis.
    fn dst_layer_slice<'py>(&self, py: Python<'py>, dst: Kv<'py>) -> PyResult<Bound<'py, PyAny>> {
        py_slice(py, self.inner.layers_in(&dst.inner).py()?)
    }
    /// The moved heads as a slice of `dst`'s local head axis.
    fn dst_head_slice<'py>(&self, py: Python<'py>, dst: Kv<'py>) -> PyResult<Bound<'py, PyAny>> {
        py_slice(py, self.inner.heads_in(&dst.inner).py()?)
    }
    /// Bytes moved per token, K and V.
    #[pyo3(signature = (head_dim, element_size=Int::of(2)),
        text_signature = "($self, head_dim, element_size=2)")]
    fn bytes_per_token(&self, head_dim: Int, element_size: Int) -> PyResult<u64> {
        conv!(head_dim: U64, element_size: U64);
        self.inner.bytes_per_token(head_dim, element_size).py()
    }
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = &self.inner;
        let d = [("src_rank", t.src_rank), ("dst_rank", t.dst_rank)].into_py_dict(py)?;
        t.named_spans().iter().try_for_each(|(k, s)| d.set_item(k, (s.lo, s.hi)))?;
        Ok(d)
    }
}

/// One SSM transfer of one band over a layer range: channels (bands "x", "B", "C") or heads
/// ("recurrent").
"SSMReshardTransfer" PySsmReshardTransfer(SsmReshardTransfer)
get {
    /// "x", "B", "C" or "recurrent".
    band: &'static str = (band.name());
    is_conv: bool = (band.is_conv());
    /// Local channels or heads read on the source, `[src_lo, src_hi)`.
    src_lo: u32 = (src_local.lo);
    src_hi: u32 = (src_local.hi);
    /// Local channels or heads written on the destination, `[dst_lo, dst_hi)`.
    dst_lo: u32 = (dst_local.lo);
    dst_hi: u32 = (dst_local.hi);
    /// "conv" for x/B/C, "recurrent" for the recurrent state.
    state_kind: &'static str = (state_kind());
}
span {
    layers = (layers);
    global_range = (global);
    src_local = (src_local);
    dst_local = (dst_local);
}
range {
    src_local_layers = (src_local_layers());
    dst_local_layers = (dst_local_layers());
}
methods {
    /// The one global layer moved; `LayoutError` for a transfer of several layers (`ranges`).
    #[getter]
    fn global_layer(&self) -> PyResult<u32> {
        self.inner.single_layer("global_layer").py()
    }
    #[getter]
    fn src_layer(&self) -> PyResult<u32> {
        self.inner.src_layer().py()
    }
    #[getter]
    fn dst_layer(&self) -> PyResult<u32> {
        self.inner.dst_layer().py()
    }
}
}

/// A KV layout argument.
type Kv<'py> = PyRef<'py, PyKvShardLayout>;

/// A KV reshard plan: a read-only sequence of `KVReshardTransfer` (`disagg_core::KvReshardPlan`).
#[pyclass(name = "KVReshardPlan", module = "disagg_rs", frozen, sequence)]
pub struct PyKvReshardPlan {
    /// The core plan.
    pub inner: KvReshardPlan,
}

plan_methods!(PyKvReshardPlan, PyKvReshardTransfer, PyKvShardLayout, records (inner.transfers),
methods {
    /// Bytes moved per token over the whole plan, K and V.
    #[pyo3(signature = (head_dim, element_size=Int::of(2)),
        text_signature = "($self, head_dim, element_size=2)")]
    fn bytes_per_token(&self, head_dim: Int, element_size: Int) -> PyResult<u64> {
        conv!(head_dim: U64, element_size: U64);
        self.inner.bytes_per_token(head_dim, element_size).py()
    }
});

/// An SSM reshard plan: a read-only sequence of single-layer `SSMReshardTransfer` records;
/// `ranges` holds the same moves merged over layer ranges.
#[pyclass(name = "SSMReshardPlan", module = "disagg_rs", frozen, sequence)]
pub struct PySsmReshardPlan {
    /// The core plan (layer-range transfers).
    pub inner: SsmReshardPlan,
    /// The same transfers cut into single layers, in plan order.
    per_layer: Vec<SsmReshardTransfer>,
}

plan_methods!(PySsmReshardPlan, PySsmReshardTransfer, PySsmShardLayout, records (per_layer),
methods {
    /// The transfers merged over layer ranges.
    #[getter]
    fn ranges(&self) -> Vec<PySsmReshardTransfer> {
        self.inner.transfers.iter().map(|&inner| PySsmReshardTransfer { inner }).collect()
    }
});

/// The planning functions: `fn name(srcs, dsts: Layout) -> Class = |plan| class`, each the
/// core's function of the same name between two layout lists, with the GIL released.
macro_rules! plan_fns {
    ($($(#[$doc:meta])* fn $f:ident($s:ident, $d:ident: $lay:ty)
        -> $class:ty = |$p:ident| $make:expr;)*) => {$(
        $(#[$doc])*
        #[pyfunction]
        pub fn $f(py: Python<'_>, $s: Layouts<'_, $lay>, $d: Layouts<'_, $lay>) -> PyResult<$class> {
            let (s, d) = (cores($s, stringify!($s))?, cores($d, stringify!($d))?);
            let $p = py.detach(|| disagg_core::$f(&s, &d)).py()?;
            Ok($make)
        }
    )*};
}

plan_fns! {
    /// `disagg_core::plan_kv_reshard` between two layout lists.
    fn plan_kv_reshard(srcs, dsts: PyKvShardLayout) -> PyKvReshardPlan
        = |inner| PyKvReshardPlan { inner };
    /// `disagg_core::plan_ssm_reshard` between two layout lists.
    fn plan_ssm_reshard(src_layouts, dst_layouts: PySsmShardLayout)
        -> PySsmReshardPlan = |inner| PySsmReshardPlan { per_layer: inner.per_layer(), inner };
}
