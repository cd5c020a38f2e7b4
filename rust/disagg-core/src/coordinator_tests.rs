use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::args::Given;
use crate::wire::control::MAX_TIMEOUT_S;

/// Payloads are plain text here.
type C = Coordinator<String>;
type Out = Vec<Outgoing<String>>;

const CLIENT: &[u8] = b"client";

fn identity(id: &str, inc: u64) -> Vec<u8> {
    format!("{id}:{inc}").into_bytes()
}

fn register(c: &mut C, id: &str, role: &str, inc: u64, now: f64) -> Out {
    let ev = Event::Register {
        engine_id: id.into(),
        role: role.into(),
        incarnation: inc,
        meta: format!("meta-{id}"),
    };
    c.handle(&identity(id, inc), ev, now)
}

fn submit(c: &mut C, rid: u64, now: f64) -> Out {
    let ev =
        Event::Submit { request_id: rid, prompt: "p".into(), max_new_tokens: 4, timeout_s: None };
    c.handle(CLIENT, ev, now)
}

fn kinds(out: &Out) -> Vec<(String, Kind)> {
    let to = |o: &Outgoing<String>| {
        o.to_engine.clone().unwrap_or_else(|| {
            String::from_utf8_lossy(o.to_client.as_deref().unwrap_or_default()).into()
        })
    };
    out.iter().map(|o| (to(o), o.kind)).collect()
}

fn get<'a>(o: &'a Outgoing<String>, name: &str) -> Option<&'a Field<String>> {
    match &o.fields {
        Field::Map(pairs) | Field::Amended(_, pairs) => {
            pairs.iter().find(|(k, _)| k == name).map(|p| &p.1)
        }
        _ => None,
    }
}

fn registered() -> C {
    let mut c = C::new(10.0, false, Some(5.0)).unwrap_or_else(|e| panic!("{e}"));
    register(&mut c, "p0", "prefill", 1, 0.0);
    register(&mut c, "d0", "decode", 1, 0.0);
    c
}

fn prefill_done(rid: u64, epoch: u64, resume: usize) -> Event<String> {
    Event::PrefillDone {
        request_id: rid,
        epoch,
        ticket: "ticket".into(),
        resume: ("tokens".into(), resume),
    }
}

#[test]
fn a_request_flows_from_prefill_to_decode_and_back_to_its_client() {
    let mut c = registered();
    let out = submit(&mut c, 7, 1.0);
    assert_eq!(kinds(&out), [("p0".into(), Kind::Prefill)]);
    assert_eq!(get(&out[0], "decode_engine_id"), Some(&Field::Text("d0".into())));
    let out = c.handle(&identity("p0", 1), prefill_done(7, 1, 1), 1.0);
    assert_eq!(
        kinds(&out),
        [("client".into(), Kind::Tokens), ("d0".into(), Kind::SubmitRequestWithKv)]
    );
    // The ticket's provenance is the coordinator's own.
    let Some(Field::Amended(ticket, provenance)) = get(&out[1], "ticket") else {
        panic!("{out:?}")
    };
    assert_eq!(ticket, "ticket");
    assert!(provenance.contains(&("prefill_engine_id".into(), Field::Text("p0".into()))));
    assert!(provenance.contains(&("prefill_incarnation".into(), Field::Int(1))));
    let imported =
        Event::KvImported { request_id: 7, epoch: 1, ok: true, error: String::new(), quiet: false };
    assert_eq!(
        kinds(&c.handle(&identity("d0", 1), imported, 2.0)),
        [("p0".into(), Kind::ReleaseKv)]
    );
    let tokens = Event::Tokens { request_id: 7, epoch: None, tokens: "t".into() };
    assert_eq!(
        kinds(&c.handle(&identity("d0", 1), tokens, 2.0)),
        [("client".into(), Kind::Tokens)]
    );
    let done = Event::Done { request_id: 7, epoch: Some(1), fields: "done".into() };
    let out = c.handle(&identity("d0", 1), done, 3.0);
    assert_eq!(kinds(&out), [("client".into(), Kind::Done)]);
    assert_eq!(out[0].fields, Field::Amended("done".into(), Vec::new()));
    assert!(c.requests().is_empty());
    assert_eq!((c.counters().completed, c.counters().failed), (1, 0));
}

#[test]
fn a_message_from_the_wrong_engine_or_attempt_is_ignored_and_counted() {
    let mut c = registered();
    submit(&mut c, 7, 1.0);
    assert!(c.handle(&identity("d0", 1), prefill_done(7, 1, 0), 1.0).is_empty()); // not the prefill
    assert!(c.handle(&identity("p0", 1), prefill_done(7, 2, 0), 1.0).is_empty()); // stale epoch
    assert!(c.handle(b"stranger", prefill_done(7, 1, 0), 1.0).is_empty()); // no engine
    assert!(c.handle(&identity("p0", 1), prefill_done(8, 1, 0), 1.0).is_empty()); // no request
    assert_eq!(c.counters().ignored.get("PREFILL_DONE"), Some(&4));
    // A second PREFILL_DONE of the same attempt is a duplicate.
    assert_eq!(c.handle(&identity("p0", 1), prefill_done(7, 1, 0), 1.0).len(), 1);
    assert!(c.handle(&identity("p0", 1), prefill_done(7, 1, 0), 1.0).is_empty());
    assert_eq!(c.counters().ignored.get("PREFILL_DONE"), Some(&5));
}

#[test]
fn a_restart_fails_the_requests_it_held_and_releases_no_pins_on_it() {
    let mut c = registered();
    submit(&mut c, 7, 1.0);
    c.handle(&identity("p0", 1), prefill_done(7, 1, 0), 1.0);
    let out = register(&mut c, "p0", "prefill", 2, 2.0);
    assert_eq!(
        kinds(&out),
        [
            ("client".into(), Kind::Failed),
            ("p0".into(), Kind::Abort),
            ("d0".into(), Kind::Abort),
            ("p0".into(), Kind::Registered),
            ("d0".into(), Kind::Peers),
        ]
    );
    assert_eq!(c.counters().left_to_lease, 0);
    // An older incarnation registering again is ignored.
    assert!(register(&mut c, "p0", "prefill", 1, 2.0).is_empty());
    assert_eq!(c.counters().ignored.get("REGISTER"), Some(&1));
}

#[test]
fn a_failed_import_that_is_not_quiet_leaves_the_pins_to_their_lease() {
    for (quiet, release) in [(false, false), (true, true)] {
        let mut c = registered();
        submit(&mut c, 7, 1.0);
        c.handle(&identity("p0", 1), prefill_done(7, 1, 0), 1.0);
        let ev = Event::KvImported { request_id: 7, epoch: 1, ok: false, error: "x".into(), quiet };
        let out = c.handle(&identity("d0", 1), ev, 2.0);
        assert_eq!(out.iter().any(|o| o.kind == Kind::ReleaseKv), release);
        assert_eq!(c.counters().left_to_lease, u64::from(!release));
    }
}

#[test]
fn a_silent_engine_is_fenced_unless_the_coordinator_is_shutting_down() {
    let mut c = registered();
    submit(&mut c, 7, 1.0);
    let beat = |c: &mut C, id: &str, now| {
        c.handle(&identity(id, 1), Event::Heartbeat { engine_id: id.into() }, now)
    };
    assert_eq!(kinds(&beat(&mut c, "d0", 4.0)), [("d0".into(), Kind::HeartbeatAck)]);
    let out = c.poll(5.5); // p0 silent since 1.0 (its last message: none since 0.0)
    assert_eq!(
        kinds(&out),
        [("client".into(), Kind::Failed), ("d0".into(), Kind::Abort), ("d0".into(), Kind::Peers)]
    );
    assert_eq!(c.counters().lost.get("p0"), Some(&1));
    // Its next heartbeat is answered FENCED.
    assert_eq!(kinds(&beat(&mut c, "p0", 6.0)), [("p0:1".into(), Kind::Fenced)]);
    assert_eq!(kinds(&c.shutdown()), [("d0".into(), Kind::Shutdown)]);
    assert!(c.poll(100.0).is_empty() && c.engines().contains_key("d0"));
}

#[test]
fn a_refused_submit_with_a_usable_id_is_answered() {
    let mut c = registered();
    let failed = |out: Out| kinds(&out) == [("client".to_owned(), Kind::Failed)];
    assert!(failed(c.refused(CLIENT, Some(Kind::Submit), Some(3), "bad")));
    assert!(c.refused(CLIENT, Some(Kind::Submit), Some(-1), "bad").is_empty());
    assert!(c.refused(CLIENT, Some(Kind::Submit), Some(1 << 63), "bad").is_empty());
    assert!(c.refused(CLIENT, Some(Kind::Tokens), Some(3), "bad").is_empty());
    submit(&mut c, 3, 0.0);
    // A live id is not answered.
    assert!(c.refused(CLIENT, Some(Kind::Submit), Some(3), "bad").is_empty());
    // A frame: {"type": "SUBMIT", "request_id": 4}; garbage gets nothing.
    let frame =
        [0x82, 0xa4, b't', b'y', b'p', b'e', 0xa6, b'S', b'U', b'B', b'M', b'I', b'T', 0xaa]
            .into_iter()
            .chain(*b"request_id")
            .chain([0x04])
            .collect::<Vec<u8>>();
    assert!(failed(c.refused_frame(CLIENT, &frame, "bad")));
    assert!(c.refused_frame(CLIENT, b"\xc1", "bad").is_empty());
}

#[test]
fn authentication_binds_an_engine_id_to_its_key() {
    let c = registered();
    let keys: BTreeMap<String, String> = [("p0".into(), "kp".into())].into();
    assert!(c.authentic(b"x", Kind::Register, Some("p0"), "kp", &keys));
    assert!(!c.authentic(b"x", Kind::Register, Some("p0"), "other", &keys));
    assert!(c.authentic(&identity("p0", 1), Kind::PrefillDone, None, "kp", &keys));
    assert!(!c.authentic(&identity("d0", 1), Kind::Done, None, "kp", &keys)); // d0 has no key
    assert!(c.authentic(b"client", Kind::Submit, None, "", &keys));
    assert!(!c.authentic(b"client", Kind::Done, None, "", &keys));
}

#[test]
fn a_bad_engine_timeout_is_refused() {
    for t in [0.0, -1.0, f64::NAN] {
        assert!(C::new(1.0, false, Some(t)).is_err());
    }
    assert!(C::new(0.0, false, None).is_err());
}

#[test]
fn timeouts_and_curve_modes_are_checked() {
    assert_eq!(timeout_seconds("t", &Given(Ok(2.5))), Ok(2.5));
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, MAX_TIMEOUT_S * 2.0] {
        assert!(timeout_seconds("t", &Given(Ok(bad))).is_err(), "{bad}");
    }
    let e = timeout_seconds("t", &Given(Err("a bool (True)".into()))).unwrap_err();
    assert!(e.to_string().contains("t=a bool (True) must be a number of seconds"), "{e}");
    assert_eq!(curve_mode("x", true, false), Ok(true));
    assert_eq!(curve_mode("x", false, true), Ok(false));
    assert!(curve_mode("x", true, true).unwrap_err().to_string().contains("`insecure`"));
    assert!(curve_mode("x", false, false).unwrap_err().to_string().contains("`keys`"));
}

#[test]
fn faults_spare_clients_and_shutdowns_and_repeat_per_seed() {
    let traffic = |n: u32| -> Vec<(u32, bool, Option<Kind>)> {
        (0..n)
            .map(|i| (i, i % 4 != 0, Some(if i % 8 == 1 { Kind::Shutdown } else { Kind::Abort })))
            .collect()
    };
    let run = |seed: u64| {
        let mut plan = FaultPlan::new(0.5, seed, 3);
        let mut sent: Vec<u32> = (0..5).flat_map(|_| plan.pass(traffic(64))).collect();
        sent.extend(plan.pass(Vec::new()));
        sent.extend((0..4).flat_map(|_| plan.pass(Vec::new())));
        (sent, plan.injected())
    };
    let (sent, injected) = run(7);
    assert_eq!(run(7), (sent.clone(), injected));
    assert!(injected > 0);
    // Spared messages arrive every round, exactly once each.
    for i in (0..64u32).filter(|i| i % 4 == 0 || i % 8 == 1) {
        assert_eq!(sent.iter().filter(|s| **s == i).count(), 5, "{i}");
    }
    // Nothing is delayed forever, and without faults nothing changes.
    let mut calm = FaultPlan::new(0.0, 1, 3);
    assert_eq!(calm.pass(traffic(8)), (0..8).collect::<Vec<_>>());
    assert_eq!(calm.injected(), 0);
}

/// One step of a random run: what arrives, from where.
#[derive(Debug, Clone)]
enum Step {
    Register(usize, u64),
    Submit(u64),
    PrefillDone(u64, usize),
    Imported(u64, bool, bool),
    Done(u64),
    Failed(u64, usize, bool),
    Poll(f64),
}

const ENGINES: [(&str, &str); 3] = [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")];

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..3usize, 1..3u64).prop_map(|(e, i)| Step::Register(e, i)),
        (0..4u64).prop_map(Step::Submit),
        (0..4u64, 0..3usize).prop_map(|(r, e)| Step::PrefillDone(r, e)),
        (0..4u64, any::<bool>(), any::<bool>()).prop_map(|(r, ok, q)| Step::Imported(r, ok, q)),
        (0..4u64).prop_map(Step::Done),
        (0..4u64, 0..3usize, any::<bool>()).prop_map(|(r, e, q)| Step::Failed(r, e, q)),
        (0.0..8.0f64).prop_map(Step::Poll),
    ]
}

proptest! {
    /// Against a simple model: every request that leaves the live set tells its client once
    /// (DONE or FAILED) in that step, and is counted once; a live request never gets a
    /// terminal message; RELEASE_KV goes at most once per attempt, only to its prefill.
    #[test]
    fn every_request_ends_once_and_each_pin_is_released_at_most_once(
        steps in proptest::collection::vec(step(), 1..60)
    ) {
        let mut c = C::new(30.0, false, Some(6.0)).unwrap_or_else(|e| panic!("{e}"));
        let mut inc = [1u64; 3];
        let mut now = 0.0;
        let mut released: BTreeSet<(u64, u64)> = BTreeSet::new();
        let mut total = 0u64;
        for s in steps {
            let before: BTreeMap<u64, Request<String>> = c.requests().clone();
            let from = |e: usize, inc: &[u64; 3]| identity(ENGINES[e].0, inc[e]);
            let epoch = |r: u64| before.get(&r).map_or(1, |q| q.epoch);
            let decode = from(2, &inc);
            let out = match s {
                Step::Register(e, i) => {
                    inc[e] = inc[e].max(i);
                    register(&mut c, ENGINES[e].0, ENGINES[e].1, i, now)
                }
                Step::Submit(r) => submit(&mut c, r, now),
                Step::PrefillDone(r, e) => c.handle(&from(e, &inc), prefill_done(r, epoch(r), 0), now),
                Step::Imported(r, ok, quiet) => {
                    let ev = Event::KvImported { request_id: r, epoch: epoch(r), ok, error: "e".into(), quiet };
                    c.handle(&decode, ev, now)
                }
                Step::Done(r) => {
                    let ev = Event::Done { request_id: r, epoch: None, fields: "done".into() };
                    c.handle(&decode, ev, now)
                }
                Step::Failed(r, e, quiet) => {
                    let ev = Event::Failed { request_id: r, epoch: None, error: "e".into(), quiet };
                    c.handle(&from(e, &inc), ev, now)
                }
                Step::Poll(dt) => {
                    now += dt;
                    c.poll(now)
                }
            };
            let after = c.requests();
            let ended: BTreeSet<u64> =
                before.keys().filter(|r| !after.contains_key(r)).copied().collect();
            let terminal: Vec<u64> = out
                .iter()
                .filter(|o| o.to_client.is_some())
                .filter_map(|o| match (o.kind, get(o, "request_id"), &s) {
                    (Kind::Failed, Some(Field::Int(r)), _) | (Kind::Done, _, Step::Done(r)) => {
                        Some(*r)
                    }
                    _ => None,
                })
                .collect();
            let told: BTreeSet<u64> = terminal.iter().copied().collect();
            let counted = c.counters().completed + c.counters().failed;
            if matches!(s, Step::Submit(r) if before.contains_key(&r)) {
                // A duplicate id is refused (FAILED) and ends nothing.
                prop_assert_eq!(terminal.len(), 1);
                prop_assert!(ended.is_empty() && counted == total);
            } else {
                prop_assert_eq!(terminal.len(), told.len()); // once each
                prop_assert!(ended.is_subset(&told));
                // Told without having been live: submitted and failed at once (no prefill).
                for r in told.difference(&ended) {
                    prop_assert!(!before.contains_key(r) && !after.contains_key(r));
                }
                prop_assert_eq!(counted, total + u64::try_from(told.len()).unwrap_or(u64::MAX));
            }
            total = counted;
            for o in out.iter().filter(|o| o.kind == Kind::ReleaseKv) {
                let (Some(Field::Int(r)), Some(Field::Int(e))) = (get(o, "request_id"), get(o, "epoch")) else {
                    panic!("{o:?}")
                };
                prop_assert!(released.insert((*r, *e)), "released twice: {:?}", o);
                let prefill = before.get(r).and_then(|q| q.prefill.clone());
                prop_assert_eq!(o.to_engine.clone(), prefill);
            }
        }
    }
}

#[test]
fn an_import_event_defaults_its_error_and_counts_quiet_only_when_true() {
    let ev = |error: Option<&str>, quiet| {
        Event::<String>::kv_imported(7, 1, false, error.map(Into::into), quiet)
    };
    let got = |e: Event<String>| match e {
        Event::KvImported { error, quiet, .. } => (error, quiet),
        other => panic!("{other:?}"),
    };
    assert_eq!(got(ev(None, None)), ("unknown error".into(), false));
    assert_eq!(got(ev(Some("x"), Some(false))), ("x".into(), false));
    assert_eq!(got(ev(Some("x"), Some(true))), ("x".into(), true));
    for (quiet, want) in [(None, false), (Some(false), false), (Some(true), true)] {
        let e = Event::<String>::failed(7, None, "e".into(), quiet);
        assert_eq!(e, Event::Failed { request_id: 7, epoch: None, error: "e".into(), quiet: want });
    }
}

#[test]
fn a_done_tells_its_client_the_request_and_tokens_but_not_the_epoch() {
    let schema = Kind::Done.schema();
    for f in &schema {
        assert_eq!(DONE_WITHHELD.contains(&f.name), f.name == "epoch", "{}", f.name);
    }
    assert!(DONE_WITHHELD.contains(&"type") && DONE_WITHHELD.contains(&"v"));
}

#[test]
fn a_push_is_told_where_the_decode_posted_or_an_empty_map() {
    for (transfer, want) in
        [(Some("t".to_owned()), Field::Payload("t".into())), (None, Field::Map(Vec::new()))]
    {
        let mut c = C::new(10.0, true, Some(5.0)).unwrap_or_else(|e| panic!("{e}"));
        register(&mut c, "p0", "prefill", 1, 0.0);
        register(&mut c, "d0", "decode", 1, 0.0);
        submit(&mut c, 7, 1.0);
        c.handle(&identity("p0", 1), prefill_done(7, 1, 0), 1.0);
        let posted =
            Event::KvRecvPosted { request_id: 7, epoch: 1, prefill: Some("p0".into()), transfer };
        let out = c.handle(&identity("d0", 1), posted, 2.0);
        assert_eq!(kinds(&out), [("p0".into(), Kind::SendKv)]);
        assert_eq!(get(&out[0], "transfer"), Some(&want));
    }
}
