//! Bindings of `StagingRanges`, `PullParts` and `write_pull_ids` (one pull's block ids checked
//! and laid out in a device id slot).

use std::collections::HashMap;
use std::sync::Mutex;

use disagg_core::pull_parts::{Outcome, PullParts, Queries, Releases};
use disagg_core::wire::peer::SourceIds;
use disagg_core::StagingRanges;
use numpy::{PyArray1, PyArrayMethods, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyMapping};

use crate::args::{conv, convs, Int, IntList, Kind, Opt, Raw, U32, U64};
use crate::error::IntoPyResult;
use crate::pool::{core_methods, lock_with, outs};
use crate::wire::{metas, BlockI64, PyPeer};

/// `disagg_core::StagingRanges`: first-fit pool of aligned byte ranges of a staging region.
#[pyclass(name = "StagingRanges", module = "disagg_rs", frozen)]
pub struct PyStagingRanges {
    inner: Mutex<StagingRanges>,
}

core_methods!(PyStagingRanges, lock_with, inner,
ctors {
    #[new]
    #[pyo3(signature = (capacity, alignment = Int::of(256)), text_signature = "(capacity, alignment=256)")]
    fn new(capacity: U64, alignment: U64) = StagingRanges::new(capacity, alignment).py()?.into();
}
calls {
    #[getter] fn capacity() -> u64 = capacity();
    #[getter] fn alignment() -> u64 = alignment();
    #[getter] fn in_use() -> u64 = in_use();
    #[getter] fn largest_free() -> u64 = largest_free();
    /// Reserve `size` bytes; `CapacityError` (field `staging_bytes`) when no free range holds them.
    fn alloc(size: U64) -> u64 = alloc(size);
    fn alloc_slots(item_bytes: U64, share: U64, max_slots: U64) -> Option<(u64, Vec<u64>)>
        = alloc_slots(item_bytes, share, max_slots);
    fn free(offset: U64) -> bool = free(offset);
    fn free_all(offsets: Raw<Vec<u64>>) -> () = free_all(&offsets);
    fn ranges() -> Vec<(u64, u64)> = ranges();
    /// `StagingRanges::alloc_stream` for a peer whose metadata's `staging` is `peer_staging`.
    #[pyo3(signature = (item_bytes, peer_staging, sources, share, max_slots))]
    fn alloc_stream(item_bytes: Raw<Option<u64>>, peer_staging: PeerPool, sources: Raw<u64>,
        share: Raw<u64>, max_slots: Raw<u64>) -> Option<(u64, Vec<u64>)>
        = alloc_stream(item_bytes, peer_staging, sources, share, max_slots);
    fn __len__() -> usize = len();
    fn __repr__() -> String = to_string();
}
methods {});

/// Block ids of one side: a list of ints or an `int64` array read directly, else an [`IntList`].
fn ids_of(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<i64>> {
    if let Ok(arr) = obj.cast::<PyArray1<i64>>() {
        if let Ok(view) = arr.try_readonly() {
            if let Ok(ids) = view.as_slice() {
                return Ok(ids.to_vec());
            }
        }
    } else if let Ok(list) = obj.cast::<PyList>() {
        let mut ids = Vec::with_capacity(list.len());
        for x in list.iter() {
            match x.cast_exact::<PyInt>().ok().and_then(|i| i.extract::<i64>().ok()) {
                Some(v) => ids.push(v),
                None => return obj.extract::<IntList>()?.to_i64s(Kind::Block, field),
            }
        }
        return Ok(ids);
    }
    obj.extract::<IntList>()?.to_i64s(Kind::Block, field)
}

/// Source ids: one shared list or array, or a mapping of global rank to ids.
pub(crate) fn source_ids_of(obj: &Bound<'_, PyAny>) -> PyResult<SourceIds> {
    if let Ok(m) = obj.cast::<PyMapping>() {
        let mut out = Vec::new();
        for item in m.items()?.iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let rank = k.extract::<Int>()?.to_i64(Kind::Block, "src_block_ids (dict key)")?;
            out.push((rank, ids_of(&v, "src_block_ids")?));
        }
        return Ok(SourceIds::PerRank(out));
    }
    Ok(SourceIds::Shared(ids_of(obj, "src_block_ids")?))
}

/// `disagg_core::pull_ids_len` of `ids` (with `rank`: the source ids of source `rank`).
#[pyfunction]
#[pyo3(signature = (ids, sources, rank=None))]
pub fn pull_ids_len(ids: &Bound<'_, PyAny>, sources: usize, rank: Option<i64>) -> PyResult<usize> {
    let n = match (rank, ids.len()) {
        (Some(r), _) => source_ids_of(ids)?.rank_len(r),
        (None, Ok(n)) => n,
        (None, Err(_)) => ids_of(ids, "dst_block_ids")?.len(),
    };
    Ok(disagg_core::pull_ids_len(n, sources))
}

/// `disagg_core::write_pull_ids` into `out` (a 1-D `int64` array): `(num_tokens, num_blocks,
/// stride, written)`, or `None` when the ids do not fit the slot layout. `ValueError` for an
/// `out` that is not contiguous.
#[pyfunction]
#[pyo3(signature = (out, srcs, ranks, src_block_ids, dst_block_ids, num_tokens, *,
    local_num_blocks, local_tokens_per_block, tokens_per_block, checked=false))]
pub fn write_pull_ids(
    mut out: PyReadwriteArray1<'_, i64>,
    srcs: Vec<PyRef<'_, PyPeer>>,
    ranks: Vec<u32>,
    src_block_ids: &Bound<'_, PyAny>,
    dst_block_ids: Option<&Bound<'_, PyAny>>,
    num_tokens: Option<Int>,
    local_num_blocks: Int,
    local_tokens_per_block: Option<Int>,
    tokens_per_block: Int,
    checked: bool,
) -> PyResult<Option<(u64, usize, usize, usize)>> {
    let src = source_ids_of(src_block_ids)?;
    let dst = dst_block_ids.map(|d| ids_of(d, "dst_block_ids")).transpose()?;
    let local = crate::wire::local_side(dst.is_some(), local_num_blocks, local_tokens_per_block)?;
    conv!(tokens_per_block: U32, num_tokens: Opt<BlockI64>);
    let slot = out.as_slice_mut().map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!("out is not contiguous: {e}"))
    })?;
    let (peers, dst) = (metas(&srcs), dst.as_deref());
    let got = disagg_core::write_pull_ids(
        checked,
        &peers,
        &ranks,
        &src,
        dst,
        num_tokens,
        local,
        tokens_per_block,
        slot,
    )
    .py()?;
    Ok(got.map(|g| (g.num_tokens, g.num_blocks, g.stride, g.len)))
}

convs! {
    /// The `nbytes` of a peer's `staging` pool, if it states one.
    PeerPool: Option<HashMap<String, u64>> => Option<u64>
        = |_f, v| Ok(v.and_then(|m| m.get("nbytes").copied()));
    /// Outcomes from Python: `(True, value)` or `(False, repr of the exception)` each.
    Outcomes: Vec<(bool, String)> => Vec<Outcome>
        = |_f, v| Ok(v.into_iter().map(|(ok, s)| if ok { Ok(s) } else { Err(s) }).collect());
}

/// `(abort, drop, finish)` part indices of a release.
type PyReleases = (Vec<usize>, Vec<usize>, Vec<usize>);

outs! {
    Releases => PyReleases = |r| (r.abort, r.drop, r.finish);
    (Releases, bool) => (PyReleases, bool) = |v| (v.0.out()?, v.1);
    Queries => (Vec<usize>, Vec<usize>, Vec<usize>) = |q| (q.landed, q.step, q.xfer);
}

/// `disagg_core::pull_parts::PullParts`: the progress of one pull's parts.
#[pyclass(name = "PullParts", module = "disagg_rs", frozen)]
pub struct PyPullParts {
    inner: Mutex<PullParts>,
}

core_methods!(PyPullParts, lock_with, inner,
ctors {
    /// Parts `(drives itself, local copy, has a handle, has on_done, label)`.
    #[new]
    #[pyo3(signature = (parts, error=None))]
    fn new(parts: Raw<Vec<(bool, bool, bool, bool, String)>>, error: Raw<Option<String>>)
        = PullParts::new(parts, error).into();
}
calls {
    #[getter] fn error() -> Option<String> = error().map(str::to_owned);
    fn begin() -> (Vec<usize>, Vec<usize>, Vec<usize>) = begin();
    fn observe(landed: Raw<Vec<bool>>, steps: Outcomes, xfers: Outcomes) -> Vec<usize>
        = observe(&landed, &steps, &xfers);
    fn after_on_done(asked: Raw<Vec<usize>>, done: Outcomes) -> Vec<usize>
        = after_on_done(&asked, &done);
    /// `PullParts::settle` of the landings, past `deadline` when `now > deadline`.
    #[pyo3(signature = (landed, now=0.0, deadline=f64::INFINITY))]
    fn settle(landed: Raw<Vec<bool>>, now: Raw<f64>, deadline: Raw<f64>)
        -> (PyReleases, bool) = settle(&landed, now > deadline);
    fn cancel() -> PyReleases = cancel();
}
methods {});
