//! Python class `StagingRanges`: the byte-range pool of a transport's staging region.

use std::sync::Mutex;

use disagg_core::StagingRanges;
use pyo3::prelude::*;

use crate::args::{Int, Kind};
use crate::error::IntoPyResult;
use crate::pool::lock;

/// First-fit pool of aligned byte ranges `[offset, offset + size)` in a staging region.
#[pyclass(name = "StagingRanges", module = "disagg_rs", frozen)]
pub struct PyStagingRanges {
    inner: Mutex<StagingRanges>,
}

#[pymethods]
impl PyStagingRanges {
    #[new]
    #[pyo3(signature = (capacity, alignment = Int::from(256_i64)), text_signature = "(capacity, alignment=256)")]
    fn new(capacity: Int, alignment: Int) -> PyResult<Self> {
        let capacity = capacity.to_u64(Kind::Argument, "capacity")?;
        let alignment = alignment.to_u64(Kind::Argument, "alignment")?;
        Ok(Self { inner: Mutex::new(StagingRanges::new(capacity, alignment).py()?) })
    }
    /// Bytes of the region.
    #[getter]
    fn capacity(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.capacity())
    }
    /// Start alignment of every range.
    #[getter]
    fn alignment(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.alignment())
    }
    /// Bytes reserved now (sizes rounded up to the alignment).
    #[getter]
    fn in_use(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.in_use())
    }
    /// The largest free range.
    #[getter]
    fn largest_free(&self) -> PyResult<u64> {
        Ok(lock(&self.inner)?.largest_free())
    }
    /// Reserve `size` bytes; return the offset. `CapacityError` (field `staging_bytes`) when
    /// no free range holds them.
    fn alloc(&self, size: Int) -> PyResult<u64> {
        let size = size.to_u64(Kind::Argument, "size")?;
        lock(&self.inner)?.alloc(size).py()
    }
    /// Slots for a chunked transfer: at most `max_slots` equal ranges of the largest free
    /// range's `1 / share`, each aligned and at least `item_bytes`, two at least. Returns
    /// `(slot_bytes, offsets)`, or `None` (nothing reserved) when two do not fit.
    fn alloc_slots(
        &self,
        item_bytes: Int,
        share: Int,
        max_slots: Int,
    ) -> PyResult<Option<(u64, Vec<u64>)>> {
        let item = item_bytes.to_u64(Kind::Argument, "item_bytes")?;
        let share = share.to_u64(Kind::Argument, "share")?;
        let max_slots = max_slots.to_u64(Kind::Argument, "max_slots")?;
        Ok(lock(&self.inner)?.alloc_slots(item, share, max_slots))
    }
    /// Return the range at `offset`; `False` when none starts there (idempotent release).
    fn free(&self, offset: Int) -> PyResult<bool> {
        let offset = offset.to_u64(Kind::Argument, "offset")?;
        Ok(lock(&self.inner)?.free(offset))
    }
    /// The reserved ranges `(offset, size)` in address order.
    fn ranges(&self) -> PyResult<Vec<(u64, u64)>> {
        Ok(lock(&self.inner)?.ranges())
    }
    fn __len__(&self) -> PyResult<usize> {
        Ok(lock(&self.inner)?.len())
    }
    fn __repr__(&self) -> PyResult<String> {
        let p = lock(&self.inner)?;
        Ok(format!(
            "StagingRanges(capacity={}, alignment={}, in_use={}, ranges={})",
            p.capacity(),
            p.alignment(),
            p.in_use(),
            p.len()
        ))
    }
}
