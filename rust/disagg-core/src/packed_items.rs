//! The packed order of a device plan's items, and where one launch puts them.
//!
//! A packed copy of `n_tok` tokens whose plane rows are `rows` (`(packed coefficient, row
//! bytes per token)`: plane `p` starts at `coefficient * n_tok`) is cut into *items*: item
//! `k` is plane `k / n_blk`, block index `k % n_blk`, `n_blk = ceil(n_tok / tokens_per_block)`,
//! in packed order, so a range of items is a contiguous range of the packed copy.
//!
//! The block-copy kernel packs one item range per launch into a window at some byte offset,
//! or up to [`MAX_PARTS`] consecutive item ranges at their own offsets (the first chunks of a
//! stream, each into its staging slot): [`PackedItems::launch`] checks them and gives the
//! launch's item range, bytes and per-range biases.

use crate::error::{DisaggError, DisaggResult};

/// Item ranges one launch places at their own offsets (the kernel has two cuts).
pub const MAX_PARTS: usize = 3;

/// Alignment (bytes) of a packed window's offset.
pub const OFFSET_ALIGN: u64 = 16;

fn overflow(what: &str) -> DisaggError {
    DisaggError::AddressOverflow { detail: format!("packed copy: {what} exceeds u64") }
}

/// The items of one packed copy.
#[derive(Debug, Clone, Copy)]
pub struct PackedItems<'a> {
    rows: &'a [(u64, u64)],
    tokens_per_block: u64,
    n_tok: u64,
    n_blk: u64,
    total: u64,
    packed: u64,
}

/// One side of a copy by plan, as its checks see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopySide {
    /// The packed region, of which the side's buffer holds bytes `[bias, bias + nbytes)`.
    Packed {
        /// First packed byte the buffer holds.
        bias: u64,
        /// Bytes the buffer holds.
        nbytes: u64,
    },
    /// A paged cache (`"src"` or `"dst"`) read through `ids` block ids (`None`: none given),
    /// id set `j` at `j * set_stride`.
    Paged {
        /// `"src"` or `"dst"`, for the message.
        kind: &'static str,
        /// Block ids given.
        ids: Option<u64>,
        /// Offset between id sets (0: every set reads the same ids).
        set_stride: u64,
    },
}

/// Whether `ids` block ids hold `sets` id sets of `n_blk` ids at stride `stride` (0: every
/// set reads the same ids; else the sets must not overlap).
fn ids_hold(ids: u64, stride: u64, sets: u64, n_blk: u64) -> bool {
    let need = sets.saturating_sub(1).saturating_mul(stride).saturating_add(n_blk);
    ids >= need && !(sets > 1 && 0 < stride && stride < n_blk)
}

/// One launch: items `[k_lo, k_hi)`, `nbytes` packed bytes, and the kernel's destination
/// placement in `unit`-byte units: `[bias0, cut1, bias1, cut2, bias2]` (items from `cut1`
/// on use `bias1`, from `cut2` on `bias2`; an absent range's cut is `k_hi`, its bias 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// First item of the launch.
    pub k_lo: u64,
    /// One past its last item.
    pub k_hi: u64,
    /// Packed bytes it copies.
    pub nbytes: u64,
    /// `[bias0, cut1, bias1, cut2, bias2]`, see above.
    pub placement: [i64; 5],
}

impl<'a> PackedItems<'a> {
    /// The items of `n_tok` tokens over `rows`.
    ///
    /// # Errors
    /// `Argument` for `tokens_per_block = 0`; `AddressOverflow` when a size exceeds `u64`.
    pub fn new(rows: &'a [(u64, u64)], tokens_per_block: u64, n_tok: u64) -> DisaggResult<Self> {
        if tokens_per_block == 0 {
            return Err(DisaggError::argument("tokens_per_block", "tokens_per_block=0"));
        }
        let n_blk = n_tok.div_ceil(tokens_per_block);
        let total = (rows.len() as u64).checked_mul(n_blk).ok_or_else(|| overflow("item count"))?;
        let row_sum = rows.iter().try_fold(0u64, |a, r| a.checked_add(r.1));
        let packed =
            row_sum.and_then(|s| s.checked_mul(n_tok)).ok_or_else(|| overflow("packed bytes"))?;
        Ok(Self { rows, tokens_per_block, n_tok, n_blk, total, packed })
    }

    /// Items in all.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes of the whole packed copy.
    #[must_use]
    pub fn packed_bytes(&self) -> u64 {
        self.packed
    }

    /// Bytes of the largest item (one block of the widest plane row).
    ///
    /// # Errors
    /// `AddressOverflow` when it exceeds `u64`.
    pub fn item_bytes(&self) -> DisaggResult<u64> {
        let row_max = self.rows.iter().map(|r| r.1).max().unwrap_or(0);
        row_max.checked_mul(self.tokens_per_block).ok_or_else(|| overflow("item bytes"))
    }

    /// Packed byte offset where item `k` starts (`k >= total`: the end of the copy).
    ///
    /// # Errors
    /// `AddressOverflow` when it exceeds `u64`.
    pub fn offset(&self, k: u64) -> DisaggResult<u64> {
        if k >= self.total {
            return Ok(self.packed);
        }
        let plane = usize::try_from(k / self.n_blk).map_err(|_| overflow("plane"))?;
        let (coef, row) = self.rows[plane];
        let tok = ((k % self.n_blk) * self.tokens_per_block).min(self.n_tok);
        coef.checked_mul(self.n_tok)
            .zip(tok.checked_mul(row))
            .and_then(|(a, b)| a.checked_add(b))
            .ok_or_else(|| overflow("packed offset"))
    }

    /// `[k_lo, k_hi, byte_lo, byte_hi]` of runs of whole items of at most `max_bytes` (one
    /// item at least), covering every item once in order.
    ///
    /// # Errors
    /// `AddressOverflow` when an offset exceeds `u64`.
    pub fn chunks(&self, max_bytes: u64) -> DisaggResult<Vec<[u64; 4]>> {
        let per = (max_bytes / self.item_bytes()?.max(1)).max(1);
        let mut out = Vec::with_capacity(usize::try_from(self.total.div_ceil(per)).unwrap_or(0));
        let mut k = 0;
        while k < self.total {
            let end = k.saturating_add(per).min(self.total);
            out.push([k, end, self.offset(k)?, self.offset(end)?]);
            k = end;
        }
        Ok(out)
    }

    /// Check the block ids a launch reads: `a_ids` ids on the paged source, id set `j` at
    /// `j * a_set` of them (`sets` sets; a stride of 0 reads the same ids for every set,
    /// else the sets must not overlap), and `b_ids` on a paged destination (`None`: packed).
    ///
    /// # Errors
    /// `Argument` (field `block_ids`) naming the counts.
    pub fn check_ids(
        &self,
        a_ids: u64,
        a_set: u64,
        sets: u64,
        b_ids: Option<u64>,
    ) -> DisaggResult<()> {
        let n_blk = self.n_blk;
        if !ids_hold(a_ids, a_set, sets, n_blk) || b_ids.is_some_and(|b| b < n_blk) {
            let b = b_ids.map_or_else(|| "no".to_string(), |b| b.to_string());
            return Err(DisaggError::argument(
                "block_ids",
                format!("{a_ids} / {b} block ids (set stride {a_set}) for {sets} id sets of {n_blk} blocks"),
            ));
        }
        Ok(())
    }

    /// Check a copy of items `items` (`None`: all) from side `a` to side `b` of a plan with
    /// `sets` id sets (`paged_only`: a merged plan, whose packed coefficients overlap);
    /// `(k_lo, k_hi, byte_lo, byte_hi)` of the copy.
    ///
    /// # Errors
    /// `Argument` naming the field: items outside the copy (`items`), a packed side of a
    /// merged plan or a window that does not hold the items' bytes (`packed`), a paged side
    /// without ids or with too few (`block_ids`).
    pub fn check_copy(
        &self,
        items: Option<(u64, u64)>,
        sides: [CopySide; 2],
        sets: u64,
        paged_only: bool,
    ) -> DisaggResult<[u64; 4]> {
        let (k_lo, k_hi) = items.unwrap_or((0, self.total));
        if k_lo > k_hi || k_hi > self.total {
            return Err(DisaggError::argument(
                "items",
                format!("items [{k_lo}, {k_hi}) are not inside [0, {})", self.total),
            ));
        }
        let (lo, hi) = (self.offset(k_lo)?, self.offset(k_hi)?);
        for side in sides {
            match side {
                CopySide::Packed { .. } if paged_only => {
                    return Err(DisaggError::argument(
                        "packed",
                        "a merged plan copies between paged sides only",
                    ));
                }
                CopySide::Packed { bias, nbytes } if lo < bias || hi - bias > nbytes => {
                    return Err(DisaggError::argument(
                        "packed",
                        format!(
                            "packed side: items [{k_lo}, {k_hi}) cover packed bytes [{lo}, {hi}) but the window holds [{bias}, {})",
                            bias.saturating_add(nbytes)
                        ),
                    ));
                }
                CopySide::Paged { kind, ids: None, .. } => {
                    return Err(DisaggError::argument(
                        "block_ids",
                        format!("{kind} side needs block ids"),
                    ));
                }
                CopySide::Paged { kind, ids: Some(n), set_stride }
                    if !ids_hold(n, set_stride, sets, self.n_blk) =>
                {
                    return Err(DisaggError::argument(
                        "block_ids",
                        format!(
                            "{kind} side: {n} block ids (set stride {set_stride}) for {sets} id sets of {} blocks",
                            self.n_blk
                        ),
                    ));
                }
                _ => {}
            }
        }
        Ok([k_lo, k_hi, lo, hi])
    }

    /// Check one launch of `parts` — `(byte offset, first item, end item)` each, consecutive
    /// item ranges — into a packed window of `window` bytes (`None`: a paged destination,
    /// which takes one range at offset 0), with kernel units of `unit` bytes.
    ///
    /// # Errors
    /// `Argument` naming the field: `unit` not a power of two up to 16, no range or more than
    /// [`MAX_PARTS`], an item range outside the copy or not following the previous one, an
    /// offset not a multiple of 16 or not a multiple of the unit away from its bytes, a range
    /// past the window; `AddressOverflow` for sizes beyond `u64`/`i64`.
    pub fn launch(
        &self,
        parts: &[(u64, u64, u64)],
        window: Option<u64>,
        unit: u64,
    ) -> DisaggResult<Launch> {
        if !unit.is_power_of_two() || unit > 16 {
            return Err(DisaggError::argument(
                "unit",
                format!("unit={unit}: a power of two <= 16"),
            ));
        }
        let max = if window.is_some() { MAX_PARTS } else { 1 };
        if parts.is_empty() || parts.len() > max {
            return Err(DisaggError::argument(
                "parts",
                format!("{} item ranges for one launch: 1 to {max}", parts.len()),
            ));
        }
        let (off0, k_lo, _) = parts[0];
        let mut placement = [0i64, 0, 0, 0, 0];
        let mut prev = k_lo;
        let mut nbytes = 0u64;
        for (j, &(offset, lo, hi)) in parts.iter().enumerate() {
            if lo > hi || hi > self.total {
                return Err(DisaggError::argument(
                    "items",
                    format!("items [{lo}, {hi}) are not inside [0, {})", self.total),
                ));
            }
            if lo != prev {
                return Err(DisaggError::argument(
                    "items",
                    format!(
                        "item range {j} starts at {lo}, not at {prev} where range {} ends",
                        j.max(1) - 1
                    ),
                ));
            }
            let (b_lo, b_hi) = (self.offset(lo)?, self.offset(hi)?);
            let size = b_hi - b_lo;
            let fits = window.is_none_or(|w| offset.checked_add(size).is_some_and(|end| end <= w));
            let aligned = match window {
                Some(_) => offset % OFFSET_ALIGN == 0,
                None => offset == 0,
            };
            if !fits || !aligned {
                let w = window.map_or_else(
                    || "a paged destination (offset 0)".to_string(),
                    |w| w.to_string(),
                );
                return Err(DisaggError::argument(
                    "b_offset",
                    format!("items [{lo}, {hi}): {size} packed bytes at {offset} of {w} (offsets are multiples of {OFFSET_ALIGN})"),
                ));
            }
            // Where byte `x` of this range lands, relative to the first range's offset:
            // `off0 + x - bias` with `bias = b_lo - (offset - off0)`.
            let bias = i128::from(b_lo) - i128::from(offset) + i128::from(off0);
            let unit_i = i128::from(unit);
            if bias % unit_i != 0 {
                return Err(DisaggError::argument(
                    "b_offset",
                    format!("items [{lo}, {hi}) at {offset}: not a multiple of unit={unit} away from packed byte {b_lo}"),
                ));
            }
            let bias = i64::try_from(bias / unit_i).map_err(|_| overflow("bias"))?;
            let cut = i64::try_from(lo).map_err(|_| overflow("item"))?;
            if j == 0 {
                placement[0] = bias;
            } else {
                placement[2 * j - 1] = cut;
                placement[2 * j] = bias;
            }
            nbytes += size;
            prev = hi;
        }
        let k_hi = prev;
        let end = i64::try_from(k_hi).map_err(|_| overflow("item"))?;
        for j in parts.len()..MAX_PARTS {
            placement[2 * j - 1] = end;
        }
        Ok(Launch { k_lo, k_hi, nbytes, placement })
    }
}

impl PackedItems<'_> {
    /// [`Self::check_ids`] then [`Self::launch`]: `ids` is `[source ids, source set stride,
    /// id sets, destination ids]`; a packed window (`window` given) reads no destination ids,
    /// so its count is not looked at.
    ///
    /// # Errors
    /// Those of [`Self::check_ids`] and [`Self::launch`].
    pub fn checked_launch(
        &self,
        parts: &[(u64, u64, u64)],
        window: Option<u64>,
        unit: u64,
        ids: [u64; 4],
    ) -> DisaggResult<Launch> {
        self.check_ids(ids[0], ids[1], ids[2], window.is_none().then_some(ids[3]))?;
        self.launch(parts, window, unit)
    }
}

/// Which buffer a side of a copy is: a paged cache (source or destination) or the packed
/// region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SideKind {
    /// The source's paged cache.
    Src,
    /// The destination's paged cache.
    Dst,
    /// The packed region (or a window of it).
    Packed,
}

impl SideKind {
    /// `"src"`, `"dst"` or `"packed"`.
    ///
    /// # Errors
    /// `Argument` (field `kind`) for any other name.
    pub fn parse(name: &str) -> DisaggResult<Self> {
        match name {
            "src" => Ok(Self::Src),
            "dst" => Ok(Self::Dst),
            "packed" => Ok(Self::Packed),
            other => Err(DisaggError::argument(
                "kind",
                format!("side kind {other:?}: one of \"src\", \"dst\", \"packed\""),
            )),
        }
    }

    /// The name [`Self::parse`] takes.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Src => "src",
            Self::Dst => "dst",
            Self::Packed => "packed",
        }
    }
}

/// How the block-copy kernel addresses one side: the plane column it reads (0 source, 1
/// destination, 2 packed coefficient), block and token strides in bytes (0 for the packed
/// region), and whether the side is the packed region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideArgs {
    /// Plane column.
    pub col: u64,
    /// Bytes between blocks.
    pub block_stride: u64,
    /// Bytes between tokens.
    pub token_stride: u64,
    /// Whether the side is the packed region.
    pub packed: bool,
}

/// Both sides of one kernel launch and its unit (bytes per kernel lane element).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSides {
    /// Largest power of two <= 16 dividing every offset, stride, row and address.
    pub unit: u64,
    /// The side read.
    pub a: SideArgs,
    /// The side written.
    pub b: SideArgs,
}

/// One side of a copy by plan as its caller gives it: its kind, its block ids (`None`: none
/// given), the bytes its buffer holds, the first packed byte its buffer holds (a packed
/// window), the offset between id sets (a paged side) and its buffer's address. What the
/// kind does not use is ignored by the checks; the unit covers both biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySpec {
    /// Which buffer.
    pub kind: SideKind,
    /// Block ids given.
    pub ids: Option<u64>,
    /// Bytes of the side's buffer.
    pub nbytes: u64,
    /// First packed byte of a packed window.
    pub bias: u64,
    /// Offset between id sets of a paged side.
    pub set_stride: u64,
    /// Address of the side's buffer.
    pub addr: u64,
}

impl CopySpec {
    /// The side as [`PackedItems::check_copy`] checks it.
    #[must_use]
    pub fn side(&self) -> CopySide {
        match self.kind {
            SideKind::Packed => CopySide::Packed { bias: self.bias, nbytes: self.nbytes },
            kind => {
                CopySide::Paged { kind: kind.name(), ids: self.ids, set_stride: self.set_stride }
            }
        }
    }
}

/// A device plan's table: plane rows `[src offset, dst offset, packed coefficient, row
/// bytes]` (offsets relative to the two buffers' bases), its block size and the strides
/// `[src block, src token, dst block, dst token]` in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaneTable {
    offsets: Vec<[i64; 2]>,
    rows: Vec<(u64, u64)>,
    tokens_per_block: u64,
    strides: [u64; 4],
}

impl PlaneTable {
    /// The table of `planes`.
    ///
    /// # Errors
    /// `Argument`: `tokens_per_block = 0` (field `tokens_per_block`), a negative packed
    /// coefficient or row size (field `planes`).
    pub fn new(
        planes: &[[i64; 4]],
        tokens_per_block: u64,
        strides: [u64; 4],
    ) -> DisaggResult<Self> {
        let rows = planes
            .iter()
            .enumerate()
            .map(|(p, r)| match (u64::try_from(r[2]), u64::try_from(r[3])) {
                (Ok(coef), Ok(row)) => Ok((coef, row)),
                _ => Err(DisaggError::argument(
                    "planes",
                    format!(
                        "plane row {p}: packed coefficient {} and row bytes {} must be >= 0",
                        r[2], r[3]
                    ),
                )),
            })
            .collect::<DisaggResult<Vec<_>>>()?;
        PackedItems::new(&rows, tokens_per_block, 0)?;
        let offsets = planes.iter().map(|r| [r[0], r[1]]).collect();
        Ok(Self { offsets, rows, tokens_per_block, strides })
    }

    /// `(packed coefficient, row bytes per token)` of every plane row.
    #[must_use]
    pub fn rows(&self) -> &[(u64, u64)] {
        &self.rows
    }

    /// Tokens per block of the plan.
    #[must_use]
    pub fn tokens_per_block(&self) -> u64 {
        self.tokens_per_block
    }

    /// The items of an `n_tok`-token copy.
    ///
    /// # Errors
    /// Those of [`PackedItems::new`].
    pub fn items(&self, n_tok: u64) -> DisaggResult<PackedItems<'_>> {
        PackedItems::new(&self.rows, self.tokens_per_block, n_tok)
    }

    /// Largest power of two <= 16 dividing every plane offset and row size, every stride and
    /// every one of `addresses` (buffer addresses, packed biases).
    #[must_use]
    pub fn unit(&self, addresses: &[u64]) -> u64 {
        let planes = self
            .offsets
            .iter()
            .zip(&self.rows)
            .flat_map(|(o, r)| [i128::from(o[0]), i128::from(o[1]), i128::from(r.1)]);
        let rest = self.strides.iter().chain(addresses).map(|&v| i128::from(v));
        let bits = planes.chain(rest).fold(16i128, |acc, v| acc | v);
        u64::try_from(bits & -bits).unwrap_or(1)
    }

    /// How the kernel addresses a side of kind `kind`.
    #[must_use]
    pub fn side(&self, kind: SideKind) -> SideArgs {
        let [sb, st, db, dt] = self.strides;
        let (col, block_stride, token_stride) = match kind {
            SideKind::Src => (0, sb, st),
            SideKind::Dst => (1, db, dt),
            SideKind::Packed => (2, 0, 0),
        };
        SideArgs { col, block_stride, token_stride, packed: kind == SideKind::Packed }
    }

    /// Both sides of a launch from `a` to `b`, its unit taken over `addresses`.
    #[must_use]
    pub fn sides(&self, a: SideKind, b: SideKind, addresses: &[u64]) -> KernelSides {
        KernelSides { unit: self.unit(addresses), a: self.side(a), b: self.side(b) }
    }

    /// A copy prepared once from a paged buffer `a` (at `a_addr`) into `b` (at `b_addr`,
    /// `b_bytes` bytes): its sides, and the window its packs write (`b` packed: its bytes;
    /// a paged `b`: none).
    ///
    /// # Errors
    /// `Argument` (field `a`) when `a` is the packed region.
    pub fn prepare(
        &self,
        a: SideKind,
        b: SideKind,
        a_addr: u64,
        b_addr: u64,
        b_bytes: u64,
    ) -> DisaggResult<(KernelSides, Option<u64>)> {
        if a == SideKind::Packed {
            return Err(DisaggError::argument(
                "a",
                "a prepared copy reads a paged buffer, not the packed region",
            ));
        }
        let window = (b == SideKind::Packed).then_some(b_bytes);
        Ok((self.sides(a, b, &[a_addr, b_addr]), window))
    }

    /// Check a copy of items `items` (`None`: all) of an `n_tok`-token handoff from `a` to
    /// `b` ([`PackedItems::check_copy`]); its `[k_lo, k_hi, byte_lo, byte_hi]` and the
    /// sides of its launch (unit over both buffers' addresses and biases).
    ///
    /// # Errors
    /// Those of [`PackedItems::check_copy`].
    pub fn check_copy(
        &self,
        n_tok: u64,
        items: Option<(u64, u64)>,
        a: &CopySpec,
        b: &CopySpec,
        sets: u64,
        paged_only: bool,
    ) -> DisaggResult<([u64; 4], KernelSides)> {
        let span = self.items(n_tok)?.check_copy(items, [a.side(), b.side()], sets, paged_only)?;
        Ok((span, self.sides(a.kind, b.kind, &[a.addr, b.addr, a.bias, b.bias])))
    }

    /// One past the last byte a paged side of kind `kind` can touch with block ids below
    /// `num_blocks`, relative to its buffer's base.
    ///
    /// # Errors
    /// `Argument`: the packed region (field `kind`), a table without plane rows (field
    /// `planes`); `AddressOverflow` beyond `i64`.
    pub fn paged_end(&self, kind: SideKind, num_blocks: u64) -> DisaggResult<i64> {
        let s = self.side(kind);
        if s.packed {
            return Err(DisaggError::argument("kind", "the packed region has no paged end"));
        }
        let col = usize::try_from(s.col).map_err(|_| overflow("column"))?;
        let last = i128::from(num_blocks) - 1;
        let tok = i128::from(self.tokens_per_block) - 1;
        let end = self
            .offsets
            .iter()
            .zip(&self.rows)
            .map(|(o, r)| {
                i128::from(o[col])
                    + last * i128::from(s.block_stride)
                    + tok * i128::from(s.token_stride)
                    + i128::from(r.1)
            })
            .max()
            .ok_or_else(|| DisaggError::argument("planes", "a plan without plane rows"))?;
        i64::try_from(end).map_err(|_| overflow("paged end"))
    }
}

#[cfg(test)]
#[path = "packed_items_tests.rs"]
mod tests;
