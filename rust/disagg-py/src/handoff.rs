//! Bindings of the handoff mixin's decisions (`disagg_core::handoff`): argument conversion
//! only.

use std::collections::BTreeMap;

use disagg_core::handoff::{self, Posting, PromptReuse, RankKey, RankReport, SamplingGiven};
use disagg_core::integrity_tables::{describe, Mismatch};
use disagg_core::ledger::{HandleState, StartImport};
use disagg_core::RankOutcome;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBool, PyDict, PyInt};

use crate::args::Raw;
use crate::error::{IntoPyResult, ResetRefusedError};
use crate::ledger::{actions, PyImportLedger, PyLedgerAction};
use crate::pool::{core_fns, lock};

/// An ``IntegrityMismatch`` of ``disagg_rs.integrity``, read by its attributes.
#[derive(FromPyObject)]
pub struct MismatchArg {
    table: String,
    layer: u64,
    unit: u64,
    expected: u64,
    got: u64,
    kv: Option<String>,
    band: Option<String>,
    tokens: Option<(u64, u64)>,
}

impl MismatchArg {
    fn text(self) -> String {
        let MismatchArg { table, layer, unit, expected, got, kv, band, tokens } = self;
        describe(
            &Mismatch { piece: 0, table, layer, unit, expected, got, kv, tokens },
            band.as_deref(),
        )
    }
}

/// `obj.name`, or None when `obj` has no such attribute or it is None.
fn attr<'py>(obj: &Bound<'py, PyAny>, name: &str) -> Option<Bound<'py, PyAny>> {
    obj.getattr(name).ok().filter(|v| !v.is_none())
}

/// `sampling_params` as given: a bare int is the number of tokens, else read by attributes.
fn sampling_given(sp: &Bound<'_, PyAny>) -> PyResult<SamplingGiven> {
    let described = sp.repr()?.to_string();
    if sp.is_instance_of::<PyInt>() && !sp.is_instance_of::<PyBool>() {
        let tokens = Some(sp.extract()?);
        return Ok(SamplingGiven {
            described,
            num_tokens_to_generate: tokens,
            ..Default::default()
        });
    }
    Ok(SamplingGiven {
        described,
        num_tokens_to_generate: attr(sp, "num_tokens_to_generate")
            .map(|v| v.extract())
            .transpose()?,
        max_new_tokens: attr(sp, "max_new_tokens").map(|v| v.extract()).transpose()?,
        termination_id: attr(sp, "termination_id").map(|v| v.extract()).transpose()?,
        stop_word_ids: attr(sp, "stop_word_ids").map(|v| v.extract()).transpose()?,
    })
}

/// A ticket's digest table, read for its chunking.
#[derive(FromPyObject)]
pub struct ChunkedArg {
    chunk_tokens: Option<u32>,
}

/// ``disagg_core::handoff::import_submission``: ``(max_new_tokens, finished, prompt_kwargs)``,
/// ``prompt_kwargs`` the prompt's arguments of ``ImportLedger.submit``.
#[pyfunction]
#[pyo3(signature = (request_id, prompt, sampling_params, eos_token, resume_tokens, integrity,
    *, two_sided))]
pub fn import_submission<'py>(
    request_id: &Bound<'py, PyAny>,
    prompt: &Bound<'py, PyAny>,
    sampling_params: &Bound<'py, PyAny>,
    eos_token: Option<i64>,
    resume_tokens: Vec<i64>,
    integrity: Option<ChunkedArg>,
    two_sided: bool,
) -> PyResult<(i64, bool, Bound<'py, PyDict>)> {
    let given = sampling_given(sampling_params)?;
    let (rid, repr) = (request_id.extract().ok(), || request_id.repr().map(|r| r.to_string()));
    let chunks = integrity.map(|t| t.chunk_tokens);
    let repr = || repr().unwrap_or_default();
    let s =
        handoff::import_submission(&given, eos_token, &resume_tokens, rid, repr, two_sided, chunks);
    let s = s.py()?;
    let args = PyDict::new(prompt.py());
    match s.reuse {
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
    Ok((s.limits.max_new_tokens, s.limits.finished, args))
}

/// ``(reason, detail, integrity, message)`` reporting a failed import
/// (``disagg_core::handoff::import_failure``).
#[pyfunction]
#[pyo3(signature = (request_id, reason, mismatch=None, rank_error=None))]
pub fn import_failure(
    request_id: u64,
    reason: &str,
    mismatch: Option<MismatchArg>,
    rank_error: Option<String>,
) -> (String, String, bool, String) {
    let text = mismatch.map(MismatchArg::text);
    let f = handoff::import_failure(request_id, reason, text.as_deref(), rank_error.as_deref());
    (f.reason, f.detail, f.integrity, f.message)
}

/// An engine's ranks' metadata (``handoff::RankMetas``).
type Ranks<'py> = Vec<BTreeMap<String, Option<Bound<'py, PyAny>>>>;

/// The fields of a ledger's start action (a ``LedgerAction``) the transfers need.
#[derive(FromPyObject)]
pub struct StartArg {
    request_id: u64,
    token_start: u32,
    src_block_ids: Vec<u32>,
    dst_block_ids: Vec<u32>,
    ssm_slot: Option<u32>,
}

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

/// A ticket's staged copies (none unless a dict), each keyed by its rank (an int, else the
/// key's text), with whether it holds any ticket.
fn staged_of<'py>(staged: &Bound<'py, PyAny>) -> PyResult<Vec<(RankKey, bool, Bound<'py, PyAny>)>> {
    let entries = staged.cast::<PyDict>().map(PyDictMethods::iter).into_iter().flatten();
    let entry = |(k, v): (Bound<'py, PyAny>, Bound<'py, PyAny>)| {
        let key = match k.extract() {
            Ok(rank) => RankKey::Int(rank),
            Err(_) => RankKey::Text(k.str()?.to_string()),
        };
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

/// A core posting as the transport call takes it.
fn post<'py, S: IntoPyObject<'py>>(
    py: Python<'py>,
    p: Posting<Bound<'py, PyAny>, S>,
) -> PyResult<Post<'py>> {
    let kwargs = PyDict::new(py);
    pass(&kwargs, "src_metas", p.src_metas)?;
    pass(&kwargs, "num_tokens", p.num_tokens)?;
    pass(&kwargs, "tag", p.tag)?;
    pass(&kwargs, "staged", p.staged)?;
    Ok((p.kind, p.metas, p.src, p.dst, kwargs))
}

/// ``disagg_core::handoff::import_postings`` of a start ``action`` (``kv_backend``: this
/// rank's KV transport, whose layout names its global rank).
#[pyfunction]
#[pyo3(signature = (action, ticket, *, num_tokens, kinds, two_sided, kv_backend=None))]
pub fn import_pulls<'py>(
    py: Python<'py>,
    action: StartArg,
    ticket: TicketArg<'py>,
    num_tokens: u32,
    kinds: Vec<String>,
    two_sided: bool,
    kv_backend: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Post<'py>>> {
    let global_rank =
        |b: &Bound<'py, PyAny>| b.getattr("layout")?.getattr("global_rank")?.extract();
    let rank = kv_backend.map(global_rank).transpose()?;
    let StartArg { request_id, token_start, src_block_ids, dst_block_ids, ssm_slot } = action;
    let start = StartImport {
        request_id,
        token_start,
        src_block_ids,
        dst_block_ids,
        ssm_slot,
        ..StartImport::default()
    };
    let ranks = ticket.prefill_meta.ranks;
    let sources =
        handoff::TicketSources { ranks, staged: ticket.staged, src_ssm_slot: ticket.src_ssm_slot };
    let posts = handoff::import_postings(&kinds, &start, num_tokens, &sources, two_sided, rank);
    posts.py()?.into_iter().map(|p| post(py, p)).collect()
}

/// ``disagg_core::handoff::push_postings``, each transfer's ``kwargs`` also carrying
/// ``filler``.
#[pyfunction]
#[pyo3(signature = (request_id, plan, decode_metas, own, kinds, *, filler))]
pub fn push_sends<'py>(
    py: Python<'py>,
    request_id: u64,
    plan: (Vec<u32>, Vec<u32>, u32, Option<u32>, Option<u32>),
    decode_metas: Ranks<'py>,
    own: Ranks<'py>,
    kinds: Vec<String>,
    filler: bool,
) -> PyResult<Vec<Post<'py>>> {
    let posts = handoff::push_postings(&kinds, request_id, &plan, &decode_metas, &own).py()?;
    let post = |p| {
        let p: Post<'py> = post(py, p)?;
        p.4.set_item("filler", filler)?;
        Ok(p)
    };
    posts.into_iter().map(post).collect()
}

/// ``"{type}: {error}"`` of a Python error.
fn error_text(py: Python<'_>, e: &PyErr) -> String {
    let name = e.get_type(py).name().map_or_else(|_| "Exception".into(), |n| n.to_string());
    format!("{name}: {}", e.value(py))
}

/// ``disagg_core::handoff::peer_registrations`` of the control plane's peer table
/// ``{engine_id: {"meta": {"ranks": [...]}, ...}}``: ``([(engine_id, kind, metas)],
/// {engine_id: error})``.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn handoff_peer_plan<'py>(
    peers: &Bound<'py, PyDict>,
    kinds: Vec<String>,
) -> PyResult<(Vec<(String, String, Vec<Bound<'py, PyAny>>)>, Bound<'py, PyDict>)> {
    let py = peers.py();
    let ranks = |peer: Bound<'py, PyAny>| -> PyResult<Ranks<'py>> {
        peer.get_item("meta")?.get_item("ranks")?.extract()
    };
    let engine = |(id, peer): (Bound<'py, PyAny>, _)| -> PyResult<_> {
        Ok((id.extract()?, ranks(peer).map_err(|e| error_text(py, &e))))
    };
    let engines = peers.iter().map(engine).collect::<PyResult<Vec<_>>>()?;
    let (plan, refused) = handoff::peer_registrations(engines, &kinds);
    Ok((plan, refused.into_py_dict(py)?))
}

pyo3::import_exception!(disagg_rs.exceptions, TransferTimeout);

/// One poll of a transfer handle: its answer, or the ``TransferTimeout`` or ``TransferError``.
fn handle_state(polled: &Bound<'_, PyAny>) -> PyResult<(HandleState, String)> {
    if !polled.is_instance_of::<PyException>() {
        let done = polled.is_truthy()?;
        return Ok((if done { HandleState::Done } else { HandleState::Running }, String::new()));
    }
    let text = format!("{}: {}", polled.get_type().name()?, polled.str()?);
    let timed_out = polled.is_instance_of::<TransferTimeout>();
    Ok((if timed_out { HandleState::TimedOut } else { HandleState::Failed }, text))
}

/// ``(outcome, first_error)`` of this rank's import (``disagg_core::handoff::local_outcome``);
/// ``polled`` holds one poll of each handle, ``failed_locally`` the error of a start that threw.
#[pyfunction]
pub fn import_local_outcome(
    failed_locally: Option<String>,
    polled: Vec<Bound<'_, PyAny>>,
) -> PyResult<(Option<&'static str>, String)> {
    let polled = polled.iter().map(handle_state).collect::<PyResult<Vec<_>>>()?;
    let (outcome, first) = handoff::local_outcome(failed_locally.as_deref(), &polled);
    Ok((outcome.map(RankOutcome::name), first))
}

/// One rank's report as gathered: ``(request_id, epoch, outcome, mismatch, error)``.
type GatheredReport = (u64, u64, String, Option<Py<PyAny>>, String);

/// Feed every rank's gathered reports into ``ledger`` at ``now``, all or nothing: its actions,
/// the first integrity mismatch and the first rank error of each request, by request id.
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
    let gathered = gathered
        .into_iter()
        .map(|rank| rank.into_iter().map(report).collect::<PyResult<Vec<_>>>())
        .collect::<PyResult<Vec<_>>>()?;
    let folded = handoff::fold_reports(&mut *lock(&ledger.get().inner)?, gathered, now).py()?;
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
        = {
            let mut ledger = lock(&ledger.get().inner)?;
            handoff::settle_quiet(&mut ledger, &quarantines)
        };
    /// ``handoff::pinned_refusal``, raised.
    fn refuse_reset_while_pinned(pinned: Raw<Vec<u64>>) -> ()
        = refused(handoff::pinned_refusal(&pinned))?;
    /// ``handoff::close_refusal``, raised.
    fn refuse_close_in_flight(imports: Raw<Vec<(u64, bool)>>, quarantined: Raw<Vec<(u64, bool)>>,
        pushes: Raw<Vec<u64>>, fillers: Raw<Vec<u64>>) -> ()
        = refused(handoff::close_refusal(&imports, &quarantined, &pushes, &fillers))?;
}

/// One rank's gathered digest: the text of its failure, or its pieces.
#[derive(FromPyObject)]
pub enum RankPieces {
    /// The rank could not digest its cells.
    Failed(String),
    /// The rank's pieces.
    Pieces(Vec<Py<PyAny>>),
}

/// Every rank's gathered digest pieces as one list; ``HandoffStateError`` (``integrity``) with
/// the first rank's failure.
#[pyfunction]
pub fn gathered_integrity_pieces(gathered: Vec<RankPieces>) -> PyResult<Vec<Py<PyAny>>> {
    let gathered = gathered.into_iter().map(|g| match g {
        RankPieces::Pieces(pieces) => Ok(pieces),
        RankPieces::Failed(error) => Err(error),
    });
    handoff::gathered_pieces(gathered.collect()).py()
}
