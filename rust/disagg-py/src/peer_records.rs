//! The reference design's peer-metadata helpers, re-exported by `disagg_rs.utils`: the core's
//! rules (`disagg_core::peer_records`) walk the Python values and hand them back as they are.

use disagg_core::peer_records::{self, MetaNode};
use disagg_core::wire::value::Obj;
use disagg_core::{refmeta, DisaggError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::args::wire_dict_to_py;
use crate::error::{to_pyerr, IntoPyResult};
use crate::layout::PyKvShardLayout;
use crate::wire::to_wire;

/// A Python metadata value, walked by the core's rules (`disagg_core::peer_records`,
/// `disagg_core::backend_rules::peers`).
#[derive(Clone)]
pub(crate) struct Node<'py>(pub(crate) Bound<'py, PyAny>);

impl MetaNode for Node<'_> {
    type Err = PyErr;
    fn lift(e: DisaggError) -> PyErr {
        to_pyerr(e)
    }
    fn list(&self) -> Option<Vec<Self>> {
        Some(self.0.cast::<PyList>().ok()?.iter().map(Node).collect())
    }
    fn is_map(&self) -> bool {
        self.0.cast::<PyDict>().is_ok()
    }
    fn get(&self, key: &str) -> PyResult<Option<Self>> {
        let Ok(d) = self.0.cast::<PyDict>() else { return Ok(None) };
        Ok(d.get_item(key)?.map(Node))
    }
    fn items(&self) -> PyResult<Vec<Self>> {
        self.0.try_iter()?.map(|v| v.map(Node)).collect()
    }
    fn ints(&self) -> Option<Vec<i64>> {
        self.0.extract().ok()
    }
    fn show(&self) -> String {
        self.0.to_string()
    }
    fn copy_with(&self, sets: Vec<(&str, Self)>) -> PyResult<Self> {
        let out = self.0.cast::<PyDict>()?.copy()?;
        sets.into_iter().try_for_each(|(k, v)| out.set_item(k, v.0))?;
        Ok(Node(out.into_any()))
    }
    fn new_list(&self, items: Vec<Self>) -> PyResult<Self> {
        Ok(Node(PyList::new(self.0.py(), items.into_iter().map(|n| n.0))?.into_any()))
    }
    fn id_list(&self, ids: &[u32]) -> PyResult<Self> {
        Ok(Node(PyList::new(self.0.py(), ids)?.into_any()))
    }
}

/// `peer_records::records`: `(meta, block_ids)` of every source rank.
#[pyfunction]
pub fn transfer_peer_records<'py>(
    peer_meta: Bound<'py, PyAny>,
    src_block_ids: Bound<'py, PyAny>,
) -> PyResult<Vec<(Bound<'py, PyAny>, Vec<u32>)>> {
    let records = peer_records::records(&Node(peer_meta), &Node(src_block_ids))?;
    Ok(records.into_iter().map(|(m, b)| (m.0, b)).collect())
}

/// `peer_records::block_count`.
#[pyfunction]
pub fn transfer_block_count(
    peer_meta: Bound<'_, PyAny>,
    src_block_ids: Bound<'_, PyAny>,
) -> PyResult<usize> {
    peer_records::block_count(&Node(peer_meta), &Node(src_block_ids))
}

/// `peer_records::drop_prefix` (the inputs are never modified).
#[pyfunction]
pub fn drop_transfer_prefix_blocks<'py>(
    peer_meta: Bound<'py, PyAny>,
    src_block_ids: Bound<'py, PyAny>,
    prefix_count: i64,
) -> PyResult<(Bound<'py, PyAny>, Vec<u32>)> {
    let (meta, rest) =
        peer_records::drop_prefix(&Node(peer_meta), &Node(src_block_ids), prefix_count)?;
    Ok((meta.0, rest))
}

/// `refmeta::meta_from_reference` as read by this rank.
#[pyfunction]
pub fn meta_from_reference<'py>(
    meta: &Bound<'py, PyAny>,
    backend: String,
    state_kind: String,
    element_size: u64,
    dtype: String,
) -> PyResult<Bound<'py, PyDict>> {
    let local = refmeta::LocalFacts { backend, state_kind, element_size, dtype };
    let out = refmeta::meta_from_reference(&to_wire(meta, "peer_meta")?, &local).py()?;
    wire_dict_to_py(meta.py(), &out)
}

/// `refmeta::kv_layout_from_reference`.
#[pyfunction]
pub fn kv_layout_from_reference(meta: &Bound<'_, PyAny>) -> PyResult<PyKvShardLayout> {
    let wire = to_wire(meta, "peer_meta")?;
    let inner = refmeta::kv_layout_from_reference(&Obj::of(&wire, "").py()?).py()?;
    Ok(PyKvShardLayout { inner })
}
