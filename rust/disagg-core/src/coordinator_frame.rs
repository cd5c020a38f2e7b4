//! The coordinator fed control frames: decoded, checked, authenticated and applied in one
//! call, every payload kept as the msgpack [`Value`] it arrived as.

use std::collections::BTreeMap;

use super::{Coordinator, Event, Field, Outgoing};
use crate::error::{DisaggError, DisaggResult};
use crate::wire::control::{decode_message, ControlMessage, Kind, PROTOCOL_VERSION};
use crate::wire::msgpack::{self, Value};

/// What became of a frame given to [`Coordinator::receive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receipt {
    /// Decoded and applied (or counted malformed by type).
    Applied,
    /// Refused at decode (the caller counts it).
    Refused,
    /// Dropped: it does not come from the key its engine id is bound to.
    Unauthenticated,
}

impl Receipt {
    /// Its name: `applied`, `refused` or `unauthenticated`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Refused => "refused",
            Self::Unauthenticated => "unauthenticated",
        }
    }
}

fn unusable(kind: Kind, name: &str, detail: &str) -> DisaggError {
    DisaggError::wire(name, format!("{} field {name} {detail}", kind.name()))
}

/// Typed reads of a schema-checked message; `nil` reads as absent.
struct Fields<'a>(&'a ControlMessage);

impl Fields<'_> {
    fn opt(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !matches!(v, Value::Nil))
    }

    /// Field `name` read by `pick` (`None`: absent); a value `pick` refuses must be `what`.
    fn read<T>(
        &self,
        name: &str,
        what: &str,
        pick: fn(&Value) -> Option<T>,
    ) -> DisaggResult<Option<T>> {
        let refused = || unusable(self.0.kind, name, &format!("must be {what}"));
        self.opt(name).map(|v| pick(v).ok_or_else(refused)).transpose()
    }

    /// A required field, read as [`Fields::read`] does.
    fn need<T>(&self, name: &str, what: &str, pick: fn(&Value) -> Option<T>) -> DisaggResult<T> {
        self.read(name, what, pick)?.ok_or_else(|| unusable(self.0.kind, name, "is missing"))
    }

    fn any(&self, name: &str) -> DisaggResult<Value> {
        self.need(name, "a value", |v| Some(v.clone()))
    }

    fn opt_id(&self, name: &str) -> DisaggResult<Option<u64>> {
        self.read(name, "an id", |v| match v {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        })
    }

    fn id(&self, name: &str) -> DisaggResult<u64> {
        self.opt_id(name)?.ok_or_else(|| unusable(self.0.kind, name, "is missing"))
    }

    fn opt_text(&self, name: &str) -> DisaggResult<Option<String>> {
        self.read(name, "a string", |v| match v {
            Value::Str(s) => Some(s.clone()),
            _ => None,
        })
    }

    fn text(&self, name: &str) -> DisaggResult<String> {
        self.opt_text(name)?.ok_or_else(|| unusable(self.0.kind, name, "is missing"))
    }

    fn opt_flag(&self, name: &str) -> DisaggResult<Option<bool>> {
        self.read(name, "a bool", |v| match v {
            Value::Bool(b) => Some(*b),
            _ => None,
        })
    }

    fn opt_seconds(&self, name: &str) -> DisaggResult<Option<f64>> {
        #[allow(clippy::cast_precision_loss)] // checked <= MAX_TIMEOUT_S by the schema
        self.read(name, "a number of seconds", |v| match v {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        })
    }
}

/// The value of `name` in a msgpack map (the last of duplicate keys).
fn lookup<'a>(pairs: &'a [(Value, Value)], name: &str) -> Option<&'a Value> {
    pairs.iter().rev().find(|(k, _)| matches!(k, Value::Str(s) if s == name)).map(|p| &p.1)
}

/// A ticket's resume tokens as a list (empty without them) and their count.
fn resume_tokens(kind: Kind, ticket: &Value) -> DisaggResult<(Value, usize)> {
    let Value::Map(pairs) = ticket else {
        return Err(unusable(kind, "ticket", "must be a map"));
    };
    match lookup(pairs, "resume_tokens") {
        None | Some(Value::Nil) => Ok((Value::Array(Vec::new()), 0)),
        Some(Value::Array(tokens)) => Ok((Value::Array(tokens.clone()), tokens.len())),
        Some(Value::Ints(tokens)) => Ok((Value::Ints(tokens.clone()), tokens.len())),
        Some(_) => Err(unusable(kind, "ticket.resume_tokens", "must be a list")),
    }
}

impl Event<Value> {
    /// The event a schema-checked message carries; a message the coordinator does not take, or
    /// a field it cannot use (a ticket's `resume_tokens` that is no list), is a `Wire` error
    /// naming it.
    pub fn from_message(msg: &ControlMessage) -> DisaggResult<Self> {
        let f = Fields(msg);
        let request_id = || f.id("request_id");
        Ok(match msg.kind {
            Kind::Register => Self::Register {
                engine_id: f.text("engine_id")?,
                role: f.text("role")?,
                incarnation: f.id("incarnation")?,
                meta: f.any("meta")?,
            },
            Kind::Submit => Self::Submit {
                request_id: request_id()?,
                prompt: f.any("prompt")?,
                max_new_tokens: f.id("max_new_tokens")?,
                timeout_s: f.opt_seconds("timeout_s")?,
            },
            Kind::Heartbeat => Self::Heartbeat { engine_id: f.text("engine_id")? },
            Kind::KvRecvPosted => Self::KvRecvPosted {
                request_id: request_id()?,
                epoch: f.id("epoch")?,
                prefill: f.opt_text("prefill_engine_id")?,
                transfer: f.opt("transfer").cloned(),
            },
            Kind::PrefillDone => {
                let ticket = f.any("ticket")?;
                let resume = resume_tokens(msg.kind, &ticket)?;
                Self::PrefillDone {
                    request_id: request_id()?,
                    epoch: f.id("epoch")?,
                    ticket,
                    resume,
                }
            }
            Kind::PrefillFailed => Self::PrefillFailed {
                request_id: request_id()?,
                epoch: f.id("epoch")?,
                error: f.text("error")?,
            },
            Kind::KvImported => {
                let ok = f.opt_flag("ok")?.ok_or_else(|| unusable(msg.kind, "ok", "is missing"))?;
                let (error, quiet) = (f.opt_text("error")?, f.opt_flag("quiet")?);
                Self::kv_imported(request_id()?, f.id("epoch")?, ok, error, quiet)
            }
            Kind::Tokens => Self::Tokens {
                request_id: request_id()?,
                epoch: f.opt_id("epoch")?,
                tokens: f.any("tokens")?,
            },
            Kind::Done => Self::Done {
                request_id: request_id()?,
                epoch: f.opt_id("epoch")?,
                fields: done_fields(msg),
            },
            Kind::Failed => {
                let (error, quiet) = (f.text("error")?, f.opt_flag("quiet")?);
                Self::failed(request_id()?, f.opt_id("epoch")?, error, quiet)
            }
            other => {
                let detail = format!("the coordinator takes no {} message", other.name());
                return Err(DisaggError::wire("type", detail));
            }
        })
    }
}

/// What a client is told of a `DONE`: the message without the fields in
/// [`super::DONE_WITHHELD`].
fn done_fields(msg: &ControlMessage) -> Value {
    let kept = msg.fields.iter().filter(|(k, _)| !super::DONE_WITHHELD.contains(&k.as_str()));
    Value::Map(kept.map(|(k, v)| (Value::Str(k.clone()), v.clone())).collect())
}

/// An id as msgpack carries it.
fn int(i: u64) -> Value {
    i64::try_from(i).map_or(Value::UInt(i), Value::Int)
}

fn set(pairs: &mut Vec<(Value, Value)>, key: String, value: Value) {
    let key = Value::Str(key);
    match pairs.iter_mut().find(|(k, _)| *k == key) {
        Some(slot) => slot.1 = value,
        None => pairs.push((key, value)),
    }
}

impl Field<Value> {
    /// This field as one msgpack value: a [`Field::Amended`] payload map with its entries set
    /// (a payload that is no map is replaced by the entries).
    pub fn into_value(self) -> Value {
        let entries = |base: Vec<(Value, Value)>, pairs: Vec<(String, Self)>| {
            let mut out = base;
            for (k, v) in pairs {
                set(&mut out, k, v.into_value());
            }
            Value::Map(out)
        };
        match self {
            Self::Nil => Value::Nil,
            Self::Int(i) => int(i),
            Self::Text(s) => Value::Str(s),
            Self::Bool(b) => Value::Bool(b),
            Self::Payload(v) => v,
            Self::Amended(Value::Map(base), pairs) => entries(base, pairs),
            Self::Map(pairs) | Self::Amended(_, pairs) => entries(Vec::new(), pairs),
        }
    }
}

impl Outgoing<Value> {
    /// `(to_engine, to_client, type name, frame)`: where the message goes, and its frame.
    pub fn into_wire(mut self) -> (Option<String>, Option<Vec<u8>>, &'static str, Vec<u8>) {
        let (engine, client, kind) = (self.to_engine.take(), self.to_client.take(), self.kind);
        (engine, client, kind.name(), self.frame())
    }

    /// The message as the frame that goes on the wire: `type` and `v` first, then its fields
    /// (the msgpack of `{"type": ..., "v": ..., **fields}`, as a peer's encoder writes it).
    pub fn frame(self) -> Vec<u8> {
        let text = |t: &str| Value::Str(t.to_owned());
        let mut pairs =
            vec![(text("type"), text(self.kind.name())), (text("v"), Value::Int(PROTOCOL_VERSION))];
        if let Value::Map(fields) = self.fields.into_value() {
            let header = |k: &Value| matches!(k, Value::Str(k) if k == "type" || k == "v");
            pairs.extend(fields.into_iter().filter(|(k, _)| !header(k)));
        }
        msgpack::encode(&Value::Map(pairs))
    }
}

/// A frame's `type` and `request_id`, where it is a msgpack map that has them.
pub(super) fn frame_head(data: &[u8]) -> (Option<Kind>, Option<i128>) {
    let Ok(Value::Map(pairs)) = msgpack::decode(data) else {
        return (None, None);
    };
    let kind = match lookup(&pairs, "type") {
        Some(Value::Str(s)) => Kind::from_name(s),
        _ => None,
    };
    let rid = match lookup(&pairs, "request_id") {
        Some(Value::Int(i)) => Some(i128::from(*i)),
        _ => None,
    };
    (kind, rid)
}

impl Coordinator<Value> {
    /// Apply a decoded message: one the coordinator does not take, or whose fields it cannot
    /// use, is counted malformed by type and changes nothing.
    fn apply(&mut self, identity: &[u8], msg: &ControlMessage, now: f64) -> Vec<Outgoing<Value>> {
        if let Ok(event) = Event::from_message(msg) {
            return self.handle(identity, event, now);
        }
        self.count_malformed(msg.kind.name());
        Vec::new()
    }

    /// Apply one frame from `identity` at `now`, as it came off the socket. A frame refused at
    /// decode gets [`Coordinator::refused_frame`]'s answer ([`Receipt::Refused`], counted by
    /// the caller); with `auth` (the sender's CURVE key and the keys bound to engine ids) one
    /// that is not [`Coordinator::authentic`] is dropped; a message the coordinator does not
    /// take, or whose fields it cannot use, is counted malformed by type.
    pub fn receive(
        &mut self,
        identity: &[u8],
        data: &[u8],
        now: f64,
        auth: Option<(&str, &BTreeMap<String, String>)>,
    ) -> (Receipt, Vec<Outgoing<Value>>) {
        let msg = match decode_message(data, false) {
            Ok(msg) => msg,
            Err(e) => {
                return (Receipt::Refused, self.refused_frame(identity, data, &e.to_string()))
            }
        };
        if let Some((user_key, keys)) = auth {
            let claimed = match msg.get("engine_id") {
                Some(Value::Str(id)) => Some(id.as_str()),
                _ => None,
            };
            if !self.authentic(identity, msg.kind, claimed, user_key, keys) {
                return (Receipt::Unauthenticated, Vec::new());
            }
        }
        (Receipt::Applied, self.apply(identity, &msg, now))
    }

    /// Apply one frame from `identity` at `now` that stands for a message handed over
    /// directly: one its schema refuses is counted malformed by type (`<unknown>` without a
    /// usable type), and a `SUBMIT` among them with a usable id is answered `FAILED`.
    pub fn handle_frame(&mut self, identity: &[u8], data: &[u8], now: f64) -> Vec<Outgoing<Value>> {
        match decode_message(data, true) {
            Ok(msg) => self.apply(identity, &msg, now),
            Err(e) => {
                let (kind, rid) = frame_head(data);
                self.count_malformed(kind.map_or("<unknown>", Kind::name));
                self.refused(identity, kind, rid, &e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::control::tests::msg;

    fn ints(xs: &[i64]) -> Value {
        Value::Array(xs.iter().map(|x| Value::Int(*x)).collect())
    }

    fn s(x: &str) -> Value {
        Value::Str(x.into())
    }

    fn get<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
        match v {
            Value::Map(pairs) => lookup(pairs, name),
            _ => None,
        }
    }

    fn register(c: &mut Coordinator<Value>, id: &str, role: &str) -> Vec<Outgoing<Value>> {
        let fields = [
            ("engine_id", s(id)),
            ("role", s(role)),
            ("incarnation", Value::Int(1)),
            ("meta", Value::Map(vec![(s("k"), s(id))])),
        ];
        c.handle_frame(id.as_bytes(), &msg("REGISTER", &fields), 0.0)
    }

    fn served() -> Coordinator<Value> {
        let mut c = Coordinator::new(10.0, false, None).unwrap();
        register(&mut c, "p0", "prefill");
        register(&mut c, "d0", "decode");
        c
    }

    fn submit(c: &mut Coordinator<Value>, extra: &[(&str, Value)]) -> Vec<Outgoing<Value>> {
        let mut fields = vec![
            ("request_id", Value::Int(7)),
            ("prompt", ints(&[1, 2])),
            ("max_new_tokens", Value::Int(3)),
        ];
        fields.extend_from_slice(extra);
        c.handle_frame(b"client", &msg("SUBMIT", &fields), 1.0)
    }

    #[test]
    fn an_outgoing_frame_is_its_type_version_and_fields_and_decodes_as_a_message() {
        let mut c = served();
        let out = submit(&mut c, &[]);
        let fields = out[0].fields.clone().into_value();
        let (engine, client, kind, frame) = out[0].clone().into_wire();
        assert_eq!((engine.as_deref(), client, kind), (Some("p0"), None, "PREFILL"));
        let Value::Map(pairs) = msgpack::decode(&frame).unwrap() else { panic!("no map") };
        assert_eq!(pairs[0], (s("type"), s("PREFILL")));
        assert_eq!(pairs[1], (s("v"), Value::Int(PROTOCOL_VERSION)));
        assert_eq!(Value::Map(pairs[2..].to_vec()), fields);
        assert_eq!(decode_message(&frame, false).unwrap().kind, Kind::Prefill);
        // A payload's own `type` or `v` never overrides the header.
        let forged = Outgoing {
            to_engine: None,
            to_client: Some(b"c".to_vec()),
            kind: Kind::Done,
            fields: Field::Amended(Value::Map(vec![(s("v"), Value::Int(99))]), vec![]),
        };
        let Value::Map(pairs) = msgpack::decode(&forged.frame()).unwrap() else { panic!() };
        assert_eq!(pairs, vec![(s("type"), s("DONE")), (s("v"), Value::Int(PROTOCOL_VERSION))]);
    }

    #[test]
    fn a_request_flows_with_its_payloads_as_they_came() {
        let mut c = served();
        let out = submit(&mut c, &[]);
        assert_eq!(out[0].to_engine.as_deref(), Some("p0"));
        let prefill = out[0].fields.clone().into_value();
        assert_eq!(get(&prefill, "prompt"), Some(&ints(&[1, 2])));
        assert_eq!(get(&prefill, "decode_engine_id"), Some(&s("d0")));
        let epoch = get(&prefill, "epoch").cloned().unwrap();
        let ticket = Value::Map(vec![
            (s("resume_tokens"), ints(&[9])),
            (s("prefill_engine_id"), s("forged")),
            (s("x"), Value::Int(1)),
        ]);
        let done = [("request_id", Value::Int(7)), ("epoch", epoch.clone()), ("ticket", ticket)];
        let out = c.handle_frame(b"p0", &msg("PREFILL_DONE", &done), 2.0);
        assert_eq!(
            (out[0].kind, out[0].to_client.as_deref()),
            (Kind::Tokens, Some(&b"client"[..]))
        );
        assert_eq!(get(&out[0].fields.clone().into_value(), "tokens"), Some(&ints(&[9])));
        let forwarded = out[1].fields.clone().into_value();
        let ticket = get(&forwarded, "ticket").unwrap();
        assert_eq!(get(ticket, "prefill_engine_id"), Some(&s("p0")));
        assert_eq!(get(ticket, "x"), Some(&Value::Int(1)));
        let fin = [("request_id", Value::Int(7)), ("epoch", epoch), ("tokens", ints(&[5]))];
        let out = c.handle_frame(b"d0", &msg("DONE", &fin), 3.0);
        let told = out.last().unwrap().fields.clone().into_value();
        let Value::Map(pairs) = &told else { panic!("{told:?}") };
        let names: Vec<&Value> = pairs.iter().map(|(k, _)| k).collect();
        assert_eq!(names, [&s("request_id"), &s("tokens")]);
        assert_eq!(c.counters().completed, 1);
    }

    #[test]
    fn a_field_the_coordinator_cannot_use_is_counted_malformed_and_changes_nothing() {
        let mut c = served();
        let out = submit(&mut c, &[]);
        let epoch = get(&out[0].fields.clone().into_value(), "epoch").cloned().unwrap();
        let ticket = Value::Map(vec![(s("resume_tokens"), s("abc"))]);
        let done = [("request_id", Value::Int(7)), ("epoch", epoch), ("ticket", ticket)];
        let frame = msg("PREFILL_DONE", &done);
        let Err(DisaggError::Wire { field, .. }) =
            Event::from_message(&decode_message(&frame, true).unwrap())
        else {
            panic!("resume_tokens that is no list was taken");
        };
        assert_eq!(field, "ticket.resume_tokens");
        assert!(c.handle_frame(b"p0", &frame, 2.0).is_empty());
        assert_eq!(c.counters().malformed.get("PREFILL_DONE"), Some(&1));
        assert!(!c.requests()[&7].state().4, "the request was not marked pinned");
    }

    #[test]
    fn a_refused_submit_with_a_usable_id_is_answered_failed_and_counted_by_type() {
        let mut c = served();
        let out = submit(&mut c, &[("prompt", ints(&[]))]);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (out[0].kind, out[0].to_client.as_deref()),
            (Kind::Failed, Some(&b"client"[..]))
        );
        let error = get(&out[0].fields.clone().into_value(), "error").cloned();
        assert!(matches!(error, Some(Value::Str(e)) if e.contains("prompt")));
        assert_eq!(c.counters().malformed.get("SUBMIT"), Some(&1));
        assert!(c.handle_frame(b"x", b"\xc1", 1.0).is_empty());
        assert_eq!(c.counters().malformed.get("<unknown>"), Some(&1));
        assert!(c.requests().is_empty());
    }

    #[test]
    fn receive_refuses_at_decode_drops_the_unauthentic_and_counts_engine_bound_types() {
        let mut c = served();
        let (receipt, out) = c.receive(b"client", b"\x90", 1.0, None);
        assert_eq!((receipt, out.len()), (Receipt::Refused, 0));
        assert!(c.counters().malformed.is_empty(), "refused at decode: the caller counts it");
        let (receipt, out) = c.receive(b"p0", &msg("SHUTDOWN", &[]), 1.0, None);
        assert_eq!((receipt, out.len()), (Receipt::Applied, 0));
        assert_eq!(c.counters().malformed.get("SHUTDOWN"), Some(&1));
        let keys: BTreeMap<String, String> = [("p0".to_owned(), "kp".to_owned())].into();
        let beat = msg("HEARTBEAT", &[("engine_id", s("p0")), ("incarnation", Value::Int(1))]);
        let (receipt, out) = c.receive(b"p0", &beat, 1.0, Some(("other", &keys)));
        assert_eq!((receipt, out.len()), (Receipt::Unauthenticated, 0));
        let (receipt, out) = c.receive(b"p0", &beat, 1.0, Some(("kp", &keys)));
        assert_eq!((receipt, out[0].kind), (Receipt::Applied, Kind::HeartbeatAck));
        assert_eq!(Receipt::Unauthenticated.name(), "unauthenticated");
    }

    #[test]
    fn an_amended_payload_keeps_its_entries_and_sets_the_new_ones() {
        let base = Value::Map(vec![(s("a"), Value::Int(1)), (s("b"), Value::Int(2))]);
        let amended = Field::Amended(base, vec![("b".into(), Field::Int(u64::MAX))]);
        let want = Value::Map(vec![(s("a"), Value::Int(1)), (s("b"), Value::UInt(u64::MAX))]);
        assert_eq!(amended.into_value(), want);
        let on_no_map = Field::Amended(Value::Nil, vec![("c".into(), Field::Nil)]);
        assert_eq!(on_no_map.into_value(), Value::Map(vec![(s("c"), Value::Nil)]));
    }
}
