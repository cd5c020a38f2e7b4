//! Checks of an engine built on the reference design (Megatron-LM's disaggregation package):
//! an engine that brings its own block allocator and attaches no ledger.
//!
//! Each check is one [`ReferenceCheck`] built from a small facts map (what the engine's
//! configuration and the request say), so the engine-side Python only gathers facts and calls
//! [`check_reference`] once per stage. Every refusal names the field and both values.

use crate::error::{DisaggError, DisaggResult};
use crate::peer_records::{self, MetaNode};
use crate::wire::ticket::{ReferencePrefillBatch, ReferenceSsm, ReferenceTicket};
use crate::wire::value::{Obj, WireValue};

/// The engine's side of a handoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Runs the prompt and pins its blocks for the decode to read.
    Prefill,
    /// Imports the prompt's state and generates.
    Decode,
}

impl Role {
    fn parse(s: &str) -> DisaggResult<Self> {
        match s {
            "prefill" => Ok(Self::Prefill),
            "decode" => Ok(Self::Decode),
            other => Err(DisaggError::handoff_state(
                "role",
                format!("role='{other}' must be 'prefill' or 'decode'"),
            )),
        }
    }
}

/// One check of a reference-design engine, with the facts it needs.
#[derive(Debug, Clone, PartialEq)]
pub enum ReferenceCheck {
    /// `setup_kv_transfer`'s role (any engine): `prefill` or `decode`.
    Role(Role),
    /// `setup_kv_transfer`: the SSM state cache matches the role and prefix caching is on.
    Setup {
        /// The engine's role.
        role: Role,
        /// Whether the model has SSM layers.
        hybrid: bool,
        /// Whether the engine has an SSM state cache (`mamba_slot_allocator`).
        state_cache: bool,
        /// Whether the allocator caches prefixes.
        prefix_caching: bool,
    },
    /// The SSM buffers a hybrid engine registers against its TP layout.
    SsmBuffers {
        /// Heads the state shape implies across TP ranks.
        heads: u64,
        /// The model's configured head count, if any.
        mamba_num_heads: Option<u64>,
        /// Conv state channels of this rank's buffer.
        conv_channels: u64,
        /// Conv channels the TP layout puts on this rank.
        layout_conv_channels: u64,
    },
    /// Every TP rank registered the same SSM state kinds.
    TpAgents {
        /// Per TP rank, its SSM state kinds.
        kinds: Vec<Vec<String>>,
    },
    /// A prefill's finished handoffs, before any is prepared.
    Prefill(ReferencePrefillBatch),
    /// A decode's `add_request_with_kv_handoff`, before anything is reserved.
    Ticket {
        /// Whether the allocator caches prefixes.
        prefix_caching: bool,
        /// Whether the model has SSM layers.
        hybrid: bool,
        /// Whether the transfer backend is set up.
        has_backend: bool,
        /// The ticket itself.
        ticket: ReferenceTicket,
    },
    /// A decode reserving a live SSM slot for an import outside any ledger.
    ReserveSsm {
        /// Whether a ledger drives the engine (it reserves slots with the blocks).
        ledger: bool,
        /// Whether SSM transfer agents are set up.
        ssm_agents: bool,
    },
    /// The pinned SSM state a prefill hands off: the slot cached for the final block.
    SsmSlot {
        /// The request.
        request_id: u64,
        /// The slot the state cache returned for the final block (negative: none).
        slot: i64,
        /// The final block.
        block: u64,
    },
    /// A decode-only engine's context holds no prefill work.
    DecodeOnly {
        /// Prefill requests in the context.
        num_prefill_requests: u64,
        /// The chunked prefill in progress (`-1`: none).
        chunked_prefill_request_id: i64,
    },
    /// A decode engine at its scheduling point has no prompts waiting.
    NoWaiting {
        /// Prompts waiting.
        waiting: u64,
    },
    /// A decode ledger reserves the engine's speculative lookahead with every import.
    Lookahead {
        /// The ledger's lookahead.
        lookahead_tokens: u64,
        /// The engine's speculative tokens.
        num_speculative_tokens: u64,
    },
    /// The request just added heads the engine's waiting queue.
    QueueHead {
        /// The request added.
        request_id: u64,
        /// The queue's head.
        head: u64,
    },
    /// A prefill capturing a handoff's ticket prepared its metadata first.
    Prepared {
        /// The request.
        request_id: u64,
        /// Whether its metadata was prepared.
        prepared: bool,
    },
    /// An import about to be admitted without a forward step.
    DecodeReady {
        /// The request.
        request_id: u64,
        /// First tokens the import carries.
        resume_tokens: u64,
        /// The engine's speculative tokens.
        num_speculative_tokens: u64,
        /// Whether the model has SSM layers.
        hybrid: bool,
        /// Whether the import moved SSM state.
        has_ssm: bool,
    },
}

fn flag(o: &Obj<'_>, key: &str) -> DisaggResult<bool> {
    match o.req(key)? {
        WireValue::Bool(b) => Ok(*b),
        other => {
            Err(DisaggError::argument(key, format!("must be a bool, got {}", other.type_name())))
        }
    }
}

/// A count given as an int, or as the list it counts; `None` (static metadata not gathered
/// yet) is a `HandoffState` error naming `setup_kv_transfer`.
fn count(o: &Obj<'_>, key: &str) -> DisaggResult<u64> {
    match o.req(key)? {
        WireValue::List(items) => Ok(items.len() as u64),
        WireValue::Null => Err(DisaggError::handoff_state(
            "setup_kv_transfer",
            format!("a KV handoff was requested before setup_kv_transfer ({key} is None)"),
        )),
        _ => o.u64(key),
    }
}

/// A signed int fact (`out_of_range` when it does not fit `i64`).
fn signed(o: &Obj<'_>, key: &str, out_of_range: i64) -> DisaggResult<i64> {
    match o.req(key)? {
        WireValue::Int(i) => Ok(i64::try_from(*i).unwrap_or(out_of_range)),
        other => {
            Err(DisaggError::argument(key, format!("must be an int, got {}", other.type_name())))
        }
    }
}

fn ssm_entry(v: Option<&WireValue>) -> ReferenceSsm {
    match v {
        None | Some(WireValue::Null) => ReferenceSsm::Absent,
        Some(WireValue::Map(entries)) => {
            ReferenceSsm::Kinds(entries.iter().map(|(k, _)| k.clone()).collect())
        }
        Some(other) => ReferenceSsm::Other(other.type_name().to_owned()),
    }
}

fn names(v: &WireValue, field: &str) -> DisaggResult<Vec<String>> {
    let bad =
        || DisaggError::argument(field, format!("must be a list of str, got {}", v.type_name()));
    let WireValue::List(items) = v else { return Err(bad()) };
    items
        .iter()
        .map(|x| match x {
            WireValue::Str(s) => Ok(s.clone()),
            _ => Err(bad()),
        })
        .collect()
}

/// See [`ReferenceCheck::Setup`].
fn check_setup(
    role: Role,
    hybrid: bool,
    state_cache: bool,
    prefix_caching: bool,
) -> DisaggResult<()> {
    if hybrid && role == Role::Prefill && !state_cache {
        return Err(DisaggError::handoff_state(
            "mamba_slot_allocator",
            "a hybrid prefill handoff needs an SSM state cache (mamba_slot_allocator \
             is None): the pinned state is read from it",
        ));
    }
    if hybrid && role == Role::Decode && state_cache {
        return Err(DisaggError::handoff_state(
            "mamba_slot_allocator",
            "a hybrid decode handoff writes directly into live SSM state; configure \
             no SSM state cache (mamba_slot_allocator) on the decode engine",
        ));
    }
    if !prefix_caching {
        return Err(DisaggError::handoff_state(
            "enable_prefix_caching",
            "KV handoff needs prefix caching on both engines: \
             enable_prefix_caching=False",
        ));
    }
    Ok(())
}

/// See [`ReferenceCheck::Ticket`]: the decode's state, then the ticket.
fn check_ticket(
    prefix_caching: bool,
    hybrid: bool,
    has_backend: bool,
    ticket: &ReferenceTicket,
) -> DisaggResult<()> {
    let rid = ticket.request_id;
    if !prefix_caching {
        return Err(DisaggError::handoff_state(
            "enable_prefix_caching",
            "add_request_with_kv_handoff needs prefix caching on the decode engine \
                         (enable_prefix_caching=False)",
        ));
    }
    if hybrid && !ticket.decode_has_ssm {
        return Err(DisaggError::handoff_state(
            "setup_kv_transfer",
            format!(
                "request {rid}: a hybrid decode received a handoff before SSM \
                             transfer setup"
            ),
        ));
    }
    if !has_backend {
        return Err(DisaggError::handoff_state(
            "setup_kv_transfer",
            format!("request {rid}: no transfer backend (setup_kv_transfer has not run)"),
        ));
    }
    ticket.check()
}

/// See [`ReferenceCheck::Prepared`].
fn check_prepared(request_id: u64, prepared: bool) -> DisaggResult<()> {
    if prepared {
        return Ok(());
    }
    Err(DisaggError::handoff_state(
        "prepared",
        format!("request {request_id}: no handoff metadata was prepared"),
    ))
}

/// See [`ReferenceCheck::ReserveSsm`].
fn check_reserve_ssm(ledger: bool, ssm_agents: bool) -> DisaggResult<()> {
    if ledger {
        return Err(DisaggError::handoff_state(
            "ssm_slot",
            "SSM slots are reserved by ImportLedger.submit, not separately",
        ));
    }
    if !ssm_agents {
        return Err(DisaggError::handoff_state(
            "setup_kv_transfer",
            "received SSM handoff state but this decode engine has no SSM transfer \
                         agents (setup_kv_transfer on a hybrid decode engine)",
        ));
    }
    Ok(())
}

impl ReferenceCheck {
    /// The check named `stage` (`setup`, `ssm_buffers`, `tp_agents`, `prefill`, `ticket`,
    /// `prepared`, `decode_ready` ...) over its facts map; an `Argument` error for an
    /// unknown stage or a missing or mistyped fact.
    pub fn parse(stage: &str, facts: &WireValue) -> DisaggResult<Self> {
        let o = Obj::of(facts, "facts")?;
        let n = |key: &str| o.u64(key);
        Ok(match stage {
            "role" => Self::Role(Role::parse(o.name("role")?)?),
            "setup" => Self::Setup {
                role: Role::parse(o.name("role")?)?,
                hybrid: flag(&o, "hybrid")?,
                state_cache: flag(&o, "state_cache")?,
                prefix_caching: flag(&o, "prefix_caching")?,
            },
            "ssm_buffers" => Self::SsmBuffers {
                heads: n("heads")?,
                mamba_num_heads: o.opt_u64("mamba_num_heads")?,
                conv_channels: n("conv_channels")?,
                layout_conv_channels: n("layout_conv_channels")?,
            },
            "tp_agents" => {
                let WireValue::List(ranks) = o.req("kinds")? else {
                    return Err(DisaggError::argument("kinds", "must be a list per TP rank"));
                };
                Self::TpAgents {
                    kinds: ranks.iter().map(|r| names(r, "kinds")).collect::<DisaggResult<_>>()?,
                }
            }
            "prefill" => {
                let WireValue::List(rows) = o.req("requests")? else {
                    return Err(DisaggError::argument("requests", "must be a list of rows"));
                };
                let requests = rows
                    .iter()
                    .map(|row| {
                        let r = Obj::of(row, "requests")?;
                        Ok((
                            r.u64("request_id")?,
                            count(&r, "resume_tokens")?,
                            count(&r, "blocks")?,
                        ))
                    })
                    .collect::<DisaggResult<_>>()?;
                Self::Prefill(ReferencePrefillBatch {
                    kv_stages: count(&o, "kv_stages")?,
                    ssm_stages: count(&o, "ssm_stages")?,
                    pp_size: n("pp_size")?,
                    num_speculative_tokens: n("num_speculative_tokens")?,
                    requests,
                })
            }
            "ticket" => Self::parse_ticket(&o)?,
            "reserve_ssm" => Self::ReserveSsm {
                ledger: flag(&o, "ledger")?,
                ssm_agents: flag(&o, "ssm_agents")?,
            },
            "ssm_slot" => Self::SsmSlot {
                request_id: n("request_id")?,
                slot: signed(&o, "slot", -1)?,
                block: n("block")?,
            },
            "decode_only" => Self::DecodeOnly {
                num_prefill_requests: n("num_prefill_requests")?,
                chunked_prefill_request_id: signed(&o, "chunked_prefill_request_id", i64::MAX)?,
            },
            "no_waiting" => Self::NoWaiting { waiting: n("waiting")? },
            "lookahead" => Self::Lookahead {
                lookahead_tokens: n("lookahead_tokens")?,
                num_speculative_tokens: n("num_speculative_tokens")?,
            },
            "queue_head" => Self::QueueHead { request_id: n("request_id")?, head: n("head")? },
            "prepared" => {
                Self::Prepared { request_id: n("request_id")?, prepared: flag(&o, "prepared")? }
            }
            "decode_ready" => Self::DecodeReady {
                request_id: n("request_id")?,
                resume_tokens: n("resume_tokens")?,
                num_speculative_tokens: n("num_speculative_tokens")?,
                hybrid: flag(&o, "hybrid")?,
                has_ssm: flag(&o, "has_ssm")?,
            },
            other => {
                return Err(DisaggError::argument(
                    "stage",
                    format!(
                        "unknown check {other:?}; known: role, setup, ssm_buffers, tp_agents, \
                         prefill, ticket, reserve_ssm, ssm_slot, decode_only, no_waiting, \
                         lookahead, queue_head, decode_ready"
                    ),
                ))
            }
        })
    }

    fn parse_ticket(o: &Obj<'_>) -> DisaggResult<Self> {
        let n = |key: &str| o.u64(key);
        Ok(Self::Ticket {
            prefix_caching: flag(o, "prefix_caching")?,
            hybrid: flag(o, "hybrid")?,
            has_backend: flag(o, "has_backend")?,
            ticket: ReferenceTicket {
                request_id: n("request_id")?,
                ssm: ssm_entry(o.get("ssm")),
                decode_has_ssm: flag(o, "decode_has_ssm")?,
                resume_tokens: n("resume_tokens")?,
                num_speculative_tokens: n("num_speculative_tokens")?,
                return_log_probs: flag(o, "return_log_probs")?,
                top_n_logprobs: match o.some("top_n_logprobs") {
                    None => 0,
                    Some(WireValue::Int(t)) => i64::try_from(*t).unwrap_or(i64::MAX),
                    Some(other) => {
                        return Err(DisaggError::argument(
                            "top_n_logprobs",
                            format!("must be an int or None, got {}", other.type_name()),
                        ))
                    }
                },
                src_blocks: n("src_blocks")?,
                prompt_tokens: n("prompt_tokens")?,
                block_size: n("block_size")?,
            },
        })
    }

    /// Refuse what the engine cannot do, naming the field: `HandoffState` errors for the
    /// engine's configuration, `HandoffMetadata` errors for metadata and tickets.
    pub fn check(&self) -> DisaggResult<()> {
        match self {
            Self::Setup { role, hybrid, state_cache, prefix_caching } => {
                check_setup(*role, *hybrid, *state_cache, *prefix_caching)
            }
            Self::SsmBuffers { heads, mamba_num_heads, conv_channels, layout_conv_channels } => {
                if let Some(want) = mamba_num_heads.filter(|h| h != heads) {
                    return Err(DisaggError::handoff_metadata(
                        "mamba_num_heads",
                        format!("SSM state shape implies {heads} heads but mamba_num_heads={want}"),
                    ));
                }
                if conv_channels != layout_conv_channels {
                    return Err(DisaggError::handoff_metadata(
                        "mamba_conv_states",
                        format!(
                            "SSM conv state has {conv_channels} channels but the TP layout needs \
                             {layout_conv_channels}"
                        ),
                    ));
                }
                Ok(())
            }
            Self::TpAgents { kinds } => {
                let mut sorted: Vec<Vec<&str>> = kinds
                    .iter()
                    .map(|k| {
                        let mut k: Vec<&str> = k.iter().map(String::as_str).collect();
                        k.sort_unstable();
                        k.dedup();
                        k
                    })
                    .collect();
                if sorted.windows(2).any(|w| w[0] != w[1]) {
                    sorted.truncate(16);
                    return Err(DisaggError::handoff_state(
                        "ssm_state_kind",
                        format!("SSM handoff agents differ between TP ranks: {sorted:?}"),
                    ));
                }
                Ok(())
            }
            Self::Role(_) => Ok(()),
            Self::Prefill(batch) => batch.check(),
            Self::Ticket { prefix_caching, hybrid, has_backend, ticket } => {
                check_ticket(*prefix_caching, *hybrid, *has_backend, ticket)
            }
            Self::ReserveSsm { ledger, ssm_agents } => check_reserve_ssm(*ledger, *ssm_agents),
            Self::SsmSlot { request_id, slot, block } => {
                if *slot < 0 {
                    return Err(DisaggError::handoff_state(
                        "ssm_slot",
                        format!(
                            "request {request_id}: no SSM state cached (pinned) for its final \
                             block {block}"
                        ),
                    ));
                }
                Ok(())
            }
            Self::Prepared { request_id, prepared } => check_prepared(*request_id, *prepared),
            Self::DecodeOnly { .. }
            | Self::NoWaiting { .. }
            | Self::Lookahead { .. }
            | Self::QueueHead { .. } => self.check_engine(),
            Self::DecodeReady {
                request_id,
                resume_tokens,
                num_speculative_tokens,
                hybrid,
                has_ssm,
            } => {
                let want = num_speculative_tokens.saturating_add(1);
                if *resume_tokens != want {
                    return Err(DisaggError::handoff_metadata(
                        "resume_tokens",
                        format!(
                            "request {request_id}: {resume_tokens} resume tokens, expected \
                             num_speculative_tokens+1={want}"
                        ),
                    ));
                }
                if *hybrid && !has_ssm {
                    return Err(DisaggError::handoff_state(
                        "ssm",
                        format!(
                            "request {request_id}: a hybrid decode-only handoff has no \
                             transferred SSM state"
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

impl ReferenceCheck {
    /// The checks of the engine's own state (`HandoffState` errors naming the field).
    fn check_engine(&self) -> DisaggResult<()> {
        match *self {
            Self::DecodeOnly { num_prefill_requests, chunked_prefill_request_id }
                if num_prefill_requests != 0 || chunked_prefill_request_id != -1 =>
            {
                Err(DisaggError::handoff_state(
                    "num_prefill_requests",
                    format!(
                        "a decode-only engine cannot run prefill requests: \
                         num_prefill_requests={num_prefill_requests}, \
                         chunked_prefill_request_id={chunked_prefill_request_id}"
                    ),
                ))
            }
            Self::NoWaiting { waiting } if waiting > 0 => Err(DisaggError::handoff_state(
                "role",
                format!(
                    "a disaggregated decode engine cannot schedule prompt prefill requests: \
                     {waiting} waiting; submit handoffs with add_request_with_kv_handoff"
                ),
            )),
            Self::Lookahead { lookahead_tokens, num_speculative_tokens }
                if lookahead_tokens != num_speculative_tokens =>
            {
                Err(DisaggError::handoff_state(
                    "num_speculative_tokens",
                    format!(
                        "ImportLedger lookahead_tokens={lookahead_tokens} but the engine's \
                         num_speculative_tokens={num_speculative_tokens}: pass the engine's \
                         num_speculative_tokens to make_handoff_ledger"
                    ),
                ))
            }
            Self::QueueHead { request_id, head } if request_id != head => {
                Err(DisaggError::handoff_state(
                    "waiting_request_ids",
                    format!(
                        "admission expected request {request_id} at the waiting queue head, \
                         found {head}"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

/// Parse and run the check named `stage` over `facts` (see [`ReferenceCheck`]).
pub fn check_reference(stage: &str, facts: &WireValue) -> DisaggResult<()> {
    ReferenceCheck::parse(stage, facts)?.check()
}

/// The `ticket` check (see [`check_reference`]) of a ticket whose peer metadata `kv_meta`
/// and `src_block_ids` are counted first ([`peer_records::block_count`], its errors first):
/// `facts` with that count as `src_blocks`. Returns the count.
pub fn check_ticket_blocks<N: MetaNode>(
    mut facts: WireValue,
    kv_meta: &N,
    src_block_ids: &N,
) -> Result<usize, N::Err> {
    let blocks = peer_records::block_count(kv_meta, src_block_ids)?;
    if let WireValue::Map(e) = &mut facts {
        e.retain(|(k, _)| k != "src_blocks");
        e.push(("src_blocks".into(), WireValue::Int(blocks as i128)));
    }
    check_reference("ticket", &facts).map_err(N::lift)?;
    Ok(blocks)
}

/// One import of a reference-design engine, in admission order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RefImport {
    request_id: u64,
    /// No transfer of this rank can still write the destinations (a start that threw after
    /// posting part of the import sets it false).
    safe: bool,
    /// This rank's terminal outcome was reported (to the tracker, or decided locally).
    reported: bool,
}

/// What became of a failed import's storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailedStorage {
    /// Back to the engine's allocator.
    Release,
    /// Kept out of the allocator: a transfer may still write it.
    Quarantine,
}

/// The lifecycle of a reference-design engine's imports: the engine's own allocator holds the
/// blocks, this book holds what to decide about them. Imports are admitted in the order they
/// started (a failed one never holds the queue); every model-parallel rank reports its local
/// outcome once, and a decision (all ok, or failed) arrives from the tracker or, with one
/// rank, from this rank's own report. A reset is all or nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReferenceImports {
    imports: Vec<RefImport>,
    decided: std::collections::BTreeMap<u64, bool>,
    quarantined: Vec<u64>,
}

impl ReferenceImports {
    /// An empty book.
    pub fn new() -> Self {
        Self::default()
    }

    /// An import was posted (or its start failed: `safe` false when a transfer may still
    /// write its destinations). `DuplicateRequest` when the id is in the book.
    pub fn start(&mut self, request_id: u64, safe: bool) -> DisaggResult<()> {
        if self.position(request_id).is_some() {
            return Err(DisaggError::DuplicateRequest { request_id });
        }
        self.imports.push(RefImport { request_id, safe, reported: false });
        Ok(())
    }

    fn position(&self, request_id: u64) -> Option<usize> {
        self.imports.iter().position(|i| i.request_id == request_id)
    }

    /// Imports in the book, in admission order.
    pub fn importing(&self) -> Vec<u64> {
        self.imports.iter().map(|i| i.request_id).collect()
    }

    /// Imports whose local outcome is not reported yet, in admission order.
    pub fn unreported(&self) -> Vec<u64> {
        self.imports.iter().filter(|i| !i.reported).map(|i| i.request_id).collect()
    }

    /// Report local outcomes (`Some(failed)`; `None`: still running, skipped). With a shared
    /// tracker (`shared`) the reports are returned for it; otherwise this rank decides alone,
    /// which needs `model_parallel == 1` (`HandoffState` error naming the tracker, nothing
    /// changed, when a terminal outcome would be decided without one).
    pub fn report(
        &mut self,
        outcomes: &[(u64, Option<bool>)],
        shared: bool,
        model_parallel: u64,
    ) -> DisaggResult<Vec<(u64, bool)>> {
        let terminal: Vec<(u64, bool)> = outcomes
            .iter()
            .filter_map(|&(rid, o)| o.map(|f| (rid, f)))
            .filter(|&(rid, _)| self.position(rid).is_some_and(|p| !self.imports[p].reported))
            .collect();
        if !shared && model_parallel != 1 && !terminal.is_empty() {
            return Err(DisaggError::handoff_state(
                "_handoff_completion_tracker",
                format!(
                    "model-parallel size {model_parallel} needs a completion tracker \
                     (_setup_handoff_completion_tracking)"
                ),
            ));
        }
        for &(rid, failed) in &terminal {
            if let Some(p) = self.position(rid) {
                self.imports[p].reported = true;
            }
            if !shared {
                self.decided.insert(rid, failed);
            }
        }
        Ok(if shared { terminal } else { Vec::new() })
    }

    /// Record a decision for `request_id` (every model-parallel rank records the same).
    pub fn decide(&mut self, request_id: u64, failed: bool) {
        self.decided.insert(request_id, failed);
    }

    /// Decided imports in admission order, with whether they failed.
    pub fn decided_in_order(&self) -> Vec<(u64, bool)> {
        self.imports
            .iter()
            .filter_map(|i| self.decided.get(&i.request_id).map(|&f| (i.request_id, f)))
            .collect()
    }

    /// The import was admitted (or completed): it leaves the book.
    pub fn admitted(&mut self, request_id: u64) -> DisaggResult<()> {
        let p = self.position(request_id).ok_or(DisaggError::UnknownRequest { request_id })?;
        self.imports.remove(p);
        self.decided.remove(&request_id);
        Ok(())
    }

    /// Whether a failed import's storage may go back once its transfers are quiet: its
    /// destinations are safe and its terminal outcome was reported (a peer may fail before
    /// posting its half of a two-sided transfer: never wait on an unmatched operation).
    pub fn may_release(&self, request_id: u64) -> bool {
        self.position(request_id).is_some_and(|p| self.imports[p].safe && self.imports[p].reported)
    }

    /// The import failed: it leaves the book; its storage is released when
    /// [`Self::may_release`] and its transfers are `quiet`, else quarantined.
    pub fn failed(&mut self, request_id: u64, quiet: bool) -> DisaggResult<FailedStorage> {
        let release = self.may_release(request_id) && quiet;
        self.admitted(request_id)?;
        if release {
            return Ok(FailedStorage::Release);
        }
        self.quarantined.push(request_id);
        Ok(FailedStorage::Quarantine)
    }

    /// Imports in the book (started, not admitted or failed).
    pub fn num_importing(&self) -> usize {
        self.imports.len()
    }

    /// Failed imports whose storage is quarantined.
    pub fn num_quarantined(&self) -> usize {
        self.quarantined.len()
    }

    /// Reset, all or nothing: refused (`ResetRefused`, nothing changed) while blocks are
    /// `pinned` for a decode to read, or while a push or an import (in the book or
    /// quarantined) may still access cache storage (`pushes`, `imports`: each request with
    /// whether its transfers are quiet; an import in the book also needs safe destinations).
    /// Otherwise the book empties.
    pub fn reset(
        &mut self,
        pinned: &[u64],
        pushes: &[(u64, bool)],
        imports: &[(u64, bool)],
    ) -> DisaggResult<()> {
        if !pinned.is_empty() {
            return Err(DisaggError::ResetRefused {
                detail: format!(
                    "cannot reset while KV handoff blocks remain pinned for requests \
                     {pinned:?}: a decode may still be reading them; wait for RELEASE_KV"
                ),
            });
        }
        let busy_pushes: Vec<u64> =
            pushes.iter().filter(|(_, quiet)| !quiet).map(|&(rid, _)| rid).collect();
        let busy: Vec<u64> = imports
            .iter()
            .filter(|&&(rid, quiet)| {
                let safe = self.position(rid).is_none_or(|p| self.imports[p].safe);
                !(safe && quiet)
            })
            .map(|&(rid, _)| rid)
            .collect();
        if !busy_pushes.is_empty() || !busy.is_empty() {
            return Err(DisaggError::ResetRefused {
                detail: format!(
                    "cannot reset while KV handoff transfers may still access cache storage: \
                     pushes of requests {busy_pushes:?}, imports of requests {busy:?}"
                ),
            });
        }
        *self = Self::default();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: &[(&str, WireValue)]) -> WireValue {
        WireValue::Map(entries.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect())
    }
    fn b(v: bool) -> WireValue {
        WireValue::Bool(v)
    }
    fn i(v: i128) -> WireValue {
        WireValue::Int(v)
    }
    fn s(v: &str) -> WireValue {
        WireValue::Str(v.to_owned())
    }
    fn field_of(r: DisaggResult<()>) -> (&'static str, String) {
        match r.unwrap_err() {
            e @ DisaggError::HandoffState { .. } => ("state", field(&e)),
            e @ DisaggError::HandoffMetadata { .. } => ("metadata", field(&e)),
            e @ DisaggError::Argument { .. } => ("argument", field(&e)),
            other => panic!("{other:?}"),
        }
    }
    fn field(e: &DisaggError) -> String {
        match e {
            DisaggError::HandoffState { field, .. }
            | DisaggError::HandoffMetadata { field, .. }
            | DisaggError::Argument { field, .. } => field.clone(),
            other => panic!("{other:?}"),
        }
    }

    fn setup(role: &str, hybrid: bool, cache: bool, prefix: bool) -> DisaggResult<()> {
        let facts = map(&[
            ("role", s(role)),
            ("hybrid", b(hybrid)),
            ("state_cache", b(cache)),
            ("prefix_caching", b(prefix)),
        ]);
        check_reference("setup", &facts)
    }

    #[test]
    fn setup_accepts_exactly_the_state_cache_each_role_needs() {
        // Oracle: a hybrid prefill reads pinned state from its cache, a hybrid decode writes
        // live slots and must have none; prefix caching is always needed.
        for role in ["prefill", "decode"] {
            for hybrid in [false, true] {
                for cache in [false, true] {
                    for prefix in [false, true] {
                        let cache_ok = !hybrid || (cache == (role == "prefill"));
                        let r = setup(role, hybrid, cache, prefix);
                        assert_eq!(r.is_ok(), cache_ok && prefix, "{role} {hybrid} {cache}");
                        if !cache_ok {
                            assert_eq!(field_of(r), ("state", "mamba_slot_allocator".into()));
                        } else if !prefix {
                            assert_eq!(field_of(r), ("state", "enable_prefix_caching".into()));
                        }
                    }
                }
            }
        }
        assert_eq!(field_of(setup("both", false, false, true)), ("state", "role".into()));
        let role = |r: &str| check_reference("role", &map(&[("role", s(r))]));
        assert!(role("prefill").is_ok() && role("decode").is_ok());
        let e = role("both").unwrap_err();
        assert!(e.to_string().contains("role='both' must be 'prefill' or 'decode'"), "{e}");
    }

    #[test]
    fn ssm_buffers_must_match_the_configured_heads_and_the_layouts_channels() {
        let facts = |heads: Option<i128>, conv: i128| {
            let mut e =
                vec![("heads", i(8)), ("conv_channels", i(conv)), ("layout_conv_channels", i(96))];
            e.push(("mamba_num_heads", heads.map_or(WireValue::Null, i)));
            map(&e)
        };
        assert!(check_reference("ssm_buffers", &facts(None, 96)).is_ok());
        assert!(check_reference("ssm_buffers", &facts(Some(8), 96)).is_ok());
        let r = check_reference("ssm_buffers", &facts(Some(16), 95));
        assert_eq!(field_of(r), ("metadata", "mamba_num_heads".into()));
        let r = check_reference("ssm_buffers", &facts(Some(8), 95));
        assert_eq!(field_of(r), ("metadata", "mamba_conv_states".into()));
    }

    #[test]
    fn tp_ranks_must_register_the_same_state_kinds_in_any_order() {
        let kinds = |ranks: &[&[&str]]| {
            let list =
                ranks.iter().map(|r| WireValue::List(r.iter().map(|k| s(k)).collect())).collect();
            map(&[("kinds", WireValue::List(list))])
        };
        assert!(check_reference("tp_agents", &kinds(&[])).is_ok());
        assert!(check_reference(
            "tp_agents",
            &kinds(&[&["conv", "recurrent"], &["recurrent", "conv"]])
        )
        .is_ok());
        let r = check_reference("tp_agents", &kinds(&[&["conv", "recurrent"], &["conv"]]));
        assert_eq!(field_of(r), ("state", "ssm_state_kind".into()));
    }

    fn ticket(changes: &[(&str, WireValue)]) -> DisaggResult<()> {
        let mut e: Vec<(&str, WireValue)> = vec![
            ("prefix_caching", b(true)),
            ("hybrid", b(false)),
            ("has_backend", b(true)),
            ("request_id", i(4)),
            ("ssm", WireValue::Null),
            ("decode_has_ssm", b(false)),
            ("resume_tokens", i(1)),
            ("num_speculative_tokens", i(0)),
            ("return_log_probs", b(false)),
            ("top_n_logprobs", WireValue::Null),
            ("src_blocks", i(3)),
            ("prompt_tokens", i(9)),
            ("block_size", i(4)),
        ];
        for (k, v) in changes {
            e.iter_mut().find(|(key, _)| key == k).unwrap().1 = v.clone();
        }
        check_reference("ticket", &map(&e))
    }

    #[test]
    fn a_ticket_is_refused_by_the_engine_state_before_its_own_fields() {
        assert!(ticket(&[]).is_ok());
        let state = |c: &[(&str, WireValue)]| field_of(ticket(c));
        assert_eq!(
            state(&[("prefix_caching", b(false)), ("resume_tokens", i(0))]),
            ("state", "enable_prefix_caching".into())
        );
        assert_eq!(state(&[("hybrid", b(true))]), ("state", "setup_kv_transfer".into()));
        assert_eq!(state(&[("has_backend", b(false))]), ("state", "setup_kv_transfer".into()));
        assert_eq!(state(&[("top_n_logprobs", i(2))]), ("metadata", "return_log_probs".into()));
        assert_eq!(state(&[("src_blocks", i(2))]), ("metadata", "src_block_ids".into()));
        let ssm = map(&[("conv", WireValue::Null), ("recurrent", WireValue::Null)]);
        assert!(ticket(&[("hybrid", b(true)), ("decode_has_ssm", b(true)), ("ssm", ssm.clone())])
            .is_ok());
        assert_eq!(state(&[("ssm", ssm)]), ("metadata", "ssm".into()));
        assert_eq!(
            state(&[("decode_has_ssm", b(true)), ("ssm", WireValue::List(vec![]))]),
            ("metadata", "ssm".into())
        );
    }

    #[test]
    fn a_prefill_batch_names_each_requests_fields() {
        let row = |rid: i128, resume: i128, blocks: i128| {
            map(&[("request_id", i(rid)), ("resume_tokens", i(resume)), ("blocks", i(blocks))])
        };
        let facts = |rows: Vec<WireValue>, kv: i128| {
            map(&[
                ("requests", WireValue::List(rows)),
                ("kv_stages", i(kv)),
                ("ssm_stages", i(1)),
                ("pp_size", i(1)),
                ("num_speculative_tokens", i(1)),
            ])
        };
        assert!(check_reference("prefill", &facts(vec![row(1, 2, 1)], 1)).is_ok());
        let r = check_reference("prefill", &facts(vec![row(1, 2, 1)], 2));
        assert_eq!(field_of(r), ("metadata", "pp_metas".into()));
        let r = check_reference("prefill", &facts(vec![row(1, 2, 1), row(2, 1, 1)], 1));
        assert_eq!(field_of(r), ("metadata", "resume_tokens".into()));
        let r = check_reference("prefill", &facts(vec![row(1, 2, 0)], 1));
        assert_eq!(field_of(r), ("metadata", "block_ids".into()));
    }

    #[test]
    fn a_decode_ready_import_has_one_more_first_token_than_speculative_tokens_and_its_state() {
        let facts = |resume: i128, hybrid: bool, has_ssm: bool| {
            map(&[
                ("request_id", i(7)),
                ("resume_tokens", i(resume)),
                ("num_speculative_tokens", i(2)),
                ("hybrid", b(hybrid)),
                ("has_ssm", b(has_ssm)),
            ])
        };
        assert!(check_reference("decode_ready", &facts(3, true, true)).is_ok());
        assert!(check_reference("decode_ready", &facts(3, false, false)).is_ok());
        let r = check_reference("decode_ready", &facts(1, true, false));
        assert_eq!(field_of(r), ("metadata", "resume_tokens".into()));
        let r = check_reference("decode_ready", &facts(3, true, false));
        assert_eq!(field_of(r), ("state", "ssm".into()));
    }

    #[test]
    fn ssm_slots_are_reserved_outside_a_ledger_with_agents_and_pinned_slots_exist() {
        let reserve = |ledger: bool, agents: bool| {
            check_reference(
                "reserve_ssm",
                &map(&[("ledger", b(ledger)), ("ssm_agents", b(agents))]),
            )
        };
        assert!(reserve(false, true).is_ok());
        assert_eq!(field_of(reserve(true, true)), ("state", "ssm_slot".into()));
        assert_eq!(field_of(reserve(false, false)), ("state", "setup_kv_transfer".into()));
        let slot = |s: i128| {
            check_reference(
                "ssm_slot",
                &map(&[("request_id", i(3)), ("slot", i(s)), ("block", i(9))]),
            )
        };
        assert!(slot(0).is_ok());
        assert_eq!(field_of(slot(-1)), ("state", "ssm_slot".into()));
    }

    #[test]
    fn engine_state_checks_name_the_field_and_both_values() {
        let check = |stage: &str, e: &[(&str, WireValue)]| check_reference(stage, &map(e));
        let only = |n: i128, c: i128| {
            check(
                "decode_only",
                &[("num_prefill_requests", i(n)), ("chunked_prefill_request_id", i(c))],
            )
        };
        assert!(only(0, -1).is_ok());
        for (n, c) in [(1, -1), (0, 7)] {
            let e = only(n, c).unwrap_err();
            assert!(
                e.to_string()
                    .contains(&format!("num_prefill_requests={n}, chunked_prefill_request_id={c}")),
                "{e}"
            );
            assert_eq!(field(&e), "num_prefill_requests");
        }
        assert!(check("no_waiting", &[("waiting", i(0))]).is_ok());
        assert_eq!(field_of(check("no_waiting", &[("waiting", i(2))])), ("state", "role".into()));
        let look = |a: i128, b: i128| {
            check("lookahead", &[("lookahead_tokens", i(a)), ("num_speculative_tokens", i(b))])
        };
        assert!(look(2, 2).is_ok());
        let e = look(1, 2).unwrap_err();
        assert!(
            e.to_string().contains("lookahead_tokens=1 but the engine's num_speculative_tokens=2"),
            "{e}"
        );
        let head = |r: i128, h: i128| check("queue_head", &[("request_id", i(r)), ("head", i(h))]);
        assert!(head(4, 4).is_ok());
        assert_eq!(field_of(head(4, 5)), ("state", "waiting_request_ids".into()));
    }

    #[test]
    fn an_unknown_stage_or_a_mistyped_fact_is_an_argument_error() {
        let r = check_reference("teardown", &map(&[]));
        assert_eq!(field_of(r), ("argument", "stage".into()));
        let facts = map(&[
            ("role", s("decode")),
            ("hybrid", i(1)),
            ("state_cache", b(false)),
            ("prefix_caching", b(true)),
        ]);
        assert_eq!(field_of(check_reference("setup", &facts)), ("argument", "hybrid".into()));
    }

    /// Oracle of the admission pass: decided imports leave in start order; failed ones never
    /// wait; ok ones wait only for decode room.
    #[test]
    fn imports_are_decided_by_their_reports_and_leave_in_start_order() {
        let mut book = ReferenceImports::new();
        for rid in [3, 1, 2] {
            book.start(rid, rid != 2).unwrap();
        }
        assert!(matches!(book.start(1, true), Err(DisaggError::DuplicateRequest { .. })));
        assert_eq!(book.unreported(), vec![3, 1, 2]);
        // One rank: this rank's report decides; a running import is skipped.
        let out = book.report(&[(3, None), (1, Some(false)), (2, Some(true))], false, 1).unwrap();
        assert!(out.is_empty());
        assert_eq!(book.unreported(), vec![3]);
        assert_eq!(book.decided_in_order(), vec![(1, false), (2, true)]);
        // A second report of a reported import is ignored.
        book.report(&[(1, Some(true))], false, 1).unwrap();
        assert_eq!(book.decided_in_order(), vec![(1, false), (2, true)]);
        // Failed: storage back only when safe, reported and quiet.
        assert!(!book.may_release(2));
        assert_eq!(book.failed(2, true).unwrap(), FailedStorage::Quarantine);
        book.admitted(1).unwrap();
        assert_eq!((book.num_importing(), book.num_quarantined()), (1, 1));
        book.decide(3, false);
        assert_eq!(book.decided_in_order(), vec![(3, false)]);
        assert!(book.admitted(9).is_err());
    }

    #[test]
    fn model_parallel_ranks_report_through_the_tracker_or_are_refused() {
        let mut book = ReferenceImports::new();
        book.start(1, true).unwrap();
        let before = book.clone();
        let e = book.report(&[(1, Some(false))], false, 2).unwrap_err();
        assert!(
            matches!(e, DisaggError::HandoffState { ref field, .. } if field == "_handoff_completion_tracker")
        );
        assert_eq!(book, before);
        // Nothing terminal: nothing to decide, no tracker needed.
        assert!(book.report(&[(1, None)], false, 2).unwrap().is_empty());
        assert_eq!(book.report(&[(1, Some(true))], true, 2).unwrap(), vec![(1, true)]);
        assert!(book.decided_in_order().is_empty());
        book.decide(1, true);
        assert_eq!(book.failed(1, true).unwrap(), FailedStorage::Release);
    }

    #[test]
    fn a_reset_is_refused_whole_while_anything_may_touch_storage() {
        let mut book = ReferenceImports::new();
        book.start(1, true).unwrap();
        book.start(2, false).unwrap();
        let before = book.clone();
        let refused = |r: DisaggResult<()>, want: &str| match r {
            Err(DisaggError::ResetRefused { detail }) => assert!(detail.contains(want), "{detail}"),
            other => panic!("{other:?}"),
        };
        refused(book.reset(&[4], &[], &[(1, true)]), "remain pinned for requests [4]");
        refused(book.reset(&[], &[(7, false)], &[(1, true)]), "pushes of requests [7]");
        refused(book.reset(&[], &[], &[(1, true), (2, true)]), "imports of requests [2]");
        refused(book.reset(&[], &[], &[(1, false)]), "imports of requests [1]");
        assert_eq!(book, before);
        let mut quiet = ReferenceImports::new();
        quiet.start(1, true).unwrap();
        quiet.reset(&[], &[(7, true)], &[(1, true)]).unwrap();
        assert_eq!(quiet, ReferenceImports::new());
    }

    #[test]
    fn a_ticket_is_captured_only_with_prepared_metadata() {
        let prepared = |p: bool| {
            check_reference("prepared", &map(&[("request_id", i(3)), ("prepared", b(p))]))
        };
        assert!(prepared(true).is_ok());
        assert_eq!(field_of(prepared(false)), ("state", "prepared".into()));
        let e = prepared(false).unwrap_err();
        assert!(e.to_string().contains("request 3: no handoff metadata was prepared"), "{e}");
    }
}
