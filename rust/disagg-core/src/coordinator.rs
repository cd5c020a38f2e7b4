//! The coordinator's routing and bookkeeping, sans-IO: one checked message in, addressed
//! messages out.
//!
//! Requests go from a client to a prefill engine (`PREFILL`), then with the prefill's ticket to
//! a decode engine (`SUBMIT_REQUEST_WITH_KV`); the decode's tokens and outcome go back to the
//! client. The coordinator gives each attempt an epoch, hears a message only from the engine
//! that plays its part for the request at its epoch, releases a prefill's pinned blocks once no
//! decode may read them, fails a request at its deadline or when an engine it depends on
//! restarts or goes silent, and counts what it ignores.
//!
//! Payloads the coordinator only forwards (engine metadata, prompts, tickets, token lists,
//! transfer descriptions) are of the caller's type `P`; the coordinator never looks inside.
//! Time is the caller's `now` in seconds (any monotonic origin).

use std::collections::BTreeMap;

use crate::args::Given;
use crate::driver::{recv_posted_route, RecvPosted};
use crate::error::{DisaggError, DisaggResult};
use crate::wire::control::{Kind, MAX_ID, MAX_TIMEOUT_S};

/// A field of an outgoing message.
#[derive(Debug, Clone, PartialEq)]
pub enum Field<P> {
    /// `nil`.
    Nil,
    /// An id, epoch or incarnation.
    Int(u64),
    /// A text.
    Text(String),
    /// A bool.
    Bool(bool),
    /// A payload, as the caller gave it.
    Payload(P),
    /// A map of named fields.
    Map(Vec<(String, Field<P>)>),
    /// A copy of a payload map with these entries set (a ticket with its provenance).
    Amended(P, Vec<(String, Field<P>)>),
}

fn map<P>(pairs: Vec<(&str, Field<P>)>) -> Field<P> {
    Field::Map(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

/// One message to send: to an engine id, or to a client identity.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing<P> {
    /// The engine it goes to (`None`: a client).
    pub to_engine: Option<String>,
    /// The client identity it goes to (`None`: an engine).
    pub to_client: Option<Vec<u8>>,
    /// Its type.
    pub kind: Kind,
    /// Its fields: a [`Field::Map`], or a client's `DONE` as the engine sent it
    /// ([`Field::Amended`]).
    pub fields: Field<P>,
}

impl<P> Outgoing<P> {
    fn engine(to: &str, kind: Kind, fields: Vec<(&'static str, Field<P>)>) -> Self {
        Self { to_engine: Some(to.to_owned()), to_client: None, kind, fields: map(fields) }
    }

    fn client(to: &[u8], kind: Kind, fields: Vec<(&'static str, Field<P>)>) -> Self {
        Self { to_engine: None, to_client: Some(to.to_vec()), kind, fields: map(fields) }
    }
}

/// One schema-checked message to the coordinator, with what it carries (fields as on the wire).
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Event<P> {
    /// An engine (re)registers.
    Register { engine_id: String, role: String, incarnation: u64, meta: P },
    /// A client submits a request (`timeout_s`: `None` for the coordinator's default).
    Submit { request_id: u64, prompt: P, max_new_tokens: u64, timeout_s: Option<f64> },
    /// An engine is alive (its claimed id).
    Heartbeat { engine_id: String },
    /// A decode posted receives (two-sided transports); `prefill`: the prefill it names;
    /// `transfer`: where (none: the prefill is told an empty map).
    KvRecvPosted { request_id: u64, epoch: u64, prefill: Option<String>, transfer: Option<P> },
    /// The prefill pinned the state; `resume`: the ticket's resume tokens and their count.
    PrefillDone { request_id: u64, epoch: u64, ticket: P, resume: (P, usize) },
    /// The prefill failed the request.
    PrefillFailed { request_id: u64, epoch: u64, error: String },
    /// The decode's import settled (`quiet`: none of its reads may still run).
    KvImported { request_id: u64, epoch: u64, ok: bool, error: String, quiet: bool },
    /// New tokens of a decoding request.
    Tokens { request_id: u64, epoch: Option<u64>, tokens: P },
    /// A request finished; `fields`: what its client is told.
    Done { request_id: u64, epoch: Option<u64>, fields: P },
    /// An engine failed the request.
    Failed { request_id: u64, epoch: Option<u64>, error: String, quiet: bool },
}

/// The fields of a `DONE` its client is not told: the frame's `type` and `v`, and the epoch.
pub const DONE_WITHHELD: [&str; 3] = ["type", "v", "epoch"];

impl<P> Event<P> {
    /// A `KV_IMPORTED`: a failure without a reason reads `unknown error`, and `quiet` counts
    /// only when it is `true`.
    pub fn kv_imported(
        request_id: u64,
        epoch: u64,
        ok: bool,
        error: Option<String>,
        quiet: Option<bool>,
    ) -> Self {
        let error = error.unwrap_or_else(|| "unknown error".to_owned());
        Self::KvImported { request_id, epoch, ok, error, quiet: quiet == Some(true) }
    }

    /// A `FAILED`: `quiet` counts only when it is `true`.
    pub fn failed(request_id: u64, epoch: Option<u64>, error: String, quiet: Option<bool>) -> Self {
        Self::Failed { request_id, epoch, error, quiet: quiet == Some(true) }
    }

    /// The message type.
    pub fn kind(&self) -> Kind {
        match self {
            Self::Register { .. } => Kind::Register,
            Self::Submit { .. } => Kind::Submit,
            Self::Heartbeat { .. } => Kind::Heartbeat,
            Self::KvRecvPosted { .. } => Kind::KvRecvPosted,
            Self::PrefillDone { .. } => Kind::PrefillDone,
            Self::PrefillFailed { .. } => Kind::PrefillFailed,
            Self::KvImported { .. } => Kind::KvImported,
            Self::Tokens { .. } => Kind::Tokens,
            Self::Done { .. } => Kind::Done,
            Self::Failed { .. } => Kind::Failed,
        }
    }

    /// The request and the epoch the message names (`None`: no request, or no epoch given).
    fn request(&self) -> Option<(u64, Option<u64>)> {
        match *self {
            Self::PrefillDone { request_id, epoch, .. }
            | Self::PrefillFailed { request_id, epoch, .. }
            | Self::KvImported { request_id, epoch, .. } => Some((request_id, Some(epoch))),
            Self::Tokens { request_id, epoch, .. }
            | Self::Done { request_id, epoch, .. }
            | Self::Failed { request_id, epoch, .. } => Some((request_id, epoch)),
            _ => None,
        }
    }
}

/// A registered engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Engine<P> {
    /// Its id.
    pub engine_id: String,
    /// `"prefill"` or `"decode"`.
    pub role: String,
    /// Its incarnation (a restart registers a larger one).
    pub incarnation: u64,
    /// Its static metadata, forwarded to its peers.
    pub meta: P,
    /// The identity its messages come from.
    pub identity: Vec<u8>,
    /// When it was last heard from.
    pub last_seen: f64,
}

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Sent to its prefill.
    Prefilling,
    /// Its ticket went to its decode.
    Decoding,
}

/// A live request (read through [`Request::state`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Request<P> {
    id: u64,
    client: Vec<u8>,
    prompt: P,
    max_new_tokens: u64,
    deadline: f64,
    /// This attempt's epoch.
    epoch: u64,
    phase: Phase,
    prefill: Option<String>,
    decode: Option<String>,
    /// Whether its prefill holds pinned blocks for it.
    pinned: bool,
    /// Whether the decode was sent the ticket: it may read the pinned blocks until quiet.
    ticket_sent: bool,
}

impl<P> Request<P> {
    /// `(epoch, phase, prefill, decode, pinned, ticket_sent, deadline)`.
    pub fn state(&self) -> (u64, Phase, Option<&str>, Option<&str>, bool, bool, f64) {
        let (prefill, decode) = (self.prefill.as_deref(), self.decode.as_deref());
        (self.epoch, self.phase, prefill, decode, self.pinned, self.ticket_sent, self.deadline)
    }

    /// Whether a message of `kind` at `epoch` (`None`: the current one) from `sender` is heard:
    /// of this attempt, and from the engine that plays that part (not another engine, nor an
    /// identity that is no registered engine, such as a replaced incarnation still talking).
    pub fn hears(&self, kind: Kind, epoch: Option<u64>, sender: Option<&str>) -> bool {
        let (prefill, decode) = (self.prefill.as_deref(), self.decode.as_deref());
        let allowed = match kind {
            Kind::PrefillDone | Kind::PrefillFailed => [prefill, None],
            Kind::KvImported | Kind::Tokens | Kind::Done => [decode, None],
            _ => [prefill, decode],
        };
        epoch.unwrap_or(self.epoch) == self.epoch && sender.is_some() && allowed.contains(&sender)
    }

    /// Whether the request loses state it still needs when `engine_id` restarts or is lost. A
    /// prefill matters while it prefills and while its pins are the decode's source (until
    /// `KV_IMPORTED`); a decode matters once it was handed the request (one still prefilling
    /// is handed to the decode's new incarnation: same layout, a state staged for it stays
    /// valid).
    pub fn lost_with(&self, engine_id: &str) -> bool {
        let prefill = self.prefill.as_deref() == Some(engine_id);
        let decode = self.decode.as_deref() == Some(engine_id);
        (prefill && (self.phase == Phase::Prefilling || self.pinned))
            || (decode && self.phase == Phase::Decoding)
    }
}

/// What the coordinator counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    /// Messages ignored (stale, from the wrong engine, duplicate), by type.
    pub ignored: BTreeMap<String, u64>,
    /// Messages refused by their schema (or that failed to apply), by type.
    pub malformed: BTreeMap<String, u64>,
    /// Engines declared lost by the liveness timeout, by id.
    pub lost: BTreeMap<String, u64>,
    /// Requests finished.
    pub completed: u64,
    /// Requests failed.
    pub failed: u64,
    /// `KV_RECV_POSTED` answered with fillers (`SEND_KV` with `abort`).
    pub aborted_pushes: u64,
    /// Failed requests whose pins were left to the prefill's lease (a decode may still read).
    pub left_to_lease: u64,
}

type Fields<P> = Vec<(&'static str, Field<P>)>;

/// The coordinator's state (see the module documentation).
#[derive(Debug, Clone)]
pub struct Coordinator<P> {
    request_timeout_s: f64,
    push_transport: bool,
    engine_timeout_s: Option<f64>,
    engines: BTreeMap<String, Engine<P>>,
    requests: BTreeMap<u64, Request<P>>,
    next_epoch: u64,
    round_robin: BTreeMap<String, usize>,
    shutting_down: bool,
    counters: Counters,
}

fn bump(map: &mut BTreeMap<String, u64>, key: &str) {
    *map.entry(key.to_owned()).or_default() += 1;
}

fn opt_text<P>(s: Option<&str>) -> Field<P> {
    s.map_or(Field::Nil, |s| Field::Text(s.to_owned()))
}

fn check_timeout(field: &str, t: f64) -> DisaggResult<f64> {
    if t > 0.0 && t <= MAX_TIMEOUT_S {
        return Ok(t);
    }
    let detail = format!("{field}={t} must be in (0, {MAX_TIMEOUT_S}] seconds");
    Err(DisaggError::argument(field, detail))
}

/// A timeout in seconds: a real number in `(0, MAX_TIMEOUT_S]`. NaN, inf, zero, negative, a
/// bool and a non-number are refused naming `field` (a NaN deadline would never pass).
pub fn timeout_seconds(field: &str, value: &Given<f64>) -> DisaggResult<f64> {
    match &value.0 {
        Ok(t) => check_timeout(field, *t),
        Err(given) => Err(DisaggError::argument_type(
            field,
            format!("{field}={given} must be a number of seconds"),
        )),
    }
}

/// Whether an end of the control plane (`what`) runs CURVE: it must have its keys (`have`),
/// or plain TCP must be asked for with `insecure`; neither, or both, are refused naming
/// `keys` or `insecure`.
pub fn curve_mode(what: &str, have: bool, insecure: bool) -> DisaggResult<bool> {
    match (have, insecure) {
        (true, true) => Err(DisaggError::argument(
            "insecure",
            format!("{what}: keys were given together with insecure=True"),
        )),
        (false, false) => Err(DisaggError::argument(
            "keys",
            format!(
                "{what}: the control plane needs CURVE keys (keys= and the coordinator's public \
                 key); pass insecure=True to run plain TCP on a trusted private network"
            ),
        )),
        _ => Ok(have),
    }
}

impl<P: Clone> Coordinator<P> {
    /// A coordinator with no engines. `request_timeout_s`: a request's default deadline;
    /// `push_transport`: two-sided transfers (the prefill pushes on `KV_RECV_POSTED`);
    /// `engine_timeout_s`: liveness (`None`: off), must be > 0.
    pub fn new(
        request_timeout_s: f64,
        push_transport: bool,
        engine_timeout_s: Option<f64>,
    ) -> DisaggResult<Self> {
        if let Some(t) = engine_timeout_s.filter(|t| t.is_nan() || *t <= 0.0) {
            return Err(DisaggError::argument(
                "engine_timeout_s",
                format!("engine_timeout_s={t} must be > 0 or None"),
            ));
        }
        Ok(Self {
            request_timeout_s: check_timeout("request_timeout_s", request_timeout_s)?,
            push_transport,
            engine_timeout_s,
            engines: BTreeMap::new(),
            requests: BTreeMap::new(),
            next_epoch: 1,
            round_robin: BTreeMap::new(),
            shutting_down: false,
            counters: Counters::default(),
        })
    }

    /// The registered engines, by id.
    pub fn engines(&self) -> &BTreeMap<String, Engine<P>> {
        &self.engines
    }

    /// The live requests, by id.
    pub fn requests(&self) -> &BTreeMap<u64, Request<P>> {
        &self.requests
    }

    /// What was counted.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Whether [`Coordinator::shutdown`] was called.
    pub fn shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// Count a message of type `name` as malformed.
    pub fn count_malformed(&mut self, name: &str) {
        bump(&mut self.counters.malformed, name);
    }

    /// The identity a message goes to: its client, or the engine's current identity (`None`:
    /// the engine is gone).
    pub fn address<'a>(
        &'a self,
        to_engine: Option<&str>,
        to_client: Option<&'a [u8]>,
    ) -> Option<&'a [u8]> {
        to_client.or_else(|| Some(&self.engines.get(to_engine?)?.identity))
    }

    /// The engine id whose messages come from `identity`.
    pub fn sender(&self, identity: &[u8]) -> Option<&str> {
        self.engines.values().find(|e| e.identity == identity).map(|e| e.engine_id.as_str())
    }

    /// Whether a message of `kind` from `identity` with CURVE key `user_key` is authentic: it
    /// speaks for the engine id it claims (`REGISTER`/`HEARTBEAT`: its `engine_id` field,
    /// otherwise the engine registered from that identity) only with the key `keys` binds to
    /// that id; a peer that claims no engine may only `SUBMIT` (a client).
    pub fn authentic(
        &self,
        identity: &[u8],
        kind: Kind,
        claimed_id: Option<&str>,
        user_key: &str,
        keys: &BTreeMap<String, String>,
    ) -> bool {
        let claims = matches!(kind, Kind::Register | Kind::Heartbeat);
        match if claims { claimed_id } else { self.sender(identity) } {
            None => kind == Kind::Submit,
            Some(id) => keys.get(id).is_some_and(|k| k == user_key),
        }
    }

    /// The answer to a message refused by its schema: a `SUBMIT` whose request id is usable
    /// and not live gets `FAILED` with `error`, so its client does not wait for its timeout;
    /// anything else gets nothing.
    pub fn refused(
        &self,
        identity: &[u8],
        kind: Option<Kind>,
        request_id: Option<i128>,
        error: &str,
    ) -> Vec<Outgoing<P>> {
        let usable = request_id
            .filter(|r| (0..=i128::from(MAX_ID)).contains(r))
            .and_then(|r| u64::try_from(r).ok())
            .filter(|r| !self.requests.contains_key(r));
        match (kind, usable) {
            (Some(Kind::Submit), Some(rid)) => vec![Self::failed_to(identity, rid, error)],
            _ => Vec::new(),
        }
    }

    /// [`Coordinator::refused`] for a frame refused at decode: its `type` and `request_id` are
    /// read if the frame is a msgpack map that has them.
    pub fn refused_frame(&self, identity: &[u8], data: &[u8], error: &str) -> Vec<Outgoing<P>> {
        let (kind, rid) = frame::frame_head(data);
        self.refused(identity, kind, rid, error)
    }

    fn failed_to(client: &[u8], request_id: u64, error: &str) -> Outgoing<P> {
        let fields =
            vec![("request_id", Field::Int(request_id)), ("error", Field::Text(error.into()))];
        Outgoing::client(client, Kind::Failed, fields)
    }

    fn ids(request_id: u64, epoch: u64) -> Fields<P> {
        vec![("request_id", Field::Int(request_id)), ("epoch", Field::Int(epoch))]
    }

    fn peers(&self) -> Field<P> {
        let entry = |e: &Engine<P>| {
            Field::Map(vec![
                ("role".into(), Field::Text(e.role.clone())),
                ("incarnation".into(), Field::Int(e.incarnation)),
                ("meta".into(), Field::Payload(e.meta.clone())),
            ])
        };
        Field::Map(self.engines.values().map(|e| (e.engine_id.clone(), entry(e))).collect())
    }

    fn peers_to_all(&self, except: Option<&str>) -> Vec<Outgoing<P>> {
        let others = self.engines.keys().filter(|id| Some(id.as_str()) != except);
        others.map(|id| Outgoing::engine(id, Kind::Peers, vec![("peers", self.peers())])).collect()
    }

    fn pick(&mut self, role: &str) -> Option<String> {
        let ids: Vec<&String> =
            self.engines.values().filter(|e| e.role == role).map(|e| &e.engine_id).collect();
        if ids.is_empty() {
            return None;
        }
        let turn = self.round_robin.entry(role.to_owned()).or_default();
        let id = ids[*turn % ids.len()].clone();
        *turn += 1;
        Some(id)
    }

    /// Apply one schema-checked message from `identity` at `now`; returns what to send.
    pub fn handle(&mut self, identity: &[u8], event: Event<P>, now: f64) -> Vec<Outgoing<P>> {
        let sender = self.sender(identity).map(str::to_owned);
        if let Some(e) = sender.as_ref().and_then(|s| self.engines.get_mut(s)) {
            e.last_seen = now;
        }
        match event {
            Event::Register { engine_id, role, incarnation, meta } => {
                let identity = identity.to_vec();
                self.on_register(Engine {
                    engine_id,
                    role,
                    incarnation,
                    meta,
                    identity,
                    last_seen: now,
                })
            }
            Event::Submit { request_id, prompt, max_new_tokens, timeout_s } => {
                let timeout = timeout_s.unwrap_or(self.request_timeout_s);
                self.on_submit(identity, request_id, prompt, max_new_tokens, timeout, now)
            }
            Event::Heartbeat { engine_id } => self.on_heartbeat(identity, sender, engine_id),
            Event::KvRecvPosted { request_id, epoch, prefill, transfer } => self.on_recv_posted(
                sender.as_deref(),
                request_id,
                epoch,
                prefill.as_deref(),
                transfer,
            ),
            other => self.on_request(sender.as_deref(), other),
        }
    }

    /// A message about a live request: heard only at the request's epoch (a message without
    /// one: the current) and from the engine that plays that part for it, else ignored.
    fn on_request(&mut self, sender: Option<&str>, event: Event<P>) -> Vec<Outgoing<P>> {
        let kind = event.kind();
        let Some((rid, epoch)) = event.request() else {
            return Vec::new();
        };
        let Some(req) = self.requests.remove(&rid) else {
            bump(&mut self.counters.ignored, kind.name());
            return Vec::new();
        };
        if !req.hears(kind, epoch, sender) {
            self.requests.insert(rid, req);
            bump(&mut self.counters.ignored, kind.name());
            return Vec::new();
        }
        match event {
            Event::PrefillDone { ticket, resume, .. } => self.on_prefill_done(req, ticket, resume),
            Event::PrefillFailed { error, .. } => self.fail(req, &error, false),
            Event::KvImported { ok, error, quiet, .. } => self.on_imported(req, ok, &error, quiet),
            Event::Tokens { tokens, .. } => {
                let fields =
                    vec![("request_id", Field::Int(rid)), ("tokens", Field::Payload(tokens))];
                let out = vec![Outgoing::client(&req.client, Kind::Tokens, fields)];
                self.requests.insert(rid, req);
                out
            }
            Event::Done { fields, .. } => self.on_done(req, fields),
            Event::Failed { error, quiet, .. } => self.fail(req, &error, quiet),
            _ => {
                self.requests.insert(rid, req); // not about a request (handled before)
                Vec::new()
            }
        }
    }

    fn on_register(&mut self, engine: Engine<P>) -> Vec<Outgoing<P>> {
        let (id, incarnation) = (engine.engine_id.clone(), engine.incarnation);
        let old = self.engines.get(&id).map(|e| e.incarnation);
        let mut out = Vec::new();
        match old {
            Some(old) if incarnation < old => {
                bump(&mut self.counters.ignored, Kind::Register.name());
                return out;
            }
            // A restarted engine lost its state: fail the requests that still depend on it.
            Some(old) if incarnation > old => {
                let why = format!(
                    "engine {id} restarted (incarnation {old} -> {incarnation}) while holding \
                     this request's state"
                );
                out = self.fail_dependents(&id, &why);
            }
            _ => {}
        }
        self.engines.insert(id.clone(), engine);
        let fields = vec![
            ("engine_id", Field::Text(id.clone())),
            ("incarnation", Field::Int(incarnation)),
            ("peers", self.peers()),
        ];
        out.push(Outgoing::engine(&id, Kind::Registered, fields));
        out.extend(self.peers_to_all(Some(&id)));
        out
    }

    /// Acknowledge a registered engine's heartbeat; tell any other identity (fenced, or never
    /// registered) to register again. A fenced engine's old requests have failed; what it
    /// still holds for them drains on its side (pins by lease, imports by deadline).
    fn on_heartbeat(
        &mut self,
        identity: &[u8],
        sender: Option<String>,
        claimed: String,
    ) -> Vec<Outgoing<P>> {
        if let Some(id) = sender {
            let inc = self.engines[&id].incarnation;
            let fields =
                vec![("engine_id", Field::Text(id.clone())), ("incarnation", Field::Int(inc))];
            return vec![Outgoing::engine(&id, Kind::HeartbeatAck, fields)];
        }
        bump(&mut self.counters.ignored, Kind::Heartbeat.name());
        vec![Outgoing::client(identity, Kind::Fenced, vec![("engine_id", Field::Text(claimed))])]
    }

    fn on_submit(
        &mut self,
        client: &[u8],
        request_id: u64,
        prompt: P,
        max_new_tokens: u64,
        timeout_s: f64,
        now: f64,
    ) -> Vec<Outgoing<P>> {
        let refusal = match check_timeout("timeout_s", timeout_s) {
            Err(e) => Some(e.to_string()),
            Ok(_) if self.requests.contains_key(&request_id) => Some("duplicate request id".into()),
            Ok(_) => None,
        };
        if let Some(error) = refusal {
            bump(&mut self.counters.ignored, Kind::Submit.name());
            return vec![Self::failed_to(client, request_id, &error)];
        }
        let epoch = self.next_epoch;
        self.next_epoch += 1;
        let prefill = self.pick("prefill");
        // The decode is chosen now so that a one-sided prefill can stage (pack) its state for
        // that decode's layout before it announces the handoff.
        let decode = prefill.as_ref().and_then(|_| self.pick("decode"));
        let req = Request {
            id: request_id,
            client: client.to_vec(),
            prompt: prompt.clone(),
            max_new_tokens,
            deadline: now + timeout_s,
            epoch,
            phase: Phase::Prefilling,
            prefill: prefill.clone(),
            decode: decode.clone(),
            pinned: false,
            ticket_sent: false,
        };
        let Some(prefill) = prefill else {
            return self.fail(req, "no prefill engine registered", false);
        };
        self.requests.insert(request_id, req);
        let mut fields = Self::ids(request_id, epoch);
        fields.push(("prompt", Field::Payload(prompt)));
        fields.push(("max_new_tokens", Field::Int(max_new_tokens)));
        fields.push(("decode_engine_id", opt_text(decode.as_deref())));
        vec![Outgoing::engine(&prefill, Kind::Prefill, fields)]
    }

    fn on_prefill_done(
        &mut self,
        mut req: Request<P>,
        ticket: P,
        resume: (P, usize),
    ) -> Vec<Outgoing<P>> {
        if req.phase == Phase::Decoding {
            self.requests.insert(req.id, req);
            bump(&mut self.counters.ignored, Kind::PrefillDone.name());
            return Vec::new();
        }
        req.pinned = true;
        req.phase = Phase::Decoding;
        if !req.decode.as_ref().is_some_and(|d| self.engines.contains_key(d)) {
            req.decode = self.pick("decode");
        }
        let Some(decode) = req.decode.clone() else {
            return self.fail(req, "no decode engine registered", false);
        };
        req.ticket_sent = true; // from now on the decode may read the pinned blocks
        let prefill = req.prefill.as_deref();
        let incarnation = prefill.and_then(|p| self.engines.get(p)).map(|e| e.incarnation);
        // Provenance comes from the coordinator's own state, never from the sender's ticket.
        let provenance = vec![
            ("prefill_engine_id".to_owned(), opt_text(prefill)),
            ("prefill_incarnation".to_owned(), incarnation.map_or(Field::Nil, Field::Int)),
            ("epoch".to_owned(), Field::Int(req.epoch)),
        ];
        let rid = req.id;
        let mut out = Vec::new();
        if resume.1 > 0 {
            let fields =
                vec![("request_id", Field::Int(rid)), ("tokens", Field::Payload(resume.0))];
            out.push(Outgoing::client(&req.client, Kind::Tokens, fields));
        }
        let mut fields = Self::ids(rid, req.epoch);
        fields.push(("prompt", Field::Payload(req.prompt.clone())));
        fields.push(("max_new_tokens", Field::Int(req.max_new_tokens)));
        fields.push(("ticket", Field::Amended(ticket, provenance)));
        out.push(Outgoing::engine(&decode, Kind::SubmitRequestWithKv, fields));
        self.requests.insert(rid, req);
        out
    }

    /// A decode posted receives: its request's prefill pushes them (`SEND_KV`), or, where the
    /// request is gone, no longer pinned, of another epoch or of another decode, the prefill
    /// the message names answers them with fillers (`SEND_KV` with `abort`): see
    /// [`recv_posted_route`].
    fn on_recv_posted(
        &mut self,
        sender: Option<&str>,
        request_id: u64,
        epoch: u64,
        named: Option<&str>,
        transfer: Option<P>,
    ) -> Vec<Outgoing<P>> {
        let role = |id: Option<&str>| id.and_then(|i| self.engines.get(i)).map_or("", |e| &e.role);
        let req = self.requests.get(&request_id);
        let route = sender.and_then(|s| {
            recv_posted_route(&RecvPosted {
                push_transport: self.push_transport,
                sender: (s, role(Some(s))),
                epoch,
                request: req.map_or((None, 0, false, None), |r| {
                    (r.decode.as_deref(), r.epoch, r.pinned, r.prefill.as_deref())
                }),
                named: (named.unwrap_or("None"), role(named)),
            })
        });
        let Some((target, abort)) = route else {
            bump(&mut self.counters.ignored, Kind::KvRecvPosted.name());
            return Vec::new();
        };
        self.counters.aborted_pushes += u64::from(abort);
        let mut fields = Self::ids(request_id, epoch);
        fields.push(("decode_engine_id", opt_text(sender)));
        // Where the decode posted its receives (blocks, slot, token range).
        fields.push(("transfer", transfer.map_or(Field::Map(Vec::new()), Field::Payload)));
        fields.push(("abort", Field::Bool(abort)));
        vec![Outgoing::engine(&target, Kind::SendKv, fields)]
    }

    fn on_imported(
        &mut self,
        mut req: Request<P>,
        ok: bool,
        error: &str,
        quiet: bool,
    ) -> Vec<Outgoing<P>> {
        if !req.pinned {
            self.requests.insert(req.id, req);
            bump(&mut self.counters.ignored, Kind::KvImported.name());
            return Vec::new();
        }
        if !ok {
            // `quiet`: the decode's reads of the pinned blocks are over (none posted, or all
            // terminal); without it they may still run and the pin waits for its lease.
            return self.fail(req, &format!("KV import failed: {error}"), quiet);
        }
        let out = vec![Self::release(&mut req)];
        self.requests.insert(req.id, req);
        out
    }

    fn on_done(&mut self, mut req: Request<P>, fields: P) -> Vec<Outgoing<P>> {
        let mut out = Vec::new();
        if req.pinned {
            out.push(Self::release(&mut req));
        }
        let done = Field::Amended(fields, Vec::new());
        out.push(Outgoing {
            to_engine: None,
            to_client: Some(req.client),
            kind: Kind::Done,
            fields: done,
        });
        self.counters.completed += 1;
        out
    }

    fn release(req: &mut Request<P>) -> Outgoing<P> {
        req.pinned = false;
        let to = req.prefill.as_deref().unwrap_or_default();
        Outgoing::engine(to, Kind::ReleaseKv, Self::ids(req.id, req.epoch))
    }

    /// End a request (taken out of the live ones) with one `FAILED` and abort it on its
    /// engines. Prefill pins are released only if no decode may read them (`decode_quiet`, or
    /// the ticket was never sent); otherwise they are left to the prefill's lease.
    fn fail(&mut self, mut req: Request<P>, error: &str, decode_quiet: bool) -> Vec<Outgoing<P>> {
        let mut out = vec![Self::failed_to(&req.client, req.id, error)];
        let mut engines = vec![req.prefill.as_deref(), req.decode.as_deref()];
        engines.dedup();
        for engine in engines.into_iter().flatten().filter(|e| self.engines.contains_key(*e)) {
            out.push(Outgoing::engine(engine, Kind::Abort, Self::ids(req.id, req.epoch)));
        }
        let prefill_here = req.prefill.as_ref().is_some_and(|p| self.engines.contains_key(p));
        if req.pinned && prefill_here {
            if decode_quiet || !req.ticket_sent {
                out.push(Self::release(&mut req));
            } else {
                self.counters.left_to_lease += 1;
            }
        }
        self.counters.failed += 1;
        out
    }

    /// Fail every request that loses state it still needs with `engine_id`. Pins held by that
    /// prefill died with it: no `RELEASE_KV` goes to it (a lost one is no longer an engine; a
    /// restarted one never had them).
    fn fail_dependents(&mut self, engine_id: &str, error: &str) -> Vec<Outgoing<P>> {
        let ids: Vec<u64> =
            self.requests.values().filter(|r| r.lost_with(engine_id)).map(|r| r.id).collect();
        let mut out = Vec::new();
        for mut req in ids.iter().filter_map(|rid| self.requests.remove(rid)).collect::<Vec<_>>() {
            req.pinned = req.pinned && req.prefill.as_deref() != Some(engine_id);
            out.extend(self.fail(req, error, false));
        }
        out
    }

    /// Declare `engine_id` lost (`why`: silent, or not reading its messages): the requests
    /// that depend on it fail, the others learn the new peer table, and its later messages are
    /// ignored until it registers again (its next `HEARTBEAT` gets `FENCED`).
    pub fn fence(&mut self, engine_id: &str, why: &str) -> Vec<Outgoing<P>> {
        let Some(gone) = self.engines.remove(engine_id) else {
            return Vec::new();
        };
        let error =
            format!("{why} (incarnation {}) while holding this request's state", gone.incarnation);
        let mut out = self.fail_dependents(engine_id, &error);
        out.extend(self.peers_to_all(None));
        out
    }

    /// Tell every registered engine to stop. From then on their silence is expected: the
    /// liveness timeout declares none of them lost.
    pub fn shutdown(&mut self) -> Vec<Outgoing<P>> {
        self.shutting_down = true;
        self.engines.keys().map(|id| Outgoing::engine(id, Kind::Shutdown, Vec::new())).collect()
    }

    /// Declare engines silent for longer than `engine_timeout_s` lost, then fail every request
    /// whose deadline has passed at `now`.
    pub fn poll(&mut self, now: f64) -> Vec<Outgoing<P>> {
        let mut out = Vec::new();
        if let Some(timeout) = self.engine_timeout_s.filter(|_| !self.shutting_down) {
            let silent: Vec<String> = self
                .engines
                .values()
                .filter(|e| now - e.last_seen > timeout)
                .map(|e| e.engine_id.clone())
                .collect();
            for id in silent {
                bump(&mut self.counters.lost, &id);
                let why = format!("engine {id} silent for more than {timeout:?} s");
                out.extend(self.fence(&id, &why));
            }
        }
        let late: Vec<u64> =
            self.requests.values().filter(|r| now >= r.deadline).map(|r| r.id).collect();
        for req in late.iter().filter_map(|rid| self.requests.remove(rid)).collect::<Vec<_>>() {
            let why = format!("request {} passed its deadline", req.id);
            out.extend(self.fail(req, &why, false));
        }
        out
    }
}

/// A test hook of a coordinator's sends: drops, duplicates or delays (reordering later traffic)
/// a share `rate` of the messages to engines (never to clients, never `SHUTDOWN`). The same
/// seed gives the same faults for the same traffic.
#[derive(Debug, Clone)]
pub struct FaultPlan<T> {
    rate: f64,
    state: u64,
    max_delay: u64,
    delayed: Vec<(u64, T)>,
    injected: u64,
}

impl<T: Clone> FaultPlan<T> {
    /// Faults on a share `rate` of the eligible messages; a delayed one waits 1 to
    /// `max_delay` rounds.
    pub fn new(rate: f64, seed: u64, max_delay: u64) -> Self {
        Self { rate, state: seed, max_delay: max_delay.max(1), delayed: Vec::new(), injected: 0 }
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected
    }

    /// `splitmix64`.
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// One round: the delayed messages whose time came, then `out` with faults. Each message
    /// comes with whether it goes to an engine and its type.
    pub fn pass(&mut self, out: Vec<(T, bool, Option<Kind>)>) -> Vec<T> {
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.delayed).into_iter().partition(|(n, _)| *n == 0);
        self.delayed = waiting.into_iter().map(|(n, o)| (n - 1, o)).collect();
        let mut kept: Vec<T> = ready.into_iter().map(|(_, o)| o).collect();
        for (o, to_engine, kind) in out {
            #[allow(clippy::cast_precision_loss)] // 53 random bits as a fraction of 2^53
            let hit = to_engine
                && kind != Some(Kind::Shutdown)
                && ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < self.rate;
            if !hit {
                kept.push(o);
                continue;
            }
            self.injected += 1;
            match self.next() % 3 {
                0 => {} // dropped
                1 => kept.extend([o.clone(), o]),
                _ => {
                    let rounds = 1 + self.next() % self.max_delay;
                    self.delayed.push((rounds, o));
                }
            }
        }
        kept
    }
}

#[path = "coordinator_frame.rs"]
mod frame;
pub use frame::Receipt;

#[cfg(test)]
#[path = "coordinator_tests.rs"]
mod tests;
