//! Bindings of the handoff mixin's decisions (`disagg_core::handoff`): argument conversion
//! only.

use std::collections::BTreeMap;

use disagg_core::handoff::SamplingGiven;
use disagg_core::handoff::{self, Polled, Posting, PromptReuse, RankKey, RankReport};
use disagg_core::ledger::HandleState;
use disagg_core::wire::ticket::DecodeNeeds;
use disagg_core::RankOutcome;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBool, PyDict, PyInt};

use crate::args::{conv, Int, Raw, U64};
use crate::error::{IntoPyResult, ResetRefusedError};
use crate::ledger::{actions, Destinations, PyImportLedger, PyLedgerAction, PyPinLedger};
use crate::pool::{core_fns, lock, lock_with};
use crate::wire::HandoffWire;

/// `obj.name`, or None when `obj` has no such attribute or it is None.
fn attr<'py, T: FromPyObjectOwned<'py>>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Option<T>> {
    let v = obj.getattr(name).ok().filter(|v| !v.is_none());
    v.map(|v| v.extract().map_err(Into::into)).transpose()
}

/// `sampling_params` as given: a bare int is the number of tokens, else read by attributes.
fn sampling_given(sp: &Bound<'_, PyAny>) -> PyResult<SamplingGiven> {
    let described = sp.repr()?.to_string();
    if sp.is_instance_of::<PyInt>() && !sp.is_instance_of::<PyBool>() {
        return Ok(SamplingGiven::tokens(described, sp.extract()?));
    }
    Ok(SamplingGiven {
        described,
        num_tokens_to_generate: attr(sp, "num_tokens_to_generate")?,
        max_new_tokens: attr(sp, "max_new_tokens")?,
        termination_id: attr(sp, "termination_id")?,
        stop_word_ids: attr(sp, "stop_word_ids")?,
    })
}

/// The ticket with its ``prefill_meta`` ranks reduced to the state kinds each exports (``True``
/// each; `HandoffTicket::parse` reads no more): their metadata, parsed in the peer table, is
/// not converted again per request. `None` (convert it all) when they are not dicts of kinds.
fn slim_ticket(ticket: &Bound<'_, PyAny>) -> Option<Py<PyAny>> {
    let ranks: Ranks<'_> =
        ticket.get_item("prefill_meta").ok()?.get_item("ranks").ok()?.extract().ok()?;
    let kinds =
        |r: BTreeMap<_, Option<_>>| r.into_iter().map(|(k, v)| (k, v.map(|_| true))).collect();
    let kinds: Vec<BTreeMap<String, Option<bool>>> = ranks.into_iter().map(kinds).collect();
    let slim = ticket.cast::<PyDict>().ok()?.copy().ok()?;
    slim.set_item("prefill_meta", [("ranks", kinds)].into_py_dict(ticket.py()).ok()?).ok()?;
    Some(slim.into_any().unbind())
}

/// ``handoff::ticket_import``: ``(max_new_tokens, resume_tokens, kwargs)``, the keyword
/// arguments of ``ImportLedger.submit`` besides ``src_block_ids``.
#[pyfunction]
#[pyo3(signature = (request_id, prompt, sampling_params, ticket, *, eos_token, sources, has_ssm,
    integrity, two_sided, now, timeout, wall_now))]
#[allow(clippy::too_many_arguments)]
pub fn ticket_import<'py>(
    request_id: Int,
    prompt: &Bound<'py, PyAny>,
    sampling_params: &Bound<'py, PyAny>,
    ticket: Py<PyAny>,
    eos_token: Option<i64>,
    sources: Vec<String>,
    has_ssm: bool,
    integrity: bool,
    two_sided: bool,
    now: u64,
    timeout: u64,
    wall_now: Option<i64>,
) -> PyResult<(i64, Vec<i64>, Bound<'py, PyDict>)> {
    let ticket = slim_ticket(ticket.bind(prompt.py())).unwrap_or(ticket);
    conv!(ticket: HandoffWire, request_id: U64);
    let needs = DecodeNeeds { request_id, sources, has_ssm, integrity };
    let given = sampling_given(sampling_params)?;
    let clock = (now, timeout, wall_now);
    let (t, submission, deadline, lease) =
        handoff::ticket_import(&ticket, &given, &needs, eos_token, two_sided, clock).py()?;
    let args = PyDict::new(prompt.py());
    match submission.reuse {
        PromptReuse::Any => args.set_item("prompt_tokens", prompt)?,
        PromptReuse::Chunks(c) => {
            args.set_item("prompt_tokens", prompt)?;
            args.set_item("reuse_align_tokens", c)?;
        }
        PromptReuse::Nothing => {
            args.set_item("num_prompt_tokens", prompt.len()?)?;
            args.set_item("prompt_hashes", Vec::<u64>::new())?;
        }
    }
    let (lease_until_wall, now_wall) = lease.unzip();
    let limits = submission.limits;
    for (key, v) in [
        ("src_block_size_tokens", t.src_block_size_tokens.map(u64::from)),
        ("resume_tokens", Some(t.resume_tokens.len() as u64)),
        ("deadline", Some(deadline)),
        ("lease_until_wall", lease_until_wall),
        ("now_wall", now_wall),
        ("now", Some(now)),
    ] {
        args.set_item(key, v)?;
    }
    args.set_item("has_ssm", has_ssm)?;
    args.set_item("finished", limits.finished)?;
    Ok((limits.max_new_tokens, t.resume_tokens, args))
}

/// ``handoff::import_failure``: ``(reason, detail, integrity, message)`` (``mismatch``: an
/// ``IntegrityMismatch``, which describes itself).
#[pyfunction]
pub fn import_failure(
    request_id: u64,
    reason: &str,
    mismatch: Option<Bound<'_, PyAny>>,
    rank_error: Option<String>,
) -> PyResult<(String, String, bool, String)> {
    let text: Option<String> =
        mismatch.map(|m| m.call_method0("describe")?.extract()).transpose()?;
    let f = handoff::import_failure(request_id, reason, text.as_deref(), rank_error.as_deref());
    Ok((f.reason, f.detail, f.integrity, f.message))
}

/// An engine's ranks' metadata (``handoff::RankMetas``).
type Ranks<'py> = Vec<BTreeMap<String, Option<Bound<'py, PyAny>>>>;

/// A ticket's ``prefill_meta``.
#[derive(FromPyObject)]
pub struct PrefillMetaArg<'py> {
    #[pyo3(item)]
    ranks: Ranks<'py>,
}

/// What the pulls read of a ticket (``handoff::TicketSources``).
#[derive(FromPyObject)]
pub struct TicketArg<'py> {
    #[pyo3(item)]
    prefill_meta: PrefillMetaArg<'py>,
    #[pyo3(item, default, from_py_with = staged_of)]
    staged: Vec<(RankKey, bool, Bound<'py, PyAny>)>,
    #[pyo3(item, default)]
    src_ssm_slot: Option<u32>,
}

/// A ticket's staged copies (none unless a dict) by rank key, each with whether it holds any.
fn staged_of<'py>(staged: &Bound<'py, PyAny>) -> PyResult<Vec<(RankKey, bool, Bound<'py, PyAny>)>> {
    let entries = staged.cast::<PyDict>().map(PyDictMethods::iter).into_iter().flatten();
    let entry = |(k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>)| {
        let key = k.extract().map_or(RankKey::Text(k.str()?.to_string()), RankKey::Int);
        Ok((key, v.is_truthy()?, v))
    };
    entries.map(entry).collect()
}

/// A transfer as the transport takes it: ``(kind, metas, src_ids, dst_ids, kwargs)``.
type Post<'py> = (String, Vec<Bound<'py, PyAny>>, Vec<u32>, Vec<u32>, Bound<'py, PyDict>);

/// Set `kwargs[key]` to `v`, unless `v` is None (the argument is not passed).
fn pass<'py, T: IntoPyObject<'py>>(
    kwargs: &Bound<'py, PyDict>,
    key: &str,
    v: Option<T>,
) -> PyResult<()> {
    v.map_or(Ok(()), |v| kwargs.set_item(key, v))
}

/// A core posting as the transport call takes it (a push's also passing ``filler``).
fn post<'py, S: IntoPyObject<'py>>(
    py: Python<'py>,
    p: Posting<Bound<'py, PyAny>, S>,
    filler: Option<bool>,
) -> PyResult<Post<'py>> {
    let kwargs = PyDict::new(py);
    pass(&kwargs, "filler", filler)?;
    pass(&kwargs, "src_metas", p.src_metas)?;
    pass(&kwargs, "num_tokens", p.num_tokens)?;
    pass(&kwargs, "tag", p.tag)?;
    pass(&kwargs, "staged", p.staged)?;
    Ok((p.kind, p.metas, p.src, p.dst, kwargs))
}

/// ``handoff::import_postings`` of a start ``action`` (``kv_backend``: this rank's KV transport).
#[pyfunction]
#[pyo3(signature = (action, ticket, *, num_tokens, kinds, two_sided, kv_backend=None))]
pub fn import_pulls<'py>(
    py: Python<'py>,
    action: Bound<'py, PyLedgerAction>,
    ticket: TicketArg<'py>,
    num_tokens: u32,
    kinds: Vec<String>,
    two_sided: bool,
    kv_backend: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Post<'py>>> {
    let global_rank =
        |b: &Bound<'py, PyAny>| b.getattr("layout")?.getattr("global_rank")?.extract();
    let rank = kv_backend.map(global_rank).transpose()?;
    let start = &action.get().inner.start;
    let ranks = ticket.prefill_meta.ranks;
    let sources =
        handoff::TicketSources { ranks, staged: ticket.staged, src_ssm_slot: ticket.src_ssm_slot };
    let posts = handoff::import_postings(&kinds, start, num_tokens, &sources, two_sided, rank);
    posts.py()?.into_iter().map(|p| post(py, p, None)).collect()
}

/// ``handoff::plan_push`` by ``pins``: ``(epoch, num_tokens, sends)``.
#[pyfunction]
#[pyo3(signature = (pins, request_id, decode_metas, own, kinds, *, filler))]
pub fn push_sends<'py>(
    py: Python<'py>,
    pins: &Bound<'py, PyPinLedger>,
    request_id: Int,
    decode_metas: Vec<Py<PyAny>>,
    own: Ranks<'py>,
    kinds: Vec<String>,
    filler: bool,
) -> PyResult<(u64, u32, Vec<Post<'py>>)> {
    let decode = decode_metas.iter().map(|m| m.bind(py).extract()).collect::<PyResult<Ranks>>()?;
    conv!(request_id: U64, decode_metas: Destinations);
    let mut l = lock(&pins.get().inner)?;
    let plan = handoff::plan_push(&mut l, request_id, &decode_metas, &decode, &own, &kinds, filler);
    let (epoch, num_tokens, posts) = plan.py()?;
    let posts = posts.into_iter().map(|p| post(py, p, Some(filler))).collect::<PyResult<_>>()?;
    Ok((epoch, num_tokens, posts))
}

/// ``handoff::peer_registrations`` of the control plane's ``{engine_id: {"meta": ...}}``.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn handoff_peer_plan<'py>(
    peers: &Bound<'py, PyDict>,
    kinds: Vec<String>,
) -> PyResult<(Vec<(String, String, Vec<Bound<'py, PyAny>>)>, Bound<'py, PyDict>)> {
    let ranks = |peer: Bound<'py, PyAny>| -> PyResult<Ranks<'py>> {
        peer.get_item("meta")?.get_item("ranks")?.extract()
    };
    // A table entry that cannot be read refuses its engine with ``"{type}: {error}"``.
    let engines: PyResult<Vec<_>> = peers
        .iter()
        .map(|(id, peer)| Ok((id.extract()?, ranks(peer).map_err(|e| e.to_string()))))
        .collect();
    let (plan, refused) = handoff::peer_registrations(engines?, &kinds);
    Ok((plan, refused.into_py_dict(peers.py())?))
}

pyo3::import_exception!(disagg_rs.exceptions, TransferTimeout);

/// `handoff::Polled::state` of one poll of a transfer handle: its answer, or the exception.
fn handle_state(polled: &Bound<'_, PyAny>) -> PyResult<(HandleState, String)> {
    if !polled.is_instance_of::<PyException>() {
        return Ok(Polled::Answered(polled.is_truthy()?).state());
    }
    let (kind, message) = (polled.get_type().name()?.to_string(), polled.str()?.to_string());
    Ok(Polled::Raised { timed_out: polled.is_instance_of::<TransferTimeout>(), kind, message }
        .state())
}

/// ``handoff::local_outcome`` of each import's ``(failed_locally, one poll of each handle)``.
#[pyfunction]
pub fn import_local_outcomes(
    imports: Vec<(Option<String>, Vec<Bound<'_, PyAny>>)>,
) -> PyResult<Vec<(Option<&'static str>, String)>> {
    let outcome = |(failed, polled): (Option<String>, Vec<Bound<'_, PyAny>>)| {
        let polled = polled.iter().map(handle_state).collect::<PyResult<Vec<_>>>()?;
        let (outcome, first) = handoff::local_outcome(failed.as_deref(), &polled);
        Ok((outcome.map(RankOutcome::name), first))
    };
    imports.into_iter().map(outcome).collect()
}

/// One rank's report as gathered: ``(request_id, epoch, outcome, mismatch, error)``.
type GatheredReport = (u64, u64, String, Option<Py<PyAny>>, String);

/// ``handoff::fold_reports`` of every rank's gathered reports into ``ledger``.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn fold_import_reports(
    ledger: &Bound<'_, PyImportLedger>,
    gathered: Vec<Vec<GatheredReport>>,
    now: u64,
) -> PyResult<(Vec<PyLedgerAction>, Vec<(u64, Py<PyAny>)>, Vec<(u64, String)>)> {
    let report = |(request_id, epoch, outcome, mismatch, detail): GatheredReport| {
        let outcome = RankOutcome::parse(&outcome).py()?;
        Ok(RankReport { request_id, epoch, outcome, mismatch, detail })
    };
    let gathered: PyResult<Vec<Vec<_>>> =
        gathered.into_iter().map(|rank| rank.into_iter().map(report).collect()).collect();
    let folded = handoff::fold_reports(&mut *lock(&ledger.get().inner)?, gathered?, now).py()?;
    Ok((actions(folded.actions), folded.mismatches, folded.rank_errors))
}

/// A refusal as ``ResetRefusedError`` naming ``request_id``.
fn refused(refusal: Option<String>) -> PyResult<()> {
    refusal.map_or(Ok(()), |msg| Err(ResetRefusedError::new_err((msg, "request_id"))))
}

core_fns! {
    /// ``handoff::settle_quiet`` of each quarantined ``(request_id, epoch, quiet)``.
    fn settle_quiet_quarantines(ledger: Raw<Py<PyImportLedger>>,
        quarantines: Raw<Vec<(u64, u64, bool)>>) -> Vec<PyLedgerAction>
        = lock_with(&ledger.get().inner, |l| handoff::settle_quiet(l, &quarantines))?;
    /// ``handoff::pinned_refusal``, raised.
    fn refuse_reset_while_pinned(pinned: Raw<Vec<u64>>) -> ()
        = refused(handoff::pinned_refusal(&pinned))?;
    /// ``handoff::close_refusal``, raised.
    fn refuse_close_in_flight(imports: Raw<Vec<(u64, bool)>>, quarantined: Raw<Vec<(u64, bool)>>,
        pushes: Raw<Vec<u64>>, fillers: Raw<Vec<u64>>) -> ()
        = refused(handoff::close_refusal(&imports, &quarantined, &pushes, &fillers))?;
}

/// ``handoff::gathered_pieces`` of every rank's digest: its pieces, or the text of its failure.
#[pyfunction]
pub fn gathered_integrity_pieces(gathered: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<Py<PyAny>>> {
    let rank =
        |g: Bound<'_, PyAny>| g.extract::<String>().map(Err).or_else(|_| g.extract().map(Ok));
    handoff::gathered_pieces(gathered.into_iter().map(rank).collect::<PyResult<_>>()?).py()
}
