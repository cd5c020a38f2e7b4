//! Python classes `ImportLedger`, `PinLedger`, `CompletionQuorum` and the action record
//! `LedgerAction` they return.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use disagg_core::ledger::admission::{self, BatchRoom};
use disagg_core::ledger::{ActionRecord, HandleState, PushDestination, PushPlan};
use disagg_core::{
    CompletionQuorum, ImportLedger, ImportLedgerConfig, ImportRequest, LedgerAction, PinLedger,
    QuorumDecision, RankOutcome, SourceLease,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{
    conv, convs, Bool, Each, Flag, I64s, Id, Ids, Int, IntList, Opt, Raw, Text, U64s, I64, U32, U64,
};
use crate::error::{py_methods, IntoPyResult};
use crate::pool::{core_methods, lock, lock_with, outs, tokens_arg, Out};
use crate::wire::to_wire;

/// One action of a ledger, tagged by `kind`; the fields a kind does not use are empty.
///
/// Kinds: `start` (post the transfers: `src_block_ids` -> `dst_block_ids` for prompt tokens
/// `[token_start, n)`, plus `cached_block_ids`, `continuation_block_ids`, `ssm_slot`), `admit`
/// (ownership of `block_ids` and `ssm_slot` moved to the live request), `complete` (finished
/// without a forward step), `fail` (`reason`, `quarantined`), `release` (`reason` is the cause).
#[pyclass(name = "LedgerAction", module = "disagg_rs", frozen, eq)]
#[derive(Clone, PartialEq, Eq)]
pub struct PyLedgerAction {
    pub(crate) inner: ActionRecord,
}

py_methods!(PyLedgerAction,
get {
    kind: &'static str = (kind);
    request_id: u64 = (start.request_id);
    epoch: u64 = (start.epoch);
    reason: Option<&'static str> = (reason);
    quarantined: bool = (quarantined);
    token_start: u32 = (start.token_start);
    src_block_ids: Vec<u32> = (start.src_block_ids.clone());
    dst_block_ids: Vec<u32> = (start.dst_block_ids.clone());
    cached_block_ids: Vec<u32> = (start.cached_block_ids.clone());
    continuation_block_ids: Vec<u32> = (start.continuation_block_ids.clone());
    block_ids: Vec<u32> = (block_ids.clone());
    ssm_slot: Option<u32> = (start.ssm_slot);
}
methods {
    fn __repr__(&self) -> String {
        self.inner.to_string()
    }
});

/// A quorum decision as Python sees it: `("success", None, None)` or
/// `("failure", first_failed_rank, its_outcome)`.
type QuorumVerdict = (&'static str, Option<u32>, Option<&'static str>);

pub(crate) fn actions(v: Vec<LedgerAction>) -> Vec<PyLedgerAction> {
    v.into_iter().map(|a| PyLedgerAction { inner: a.into() }).collect()
}

impl<const N: usize> Out for [(&'static str, u64); N] {
    type Py = BTreeMap<&'static str, u64>;
    fn out(self) -> PyResult<Self::Py> {
        Ok(BTreeMap::from(self))
    }
}

outs! {
    Vec<LedgerAction> => Vec<PyLedgerAction> = |v| actions(v);
    PushPlan => PushTuple = |p| {
        let (src_ssm, dst_ssm) = (p.ssm_slots.map(|(s, _)| s), p.ssm_slots.map(|(_, d)| d));
        (p.epoch, p.src_block_ids, p.dst_block_ids, p.num_tokens, src_ssm, dst_ssm)
    };
    Option<QuorumDecision> => Option<QuorumVerdict> = |v| v.map(|d| match d {
        QuorumDecision::Success => ("success", None, None),
        QuorumDecision::Failure { rank, outcome } => ("failure", Some(rank), Some(outcome.name())),
    });
}

convs! {
    /// One rank's terminal outcome: `"ok"`, `"error"`, `"timeout"` or `"may_still_write"`.
    Outcome: Text => RankOutcome = |f, v| RankOutcome::parse(v.get(f)?).py();
    /// An int as given, for the core to check.
    Given: Int => disagg_core::args::Int = |_f, v| Ok(v.0);
    /// A transfer handle's state: `"running"`, `"done"`, `"timeout"` or `"error"`.
    State: Text => HandleState = |f, v| HandleState::parse(v.get(f)?).py();
    /// The `destination` each decode rank's metadata states (`None` when it states none).
    Destinations: Vec<Py<PyAny>> => Vec<Option<PushDestination>>
        = |_f, v| Python::attach(|py| v.iter().map(|m| push_destination(m.bind(py))).collect());
    /// Request ids.
    Rids: Vec<Int> => Vec<u64>
        = |_f, v| v.into_iter().map(|r| U64::conv("request_id", r)).collect();
    /// `(request_id, flag)` pairs.
    RidPairs: Vec<(Int, bool)> => Vec<(u64, bool)>
        = |_f, v| v.into_iter().map(|(r, b)| Ok((U64::conv("request_id", r)?, b))).collect();
    /// `(request_id, outcome or None)` pairs.
    RidOutcomes: Vec<(Int, Option<bool>)> => Vec<(u64, Option<bool>)>
        = |_f, v| v.into_iter().map(|(r, o)| Ok((U64::conv("request_id", r)?, o))).collect();
}

type PushTuple = (u64, Vec<u32>, Vec<u32>, u32, Option<u32>, Option<u32>);

fn push_destination(meta: &Bound<'_, PyAny>) -> PyResult<Option<PushDestination>> {
    let Ok(meta) = meta.cast::<PyDict>() else { return Ok(None) };
    let Some(dest) = meta.get_item("destination")? else { return Ok(None) };
    PushDestination::from_wire(&to_wire(&dest, "destination")?).map(Some).py()
}

/// Decode-side import ledger over its own block and SSM slot pools.
#[pyclass(name = "ImportLedger", module = "disagg_rs", frozen)]
pub struct PyImportLedger {
    pub(crate) inner: Arc<Mutex<ImportLedger>>,
}

core_methods!(PyImportLedger, lock_with, inner, pools Import,
ctors {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size_tokens, num_ssm_slots=Int::of(0), *, world_size=Int::of(1),
        rank=Int::of(0), pull=Flag::of(true), lookahead_tokens=Int::of(0),
        drain_horizon=Int::of(30_000_000_000), clock_offset_bound=Int::of(1_000_000_000)
    ), text_signature = "(num_blocks, block_size_tokens, num_ssm_slots=0, *, world_size=1, \
        rank=0, pull=True, lookahead_tokens=0, drain_horizon=30000000000, \
        clock_offset_bound=1000000000)")]
    fn new(num_blocks: U32, block_size_tokens: U32, num_ssm_slots: U32, world_size: U32,
        rank: U32, pull: Bool, lookahead_tokens: U32, drain_horizon: U64, clock_offset_bound: U64)
        = Arc::new(ImportLedger::new(num_blocks, block_size_tokens, num_ssm_slots,
            ImportLedgerConfig {
                world_size, rank, pull, lookahead_tokens, drain_horizon, clock_offset_bound,
            },
        ).py()?.into());
}
calls {
    /// The local handle of a quarantined attempt settled.
    fn settle(request_id: U64, epoch: U64) -> Vec<PyLedgerAction> = settle(request_id, epoch);
    /// Abort a request at any stage (unknown ids are counted no-ops).
    fn abort(request_id: U64, now: U64) -> Vec<PyLedgerAction> = abort(request_id, now);
    /// Quarantined `(request_id, epoch)` pairs due at `now` (see `ImportLedger::quarantine_due`).
    fn quarantine_due(now: U64) -> Vec<(u64, u64)> = quarantine_due(now);
    /// Expire deadlines, drain quarantines past their horizon, start what fits.
    fn poll(now: U64) -> Vec<PyLedgerAction> = poll(now);
    /// Engine reset; `ResetRefusedError` (nothing changed) while anything may still be written.
    fn reset(now: U64) -> Vec<PyLedgerAction> = reset(now);
    /// Verify conservation and ownership; raises `ConservationError`.
    fn check() -> () = check();
    /// Event counters by name.
    fn counters() -> BTreeMap<&'static str, u64> = counters().named();
    /// Live handoffs (deferred + importing + ready).
    #[getter] fn pending_kv_import_count() -> usize = pending_kv_import_count();
    /// Whether an admission point has work.
    #[getter] fn has_admittable_kv_import() -> bool = has_admittable_kv_import();
    /// Handoffs waiting for capacity.
    #[getter] fn num_deferred() -> usize = num_deferred();
    /// Deferred request ids, oldest first.
    fn deferred_ids() -> Vec<u64> = deferred_ids();
    /// Two-sided transports: see `ImportLedger::drain_started_pushes`.
    fn drain_started_pushes() -> Vec<(u64, u64)> = drain_started_pushes();
    /// Handoffs with transfers in flight.
    #[getter] fn num_importing() -> usize = num_importing();
    /// Complete handoffs waiting for admission.
    #[getter] fn num_ready() -> usize = num_ready();
    /// `"deferred"`, `"importing"`, `"ready"`, or `None` if not live.
    fn state_of(request_id: U64) -> Option<&'static str> = state_of(request_id);
    /// Failed attempts whose destinations may still be written.
    #[getter] fn num_quarantined() -> usize = num_quarantined();
    /// Blocks held in quarantine.
    #[getter] fn num_quarantined_blocks() -> usize = num_quarantined_blocks();
    /// Current attempt epoch of a live request.
    fn epoch_of(request_id: U64) -> Option<u64> = epoch_of(request_id);
    /// See `ImportLedger::hold_quarantine`; returns whether the quarantine was kept.
    fn hold_quarantine(request_id: U64, epoch: U64, running: Raw<bool>, now: U64) -> bool
        = hold_quarantine(request_id, epoch, running, now);
    /// One rank's terminal report (`outcome`: `"ok"`, `"error"`, `"timeout"`, `"may_still_write"`).
    fn report(request_id: U64, epoch: U64, rank: U32, outcome: Outcome, now: U64)
        -> Vec<PyLedgerAction> = report(request_id, epoch, rank, outcome, now);
    /// Admission point (see `ImportLedger::admit`; `now` as read after the completions).
    #[pyo3(signature = (batch_room, now=None))]
    fn admit(batch_room: U32, now: Opt<U64>) -> Vec<PyLedgerAction> = admit(batch_room, now);
    /// Speculative lookahead tokens reserved after the resume tokens of every import.
    #[getter] fn lookahead_tokens() -> u32 = config().lookahead_tokens;
}
statics {
    /// `admission::continuation_blocks`: blocks needed beyond the prompt blocks.
    #[pyo3(signature = (prompt_length, input_token_count, block_size, mtp_kv_cache=Flag::of(false)),
        text_signature = "(prompt_length, input_token_count, block_size, mtp_kv_cache=False)")]
    fn continuation_blocks(prompt_length: U64, input_token_count: U64, block_size: U64,
        mtp_kv_cache: Bool) -> u64 = admission::continuation_blocks(
            prompt_length, input_token_count, block_size, mtp_kv_cache);
    /// `admission::BatchRoom::fits`: whether one more request of `input_tokens` fits.
    fn batch_fits(total_request_count: U64, max_requests: U64, active_token_count: U64,
        max_tokens: U64, input_tokens: U64) -> bool
        = BatchRoom { total_requests: total_request_count, max_requests,
            active_tokens: active_token_count, max_tokens }.fits(input_tokens);
    /// `admission::check_prefilled_admission` (see `disagg_rs.decode_admission`).
    #[pyo3(signature = (
        request_id, prompt_length, prompt_blocks, continuation_blocks, input_tokens, *,
        has_ssm_slot, block_size, num_speculative_tokens, mtp_kv_cache, hybrid,
        total_request_count, max_requests, active_token_count, max_tokens
    ))]
    fn check_prefilled_admission(request_id: U64, prompt_length: U64, prompt_blocks: U64,
        continuation_blocks: U64, input_tokens: U64, has_ssm_slot: Bool, block_size: U64,
        num_speculative_tokens: U64, mtp_kv_cache: Bool, hybrid: Bool, total_request_count: U64,
        max_requests: U64, active_token_count: U64, max_tokens: U64) -> ()
        = admission::check_prefilled_admission(
            &admission::PrefilledRequest {
                request_id, prompt_len: prompt_length, prompt_blocks, continuation_blocks,
                input_tokens, has_ssm_slot,
            },
            &BatchRoom { total_requests: total_request_count, max_requests,
                active_tokens: active_token_count, max_tokens },
            &admission::DecodeSettings { block_size, num_speculative_tokens, mtp_kv_cache, hybrid },
        );
    /// `admission::import_deadline` (`MetadataError` unless `lease_ns` is an int >= 2).
    #[pyo3(signature = (request_id, now, timeout, lease_ns=None))]
    fn import_deadline(request_id: U64, now: U64, timeout: U64, lease_ns: Opt<Given>) -> u64
        = lease_ns.map(|v| admission::ticket_int(request_id, "lease_ns", &v)).transpose()
            .and_then(|lease| admission::import_deadline(request_id, now, timeout, lease));
    /// `admission::source_lease_of`: `(lease_until_wall, now_wall)` for `submit`, or `None`s.
    #[pyo3(signature = (request_id, lease_until_wall_ns=None, now_wall=None))]
    fn source_lease(request_id: U64, lease_until_wall_ns: Opt<Given>, now_wall: Opt<Given>)
        -> (Option<u64>, Option<u64>)
        = admission::source_lease_of(request_id, lease_until_wall_ns.as_ref(), now_wall.as_ref())
            .map(Option::unzip);
    /// `admission::resume_finishes`: whether the handed-off tokens already finish a request.
    #[pyo3(signature = (resume_tokens, max_new_tokens, termination_id=None, stop_word_ids=Vec::new()),
        text_signature = "(resume_tokens, max_new_tokens, termination_id=None, stop_word_ids=[])")]
    fn resume_finishes(resume_tokens: I64s, max_new_tokens: I64, termination_id: Opt<I64>,
        stop_word_ids: Each<I64s>) -> bool
        = admission::resume_finishes(
            &resume_tokens, max_new_tokens, termination_id, &stop_word_ids);
}
methods {
    /// Share of the source's pin lease (percent) an import may use, submit to admission.
    #[classattr]
    const LEASE_READ_PERCENT: u64 = admission::LEASE_READ_PERCENT;

    /// `ImportLedger::submit`: `prompt_tokens` (hashed here) or `num_prompt_tokens` with
    /// optional `prompt_hashes`; a source lease is `lease_until_wall` with `now_wall`.
    #[pyo3(signature = (
        request_id, prompt_tokens=None, *, num_prompt_tokens=None, prompt_hashes=None,
        src_block_ids, src_block_size_tokens=None, resume_tokens=Int::of(0), has_ssm=Flag::of(false),
        finished=Flag::of(false), deadline, now, reuse_align_tokens=Int::of(1),
        lease_until_wall=None, now_wall=None
    ), text_signature = "($self, request_id, prompt_tokens=None, *, num_prompt_tokens=None, \
        prompt_hashes=None, src_block_ids, src_block_size_tokens=None, resume_tokens=0, \
        has_ssm=False, finished=False, deadline, now, reuse_align_tokens=1, \
        lease_until_wall=None, now_wall=None)")]
    fn submit(&self, py: Python<'_>, request_id: Int, prompt_tokens: Option<&Bound<'_, PyAny>>,
        num_prompt_tokens: Option<Int>, prompt_hashes: Option<IntList>, src_block_ids: IntList,
        src_block_size_tokens: Option<Int>, resume_tokens: Int, has_ssm: Flag, finished: Flag,
        deadline: Int, now: Int, reuse_align_tokens: Int, lease_until_wall: Option<Int>,
        now_wall: Option<Int>) -> PyResult<Vec<PyLedgerAction>> {
        conv!(request_id: U64, has_ssm: Bool, finished: Bool, prompt_hashes: Opt<U64s>);
        conv!(lease_until_wall: Opt<U64>, now_wall: Opt<U64>);
        let source_lease = SourceLease::pair(lease_until_wall, now_wall).py()?;
        conv!(reuse_align_tokens: U32);
        let prompt_tokens = prompt_tokens.map(tokens_arg).transpose()?;
        conv!(src_block_ids: Ids, resume_tokens: U32, deadline: U64, now: U64);
        conv!(src_block_size_tokens: Opt<U32>, num_prompt_tokens: Opt<U32>);
        let inner = Arc::clone(&self.inner);
        let out = py.detach(move || -> PyResult<Vec<LedgerAction>> {
            let mut l = lock(&inner)?;
            let (num_prompt_tokens, prompt_hashes) =
                l.prompt_facts(prompt_tokens.as_deref(), num_prompt_tokens, prompt_hashes).py()?;
            let req = ImportRequest {
                request_id, num_prompt_tokens, prompt_hashes, src_block_ids,
                src_block_size_tokens: l.src_block_size(src_block_size_tokens), resume_tokens,
                has_ssm, finished, deadline, reuse_align_tokens, source_lease,
            };
            l.submit(req, now).py()
        })?;
        Ok(actions(out))
    }

});

/// Prefill-side pin ledger over its own block and SSM slot pools.
#[pyclass(name = "PinLedger", module = "disagg_rs", frozen)]
pub struct PyPinLedger {
    pub(crate) inner: Arc<Mutex<PinLedger>>,
}

core_methods!(PyPinLedger, lock_with, inner, pools Pin,
ctors {
    #[new]
    #[pyo3(signature = (num_blocks, block_size_tokens, num_ssm_slots=Int::of(0)),
        text_signature = "(num_blocks, block_size_tokens, num_ssm_slots=0)")]
    fn new(num_blocks: U32, block_size_tokens: U32, num_ssm_slots: U32)
        = Arc::new(PinLedger::new(num_blocks, block_size_tokens, num_ssm_slots).py()?.into());
}
calls {
    /// A push send started reading the pin (two-sided transports).
    fn begin_push(request_id: U64, epoch: U64) -> () = begin_push(request_id, epoch);
    /// The push send settled; a release that waited for it happens now.
    fn push_settled(request_id: U64, epoch: U64) -> Vec<PyLedgerAction>
        = push_settled(request_id, epoch);
    /// Release pins whose lease ended at `now`.
    fn expire(now: U64) -> Vec<PyLedgerAction> = expire(now);
    /// Release every pin; refused (nothing changed) while a push may still read.
    fn reset() -> Vec<PyLedgerAction> = reset();
    /// Verify conservation; raises `ConservationError`.
    fn check() -> () = check();
    /// Event counters by name.
    fn counters() -> BTreeMap<&'static str, u64> = counters().named();
    /// Live pins.
    #[getter] fn num_pinned() -> usize = num_pinned();
    /// The reference design's `pending_kv_push_count`.
    #[getter] fn pending_kv_push_count() -> usize = pending_kv_push_count();
    /// Request ids of the live pins, ascending.
    fn pinned_request_ids() -> Vec<u64> = pinned_request_ids();
    /// Epoch of a live pin.
    fn epoch_of(request_id: U64) -> Option<u64> = epoch_of(request_id);
    /// `PinLedger::pin` until `RELEASE_KV` or `lease_until`; returns the pin's epoch.
    #[pyo3(signature = (request_id, block_ids, ssm_slot=None, *, lease_until, now))]
    fn pin(request_id: U64, block_ids: Ids, ssm_slot: Opt<Id>, lease_until: U64, now: U64) -> u64
        = pin(request_id, &block_ids, ssm_slot, lease_until, now);
    /// `RELEASE_KV`: idempotent; unknown ids and old epochs are counted no-ops.
    #[pyo3(signature = (request_id, epoch=None))]
    fn release(request_id: U64, epoch: Opt<U64>) -> Vec<PyLedgerAction>
        = release(request_id, epoch);
    /// `PinLedger::start_push` to the first `destination` of `decode_metas`: `(epoch,
    /// src_block_ids, dst_block_ids, num_tokens, src_ssm_slot, dst_ssm_slot)`.
    fn start_push(request_id: U64, decode_metas: Destinations) -> PushTuple
        = start_push(request_id, &decode_metas);
    /// `PinLedger::filler_push`: the `start_push` tuple of a filler; nothing changes.
    fn filler_push(request_id: U64, decode_metas: Destinations) -> PushTuple
        = filler_push(request_id, &decode_metas);
    /// Blocks of a live pin in pinned order (``None`` for an id with no pin).
    fn pinned_blocks(request_id: U64) -> Option<Vec<u32>>
        = pinned(request_id).map(|(b, _)| b.to_vec());
    /// SSM slot of a live pin (``None`` for an id with no pin or a pin without a slot).
    fn pinned_ssm_slot(request_id: U64) -> Option<u32> = pinned(request_id).and_then(|(_, s)| s);
}
methods {});

/// Model-parallel agreement: success when all ranks report ok, failure at the first non-ok
/// report (once); a rank contradicting itself raises `HandoffStateError`.
#[pyclass(name = "CompletionQuorum", module = "disagg_rs", frozen)]
pub struct PyCompletionQuorum {
    inner: Mutex<CompletionQuorum>,
}

core_methods!(PyCompletionQuorum, lock_with, inner,
ctors {
    #[new]
    fn new(world_size: U32) = CompletionQuorum::new(world_size).py()?.into();
}
calls {
    /// Number of ranks.
    #[getter] fn world_size() -> u32 = world_size();
    /// Duplicate reports ignored so far.
    #[getter] fn ignored() -> u64 = ignored();
    /// Attempts with votes not forgotten yet.
    #[getter] fn num_open() -> usize = num_open();
    /// Drop the votes of a finished attempt.
    fn forget(request_id: U64, epoch: U64) -> () = forget((request_id, epoch));
    /// Record a report: `None` (no decision yet or already decided) or the decision.
    fn report(request_id: U64, epoch: U64, rank: U32, outcome: Outcome) -> Option<QuorumVerdict>
        = report((request_id, epoch), rank, outcome);
}
statics {
    /// `RankOutcome::fold_local` of the handles' states: `None` while one runs.
    fn local_outcome(failed_locally: Bool, handle_states: Each<State>) -> Option<&'static str>
        = RankOutcome::fold_local(failed_locally, &handle_states).map(RankOutcome::name);
}
methods {});

/// `disagg_core::reference::ReferenceImports`: a reference-design engine's imports.
#[pyclass(name = "ReferenceImports", module = "disagg_rs", frozen)]
pub struct PyReferenceImports(Mutex<disagg_core::reference::ReferenceImports>);

core_methods!(PyReferenceImports, lock_with, 0,
ctors {
    #[new]
    fn new() = disagg_core::reference::ReferenceImports::new().into();
}
calls {
    fn start(request_id: U64, safe: Raw<bool>) -> () = start(request_id, safe);
    fn importing() -> Vec<u64> = importing();
    fn unreported() -> Vec<u64> = unreported();
    fn decide(request_id: U64, failed: Raw<bool>) -> () = decide(request_id, failed);
    fn decided_in_order() -> Vec<(u64, bool)> = decided_in_order();
    fn admitted(request_id: U64) -> () = admitted(request_id);
    fn may_release(request_id: U64) -> bool = may_release(request_id);
    #[getter] fn num_importing() -> usize = num_importing();
    #[getter] fn num_quarantined() -> usize = num_quarantined();
    fn report(outcomes: RidOutcomes, shared: Raw<bool>, model_parallel: U64) -> Vec<(u64, bool)>
        = report(&outcomes, shared, model_parallel);
    /// True: release the storage; False: it was quarantined.
    fn failed(request_id: U64, quiet: Raw<bool>) -> bool
        = failed(request_id, quiet).map(|s| s == disagg_core::reference::FailedStorage::Release);
    fn reset(pinned: Rids, pushes: RidPairs, imports: RidPairs) -> ()
        = reset(&pinned, &pushes, &imports);
}
methods {});
