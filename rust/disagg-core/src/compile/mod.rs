//! Descriptor compiler: reshard plan x geometries x block lists -> transfer program.
//!
//! A program is compiled for ONE destination rank and covers every source rank that sends to
//! it. For each source rank it says how the bytes move:
//!
//! - **direct**: pairs of byte ranges (source address, destination address, length), where
//!   ranges that are contiguous on both sides are merged, so a matched layout with contiguous
//!   block runs needs one descriptor per (plane, run), not per block;
//! - **staged**: a gather list (source address -> packed offset) that packs the source's bytes
//!   into one contiguous packed region, one large descriptor that moves that region, and a
//!   scatter list (packed offset -> destination address) that unpacks it.
//!
//! **Canonical packed order.** The packed region of one (source rank, destination rank) pair
//! is `[0, packed_bytes)` and is a function of the plan, the source geometry, `num_tokens` and
//! `token_start` only (not of any block id and not of the destination geometry), so a prefill
//! rank can pack before it knows the decode's blocks, and both sides compute identical offsets.
//! The region holds the pair's reshard transfers in plan order; each transfer is a dense array
//! `[kv][layer][token][head][dim]` (or `[kv][layer][head][token][dim]` when the source
//! geometry stores heads outside tokens, HND), over the transfer's layers and heads and the
//! moved token positions `[token_start, num_tokens)`. An SSM region holds the conv pieces,
//! then the recurrent ones, each ordered by source-local layer, then band (x, B, C), then
//! channel; a piece is its dense `[unit][inner]` bytes.
//!
//! Block-size mismatch: source and destination may use different `tokens_per_block`; the
//! compiler maps token positions, cutting at every block boundary of either side, including a
//! partial tail block. All ranges are half-open `[lo, hi)`.
//!
//! Address arithmetic: geometry constructors check that every addressable byte fits `u64`,
//! block ids are checked against `num_blocks`, token offsets against `tokens_per_block` and
//! packed sizes with checked arithmetic here, so the expansion loops cannot overflow.

mod cost;
mod kv;
mod program;
mod regions;
mod request;
pub mod route;
mod sink;
mod ssm;
mod verify;
mod walk;

pub use cost::{CostModel, ModeChoice, TransferMode};
pub use kv::{compile_kv_transfer, compile_kv_transfer_checked, KvDevicePlan};
pub use program::{Rows, SourceProgram, SourceStats, TransferProgram};
pub use regions::{RegionTable, RowForm};
pub use request::{
    KvTokens, KvTransferRequest, PerSource, SrcBlockIds, SrcSlots, SsmSlots, SsmTransferRequest,
    TransferRequest,
};
pub use sink::{ListKind, RowBuf, SliceRows};
pub use ssm::compile_ssm_transfer;
