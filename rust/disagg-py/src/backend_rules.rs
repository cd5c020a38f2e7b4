//! Bindings of the transfer backends' host-side rules (`disagg_core::backend_rules`): argument
//! conversion only.

use disagg_core::backend_rules::{self as rules, ChunkFacts, IpcHost};
use pyo3::prelude::*;

use crate::error::IntoPyResult;
use crate::layout::{PyKvShardLayout, PySsmShardLayout};

/// `mapping.get(key)`, `None` when absent or `None`.
fn get<'py>(mapping: &Bound<'py, PyAny>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let v = mapping.call_method1("get", (key,))?;
    Ok((!v.is_none()).then_some(v))
}

/// The layouts of `layout`'s model-parallel group (TP fastest, then PP), `None` at its own
/// place; raises `MetadataError` (`src_metas`) where a sibling cannot be inferred.
#[pyfunction]
pub fn group_layouts(
    py: Python<'_>,
    layout: &Bound<'_, PyAny>,
) -> PyResult<Vec<Option<Py<PyAny>>>> {
    if let Ok(kv) = layout.cast::<PyKvShardLayout>() {
        let sibs = rules::group_siblings(&kv.get().inner).py()?;
        to_py(py, sibs.into_iter().map(|s| s.map(|inner| PyKvShardLayout { inner })))
    } else {
        let sibs = rules::group_siblings(&layout.cast::<PySsmShardLayout>()?.get().inner).py()?;
        to_py(py, sibs.into_iter().map(|s| s.map(|inner| PySsmShardLayout { inner })))
    }
}

fn to_py<T>(
    py: Python<'_>,
    items: impl Iterator<Item = Option<T>>,
) -> PyResult<Vec<Option<Py<PyAny>>>>
where
    T: pyo3::PyClass + Into<PyClassInitializer<T>>,
{
    items.map(|s| s.map(|v| Ok(Py::new(py, v)?.into_any())).transpose()).collect()
}

fn chunk_facts(meta: &Bound<'_, PyAny>) -> PyResult<ChunkFacts> {
    let kind = get(meta, "state_kind")?;
    let regions = match get(meta, "buffer")?.map(|b| get(&b, "regions")).transpose()?.flatten() {
        Some(r) => r.len()?,
        None => 0,
    };
    let geometry = match get(meta, "geometry")? {
        Some(g) => {
            let keys = ["tokens_per_block", "num_heads", "head_stride", "head_dim", "element_size"];
            let mut out = [0u64; 5];
            for (slot, key) in out.iter_mut().zip(keys) {
                *slot = g.get_item(key)?.extract()?;
            }
            Some(out)
        }
        None => None,
    };
    Ok(ChunkFacts { kv: kind.is_some_and(|k| k.eq("kv").unwrap_or(false)), regions, geometry })
}

/// Whether a two-sided handoff between ranks of these metadata dicts moves in chunks.
#[pyfunction]
pub fn chunkable(metas: Vec<Bound<'_, PyAny>>) -> PyResult<bool> {
    let facts = metas.iter().map(chunk_facts).collect::<PyResult<Vec<_>>>()?;
    Ok(rules::chunkable(&facts))
}

/// `(slots, slot_bytes)` of a staging pool (`None`: the defaults); `ArgumentError` on a chunk
/// size that is not a positive multiple of 256.
#[pyfunction]
#[pyo3(signature = (pool_bytes, chunk_bytes, default_pool_bytes, default_chunk_bytes))]
pub fn staging_slots(
    pool_bytes: Option<i64>,
    chunk_bytes: Option<i64>,
    default_pool_bytes: i64,
    default_chunk_bytes: i64,
) -> PyResult<(u64, u64)> {
    rules::staging_slots(
        pool_bytes.unwrap_or(default_pool_bytes),
        chunk_bytes.unwrap_or(default_chunk_bytes),
    )
    .py()
}

/// Raise `CapacityError` (`chunk_bytes`) when an item does not fit a staging slot.
#[pyfunction]
pub fn check_slot_capacity(items: Vec<u64>, slot_bytes: u64) -> PyResult<()> {
    rules::check_slot_capacity(&items, slot_bytes).py()
}

/// Raise `BlockIdError` (`field`) when `held` block ids are not what the plans need.
#[pyfunction]
pub fn check_chunk_blocks(
    field: &str,
    held: u64,
    num_tokens: u64,
    needs: Vec<u64>,
) -> PyResult<()> {
    rules::check_chunk_blocks(field, held, num_tokens, &needs).py()
}

/// `(lo, hi, programs)` of one kernel launch over packed bytes `range` of a run table
/// `(total, unit)`, in units.
#[pyfunction]
pub fn packed_window(
    range: (i64, Option<i64>),
    table: (u64, u64),
    chunk_units: u64,
) -> PyResult<(u64, u64, u64)> {
    rules::packed_window(range, table, chunk_units).py()
}

/// The packed windows of a pipelined handoff between two run tables, each `(total, unit)`
/// (`chunk_bytes` below one unit: one unit).
#[pyfunction]
pub fn pipeline_windows(
    gather: (u64, u64),
    scatter: (u64, u64),
    chunk_bytes: i64,
) -> PyResult<Vec<(u64, u64)>> {
    rules::pipeline_windows(gather, scatter, u64::try_from(chunk_bytes).unwrap_or(0)).py()
}

/// `"triton"` or `"torch"`: which implementation copies a tensor's fragments.
#[pyfunction]
pub fn staging_path(forced: &str, cuda_with_triton: bool) -> &'static str {
    rules::staging_path(forced, cuda_with_triton)
}

fn ipc_host(export: Option<Bound<'_, PyAny>>) -> PyResult<Option<IpcHost>> {
    let Some(e) = export.filter(|e| e.is_truthy().unwrap_or(false)) else { return Ok(None) };
    let text = |key| -> PyResult<Option<String>> {
        get(&e, key)?.map(|v| Ok(v.str()?.to_string())).transpose()
    };
    Ok(Some(IpcHost { hostname: text("hostname")?, boot_id: text("boot_id")? }))
}

/// Whether two CUDA IPC exports (dicts, or `None`) come from one host.
#[pyfunction]
pub fn ipc_same_host(
    mine: Option<Bound<'_, PyAny>>,
    theirs: Option<Bound<'_, PyAny>>,
) -> PyResult<bool> {
    Ok(rules::same_host(ipc_host(mine)?.as_ref(), ipc_host(theirs)?.as_ref()))
}

/// The widest unit (8, 4, 2 or 1 bytes) dividing a row and a storage offset.
#[pyfunction]
pub fn row_unit(row_bytes: u64, offset: u64) -> u64 {
    rules::row_unit(row_bytes, offset)
}

/// The GPU index whose kernels read a buffer of GPU `home` mapped through CUDA IPC, for a
/// reader on `local` (a `torch.device` or `None`); `unset` where `local` names no index.
#[pyfunction]
pub fn ipc_reader_gpu(home: u32, local: Option<Bound<'_, PyAny>>, unset: u32) -> PyResult<u32> {
    let (cuda, index) = match local {
        Some(d) => (d.getattr("type")?.eq("cuda")?, d.getattr("index")?.extract::<Option<u32>>()?),
        None => (false, None),
    };
    Ok(rules::reader_gpu(home, cuda, index, unset))
}
