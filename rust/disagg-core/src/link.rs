//! The engines' and clients' ends of the control plane, sans-IO: what an engine's link makes
//! of the frames it received, and a client's deadlines.
//!
//! An engine's link decodes what arrived (an undecodable frame is dropped and counted), keeps
//! its view of the coordinator's liveness ([`LinkLiveness`]), takes the peer table a
//! `REGISTERED` or `PEERS` carries, answers `FENCED` by registering again (the engine was
//! declared lost while alive) as it does when a lost coordinator is heard again, and hands
//! the engine everything else but the acknowledgements. A client gives each request a
//! deadline and reports it failed when no answer came by then.

use std::collections::BTreeMap;

use crate::args::Int;
use crate::error::DisaggResult;
use crate::wire::control::{decode_message, ControlMessage, Kind, LinkLiveness};
use crate::wire::msgpack::Value;

/// What one batch of frames told an engine's link.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// The messages for the engine, in arrival order.
    pub messages: Vec<ControlMessage>,
    /// The newest peer table, when a `REGISTERED` or `PEERS` came.
    pub peers: Option<Value>,
    /// Register again now (fenced, or a lost coordinator heard again).
    pub register: bool,
}

/// Where an engine's registration stands ([`EngineInbox::registration`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registration {
    /// `REGISTERED` came (or no `REGISTER` was sent).
    Answered,
    /// Sent, unanswered, before its deadline.
    Awaited,
    /// Sent and unanswered at its deadline: the coordinator did not answer.
    Overdue,
}

/// An engine's link: the coordinator's liveness, registration and what was dropped.
#[derive(Debug, Clone)]
pub struct EngineInbox {
    /// The coordinator's liveness as this engine sees it.
    pub liveness: LinkLiveness,
    registered: bool,
    awaiting: bool,
    fenced: u64,
    malformed: u64,
}

fn id(m: &ControlMessage, name: &str) -> Option<i64> {
    match m.get(name) {
        Some(Value::Int(i)) => Some(*i),
        _ => None,
    }
}

impl EngineInbox {
    /// A link that last heard from its coordinator at `now` (see [`LinkLiveness::new`]).
    pub fn new(timeout_s: Option<f64>, now: f64) -> DisaggResult<Self> {
        let liveness = LinkLiveness::new(timeout_s, now)?;
        Ok(Self { liveness, registered: false, awaiting: false, fenced: 0, malformed: 0 })
    }

    /// The engine sent (`delivered`, else dropped) a `kind` message about `request_id` at
    /// `now`; a `REGISTER` makes the link registered and waiting for `REGISTERED`.
    pub fn sent(&mut self, kind: Kind, request_id: Option<i64>, delivered: bool, now: f64) {
        self.registering(Some(kind));
        self.liveness.sent(kind, request_id, delivered, now);
    }

    /// [`EngineInbox::sent`] of a message named `kind` with its id as given (see
    /// [`LinkLiveness::sent_named`]).
    pub fn sent_named(&mut self, kind: &str, request_id: Option<&Int>, delivered: bool, now: f64) {
        self.registering(Kind::from_name(kind));
        self.liveness.sent_named(kind, request_id, delivered, now);
    }

    fn registering(&mut self, kind: Option<Kind>) {
        if kind == Some(Kind::Register) {
            self.registered = true;
            self.awaiting = true;
        }
    }

    /// The frames that arrived by `now`, in order.
    pub fn receive<F: AsRef<[u8]>>(&mut self, frames: &[F], now: f64) -> Received {
        let mut got = Received { messages: Vec::new(), peers: None, register: false };
        for frame in frames {
            let Ok(m) = decode_message(frame.as_ref(), false) else {
                self.malformed += 1;
                continue;
            };
            let back = self.liveness.received(m.kind, id(&m, "request_id"), id(&m, "epoch"), now);
            got.register |= back && self.registered;
            if matches!(m.kind, Kind::Registered | Kind::Peers) {
                got.peers = m.get("peers").cloned();
            }
            match m.kind {
                Kind::Registered => self.awaiting = false,
                Kind::Fenced if self.registered => {
                    self.fenced += 1;
                    got.register = true;
                }
                Kind::HeartbeatAck => {}
                _ => got.messages.push(m),
            }
        }
        got
    }

    /// Whether a `REGISTER` was sent and its `REGISTERED` has not come yet.
    pub fn awaiting_registered(&self) -> bool {
        self.awaiting
    }

    /// Where registration stands at `now` for a `REGISTER` sent at `since` that must be
    /// answered within `timeout_s`.
    pub fn registration(&self, since: f64, timeout_s: f64, now: f64) -> Registration {
        match (self.awaiting, now >= since + timeout_s) {
            (false, _) => Registration::Answered,
            (true, false) => Registration::Awaited,
            (true, true) => Registration::Overdue,
        }
    }

    /// Times the coordinator fenced this engine (it then registered again).
    pub fn fenced(&self) -> u64 {
        self.fenced
    }

    /// Undecodable frames dropped.
    pub fn malformed(&self) -> u64 {
        self.malformed
    }
}

/// A client's request deadlines (seconds on the caller's clock).
#[derive(Debug, Clone)]
pub struct ClientDeadlines {
    default_s: f64,
    grace_s: f64,
    due: BTreeMap<i64, f64>,
}

impl ClientDeadlines {
    /// Requests get `timeout_s`, else `default_s`, plus `grace_s` (for the coordinator's own
    /// `FAILED` to arrive first).
    pub fn new(default_s: f64, grace_s: f64) -> Self {
        Self { default_s, grace_s, due: BTreeMap::new() }
    }

    /// `request_id` was submitted at `now` with `timeout_s` (`None`: the default).
    pub fn submit(&mut self, request_id: i64, timeout_s: Option<f64>, now: f64) {
        let budget = timeout_s.unwrap_or(self.default_s);
        self.due.insert(request_id, now + budget + self.grace_s);
    }

    /// A message named `kind` about `request_id` arrived: `DONE` and `FAILED` end its deadline
    /// (a name of no message type ends nothing).
    pub fn answered(&mut self, kind: &str, request_id: Option<i64>) {
        if let (Some(Kind::Done | Kind::Failed), Some(rid)) = (Kind::from_name(kind), request_id) {
            self.due.remove(&rid);
        }
    }

    /// The requests past their deadline at `now`, in id order (each reported once).
    pub fn expired(&mut self, now: f64) -> Vec<i64> {
        let late: Vec<i64> =
            self.due.iter().filter(|(_, end)| now >= **end).map(|(r, _)| *r).collect();
        for r in &late {
            self.due.remove(r);
        }
        late
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: &str, fields: &[(&str, Value)]) -> Vec<u8> {
        let mut pairs = vec![
            (Value::Str("type".into()), Value::Str(kind.into())),
            (Value::Str("v".into()), Value::Int(3)),
        ];
        pairs.extend(fields.iter().map(|(k, v)| (Value::Str((*k).into()), v.clone())));
        crate::wire::msgpack::encode(&Value::Map(pairs))
    }

    fn peers(n: i64) -> Value {
        Value::Map(vec![(Value::Str("p0".into()), Value::Int(n))])
    }

    fn ack() -> Vec<u8> {
        frame(
            "HEARTBEAT_ACK",
            &[("engine_id", Value::Str("p0".into())), ("incarnation", Value::Int(1))],
        )
    }

    fn kinds(r: &Received) -> Vec<Kind> {
        r.messages.iter().map(|m| m.kind).collect()
    }

    #[test]
    fn acks_and_registration_replies_are_consumed_and_the_newest_peer_table_is_taken() {
        let mut l = EngineInbox::new(Some(10.0), 0.0).unwrap_or_else(|e| panic!("{e}"));
        l.sent(Kind::Register, None, true, 0.0);
        assert!(l.awaiting_registered());
        let prefill = frame(
            "PREFILL",
            &[
                ("request_id", Value::Int(5)),
                ("epoch", Value::Int(1)),
                ("prompt", Value::Array(vec![Value::Int(1)])),
                ("max_new_tokens", Value::Int(2)),
                ("decode_engine_id", Value::Str("d0".into())),
            ],
        );
        let registered = frame(
            "REGISTERED",
            &[
                ("engine_id", Value::Str("p0".into())),
                ("incarnation", Value::Int(1)),
                ("peers", peers(1)),
            ],
        );
        let ack = ack();
        let update = frame("PEERS", &[("peers", peers(2))]);
        let got = l.receive(&[registered, prefill, ack, b"junk".to_vec(), update], 1.0);
        assert_eq!(kinds(&got), vec![Kind::Prefill, Kind::Peers]);
        assert_eq!(got.peers, Some(peers(2)));
        assert!(!got.register && !l.awaiting_registered());
        assert_eq!(l.malformed(), 1);
    }

    #[test]
    fn a_fenced_or_lost_and_found_engine_registers_again_only_once_registered() {
        let fenced = frame("FENCED", &[("engine_id", Value::Str("p0".into()))]);
        let mut l = EngineInbox::new(Some(1.0), 0.0).unwrap_or_else(|e| panic!("{e}"));
        let got = l.receive(std::slice::from_ref(&fenced), 0.5);
        assert!(!got.register && kinds(&got) == vec![Kind::Fenced] && l.fenced() == 0);
        l.sent(Kind::Register, None, true, 0.5);
        let got = l.receive(&[fenced], 0.6);
        assert!(got.register && got.messages.is_empty() && l.fenced() == 1);
        assert!(l.liveness.check(5.0).is_empty() && l.liveness.lost());
        let got = l.receive(&[ack()], 6.0);
        assert!(got.register && got.messages.is_empty());
        assert!(!l.receive(&[ack()], 6.1).register);
    }

    #[test]
    fn a_client_request_fails_once_at_its_deadline_unless_answered() {
        let mut d = ClientDeadlines::new(10.0, 1.0);
        d.submit(2, None, 0.0);
        d.submit(1, Some(2.0), 0.0);
        d.submit(3, Some(2.0), 0.0);
        d.answered("TOKENS", Some(1));
        d.answered("NOT_A_KIND", Some(2));
        d.answered("DONE", Some(3));
        assert!(d.expired(2.9).is_empty());
        assert_eq!(d.expired(3.0), vec![1]);
        assert!(d.expired(10.9).is_empty());
        assert_eq!(d.expired(11.0), vec![2]);
        assert!(d.expired(100.0).is_empty());
        d.submit(4, None, 0.0);
        d.answered("FAILED", Some(4));
        assert!(d.expired(100.0).is_empty());
    }

    #[test]
    fn registration_is_awaited_until_registered_or_overdue_at_its_deadline() {
        let mut l = EngineInbox::new(None, 0.0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(l.registration(0.0, 1.0, 5.0), Registration::Answered, "nothing sent");
        l.sent(Kind::Register, None, true, 0.0);
        assert_eq!(l.registration(0.0, 1.0, 0.5), Registration::Awaited);
        assert_eq!(l.registration(0.0, 1.0, 1.0), Registration::Overdue);
        assert_eq!(l.registration(0.5, 0.75, 1.0), Registration::Awaited, "since + timeout");
        assert_eq!(l.registration(0.5, 0.75, 1.25), Registration::Overdue);
        let registered = frame(
            "REGISTERED",
            &[
                ("engine_id", Value::Str("p0".into())),
                ("incarnation", Value::Int(1)),
                ("peers", peers(1)),
            ],
        );
        l.receive(&[registered], 0.6);
        assert_eq!(l.registration(0.0, 1.0, 2.0), Registration::Answered);
    }
}
