//! Decisions of the handoff mixin around its ledgers: the limits a request's sampling
//! parameters set on an import, how a prompt may reuse the decode's prefix cache, the
//! arguments of a pull, this rank's outcome of an import from its transfer handles, the
//! model-parallel ranks' gathered reports folded into the import ledger, how a failed import
//! is reported, and what refuses a reset or a close.
//!
//! Pure functions of plain values (and the ledger): the engine polls its transfer handles and
//! reads its records, and carries the answer out.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{DisaggError, DisaggResult};
use crate::integrity;
use crate::ledger::admission::{import_deadline, resume_finishes, source_lease_end};
use crate::ledger::{
    HandleState, ImportLedger, LedgerAction, PinLedger, PushDestination, RankOutcome, StartImport,
};
use crate::tags;
use crate::wire::ticket::{DecodeNeeds, HandoffTicket};
use crate::wire::value::{Obj, WireValue};

/// A request's sampling parameters, as given: the reference design's `SamplingParams` (or any
/// object with its attributes), or a bare number of tokens to generate (then only
/// `num_tokens_to_generate` is set).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SamplingGiven {
    /// How the parameters print, for an error naming them.
    pub described: String,
    /// `num_tokens_to_generate`, when the object has it.
    pub num_tokens_to_generate: Option<i64>,
    /// `max_new_tokens`, read when `num_tokens_to_generate` is missing.
    pub max_new_tokens: Option<i64>,
    /// `termination_id`; a negative one means none.
    pub termination_id: Option<i64>,
    /// `stop_word_ids`: token sequences that end the request (none when not given).
    pub stop_word_ids: Option<Vec<Vec<i64>>>,
}

impl SamplingGiven {
    /// Parameters given as a bare number of tokens to generate: only that is set.
    #[must_use]
    pub fn tokens(described: String, num_tokens_to_generate: i64) -> Self {
        Self { described, num_tokens_to_generate: Some(num_tokens_to_generate), ..Self::default() }
    }
}

/// What an import's sampling parameters decide before it is submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportLimits {
    /// Tokens the request may generate.
    pub max_new_tokens: i64,
    /// Whether the handed-off tokens already finish it (it completes without a forward step).
    pub finished: bool,
}

/// The limits of an import whose prefill handed off `resume`: the token limit
/// (`num_tokens_to_generate`, else `max_new_tokens`; a `Wire` error naming `sampling_params`
/// without either), and whether `resume` already reaches it, ends with the termination token
/// (the request's own when >= 0, else the engine's `eos`) or with a stop word.
pub fn import_limits(
    given: &SamplingGiven,
    eos: Option<i64>,
    resume: &[i64],
) -> DisaggResult<ImportLimits> {
    let limit = given.num_tokens_to_generate.or(given.max_new_tokens).ok_or_else(|| {
        let detail = format!(
            "sampling_params={} has neither num_tokens_to_generate nor max_new_tokens",
            given.described
        );
        DisaggError::wire("sampling_params", detail)
    })?;
    let termination = given.termination_id.filter(|&t| t >= 0).or(eos);
    let stops = given.stop_word_ids.as_deref().unwrap_or_default();
    let finished = resume_finishes(resume, limit, termination, stops);
    Ok(ImportLimits { max_new_tokens: limit, finished })
}

/// How a failed import is reported: to the driver (`reason` and `detail`, the failure reason
/// is `reason + detail`) and to the request's future (`message`, of an integrity error when
/// `integrity`, else of a transfer error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportFailure {
    /// `integrity` when the written state failed the digest check, else the ledger's reason.
    pub reason: String,
    /// What names the failure's cause: the mismatching cell, or the first error a rank saw
    /// (in parentheses); empty when neither is known.
    pub detail: String,
    /// Whether the failure is an integrity failure.
    pub integrity: bool,
    /// The message of the exception the request's future receives.
    pub message: String,
}

/// The report of `request_id`'s failed import: the ledger gave `reason`; `mismatch` describes
/// the first cell that failed the digest check (it wins over every other cause) and
/// `rank_error` the first transport error a rank reported (an empty one is no error).
pub fn import_failure(
    request_id: u64,
    reason: &str,
    mismatch: Option<&str>,
    rank_error: Option<&str>,
) -> ImportFailure {
    if let Some(m) = mismatch {
        return ImportFailure {
            reason: "integrity".into(),
            detail: format!(" {m}"),
            integrity: true,
            message: format!("KV import of request {request_id} failed the integrity check: {m}"),
        };
    }
    let detail =
        rank_error.filter(|e| !e.is_empty()).map_or_else(String::new, |e| format!(" ({e})"));
    ImportFailure {
        reason: reason.into(),
        message: format!("KV import of request {request_id} failed: {reason}{detail}"),
        detail,
        integrity: false,
    }
}

/// How an import's prompt may reuse blocks the decode already caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptReuse {
    /// Any cached prefix (the ledger hashes the prompt).
    Any,
    /// Only whole chunks of this many tokens: a verifying decode skips the digest entries of
    /// the reused chunks, so reuse must end on a chunk boundary.
    Chunks(u32),
    /// None at all: a verifying decode whose digest has no chunks checks the whole prompt.
    Nothing,
}

/// How a decode that does (`verifying`) or does not check the digest may reuse its prefix
/// cache for a prompt whose digest is chunked by `chunk_tokens` (`None`: one chunk).
pub fn prompt_reuse(verifying: bool, chunk_tokens: Option<u32>) -> PromptReuse {
    match (verifying, chunk_tokens) {
        (false, _) => PromptReuse::Any,
        (true, Some(c)) => PromptReuse::Chunks(c),
        (true, None) => PromptReuse::Nothing,
    }
}

/// What an import's request decides before its submission to the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportSubmission {
    /// Its token limit and whether the handed-off tokens already finish it.
    pub limits: ImportLimits,
    /// How its prompt may reuse the decode's prefix cache.
    pub reuse: PromptReuse,
}

/// The submission of the import of `request_id` (`None`: not a 64-bit int; `repr` describes
/// it): its [`import_limits`], then, on a `two_sided` transport, an `Argument` error for an
/// id its state cannot be tagged with (see [`tags::two_sided_tag_named`]), and its
/// [`prompt_reuse`] (`integrity`: the digest's chunk tokens when this decode verifies).
pub fn import_submission(
    given: &SamplingGiven,
    eos: Option<i64>,
    resume: &[i64],
    request_id: Option<i64>,
    repr: impl FnOnce() -> String,
    two_sided: bool,
    integrity: Option<Option<u32>>,
) -> DisaggResult<ImportSubmission> {
    let limits = import_limits(given, eos, resume)?;
    if two_sided {
        tags::two_sided_tag_named(request_id, repr, "kv")?;
    }
    let reuse = prompt_reuse(integrity.is_some(), integrity.flatten());
    Ok(ImportSubmission { limits, reuse })
}

/// A decode's reading of `ticket` for an import with sampling parameters `given` on a rank
/// that `needs` it (its end-of-sequence token `eos`, whether its KV transport is
/// `two_sided`, its `clock`: the deadline's clock now, the import timeout, and its wall
/// clock when it reads one): the ticket parsed and checked against the needs
/// ([`HandoffTicket::check_for_decode`]), the digest's chunking read when it verifies, then
/// the [`import_submission`], the [`import_deadline`] by the ticket's lease and the source's
/// lease end ([`source_lease_end`]), in that order. Returns the ticket, the submission, the
/// deadline and the source lease.
#[allow(clippy::type_complexity)]
pub fn ticket_import(
    ticket: &WireValue,
    given: &SamplingGiven,
    needs: &DecodeNeeds,
    eos: Option<i64>,
    two_sided: bool,
    clock: (u64, u64, Option<i64>),
) -> DisaggResult<(HandoffTicket, ImportSubmission, u64, Option<(u64, u64)>)> {
    let (rid, (now, timeout, wall_now)) = (needs.request_id, clock);
    let t = HandoffTicket::parse(ticket)?;
    t.check_for_decode(needs)?;
    let chunks = if needs.integrity {
        let table = Obj::of(ticket, "")?.get("integrity").unwrap_or(&WireValue::Null);
        Some(integrity::check_wire(table, None)?)
    } else {
        None
    };
    let (id, repr) = (i64::try_from(rid).ok(), || rid.to_string());
    let submission = import_submission(given, eos, &t.resume_tokens, id, repr, two_sided, chunks)?;
    let deadline = import_deadline(rid, now, timeout, t.lease_ns.map(i128::from))?;
    let wall = wall_now.map(i128::from);
    let lease = source_lease_end(rid, t.lease_until_wall_ns.map(i128::from), wall)?;
    Ok((t, submission, deadline, lease))
}

/// What a pull of one state kind passes its transport besides the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PullArgs {
    /// A two-sided receive: the message tag of the request's state kind.
    Tagged,
    /// A one-sided read of the packed copy the prefill staged for this rank.
    Staged,
    /// A direct one-sided read.
    Direct,
}

/// The arguments of a pull of state `kind`: tagged on a two-sided transport; else staged when
/// the prefill packed a copy for this rank (`has_staged`) and the pull reads the whole prompt
/// (`token_start` is 0: the packed layout covers it all, a prefix-trimmed pull reads directly);
/// only KV is staged.
pub fn pull_args(
    two_sided: bool,
    kind: &str,
    token_start: Option<u32>,
    has_staged: bool,
) -> PullArgs {
    if two_sided {
        PullArgs::Tagged
    } else if kind == "kv" && token_start == Some(0) && has_staged {
        PullArgs::Staged
    } else {
        PullArgs::Direct
    }
}

/// One transfer a started import posts: state `kind` from the source's ids to this rank's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportPull {
    /// `kv`, `conv` or `recurrent`.
    pub kind: String,
    /// Source blocks (KV) or the source's SSM slot.
    pub src: Vec<u32>,
    /// Destination blocks (KV) or this rank's SSM slot.
    pub dst: Vec<u32>,
    /// KV: the prompt tokens moved (from `token_start` on); `None` for SSM state.
    pub num_tokens: Option<u32>,
}

/// The transfers of a started import on a rank that moves state `kinds` (`kv` and/or SSM
/// kinds, in posting order): KV when the prompt's `num_tokens` extend past the `token_start`
/// the decode's prefix cache already holds, each SSM kind when the import reserved a slot
/// (`ssm`: the source's slot and this rank's).
pub fn import_pulls(
    kinds: &[String],
    num_tokens: u32,
    token_start: u32,
    src_block_ids: &[u32],
    dst_block_ids: &[u32],
    ssm: Option<(u32, u32)>,
) -> Vec<ImportPull> {
    let kv_tokens = (num_tokens > token_start).then(|| num_tokens - token_start);
    state_transfers(kinds, kv_tokens, src_block_ids, dst_block_ids, ssm)
}

/// The sends of a push (or its filler) from a prefill rank that moves state `kinds` (`kv`
/// and/or SSM kinds, in posting order), as [`ImportPull`]s from this rank's ids to the
/// decode's: KV when the decode has KV ranks (`kv_peers`), the planned `num_tokens` of it;
/// each SSM kind when the pin holds a slot (`ssm`: this rank's slot and the decode's).
pub fn push_sends(
    kinds: &[String],
    kv_peers: bool,
    src_block_ids: &[u32],
    dst_block_ids: &[u32],
    num_tokens: u32,
    ssm: Option<(u32, u32)>,
) -> Vec<ImportPull> {
    state_transfers(kinds, kv_peers.then_some(num_tokens), src_block_ids, dst_block_ids, ssm)
}

/// One transfer per state kind, in `kinds` order: KV's blocks with `kv_tokens` tokens (none
/// when `None`), each SSM kind's slot (none without `ssm`).
fn state_transfers(
    kinds: &[String],
    kv_tokens: Option<u32>,
    src_block_ids: &[u32],
    dst_block_ids: &[u32],
    ssm: Option<(u32, u32)>,
) -> Vec<ImportPull> {
    let transfer = |kind: &String| match (kind.as_str(), ssm) {
        ("kv", _) => kv_tokens.map(|n| ImportPull {
            kind: kind.clone(),
            src: src_block_ids.to_vec(),
            dst: dst_block_ids.to_vec(),
            num_tokens: Some(n),
        }),
        (_, None) => None,
        (_, Some((src, dst))) => Some(ImportPull {
            kind: kind.clone(),
            src: vec![src],
            dst: vec![dst],
            num_tokens: None,
        }),
    };
    kinds.iter().filter_map(transfer).collect()
}

/// An engine's ranks' metadata (its `handoff_static_meta` `ranks`): per rank, its metadata
/// of each state kind (`kv`, `conv`, `recurrent`), `None` where it has none.
pub type RankMetas<M> = [BTreeMap<String, Option<M>>];

/// Each rank's metadata of state `kind`, in rank order, skipping ranks without it.
pub fn of_kind<M: Clone>(ranks: &RankMetas<M>, kind: &str) -> Vec<M> {
    ranks.iter().filter_map(|r| r.get(kind).cloned().flatten()).collect()
}

/// How a ticket names a decode rank among its staged copies: by number, or by the number's
/// text once the ticket crossed a text encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankKey {
    /// The rank as a number.
    Int(i64),
    /// The rank's decimal text.
    Text(String),
}

/// What an import's transfers read of its ticket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TicketSources<M, S> {
    /// The prefill's ranks' metadata (`prefill_meta` `ranks`).
    pub ranks: Vec<BTreeMap<String, Option<M>>>,
    /// The packed copies the prefill staged (`staged`), per decode rank: its key, whether it
    /// holds any ticket, and the tickets.
    pub staged: Vec<(RankKey, bool, S)>,
    /// The prefill's SSM slot (`src_ssm_slot`).
    pub src_ssm_slot: Option<u32>,
}

/// One transfer as the engine posts it to the transport of state `kind`: between the peer
/// ranks' `metas` and the ids, with the transport's keyword arguments (`None`: not passed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Posting<M, S> {
    /// `kv`, `conv` or `recurrent`.
    pub kind: String,
    /// The other engine's ranks' metadata of `kind`.
    pub metas: Vec<M>,
    /// Source blocks (KV) or the source's SSM slot.
    pub src: Vec<u32>,
    /// Destination blocks (KV) or the destination's SSM slot.
    pub dst: Vec<u32>,
    /// A push's own ranks' metadata of `kind` (`src_metas`).
    pub src_metas: Option<Vec<M>>,
    /// KV: the tokens moved (`num_tokens`).
    pub num_tokens: Option<u32>,
    /// A two-sided transfer's message tag (`tag`).
    pub tag: Option<i64>,
    /// The packed copies a one-sided KV pull reads (`staged`).
    pub staged: Option<S>,
}

/// The message tag of `request_id`'s state `kind`, refused (`Argument`) for an id a two-sided
/// transport cannot tag.
fn tag_of(request_id: u64, kind: &str) -> DisaggResult<i64> {
    let rid = i64::try_from(request_id).ok();
    tags::two_sided_tag_named(rid, || request_id.to_string(), kind)
}

/// The tickets staged for decode rank `rank` that hold any: those keyed by its number, else
/// by its text.
fn staged_for<S: Clone>(staged: &[(RankKey, bool, S)], rank: i64) -> Option<S> {
    let find = |key: RankKey| staged.iter().find(|(k, any, _)| *any && *k == key);
    let found = find(RankKey::Int(rank)).or_else(|| find(RankKey::Text(rank.to_string())));
    found.map(|(_, _, s)| s.clone())
}

/// The transfers a started import posts on a rank that moves state `kinds` (see
/// [`import_pulls`]), from the `ticket`'s prefill ranks: tagged on a `two_sided` transport;
/// else a KV pull of the whole prompt reads the copy staged for this rank (`kv_rank`, its
/// global rank; see [`pull_args`]). A slot reserved without the ticket's source slot is a
/// `HandoffMetadata` error naming `src_ssm_slot`.
pub fn import_postings<M: Clone, S: Clone>(
    kinds: &[String],
    start: &StartImport,
    num_tokens: u32,
    ticket: &TicketSources<M, S>,
    two_sided: bool,
    kv_rank: Option<i64>,
) -> DisaggResult<Vec<Posting<M, S>>> {
    let ssm = match (ticket.src_ssm_slot, start.ssm_slot) {
        (_, None) => None,
        (Some(src), Some(dst)) => Some((src, dst)),
        (None, Some(_)) => {
            let detail = "the import reserved an SSM slot but the ticket names no source slot";
            return Err(DisaggError::handoff_metadata("src_ssm_slot", detail));
        }
    };
    let (src, dst, token_start) = (&start.src_block_ids, &start.dst_block_ids, start.token_start);
    let pulls = import_pulls(kinds, num_tokens, token_start, src, dst, ssm);
    let post = |p: ImportPull| {
        let staged = kv_rank.filter(|_| p.num_tokens.is_some());
        let staged = staged.and_then(|rank| staged_for(&ticket.staged, rank));
        let token_start = p.num_tokens.map(|_| token_start);
        let mut posting = Posting::of(of_kind(&ticket.ranks, &p.kind), p, None);
        match pull_args(two_sided, &posting.kind, token_start, staged.is_some()) {
            PullArgs::Tagged => posting.tag = Some(tag_of(start.request_id, &posting.kind)?),
            PullArgs::Staged => posting.staged = staged,
            PullArgs::Direct => {}
        }
        Ok(posting)
    };
    pulls.into_iter().map(post).collect()
}

/// The sends of `request_id`'s push (or its filler) from a prefill rank that moves state
/// `kinds` (see [`push_sends`]) as the pin ledger planned them (`plan`: source and
/// destination blocks, KV tokens, source and destination SSM slots): to the `decode` ranks
/// of each kind (KV only when it has KV ranks), with this engine's `own` ranks' metadata and
/// the message tag.
pub fn push_postings<M: Clone>(
    kinds: &[String],
    request_id: u64,
    plan: &(Vec<u32>, Vec<u32>, u32, Option<u32>, Option<u32>),
    decode: &RankMetas<M>,
    own: &RankMetas<M>,
) -> DisaggResult<Vec<Posting<M, ()>>> {
    let (src, dst, num_tokens, src_slot, dst_slot) = plan;
    let kv_peers = !of_kind(decode, "kv").is_empty();
    let sends = push_sends(kinds, kv_peers, src, dst, *num_tokens, src_slot.zip(*dst_slot));
    let post = |s: ImportPull| {
        let (tag, src_metas) = (tag_of(request_id, &s.kind)?, of_kind(own, &s.kind));
        let posting = Posting::of(of_kind(decode, &s.kind), s, Some(tag));
        Ok(Posting { src_metas: Some(src_metas), ..posting })
    };
    sends.into_iter().map(post).collect()
}

/// `request_id`'s push (or, `filler`, its filler, which changes nothing) to the decode ranks
/// whose metadata `decode` states `destinations`, as the pin ledger plans it
/// ([`PinLedger::start_push`], [`PinLedger::filler_push`]): an id a two-sided transport
/// cannot tag is refused first, nothing changed. Returns the pin's epoch, the KV tokens sent
/// and the [`push_postings`] of a rank moving state `kinds` with its `own` ranks' metadata.
#[allow(clippy::type_complexity)]
pub fn plan_push<M: Clone>(
    pins: &mut PinLedger,
    request_id: u64,
    destinations: &[Option<PushDestination>],
    decode: &RankMetas<M>,
    own: &RankMetas<M>,
    kinds: &[String],
    filler: bool,
) -> DisaggResult<(u64, u32, Vec<Posting<M, ()>>)> {
    tag_of(request_id, "kv")?;
    let plan = if filler {
        pins.filler_push(request_id, destinations)?
    } else {
        pins.start_push(request_id, destinations)?
    };
    let (src, dst) = plan.ssm_slots.unzip();
    let p = (plan.src_block_ids, plan.dst_block_ids, plan.num_tokens, src, dst);
    Ok((plan.epoch, plan.num_tokens, push_postings(kinds, request_id, &p, decode, own)?))
}

impl<M, S> Posting<M, S> {
    /// The posting of transfer `t` to `metas`, tagged `tag`, with nothing else passed.
    fn of(metas: Vec<M>, t: ImportPull, tag: Option<i64>) -> Self {
        let ImportPull { kind, src, dst, num_tokens } = t;
        Self { kind, metas, src, dst, src_metas: None, num_tokens, tag, staged: None }
    }
}

/// What a rank registers of a peer table: for each engine (in table order) whose ranks'
/// metadata could be read (`engines`: each engine's, or why it could not be read),
/// `(engine, kind, metas)` for each of this rank's state `kinds` its ranks state; the engines
/// that could not be read are refused with their error.
#[allow(clippy::type_complexity)]
pub fn peer_registrations<M: Clone>(
    engines: Vec<(String, Result<Vec<BTreeMap<String, Option<M>>>, String>)>,
    kinds: &[String],
) -> (Vec<(String, String, Vec<M>)>, Vec<(String, String)>) {
    let mut plan = Vec::new();
    let mut refused = Vec::new();
    for (engine, ranks) in engines {
        match ranks {
            Ok(ranks) => plan.extend(
                kinds
                    .iter()
                    .map(|kind| (engine.clone(), kind.clone(), of_kind(&ranks, kind)))
                    .filter(|(_, _, metas)| !metas.is_empty()),
            ),
            Err(why) => refused.push((engine, why)),
        }
    }
    (plan, refused)
}

/// Settle, in order, each quarantined attempt `(request_id, epoch, quiet)` whose local
/// transfers are all quiet again (the others stay quarantined): the ledger's actions.
pub fn settle_quiet(
    ledger: &mut ImportLedger,
    quarantines: &[(u64, u64, bool)],
) -> DisaggResult<Vec<LedgerAction>> {
    let mut out = Vec::new();
    for &(request_id, epoch, quiet) in quarantines {
        if quiet {
            out.extend(ledger.settle(request_id, epoch)?);
        }
    }
    Ok(out)
}

/// What one poll of a transfer handle gave: its answer, or the exception it raised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Polled {
    /// It answered whether it is done.
    Answered(bool),
    /// It raised: whether as a timeout, the exception's type name and its message.
    Raised {
        /// Whether the exception is a transfer timeout.
        timed_out: bool,
        /// The exception's type name.
        kind: String,
        /// Its message.
        message: String,
    },
}

impl Polled {
    /// The handle's state, with the error text `"{kind}: {message}"` of a raise (else empty).
    #[must_use]
    pub fn state(&self) -> (HandleState, String) {
        match self {
            Self::Answered(true) => (HandleState::Done, String::new()),
            Self::Answered(false) => (HandleState::Running, String::new()),
            Self::Raised { timed_out, kind, message } => {
                let state = if *timed_out { HandleState::TimedOut } else { HandleState::Failed };
                (state, format!("{kind}: {message}"))
            }
        }
    }
}

/// This rank's terminal outcome of one import from one poll of each of its transfer handles
/// (its state and the error it raised, empty when none) and `failed_locally` (the error of a
/// start that threw), as [`RankOutcome::fold_local`] decides it (`None` while one runs), with
/// the first error seen: the start's, else the first handle's.
pub fn local_outcome(
    failed_locally: Option<&str>,
    polled: &[(HandleState, String)],
) -> (Option<RankOutcome>, String) {
    let states: Vec<HandleState> = polled.iter().map(|(s, _)| *s).collect();
    let outcome = RankOutcome::fold_local(failed_locally.is_some(), &states);
    let first = std::iter::once(failed_locally.unwrap_or_default())
        .chain(polled.iter().map(|(_, e)| e.as_str()))
        .find(|e| !e.is_empty())
        .unwrap_or_default();
    (outcome, first.to_string())
}

/// One rank's terminal report of an import attempt, as every model-parallel rank gathers it.
/// `mismatch` is the digest check's finding (any value the caller keeps for the failure):
/// a rank whose written state fails the check reports an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReport<M> {
    /// The request.
    pub request_id: u64,
    /// Its attempt.
    pub epoch: u64,
    /// What the rank's transfers ended in.
    pub outcome: RankOutcome,
    /// The first cell whose digest did not match, when the rank's state failed the check.
    pub mismatch: Option<M>,
    /// The first transport error the rank saw (empty when none).
    pub detail: String,
}

/// The gathered reports folded into the import ledger: its actions, in report order, and
/// for each request that fails, what its failure is reported with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoldedReports<M> {
    /// The ledger's actions.
    pub actions: Vec<LedgerAction>,
    /// Per started request: the first digest mismatch a rank reported.
    pub mismatches: Vec<(u64, M)>,
    /// Per started request: the first transport error a rank reported, naming the rank.
    pub rank_errors: Vec<(u64, String)>,
}

/// Feed every model-parallel rank's reports (`gathered[rank]`, in rank order) into `ledger`
/// at `now`, all or nothing: a rank outside the ledger's world or a rank contradicting a
/// report it made before is an error and changes nothing. A request's first mismatch and
/// first rank error are kept while its import is started (importing or ready); the failure
/// they cause is among the actions.
pub fn fold_reports<M>(
    ledger: &mut ImportLedger,
    gathered: Vec<Vec<RankReport<M>>>,
    now: u64,
) -> DisaggResult<FoldedReports<M>> {
    let world = ledger.config().world_size;
    if u32::try_from(gathered.len()).map_or(true, |n| n > world) {
        let detail = format!("{} ranks reported, world_size={world}", gathered.len());
        return Err(DisaggError::argument("rank", detail));
    }
    let mut seen = BTreeMap::new();
    for (reports, rank) in gathered.iter().zip(0u32..) {
        for r in reports {
            let outcome = effective(r);
            let earlier = seen.insert((r.request_id, r.epoch, rank), outcome);
            if earlier.is_some_and(|e| e != outcome)
                || ledger.quorum().would_conflict((r.request_id, r.epoch), rank, outcome)
            {
                return Err(DisaggError::State {
                    request_id: r.request_id,
                    detail: format!("epoch {}: rank {rank} contradicts its report", r.epoch),
                });
            }
        }
    }
    let mut out =
        FoldedReports { actions: Vec::new(), mismatches: Vec::new(), rank_errors: Vec::new() };
    // (request, whether a mismatch) already kept: the first of each wins.
    let mut kept: BTreeSet<(u64, bool)> = BTreeSet::new();
    for (reports, rank) in gathered.into_iter().zip(0u32..) {
        for r in reports {
            let outcome = effective(&r);
            let started = matches!(ledger.state_of(r.request_id), Some("importing" | "ready"));
            if let Some(m) = r.mismatch.filter(|_| started && kept.insert((r.request_id, true))) {
                out.mismatches.push((r.request_id, m));
            }
            let failed = outcome != RankOutcome::Ok && !r.detail.is_empty();
            if failed && started && kept.insert((r.request_id, false)) {
                let text = format!("model-parallel rank {rank}: {}", r.detail);
                out.rank_errors.push((r.request_id, text));
            }
            out.actions.extend(ledger.report(r.request_id, r.epoch, rank, outcome, now)?);
        }
    }
    Ok(out)
}

/// A report's outcome as the ledger takes it: a digest mismatch is an error.
fn effective<M>(r: &RankReport<M>) -> RankOutcome {
    if r.mismatch.is_some() {
        RankOutcome::Error
    } else {
        r.outcome
    }
}

/// Every model-parallel rank's digest pieces of one request, in rank order, or a
/// `HandoffState` error naming `integrity` with the first rank's failure: each rank gathered
/// the same list, so every rank raises alike instead of one waiting for the others.
pub fn gathered_pieces<P>(gathered: Vec<Result<Vec<P>, String>>) -> DisaggResult<Vec<P>> {
    let mut pieces = Vec::new();
    for rank in gathered {
        pieces.extend(rank.map_err(|e| DisaggError::HandoffState {
            field: "integrity".into(),
            detail: format!("integrity digest failed on a rank: {e}"),
        })?);
    }
    Ok(pieces)
}

/// Why a reset must wait for the prefill's pins (`pinned` request ids, in order), or `None`
/// when nothing is pinned.
pub fn pinned_refusal(pinned: &[u64]) -> Option<String> {
    (!pinned.is_empty()).then(|| {
        format!(
            "cannot reset while KV handoff blocks remain pinned for requests {pinned:?}: a \
             decode may still be reading them; wait for RELEASE_KV or lease expiry"
        )
    })
}

/// Why closing the transports must wait, or `None`: started imports whose handles are not all
/// quiet (`(request_id, quiet)`), quarantined ones likewise, pushes and fillers in flight;
/// each group's request ids sorted, in that order.
pub fn close_refusal(
    imports: &[(u64, bool)],
    quarantined: &[(u64, bool)],
    pushes: &[u64],
    fillers: &[u64],
) -> Option<String> {
    let loud = |group: &[(u64, bool)]| -> Vec<u64> {
        let mut ids: Vec<u64> = group.iter().filter(|(_, quiet)| !quiet).map(|(r, _)| *r).collect();
        ids.sort_unstable();
        ids
    };
    let sorted = |ids: &[u64]| -> Vec<u64> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids
    };
    let live: Vec<u64> =
        [loud(imports), loud(quarantined), sorted(pushes), sorted(fillers)].concat();
    (!live.is_empty()).then(|| {
        format!(
            "close_kv_transfer: transfers of requests {live:?} are still in flight; close after \
             they settle"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{FailReason, ImportLedgerConfig, ImportRequest};
    use proptest::prelude::*;

    /// A two-rank pull ledger with requests `rids` (4 prompt tokens each) started.
    fn importing(rids: &[u64]) -> ImportLedger {
        let cfg = ImportLedgerConfig { world_size: 2, ..ImportLedgerConfig::default() };
        let mut l = ImportLedger::new(16, 4, 0, cfg).unwrap();
        for &rid in rids {
            let req = ImportRequest {
                request_id: rid,
                num_prompt_tokens: 4,
                prompt_hashes: Vec::new(),
                src_block_ids: vec![0],
                src_block_size_tokens: 4,
                resume_tokens: 1,
                has_ssm: false,
                finished: false,
                deadline: 1_000,
                reuse_align_tokens: 1,
                source_lease: None,
            };
            let started = l.submit(req, 0).unwrap();
            assert!(matches!(started[..], [LedgerAction::StartImport(_)]));
            assert_eq!(l.epoch_of(rid), Some(rid), "the helpers' reports name epoch = request id");
        }
        l
    }

    fn report(
        rid: u64,
        outcome: RankOutcome,
        mismatch: Option<&'static str>,
        detail: &str,
    ) -> RankReport<&'static str> {
        RankReport { request_id: rid, epoch: rid, outcome, mismatch, detail: detail.into() }
    }

    #[test]
    fn a_push_sends_kv_to_kv_peers_and_each_ssm_kind_with_a_slot() {
        let kinds: Vec<String> = ["kv", "conv", "recurrent"].map(String::from).to_vec();
        let sends = push_sends(&kinds, true, &[1, 2], &[7, 8], 5, Some((3, 9)));
        let got: Vec<_> =
            sends.iter().map(|s| (s.kind.as_str(), &s.src[..], &s.dst[..], s.num_tokens)).collect();
        assert_eq!(
            got,
            [
                ("kv", &[1, 2][..], &[7, 8][..], Some(5)),
                ("conv", &[3][..], &[9][..], None),
                ("recurrent", &[3][..], &[9][..], None)
            ]
        );
        // No KV ranks on the decode: no KV send; no slot: no SSM send; no kinds: nothing.
        assert!(push_sends(&kinds, false, &[1], &[7], 5, None).is_empty());
        let ssm_only = push_sends(&kinds[1..], true, &[1], &[7], 5, Some((0, 4)));
        assert_eq!(
            ssm_only.iter().map(|s| s.kind.as_str()).collect::<Vec<_>>(),
            ["conv", "recurrent"]
        );
        assert!(push_sends(&[], true, &[1], &[7], 5, Some((0, 4))).is_empty());
    }

    #[test]
    fn peers_register_each_stated_kind_and_unreadable_ones_are_refused() {
        let kinds: Vec<String> = ["kv", "conv"].map(String::from).to_vec();
        let engines = vec![
            (
                "p0".to_string(),
                Ok(ranks(&[&[("kv", Some(1)), ("conv", Some(3))], &[("kv", Some(2))]])),
            ),
            ("bad".to_string(), Err("KeyError: 'meta'".to_string())),
            ("p1".to_string(), Ok(ranks(&[&[("kv", None), ("conv", Some(4))]]))),
            ("p2".to_string(), Ok(ranks(&[&[("recurrent", Some(5))]]))),
        ];
        let (plan, refused) = peer_registrations(engines, &kinds);
        let s = |x: &str| x.to_string();
        assert_eq!(
            plan,
            [
                (s("p0"), s("kv"), vec![1, 2]),
                (s("p0"), s("conv"), vec![3]),
                (s("p1"), s("conv"), vec![4])
            ]
        );
        assert_eq!(refused, [(s("bad"), s("KeyError: 'meta'"))]);
    }

    #[test]
    fn only_quiet_quarantines_settle() {
        let quarantine = |l: &mut ImportLedger| {
            for rid in [1, 2] {
                l.abort(rid, 5).unwrap();
            }
            assert_eq!(l.num_quarantined(), 2, "an aborted started import is quarantined");
        };
        let (mut l, mut model) = (importing(&[1, 2]), importing(&[1, 2]));
        quarantine(&mut l);
        quarantine(&mut model);
        let got = settle_quiet(&mut l, &[(1, 1, false), (2, 2, true)]).unwrap();
        assert_eq!(got, model.settle(2, 2).unwrap());
        assert!(!got.is_empty());
        assert_eq!(l.num_quarantined(), 1);
        assert_eq!(settle_quiet(&mut l, &[(1, 1, true)]).unwrap(), model.settle(1, 1).unwrap());
        assert_eq!(l.num_quarantined(), 0);
    }

    #[test]
    fn a_verifying_decode_reuses_whole_digest_chunks_only() {
        assert_eq!(prompt_reuse(false, Some(8)), PromptReuse::Any);
        assert_eq!(prompt_reuse(false, None), PromptReuse::Any);
        assert_eq!(prompt_reuse(true, Some(8)), PromptReuse::Chunks(8));
        assert_eq!(prompt_reuse(true, None), PromptReuse::Nothing);
    }

    #[test]
    fn only_a_whole_prompt_kv_pull_reads_the_staged_copy() {
        assert_eq!(pull_args(true, "kv", Some(0), true), PullArgs::Tagged);
        assert_eq!(pull_args(true, "conv", None, false), PullArgs::Tagged);
        assert_eq!(pull_args(false, "kv", Some(0), true), PullArgs::Staged);
        assert_eq!(pull_args(false, "kv", Some(4), true), PullArgs::Direct);
        assert_eq!(pull_args(false, "kv", None, true), PullArgs::Direct);
        assert_eq!(pull_args(false, "kv", Some(0), false), PullArgs::Direct);
        assert_eq!(pull_args(false, "recurrent", Some(0), true), PullArgs::Direct);
    }

    #[test]
    fn an_import_pulls_the_kv_past_its_cached_prefix_and_each_ssm_kind_into_its_slot() {
        let kinds: Vec<String> = ["kv", "conv", "recurrent"].map(String::from).to_vec();
        let pulls = import_pulls(&kinds, 10, 4, &[7, 8], &[1, 2], Some((3, 5)));
        let pull = |kind: &str, src: Vec<u32>, dst: Vec<u32>, num_tokens| ImportPull {
            kind: kind.into(),
            src,
            dst,
            num_tokens,
        };
        assert_eq!(
            pulls,
            vec![
                pull("kv", vec![7, 8], vec![1, 2], Some(6)),
                pull("conv", vec![3], vec![5], None),
                pull("recurrent", vec![3], vec![5], None),
            ]
        );
        // The whole prompt cached: no KV moves; no slot reserved: no SSM state moves.
        assert!(import_pulls(&kinds, 4, 4, &[], &[], None).is_empty());
        let ssm_only = import_pulls(&kinds[1..], 10, 0, &[7], &[1], Some((3, 5)));
        assert_eq!(
            ssm_only.iter().map(|p| p.kind.as_str()).collect::<Vec<_>>(),
            ["conv", "recurrent"]
        );
    }

    #[test]
    fn a_poll_answer_or_raise_gives_the_handle_state_and_its_error_text() {
        assert_eq!(Polled::Answered(true).state(), (HandleState::Done, String::new()));
        assert_eq!(Polled::Answered(false).state(), (HandleState::Running, String::new()));
        let raised =
            |timed_out| Polled::Raised { timed_out, kind: "E".into(), message: "m".into() };
        assert_eq!(raised(true).state(), (HandleState::TimedOut, "E: m".into()));
        assert_eq!(raised(false).state(), (HandleState::Failed, "E: m".into()));
    }

    #[test]
    fn bare_tokens_set_only_the_number_to_generate() {
        let given = SamplingGiven::tokens("7".into(), 7);
        let want = SamplingGiven {
            described: "7".into(),
            num_tokens_to_generate: Some(7),
            ..SamplingGiven::default()
        };
        assert_eq!(given, want);
    }

    #[test]
    fn the_local_outcome_names_the_first_error_seen() {
        let polled = |v: &[(HandleState, &str)]| -> Vec<(HandleState, String)> {
            v.iter().map(|(s, e)| (*s, (*e).to_string())).collect()
        };
        let running = polled(&[(HandleState::Running, ""), (HandleState::Failed, "E1")]);
        assert_eq!(local_outcome(None, &running), (None, "E1".into()));
        let failed = polled(&[(HandleState::Done, ""), (HandleState::Failed, "E1")]);
        assert_eq!(local_outcome(None, &failed), (Some(RankOutcome::Error), "E1".into()));
        assert_eq!(
            local_outcome(Some("start"), &failed),
            (Some(RankOutcome::Error), "start".into())
        );
        assert_eq!(local_outcome(Some(""), &[]), (Some(RankOutcome::Error), String::new()));
        let timed = polled(&[(HandleState::TimedOut, "T"), (HandleState::Done, "")]);
        assert_eq!(local_outcome(None, &timed), (Some(RankOutcome::MayStillWrite), "T".into()));
        assert_eq!(local_outcome(None, &[]), (Some(RankOutcome::Ok), String::new()));
    }

    #[test]
    fn gathered_reports_act_as_reported_one_by_one_and_keep_the_first_cause() {
        let gathered = vec![
            vec![report(1, RankOutcome::Ok, None, ""), report(2, RankOutcome::Ok, Some("M0"), "")],
            vec![
                report(1, RankOutcome::Ok, None, ""),
                report(2, RankOutcome::Error, Some("M1"), "boom"),
                report(3, RankOutcome::Error, None, "E3"),
            ],
        ];
        let mut model = importing(&[1, 2, 3]);
        let mut want = Vec::new();
        for (rank, rid, outcome) in
            [(0, 1, RankOutcome::Ok), (0, 2, RankOutcome::Error), (1, 1, RankOutcome::Ok)]
                .into_iter()
                .chain([(1, 2, RankOutcome::Error), (1, 3, RankOutcome::Error)])
        {
            want.extend(model.report(rid, rid, rank, outcome, 5).unwrap());
        }
        let mut l = importing(&[1, 2, 3]);
        let got = fold_reports(&mut l, gathered, 5).unwrap();
        assert_eq!(got.actions, want);
        assert_eq!(l.state_of(1), Some("ready"));
        assert_eq!(l.state_of(2), None, "a mismatch is an error");
        // Request 2 failed at rank 0's mismatch: rank 1's reports of it come too late.
        assert_eq!(got.mismatches, vec![(2, "M0")]);
        assert_eq!(got.rank_errors, vec![(3, "model-parallel rank 1: E3".to_string())]);
        assert!(matches!(
            got.actions[..],
            [
                LedgerAction::Fail { request_id: 2, reason: FailReason::RankError, .. },
                LedgerAction::Fail { request_id: 3, .. }
            ]
        ));
    }

    #[test]
    fn a_bad_batch_of_reports_changes_nothing() {
        let mut l = importing(&[1]);
        let before = l.counters();
        let three = vec![Vec::new(), Vec::new(), vec![report(1, RankOutcome::Ok, None, "")]];
        assert!(matches!(fold_reports(&mut l, three, 5), Err(DisaggError::Argument { .. })));
        let contradicting = vec![vec![
            report(1, RankOutcome::Ok, None, ""),
            report(1, RankOutcome::Error, None, ""),
        ]];
        assert!(matches!(fold_reports(&mut l, contradicting, 5), Err(DisaggError::State { .. })));
        l.report(1, 1, 1, RankOutcome::Ok, 5).unwrap();
        let against_earlier = vec![Vec::new(), vec![report(1, RankOutcome::Timeout, None, "")]];
        let before_rank1 = l.counters();
        assert!(fold_reports(&mut l, against_earlier, 5).is_err());
        assert_eq!(l.counters(), before_rank1);
        assert_eq!(before.ignored_messages, before_rank1.ignored_messages);
        // Rank 0's refused reports were not recorded: it may still report an error.
        let failed = fold_reports(&mut l, vec![vec![report(1, RankOutcome::Error, None, "")]], 6);
        assert!(matches!(failed.unwrap().actions[..], [LedgerAction::Fail { request_id: 1, .. }]));
    }

    #[test]
    fn a_ranks_digest_failure_fails_the_whole_digest() {
        assert_eq!(
            gathered_pieces(vec![Ok(vec![1, 2]), Ok(vec![]), Ok(vec![3])]),
            Ok(vec![1, 2, 3])
        );
        let failed = gathered_pieces(vec![Ok(vec![1]), Err("E1".into()), Err("E2".into())]);
        let want = "integrity digest failed on a rank: E1";
        assert_eq!(
            failed,
            Err(DisaggError::HandoffState { field: "integrity".into(), detail: want.into() })
        );
    }

    #[test]
    fn a_reset_waits_for_pins_and_a_close_for_every_transfer_in_flight() {
        assert_eq!(pinned_refusal(&[]), None);
        let pinned = pinned_refusal(&[4, 2]).unwrap();
        assert!(pinned.contains("remain pinned for requests [4, 2]"), "{pinned}");
        assert_eq!(close_refusal(&[(1, true)], &[(2, true)], &[], &[]), None);
        let live =
            close_refusal(&[(9, false), (1, true), (3, false)], &[(2, false)], &[8, 5], &[7]);
        assert_eq!(
            live.unwrap(),
            "close_kv_transfer: transfers of requests [3, 9, 2, 5, 8, 7] are still in flight; \
             close after they settle"
        );
    }

    fn params(num: Option<i64>, max_new: Option<i64>, term: Option<i64>) -> SamplingGiven {
        SamplingGiven {
            described: "P".into(),
            num_tokens_to_generate: num,
            max_new_tokens: max_new,
            termination_id: term,
            stop_word_ids: Some(vec![vec![5, 6], vec![]]),
        }
    }

    #[test]
    fn the_limit_is_num_tokens_to_generate_else_max_new_tokens_else_an_error() {
        let limits = |p: &SamplingGiven| import_limits(p, None, &[1]).map(|l| l.max_new_tokens);
        assert_eq!(limits(&params(Some(4), Some(9), None)), Ok(4));
        assert_eq!(limits(&params(None, Some(9), None)), Ok(9));
        let e = limits(&params(None, None, None)).unwrap_err();
        let want = "sampling_params=P has neither num_tokens_to_generate nor max_new_tokens";
        assert_eq!(e, DisaggError::wire("sampling_params", want));
    }

    #[test]
    fn a_negative_termination_id_falls_back_to_the_engines_eos_token() {
        let finished = |term, eos, resume: &[i64]| {
            import_limits(&params(Some(8), None, term), eos, resume).unwrap().finished
        };
        assert!(finished(Some(3), Some(9), &[3]));
        assert!(!finished(Some(3), Some(9), &[9]));
        assert!(finished(Some(-1), Some(9), &[9]));
        assert!(finished(None, Some(9), &[9]));
        assert!(!finished(None, None, &[9]));
        assert!(finished(None, None, &[5, 6]), "a stop word ends it");
        assert!(!finished(None, None, &[]), "empty stop words never match");
        let no_stops = SamplingGiven { stop_word_ids: None, ..params(Some(8), None, None) };
        assert!(!import_limits(&no_stops, None, &[5, 6]).unwrap().finished, "none given");
    }

    #[test]
    fn a_submission_checks_the_limits_then_the_tag_and_plans_the_prompts_reuse() {
        let given = params(Some(4), None, None);
        let submit = |rid, two_sided, integrity| {
            import_submission(&given, None, &[1], rid, || "R".into(), two_sided, integrity)
        };
        let s = submit(Some(3), true, Some(Some(8))).unwrap();
        assert_eq!(s.limits, import_limits(&given, None, &[1]).unwrap());
        assert_eq!(s.reuse, PromptReuse::Chunks(8));
        assert_eq!(submit(None, false, None).unwrap().reuse, PromptReuse::Any);
        assert_eq!(submit(Some(3), false, Some(None)).unwrap().reuse, PromptReuse::Nothing);
        let untaggable = submit(None, true, None).unwrap_err();
        assert_eq!(untaggable, tags::two_sided_tag_named(None, || "R".into(), "kv").unwrap_err());
        let no_limit = SamplingGiven::default();
        let e = import_submission(&no_limit, None, &[], None, || "R".into(), true, None);
        assert!(matches!(e, Err(DisaggError::Wire { .. })), "the limits are checked first");
    }

    /// A ticket of one KV prefill rank handing off `[7]`, with `extra` entries.
    fn wire_ticket(extra: Vec<(&str, WireValue)>) -> WireValue {
        let list = |v: Vec<WireValue>| WireValue::List(v);
        let map = |e: Vec<(&str, WireValue)>| {
            WireValue::Map(e.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
        };
        let rank = map(vec![("kv", map(vec![]))]);
        let mut e = vec![
            ("src_block_ids", list(vec![WireValue::Int(0)])),
            ("resume_tokens", list(vec![WireValue::Int(7)])),
            ("prefill_meta", map(vec![("ranks", list(vec![rank]))])),
        ];
        e.extend(extra);
        map(e)
    }

    #[test]
    fn a_ticket_import_checks_the_ticket_then_composes_submission_deadline_and_lease() {
        let needs = DecodeNeeds { request_id: 3, sources: vec!["kv".into()], ..Default::default() };
        let given = params(Some(4), None, None);
        let read = |t: &WireValue, g: &SamplingGiven, n: &DecodeNeeds, two_sided, wall| {
            ticket_import(t, g, n, None, two_sided, (100, 1_000, wall))
        };
        let (t, submission, deadline, lease) =
            read(&wire_ticket(vec![]), &given, &needs, false, None).unwrap();
        let want = import_submission(&given, None, &[7], Some(3), String::new, false, None);
        assert_eq!(submission, want.unwrap());
        assert_eq!((t.resume_tokens, deadline, lease), (vec![7], 1_100, None));
        // The ticket's lease caps the deadline; its wall-clock end is read with this side's.
        let leased = wire_ticket(vec![
            ("lease_ns", WireValue::Int(200)),
            ("lease_until_wall_ns", WireValue::Int(900)),
            ("src_block_size_tokens", WireValue::Int(16)),
        ]);
        let (t, _, deadline, lease) = read(&leased, &given, &needs, false, Some(50)).unwrap();
        assert_eq!(deadline, import_deadline(3, 100, 1_000, Some(200)).unwrap());
        assert_eq!((lease, t.src_block_size_tokens), (Some((900, 50)), Some(16)));
        assert_eq!(read(&leased, &given, &needs, false, None).unwrap().3, None);
        // A verifying decode reuses whole digest chunks only.
        let chunked = WireValue::Map(vec![("chunk_tokens".into(), WireValue::Int(8))]);
        let verifying = DecodeNeeds { integrity: true, ..needs.clone() };
        let t = read(&wire_ticket(vec![("integrity", chunked)]), &given, &verifying, false, None);
        assert_eq!(t.unwrap().1.reuse, PromptReuse::Chunks(8));
        // The ticket first (no digest to verify), then the sampling parameters.
        let none = SamplingGiven::default();
        let e = read(&wire_ticket(vec![]), &none, &verifying, false, None);
        assert!(matches!(e, Err(DisaggError::HandoffMetadata { .. })), "{e:?}");
        let e = read(&wire_ticket(vec![]), &none, &needs, false, None);
        assert!(
            matches!(e, Err(DisaggError::Wire { ref field, .. }) if field == "sampling_params")
        );
        let untaggable = DecodeNeeds { request_id: u64::MAX, ..needs.clone() };
        let e = read(&wire_ticket(vec![]), &given, &untaggable, true, None).unwrap_err();
        let rid = u64::MAX.to_string();
        assert_eq!(e, tags::two_sided_tag_named(None, || rid, "kv").unwrap_err());
    }

    #[test]
    fn a_push_is_tagged_then_planned_by_the_pins_and_posted_to_each_kinds_ranks() {
        let mut pins = PinLedger::new(8, 4, 2).unwrap();
        let blocks = pins.pool_mut().allocate(2).unwrap();
        let epoch = pins.pin(5, &blocks, None, 1_000, 0).unwrap();
        let dest = PushDestination {
            dst_block_ids: Some(vec![6, 7]),
            num_tokens: Some(8),
            ..PushDestination::default()
        };
        let (decode, own) = (ranks(&[&[("kv", Some(10))]]), ranks(&[&[("kv", Some(20))]]));
        let kinds = vec!["kv".to_string()];
        let plan = |pins: &mut PinLedger, rid, filler| {
            plan_push(pins, rid, &[None, Some(dest.clone())], &decode, &own, &kinds, filler)
        };
        let (_, n, posts) = plan(&mut pins, 5, true).unwrap();
        assert_eq!(n, 8);
        let (e, n, pushed) = plan(&mut pins, 5, false).unwrap();
        assert_eq!((e, n, &pushed), (epoch, 8, &posts), "a filler sends what the push sends");
        let p = (blocks, vec![6, 7], 8, None, None);
        assert_eq!(pushed, push_postings(&kinds, 5, &p, &decode, &own).unwrap());
        assert!(plan(&mut pins, 5, false).is_err(), "the push is in flight: a second refused");
        // An untaggable id is refused before the ledger is asked (it has no pin either).
        let untaggable = plan(&mut pins, u64::MAX, false).unwrap_err();
        assert_eq!(untaggable, tag_of(u64::MAX, "kv").unwrap_err());
    }

    /// Ranks' metadata: per rank, `(kind, meta)` pairs; a `None` meta is stated as absent.
    fn ranks(r: &[&[(&str, Option<u32>)]]) -> Vec<BTreeMap<String, Option<u32>>> {
        r.iter().map(|rank| rank.iter().map(|(k, m)| ((*k).to_string(), *m)).collect()).collect()
    }

    #[test]
    fn of_kind_skips_ranks_without_the_kind() {
        let r =
            ranks(&[&[("kv", Some(1)), ("conv", None)], &[("conv", Some(2))], &[("kv", Some(3))]]);
        assert_eq!(of_kind(&r, "kv"), [1, 3]);
        assert_eq!(of_kind(&r, "conv"), [2]);
        assert!(of_kind(&r, "recurrent").is_empty());
    }

    #[test]
    fn a_staged_copy_is_found_by_number_then_by_text_and_only_when_it_holds_tickets() {
        let text = |r: &str| RankKey::Text(r.into());
        let staged = vec![(RankKey::Int(1), false, "empty"), (text("1"), true, "t1")];
        assert_eq!(staged_for(&staged, 1), Some("t1"));
        let both = vec![(text("2"), true, "text"), (RankKey::Int(2), true, "int")];
        assert_eq!(staged_for(&both, 2), Some("int"));
        assert_eq!(staged_for(&both, 3), None);
    }

    fn start(token_start: u32, ssm_slot: Option<u32>) -> StartImport {
        StartImport {
            request_id: 5,
            token_start,
            src_block_ids: vec![7, 8],
            dst_block_ids: vec![1, 2],
            ssm_slot,
            ..StartImport::default()
        }
    }

    #[test]
    fn an_imports_postings_read_each_kinds_prefill_ranks_tagged_staged_or_direct() {
        let kinds: Vec<String> = ["kv", "conv"].map(String::from).to_vec();
        let ticket = TicketSources {
            ranks: ranks(&[&[("kv", Some(10)), ("conv", Some(20))], &[("kv", Some(11))]]),
            staged: vec![(RankKey::Int(0), true, "s0")],
            src_ssm_slot: Some(3),
        };
        let got = import_postings(&kinds, &start(0, Some(4)), 8, &ticket, false, Some(0)).unwrap();
        let want_kv = Posting {
            kind: "kv".into(),
            metas: vec![10, 11],
            src: vec![7, 8],
            dst: vec![1, 2],
            src_metas: None,
            num_tokens: Some(8),
            tag: None,
            staged: Some("s0"),
        };
        assert_eq!(got[0], want_kv);
        let conv = Posting {
            kind: "conv".into(),
            metas: vec![20],
            src: vec![3],
            dst: vec![4],
            ..want_kv.clone()
        };
        assert_eq!(got[1], Posting { num_tokens: None, staged: None, ..conv });
        // A prefix-trimmed pull or another rank reads directly; a two-sided one is tagged.
        let trimmed = import_postings(&kinds, &start(4, None), 8, &ticket, false, Some(0)).unwrap();
        assert_eq!((trimmed.len(), trimmed[0].staged, trimmed[0].num_tokens), (1, None, Some(4)));
        let other = import_postings(&kinds, &start(0, None), 8, &ticket, false, Some(1)).unwrap();
        assert_eq!(other[0].staged, None);
        let tagged =
            import_postings(&kinds, &start(0, Some(4)), 8, &ticket, true, Some(0)).unwrap();
        let tags: Vec<_> = tagged.iter().map(|p| (p.tag, p.staged)).collect();
        assert_eq!(
            tags,
            [(Some(tag_of(5, "kv").unwrap()), None), (Some(tag_of(5, "conv").unwrap()), None)]
        );
        let no_src = TicketSources { src_ssm_slot: None, ..ticket };
        let e = import_postings(&kinds, &start(0, Some(4)), 8, &no_src, false, None).unwrap_err();
        assert!(
            matches!(e, DisaggError::HandoffMetadata { ref field, .. } if field == "src_ssm_slot")
        );
    }

    #[test]
    fn a_push_posts_to_the_decodes_ranks_of_each_kind_with_its_own_and_the_tag() {
        let kinds: Vec<String> = ["kv", "recurrent"].map(String::from).to_vec();
        let decode = ranks(&[&[("kv", Some(1)), ("recurrent", Some(2))]]);
        let own = ranks(&[&[("kv", Some(8))], &[("recurrent", Some(9))]]);
        let plan = (vec![4], vec![6], 16, Some(0), Some(3));
        let got = push_postings(&kinds, 5, &plan, &decode, &own).unwrap();
        let summary: Vec<_> = got
            .iter()
            .map(|p| (p.kind.as_str(), p.metas.clone(), p.src_metas.clone(), p.num_tokens, p.tag))
            .collect();
        assert_eq!(
            summary,
            [
                ("kv", vec![1], Some(vec![8]), Some(16), Some(tag_of(5, "kv").unwrap())),
                ("recurrent", vec![2], Some(vec![9]), None, Some(tag_of(5, "recurrent").unwrap())),
            ]
        );
        let ssm_decode = ranks(&[&[("recurrent", Some(2))]]);
        let got = push_postings(&kinds, 5, &plan, &ssm_decode, &own).unwrap();
        assert_eq!(got.iter().map(|p| p.kind.as_str()).collect::<Vec<_>>(), ["recurrent"]);
        let untaggable = push_postings(&kinds, u64::MAX, &plan, &decode, &own);
        assert!(matches!(untaggable, Err(DisaggError::Argument { .. })));
    }

    #[test]
    fn an_integrity_mismatch_wins_over_a_ranks_transport_error() {
        let f = import_failure(7, "error", Some("kv=K layer=0 head=1"), Some("rank 1: boom"));
        assert_eq!(f.reason, "integrity");
        assert_eq!(f.detail, " kv=K layer=0 head=1");
        assert!(f.integrity);
        assert_eq!(
            f.message,
            "KV import of request 7 failed the integrity check: kv=K layer=0 head=1"
        );
        let f = import_failure(7, "deadline", None, Some("rank 1: boom"));
        assert_eq!((f.reason.as_str(), f.detail.as_str()), ("deadline", " (rank 1: boom)"));
        assert_eq!(f.message, "KV import of request 7 failed: deadline (rank 1: boom)");
        assert!(!f.integrity);
        assert_eq!(import_failure(7, "aborted", None, Some("")).detail, "");
        assert_eq!(
            import_failure(7, "aborted", None, None).message,
            "KV import of request 7 failed: aborted"
        );
    }

    proptest! {
        /// Against a simple model: the limit is the first given of the two attributes, and the
        /// request is finished exactly when the model says so.
        #[test]
        fn limits_match_a_simple_model(
            num in proptest::option::of(0i64..6),
            max_new in proptest::option::of(0i64..6),
            term in proptest::option::of(-2i64..4),
            eos in proptest::option::of(0i64..4),
            resume in proptest::collection::vec(0i64..4, 0..4),
        ) {
            let given = SamplingGiven {
                described: "P".into(),
                num_tokens_to_generate: num,
                max_new_tokens: max_new,
                termination_id: term,
                stop_word_ids: None,
            };
            let got = import_limits(&given, eos, &resume);
            match num.or(max_new) {
                None => prop_assert!(got.is_err()),
                Some(limit) => {
                    let end = match term { Some(t) if t >= 0 => Some(t), _ => eos };
                    let reached = i64::try_from(resume.len()).unwrap() >= limit;
                    let terminated = end.is_some() && resume.last().copied() == end;
                    let want = ImportLimits { max_new_tokens: limit, finished: reached || terminated };
                    prop_assert_eq!(got, Ok(want));
                }
            }
        }
    }
}
