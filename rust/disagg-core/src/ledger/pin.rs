//! Prefill-side pin ledger: a finished handoff's blocks and SSM slot stay pinned until
//! `RELEASE_KV` or lease expiry.

use std::collections::HashMap;

use super::{Epochs, LedgerAction, ReleaseCause};
use crate::args::{Int, IntList, Kind};
use crate::error::{DisaggError, DisaggResult};
use crate::pool::{BlockPool, SlotPool, SlotState};
use crate::wire::value::{Obj, WireValue};

/// Monotonic event counters of a [`PinLedger`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinCounters {
    /// Pins taken.
    pub pinned: u64,
    /// Pins released by `RELEASE_KV`.
    pub released: u64,
    /// Pins released because the lease expired.
    pub expired: u64,
    /// Releases for unknown ids or old epochs, and duplicate push reports (no-ops).
    pub ignored_messages: u64,
}

super::import::named_counters!(PinCounters { pinned, released, expired, ignored_messages });

/// Whether a push (two-sided send) is reading the pinned blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Push {
    Idle,
    /// A send is in flight; `release` holds the cause of a release that must wait for it.
    Sending {
        release: Option<ReleaseCause>,
    },
}

#[derive(Debug, Clone)]
struct Pin {
    epoch: u64,
    blocks: Vec<u32>,
    slot: Option<u32>,
    lease_until: u64,
    push: Push,
}

/// Where a decode posted the receives of a push, as its `destination` states it; a field it
/// left out is `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushDestination {
    /// Decode blocks that receive the sent blocks, in token order.
    pub dst_block_ids: Option<Vec<u32>>,
    /// Prompt tokens of the request.
    pub num_tokens: Option<u32>,
    /// First prompt token the decode receives (it holds the ones before it).
    pub token_start: u32,
    /// Decode SSM slot that receives the state (hybrid models).
    pub dst_ssm_slot: Option<u32>,
}

impl PushDestination {
    /// The first destination among `destinations` (one entry per decode rank) and its block
    /// ids and token count: a `Wire` error (naming `request_id`; `hint` ends the message of
    /// no destination at all) when there is none or it lacks either.
    fn first_of<'a>(
        request_id: u64,
        destinations: &'a [Option<Self>],
        hint: &str,
    ) -> DisaggResult<(&'a Self, Vec<u32>, u32)> {
        let Some(dest) = destinations.iter().flatten().next() else {
            return Err(DisaggError::wire(
                "destination",
                format!("request {request_id}: decode_metas carry no 'destination'{hint}"),
            ));
        };
        let ids =
            dest.dst_block_ids.clone().ok_or_else(|| Self::missing(request_id, "dst_block_ids"))?;
        let num_tokens = dest.num_tokens.ok_or_else(|| Self::missing(request_id, "num_tokens"))?;
        Ok((dest, ids, num_tokens))
    }

    /// The `Wire` error of a destination without `key`.
    fn missing(request_id: u64, key: &str) -> DisaggError {
        DisaggError::wire(
            "destination",
            format!("request {request_id}: push destination has no '{key}'"),
        )
    }

    /// The `destination` a decode rank's metadata states: a `Wire` error unless a map; a key
    /// holding `None` states nothing, like a missing key; `token_start` defaults to 0.
    pub fn from_wire(v: &WireValue) -> DisaggResult<Self> {
        if !matches!(v, WireValue::Map(_)) {
            return Err(DisaggError::wire("destination", "a push destination must be a dict"));
        }
        let o = Obj::of(v, "destination")?;
        let int = |key: &str| {
            o.some(key).map(|x| Int::of_wire(x).to_u32(Kind::Argument, key)).transpose()
        };
        let ids = |x| IntList::of_wire(x).to_u32s(Kind::Block, "dst_block_ids");
        Ok(Self {
            dst_block_ids: o.some("dst_block_ids").map(ids).transpose()?,
            num_tokens: int("num_tokens")?,
            token_start: int("token_start")?.unwrap_or(0),
            dst_ssm_slot: int("dst_ssm_slot")?,
        })
    }
}

/// What one push of a pinned handoff sends: pinned blocks `src_block_ids` (from the block of
/// the destination's `token_start` on) into `dst_block_ids`, `num_tokens` tokens in all, and the
/// pinned SSM slot, if any, into the destination's slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushPlan {
    /// The pin's epoch (its `push_settled` must carry it).
    pub epoch: u64,
    /// Pinned blocks to send.
    pub src_block_ids: Vec<u32>,
    /// Decode blocks that receive them.
    pub dst_block_ids: Vec<u32>,
    /// Tokens to send (the destination's `num_tokens - token_start`).
    pub num_tokens: u32,
    /// The pinned SSM slot and the decode slot that receives it, when the pin has a slot.
    pub ssm_slots: Option<(u32, u32)>,
}

/// Pins of finished prefill handoffs over the prefill engine's own pools.
///
/// `pin` adds one reference to each block (the engine keeps and later drops its own) and takes
/// over the SSM slot (it must be handed out, i.e. not free; the pin frees it at release).
#[derive(Debug, Clone)]
pub struct PinLedger {
    pool: BlockPool,
    slots: SlotPool,
    pins: HashMap<u64, Pin>,
    epochs: Epochs,
    counters: PinCounters,
}

impl PinLedger {
    /// A ledger over fresh pools.
    pub fn new(num_blocks: u32, block_size_tokens: u32, num_ssm_slots: u32) -> DisaggResult<Self> {
        Ok(Self::with_pools(
            BlockPool::new(num_blocks, block_size_tokens)?,
            SlotPool::try_new(num_ssm_slots)?,
        ))
    }

    /// A ledger that takes ownership of existing pools.
    pub fn with_pools(pool: BlockPool, slots: SlotPool) -> Self {
        Self {
            pool,
            slots,
            pins: HashMap::new(),
            epochs: Epochs::default(),
            counters: PinCounters::default(),
        }
    }

    pool_accessors!("The block pool, for the engine's own allocations.");

    /// Event counters.
    pub fn counters(&self) -> PinCounters {
        self.counters
    }

    /// Live pins.
    pub fn num_pinned(&self) -> usize {
        self.pins.len()
    }

    /// The reference design's `pending_kv_push_count`: pins with a send in flight.
    pub fn pending_kv_push_count(&self) -> usize {
        self.pins.values().filter(|p| matches!(p.push, Push::Sending { .. })).count()
    }

    /// Epoch of a live pin.
    pub fn epoch_of(&self, request_id: u64) -> Option<u64> {
        self.pins.get(&request_id).map(|p| p.epoch)
    }

    /// The blocks and SSM slot of a live pin, in the order they were pinned.
    pub fn pinned(&self, request_id: u64) -> Option<(&[u32], Option<u32>)> {
        self.pins.get(&request_id).map(|p| (p.blocks.as_slice(), p.slot))
    }

    /// Request ids of the live pins, ascending.
    pub fn pinned_request_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.pins.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Blocks (with repeats) held by pins.
    pub fn num_pinned_blocks(&self) -> usize {
        self.pins.values().map(|p| p.blocks.len()).sum()
    }

    /// Pin `block_ids` and `ssm_slot` of a finished handoff until `RELEASE_KV` or `lease_until`.
    /// Validates everything first; returns the pin's epoch.
    pub fn pin(
        &mut self,
        request_id: u64,
        block_ids: &[u32],
        ssm_slot: Option<u32>,
        lease_until: u64,
        now: u64,
    ) -> DisaggResult<u64> {
        if self.pins.contains_key(&request_id) {
            return Err(DisaggError::DuplicateRequest { request_id });
        }
        if lease_until <= now {
            return Err(DisaggError::argument(
                "lease_until",
                format!("lease_until={lease_until} must be > now={now}"),
            ));
        }
        if let Some(s) = ssm_slot {
            if self.slots.state(s)? == SlotState::Free {
                return Err(DisaggError::block(
                    "ssm_slot",
                    format!("slot {s} is free; pin a handed-out slot"),
                ));
            }
            if let Some((rid, _)) = self.pins.iter().find(|(_, p)| p.slot == Some(s)) {
                return Err(DisaggError::block(
                    "ssm_slot",
                    format!("slot {s} is already pinned by request {rid}"),
                ));
            }
        }
        for &b in block_ids {
            if self.pool.refcount(b)? == 0 {
                return Err(DisaggError::block(
                    "block_ids",
                    format!("block {b} has refcount=0; pin held blocks only"),
                ));
            }
        }
        self.pool.retain(block_ids)?;
        let epoch = self.epochs.take();
        self.counters.pinned += 1;
        self.pins.insert(
            request_id,
            Pin {
                epoch,
                blocks: block_ids.to_vec(),
                slot: ssm_slot,
                lease_until,
                push: Push::Idle,
            },
        );
        Ok(epoch)
    }

    fn matches(&self, request_id: u64, epoch: Option<u64>) -> bool {
        self.pins.get(&request_id).is_some_and(|p| epoch.is_none_or(|e| e == p.epoch))
    }

    /// Plan a filler for receives a decode posted for `request_id` that this engine will not
    /// push (unknown or unpinned request, refused push, lease over): the same messages the
    /// push would send, sized by the first destination among `destinations`, so the decode's
    /// receives complete and the next send on the pair matches its own receive. Nothing is
    /// read or changed: the source blocks are `0..n` (any valid ids size the plan the same),
    /// the source slot `0` when the destination names a slot and this engine has slots; the
    /// epoch is 0. Refuses a destination without `dst_block_ids` or `num_tokens`, a
    /// `token_start` past the prompt, and a prompt more blocks long than this pool holds
    /// (no push of it could have been pinned here).
    pub fn filler_push(
        &self,
        request_id: u64,
        destinations: &[Option<PushDestination>],
    ) -> DisaggResult<PushPlan> {
        let bs = self.pool.block_size_tokens();
        let (dest, dst_block_ids, num_tokens) =
            PushDestination::first_of(request_id, destinations, "")?;
        if dest.token_start > num_tokens {
            return Err(DisaggError::wire(
                "token_start",
                format!(
                    "request {request_id}: push destination token_start={} is past \
                     num_tokens={num_tokens}",
                    dest.token_start
                ),
            ));
        }
        let blocks = num_tokens.div_ceil(bs) - dest.token_start / bs;
        if blocks > self.pool.num_blocks() {
            return Err(DisaggError::Capacity {
                resource: "blocks".into(),
                detail: format!(
                    "request {request_id}: a filler of {blocks} blocks (num_tokens={num_tokens}) \
                     > pool size {}",
                    self.pool.num_blocks()
                ),
            });
        }
        Ok(PushPlan {
            epoch: 0,
            src_block_ids: (0..blocks).collect(),
            dst_block_ids,
            num_tokens: num_tokens - dest.token_start,
            ssm_slots: dest.dst_ssm_slot.filter(|_| self.slots.num_slots() > 0).map(|d| (0, d)),
        })
    }

    /// Plan a push of `request_id`'s pin to the first destination among `destinations` (one
    /// entry per decode rank, `None` where a rank states none), then mark the push in flight.
    /// Refuses, changing nothing, an unpinned request, a push already in flight, no
    /// destination, a destination without `dst_block_ids` or `num_tokens` (or `dst_ssm_slot`
    /// when the pin holds a slot), and a `token_start` past the prompt or the pinned blocks.
    pub fn start_push(
        &mut self,
        request_id: u64,
        destinations: &[Option<PushDestination>],
    ) -> DisaggResult<PushPlan> {
        let bs = self.pool.block_size_tokens();
        let Some(pin) = self.pins.get(&request_id) else {
            return Err(DisaggError::State {
                request_id,
                detail: "it has no pinned handoff to push".into(),
            });
        };
        if pin.push != Push::Idle {
            return Err(DisaggError::State {
                request_id,
                detail: format!("epoch {}: a push is already in flight", pin.epoch),
            });
        }
        let (dest, dst_block_ids, num_tokens) = PushDestination::first_of(
            request_id,
            destinations,
            " (attach the decode's posted destination with with_push_destination)",
        )?;
        let ssm_slots = match pin.slot {
            Some(src) => Some((
                src,
                dest.dst_ssm_slot
                    .ok_or_else(|| PushDestination::missing(request_id, "dst_ssm_slot"))?,
            )),
            None => None,
        };
        let first = (dest.token_start / bs) as usize;
        if dest.token_start > num_tokens || first > pin.blocks.len() {
            return Err(DisaggError::wire(
                "token_start",
                format!(
                    "request {request_id}: push destination token_start={} is past num_tokens=\
                     {num_tokens} or the {} pinned blocks of {bs} tokens",
                    dest.token_start,
                    pin.blocks.len()
                ),
            ));
        }
        let plan = PushPlan {
            epoch: pin.epoch,
            src_block_ids: pin.blocks[first..].to_vec(),
            dst_block_ids,
            num_tokens: num_tokens - dest.token_start,
            ssm_slots,
        };
        self.begin_push(request_id, plan.epoch)?;
        Ok(plan)
    }

    /// A push send started reading the pinned blocks (two-sided transports).
    pub fn begin_push(&mut self, request_id: u64, epoch: u64) -> DisaggResult<()> {
        match self.pins.get_mut(&request_id) {
            Some(p) if p.epoch == epoch => {
                if p.push != Push::Idle {
                    return Err(DisaggError::State {
                        request_id,
                        detail: format!("epoch {epoch}: a push is already in flight"),
                    });
                }
                p.push = Push::Sending { release: None };
                Ok(())
            }
            _ => {
                self.counters.ignored_messages += 1;
                Ok(())
            }
        }
    }

    /// The push send settled; a release that waited for it happens now.
    pub fn push_settled(&mut self, request_id: u64, epoch: u64) -> DisaggResult<Vec<LedgerAction>> {
        let mut out = Vec::new();
        let pending = match self.pins.get_mut(&request_id) {
            Some(p) if p.epoch == epoch && p.push != Push::Idle => {
                let Push::Sending { release } = p.push else { return Ok(out) };
                p.push = Push::Idle;
                release
            }
            _ => {
                self.counters.ignored_messages += 1;
                return Ok(out);
            }
        };
        if let Some(cause) = pending {
            out.extend(self.unpin(request_id, cause)?);
        }
        Ok(out)
    }

    /// Drop the pin of `request_id` (if any), freeing its blocks and slot; returns the
    /// `Released` action to report.
    fn unpin(
        &mut self,
        request_id: u64,
        cause: ReleaseCause,
    ) -> DisaggResult<Option<LedgerAction>> {
        let Some(p) = self.pins.remove(&request_id) else { return Ok(None) };
        self.pool.release(&p.blocks)?;
        if let Some(s) = p.slot {
            self.slots.free(s)?;
        }
        match cause {
            ReleaseCause::LeaseExpired => self.counters.expired += 1,
            _ => self.counters.released += 1,
        }
        Ok(Some(LedgerAction::Released { request_id, epoch: p.epoch, cause }))
    }

    fn release_or_defer(
        &mut self,
        request_id: u64,
        cause: ReleaseCause,
        out: &mut Vec<LedgerAction>,
    ) -> DisaggResult<()> {
        if let Some(p) = self.pins.get_mut(&request_id) {
            if let Push::Sending { release } = &mut p.push {
                // The send still reads the blocks: release when it settles.
                release.get_or_insert(cause);
                return Ok(());
            }
        }
        out.extend(self.unpin(request_id, cause)?);
        Ok(())
    }

    /// `RELEASE_KV`: idempotent; an unknown id or an old epoch is a counted no-op. While a push
    /// still reads the blocks the release waits for `push_settled`.
    pub fn release(
        &mut self,
        request_id: u64,
        epoch: Option<u64>,
    ) -> DisaggResult<Vec<LedgerAction>> {
        let mut out = Vec::new();
        if self.matches(request_id, epoch) {
            self.release_or_defer(request_id, ReleaseCause::ReleaseKv, &mut out)?;
        } else {
            self.counters.ignored_messages += 1;
        }
        Ok(out)
    }

    /// Release every pin whose lease ended (`lease_until <= now`), oldest epoch first.
    pub fn expire(&mut self, now: u64) -> DisaggResult<Vec<LedgerAction>> {
        let mut due: Vec<(u64, u64)> = self
            .pins
            .iter()
            .filter(|(_, p)| p.lease_until <= now)
            .map(|(r, p)| (p.epoch, *r))
            .collect();
        due.sort_unstable();
        let mut out = Vec::new();
        for (_, rid) in due {
            self.release_or_defer(rid, ReleaseCause::LeaseExpired, &mut out)?;
        }
        Ok(out)
    }

    /// Engine reset: refuse, changing nothing, while a push may still read pinned blocks;
    /// otherwise release every pin.
    pub fn reset(&mut self) -> DisaggResult<Vec<LedgerAction>> {
        let mut busy: Vec<u64> =
            self.pins.iter().filter(|(_, p)| p.push != Push::Idle).map(|(r, _)| *r).collect();
        if !busy.is_empty() {
            busy.sort_unstable();
            return Err(DisaggError::ResetRefused {
                detail: format!(
                    "{} push(es) may still read pinned blocks: requests {busy:?}",
                    busy.len()
                ),
            });
        }
        let mut all: Vec<(u64, u64)> = self.pins.iter().map(|(r, p)| (p.epoch, *r)).collect();
        all.sort_unstable();
        let mut out = Vec::new();
        for (_, rid) in all {
            out.extend(self.unpin(rid, ReleaseCause::Reset)?);
        }
        Ok(out)
    }

    /// Verify the pools and that every pinned block is referenced at least once per pin and
    /// every pinned slot is handed out and pinned once.
    pub fn check(&self) -> DisaggResult<()> {
        self.pool.check()?;
        self.slots.check()?;
        let mut holds: HashMap<u32, u32> = HashMap::new();
        let mut slots_seen: HashMap<u32, u64> = HashMap::new();
        for (&rid, p) in &self.pins {
            for &b in &p.blocks {
                *holds.entry(b).or_insert(0) += 1;
            }
            if let Some(s) = p.slot {
                if self.slots.state(s)? == SlotState::Free || slots_seen.insert(s, rid).is_some() {
                    return Err(DisaggError::Conservation {
                        detail: format!("pinned slot {s} of request {rid} is free or pinned twice"),
                    });
                }
            }
        }
        for (b, h) in holds {
            let rc = self.pool.refcount(b)?;
            if rc < h {
                return Err(DisaggError::Conservation {
                    detail: format!("block {b}: refcount={rc} < pins={h}"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod destination_tests {
    use super::*;

    fn map(entries: &[(&str, WireValue)]) -> WireValue {
        WireValue::Map(entries.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect())
    }

    #[test]
    fn a_destination_reads_its_fields_none_as_absent_and_names_a_bad_one() {
        let ids = WireValue::List(vec![WireValue::Int(3), WireValue::Int(4)]);
        let d = map(&[
            ("dst_block_ids", ids),
            ("num_tokens", WireValue::Int(9)),
            ("dst_ssm_slot", WireValue::Null),
        ]);
        let want = PushDestination {
            dst_block_ids: Some(vec![3, 4]),
            num_tokens: Some(9),
            token_start: 0,
            dst_ssm_slot: None,
        };
        assert_eq!(PushDestination::from_wire(&d), Ok(want));
        let e = PushDestination::from_wire(&WireValue::Str("x".into())).unwrap_err();
        assert_eq!(e, DisaggError::wire("destination", "a push destination must be a dict"));
        let neg = map(&[("dst_block_ids", WireValue::List(vec![WireValue::Int(-1)]))]);
        let e = PushDestination::from_wire(&neg).unwrap_err();
        assert!(
            matches!(e, DisaggError::Block { ref field, .. } if field == "dst_block_ids"),
            "{e:?}"
        );
        let e = PushDestination::from_wire(&map(&[("token_start", WireValue::Bool(true))]))
            .unwrap_err();
        assert!(
            matches!(e, DisaggError::ArgumentType { ref field, .. } if field == "token_start"),
            "{e:?}"
        );
    }
}
