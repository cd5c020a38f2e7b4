//! disagg-core: every decision of `disagg_rs`, in pure Rust.
//!
//! Layouts and reshard plans, and (in later modules) the descriptor compiler, the pools and the
//! sans-IO ledgers. Nothing here performs I/O, reads a clock or calls Python: callers pass the
//! time and the events in and carry the returned actions out. All ranges are half-open
//! `[lo, hi)`.
#![forbid(unsafe_code)]

pub mod args;
pub mod backend_rules;
pub mod buffer;
pub mod chunks;
pub mod compile;
pub mod completion_tracker;
pub mod coordinator;
pub mod driver;
pub mod error;
pub mod geometry;
pub mod handoff;
pub mod integrity;
pub mod integrity_tables;
pub mod layout;
pub mod ledger;
pub mod link;
pub mod nixl_route;
pub mod p2p_header;
pub mod packed_items;
pub mod peer_records;
pub mod pool;
pub mod pull_parts;
pub mod refdecode;
pub mod reference;
pub mod refmeta;
pub mod refticket;
pub mod reshard;
pub mod row_pool;
pub mod runs;
pub mod staging;
pub mod stream;
pub mod tags;
pub mod tensor_args;
pub mod wire;

pub use compile::{
    compile_kv_transfer, compile_ssm_transfer, CostModel, KvDevicePlan, KvTokens,
    KvTransferRequest, ListKind, ModeChoice, RegionTable, RowBuf, RowForm, SliceRows,
    SourceProgram, SourceStats, SrcBlockIds, SrcSlots, SsmSlots, SsmTransferRequest, TransferMode,
    TransferProgram, TransferRequest,
};
pub use driver::{
    Action, DriverCounters, EngineDriver, ImportReport, Inbound, MsgKind, PeerIncarnations, Role,
    Verdict,
};
pub use error::{DisaggError, DisaggResult};
pub use geometry::{KvGeometry, KvGeometrySpec, SsmGeometry, SsmStateKind, SsmStatePart};
pub use layout::{
    BandSpan, KvLayoutSpec, KvShardLayout, RankCoords, Span, SsmBand, SsmLayoutSpec,
    SsmShardLayout, SsmStateDims,
};
pub use ledger::{
    CompletionQuorum, FailReason, ImportLedger, ImportLedgerConfig, ImportRequest, LedgerAction,
    PinLedger, QuorumDecision, RankOutcome, ReleaseCause, SourceLease, StartImport,
};
pub use pool::{block_hashes, BlockPool, SlotPool, SlotState, MAX_POOL_BLOCKS, MAX_SSM_SLOTS};
pub use reshard::{
    local_range, plan_kv_reshard, plan_ssm_reshard, KvReshardPlan, KvReshardTransfer,
    SsmReshardPlan, SsmReshardTransfer,
};
pub use staging::{lay_out_ids, pull_ids_len, write_pull_ids, PullIds, StagingRanges};
