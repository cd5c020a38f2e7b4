use super::*;
use crate::p2p_header::HEADER_BYTES;
use proptest::prelude::*;

fn i(v: i128) -> WireValue {
    WireValue::Int(v)
}
fn ids(v: &[i128]) -> WireValue {
    WireValue::List(v.iter().copied().map(i).collect())
}
fn map(entries: Vec<(&str, WireValue)>) -> WireValue {
    WireValue::Map(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}
fn peer(name: &str) -> WireValue {
    map(vec![("agent_name", WireValue::Str(name.into()))])
}
fn with_ids(name: &str, own: &[i128]) -> WireValue {
    map(vec![("agent_name", WireValue::Str(name.into())), ("block_ids", ids(own))])
}
fn pairs(records: &[PeerRecord<WireValue>]) -> Vec<(WireValue, Option<WireValue>)> {
    records.iter().map(|r| (r.meta.clone(), r.ids.clone())).collect()
}

#[test]
fn one_dict_a_list_and_a_tp_wrapper_give_one_record_per_dict() {
    let (a, b) = (peer("a"), with_ids("b", &[7]));
    assert_eq!(pairs(&peer_records(&a).unwrap()), [(a.clone(), None)]);
    let list = WireValue::List(vec![a.clone(), b.clone()]);
    let want = [(a.clone(), None), (b.clone(), Some(ids(&[7])))];
    assert_eq!(pairs(&peer_records(&list).unwrap()), want);
    assert_eq!(pairs(&peer_records(&map(vec![("tp_metas", list)])).unwrap()), want);
    assert!(peer_records(&WireValue::List(vec![])).unwrap().is_empty());
}

#[test]
fn pp_stages_lend_their_block_ids_to_their_ranks_unless_a_rank_has_its_own() {
    let (a, b, c) = (peer("a"), with_ids("b", &[7]), peer("c"));
    let stages = WireValue::List(vec![
        map(vec![
            ("tp_metas", WireValue::List(vec![a.clone(), b.clone()])),
            ("block_ids", ids(&[4])),
        ]),
        map(vec![("tp_metas", c.clone())]),
        b.clone(),
    ]);
    let got = pairs(&peer_records(&map(vec![("pp_metas", stages)])).unwrap());
    let want =
        [(a, Some(ids(&[4]))), (b.clone(), Some(ids(&[7]))), (c, None), (b, Some(ids(&[7])))];
    assert_eq!(got, want);
}

#[test]
fn entries_that_are_not_dicts_are_refused_naming_the_field() {
    let field = |v: &WireValue| match peer_records(v).unwrap_err() {
        DisaggError::Wire { field, detail } => format!("{field}: {detail}"),
        other => panic!("{other}"),
    };
    let bad_rank = map(vec![("tp_metas", WireValue::List(vec![peer("a"), i(3)]))]);
    assert_eq!(field(&bad_rank), "peer_meta: peer metadata entries must be dicts, got int");
    let bad_stage = map(vec![("pp_metas", WireValue::List(vec![i(1)]))]);
    assert_eq!(field(&bad_stage), "pp_metas: pp_metas entries must be dicts");
    for v in [WireValue::Null, WireValue::Str("x".into()), i(3)] {
        assert!(
            field(&v).starts_with("peer_meta: peer metadata must be a dict or a list"),
            "{v:?}"
        );
    }
    assert!(field(&map(vec![("tp_metas", WireValue::Null)])).contains("got None"));
    let none = source_records(&WireValue::List(vec![])).unwrap_err();
    assert!(none.to_string().contains("no peer metadata given"), "{none}");
}

#[test]
fn the_call_s_ids_stay_as_given_unless_a_record_carries_its_own() {
    let default = ids(&[1, 2]);
    assert_eq!(ids_by_rank(&[(0, None), (1, None)], &default), ResolvedIds::Given);
    let per_rank = map(vec![("0", ids(&[5])), ("2", ids(&[6]))]);
    let records =
        [(0, None), (1, Some(ids(&[9]))), (2, Some(per_rank.clone())), (3, Some(WireValue::Null))];
    let want = vec![(0, default.clone()), (1, ids(&[9])), (2, ids(&[6]))];
    assert_eq!(ids_by_rank(&records, &default), ResolvedIds::ByRank(want));
    // A per-rank default gives each rank its entry; a later record of a rank wins.
    let got = ids_by_rank(&[(0, None), (2, Some(ids(&[8]))), (0, Some(ids(&[3])))], &per_rank);
    assert_eq!(got, ResolvedIds::ByRank(vec![(0, ids(&[3])), (2, ids(&[8]))]));
}

#[test]
fn a_dict_without_transport_fields_is_planned_with_none_and_rank_0() {
    let want = map(vec![
        ("agent_metadata", WireValue::Str(String::new())),
        ("staging", WireValue::Null),
        ("dist_rank", i(0)),
    ]);
    assert_eq!(planning_defaults(), want);
}

fn table() -> PeerTable<usize> {
    let local = crate::wire::peer::LocalFacts {
        state_kind: crate::wire::peer::StateKind::Kv,
        dtype: "torch.float32".into(),
        head_dim: 4,
        num_layers: Some(2),
        compat_hash: "0123456789abcdef".into(),
    };
    PeerTable::new("nixl", local)
}

fn reference_local() -> refmeta::LocalFacts {
    refmeta::LocalFacts {
        backend: "nixl".into(),
        state_kind: "kv".into(),
        element_size: 4,
        dtype: "torch.float32".into(),
    }
}

fn valid() -> WireValue {
    use crate::wire::peer::{tests::meta_with_staging, Region};
    meta_with_staging(Region { addr: 1 << 20, nbytes: 4096 })
}

fn plus(meta: &WireValue, key: &str, v: WireValue) -> WireValue {
    let WireValue::Map(mut e) = meta.clone() else { panic!("a map") };
    e.retain(|(k, _)| k != key);
    e.push((key.to_owned(), v));
    WireValue::Map(e)
}

#[test]
fn a_peer_is_adopted_once_without_its_block_ids_and_found_again_by_content() {
    let (mut t, local) = (table(), reference_local());
    let mut made = 0;
    let mut attach = |_: &Arc<PeerMeta>, schema: &WireValue| {
        assert_eq!(schema.field("block_ids"), None);
        made += 1;
        Ok(made)
    };
    let first =
        adopt_peer(&mut t, (plus(&valid(), "block_ids", ids(&[1, 2])), false), &local, &mut attach);
    assert_eq!(first.unwrap().1, 1);
    // The same peer with other handoff ids, or none, is the entry adopted first.
    let again =
        adopt_peer(&mut t, (plus(&valid(), "block_ids", ids(&[3])), false), &local, &mut attach);
    assert_eq!(again.unwrap().1, 1);
    assert_eq!(adopt_peer(&mut t, (valid(), false), &local, &mut attach).unwrap().1, 1);
    // Changed content is another peer.
    let other = plus(&valid(), "incarnation", i(8));
    assert_eq!(adopt_peer(&mut t, (other, false), &local, &mut attach).unwrap().1, 2);
    assert_eq!((made, t.len()), (2, 2));
}

#[test]
fn a_dict_without_a_version_is_translated_from_the_reference_fields_first() {
    let (mut t, local) = (table(), reference_local());
    let mut attach = |_: &Arc<PeerMeta>, _: &WireValue| -> DisaggResult<usize> { Ok(0) };
    let mut kind = |meta: WireValue, t: &mut PeerTable<usize>| {
        let e = adopt_peer(t, (meta, false), &local, &mut attach).unwrap_err();
        (e.kind(), e.to_string())
    };
    let mut bare = valid();
    if let WireValue::Map(e) = &mut bare {
        e.retain(|(k, _)| k != "version");
    }
    let translated = refmeta::meta_from_reference(&bare, &local).unwrap_err();
    assert_eq!(kind(bare, &mut t), (translated.kind(), translated.to_string()));
    // With a version it is parsed as given: the parse's error, not the translation's.
    let parsed = kind(plus(&valid(), "head_dim", i(8)), &mut t);
    assert_ne!(parsed.1, translated.to_string());
    assert_eq!(t.len(), 0);
}

#[test]
fn a_dict_to_plan_with_gets_the_transport_defaults_under_its_own_fields() {
    let (mut t, local) = (table(), reference_local());
    let mut schemas = Vec::new();
    let mut attach = |_: &Arc<PeerMeta>, schema: &WireValue| {
        schemas.push(schema.clone());
        Ok(schemas.len())
    };
    let mut bare = valid();
    if let WireValue::Map(e) = &mut bare {
        e.retain(|(k, _)| k != "agent_metadata" && k != "staging");
    }
    let bare = plus(&bare, "dist_rank", i(3));
    assert_eq!(adopt_peer(&mut t, (bare.clone(), true), &local, &mut attach).unwrap().1, 1);
    assert_eq!(adopt_peer(&mut t, (bare, true), &local, &mut attach).unwrap().1, 1);
    // Found as given: a full dict adopted before is not widened.
    assert_eq!(adopt_peer(&mut t, (valid(), true), &local, &mut attach).unwrap().1, 2);
    let err = adopt_peer(&mut t, (ids(&[1]), true), &local, &mut attach).unwrap_err();
    assert!(err.to_string().contains("must be a dict, got list"), "{err}");
    let got = &schemas[0];
    assert_eq!(got.field("agent_metadata"), Some(WireValue::Str(String::new())));
    assert_eq!((got.field("staging"), got.field("dist_rank")), (Some(WireValue::Null), Some(i(3))));
}

#[test]
fn the_first_failure_wins_posting_then_works_then_threads() {
    let s = |v: &str| v.to_owned();
    assert_eq!(p2p_outcome(None, vec![None, None], vec![]), None);
    assert_eq!(p2p_outcome(None, vec![None, Some(s("w"))], vec![s("t")]), Some(s("w")));
    assert_eq!(p2p_outcome(Some(s("p")), vec![Some(s("w"))], vec![s("t")]), Some(s("p")));
    assert_eq!(p2p_outcome(None, vec![None], vec![s("t"), s("u")]), Some(s("t")));
}

#[test]
fn receives_skip_empty_sources_and_refuse_a_source_no_peer_names() {
    let p = |g, d| MessagePeer { global_rank: g, dist_rank: d, incarnation: 9 };
    let peers = [p(0, 4), p(1, 5)];
    let got = p2p_receives(&[(1, 64), (0, 0)], &peers, (6, false)).unwrap();
    assert_eq!(got, (6, vec![(p(1, 5), 64)]));
    assert_eq!(p2p_receives(&[(1, 64)], &peers, (6, true)).unwrap().0, 0);
    let err = p2p_receives(&[(0, 8), (3, 8)], &peers, (6, false)).unwrap_err();
    assert!(matches!(&err, DisaggError::Wire { field, .. } if field == "peer_meta"));
    assert!(err.to_string().contains("source rank 3"), "{err}");
}

#[test]
fn sends_go_to_destinations_that_read_bytes_from_this_rank() {
    let programs = [vec![(0, 10), (1, 20)], vec![(0, 5)], vec![(1, 0)], vec![(1, 7)]];
    assert_eq!(p2p_sends(1, &programs), [(0, 20), (3, 7)]);
    assert!(p2p_sends(2, &programs).is_empty());
}

#[test]
fn each_send_carries_the_header_of_its_one_message() {
    let programs = vec![vec![(1, 20)], vec![(0, 5)], vec![(1, 7)]];
    for filler in [false, true] {
        let kind = MessageKind::sent(filler);
        let (tag, got) = p2p_send_messages(1, &programs, kind, (9, 4), filler).unwrap();
        assert_eq!(tag, if filler { 0 } else { 9 });
        let ids: Vec<_> = got.iter().map(|(i, n, _)| (*i, *n)).collect();
        assert_eq!(ids, p2p_sends(1, &programs));
        for (_, n, head) in &got {
            assert_eq!(head.len(), HEADER_BYTES);
            assert_eq!(*head, encode_headers(kind, 9, 4, &[*n]).unwrap());
        }
    }
    assert_eq!(MessageKind::sent(true), MessageKind::Aborted);
    assert_eq!(MessageKind::sent(false), MessageKind::Data);
}

#[test]
fn a_poll_fails_only_once_terminal_and_times_out_only_while_running() {
    assert_eq!(poll_verdict(false, None, 1.0, (2.0, 0.5)), PollVerdict::Running);
    assert_eq!(poll_verdict(true, None, 9.0, (2.0, 0.5)), PollVerdict::Done);
    let failed = poll_verdict(true, Some("x".into()), 9.0, (2.0, 0.5));
    assert_eq!(failed, PollVerdict::Failed("x".into()));
    let late = poll_verdict(false, Some("x".into()), 2.5, (2.0, 0.25));
    let want = "transfer not finished 0.250 s after submission; its destinations may still be \
                written";
    assert_eq!(late, PollVerdict::TimedOut(want.into()));
    assert_eq!(poll_verdict(false, None, 2.0, (2.0, 0.5)), PollVerdict::Running);
}

proptest! {
    #[test]
    fn nothing_to_move_exactly_when_every_list_is_empty(
        counts in prop::collection::vec(prop::collection::vec(0_usize..3, 0..3), 0..4)
    ) {
        let model = counts.iter().map(|c| c.iter().sum::<usize>()).sum::<usize>() == 0;
        prop_assert_eq!(nothing_to_move(&counts), model);
    }

}

#[test]
fn the_memo_finds_an_unchanged_object_and_restarts_when_full() {
    let mut memo = IdentityMemo::new(2);
    memo.insert(10, "a");
    memo.insert(11, "b");
    assert_eq!(memo.get(10, |_| true), Some(&"a"));
    assert_eq!(memo.get(10, |v| *v == "changed"), None);
    memo.insert(12, "c");
    assert_eq!((memo.len(), memo.get(10, |_| true)), (1, None));
    assert!(!memo.is_empty());
}
