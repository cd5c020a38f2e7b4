//! Handoff and staging tickets: what a prefill rank sends with a handoff, typed and checked
//! once when the decode receives it.
//!
//! A [`StagingTicket`] names the packed copy one source rank made in its staging region; a
//! [`HandoffTicket`] is the whole handoff (source blocks, SSM slot, first tokens, pin epoch,
//! lease, staging tickets per decode rank, the prefill's rank metadata).

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};
use crate::stream::MAX_STREAM_SLOTS;
use crate::wire::peer::PeerMeta;
use crate::wire::value::{as_uint, Obj, WireValue, MAX_ITEMS};

/// The packed copy one source rank made for one decode rank (`stage_blocks`' return value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingTicket {
    /// The source rank's global rank.
    pub src_rank: u32,
    /// The source rank's incarnation when it packed.
    pub incarnation: u64,
    /// Whether a packed copy exists (`false`: read the blocks directly).
    pub staged: bool,
    /// Offset of the packed copy in the source's staging region.
    pub offset: u64,
    /// Bytes of the packed copy.
    pub nbytes: u64,
    /// Set when the packed copy is streamed through a few slots of the source's pool rather
    /// than held whole (`offset` is then 0; see `crate::stream`).
    pub stream: Option<StreamTicket>,
    /// A packed copy held whole whose pack may not have completed when the ticket left: the
    /// stream id whose one `Ready` notification announces it (the decode reads it only then).
    pub ready: Option<u64>,
}

/// How a streamed packed copy moves: the stream's id, the chunk size both sides cut the
/// copy with (`crate::stream::chunk_ranges`) and the source slots (offsets in its staging
/// region; every chunk is announced by a notification once packed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamTicket {
    /// The stream's id on the source (named in every notification).
    pub id: u64,
    /// Most bytes of one chunk (a chunk holds one item at least).
    pub chunk_bytes: u64,
    /// Bytes of each source slot (at least every chunk's size).
    pub slot_bytes: u64,
    /// Where each source slot starts in the source's staging region.
    pub offsets: Vec<u64>,
}

impl StreamTicket {
    fn parse(o: &Obj<'_>, field: &str) -> DisaggResult<Option<Self>> {
        let Some(v) = o.some("stream") else { return Ok(None) };
        let path = format!("{field}.stream");
        let s = Obj::of(v, &path)?;
        let t = Self {
            id: s.u64("id")?,
            chunk_bytes: s.u64("chunk_bytes")?,
            slot_bytes: s.u64("slot_bytes")?,
            offsets: s.uints("offsets", u64::MAX)?,
        };
        if t.offsets.is_empty() || t.offsets.len() > MAX_STREAM_SLOTS {
            return Err(DisaggError::wire(
                format!("{path}.offsets"),
                format!("{} slots, a stream holds 1 to {MAX_STREAM_SLOTS}", t.offsets.len()),
            ));
        }
        if t.slot_bytes == 0 || t.chunk_bytes > t.slot_bytes {
            return Err(DisaggError::wire(
                format!("{path}.slot_bytes"),
                format!(
                    "slot_bytes={} must be positive and hold chunk_bytes={}",
                    t.slot_bytes, t.chunk_bytes
                ),
            ));
        }
        Ok(Some(t))
    }
}

impl StagingTicket {
    /// The id of the stream or of the announcement whose notifications concern this copy.
    pub fn notice_id(&self) -> Option<u64> {
        self.stream.as_ref().map(|st| st.id).or(self.ready)
    }

    /// Offset of a packed copy held whole: the range releasing the ticket frees.
    pub fn held_offset(&self) -> Option<u64> {
        (self.staged && self.stream.is_none()).then_some(self.offset)
    }

    /// What releasing the ticket frees: `(notice id, or -1 without one; [offset of a copy
    /// held whole])`.
    pub fn release_plan(&self) -> (i64, Vec<u64>) {
        let notice = self.notice_id().map_or(-1, |id| i64::try_from(id).unwrap_or(i64::MAX));
        (notice, self.held_offset().into_iter().collect())
    }

    /// The checked ticket as a wire map (`stream` only when streamed).
    pub fn to_wire(&self) -> WireValue {
        let int = |v: u64| WireValue::Int(i128::from(v));
        let mut m = vec![
            ("src_rank".to_owned(), int(u64::from(self.src_rank))),
            ("incarnation".to_owned(), int(self.incarnation)),
            ("staged".to_owned(), WireValue::Bool(self.staged)),
            ("offset".to_owned(), int(self.offset)),
            ("nbytes".to_owned(), int(self.nbytes)),
        ];
        if let Some(st) = &self.stream {
            let offsets = WireValue::List(st.offsets.iter().map(|&o| int(o)).collect());
            let s = vec![
                ("id".to_owned(), int(st.id)),
                ("chunk_bytes".to_owned(), int(st.chunk_bytes)),
                ("slot_bytes".to_owned(), int(st.slot_bytes)),
                ("offsets".to_owned(), offsets),
            ];
            m.push(("stream".to_owned(), WireValue::Map(s)));
        }
        if let Some(id) = self.ready {
            m.push(("ready".to_owned(), int(id)));
        }
        WireValue::Map(m)
    }

    /// Parse one ticket map (`field` names it in errors): `HandoffMetadata` errors.
    pub fn parse(v: &WireValue, field: &str) -> DisaggResult<Self> {
        Self::parse_fields(v, field).map_err(DisaggError::in_handoff_metadata)
    }

    fn parse_fields(v: &WireValue, field: &str) -> DisaggResult<Self> {
        let o = Obj::of(v, field)?;
        let t = Self {
            src_rank: o.u32("src_rank")?,
            incarnation: o.u64("incarnation")?,
            staged: match o.req("staged")? {
                WireValue::Bool(b) => *b,
                other => {
                    return Err(DisaggError::wire(
                        format!("{field}.staged"),
                        format!("must be a bool, got a {}", other.type_name()),
                    ))
                }
            },
            offset: o.u64("offset")?,
            nbytes: o.u64("nbytes")?,
            stream: StreamTicket::parse(&o, field)?,
            ready: o.opt_u64("ready")?,
        };
        if t.ready.is_some() && (t.stream.is_some() || !t.staged) {
            return Err(DisaggError::wire(
                format!("{field}.ready"),
                format!(
                    "an announcement names a copy held whole, got staged={} with a stream={}",
                    t.staged,
                    t.stream.is_some()
                ),
            ));
        }
        if t.stream.is_some() && !t.staged {
            return Err(DisaggError::wire(
                format!("{field}.stream"),
                "a stream without a packed copy (staged=false)",
            ));
        }
        if t.offset.checked_add(t.nbytes).is_none() {
            return Err(DisaggError::wire(
                format!("{field}.nbytes"),
                format!("offset={} + nbytes={} exceeds u64", t.offset, t.nbytes),
            ));
        }
        Ok(t)
    }

    /// Check the ticket against its source's metadata: the same incarnation, and a packed copy
    /// that lies inside the source's staging region.
    pub fn check_against(&self, peer: &PeerMeta) -> DisaggResult<()> {
        let rank = self.src_rank;
        if self.incarnation != peer.incarnation {
            return Err(DisaggError::wire(
                "staged",
                format!(
                    "ticket of rank {rank} is from incarnation {}, the peer is at {}",
                    self.incarnation, peer.incarnation
                ),
            ));
        }
        if self.staged {
            let Some(region) = peer.staging() else {
                return Err(DisaggError::wire(
                    "staged",
                    format!("ticket of rank {rank} names a packed copy but the peer has no staging region"),
                ));
            };
            // A streamed copy lies in its slots only (checked below), never whole.
            if self.stream.is_none() && self.offset.saturating_add(self.nbytes) > region.nbytes {
                return Err(DisaggError::wire(
                    "staged",
                    format!(
                        "ticket of rank {rank} names bytes [{}, {}) outside the peer's staging \
                         region of {} bytes",
                        self.offset,
                        self.offset.saturating_add(self.nbytes),
                        region.nbytes
                    ),
                ));
            }
            let slots = self.stream.iter().flat_map(|st| st.offsets.iter().map(move |&o| (o, st)));
            for (at, st) in slots {
                if at.saturating_add(st.slot_bytes) > region.nbytes {
                    return Err(DisaggError::wire(
                        "staged",
                        format!(
                            "ticket of rank {rank} names a stream slot [{at}, {}) outside the \
                             peer's staging region of {} bytes",
                            at.saturating_add(st.slot_bytes),
                            region.nbytes
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Check the staging tickets of one pull against the source peers (by global rank): every
/// ticket names a known source, at most one ticket per source. Returns them by source rank;
/// errors are `HandoffMetadata` naming the field.
pub fn check_staging_tickets(
    tickets: &[WireValue],
    peers: &BTreeMap<u32, &PeerMeta>,
) -> DisaggResult<BTreeMap<u32, StagingTicket>> {
    check_tickets(tickets, peers).map_err(DisaggError::in_handoff_metadata)
}

fn check_tickets(
    tickets: &[WireValue],
    peers: &BTreeMap<u32, &PeerMeta>,
) -> DisaggResult<BTreeMap<u32, StagingTicket>> {
    if tickets.len() > MAX_ITEMS {
        return Err(DisaggError::wire("staged", format!("{} tickets", tickets.len())));
    }
    let mut out = BTreeMap::new();
    for (i, v) in tickets.iter().enumerate() {
        let t = StagingTicket::parse(v, &format!("staged[{i}]"))?;
        let Some(peer) = peers.get(&t.src_rank) else {
            return Err(DisaggError::wire(
                "staged",
                format!("ticket names unknown source rank {}", t.src_rank),
            ));
        };
        t.check_against(peer)?;
        if out.contains_key(&t.src_rank) {
            return Err(DisaggError::wire(
                "staged",
                format!("two tickets for source rank {}", t.src_rank),
            ));
        }
        out.insert(t.src_rank, t);
    }
    Ok(out)
}

/// Most first tokens a ticket may carry.
pub const MAX_RESUME_TOKENS: usize = 4096;

/// The handoff ticket the prefill sends with a finished prefill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandoffTicket {
    /// The prompt's blocks on the prefill (first pipeline stage's, TP rank 0's); empty when
    /// the caller passes them beside the ticket.
    pub src_block_ids: Vec<u32>,
    /// Tokens per prefill block.
    pub src_block_size_tokens: Option<u32>,
    /// The prefill's SSM slot (hybrid models).
    pub src_ssm_slot: Option<u32>,
    /// Tokens the prefill already generated.
    pub resume_tokens: Vec<i64>,
    /// Epoch of the prefill's pin.
    pub pin_epoch: Option<u64>,
    /// Lease the prefill holds the blocks for, in ns (>= 2).
    pub lease_ns: Option<u64>,
    /// End of the lease on the prefill's wall clock, in ns.
    pub lease_until_wall_ns: Option<u64>,
    /// Staging tickets per decode global rank.
    pub staged: BTreeMap<u32, Vec<StagingTicket>>,
    /// Whether the ticket carries an integrity table.
    pub has_integrity: bool,
    /// Whether the ticket names the prefill's rank metadata.
    pub has_prefill_meta: bool,
    /// The state kinds (`kv`, `conv`, `recurrent`) each prefill rank exports, when the
    /// prefill metadata holds a non-empty list of rank maps (`None` otherwise).
    pub prefill_sources: Option<Vec<Vec<String>>>,
}

/// What a decode rank needs of a ticket (see [`HandoffTicket::check_for_decode`]).
#[derive(Debug, Clone, Default)]
pub struct DecodeNeeds {
    /// The request the ticket is for (named in errors).
    pub request_id: u64,
    /// The state kinds this rank reads (`kv` and its SSM kinds); empty when it reads none.
    pub sources: Vec<String>,
    /// Whether this decode holds SSM state (the ticket must name a source slot exactly then).
    pub has_ssm: bool,
    /// Whether this decode verifies integrity (the ticket must carry a digest table).
    pub integrity: bool,
}

/// The state kinds each rank map of a prefill's `handoff_static_meta` exports.
fn prefill_sources(meta: &WireValue) -> Option<Vec<Vec<String>>> {
    let ranks = Obj::of(meta, "prefill_meta").ok()?.some("ranks")?;
    let WireValue::List(items) = ranks else { return None };
    if items.is_empty() {
        return None;
    }
    items
        .iter()
        .map(|r| match r {
            WireValue::Map(e) => Some(
                e.iter()
                    .filter(|(_, v)| !matches!(v, WireValue::Null))
                    .map(|(k, _)| k.clone())
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

fn rank_key(k: &str) -> DisaggResult<u32> {
    k.parse::<u32>().map_err(|_| {
        DisaggError::wire("staged", format!("staged key {k:?} is not a decode global rank"))
    })
}

impl HandoffTicket {
    /// Parse and validate a ticket (every field named in its `HandoffMetadata` error).
    /// `staged` maps decode ranks (ints or their decimal text) to lists of staging tickets.
    pub fn parse(v: &WireValue) -> DisaggResult<Self> {
        Self::parse_fields(v).map_err(DisaggError::in_handoff_metadata)
    }

    fn parse_fields(v: &WireValue) -> DisaggResult<Self> {
        if !matches!(v, WireValue::Map(_)) {
            return Err(DisaggError::wire(
                "ticket",
                format!("expected a dict, got a {}", v.type_name()),
            ));
        }
        let o = Obj::of(v, "")?;
        // The reference design's callers pass the source blocks beside the ticket.
        let ids = match o.some("src_block_ids") {
            None => Vec::new(),
            Some(_) => o.uints("src_block_ids", u64::from(u32::MAX))?,
        };
        if ids.len() > MAX_ITEMS {
            return Err(DisaggError::block("src_block_ids", format!("{} ids", ids.len())));
        }
        // A handoff continues from the token(s) the prefill sampled: never from none (the
        // decode would import, then fail at admission with nothing to continue from).
        let resume = match o.some("resume_tokens") {
            None => {
                return Err(DisaggError::wire(
                    "resume_tokens",
                    "must hold the prefill's sampled token, got no field",
                ))
            }
            Some(WireValue::List(items)) if items.is_empty() => {
                return Err(DisaggError::wire(
                    "resume_tokens",
                    "must hold the prefill's sampled token, got an empty list",
                ))
            }
            Some(WireValue::List(items)) if items.len() <= MAX_RESUME_TOKENS => items
                .iter()
                .enumerate()
                .map(|(i, t)| match t {
                    WireValue::Int(x) if *x >= 0 && *x <= i128::from(i64::MAX) => Ok(*x as i64),
                    other => Err(DisaggError::wire(
                        format!("resume_tokens[{i}]"),
                        format!("must be a non-negative int, got a {}", other.type_name()),
                    )),
                })
                .collect::<DisaggResult<_>>()?,
            Some(other) => {
                return Err(DisaggError::wire(
                    "resume_tokens",
                    format!(
                        "must be a list of at most {MAX_RESUME_TOKENS} ints, got a {}",
                        other.type_name()
                    ),
                ))
            }
        };
        let lease_ns = o.opt_u64("lease_ns")?;
        if let Some(l) = lease_ns {
            if l < 2 {
                return Err(DisaggError::wire("lease_ns", format!("lease_ns={l} must be >= 2")));
            }
        }
        let mut staged = BTreeMap::new();
        if let Some(s) = o.some("staged") {
            let WireValue::Map(entries) = s else {
                return Err(DisaggError::wire(
                    "staged",
                    format!("must be a dict, got a {}", s.type_name()),
                ));
            };
            for (k, list) in entries {
                let rank = rank_key(k)?;
                let WireValue::List(items) = list else {
                    return Err(DisaggError::wire(
                        format!("staged.{k}"),
                        format!("must be a list of tickets, got a {}", list.type_name()),
                    ));
                };
                let ts = items
                    .iter()
                    .enumerate()
                    .map(|(i, t)| StagingTicket::parse(t, &format!("staged.{k}[{i}]")))
                    .collect::<DisaggResult<Vec<_>>>()?;
                staged.insert(rank, ts);
            }
        }
        Ok(Self {
            src_block_ids: ids.into_iter().map(|b| b as u32).collect(),
            src_block_size_tokens: o.opt_u32("src_block_size_tokens")?,
            src_ssm_slot: o.opt_u32("src_ssm_slot")?,
            resume_tokens: resume,
            pin_epoch: o.opt_u64("pin_epoch")?,
            lease_ns,
            lease_until_wall_ns: o.opt_u64("lease_until_wall_ns")?,
            staged,
            has_integrity: o.some("integrity").is_some(),
            has_prefill_meta: o.some("prefill_meta").is_some(),
            prefill_sources: o.some("prefill_meta").and_then(prefill_sources),
        })
    }

    /// Check the ticket against what one decode rank needs, before anything is reserved:
    /// the prefill's rank metadata is named and exports every state kind this rank reads,
    /// a digest table is present when the decode verifies, and the ticket names a source
    /// SSM slot exactly when the decode holds SSM state. `HandoffMetadata` errors naming the
    /// field (`prefill_meta`, `integrity`, `src_ssm_slot`).
    pub fn check_for_decode(&self, needs: &DecodeNeeds) -> DisaggResult<()> {
        let rid = needs.request_id;
        if !self.has_prefill_meta {
            return Err(DisaggError::handoff_metadata(
                "prefill_meta",
                format!("request {rid}: ticket has no prefill_meta"),
            ));
        }
        if !needs.sources.is_empty() {
            let Some(ranks) = &self.prefill_sources else {
                return Err(DisaggError::handoff_metadata(
                    "prefill_meta",
                    format!("request {rid}: ticket prefill_meta has no list of rank metadata"),
                ));
            };
            if let Some(kind) = needs.sources.iter().find(|k| !ranks.iter().any(|r| r.contains(k)))
            {
                return Err(DisaggError::handoff_metadata(
                    "prefill_meta",
                    format!(
                        "request {rid}: ticket prefill_meta has no {kind:?} source on any of its \
                         {} ranks, but this decode must read {kind} state",
                        ranks.len()
                    ),
                ));
            }
        }
        if needs.integrity && !self.has_integrity {
            return Err(DisaggError::handoff_metadata(
                "integrity",
                format!(
                    "request {rid}: this decode verifies integrity but the ticket has no \
                     integrity table (enable verify_integrity on the prefill engine)"
                ),
            ));
        }
        if needs.has_ssm != self.src_ssm_slot.is_some() {
            return Err(DisaggError::handoff_metadata(
                "src_ssm_slot",
                format!(
                    "request {rid}: decode has_ssm={} but ticket src_ssm_slot={:?}",
                    needs.has_ssm, self.src_ssm_slot
                ),
            ));
        }
        Ok(())
    }

    /// [`Self::check_for_decode`] for a decode rank's `needs`; a parsed ticket without them
    /// (a caller that is no decode rank) passes.
    pub fn check_needs(&self, needs: Option<&DecodeNeeds>) -> DisaggResult<()> {
        needs.map_or(Ok(()), |n| self.check_for_decode(n))
    }
}

/// The `ssm` entry of a reference-design ticket (`kv_meta["ssm"]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReferenceSsm {
    /// No entry (or `None`).
    Absent,
    /// A mapping with these keys (state kinds).
    Kinds(Vec<String>),
    /// Anything else: its type name.
    Other(String),
}

/// What the reference design's decode engine checks of a handoff before it reserves anything
/// (see [`ReferenceTicket::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferenceTicket {
    /// The request.
    pub request_id: u64,
    /// The ticket's SSM metadata.
    pub ssm: ReferenceSsm,
    /// Whether the decode moves SSM state (it set up SSM transfer agents).
    pub decode_has_ssm: bool,
    /// First tokens the ticket carries.
    pub resume_tokens: u64,
    /// The decode's speculative tokens (a handoff carries one more first token).
    pub num_speculative_tokens: u64,
    /// Whether the request asks for log probabilities (never handed off).
    pub return_log_probs: bool,
    /// Top-n log probabilities asked for (0: none).
    pub top_n_logprobs: i64,
    /// Source blocks named.
    pub src_blocks: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens per decode block.
    pub block_size: u64,
}

/// The SSM state kinds a hybrid model's ticket names.
pub const SSM_STATE_KINDS: [&str; 2] = ["conv", "recurrent"];

impl ReferenceTicket {
    /// Refuse a ticket the decode cannot import, naming the field (`ssm`, `resume_tokens`,
    /// `return_log_probs`, `src_block_ids`): `HandoffMetadata` errors, checked in this order.
    pub fn check(&self) -> DisaggResult<()> {
        let rid = self.request_id;
        match (&self.ssm, self.decode_has_ssm) {
            (ReferenceSsm::Kinds(kinds), true) => {
                let missing: Vec<&str> =
                    SSM_STATE_KINDS.into_iter().filter(|k| !kinds.iter().any(|x| x == k)).collect();
                if !missing.is_empty() {
                    return Err(DisaggError::handoff_metadata(
                        "ssm",
                        format!("request {rid}: SSM metadata lacks state kinds {missing:?}"),
                    ));
                }
            }
            (ReferenceSsm::Absent | ReferenceSsm::Other(_), true) => {
                let got = match &self.ssm {
                    ReferenceSsm::Other(t) => t.as_str(),
                    _ => "NoneType",
                };
                return Err(DisaggError::handoff_metadata(
                    "ssm",
                    format!(
                        "request {rid}: a hybrid decode needs the ticket's 'ssm' mapping, got {got}"
                    ),
                ));
            }
            (ReferenceSsm::Absent, false) => {}
            (_, false) => {
                return Err(DisaggError::handoff_metadata(
                    "ssm",
                    format!(
                        "request {rid}: an attention-only decode received SSM metadata from a \
                         hybrid prefill"
                    ),
                ));
            }
        }
        let want = self.num_speculative_tokens.saturating_add(1);
        if self.resume_tokens != want {
            return Err(DisaggError::handoff_metadata(
                "resume_tokens",
                format!(
                    "request {rid}: {} resume tokens but a decode-only handoff needs \
                     num_speculative_tokens+1={want}",
                    self.resume_tokens
                ),
            ));
        }
        if self.return_log_probs || self.top_n_logprobs > 0 {
            return Err(DisaggError::handoff_metadata(
                "return_log_probs",
                format!(
                    "request {rid}: a decode-only handoff carries no log probabilities \
                     (return_log_probs / top_n_logprobs)"
                ),
            ));
        }
        if self.block_size == 0 {
            return Err(DisaggError::argument("block_size", "block_size=0 must be >= 1"));
        }
        let need = self.prompt_tokens.div_ceil(self.block_size);
        if self.src_blocks != need {
            return Err(DisaggError::handoff_metadata(
                "src_block_ids",
                format!(
                    "request {rid}: {} source blocks but {} prompt tokens at block_size={} need \
                     {need} (partial tail included)",
                    self.src_blocks, self.prompt_tokens, self.block_size
                ),
            ));
        }
        Ok(())
    }
}

/// A reference-design prefill's finished handoffs, checked before any is prepared (see
/// [`ReferencePrefillBatch::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferencePrefillBatch {
    /// Pipeline stages the static KV metadata covers.
    pub kv_stages: u64,
    /// Pipeline stages the static SSM metadata covers.
    pub ssm_stages: u64,
    /// The engine's pipeline-parallel size.
    pub pp_size: u64,
    /// The engine's speculative tokens (a handoff carries one more first token).
    pub num_speculative_tokens: u64,
    /// Per request: its id, first tokens generated, prompt blocks.
    pub requests: Vec<(u64, u64, u64)>,
}

impl ReferencePrefillBatch {
    /// Refuse the whole batch, naming the field (`pp_metas`, `resume_tokens`, `block_ids`),
    /// when the static metadata does not cover every pipeline stage or a request has the
    /// wrong number of first tokens or no prompt block: `HandoffMetadata` errors.
    pub fn check(&self) -> DisaggResult<()> {
        if self.kv_stages != self.pp_size || self.ssm_stages != self.pp_size {
            return Err(DisaggError::handoff_metadata(
                "pp_metas",
                format!(
                    "static metadata covers {} KV / {} SSM pipeline stages but pp_size={}",
                    self.kv_stages, self.ssm_stages, self.pp_size
                ),
            ));
        }
        let want = self.num_speculative_tokens.saturating_add(1);
        for &(rid, resume, blocks) in &self.requests {
            if resume != want {
                return Err(DisaggError::handoff_metadata(
                    "resume_tokens",
                    format!(
                        "request {rid}: {resume} resume tokens but a decode-only handoff needs \
                         num_speculative_tokens+1={want}"
                    ),
                ));
            }
            if blocks == 0 {
                return Err(DisaggError::handoff_metadata(
                    "block_ids",
                    format!("request {rid}: no prompt KV blocks"),
                ));
            }
        }
        Ok(())
    }
}

/// A staged map key given as an int (msgpack keeps int keys; JSON turns them into text).
pub fn int_key(v: &WireValue) -> Option<u32> {
    as_uint(v, u64::from(u32::MAX)).and_then(|x| u32::try_from(x).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::peer::{BackendFields, Region};

    fn i(v: i128) -> WireValue {
        WireValue::Int(v)
    }
    fn map(entries: Vec<(&str, WireValue)>) -> WireValue {
        WireValue::Map(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }
    fn ticket(rank: i128, inc: i128, staged: bool, offset: i128, nbytes: i128) -> WireValue {
        map(vec![
            ("src_rank", i(rank)),
            ("incarnation", i(inc)),
            ("staged", WireValue::Bool(staged)),
            ("offset", i(offset)),
            ("nbytes", i(nbytes)),
        ])
    }

    fn streamed(inc: i128, offsets: &[i128], slot: i128) -> WireValue {
        let WireValue::Map(mut e) = ticket(0, inc, true, 0, 4096) else { unreachable!() };
        let offs = WireValue::List(offsets.iter().map(|&o| i(o)).collect());
        let st = map(vec![
            ("id", i(3)),
            ("chunk_bytes", i(slot)),
            ("slot_bytes", i(slot)),
            ("offsets", offs),
        ]);
        e.push(("stream".into(), st));
        WireValue::Map(e)
    }

    #[test]
    fn a_ticket_names_its_notices_and_the_range_its_release_frees() {
        let whole = StagingTicket::parse(&ticket(0, 1, true, 64, 8), "t").unwrap();
        assert_eq!((whole.notice_id(), whole.held_offset()), (None, Some(64)));
        let announced = StagingTicket { ready: Some(9), ..whole.clone() };
        assert_eq!((announced.notice_id(), announced.held_offset()), (Some(9), Some(64)));
        let direct = StagingTicket { staged: false, ..whole };
        assert_eq!((direct.notice_id(), direct.held_offset()), (None, None));
        let streamed = StagingTicket::parse(&streamed(1, &[0, 64], 32), "t").unwrap();
        assert_eq!((streamed.notice_id(), streamed.held_offset()), (Some(3), None));
    }

    #[test]
    fn a_release_plan_marks_a_ticket_without_notices_by_minus_one() {
        let whole = StagingTicket::parse(&ticket(0, 1, true, 64, 8), "t").unwrap();
        assert_eq!(whole.release_plan(), (-1, vec![64]));
        let announced = StagingTicket { ready: Some(9), staged: false, ..whole.clone() };
        assert_eq!(announced.release_plan(), (9, vec![]));
        let huge = StagingTicket { ready: Some(u64::MAX), ..whole };
        assert_eq!(huge.release_plan(), (i64::MAX, vec![64]));
    }

    #[test]
    fn stream_tickets_are_parsed_and_bounded() {
        let t = StagingTicket::parse(&streamed(1, &[0, 64], 32), "t").unwrap();
        let st = t.stream.unwrap();
        assert_eq!((st.id, st.chunk_bytes, st.offsets), (3, 32, vec![0, 64]));
        let field = |v: WireValue| match StagingTicket::parse(&v, "t") {
            Err(DisaggError::HandoffMetadata { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(streamed(1, &[], 32)), "t.stream.offsets");
        assert_eq!(field(streamed(1, &[0; 17], 32)), "t.stream.offsets");
        assert_eq!(field(streamed(1, &[0], 0)), "t.stream.slot_bytes");
        let WireValue::Map(mut e) = streamed(1, &[0], 8) else { unreachable!() };
        e[2].1 = WireValue::Bool(false);
        assert_eq!(field(WireValue::Map(e)), "t.stream");
    }

    #[test]
    fn negative_offsets_and_wrapping_ranges_are_refused_when_parsed() {
        let e = StagingTicket::parse(&ticket(0, 1, true, -8, 8), "t").unwrap_err();
        assert!(
            matches!(&e, DisaggError::HandoffMetadata { field, .. } if field == "t.offset"),
            "{e}"
        );
        let e =
            StagingTicket::parse(&ticket(0, 1, true, i128::from(u64::MAX), 2), "t").unwrap_err();
        assert!(
            matches!(&e, DisaggError::HandoffMetadata { field, .. } if field == "t.nbytes"),
            "{e}"
        );
    }

    #[test]
    fn a_handoff_ticket_parses_and_names_its_bad_fields() {
        let ok = map(vec![
            ("src_block_ids", WireValue::List(vec![i(3), i(1)])),
            ("resume_tokens", WireValue::List(vec![i(42)])),
            ("lease_ns", i(1000)),
            ("staged", map(vec![("0", WireValue::List(vec![ticket(1, 2, true, 0, 64)]))])),
        ]);
        let t = HandoffTicket::parse(&ok).unwrap();
        assert_eq!(t.src_block_ids, vec![3, 1]);
        assert_eq!(t.staged[&0][0].nbytes, 64);
        for (key, bad, field) in [
            ("src_block_ids", WireValue::List(vec![i(-1)]), "src_block_ids[0]"),
            ("lease_ns", i(1), "lease_ns"),
            ("resume_tokens", WireValue::Str("x".into()), "resume_tokens"),
            ("resume_tokens", WireValue::List(vec![]), "resume_tokens"),
            ("staged", map(vec![("x", WireValue::List(vec![]))]), "staged"),
        ] {
            let mut v = ok.clone();
            if let WireValue::Map(e) = &mut v {
                e.retain(|(k, _)| k != key);
                e.push((key.to_owned(), bad));
            }
            let e = HandoffTicket::parse(&v).unwrap_err();
            assert!(
                matches!(&e, DisaggError::HandoffMetadata { field: f, .. } if f == field),
                "{e}"
            );
        }
    }

    #[test]
    fn a_ticket_missing_what_the_decode_reads_is_refused_naming_the_field() {
        let rank = |kinds: Vec<(&str, WireValue)>| map(kinds);
        let prefill = map(vec![(
            "ranks",
            WireValue::List(vec![rank(vec![("kv", map(vec![])), ("conv", WireValue::Null)])]),
        )]);
        let ticket = |extra: Vec<(&str, WireValue)>| {
            let mut e = vec![
                ("src_block_ids", WireValue::List(vec![i(0)])),
                ("resume_tokens", WireValue::List(vec![i(1)])),
            ];
            e.extend(extra);
            HandoffTicket::parse(&map(e)).unwrap()
        };
        let kv = DecodeNeeds { request_id: 3, sources: vec!["kv".into()], ..Default::default() };
        let ok = ticket(vec![("prefill_meta", prefill.clone())]);
        assert!(ok.check_for_decode(&kv).is_ok());
        let field = |t: &HandoffTicket, n: &DecodeNeeds| match t.check_for_decode(n) {
            Err(DisaggError::HandoffMetadata { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(&ticket(vec![]), &kv), "prefill_meta");
        let bad = ticket(vec![("prefill_meta", map(vec![("ranks", WireValue::List(vec![]))]))]);
        assert_eq!(field(&bad, &kv), "prefill_meta");
        let conv = DecodeNeeds { sources: vec!["kv".into(), "conv".into()], ..kv.clone() };
        assert_eq!(field(&ok, &conv), "prefill_meta");
        let verify = DecodeNeeds { integrity: true, ..kv.clone() };
        assert_eq!(field(&ok, &verify), "integrity");
        let ssm = DecodeNeeds { has_ssm: true, ..kv.clone() };
        assert_eq!(field(&ok, &ssm), "src_ssm_slot");
        let with_slot = ticket(vec![("prefill_meta", prefill), ("src_ssm_slot", i(1))]);
        assert_eq!(field(&with_slot, &kv), "src_ssm_slot");
        assert!(with_slot.check_for_decode(&ssm).is_ok());
        // Without a decode's needs only the parse is checked.
        assert!(ticket(vec![]).check_needs(None).is_ok());
        assert!(ticket(vec![]).check_needs(Some(&kv)).is_err());
        assert!(ok.check_needs(Some(&kv)).is_ok());
        // A decode that reads nothing needs no sources, but still the metadata.
        let none = DecodeNeeds { sources: vec![], ..kv };
        assert!(bad.check_for_decode(&none).is_ok());
    }

    #[test]
    fn a_reference_ticket_is_refused_naming_the_first_bad_field() {
        let ok = ReferenceTicket {
            request_id: 4,
            ssm: ReferenceSsm::Kinds(vec!["conv".into(), "recurrent".into()]),
            decode_has_ssm: true,
            resume_tokens: 2,
            num_speculative_tokens: 1,
            return_log_probs: false,
            top_n_logprobs: 0,
            src_blocks: 3,
            prompt_tokens: 9,
            block_size: 4,
        };
        assert!(ok.check().is_ok());
        let attention =
            ReferenceTicket { ssm: ReferenceSsm::Absent, decode_has_ssm: false, ..ok.clone() };
        assert!(attention.check().is_ok());
        let field = |t: ReferenceTicket| match t.check() {
            Err(DisaggError::HandoffMetadata { field, detail }) => {
                assert!(detail.contains("request 4"), "{detail}");
                field
            }
            other => panic!("{other:?}"),
        };
        for (bad, want) in [
            (
                ReferenceTicket { ssm: ReferenceSsm::Kinds(vec!["conv".into()]), ..ok.clone() },
                "ssm",
            ),
            (ReferenceTicket { ssm: ReferenceSsm::Other("list".into()), ..ok.clone() }, "ssm"),
            (ReferenceTicket { ssm: ReferenceSsm::Absent, ..ok.clone() }, "ssm"),
            (ReferenceTicket { decode_has_ssm: false, ..ok.clone() }, "ssm"),
            (ReferenceTicket { resume_tokens: 1, ..ok.clone() }, "resume_tokens"),
            (ReferenceTicket { return_log_probs: true, ..ok.clone() }, "return_log_probs"),
            (ReferenceTicket { top_n_logprobs: 2, ..ok.clone() }, "return_log_probs"),
            (ReferenceTicket { src_blocks: 2, ..ok.clone() }, "src_block_ids"),
            (ReferenceTicket { prompt_tokens: 13, ..ok.clone() }, "src_block_ids"),
            // The first bad field is named: SSM before the first tokens.
            (ReferenceTicket { ssm: ReferenceSsm::Absent, resume_tokens: 0, ..ok.clone() }, "ssm"),
        ] {
            assert_eq!(field(bad), want);
        }
        assert!(matches!(
            ReferenceTicket { block_size: 0, ..ok }.check(),
            Err(DisaggError::Argument { .. })
        ));
    }

    #[test]
    fn a_reference_prefill_batch_is_refused_before_any_request_is_prepared() {
        let ok = ReferencePrefillBatch {
            kv_stages: 2,
            ssm_stages: 2,
            pp_size: 2,
            num_speculative_tokens: 0,
            requests: vec![(1, 1, 3), (2, 1, 1)],
        };
        assert!(ok.check().is_ok());
        let field = |b: ReferencePrefillBatch| match b.check() {
            Err(DisaggError::HandoffMetadata { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(ReferencePrefillBatch { ssm_stages: 1, ..ok.clone() }), "pp_metas");
        assert_eq!(field(ReferencePrefillBatch { kv_stages: 3, ..ok.clone() }), "pp_metas");
        let resume = ReferencePrefillBatch { requests: vec![(1, 1, 3), (2, 2, 1)], ..ok.clone() };
        assert_eq!(field(resume), "resume_tokens");
        let empty = ReferencePrefillBatch { requests: vec![(1, 1, 0)], ..ok };
        assert_eq!(field(empty), "block_ids");
    }

    #[test]
    fn staging_tickets_are_checked_against_their_source() {
        // A minimal peer: only incarnation and staging matter here.
        let v = crate::wire::peer::tests::meta_with_staging(Region { addr: 1 << 20, nbytes: 128 });
        let peer = PeerMeta::parse(&v, "nixl").unwrap();
        assert!(matches!(peer.backend, BackendFields::Nixl { .. }));
        let peers = BTreeMap::from([(0u32, &peer)]);
        let inc = i128::from(peer.incarnation);
        assert!(check_staging_tickets(&[ticket(0, inc, true, 64, 64)], &peers).is_ok());
        // A streamed copy of 4096 bytes through two 32-byte slots of the 128-byte region.
        let checked = check_staging_tickets(&[streamed(inc, &[0, 96], 32)], &peers).unwrap();
        // The checked ticket's wire map is the one it was read from.
        assert_eq!(checked[&0].to_wire(), streamed(inc, &[0, 96], 32));
        let plain = check_staging_tickets(&[ticket(0, inc, true, 64, 64)], &peers).unwrap();
        assert_eq!(plain[&0].to_wire(), ticket(0, inc, true, 64, 64));
        for bad in [
            vec![ticket(1, inc, true, 0, 8)],
            vec![ticket(0, inc + 1, true, 0, 8)],
            vec![ticket(0, inc, true, 100, 64)],
            vec![ticket(0, inc, false, 0, 0), ticket(0, inc, false, 0, 0)],
            vec![streamed(inc, &[0, 112], 32)],
        ] {
            let e = check_staging_tickets(&bad, &peers).unwrap_err();
            assert!(
                matches!(&e, DisaggError::HandoffMetadata { field, .. } if field == "staged"),
                "{e}"
            );
        }
    }
}
