//! Sans-IO handoff ledgers: events in, actions out, time supplied by the caller.
//!
//! [`ImportLedger`] runs the decode side (docs/architecture.md §5): DEFERRED -> IMPORTING -> READY ->
//! ADMITTED, with FAILED handoffs either released at once (destinations provably quiet) or
//! QUARANTINED until their handle settles or a drain horizon passes. [`PinLedger`] runs the
//! prefill side: blocks and the SSM slot of a finished handoff stay pinned until `RELEASE_KV` or
//! lease expiry. [`CompletionQuorum`] makes model-parallel ranks agree on one outcome.
//!
//! Time is an opaque `u64` chosen by the caller (nanoseconds of a monotonic clock in the
//! drivers, a virtual counter in tests); nothing here reads a clock.

/// The pool accessors both ledgers offer over their `pool` and `slots` fields; `$pool_mut`
/// documents `pool_mut` (what the engine may use it for).
macro_rules! pool_accessors {
    ($pool_mut:literal) => {
        /// The block pool (read-only).
        pub fn pool(&self) -> &BlockPool {
            &self.pool
        }

        #[doc = $pool_mut]
        pub fn pool_mut(&mut self) -> &mut BlockPool {
            &mut self.pool
        }

        /// The SSM slot pool (read-only).
        pub fn slots(&self) -> &SlotPool {
            &self.slots
        }

        /// The SSM slot pool, for the engine's own use.
        pub fn slots_mut(&mut self) -> &mut SlotPool {
            &mut self.slots
        }
    };
}

/// The attempt epochs a ledger hands out: 1, 2, 3, ..., each once, so a late message of an
/// earlier attempt never matches a later one.
#[derive(Debug, Clone)]
struct Epochs {
    next: u64,
}

impl Default for Epochs {
    fn default() -> Self {
        Self { next: 1 }
    }
}

impl Epochs {
    /// The next epoch, never handed out before.
    fn take(&mut self) -> u64 {
        let epoch = self.next;
        self.next += 1;
        epoch
    }
}

pub mod admission;
mod import;
pub(crate) use import::named_counters;
mod pin;
mod quorum;
mod record;

pub use import::{
    ImportCounters, ImportLedger, ImportLedgerConfig, ImportRequest, SourceLease, StartImport,
};
pub use pin::{PinCounters, PinLedger, PushDestination, PushPlan};
pub use quorum::{CompletionQuorum, HandleState, QuorumDecision, RankOutcome};
pub use record::ActionRecord;

/// Why a handoff failed (the reason of a [`LedgerAction::Fail`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailReason {
    /// A rank reported that its transfer failed.
    RankError,
    /// A rank reported a timeout or a transfer that may still write.
    RankTimeout,
    /// The handoff's own deadline passed in `poll(now)`.
    Deadline,
    /// The caller aborted it.
    Aborted,
    /// An engine reset cancelled it.
    Reset,
    /// The source's pin lease may have ended before the import started, completed or was
    /// admitted: the source may have reused the blocks it read.
    LeaseExpired,
}

impl FailReason {
    /// Stable lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::RankError => "rank_error",
            Self::RankTimeout => "rank_timeout",
            Self::Deadline => "deadline",
            Self::Aborted => "aborted",
            Self::Reset => "reset",
            Self::LeaseExpired => "lease_expired",
        }
    }
}

/// Why a quarantine or a pin ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseCause {
    /// The local transfer handle settled: nothing can write any more.
    Settled,
    /// The drain horizon passed.
    Horizon,
    /// `RELEASE_KV` arrived (prefill pins).
    ReleaseKv,
    /// The pin's lease expired.
    LeaseExpired,
    /// An engine reset released it.
    Reset,
}

impl ReleaseCause {
    /// Stable lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Settled => "settled",
            Self::Horizon => "horizon",
            Self::ReleaseKv => "release_kv",
            Self::LeaseExpired => "lease_expired",
            Self::Reset => "reset",
        }
    }
}

/// What the caller must do (or learn) after an event. Each request gets exactly one terminal
/// action per attempt: `Admit`, `CompleteWithoutForward` or `Fail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LedgerAction {
    /// Post the transfers of one import (pull: begin the reads; push: post the receives).
    StartImport(StartImport),
    /// The import is complete and admitted: ownership of `block_ids` (cached prefix, imported
    /// blocks, continuation blocks, in token order) and `ssm_slot` moved to the live request.
    Admit {
        /// The request.
        request_id: u64,
        /// Its attempt epoch.
        epoch: u64,
        /// Every block of the request in token order; the request now holds one reference each.
        block_ids: Vec<u32>,
        /// The SSM slot, detached from the slot pool's accounting.
        ssm_slot: Option<u32>,
    },
    /// The transferred resume tokens already satisfy the request: finish it without a forward
    /// step. The ledger released its blocks and slot.
    CompleteWithoutForward {
        /// The request.
        request_id: u64,
        /// Its attempt epoch.
        epoch: u64,
    },
    /// The handoff failed; its future must fail with `reason`.
    Fail {
        /// The request.
        request_id: u64,
        /// Its attempt epoch.
        epoch: u64,
        /// Why.
        reason: FailReason,
        /// Whether the destinations went to quarantine (may still be written) instead of back
        /// to the pool.
        quarantined: bool,
    },
    /// Blocks and slot of an ended attempt went back to the pool (quarantine drained, pin
    /// released).
    Released {
        /// The request.
        request_id: u64,
        /// The attempt (or pin) epoch.
        epoch: u64,
        /// Why now.
        cause: ReleaseCause,
    },
}
