//! Decode-side import ledger (docs/architecture.md §5).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;

use super::quorum::{CompletionQuorum, QuorumDecision, RankOutcome};
use super::{Epochs, FailReason, LedgerAction, ReleaseCause};
use crate::args::{named, Kind};
use crate::error::{DisaggError, DisaggResult};
use crate::pool::{BlockPool, IdMap, SlotPool, SlotState};

/// Static settings of an [`ImportLedger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportLedgerConfig {
    /// Model-parallel ranks that must all report ok.
    pub world_size: u32,
    /// This rank (its report describes the local transfer handle).
    pub rank: u32,
    /// Pull transport (one-sided reads): reuse the decode prefix cache and pull only the
    /// uncached suffix. Push transports never trim (receives must match the sender's posts).
    pub pull: bool,
    /// Extra token slots reserved after the resume tokens (speculative decode lookahead).
    pub lookahead_tokens: u32,
    /// How long (in the caller's time unit) a quarantine waits for its handle to settle before
    /// its blocks are returned anyway.
    pub drain_horizon: u64,
    /// Bound on how far the source's clock may be from ours (caller's time unit): a source
    /// lease counts as ending this much earlier than it says.
    pub clock_offset_bound: u64,
}

impl Default for ImportLedgerConfig {
    fn default() -> Self {
        Self {
            world_size: 1,
            rank: 0,
            pull: true,
            lookahead_tokens: 0,
            drain_horizon: 30_000_000_000,
            clock_offset_bound: 1_000_000_000,
        }
    }
}

/// One `SUBMIT_REQUEST_WITH_KV` as the ledger needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportRequest {
    /// Request id (unique among live handoffs).
    pub request_id: u64,
    /// Prompt length in tokens.
    pub num_prompt_tokens: u32,
    /// Hash chain of the prompt's full blocks at the DECODE block size (may be shorter or empty:
    /// no prefix reuse and no publishing beyond it).
    pub prompt_hashes: Vec<u64>,
    /// Source (prefill) block ids of the prompt, in token order.
    pub src_block_ids: Vec<u32>,
    /// Tokens per source block.
    pub src_block_size_tokens: u32,
    /// Tokens the prefill already generated that the decode continues from.
    pub resume_tokens: u32,
    /// Whether the model has SSM state to import (one slot).
    pub has_ssm: bool,
    /// The resume tokens already satisfy the request: it completes without a forward step.
    pub finished: bool,
    /// Absolute time after which the handoff fails if it is not admitted.
    pub deadline: u64,
    /// Reuse a cached prefix only in whole multiples of this many tokens (as well as of both
    /// block sizes); 1 for no constraint. An integrity digest chunked by `C` tokens sets `C`,
    /// so the transferred suffix starts on a chunk boundary.
    pub reuse_align_tokens: u32,
    /// The source's pin lease, if it has one: past it the source may reuse the blocks this
    /// import reads, so the import must not start, complete or be admitted after it.
    pub source_lease: Option<SourceLease>,
}

/// A source pin lease as the ticket states it, read against this side's clock.
///
/// The source frees its blocks at `until_wall` of ITS wall clock; `now_wall` is this side's
/// wall clock read together with the `now` of the submit. With the configured
/// `clock_offset_bound` the ledger derives a deadline on its own (monotonic) time base:
/// `now + (until_wall - now_wall - clock_offset_bound)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceLease {
    /// End of the source's lease, on the source's wall clock.
    pub until_wall: u64,
    /// This side's wall clock at the submit.
    pub now_wall: u64,
}

impl SourceLease {
    /// The lease a submit states: both clocks, or neither (an `Argument` error otherwise).
    pub fn pair(until_wall: Option<u64>, now_wall: Option<u64>) -> DisaggResult<Option<Self>> {
        match (until_wall, now_wall) {
            (None, None) => Ok(None),
            (Some(until_wall), Some(now_wall)) => Ok(Some(Self { until_wall, now_wall })),
            (u, w) => Err(DisaggError::argument(
                "lease_until_wall",
                format!(
                    "give lease_until_wall (given: {}) and now_wall (given: {}) together or \
                     neither",
                    u.is_some(),
                    w.is_some()
                ),
            )),
        }
    }
}

/// The reads (or receives) to post for one import, all in token order. Source blocks
/// `src_block_ids` hold tokens `[token_start, num_prompt_tokens)`, destination blocks
/// `dst_block_ids` receive them; `cached_block_ids` already hold `[0, token_start)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartImport {
    /// The request.
    pub request_id: u64,
    /// This attempt's epoch: every report must carry it.
    pub epoch: u64,
    /// First prompt token to transfer (a multiple of both block sizes).
    pub token_start: u32,
    /// Source blocks to read, covering `[token_start, num_prompt_tokens)`.
    pub src_block_ids: Vec<u32>,
    /// Local blocks that receive them.
    pub dst_block_ids: Vec<u32>,
    /// Decode-cached prefix blocks reused for `[0, token_start)` (retained, never written).
    pub cached_block_ids: Vec<u32>,
    /// Empty blocks reserved for the resume tokens and lookahead.
    pub continuation_block_ids: Vec<u32>,
    /// The SSM slot that receives conv and recurrent state.
    pub ssm_slot: Option<u32>,
}

/// Monotonic event counters of an [`ImportLedger`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportCounters {
    /// Accepted submits.
    pub submitted: u64,
    /// Submits that had to wait in DEFERRED.
    pub deferred: u64,
    /// Imports started.
    pub started: u64,
    /// Requests admitted into the batch.
    pub admitted: u64,
    /// Requests completed without a forward step.
    pub completed_without_forward: u64,
    /// Requests failed (any reason).
    pub failed: u64,
    /// Failures whose destinations went to quarantine.
    pub quarantined: u64,
    /// Quarantines drained because the handle settled.
    pub drained_settled: u64,
    /// Quarantines drained because the horizon passed.
    pub drained_horizon: u64,
    /// Quarantines kept past their horizon: transfers that cannot be cancelled may still
    /// write their blocks (`hold_quarantine`).
    pub quarantine_held: u64,
    /// Imports failed because the source lease may have ended (before start, completion or
    /// admission).
    pub lease_expired: u64,
    /// Duplicate, late (old epoch) and unknown messages ignored.
    pub ignored_messages: u64,
    /// Cached prefix blocks reused instead of pulled.
    pub prefix_blocks_reused: u64,
}

/// `named()` of a counters struct: every listed counter under its own name, in order.
macro_rules! named_counters {
    ($ty:ty { $($f:ident),* $(,)? }) => {
        impl $ty {
            /// Every counter under its name, in declaration order.
            pub fn named(&self) -> [(&'static str, u64); [$(stringify!($f)),*].len()] {
                [$((stringify!($f), self.$f)),*]
            }
        }
    };
}
pub(crate) use named_counters;

named_counters!(ImportCounters {
    submitted,
    deferred,
    started,
    admitted,
    completed_without_forward,
    failed,
    quarantined,
    drained_settled,
    drained_horizon,
    quarantine_held,
    lease_expired,
    ignored_messages,
    prefix_blocks_reused,
});

/// Whether the local transfer handle can still write the destinations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    Running,
    Quiet,
    MayWrite,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Deferred,
    Importing(Local),
    Ready,
}

/// What one handoff holds in the pools.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Holdings {
    cached: Vec<u32>,
    dst: Vec<u32>,
    cont: Vec<u32>,
    slot: Option<u32>,
}

impl Holdings {
    fn blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.cached.iter().chain(&self.dst).chain(&self.cont).copied()
    }
}

#[derive(Debug, Clone)]
struct Handoff {
    req: ImportRequest,
    epoch: u64,
    phase: Phase,
    hold: Holdings,
    /// Local time at which the source lease may end (`None`: no lease).
    lease_deadline: Option<u64>,
}

impl Handoff {
    fn lease_passed(&self, now: u64) -> bool {
        self.lease_deadline.is_some_and(|d| d <= now)
    }
}

#[derive(Debug, Clone)]
struct Quarantined {
    hold: Holdings,
    drain_at: u64,
    local_reported: bool,
}

/// A plan to start one deferred handoff, computed without mutation.
struct StartPlan {
    token_start: u32,
    cached: Vec<u32>,
    new_prompt: u32,
    cont: u32,
}

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The decode-side import lifecycle over its own [`BlockPool`] and [`SlotPool`].
#[derive(Debug, Clone)]
pub struct ImportLedger {
    cfg: ImportLedgerConfig,
    pool: BlockPool,
    slots: SlotPool,
    live: IdMap<u64, Handoff>,
    deferred: VecDeque<u64>,
    ready: VecDeque<u64>,
    quarantine: BTreeMap<(u64, u64), Quarantined>,
    quorum: CompletionQuorum,
    epochs: Epochs,
    counters: ImportCounters,
    /// The latest `now` any call supplied: a lower bound of the current time.
    clock: u64,
    /// Two-sided transports: attempts `(request_id, epoch)` whose import started since the
    /// last [`drain_started_pushes`](Self::drain_started_pushes), oldest first.
    started_pushes: Vec<(u64, u64)>,
}

impl ImportLedger {
    /// A ledger over fresh pools of `num_blocks` blocks and `num_ssm_slots` SSM slots.
    pub fn new(
        num_blocks: u32,
        block_size_tokens: u32,
        num_ssm_slots: u32,
        cfg: ImportLedgerConfig,
    ) -> DisaggResult<Self> {
        Self::with_pools(
            BlockPool::new(num_blocks, block_size_tokens)?,
            SlotPool::try_new(num_ssm_slots)?,
            cfg,
        )
    }

    /// A ledger that takes ownership of existing pools.
    pub fn with_pools(
        pool: BlockPool,
        slots: SlotPool,
        cfg: ImportLedgerConfig,
    ) -> DisaggResult<Self> {
        let quorum = CompletionQuorum::new(cfg.world_size)?;
        quorum.check_rank(cfg.rank)?;
        Ok(Self {
            quorum,
            cfg,
            pool,
            slots,
            live: IdMap::default(),
            deferred: VecDeque::new(),
            ready: VecDeque::new(),
            quarantine: BTreeMap::new(),
            epochs: Epochs::default(),
            counters: ImportCounters::default(),
            clock: 0,
            started_pushes: Vec::new(),
        })
    }

    /// Static settings.
    pub fn config(&self) -> ImportLedgerConfig {
        self.cfg
    }

    /// A submit's prompt as `(num_prompt_tokens, prompt_hashes)`: from its `tokens` (hashed
    /// at this ledger's block size unless `hashes` are given) or from its length `num_tokens`
    /// alone (with `hashes` or none); exactly one of the two must be given.
    pub fn prompt_facts(
        &self,
        tokens: Option<&[i64]>,
        num_tokens: Option<u32>,
        hashes: Option<Vec<u64>>,
    ) -> DisaggResult<(u32, Vec<u64>)> {
        match (tokens, num_tokens) {
            (Some(t), None) => {
                let n = u32::try_from(t.len()).map_err(|_| {
                    DisaggError::argument(
                        "prompt_tokens",
                        format!("len={} must be < 2**32", t.len()),
                    )
                })?;
                Ok((n, hashes.map_or_else(|| self.pool.block_hashes(t), Ok)?))
            }
            (None, Some(n)) => Ok((n, hashes.unwrap_or_default())),
            _ => Err(DisaggError::argument(
                "prompt_tokens",
                "give exactly one of prompt_tokens and num_prompt_tokens",
            )),
        }
    }

    /// The block size of a submit's source: `given`, or this ledger's own when the source
    /// names none.
    pub fn src_block_size(&self, given: Option<u32>) -> u32 {
        given.unwrap_or_else(|| self.pool.block_size_tokens())
    }

    pool_accessors!(
        "The block pool, for the engine's own allocations (admitted requests, prompts it runs). \
         Releasing blocks the ledger holds through it is a bug that `check()` reports."
    );

    /// Event counters.
    pub fn counters(&self) -> ImportCounters {
        self.counters
    }

    /// Handoffs waiting for capacity.
    pub fn num_deferred(&self) -> usize {
        self.deferred.len()
    }

    /// Handoffs with transfers in flight.
    pub fn num_importing(&self) -> usize {
        self.live.values().filter(|h| matches!(h.phase, Phase::Importing(_))).count()
    }

    /// Complete handoffs waiting for an admission point.
    pub fn num_ready(&self) -> usize {
        self.ready.len()
    }

    /// Failed attempts whose destinations may still be written.
    pub fn num_quarantined(&self) -> usize {
        self.quarantine.len()
    }

    /// Distinct blocks held in quarantine.
    pub fn num_quarantined_blocks(&self) -> usize {
        self.quarantine.values().map(|q| q.hold.blocks().count()).sum()
    }

    /// Quarantined attempts `(request_id, epoch)` whose drain horizon is `<= now`: the next
    /// `poll(now)` returns their blocks to the pool, so the caller cancels their transfers
    /// through the transport first.
    pub fn quarantine_due(&self, now: u64) -> Vec<(u64, u64)> {
        self.quarantine.iter().filter(|(_, q)| q.drain_at <= now).map(|(k, _)| *k).collect()
    }

    /// The reference design's `pending_kv_import_count`: waiting for capacity or transfer
    /// completion, or complete but not admitted yet.
    pub fn pending_kv_import_count(&self) -> usize {
        self.live.len()
    }

    /// The reference design's `has_admittable_kv_import`.
    pub fn has_admittable_kv_import(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Request ids in DEFERRED, oldest first.
    pub fn deferred_ids(&self) -> Vec<u64> {
        self.deferred.iter().copied().collect()
    }

    /// Two-sided transports (`pull == false`): the requests whose import started since the
    /// last call and is still in flight, oldest first. Their receives are posted, so their
    /// source may now be told to push: on the ticket's arrival or, for a deferred import,
    /// whenever capacity let it start. Always empty for pull transports.
    pub fn drain_started_pushes(&mut self) -> Vec<(u64, u64)> {
        let mut started = std::mem::take(&mut self.started_pushes);
        started.retain(|key| self.receives_posted(*key));
        started
    }

    /// Whether attempt `key`'s receives are (or may still be) posted: it is importing, or it
    /// failed while they were and is quarantined. A quarantined one is drained too: its
    /// source must still answer every posted receive (with a filler), or its next send on the
    /// pair would land in them.
    fn receives_posted(&self, key: (u64, u64)) -> bool {
        self.quarantine.contains_key(&key)
            || self
                .live
                .get(&key.0)
                .is_some_and(|h| h.epoch == key.1 && matches!(h.phase, Phase::Importing(_)))
    }

    /// At quarantined attempt `(request_id, epoch)`'s drain horizon: when a transfer that
    /// cannot be cancelled (a posted two-sided receive) is still `running`, it may still
    /// write the attempt's blocks, so they must not go back to the pool: keep the quarantine
    /// until `now` plus another horizon (or until it settles). Returns whether it was kept.
    pub fn hold_quarantine(
        &mut self,
        request_id: u64,
        epoch: u64,
        running: bool,
        now: u64,
    ) -> bool {
        self.clock = self.clock.max(now);
        let horizon = self.cfg.drain_horizon;
        match self.quarantine.get_mut(&(request_id, epoch)).filter(|_| running) {
            Some(q) => {
                q.drain_at = now.saturating_add(horizon);
                self.counters.quarantine_held += 1;
                true
            }
            None => false,
        }
    }

    /// The model-parallel ranks' reports of the started attempts (read-only: a report goes
    /// through [`report`](Self::report)).
    pub fn quorum(&self) -> &CompletionQuorum {
        &self.quorum
    }

    /// The current attempt epoch of a live request.
    pub fn epoch_of(&self, request_id: u64) -> Option<u64> {
        self.live.get(&request_id).map(|h| h.epoch)
    }

    /// State name of a request's current attempt: `deferred`, `importing`, `ready`, or `None`
    /// when it is not live (terminal or unknown).
    pub fn state_of(&self, request_id: u64) -> Option<&'static str> {
        self.live.get(&request_id).map(|h| match h.phase {
            Phase::Deferred => "deferred",
            Phase::Importing(_) => "importing",
            Phase::Ready => "ready",
        })
    }

    fn prompt_blocks(&self, n_tokens: u32) -> u64 {
        ceil_div(u64::from(n_tokens), u64::from(self.pool.block_size_tokens()))
    }

    fn total_blocks(&self, req: &ImportRequest) -> u64 {
        let total = u64::from(req.num_prompt_tokens)
            + u64::from(req.resume_tokens)
            + u64::from(self.cfg.lookahead_tokens);
        ceil_div(total, u64::from(self.pool.block_size_tokens()))
            .max(self.prompt_blocks(req.num_prompt_tokens))
    }

    fn validate(&self, req: &ImportRequest, now: u64) -> DisaggResult<()> {
        if self.live.contains_key(&req.request_id) {
            return Err(DisaggError::DuplicateRequest { request_id: req.request_id });
        }
        Kind::Argument.at_least_one(&named!(req;
            num_prompt_tokens, src_block_size_tokens, reuse_align_tokens
        ))?;
        if req.deadline <= now {
            return Err(DisaggError::argument(
                "deadline",
                format!("deadline={} must be > now={now}", req.deadline),
            ));
        }
        self.lease_deadline(req, now)?;
        let want_src =
            ceil_div(u64::from(req.num_prompt_tokens), u64::from(req.src_block_size_tokens));
        if req.src_block_ids.len() as u64 != want_src {
            return Err(DisaggError::block(
                "src_block_ids",
                format!(
                    "len(src_block_ids)={} != ceil(num_prompt_tokens={} / src_block_size_tokens={})={want_src}",
                    req.src_block_ids.len(),
                    req.num_prompt_tokens,
                    req.src_block_size_tokens
                ),
            ));
        }
        // A prefill request never holds one block at two token positions: a repeated source id
        // means a corrupted ticket, and pulling it would silently duplicate one block's tokens.
        let mut seen = std::collections::BTreeSet::new();
        if let Some(dup) = req.src_block_ids.iter().find(|&&id| !seen.insert(id)) {
            return Err(DisaggError::block(
                "src_block_ids",
                format!("src_block_ids names block {dup} twice ({} ids)", req.src_block_ids.len()),
            ));
        }
        let full = u64::from(req.num_prompt_tokens) / u64::from(self.pool.block_size_tokens());
        if req.prompt_hashes.len() as u64 > full {
            return Err(DisaggError::block(
                "prompt_hashes",
                format!(
                    "len(prompt_hashes)={} > full prompt blocks={full}",
                    req.prompt_hashes.len()
                ),
            ));
        }
        let need = self.total_blocks(req);
        if need > u64::from(self.pool.num_blocks()) {
            return Err(DisaggError::Capacity {
                resource: "blocks".into(),
                detail: format!(
                    "request {} needs {need} blocks > num_blocks={}",
                    req.request_id,
                    self.pool.num_blocks()
                ),
            });
        }
        if req.has_ssm && self.slots.num_slots() == 0 {
            return Err(DisaggError::Capacity {
                resource: "ssm_slots".into(),
                detail: format!("request {} needs 1 SSM slot > num_slots=0", req.request_id),
            });
        }
        Ok(())
    }

    /// The local time at which the source lease of `req` may end, read at `now`: its
    /// remaining time by the source's wall clock, less the clock offset bound. `None` without a
    /// lease; an error when no time is left (the source may already reuse the blocks).
    fn lease_deadline(&self, req: &ImportRequest, now: u64) -> DisaggResult<Option<u64>> {
        let Some(lease) = req.source_lease else { return Ok(None) };
        let left = lease
            .until_wall
            .checked_sub(lease.now_wall)
            .and_then(|r| r.checked_sub(self.cfg.clock_offset_bound))
            .filter(|&r| r > 0);
        match left {
            Some(r) => Ok(Some(now.saturating_add(r))),
            None => Err(DisaggError::argument(
                "lease_until_wall",
                format!(
                    "request {}: source lease ends at lease_until_wall={} but now_wall={} + \
                     clock_offset_bound={} leaves no time to read before it",
                    req.request_id, lease.until_wall, lease.now_wall, self.cfg.clock_offset_bound
                ),
            )),
        }
    }

    fn tick(&mut self, now: u64) {
        self.clock = self.clock.max(now);
    }

    /// Validate, then queue (DEFERRED, FIFO, no side effects) and start what fits. A rejected
    /// submit changes nothing. Returns the actions (a `StartImport` for each started handoff).
    ///
    /// With `req.source_lease` the import gets a second deadline, the local time at which the
    /// source may reuse its blocks: it does not start, become ready or get admitted at or past
    /// it, and `poll` fails it there (reason `lease_expired`).
    pub fn submit(&mut self, req: ImportRequest, now: u64) -> DisaggResult<Vec<LedgerAction>> {
        self.validate(&req, now)?;
        let lease_deadline = self.lease_deadline(&req, now)?;
        self.tick(now);
        let rid = req.request_id;
        let epoch = self.epochs.take();
        self.counters.submitted += 1;
        self.live.insert(
            rid,
            Handoff {
                req,
                epoch,
                phase: Phase::Deferred,
                hold: Holdings::default(),
                lease_deadline,
            },
        );
        self.deferred.push_back(rid);
        let mut out = Vec::new();
        self.drain_deferred(&mut out)?;
        if self.state_of(rid) == Some("deferred") {
            self.counters.deferred += 1;
        }
        Ok(out)
    }

    fn plan_start(&self, req: &ImportRequest) -> Option<StartPlan> {
        let bs = u64::from(self.pool.block_size_tokens());
        let sbs = u64::from(req.src_block_size_tokens);
        let mut cached =
            if self.cfg.pull { self.pool.match_prefix(&req.prompt_hashes) } else { Vec::new() };
        // Reuse only whole multiples of both block sizes, so no cached block is partly written
        // and the source read starts on a source block boundary (and of the requested
        // alignment). Saturating: an alignment past any prompt simply means no reuse.
        let lcm = bs / gcd(bs, sbs) * sbs;
        let align = u64::from(req.reuse_align_tokens);
        let lcm = (lcm / gcd(lcm, align)).saturating_mul(align);
        let token_start =
            (cached.len() as u64 * bs / lcm * lcm).min(u64::from(req.num_prompt_tokens));
        cached.truncate((token_start / bs) as usize);
        let prompt_blocks = self.prompt_blocks(req.num_prompt_tokens);
        let new_prompt = prompt_blocks - cached.len() as u64;
        let cont = self.total_blocks(req) - prompt_blocks;
        let evictable_hits = cached.iter().filter(|&&b| self.pool.is_evictable(b)).count() as u64;
        let available = u64::from(self.pool.num_free()) - evictable_hits;
        if new_prompt + cont > available || (req.has_ssm && self.slots.num_free() == 0) {
            return None;
        }
        Some(StartPlan {
            token_start: token_start as u32,
            cached,
            new_prompt: new_prompt as u32,
            cont: cont as u32,
        })
    }

    /// Start deferred handoffs in FIFO order while the queue head fits. A head whose source
    /// lease passed by the latest known time fails instead (nothing was posted for it).
    fn drain_deferred(&mut self, out: &mut Vec<LedgerAction>) -> DisaggResult<()> {
        while let Some(&rid) = self.deferred.front() {
            let Some(h) = self.live.get(&rid) else {
                self.deferred.pop_front();
                continue;
            };
            if h.lease_passed(self.clock) {
                self.fail(rid, FailReason::LeaseExpired, self.clock, out)?;
                continue;
            }
            let Some(plan) = self.plan_start(&h.req) else { break };
            match self.reserve(&plan, h.req.has_ssm) {
                Ok(hold) => {
                    self.deferred.pop_front();
                    out.push(self.begin(rid, plan.token_start, hold));
                }
                // The plan was checked against the pools just above; a failure here means an
                // outside caller broke the pool, and `check()` will say how. Keep it deferred.
                Err(_) => break,
            }
        }
        Ok(())
    }

    fn reserve(&mut self, plan: &StartPlan, has_ssm: bool) -> DisaggResult<Holdings> {
        self.pool.retain(&plan.cached)?;
        let mut fresh = match self.pool.allocate(plan.new_prompt + plan.cont) {
            Ok(f) => f,
            Err(e) => {
                self.pool.release(&plan.cached)?;
                return Err(e);
            }
        };
        let slot = if has_ssm {
            match self.slots.allocate() {
                Ok(s) => Some(s),
                Err(e) => {
                    self.pool.release(&plan.cached)?;
                    self.pool.release(&fresh)?;
                    return Err(e);
                }
            }
        } else {
            None
        };
        let cont = fresh.split_off(plan.new_prompt as usize);
        Ok(Holdings { cached: plan.cached.clone(), dst: fresh, cont, slot })
    }

    fn begin(&mut self, rid: u64, token_start: u32, hold: Holdings) -> LedgerAction {
        self.counters.started += 1;
        self.counters.prefix_blocks_reused += hold.cached.len() as u64;
        let h = self.live.get_mut(&rid);
        let Some(h) = h else {
            return LedgerAction::Fail {
                request_id: rid,
                epoch: 0,
                reason: FailReason::Aborted,
                quarantined: false,
            };
        };
        let skip_src = (token_start / h.req.src_block_size_tokens) as usize;
        let act = StartImport {
            request_id: rid,
            epoch: h.epoch,
            token_start,
            src_block_ids: h.req.src_block_ids.get(skip_src..).unwrap_or_default().to_vec(),
            dst_block_ids: hold.dst.clone(),
            cached_block_ids: hold.cached.clone(),
            continuation_block_ids: hold.cont.clone(),
            ssm_slot: hold.slot,
        };
        h.phase = Phase::Importing(Local::Running);
        h.hold = hold;
        if !self.cfg.pull {
            // Bounded for an engine that never drains: keep only imports still in flight.
            if self.started_pushes.len() >= 2 * (self.live.len() + self.quarantine.len()) + 64 {
                let mut kept = std::mem::take(&mut self.started_pushes);
                kept.retain(|key| self.receives_posted(*key));
                self.started_pushes = kept;
            }
            self.started_pushes.push((rid, act.epoch));
        }
        LedgerAction::StartImport(act)
    }

    fn release_hold(&mut self, hold: &Holdings) -> DisaggResult<()> {
        let blocks: Vec<u32> = hold.blocks().collect();
        self.pool.release(&blocks)?;
        if let Some(s) = hold.slot {
            self.slots.free(s)?;
        }
        Ok(())
    }

    /// End the live attempt of `rid` as failed: release if quiet, else quarantine.
    fn fail(
        &mut self,
        rid: u64,
        reason: FailReason,
        now: u64,
        out: &mut Vec<LedgerAction>,
    ) -> DisaggResult<()> {
        let Some(h) = self.live.remove(&rid) else { return Ok(()) };
        self.quorum.forget((rid, h.epoch));
        match h.phase {
            Phase::Deferred => self.deferred.retain(|&r| r != rid),
            Phase::Ready => self.ready.retain(|&r| r != rid),
            Phase::Importing(_) => {}
        }
        let may_write = matches!(h.phase, Phase::Importing(Local::Running | Local::MayWrite));
        self.counters.failed += 1;
        if reason == FailReason::LeaseExpired {
            self.counters.lease_expired += 1;
        }
        if may_write {
            self.counters.quarantined += 1;
            let drain_at = now.saturating_add(self.cfg.drain_horizon);
            let local_reported = matches!(h.phase, Phase::Importing(Local::MayWrite));
            self.quarantine
                .insert((rid, h.epoch), Quarantined { hold: h.hold, drain_at, local_reported });
        } else {
            self.release_hold(&h.hold)?;
        }
        out.push(LedgerAction::Fail {
            request_id: rid,
            epoch: h.epoch,
            reason,
            quarantined: may_write,
        });
        Ok(())
    }

    fn drain_quarantine(
        &mut self,
        key: (u64, u64),
        cause: ReleaseCause,
        out: &mut Vec<LedgerAction>,
    ) -> DisaggResult<()> {
        if let Some(q) = self.quarantine.remove(&key) {
            self.release_hold(&q.hold)?;
            match cause {
                ReleaseCause::Horizon => self.counters.drained_horizon += 1,
                _ => self.counters.drained_settled += 1,
            }
            out.push(LedgerAction::Released { request_id: key.0, epoch: key.1, cause });
        }
        Ok(())
    }

    /// A rank's terminal report for attempt `(request_id, epoch)`. Late, duplicate and unknown
    /// reports are ignored and counted; a rank contradicting itself is an error (nothing
    /// changes). A quiet report from this rank for a quarantined attempt drains it.
    pub fn report(
        &mut self,
        request_id: u64,
        epoch: u64,
        rank: u32,
        outcome: RankOutcome,
        now: u64,
    ) -> DisaggResult<Vec<LedgerAction>> {
        self.quorum.check_rank(rank)?;
        self.tick(now);
        let mut out = Vec::new();
        let key = (request_id, epoch);
        if let Some(q) = self.quarantine.get_mut(&key) {
            if rank == self.cfg.rank && !q.local_reported {
                q.local_reported = true;
                if outcome.is_quiet() {
                    self.drain_quarantine(key, ReleaseCause::Settled, &mut out)?;
                    self.drain_deferred(&mut out)?;
                }
            } else {
                self.counters.ignored_messages += 1;
            }
            return Ok(out);
        }
        let phase = match self.live.get(&request_id) {
            Some(h) if h.epoch == epoch && h.phase != Phase::Deferred => h.phase,
            _ => {
                self.counters.ignored_messages += 1;
                return Ok(out);
            }
        };
        let before = self.quorum.ignored();
        let decision = self.quorum.report(key, rank, outcome)?;
        if self.quorum.ignored() != before {
            self.counters.ignored_messages += 1;
            return Ok(out);
        }
        if rank == self.cfg.rank {
            if let (Phase::Importing(_), Some(h)) = (phase, self.live.get_mut(&request_id)) {
                h.phase = Phase::Importing(if outcome.is_quiet() {
                    Local::Quiet
                } else {
                    Local::MayWrite
                });
            }
        }
        match decision {
            // Every rank's reads are complete, but `now` (read after the reports were observed)
            // may be past the source lease: the source may have reused the blocks under them.
            Some(QuorumDecision::Success)
                if self.live.get(&request_id).is_some_and(|h| h.lease_passed(now)) =>
            {
                self.fail(request_id, FailReason::LeaseExpired, now, &mut out)?;
                self.drain_deferred(&mut out)?;
            }
            Some(QuorumDecision::Success) => {
                if let Some(h) = self.live.get_mut(&request_id) {
                    h.phase = Phase::Ready;
                    self.ready.push_back(request_id);
                }
            }
            Some(QuorumDecision::Failure { outcome, .. }) => {
                let reason = if outcome == RankOutcome::Error {
                    FailReason::RankError
                } else {
                    FailReason::RankTimeout
                };
                self.fail(request_id, reason, now, &mut out)?;
                self.drain_deferred(&mut out)?;
            }
            None => {}
        }
        Ok(out)
    }

    /// The local transfer handle of attempt `(request_id, epoch)` settled after a timeout or
    /// may-still-write report: nothing can write its destinations any more. Drains the
    /// quarantine; anything else is ignored and counted.
    pub fn settle(&mut self, request_id: u64, epoch: u64) -> DisaggResult<Vec<LedgerAction>> {
        let mut out = Vec::new();
        if self.quarantine.contains_key(&(request_id, epoch)) {
            self.drain_quarantine((request_id, epoch), ReleaseCause::Settled, &mut out)?;
            self.drain_deferred(&mut out)?;
        } else {
            self.counters.ignored_messages += 1;
        }
        Ok(out)
    }

    /// Abort a request at whatever stage it is. Unknown or already terminal ids are ignored and
    /// counted.
    pub fn abort(&mut self, request_id: u64, now: u64) -> DisaggResult<Vec<LedgerAction>> {
        self.tick(now);
        let mut out = Vec::new();
        if self.live.contains_key(&request_id) {
            self.fail(request_id, FailReason::Aborted, now, &mut out)?;
            self.drain_deferred(&mut out)?;
        } else {
            self.counters.ignored_messages += 1;
        }
        Ok(out)
    }

    /// Advance time: fail every live handoff whose deadline (reason `deadline`) or source
    /// lease (reason `lease_expired`) is `<= now`, oldest epoch first, drain quarantines whose
    /// horizon passed, then start what fits.
    pub fn poll(&mut self, now: u64) -> DisaggResult<Vec<LedgerAction>> {
        self.tick(now);
        let mut out = Vec::new();
        let mut expired: Vec<(u64, u64, FailReason)> = self
            .live
            .values()
            .filter_map(|h| {
                let reason = if h.lease_passed(now) {
                    FailReason::LeaseExpired
                } else if h.req.deadline <= now {
                    FailReason::Deadline
                } else {
                    return None;
                };
                Some((h.epoch, h.req.request_id, reason))
            })
            .collect();
        expired.sort_unstable_by_key(|&(e, r, _)| (e, r));
        for (_, rid, reason) in expired {
            self.fail(rid, reason, now, &mut out)?;
        }
        let due: Vec<(u64, u64)> =
            self.quarantine.iter().filter(|(_, q)| q.drain_at <= now).map(|(k, _)| *k).collect();
        for key in due {
            self.drain_quarantine(key, ReleaseCause::Horizon, &mut out)?;
        }
        self.drain_deferred(&mut out)?;
        Ok(out)
    }

    /// An admission point: move READY handoffs, oldest first, into the batch while it has
    /// `batch_room` places. Requests the resume tokens already satisfy complete without a
    /// place. The head waits when the batch is full (later ones never overtake it). Admitted
    /// prompts' full blocks are published in the prefix cache (never before admission).
    ///
    /// `now` must be read after the completions were observed (the next clock reading of the
    /// serving loop): a READY handoff whose source lease is `<= now` fails (`lease_expired`)
    /// instead. Without `now` a handoff with a source lease cannot be proven safe and waits.
    pub fn admit(&mut self, batch_room: u32, now: Option<u64>) -> DisaggResult<Vec<LedgerAction>> {
        if let Some(n) = now {
            self.tick(n);
        }
        let mut out = Vec::new();
        let mut room = batch_room;
        while let Some(&rid) = self.ready.front() {
            let Some(h) = self.live.get(&rid) else {
                self.ready.pop_front();
                continue;
            };
            let (lease, finished) = (h.lease_deadline, h.req.finished);
            if let Some(deadline) = lease {
                match now {
                    None => break,
                    Some(n) if deadline <= n => {
                        self.fail(rid, FailReason::LeaseExpired, n, &mut out)?;
                        continue;
                    }
                    Some(_) => {}
                }
            }
            if !finished && room == 0 {
                break;
            }
            self.ready.pop_front();
            let Some(h) = self.live.remove(&rid) else { continue };
            self.quorum.forget((rid, h.epoch));
            let prompt: Vec<u32> = h.hold.cached.iter().chain(&h.hold.dst).copied().collect();
            let n = h.req.prompt_hashes.len().min(prompt.len());
            self.pool.register_cached(&prompt[..n], &h.req.prompt_hashes[..n])?;
            if h.req.finished {
                self.release_hold(&h.hold)?;
                self.counters.completed_without_forward += 1;
                out.push(LedgerAction::CompleteWithoutForward { request_id: rid, epoch: h.epoch });
            } else {
                room -= 1;
                if let Some(s) = h.hold.slot {
                    self.slots.detach(s)?;
                }
                self.counters.admitted += 1;
                out.push(LedgerAction::Admit {
                    request_id: rid,
                    epoch: h.epoch,
                    block_ids: h.hold.blocks().collect(),
                    ssm_slot: h.hold.slot,
                });
            }
        }
        self.drain_deferred(&mut out)?;
        Ok(out)
    }

    /// Engine reset: refuse, changing nothing, while any destination may still be written
    /// (an import whose local handle is not quiet, a quarantine); otherwise fail every live
    /// handoff with reason `reset` and release its blocks.
    pub fn reset(&mut self, now: u64) -> DisaggResult<Vec<LedgerAction>> {
        self.tick(now);
        let mut blockers: Vec<String> = Vec::new();
        let mut live: Vec<(u64, u64)> =
            self.live.values().map(|h| (h.epoch, h.req.request_id)).collect();
        live.sort_unstable();
        for &(epoch, rid) in &live {
            if let Some(Phase::Importing(l @ (Local::Running | Local::MayWrite))) =
                self.live.get(&rid).map(|h| h.phase)
            {
                blockers
                    .push(format!("request {rid} epoch {epoch} importing (local handle {l:?})"));
            }
        }
        for (&(rid, epoch), q) in &self.quarantine {
            blockers.push(format!("request {rid} epoch {epoch} quarantined until {}", q.drain_at));
        }
        if !blockers.is_empty() {
            let mut detail = format!("{} item(s) may still be written: ", blockers.len());
            let _ = write!(detail, "{}", blockers.join("; "));
            return Err(DisaggError::ResetRefused { detail });
        }
        let mut out = Vec::new();
        for (_, rid) in live {
            self.fail(rid, FailReason::Reset, now, &mut out)?;
        }
        self.quorum.clear();
        Ok(out)
    }

    /// Verify conservation and ownership: pools consistent; every block the ledger holds is
    /// referenced at least once per holder; imported and continuation blocks (which a transfer
    /// may write) are held by exactly one attempt and nobody else; held slots are allocated and
    /// distinct; DEFERRED holds nothing; queues agree with states.
    pub fn check(&self) -> DisaggResult<()> {
        self.pool.check()?;
        self.slots.check()?;
        let n = self.pool.num_blocks() as usize;
        let mut holds = vec![0u32; n];
        let mut exclusive = vec![false; n];
        let mut slot_held = vec![false; self.slots.num_slots() as usize];
        let holdings = self
            .live
            .values()
            .map(|h| (h.req.request_id, &h.hold))
            .chain(self.quarantine.iter().map(|(k, q)| (k.0, &q.hold)));
        for (rid, hold) in holdings {
            for b in hold.blocks() {
                let i = b as usize;
                if i >= n {
                    return Err(DisaggError::Conservation {
                        detail: format!("request {rid} holds block {b} >= {n}"),
                    });
                }
                holds[i] += 1;
            }
            for &b in hold.dst.iter().chain(&hold.cont) {
                exclusive[b as usize] = true;
            }
            if let Some(s) = hold.slot {
                if self.slots.state(s)? != SlotState::Allocated || slot_held[s as usize] {
                    return Err(DisaggError::Conservation {
                        detail: format!(
                            "request {rid} holds slot {s} that is not allocated to it alone"
                        ),
                    });
                }
                slot_held[s as usize] = true;
            }
        }
        for (b, &h) in holds.iter().enumerate() {
            let rc = self.pool.refcount(b as u32)?;
            if rc < h || (exclusive[b] && (rc != 1 || h != 1)) {
                return Err(DisaggError::Conservation {
                    detail: format!(
                        "block {b}: refcount={rc}, ledger holders={h}, writable={}",
                        exclusive[b]
                    ),
                });
            }
        }
        let mut n_def = 0;
        let mut n_ready = 0;
        for h in self.live.values() {
            match h.phase {
                Phase::Deferred => {
                    n_def += 1;
                    if h.hold != Holdings::default() {
                        return Err(DisaggError::Conservation {
                            detail: format!(
                                "deferred request {} holds resources",
                                h.req.request_id
                            ),
                        });
                    }
                }
                Phase::Ready => n_ready += 1,
                Phase::Importing(_) => {}
            }
        }
        if n_def != self.deferred.len() || n_ready != self.ready.len() {
            return Err(DisaggError::Conservation {
                detail: format!(
                    "queues disagree with states: deferred {n_def} vs {}, ready {n_ready} vs {}",
                    self.deferred.len(),
                    self.ready.len()
                ),
            });
        }
        Ok(())
    }
}
