//! Handoff and staging tickets: what a prefill rank sends with a handoff, typed and checked
//! once when the decode receives it.
//!
//! A [`StagingTicket`] names the packed copy one source rank made in its staging region; a
//! [`HandoffTicket`] is the whole handoff (source blocks, SSM slot, first tokens, pin epoch,
//! lease, staging tickets per decode rank, the prefill's rank metadata).

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};
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
}

impl StagingTicket {
    /// Parse one ticket map (`field` names it in errors).
    pub fn parse(v: &WireValue, field: &str) -> DisaggResult<Self> {
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
        };
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
            if self.offset.saturating_add(self.nbytes) > region.nbytes {
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
        }
        Ok(())
    }
}

/// Check the staging tickets of one pull against the source peers (by global rank): every
/// ticket names a known source, at most one ticket per source. Returns them by source rank.
pub fn check_staging_tickets(
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
}

fn rank_key(k: &str) -> DisaggResult<u32> {
    k.parse::<u32>().map_err(|_| {
        DisaggError::wire("staged", format!("staged key {k:?} is not a decode global rank"))
    })
}

impl HandoffTicket {
    /// Parse and validate a ticket (every field named in its error). `staged` maps decode
    /// ranks (ints or their decimal text) to lists of staging tickets.
    pub fn parse(v: &WireValue) -> DisaggResult<Self> {
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
        })
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

    #[test]
    fn negative_offsets_and_wrapping_ranges_are_refused_when_parsed() {
        let e = StagingTicket::parse(&ticket(0, 1, true, -8, 8), "t").unwrap_err();
        assert!(matches!(&e, DisaggError::Wire { field, .. } if field == "t.offset"), "{e}");
        let e =
            StagingTicket::parse(&ticket(0, 1, true, i128::from(u64::MAX), 2), "t").unwrap_err();
        assert!(matches!(&e, DisaggError::Wire { field, .. } if field == "t.nbytes"), "{e}");
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
            assert!(matches!(&e, DisaggError::Wire { field: f, .. } if f == field), "{e}");
        }
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
        for bad in [
            vec![ticket(1, inc, true, 0, 8)],
            vec![ticket(0, inc + 1, true, 0, 8)],
            vec![ticket(0, inc, true, 100, 64)],
            vec![ticket(0, inc, false, 0, 0), ticket(0, inc, false, 0, 0)],
        ] {
            let e = check_staging_tickets(&bad, &peers).unwrap_err();
            assert!(matches!(&e, DisaggError::Wire { field, .. } if field == "staged"), "{e}");
        }
    }
}
