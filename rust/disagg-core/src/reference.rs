//! Checks of an engine built on the reference design (Megatron-LM's disaggregation package):
//! an engine that brings its own block allocator and attaches no ledger.
//!
//! Each check is one [`ReferenceCheck`] built from a small facts map (what the engine's
//! configuration and the request say), so the engine-side Python only gathers facts and calls
//! [`check_reference`] once per stage. Every refusal names the field and both values.

use crate::error::{DisaggError, DisaggResult};
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
                format!("role={other:?} must be 'prefill' or 'decode'"),
            )),
        }
    }
}

/// One check of a reference-design engine, with the facts it needs.
#[derive(Debug, Clone, PartialEq)]
pub enum ReferenceCheck {
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

impl ReferenceCheck {
    /// The check named `stage` (`setup`, `ssm_buffers`, `tp_agents`, `prefill`, `ticket`,
    /// `decode_ready`) over its facts map; an `Argument` error for an unknown stage or a
    /// missing or mistyped fact.
    pub fn parse(stage: &str, facts: &WireValue) -> DisaggResult<Self> {
        let o = Obj::of(facts, "facts")?;
        let n = |key: &str| o.u64(key);
        Ok(match stage {
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
                        Ok((r.u64("request_id")?, r.u64("resume_tokens")?, r.u64("blocks")?))
                    })
                    .collect::<DisaggResult<_>>()?;
                Self::Prefill(ReferencePrefillBatch {
                    kv_stages: n("kv_stages")?,
                    ssm_stages: n("ssm_stages")?,
                    pp_size: n("pp_size")?,
                    num_speculative_tokens: n("num_speculative_tokens")?,
                    requests,
                })
            }
            "ticket" => Self::Ticket {
                prefix_caching: flag(&o, "prefix_caching")?,
                hybrid: flag(&o, "hybrid")?,
                has_backend: flag(&o, "has_backend")?,
                ticket: ReferenceTicket {
                    request_id: n("request_id")?,
                    ssm: ssm_entry(o.get("ssm")),
                    decode_has_ssm: flag(&o, "decode_has_ssm")?,
                    resume_tokens: n("resume_tokens")?,
                    num_speculative_tokens: n("num_speculative_tokens")?,
                    return_log_probs: flag(&o, "return_log_probs")?,
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
            },
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
                        "unknown check {other:?}; known: setup, ssm_buffers, tp_agents, \
                         prefill, ticket, decode_ready"
                    ),
                ))
            }
        })
    }

    /// Refuse what the engine cannot do, naming the field: `HandoffState` errors for the
    /// engine's configuration, `HandoffMetadata` errors for metadata and tickets.
    pub fn check(&self) -> DisaggResult<()> {
        match self {
            Self::Setup { role, hybrid, state_cache, prefix_caching } => {
                if *hybrid && *role == Role::Prefill && !state_cache {
                    return Err(DisaggError::handoff_state(
                        "mamba_slot_allocator",
                        "a hybrid prefill handoff needs an SSM state cache (mamba_slot_allocator \
                         is None): the pinned state is read from it",
                    ));
                }
                if *hybrid && *role == Role::Decode && *state_cache {
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
            Self::Prefill(batch) => batch.check(),
            Self::Ticket { prefix_caching, hybrid, has_backend, ticket } => {
                let rid = ticket.request_id;
                if !prefix_caching {
                    return Err(DisaggError::handoff_state(
                        "enable_prefix_caching",
                        "add_request_with_kv_handoff needs prefix caching on the decode engine \
                         (enable_prefix_caching=False)",
                    ));
                }
                if *hybrid && !ticket.decode_has_ssm {
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
                        format!(
                            "request {rid}: no transfer backend (setup_kv_transfer has not run)"
                        ),
                    ));
                }
                ticket.check()
            }
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

/// Parse and run the check named `stage` over `facts` (see [`ReferenceCheck`]).
pub fn check_reference(stage: &str, facts: &WireValue) -> DisaggResult<()> {
    ReferenceCheck::parse(stage, facts)?.check()
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
}
