//! The reference design's peer-metadata helpers, re-exported by `disagg_rs.utils`: flatten flat,
//! TP-wrapped (`{"tp_metas": [...]}`) and PP-wrapped (`{"pp_metas": [...]}`) peer metadata into
//! `(meta, block_ids)` records, count a handoff's blocks, and drop a cached prefix. Block id lists
//! are parsed here, once, into `u32` (a negative or oversized id is a `BlockIdError`).

use disagg_core::wire::value::Obj;
use disagg_core::{refmeta, DisaggError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::args::wire_dict_to_py;
use crate::error::{to_pyerr, IntoPyResult};
use crate::layout::PyKvShardLayout;
use crate::wire::to_wire;

/// One record: a peer's metadata dict and the block ids to move from it.
type Record<'py> = (Bound<'py, PyDict>, Vec<u32>);

fn block_ids(v: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u32>> {
    let ids: Vec<i64> = v.extract().map_err(|_| {
        to_pyerr(DisaggError::block(field, format!("{field} must be a sequence of ints, got {v}")))
    })?;
    ids.iter()
        .map(|&b| {
            u32::try_from(b).map_err(|_| {
                to_pyerr(DisaggError::block(field, format!("{field} holds {b}, not in [0, 2**32)")))
            })
        })
        .collect()
}

/// Append one record per metadata dict of `raw` (a dict or a list of dicts).
fn append_metas<'py>(
    raw: &Bound<'py, PyAny>,
    default_blocks: &[u32],
    out: &mut Vec<Record<'py>>,
) -> PyResult<()> {
    let metas: Vec<Bound<'py, PyAny>> = match raw.cast::<PyList>() {
        Ok(list) => list.iter().collect(),
        Err(_) => vec![raw.clone()],
    };
    for meta in metas {
        let dict = meta.cast_into::<PyDict>().map_err(|_| {
            to_pyerr(DisaggError::wire(
                "tp_metas",
                "transfer peer metadata entries must be dictionaries",
            ))
        })?;
        let blocks = match dict.get_item("block_ids")? {
            Some(v) => block_ids(&v, "block_ids")?,
            None => default_blocks.to_vec(),
        };
        out.push((dict, blocks));
    }
    Ok(())
}

/// Normalize flat, TP-wrapped or PP-wrapped peer metadata into `(meta, block_ids)` records,
/// one per source rank. A PP entry's own `block_ids` (or its ranks') override `src_block_ids`.
#[pyfunction]
pub fn transfer_peer_records<'py>(
    peer_meta: &Bound<'py, PyAny>,
    src_block_ids: &Bound<'py, PyAny>,
) -> PyResult<Vec<Record<'py>>> {
    let mut out = Vec::new();
    if let Ok(d) = peer_meta.cast::<PyDict>() {
        if let Some(stages) = d.get_item("pp_metas")? {
            for entry in stages.try_iter()? {
                let entry = entry?;
                let stage = entry.cast::<PyDict>().map_err(|_| {
                    to_pyerr(DisaggError::wire("pp_metas", "pp_metas entries must be dictionaries"))
                })?;
                let raw = stage.get_item("tp_metas")?.unwrap_or_else(|| entry.clone());
                let blocks = match stage.get_item("block_ids")? {
                    Some(v) => block_ids(&v, "block_ids")?,
                    None => Vec::new(),
                };
                append_metas(&raw, &blocks, &mut out)?;
            }
            return Ok(out);
        }
        let blocks = block_ids(src_block_ids, "src_block_ids")?;
        match d.get_item("tp_metas")? {
            Some(ranks) => append_metas(&ranks, &blocks, &mut out)?,
            None => append_metas(peer_meta, &blocks, &mut out)?,
        }
        return Ok(out);
    }
    let blocks = block_ids(src_block_ids, "src_block_ids")?;
    append_metas(peer_meta, &blocks, &mut out)?;
    Ok(out)
}

/// The number of sequence blocks the metadata describes (the first record's; 0 if none).
#[pyfunction]
pub fn transfer_block_count(
    peer_meta: &Bound<'_, PyAny>,
    src_block_ids: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    Ok(transfer_peer_records(peer_meta, src_block_ids)?.first().map_or(0, |(_, b)| b.len()))
}

/// A copy of `value` with the first `prefix` ids of every `block_ids` list removed, recursing
/// through `pp_metas` and `tp_metas`.
fn trim<'py>(value: &Bound<'py, PyAny>, prefix: usize) -> PyResult<Bound<'py, PyAny>> {
    let py = value.py();
    if let Ok(list) = value.cast::<PyList>() {
        let items = list.iter().map(|v| trim(&v, prefix)).collect::<PyResult<Vec<_>>>()?;
        return Ok(PyList::new(py, items)?.into_any());
    }
    let Ok(d) = value.cast::<PyDict>() else {
        return Ok(value.clone());
    };
    let out = d.copy()?;
    if let Some(v) = d.get_item("block_ids")? {
        let ids = block_ids(&v, "block_ids")?;
        let rest = ids.get(prefix..).ok_or_else(|| {
            to_pyerr(DisaggError::block(
                "block_ids",
                format!("cannot remove {prefix} blocks from a {}-block peer", ids.len()),
            ))
        })?;
        out.set_item("block_ids", rest.to_vec())?;
    }
    for key in ["pp_metas", "tp_metas"] {
        if let Some(v) = d.get_item(key)? {
            out.set_item(key, trim(&v, prefix)?)?;
        }
    }
    Ok(out.into_any())
}

/// Remove a cached sequence prefix of `prefix_count` blocks from peer metadata and from
/// `src_block_ids` (the decode reuses its cached prefix and pulls only the suffix). Raises
/// before returning anything if a `block_ids` list is shorter than the prefix; the inputs are
/// never modified.
#[pyfunction]
pub fn drop_transfer_prefix_blocks<'py>(
    peer_meta: &Bound<'py, PyAny>,
    src_block_ids: &Bound<'py, PyAny>,
    prefix_count: i64,
) -> PyResult<(Bound<'py, PyAny>, Vec<u32>)> {
    let prefix = usize::try_from(prefix_count).map_err(|_| {
        to_pyerr(DisaggError::argument(
            "prefix_count",
            format!("prefix_count={prefix_count} must be non-negative"),
        ))
    })?;
    let ids = block_ids(src_block_ids, "src_block_ids")?;
    if prefix == 0 {
        return Ok((peer_meta.clone(), ids));
    }
    // PP-wrapped metadata carries its block ids per stage; `src_block_ids` may then be shorter
    // than the prefix (even empty), and its suffix is simply what remains.
    let rest = ids.get(prefix..).unwrap_or_default().to_vec();
    Ok((trim(peer_meta, prefix)?, rest))
}

/// This library's schema for a peer dict of the reference design's fields only (see
/// `disagg_core::refmeta`), as read by a rank of `backend` holding `state_kind` state of
/// `element_size`-byte `dtype` elements.
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

/// The KV layout of the reference design's nine layout fields of a peer dict.
#[pyfunction]
pub fn kv_layout_from_reference(meta: &Bound<'_, PyAny>) -> PyResult<PyKvShardLayout> {
    let wire = to_wire(meta, "peer_meta")?;
    let inner = refmeta::kv_layout_from_reference(&Obj::of(&wire, "").py()?).py()?;
    Ok(PyKvShardLayout { inner })
}
