//! Bindings of the handoff mixin's decisions (`disagg_core::handoff`): argument conversion
//! only.

use disagg_core::handoff::{self, PromptReuse, PullArgs, RankReport, SamplingGiven};
use disagg_core::integrity_tables::{describe, Mismatch};
use disagg_core::ledger::HandleState;
use disagg_core::RankOutcome;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyList};

use crate::error::{IntoPyResult, ResetRefusedError};
use crate::ledger::{actions, PyImportLedger, PyLedgerAction};
use crate::pool::lock;

/// An ``IntegrityMismatch`` of ``disagg_rs.integrity``, read by its attributes.
#[derive(FromPyObject)]
pub struct MismatchArg {
    #[pyo3(attribute)]
    table: String,
    #[pyo3(attribute)]
    layer: u64,
    #[pyo3(attribute)]
    unit: u64,
    #[pyo3(attribute)]
    expected: u64,
    #[pyo3(attribute)]
    got: u64,
    #[pyo3(attribute)]
    kv: Option<String>,
    #[pyo3(attribute)]
    band: Option<String>,
    #[pyo3(attribute)]
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
    if sp.is_instance_of::<PyInt>() && !sp.is_instance_of::<PyBool>() {
        return Ok(SamplingGiven {
            num_tokens_to_generate: Some(sp.extract()?),
            ..Default::default()
        });
    }
    Ok(SamplingGiven {
        num_tokens_to_generate: attr(sp, "num_tokens_to_generate")
            .map(|v| v.extract())
            .transpose()?,
        max_new_tokens: attr(sp, "max_new_tokens").map(|v| v.extract()).transpose()?,
        termination_id: attr(sp, "termination_id").map(|v| v.extract()).transpose()?,
        stop_word_ids: attr(sp, "stop_word_ids")
            .map(|v| v.extract())
            .transpose()?
            .unwrap_or_default(),
    })
}

/// ``(max_new_tokens, finished)`` of an import (``disagg_core::handoff::import_limits``;
/// ``MetadataError`` naming ``sampling_params`` without a limit).
#[pyfunction]
pub fn import_limits(
    sampling_params: &Bound<'_, PyAny>,
    eos_token: Option<i64>,
    resume_tokens: Vec<i64>,
) -> PyResult<(i64, bool)> {
    let given = sampling_given(sampling_params)?;
    let described = sampling_params.repr()?.to_string();
    let limits = handoff::import_limits(&given, &described, eos_token, &resume_tokens).py()?;
    Ok((limits.max_new_tokens, limits.finished))
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

/// The prompt arguments of `ImportLedger.submit` for `prompt` (``integrity``: the ticket's
/// digest table, ``None`` when this decode does not verify).
#[pyfunction]
#[pyo3(signature = (prompt, integrity=None))]
pub fn import_prompt_args<'py>(
    prompt: &Bound<'py, PyAny>,
    integrity: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let chunk: Option<Option<u32>> =
        integrity.map(|t| t.getattr("chunk_tokens")?.extract()).transpose()?;
    let args = PyDict::new(prompt.py());
    match handoff::prompt_reuse(integrity.is_some(), chunk.flatten()) {
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
    Ok(args)
}

/// The transport arguments of a pull of state ``kind``: ``{"tag": ...}`` (two-sided;
/// ``ArgumentError`` for an id it cannot tag), ``{"staged": tickets}`` or ``{}``.
#[pyfunction]
#[pyo3(signature = (kind, request_id, *, two_sided, token_start=None, staged=None, global_rank=None))]
pub fn pull_kwargs<'py>(
    kind: &str,
    request_id: &Bound<'py, PyAny>,
    two_sided: bool,
    token_start: Option<u32>,
    staged: Option<&Bound<'py, PyAny>>,
    global_rank: Option<i64>,
) -> PyResult<Bound<'py, PyDict>> {
    // The ticket's keys are ints, or their text once it crossed a text encoding.
    let truthy = |t: &Bound<'py, PyAny>| t.is_truthy().unwrap_or(false);
    let mine = match (staged.and_then(|s| s.cast::<PyDict>().ok()), global_rank) {
        (Some(s), Some(me)) => match s.get_item(me)?.filter(truthy) {
            Some(t) => Some(t),
            None => s.get_item(me.to_string())?.filter(truthy),
        },
        _ => None,
    };
    let args = PyDict::new(request_id.py());
    match handoff::pull_args(two_sided, kind, token_start, mine.is_some()) {
        PullArgs::Tagged => args.set_item("tag", crate::tags::two_sided_tag(request_id, kind)?)?,
        PullArgs::Staged => args.set_item("staged", mine)?,
        PullArgs::Direct => {}
    }
    Ok(args)
}

/// The fields of a ledger's start action (a ``LedgerAction``) the transfers need.
#[derive(FromPyObject)]
pub struct StartArg {
    #[pyo3(attribute)]
    request_id: u64,
    #[pyo3(attribute)]
    token_start: u32,
    #[pyo3(attribute)]
    src_block_ids: Vec<u32>,
    #[pyo3(attribute)]
    dst_block_ids: Vec<u32>,
    #[pyo3(attribute)]
    ssm_slot: Option<u32>,
}

/// ``disagg_core::handoff::import_pulls``: ``(kind, prefill_metas_of_kind, src_ids, dst_ids,
/// kwargs)`` in posting order, ``kwargs`` as :func:`pull_kwargs` gives them (plus KV's
/// ``num_tokens``).
#[pyfunction]
#[pyo3(signature = (action, ticket, *, num_tokens, kinds, two_sided, kv_backend=None))]
#[allow(clippy::type_complexity)]
pub fn import_pulls<'py>(
    action: StartArg,
    ticket: &Bound<'py, PyDict>,
    num_tokens: u32,
    kinds: Vec<String>,
    two_sided: bool,
    kv_backend: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<(String, Bound<'py, PyList>, Vec<u32>, Vec<u32>, Bound<'py, PyDict>)>> {
    let a = action;
    let ssm = match a.ssm_slot {
        Some(dst) => Some((ticket.as_any().get_item("src_ssm_slot")?.extract()?, dst)),
        None => None,
    };
    let request_id = a.request_id.into_pyobject(ticket.py())?.into_any();
    let pulls = handoff::import_pulls(
        &kinds,
        num_tokens,
        a.token_start,
        &a.src_block_ids,
        &a.dst_block_ids,
        ssm,
    );
    pulls
        .into_iter()
        .map(|p| {
            let kv = p.num_tokens.is_some();
            let rank = match kv_backend.filter(|_| kv) {
                Some(b) => Some(b.getattr("layout")?.getattr("global_rank")?.extract()?),
                None => None,
            };
            let staged = ticket.get_item("staged")?;
            let token_start = kv.then_some(a.token_start);
            let args =
                pull_kwargs(&p.kind, &request_id, two_sided, token_start, staged.as_ref(), rank)?;
            if let Some(n) = p.num_tokens {
                args.set_item("num_tokens", n)?;
            }
            let ranks = ticket.as_any().get_item("prefill_meta")?.get_item("ranks")?;
            Ok((p.kind.clone(), of_kind(&ranks, &p.kind)?, p.src, p.dst, args))
        })
        .collect()
}

/// Each rank's metadata of one state `kind` in `ranks`, skipping ranks without it.
fn of_kind<'py>(ranks: &Bound<'py, PyAny>, kind: &str) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(ranks.py());
    for r in ranks.try_iter()? {
        let meta = r?.call_method1("get", (kind,))?;
        if !meta.is_none() {
            out.append(meta)?;
        }
    }
    Ok(out)
}

/// The sends of a push (or its filler, ``filler=True``) as ``(kind, decode_metas_of_kind,
/// src_ids, dst_ids, kwargs)`` in posting order (see ``disagg_core::handoff::push_sends``):
/// ``plan`` is the pin ledger's ``(src_block_ids, dst_block_ids, num_tokens, src_ssm_slot,
/// dst_ssm_slot)``, ``decode_metas`` the decode's ranks, ``own`` this engine's, ``kinds`` the
/// states this rank moves; ``kwargs`` carry ``src_metas``, the two-sided ``tag``, ``filler``
/// and KV's ``num_tokens``.
#[pyfunction]
#[pyo3(signature = (request_id, plan, decode_metas, own, kinds, *, filler))]
#[allow(clippy::type_complexity)]
pub fn push_sends<'py>(
    request_id: &Bound<'py, PyAny>,
    plan: (Vec<u32>, Vec<u32>, u32, Option<u32>, Option<u32>),
    decode_metas: &Bound<'py, PyAny>,
    own: &Bound<'py, PyAny>,
    kinds: Vec<String>,
    filler: bool,
) -> PyResult<Vec<(String, Bound<'py, PyList>, Vec<u32>, Vec<u32>, Bound<'py, PyDict>)>> {
    let (src_ids, dst_ids, num_tokens, src_slot, dst_slot) = plan;
    let kv_peers = !of_kind(decode_metas, "kv")?.is_empty();
    let sends = handoff::push_sends(
        &kinds,
        kv_peers,
        &src_ids,
        &dst_ids,
        num_tokens,
        src_slot.zip(dst_slot),
    );
    sends
        .into_iter()
        .map(|s| {
            let args = PyDict::new(request_id.py());
            args.set_item("src_metas", of_kind(own, &s.kind)?)?;
            if let Some(n) = s.num_tokens {
                args.set_item("num_tokens", n)?;
            }
            args.set_item("tag", crate::tags::two_sided_tag(request_id, &s.kind)?)?;
            args.set_item("filler", filler)?;
            Ok((s.kind.clone(), of_kind(decode_metas, &s.kind)?, s.src, s.dst, args))
        })
        .collect()
}

/// One peer's ranks' metadata of each of `kinds` (`peer["meta"]["ranks"]`), or the error
/// reading it raised, as ``"{type}: {error}"``.
fn peer_kinds<'py>(
    peer: &Bound<'py, PyAny>,
    kinds: &[String],
) -> Result<Vec<Vec<Bound<'py, PyAny>>>, String> {
    let read = || -> PyResult<Vec<Vec<Bound<'py, PyAny>>>> {
        let ranks = peer.get_item("meta")?.get_item("ranks")?;
        kinds.iter().map(|k| Ok(of_kind(&ranks, k)?.iter().collect())).collect()
    };
    read().map_err(|e| {
        let py = peer.py();
        let name = e.get_type(py).name().map_or_else(|_| "Exception".into(), |n| n.to_string());
        format!("{name}: {}", e.value(py))
    })
}

/// The registrations of the control plane's peer table ``{engine_id: {"meta": {"ranks":
/// [...]}, ...}}`` on a rank that moves state ``kinds``: ``([(engine_id, kind, metas)],
/// {engine_id: error})`` (see ``disagg_core::handoff::peer_registrations``).
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn handoff_peer_plan<'py>(
    peers: &Bound<'py, PyDict>,
    kinds: Vec<String>,
) -> PyResult<(Vec<(String, String, Vec<Bound<'py, PyAny>>)>, Bound<'py, PyDict>)> {
    let engines = peers
        .iter()
        .map(|(id, peer)| Ok((id.extract::<String>()?, peer_kinds(&peer, &kinds))))
        .collect::<PyResult<Vec<_>>>()?;
    let (plan, refused) = handoff::peer_registrations(engines, &kinds);
    let refused_dict = PyDict::new(peers.py());
    for (engine, why) in refused {
        refused_dict.set_item(engine, why)?;
    }
    Ok((plan, refused_dict))
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
#[pyo3(signature = (failed_locally, polled))]
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

/// Settle each quarantined ``(request_id, epoch, quiet)`` whose local transfers are all quiet
/// again (see ``disagg_core::handoff::settle_quiet``): the ledger's actions.
#[pyfunction]
pub fn settle_quiet_quarantines(
    ledger: &Bound<'_, PyImportLedger>,
    quarantines: Vec<(u64, u64, bool)>,
) -> PyResult<Vec<PyLedgerAction>> {
    let settled = handoff::settle_quiet(&mut *lock(&ledger.get().inner)?, &quarantines).py()?;
    Ok(actions(settled))
}

/// A refusal as ``ResetRefusedError`` naming ``request_id``.
fn refused(refusal: Option<String>) -> PyResult<()> {
    refusal.map_or(Ok(()), |msg| Err(ResetRefusedError::new_err((msg, "request_id"))))
}

/// Raise ``ResetRefusedError`` (naming ``request_id``) while the prefill pins ``pinned``.
#[pyfunction]
pub fn refuse_reset_while_pinned(pinned: Vec<u64>) -> PyResult<()> {
    refused(handoff::pinned_refusal(&pinned))
}

/// Raise ``ResetRefusedError`` (naming ``request_id``) while a transfer may still touch the
/// registered memory (``disagg_core::handoff::close_refusal``).
#[pyfunction]
pub fn refuse_close_in_flight(
    imports: Vec<(u64, bool)>,
    quarantined: Vec<(u64, bool)>,
    pushes: Vec<u64>,
    fillers: Vec<u64>,
) -> PyResult<()> {
    refused(handoff::close_refusal(&imports, &quarantined, &pushes, &fillers))
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
