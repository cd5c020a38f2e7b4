//! The one error type of the core: one variant per failure kind.
//!
//! Every variant names the offending field and, where there is one, both the value given and
//! the value it had to agree with, so an engine log line is enough to find the bad input.
//! The bindings map each variant to exactly one Python exception class of
//! `disagg_rs.exceptions`; `DisaggError::kind` is the stable name that mapping keys on.

use std::fmt;

use crate::wire::value::join;

/// Result alias used by every fallible function of the core.
pub type DisaggResult<T> = Result<T, DisaggError>;

/// Every way a decision of the core can fail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DisaggError {
    /// A layout or dims field is out of range or disagrees with another field
    /// (for example `tp_rank=4` with `tp_size=4`, or a layout list mixing `num_layers`).
    Layout {
        /// The field that is wrong.
        field: String,
        /// What was given and what it had to satisfy, both values spelled out.
        detail: String,
    },
    /// A reshard plan would leave a destination cell unwritten (a gap) or write it twice
    /// (an overlap). Names the first offending cell.
    Coverage {
        /// The first gap or overlap, with destination rank and cell coordinates.
        detail: String,
    },
    /// A block id, slot id or block list is invalid: out of range, negative, duplicated where
    /// it must be unique, or of a length that does not match its partner list.
    Block {
        /// The list or argument that is wrong.
        field: String,
        /// The bad value and the bound or partner value it violates.
        detail: String,
    },
    /// Two memory geometries (or a geometry and a layout) disagree on something both sides must
    /// share: `head_dim`, element size, dtype, number of blocks, axis set.
    Geometry {
        /// The field that disagrees.
        field: String,
        /// Both values.
        detail: String,
    },
    /// Address arithmetic would overflow `u64`; the geometry describes memory that cannot exist.
    AddressOverflow {
        /// What was being computed.
        detail: String,
    },
    /// Handoff metadata from a peer cannot be decoded: missing field, wrong type, unknown
    /// format version or a compatibility-hash mismatch.
    Wire {
        /// The field that is missing or wrong.
        field: String,
        /// What was found and what was expected.
        detail: String,
    },
    /// A handoff's own metadata is malformed: a ticket (source blocks, first tokens, lease,
    /// staging tickets) or the peer metadata it carries is missing a field, mistyped or out of
    /// range. A kind of `Wire` error raised where the handoff contract is checked.
    HandoffMetadata {
        /// The field that is missing or wrong.
        field: String,
        /// What was found and what was expected.
        detail: String,
    },
    /// A request id is unknown to a ledger where it must be known.
    UnknownRequest {
        /// The request id.
        request_id: u64,
    },
    /// A request id is already in flight in a ledger.
    DuplicateRequest {
        /// The request id.
        request_id: u64,
    },
    /// A request needs more blocks or slots than the whole pool holds, so it could never start.
    Capacity {
        /// The resource (`blocks`, `ssm_slots`).
        resource: String,
        /// What was needed and what the pool holds.
        detail: String,
    },
    /// An event is not allowed in the current state of a handoff (for example a second,
    /// conflicting completion report from the same rank).
    State {
        /// The request id the event was for.
        request_id: u64,
        /// The current state and the event.
        detail: String,
    },
    /// The engine is not in a state (or configuration) that allows the operation: a hybrid
    /// prefill without an SSM state cache, a handoff before transfer setup.
    HandoffState {
        /// The setting or state that forbids it.
        field: String,
        /// What was found and what the operation needs.
        detail: String,
    },
    /// A reset was refused because something may still be written or read; nothing changed.
    ResetRefused {
        /// Itemized list of what blocks the reset.
        detail: String,
    },
    /// A plain argument is out of range (a rank >= world size, a zero block size, a deadline
    /// before the current time).
    Argument {
        /// The argument that is wrong.
        field: String,
        /// The value given and the bound it violates.
        detail: String,
    },
    /// A two-sided message's header disagrees with the receive it landed in (another
    /// request's, incarnation's, chunk's or size's message, or no header at all): the peer
    /// pair is out of step and the bytes must not be admitted.
    MessageOrder {
        /// The header field that differs (`tag`, `incarnation`, `chunk`, `nbytes`, `magic`..).
        field: String,
        /// The value the receive was posted for.
        expected: u64,
        /// The value the message carried.
        got: u64,
    },
    /// A two-sided handoff's sender answered the posted receives with fillers: it will not
    /// send the handoff (unknown or unpinned request, refused push, lease over). The peer pair
    /// stays in step; the import fails at once.
    PushAborted {
        /// The sender's process rank.
        peer: u64,
        /// The handoff's message tag.
        tag: u64,
    },
    /// An argument of the wrong type (a float, a bool, `None` or a string where an int is
    /// needed); raised as a `TypeError` too.
    ArgumentType {
        /// The argument that is wrong.
        field: String,
        /// What was needed and what was given.
        detail: String,
    },
    /// A pool or ledger consistency check found a leaked, doubly owned or miscounted block or
    /// slot. Always a bug (in the caller's use of the pool or in `disagg_rs`), never bad input.
    Conservation {
        /// The first broken invariant, with the counts involved.
        detail: String,
    },
}

/// The shorthand constructors `name(field, detail)` of the variants that name a field: one
/// line per variant, `name => Variant`.
macro_rules! field_error_shorthands {
    ($($name:ident => $variant:ident,)*) => {$(
        #[doc = concat!("Shorthand for [`DisaggError::", stringify!($variant), "`].")]
        pub fn $name(field: impl Into<String>, detail: impl Into<String>) -> Self {
            Self::$variant { field: field.into(), detail: detail.into() }
        }
    )*};
}

impl DisaggError {
    field_error_shorthands! {
        handoff_state => HandoffState,
        layout => Layout,
        block => Block,
        geometry => Geometry,
        wire => Wire,
        handoff_metadata => HandoffMetadata,
        argument => Argument,
        argument_type => ArgumentType,
    }

    /// One example of every variant, so tests can prove that the mapping to Python classes is
    /// exhaustive (a new variant without an example fails `every_variant_has_a_sample`).
    pub fn samples() -> Vec<Self> {
        vec![
            Self::layout("tp_rank", "tp_rank=4 must be < tp_size=4"),
            Self::Coverage { detail: "dst rank 0 layer 3 head 1 is never written".into() },
            Self::block("src_block_ids", "block id 9 >= num_blocks=8"),
            Self::geometry("head_dim", "src head_dim=128 != dst head_dim=64"),
            Self::AddressOverflow { detail: "base 0xffff_ffff_ffff_fff0 + 64".into() },
            Self::wire("version", "got 7, expected 1"),
            Self::handoff_metadata("lease_ns", "lease_ns=1 must be >= 2"),
            Self::UnknownRequest { request_id: 7 },
            Self::DuplicateRequest { request_id: 7 },
            Self::Capacity { resource: "blocks".into(), detail: "needs 9 > pool size 8".into() },
            Self::State { request_id: 7, detail: "rank 1 reported ok after error".into() },
            Self::handoff_state("enable_prefix_caching", "enable_prefix_caching=False"),
            Self::ResetRefused { detail: "1 importing handoff may still write".into() },
            Self::argument("rank", "rank=4 must be < world_size=4"),
            Self::MessageOrder { field: "tag".into(), expected: 68, got: 72 },
            Self::PushAborted { peer: 0, tag: 68 },
            Self::argument_type("rank", "rank must be an int, got a float (1.5)"),
            Self::Conservation {
                detail: "free 3 + owned 4 + quarantined 0 + pinned 0 != 8".into(),
            },
        ]
    }

    /// The same failure as a handoff-metadata error: a `Wire` error becomes
    /// [`DisaggError::HandoffMetadata`] with its field and detail; any other is kept.
    #[must_use]
    pub fn in_handoff_metadata(self) -> Self {
        match self {
            Self::Wire { field, detail } => Self::HandoffMetadata { field, detail },
            other => other,
        }
    }

    /// The same failure inside the wire record at `path`: a `Wire` error's field is named
    /// from there (`layout.tp_size`); any other is kept.
    #[must_use]
    pub fn under(self, path: &str) -> Self {
        match self {
            Self::Wire { field, detail } => Self::Wire { field: join(path, &field), detail },
            other => other,
        }
    }

    /// `Ok` when an invariant `holds`, else a [`DisaggError::Conservation`] saying `detail()`.
    pub fn conserved(holds: bool, detail: impl FnOnce() -> String) -> DisaggResult<()> {
        if holds {
            Ok(())
        } else {
            Err(Self::Conservation { detail: detail() })
        }
    }

    /// Shorthand for [`DisaggError::AddressOverflow`].
    pub fn overflow(detail: impl Into<String>) -> Self {
        Self::AddressOverflow { detail: detail.into() }
    }
}

/// [`DisaggError::kind`] and the `Display` message of every variant from one line each:
/// `Variant { fields.. } => "message naming {every} {field}"`.
macro_rules! kinds_and_messages {
    ($($variant:ident { $($field:ident),+ } => $msg:literal,)*) => {
        impl DisaggError {
            /// Stable name of the failure kind; the bindings map it to one exception class.
            pub fn kind(&self) -> &'static str {
                match self {
                    $(Self::$variant { .. } => stringify!($variant),)*
                }
            }
        }

        impl fmt::Display for DisaggError {
            fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    $(Self::$variant { $($field),+ } => write!(out, $msg, $($field = $field),+),)*
                }
            }
        }
    };
}

kinds_and_messages! {
    Layout { field, detail } => "invalid layout field `{field}`: {detail}",
    Coverage { detail } => "reshard plan coverage broken: {detail}",
    Block { field, detail } => "invalid `{field}`: {detail}",
    Geometry { field, detail } => "geometry mismatch on `{field}`: {detail}",
    AddressOverflow { detail } => "address arithmetic overflows u64: {detail}",
    Wire { field, detail } => "bad handoff metadata field `{field}`: {detail}",
    HandoffMetadata { field, detail } => "malformed handoff metadata field `{field}`: {detail}",
    UnknownRequest { request_id } => "unknown request id {request_id}",
    DuplicateRequest { request_id } => "request id {request_id} is already in flight",
    Capacity { resource, detail } => "request can never fit in the {resource} pool: {detail}",
    State { request_id, detail } => "event not allowed for request {request_id}: {detail}",
    HandoffState { field, detail } => "handoff not possible in this state (`{field}`): {detail}",
    ResetRefused { detail } => "reset refused, nothing changed: {detail}",
    Argument { field, detail } => "invalid argument `{field}`: {detail}",
    MessageOrder { field, expected, got } => "two-sided message out of step: header field \
        `{field}` is {got}, the receive was posted for {expected}",
    PushAborted { peer, tag } => "rank {peer} aborted the handoff of tag {tag}: its messages \
        are fillers",
    ArgumentType { field, detail } => "invalid argument `{field}`: {detail}",
    Conservation { detail } => "conservation check failed: {detail}",
}

impl std::error::Error for DisaggError {}

#[cfg(test)]
mod tests {
    use super::DisaggError;

    #[test]
    fn every_variant_has_a_sample() {
        let mut kinds: Vec<&str> = DisaggError::samples().iter().map(DisaggError::kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        // Bump this together with a new variant and its sample.
        assert_eq!(kinds.len(), 18);
    }

    #[test]
    fn every_variant_has_its_kind_and_message() {
        let kinds: Vec<&str> = DisaggError::samples().iter().map(DisaggError::kind).collect();
        assert_eq!(kinds[..3], ["Layout", "Coverage", "Block"]);
        assert_eq!(kinds[17], "Conservation");
        let all: Vec<String> = DisaggError::samples().iter().map(ToString::to_string).collect();
        assert_eq!(
            all.join("\n"),
            "\
invalid layout field `tp_rank`: tp_rank=4 must be < tp_size=4
reshard plan coverage broken: dst rank 0 layer 3 head 1 is never written
invalid `src_block_ids`: block id 9 >= num_blocks=8
geometry mismatch on `head_dim`: src head_dim=128 != dst head_dim=64
address arithmetic overflows u64: base 0xffff_ffff_ffff_fff0 + 64
bad handoff metadata field `version`: got 7, expected 1
malformed handoff metadata field `lease_ns`: lease_ns=1 must be >= 2
unknown request id 7
request id 7 is already in flight
request can never fit in the blocks pool: needs 9 > pool size 8
event not allowed for request 7: rank 1 reported ok after error
handoff not possible in this state (`enable_prefix_caching`): enable_prefix_caching=False
reset refused, nothing changed: 1 importing handoff may still write
invalid argument `rank`: rank=4 must be < world_size=4
two-sided message out of step: header field `tag` is 72, the receive was posted for 68
rank 0 aborted the handoff of tag 68: its messages are fillers
invalid argument `rank`: rank must be an int, got a float (1.5)
conservation check failed: free 3 + owned 4 + quarantined 0 + pinned 0 != 8"
        );
    }

    #[test]
    fn display_names_field_and_values() {
        let e = DisaggError::layout("tp_rank", "tp_rank=4 must be < tp_size=4");
        assert!(e.to_string().contains("tp_rank=4"));
        assert!(e.to_string().contains("tp_size=4"));
    }
}
