//! Control-plane messages: one schema per message type, checked once at decode.
//!
//! A frame is a msgpack map with `type` (the message type), `v` (the protocol version) and the
//! fields of that type. Each schema lists, per field, its type, range, size cap and whether it
//! is required; fields a schema does not name pass through unchecked (a newer peer may add
//! some). Nested payloads (`meta`, `ticket`, `peers`, `transfer`) are only required to be maps
//! here: their own parsers type them.

use crate::args::Int;
use crate::error::{DisaggError, DisaggResult};
use crate::wire::msgpack::{self, Value};
use crate::wire::value::clipped;

/// Version of the control protocol (2 added `HEARTBEAT` and `FENCED`, 3 `HEARTBEAT_ACK`).
pub const PROTOCOL_VERSION: i64 = 3;
/// Longest prompt a SUBMIT may carry.
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;
/// Largest `max_new_tokens` a SUBMIT may ask for.
pub const MAX_NEW_TOKENS: i64 = 1 << 20;
/// Largest request id, epoch or incarnation (they travel as signed 64-bit ints).
pub const MAX_ID: i64 = i64::MAX;
/// Longest engine id or error text, in bytes.
pub const MAX_TEXT: usize = 4096;
/// Largest control frame accepted.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// Largest request timeout in seconds (one day).
pub const MAX_TIMEOUT_S: f64 = 86_400.0;

/// What one field must be.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldType {
    /// An int in `0..=MAX_ID` (request id, epoch, incarnation).
    Id,
    /// An int in `lo..=hi`.
    IntIn(i64, i64),
    /// A string of at most [`MAX_TEXT`] bytes.
    Text,
    /// A [`FieldType::Text`] or nil.
    TextOrNil,
    /// `"prefill"` or `"decode"`.
    Role,
    /// A bool.
    Bool,
    /// A map (typed by its own parser).
    Map,
    /// Anything.
    Any,
    /// A list of ids (tokens) with a length in `min..=max`.
    IdList(usize, usize),
    /// Seconds: a finite number in `(0, MAX_TIMEOUT_S]` (NaN and inf refused).
    Timeout,
}

/// One field of a schema.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    /// The field's name.
    pub name: &'static str,
    /// Its type.
    pub ty: FieldType,
    /// Whether a message without it is refused.
    pub required: bool,
}

const fn req(name: &'static str, ty: FieldType) -> Field {
    Field { name, ty, required: true }
}

const fn opt(name: &'static str, ty: FieldType) -> Field {
    Field { name, ty, required: false }
}

/// Control-plane message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Kind {
    Register,
    Registered,
    Peers,
    Submit,
    Prefill,
    PrefillDone,
    PrefillFailed,
    SubmitRequestWithKv,
    KvRecvPosted,
    SendKv,
    KvImported,
    ReleaseKv,
    Tokens,
    Done,
    Failed,
    Abort,
    Shutdown,
    Heartbeat,
    Fenced,
    HeartbeatAck,
}

const RID: Field = req("request_id", FieldType::Id);
const EPOCH: Field = req("epoch", FieldType::Id);
const PROMPT_MAX_NEW: [Field; 2] = [
    req("prompt", FieldType::IdList(0, MAX_PROMPT_TOKENS)),
    req("max_new_tokens", FieldType::IntIn(1, MAX_NEW_TOKENS)),
];
const TOKEN_CAP: usize = MAX_NEW_TOKENS as usize;

impl Kind {
    /// Every type, in wire-name order of the protocol description.
    pub const ALL: [Kind; 20] = [
        Kind::Register,
        Kind::Registered,
        Kind::Peers,
        Kind::Submit,
        Kind::Prefill,
        Kind::PrefillDone,
        Kind::PrefillFailed,
        Kind::SubmitRequestWithKv,
        Kind::KvRecvPosted,
        Kind::SendKv,
        Kind::KvImported,
        Kind::ReleaseKv,
        Kind::Tokens,
        Kind::Done,
        Kind::Failed,
        Kind::Abort,
        Kind::Shutdown,
        Kind::Heartbeat,
        Kind::Fenced,
        Kind::HeartbeatAck,
    ];

    /// The name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Register => "REGISTER",
            Kind::Registered => "REGISTERED",
            Kind::Peers => "PEERS",
            Kind::Submit => "SUBMIT",
            Kind::Prefill => "PREFILL",
            Kind::PrefillDone => "PREFILL_DONE",
            Kind::PrefillFailed => "PREFILL_FAILED",
            Kind::SubmitRequestWithKv => "SUBMIT_REQUEST_WITH_KV",
            Kind::KvRecvPosted => "KV_RECV_POSTED",
            Kind::SendKv => "SEND_KV",
            Kind::KvImported => "KV_IMPORTED",
            Kind::ReleaseKv => "RELEASE_KV",
            Kind::Tokens => "TOKENS",
            Kind::Done => "DONE",
            Kind::Failed => "FAILED",
            Kind::Abort => "ABORT",
            Kind::Shutdown => "SHUTDOWN",
            Kind::Heartbeat => "HEARTBEAT",
            Kind::Fenced => "FENCED",
            Kind::HeartbeatAck => "HEARTBEAT_ACK",
        }
    }

    /// The type named `name` on the wire.
    pub fn from_name(name: &str) -> Option<Kind> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether the coordinator accepts this type (the others flow from it to engines/clients).
    pub fn to_coordinator(self) -> bool {
        matches!(
            self,
            Kind::Register
                | Kind::Submit
                | Kind::PrefillDone
                | Kind::PrefillFailed
                | Kind::KvRecvPosted
                | Kind::KvImported
                | Kind::Tokens
                | Kind::Done
                | Kind::Failed
                | Kind::Heartbeat
        )
    }

    /// The schema of this type.
    pub fn schema(self) -> Vec<Field> {
        use FieldType as T;
        match self {
            Kind::Register => vec![
                req("engine_id", T::Text),
                req("role", T::Role),
                req("incarnation", T::Id),
                req("meta", T::Any),
            ],
            Kind::Registered => {
                vec![req("engine_id", T::Text), req("incarnation", T::Id), req("peers", T::Map)]
            }
            Kind::Peers => vec![req("peers", T::Map)],
            Kind::Submit => vec![
                RID,
                req("prompt", T::IdList(1, MAX_PROMPT_TOKENS)),
                PROMPT_MAX_NEW[1],
                opt("timeout_s", T::Timeout),
            ],
            Kind::Prefill => {
                vec![
                    RID,
                    EPOCH,
                    PROMPT_MAX_NEW[0],
                    PROMPT_MAX_NEW[1],
                    opt("decode_engine_id", T::TextOrNil),
                ]
            }
            Kind::PrefillDone => vec![RID, EPOCH, req("ticket", T::Map)],
            Kind::PrefillFailed => vec![RID, EPOCH, req("error", T::Text)],
            Kind::SubmitRequestWithKv => {
                vec![RID, EPOCH, PROMPT_MAX_NEW[0], PROMPT_MAX_NEW[1], req("ticket", T::Map)]
            }
            Kind::KvRecvPosted => {
                vec![RID, EPOCH, opt("transfer", T::Map), opt("prefill_engine_id", T::TextOrNil)]
            }
            Kind::SendKv => vec![
                RID,
                EPOCH,
                req("decode_engine_id", T::TextOrNil),
                opt("transfer", T::Map),
                opt("abort", T::Bool),
            ],
            Kind::KvImported => {
                vec![RID, EPOCH, req("ok", T::Bool), opt("error", T::Text), opt("quiet", T::Bool)]
            }
            Kind::ReleaseKv | Kind::Abort => vec![RID, EPOCH],
            Kind::Tokens => {
                vec![RID, opt("epoch", T::Id), req("tokens", T::IdList(0, TOKEN_CAP))]
            }
            Kind::Done => {
                vec![RID, opt("epoch", T::Id), req("tokens", T::IdList(0, TOKEN_CAP + 1))]
            }
            Kind::Failed => {
                vec![RID, opt("epoch", T::Id), req("error", T::Text), opt("quiet", T::Bool)]
            }
            Kind::Shutdown => vec![],
            Kind::Heartbeat | Kind::HeartbeatAck => {
                vec![req("engine_id", T::Text), req("incarnation", T::Id)]
            }
            Kind::Fenced => vec![req("engine_id", T::Text)],
        }
    }
}

/// A decoded, schema-checked control message.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlMessage {
    /// Its type.
    pub kind: Kind,
    /// Every field of the frame except `type` (`v` included), in frame order, the last of
    /// duplicate keys kept.
    pub fields: Vec<(String, Value)>,
}

impl ControlMessage {
    /// The value of field `name`, if present.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }
}

fn short(v: &Value) -> String {
    clipped(format!("{v:?}"), 80)
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

/// Check `value` against `ty`; `Err(detail)` says what it had to be.
fn check(ty: FieldType, value: &Value) -> Result<(), String> {
    let ok = match ty {
        FieldType::Id => int(value).is_some_and(|i| (0..=MAX_ID).contains(&i)),
        FieldType::IntIn(lo, hi) => int(value).is_some_and(|i| (lo..=hi).contains(&i)),
        FieldType::Text => matches!(value, Value::Str(s) if s.len() <= MAX_TEXT),
        FieldType::TextOrNil => {
            matches!(value, Value::Nil) || matches!(value, Value::Str(s) if s.len() <= MAX_TEXT)
        }
        FieldType::Role => matches!(value, Value::Str(s) if s == "prefill" || s == "decode"),
        FieldType::Bool => matches!(value, Value::Bool(_)),
        FieldType::Map => matches!(value, Value::Map(_)),
        FieldType::Any => true,
        FieldType::IdList(lo, hi) => match value {
            Value::Ints(items) => (lo..=hi).contains(&items.len()) && items.iter().all(|i| *i >= 0),
            Value::Array(items) => {
                (lo..=hi).contains(&items.len())
                    && items.iter().all(|t| int(t).is_some_and(|i| i >= 0))
            }
            _ => false,
        },
        FieldType::Timeout => {
            let t = match value {
                #[allow(clippy::cast_precision_loss)] // only compared with a bound of 86,400
                Value::Int(i) => Some(*i as f64),
                Value::Float(f) => Some(*f),
                _ => None,
            };
            t.is_some_and(|t| t > 0.0 && t <= MAX_TIMEOUT_S) // false for NaN
        }
    };
    if ok {
        return Ok(());
    }
    Err(match ty {
        FieldType::Id => format!("must be an int in [0, {MAX_ID}]"),
        FieldType::IntIn(lo, hi) => format!("must be an int in [{lo}, {hi}]"),
        FieldType::Text => format!("must be a string of at most {MAX_TEXT} bytes"),
        FieldType::TextOrNil => format!("must be nil or a string of at most {MAX_TEXT} bytes"),
        FieldType::Role => "must be \"prefill\" or \"decode\"".into(),
        FieldType::Bool => "must be a bool".into(),
        FieldType::Map => "must be a map".into(),
        FieldType::Any => String::new(),
        FieldType::IdList(lo, hi) => {
            format!("must be a list of {lo} to {hi} ints in [0, {MAX_ID}]")
        }
        FieldType::Timeout => format!("must be a finite number of seconds in (0, {MAX_TIMEOUT_S}]"),
    })
}

/// Decode one control frame and check it against its type's schema. With `to_coordinator`,
/// only the types the coordinator accepts pass. Errors are [`DisaggError::Wire`] naming the
/// field (`<frame>` for an undecodable frame, `v`, `type`, or the schema field).
pub fn decode_message(data: &[u8], to_coordinator: bool) -> DisaggResult<ControlMessage> {
    if data.len() > MAX_FRAME_BYTES {
        return Err(DisaggError::wire(
            "<frame>",
            format!("control frame of {} bytes > {MAX_FRAME_BYTES}", data.len()),
        ));
    }
    let Value::Map(pairs) = msgpack::decode(data)? else {
        return Err(DisaggError::wire("<frame>", "control message is not a map"));
    };
    let mut fields: Vec<(String, Value)> = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        let Value::Str(k) = k else {
            return Err(DisaggError::wire(
                "<frame>",
                format!("control message key {} is not a string", short(&k)),
            ));
        };
        if let Some(slot) = fields.iter_mut().find(|(name, _)| *name == k) {
            slot.1 = v;
        } else {
            fields.push((k, v));
        }
    }
    let take = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
    match take("v") {
        Some(Value::Int(PROTOCOL_VERSION)) => {}
        other => {
            return Err(DisaggError::wire(
                "v",
                format!(
                    "control protocol version {}, expected {PROTOCOL_VERSION}",
                    other.map_or("missing".into(), short)
                ),
            ));
        }
    }
    let kind = match take("type") {
        Some(Value::Str(name)) => Kind::from_name(name),
        _ => None,
    }
    .ok_or_else(|| {
        DisaggError::wire(
            "type",
            format!(
                "unknown control message type {}",
                take("type").map_or("missing".into(), short)
            ),
        )
    })?;
    if to_coordinator && !kind.to_coordinator() {
        return Err(DisaggError::wire(
            "type",
            format!("{} is not a message the coordinator accepts", kind.name()),
        ));
    }
    for f in kind.schema() {
        match take(f.name) {
            None if f.required => {
                return Err(DisaggError::wire(
                    f.name,
                    format!("{} message is missing {}", kind.name(), f.name),
                ));
            }
            None => {}
            Some(v) => check(f.ty, v).map_err(|detail| {
                DisaggError::wire(
                    f.name,
                    format!("{} field {}={} {detail}", kind.name(), f.name, short(v)),
                )
            })?,
        }
    }
    fields.retain(|(k, _)| k != "type");
    Ok(ControlMessage { kind, fields })
}

/// An engine's view of its coordinator: whether it is alive, and the requests the engine was
/// given and has not finished (what it must abort when the coordinator is lost).
///
/// Times are the caller's seconds on any monotonic origin (a virtual clock in tests). The
/// coordinator acknowledges every `HEARTBEAT`, so any message received is a sign of life; a
/// coordinator heard from less recently than the timeout is declared lost once, and heard
/// again it is back (the engine registers again: a new coordinator does not know it).
#[derive(Debug, Clone)]
pub struct LinkLiveness {
    timeout_s: Option<f64>,
    last_sent: f64,
    last_heard: f64,
    last_probe: f64,
    lost: bool,
    losses: u64,
    abandoned: u64,
    given: std::collections::BTreeMap<i64, i64>,
}

impl LinkLiveness {
    /// A link that last heard from its coordinator at `now`; `timeout_s` of `None` never
    /// declares it lost. A timeout that is not finite and positive is refused naming
    /// `coordinator_timeout_s`.
    pub fn new(timeout_s: Option<f64>, now: f64) -> DisaggResult<Self> {
        if let Some(t) = timeout_s {
            if !(t.is_finite() && t > 0.0) {
                return Err(DisaggError::Argument {
                    field: "coordinator_timeout_s".into(),
                    detail: format!("coordinator_timeout_s={t} must be finite and > 0"),
                });
            }
        }
        Ok(Self {
            timeout_s,
            last_sent: now,
            last_heard: now,
            last_probe: now,
            lost: false,
            losses: 0,
            abandoned: 0,
            given: std::collections::BTreeMap::default(),
        })
    }

    /// The engine sent (or, `delivered` false, dropped) a `kind` message about `request_id`
    /// at `now`: a final report ends the engine's part in that request either way.
    pub fn sent(&mut self, kind: Kind, request_id: Option<i64>, delivered: bool, now: f64) {
        if matches!(kind, Kind::PrefillFailed | Kind::Done | Kind::Failed) {
            if let Some(rid) = request_id {
                self.given.remove(&rid);
            }
        }
        if delivered {
            self.last_sent = now;
        }
    }

    /// [`LinkLiveness::sent`] of a message named `kind` with its ids as given: a name that is
    /// not a message of the protocol is ignored, an id that is not an int is no id.
    pub fn sent_named(&mut self, kind: &str, request_id: Option<&Int>, delivered: bool, now: f64) {
        if let Some(k) = Kind::from_name(kind) {
            self.sent(k, given_id(request_id), delivered, now);
        }
    }

    /// [`LinkLiveness::received`] of a message named `kind` with its ids as given: a name that
    /// is not a message of the protocol changes nothing (returns false).
    pub fn received_named(
        &mut self,
        kind: &str,
        request_id: Option<&Int>,
        epoch: Option<&Int>,
        now: f64,
    ) -> bool {
        Kind::from_name(kind)
            .is_some_and(|k| self.received(k, given_id(request_id), given_id(epoch), now))
    }

    /// A `kind` message arrived at `now`. Returns whether the coordinator was lost and is
    /// back (the engine then registers again).
    pub fn received(
        &mut self,
        kind: Kind,
        request_id: Option<i64>,
        epoch: Option<i64>,
        now: f64,
    ) -> bool {
        self.last_heard = self.last_heard.max(now);
        match (kind, request_id, epoch) {
            (Kind::Prefill | Kind::SubmitRequestWithKv, Some(rid), Some(epoch)) => {
                self.given.insert(rid, epoch);
            }
            (Kind::Abort | Kind::ReleaseKv, Some(rid), _) => {
                self.given.remove(&rid);
            }
            _ => {}
        }
        std::mem::replace(&mut self.lost, false)
    }

    /// Whether a `HEARTBEAT` is due at `now`: nothing sent, or nothing heard, for
    /// `interval_s`, and none sent within it. A due heartbeat is taken as sent now.
    pub fn heartbeat_due(&mut self, interval_s: f64, now: f64) -> bool {
        let idle = (now - self.last_sent).max(now - self.last_heard);
        if idle < interval_s || now - self.last_probe < interval_s {
            return false;
        }
        self.last_probe = now;
        true
    }

    /// At `now`: if the coordinator has just passed the timeout silent, declare it lost and
    /// return every `(request_id, epoch)` the engine still holds (to abort), in id order.
    pub fn check(&mut self, now: f64) -> Vec<(i64, i64)> {
        let Some(timeout) = self.timeout_s else { return Vec::new() };
        if self.lost || now - self.last_heard <= timeout {
            return Vec::new();
        }
        self.lost = true;
        self.losses += 1;
        let given: Vec<(i64, i64)> = std::mem::take(&mut self.given).into_iter().collect();
        self.abandoned += given.len() as u64;
        given
    }

    /// Whether the coordinator is declared lost now.
    pub fn lost(&self) -> bool {
        self.lost
    }

    /// How many times the coordinator was declared lost.
    pub fn losses(&self) -> u64 {
        self.losses
    }

    /// Requests handed back for abort because the coordinator was lost.
    pub fn abandoned(&self) -> u64 {
        self.abandoned
    }

    /// When the coordinator was last heard from.
    pub fn last_heard(&self) -> f64 {
        self.last_heard
    }
}

/// An id as given: an int that fits `i64`, else none.
fn given_id(v: Option<&Int>) -> Option<i64> {
    v.and_then(|x| x.0.clone().ok()).and_then(|i| i64::try_from(i).ok())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::args::Given;

    #[test]
    fn a_message_by_name_ignores_unknown_names_and_reads_ids_that_are_ints() {
        let mut l = LinkLiveness::new(Some(5.0), 0.0).unwrap();
        assert!(!l.received_named("NO_SUCH_MESSAGE", None, None, 9.0));
        assert!(l.last_heard() < 9.0);
        let (rid, epoch) = (Int::of(4), Int::of(1));
        assert!(!l.received_named(Kind::Prefill.name(), Some(&rid), Some(&epoch), 1.0));
        assert!((l.last_heard() - 1.0).abs() < f64::EPSILON);
        assert_eq!(given_id(Some(&Given(Err("a str ('4')".into())))), None);
        assert_eq!(given_id(Some(&Int::from(i128::from(i64::MAX) + 1))), None);
        assert_eq!(given_id(Some(&rid)), Some(4));
        l.sent_named("NO_SUCH_MESSAGE", Some(&rid), true, 2.0);
        l.sent_named(Kind::Done.name(), Some(&rid), true, 2.0);
    }

    /// The msgpack of a map of str keys to `pairs`' values.
    fn enc(pairs: &[(&str, Value)]) -> Vec<u8> {
        let map = pairs.iter().map(|(k, v)| (Value::Str((*k).into()), v.clone())).collect();
        msgpack::encode(&Value::Map(map))
    }

    fn s(x: &str) -> Value {
        Value::Str(x.into())
    }

    /// A current-version frame of type `kind` with `fields`.
    pub(crate) fn msg(kind: &str, fields: &[(&str, Value)]) -> Vec<u8> {
        let head = [("type", s(kind)), ("v", Value::Int(PROTOCOL_VERSION))];
        enc(&[&head[..], fields].concat())
    }

    fn submit(extra: &[(&str, Value)]) -> Vec<u8> {
        let mut pairs = vec![
            ("type", s("SUBMIT")),
            ("v", Value::Int(PROTOCOL_VERSION)),
            ("request_id", Value::Int(7)),
            ("prompt", Value::Array(vec![Value::Int(1), Value::Int(2)])),
            ("max_new_tokens", Value::Int(4)),
        ];
        for (k, v) in extra {
            pairs.retain(|(n, _)| n != k);
            pairs.push((k, v.clone()));
        }
        enc(&pairs)
    }

    fn field_of(r: DisaggResult<ControlMessage>) -> String {
        match r {
            Err(DisaggError::Wire { field, .. }) => field,
            other => panic!("expected a wire error, got {other:?}"),
        }
    }

    #[test]
    fn a_valid_submit_decodes_with_its_fields() {
        let m = decode_message(&submit(&[("timeout_s", Value::Float(2.5))]), true).unwrap();
        assert_eq!(m.kind, Kind::Submit);
        assert_eq!(m.get("request_id"), Some(&Value::Int(7)));
        assert_eq!(m.get("timeout_s"), Some(&Value::Float(2.5)));
        assert!(m.get("type").is_none());
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: Vec<(&str, Value)> = vec![
            ("request_id", Value::Int(-1)),
            ("request_id", Value::UInt(u64::MAX)),
            ("request_id", Value::Bool(true)),
            ("prompt", Value::Array(vec![])),
            ("prompt", Value::Array(vec![Value::Int(-3)])),
            ("prompt", Value::Array(vec![Value::Float(1.0)])),
            ("max_new_tokens", Value::Int(0)),
            ("max_new_tokens", Value::Int(MAX_NEW_TOKENS + 1)),
            ("timeout_s", Value::Float(f64::NAN)),
            ("timeout_s", Value::Float(f64::INFINITY)),
            ("timeout_s", Value::Float(0.0)),
            ("timeout_s", Value::Int(86_401)),
            ("timeout_s", s("5")),
            ("v", Value::Int(1)),
            ("type", s("NOPE")),
            ("type", Value::Int(3)),
        ];
        for (name, bad) in cases {
            assert_eq!(
                field_of(decode_message(&submit(&[(name, bad.clone())]), true)),
                name,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_missing_required_field_is_named_and_optional_ones_may_be_absent() {
        let ids = [("request_id", Value::Int(1)), ("epoch", Value::Int(1))];
        let frame = msg("KV_IMPORTED", &ids);
        assert_eq!(field_of(decode_message(&frame, true)), "ok");
        let frame =
            msg("KV_IMPORTED", &[ids[0].clone(), ids[1].clone(), ("ok", Value::Bool(true))]);
        assert!(decode_message(&frame, true).is_ok());
    }

    #[test]
    fn engine_bound_types_are_refused_only_on_the_coordinator_side() {
        let frame = msg("ABORT", &[("request_id", Value::Int(1)), ("epoch", Value::Int(3))]);
        assert!(decode_message(&frame, false).is_ok());
        assert_eq!(field_of(decode_message(&frame, true)), "type");
    }

    #[test]
    fn a_non_map_frame_and_non_string_keys_are_frame_errors() {
        assert_eq!(field_of(decode_message(&[0x01], false)), "<frame>");
        assert_eq!(field_of(decode_message(&[0x81, 0x01, 0x01], false)), "<frame>");
    }

    #[test]
    fn every_kind_round_trips_through_its_wire_name() {
        for k in Kind::ALL {
            assert_eq!(Kind::from_name(k.name()), Some(k));
        }
    }

    #[test]
    fn a_silent_coordinator_is_lost_once_and_the_held_requests_come_back_to_abort() {
        let mut l = LinkLiveness::new(Some(10.0), 0.0).unwrap();
        l.received(Kind::Prefill, Some(3), Some(7), 1.0);
        l.received(Kind::Prefill, Some(4), Some(8), 1.0);
        l.received(Kind::SubmitRequestWithKv, Some(5), Some(9), 1.0);
        l.sent(Kind::PrefillFailed, Some(4), false, 2.0); // ends 4 even when dropped
        l.received(Kind::Abort, Some(5), Some(9), 2.0);
        assert!(l.check(12.0).is_empty()); // 10 s since heard: not past
        assert_eq!(l.check(12.5), vec![(3, 7)]);
        assert!(l.lost() && l.losses() == 1 && l.abandoned() == 1);
        assert!(l.check(100.0).is_empty());
        assert!(l.received(Kind::HeartbeatAck, None, None, 101.0)); // back: register again
        assert!(!l.lost() && !l.received(Kind::Peers, None, None, 101.0));
        assert!(l.check(111.0).is_empty());
        assert!(l.check(111.5).is_empty() && l.lost()); // lost again, nothing held
        assert_eq!(l.losses(), 2);
    }

    #[test]
    fn heartbeats_are_due_when_idle_either_way_at_most_once_per_interval() {
        let mut l = LinkLiveness::new(None, 0.0).unwrap();
        assert!(!l.heartbeat_due(1.0, 0.5));
        assert!(l.heartbeat_due(1.0, 1.0));
        assert!(!l.heartbeat_due(1.0, 1.5)); // one per interval
        l.sent(Kind::Tokens, Some(1), true, 2.0); // busy sending, but nothing heard back
        assert!(l.heartbeat_due(1.0, 2.1));
        l.received(Kind::HeartbeatAck, None, None, 2.2);
        assert!(!l.heartbeat_due(1.0, 3.0)); // sent and heard within the interval
        assert!(l.check(1e9).is_empty()); // no timeout: never lost
    }

    #[test]
    fn a_timeout_that_is_not_finite_and_positive_is_refused() {
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            match LinkLiveness::new(Some(t), 0.0) {
                Err(DisaggError::Argument { field, .. }) => {
                    assert_eq!(field, "coordinator_timeout_s");
                }
                other => panic!("{t}: {other:?}"),
            }
        }
    }
}
