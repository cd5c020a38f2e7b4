use super::*;
use proptest::prelude::*;

/// Plane rows `(coefficient, row)` with coefficients the running sums of the rows.
fn rows_of(sizes: &[u64]) -> Vec<(u64, u64)> {
    let mut at = 0;
    sizes
        .iter()
        .map(|&r| {
            let row = (at, r);
            at += r;
            row
        })
        .collect()
}

#[test]
fn chunks_are_runs_of_whole_items() {
    // Two planes of 4 and 8 bytes per token, 4 tokens per block, 10 tokens: 3 blocks each.
    let rows = rows_of(&[4, 8]);
    let got = chunk_ranges(&rows, 4, 10, 64).unwrap();
    // Items of at most 32 bytes: 2 per chunk. Plane 0 starts at 0, plane 1 at 40.
    assert_eq!(got, [[0, 2, 0, 32], [2, 4, 32, 72], [4, 6, 72, 120]]);
}

#[test]
fn a_chunk_holds_one_item_when_an_item_exceeds_the_limit() {
    let got = chunk_ranges(&rows_of(&[16]), 4, 8, 10).unwrap();
    assert_eq!(got, [[0, 1, 0, 64], [1, 2, 64, 128]]);
}

#[test]
fn chunk_ranges_refuse_zero_tokens_per_block() {
    assert!(matches!(
        chunk_ranges(&rows_of(&[4]), 0, 8, 64),
        Err(DisaggError::Argument { field, .. }) if field == "tokens_per_block"
    ));
}

#[test]
fn no_tokens_no_chunks() {
    assert!(chunk_ranges(&rows_of(&[4]), 4, 0, 64).unwrap().is_empty());
}

#[test]
fn messages_round_trip_and_malformed_ones_name_the_field() {
    let m = StreamMsg {
        kind: StreamKind::Ready,
        stream: 7,
        chunk: 3,
        slot: 1,
        offset: 4096,
        nbytes: 512,
    };
    let b = m.encode();
    assert_eq!(b.len(), STREAM_MSG_LEN);
    assert_eq!(StreamMsg::decode(&b).unwrap(), m);
    let wire_err = |b: &[u8]| match StreamMsg::decode(b) {
        Err(DisaggError::Wire { field, detail }) => (field, detail),
        other => panic!("expected a Wire error, got {other:?}"),
    };
    assert!(wire_err(&b[..40]).1.contains("40 bytes"));
    let mut bad = b.clone();
    bad[0] = b'X';
    assert!(wire_err(&bad).1.contains("magic"));
    bad = b.clone();
    bad[4] = 9;
    assert!(wire_err(&bad).1.contains("kind 9"));
    let mut ack = StreamMsg::bare(StreamKind::Ack, 7, 3).encode();
    assert_eq!(StreamMsg::decode(&ack).unwrap().kind, StreamKind::Ack);
    ack[33] = 1; // an Ack with a size
    assert!(wire_err(&ack).1.contains("nbytes=1"));
    let abort = StreamMsg::bare(StreamKind::Abort, 7, 2).encode();
    assert!(wire_err(&abort).1.contains("chunk=2"));
}

fn stream_of(n: usize, slots: usize) -> (StreamSource, StreamSink) {
    let chunks: Vec<ChunkRange> =
        (0..n as u64).map(|k| [k, k + 1, 100 * k, 100 * k + 100]).collect();
    let offsets: Vec<u64> = (0..slots as u64).map(|s| 1024 * s).collect();
    let src = StreamSource::new(5, chunks.clone(), offsets.clone()).unwrap();
    let sink = StreamSink::new(5, chunks, offsets, 100, 2).unwrap();
    (src, sink)
}

#[test]
fn the_source_reuses_a_slot_only_after_its_chunk_is_acknowledged() {
    let (mut src, _) = stream_of(5, 2);
    assert_eq!(src.packable(), [(0, 0), (1, 1)]);
    assert!(src.packable().is_empty());
    src.receive(&StreamMsg::bare(StreamKind::Ack, 5, 1)).unwrap();
    assert!(src.packable().is_empty(), "chunk 2 waits for slot 0 (chunk 0)");
    src.receive(&StreamMsg::bare(StreamKind::Ack, 5, 0)).unwrap();
    assert_eq!(src.packable(), [(2, 0), (3, 1)]);
    assert_eq!(src.ready(3).unwrap().offset, 1024);
    assert!(src.ready(4).is_err());
}

#[test]
fn the_source_refuses_acks_it_cannot_have_earned() {
    let (mut src, _) = stream_of(5, 2);
    src.packable();
    let field = |r: DisaggResult<StreamKind>| match r {
        Err(DisaggError::Wire { field, .. }) => field,
        other => panic!("expected a Wire error, got {other:?}"),
    };
    assert_eq!(field(src.receive(&StreamMsg::bare(StreamKind::Ack, 5, 2))), "stream_msg.chunk");
    assert_eq!(field(src.receive(&StreamMsg::bare(StreamKind::Ack, 6, 0))), "stream_msg.stream");
    src.receive(&StreamMsg::bare(StreamKind::Ack, 5, 0)).unwrap();
    assert_eq!(field(src.receive(&StreamMsg::bare(StreamKind::Ack, 5, 0))), "stream_msg.chunk");
    let ready = src.ready(1).unwrap();
    assert_eq!(field(src.receive(&ready)), "stream_msg.kind");
    assert_eq!(src.receive(&StreamMsg::bare(StreamKind::Abort, 5, 0)).unwrap(), StreamKind::Abort);
    assert!(src.aborted() && src.packable().is_empty() && !src.done());
}

#[test]
fn the_sink_takes_only_the_schedules_announcements() {
    let (mut src, mut sink) = stream_of(4, 2);
    src.packable();
    assert!(sink.reads().is_empty(), "nothing is read before it is announced");
    for k in 0..2 {
        sink.receive(&src.ready(k).unwrap()).unwrap();
    }
    let reads = sink.reads();
    assert_eq!(
        reads.iter().map(|r| (r.0, r.1, r.2)).collect::<Vec<_>>(),
        [(0, 0, 0), (1, 1, 1024)]
    );
    let ack = sink.landed(0).unwrap();
    assert!(sink.landed(0).is_err());
    src.receive(&ack).unwrap();
    src.packable();
    let good = src.ready(2).unwrap();
    for (field, bad) in [
        ("stream_msg.slot", StreamMsg { slot: 1, ..good }),
        ("stream_msg.offset", StreamMsg { offset: 1024, ..good }),
        ("stream_msg.nbytes", StreamMsg { nbytes: 99, ..good }),
        ("stream_msg.chunk", StreamMsg { chunk: 9, ..good }),
        ("stream_msg.chunk", StreamMsg { chunk: 1, slot: 1, offset: 1024, ..good }),
        ("stream_msg.kind", ack),
    ] {
        match sink.receive(&bad) {
            Err(DisaggError::Wire { field: f, .. }) => assert_eq!(f, field, "{bad:?}"),
            other => panic!("{bad:?}: expected a Wire error, got {other:?}"),
        }
    }
    assert_eq!(sink.receive(&good).unwrap(), StreamKind::Ready);
    assert_eq!(sink.reads().iter().map(|r| r.0).collect::<Vec<_>>(), [2]);
}

#[test]
fn slot_counts_are_bounded() {
    assert!(StreamSource::new(1, vec![], vec![]).is_err());
    assert!(StreamSource::new(1, vec![], vec![0; MAX_STREAM_SLOTS + 1]).is_err());
    assert!(StreamSink::new(1, vec![], vec![0], 8, 0).is_err());
    assert!(StreamSink::new(1, vec![[0, 1, 0, 9]], vec![0], 8, 1).is_err());
}

proptest! {
    #[test]
    fn chunks_cover_every_item_and_byte_once_within_the_limit(
        sizes in proptest::collection::vec(1u64..64, 1..6),
        tpb in 1u64..9, n_tok in 0u64..80, max_bytes in 0u64..2000,
    ) {
        let rows = rows_of(&sizes);
        let chunks = chunk_ranges(&rows, tpb, n_tok, max_bytes).unwrap();
        let n_blk = n_tok.div_ceil(tpb);
        let total = rows.len() as u64 * n_blk;
        let packed = sizes.iter().sum::<u64>() * n_tok;
        let item_max = sizes.iter().max().unwrap() * tpb;
        let (mut k, mut at) = (0, 0);
        for &[k_lo, k_hi, lo, hi] in &chunks {
            prop_assert_eq!((k_lo, lo), (k, at));
            prop_assert!(k_hi > k_lo && hi >= lo);
            prop_assert!(hi - lo <= max_bytes.max(item_max));
            k = k_hi;
            at = hi;
        }
        prop_assert_eq!((k, at), (total, if total == 0 { 0 } else { packed }));
    }

    #[test]
    fn messages_round_trip(kind in 1u8..4, stream: u64, chunk: u64, slot: u32, offset: u64,
                           nbytes: u64) {
        let kind = [StreamKind::Ready, StreamKind::Ack, StreamKind::Abort][usize::from(kind) - 1];
        let m = match kind {
            StreamKind::Ready => StreamMsg { kind, stream, chunk, slot, offset, nbytes },
            StreamKind::Ack => StreamMsg::bare(kind, stream, chunk),
            StreamKind::Abort => StreamMsg::bare(kind, stream, 0),
        };
        prop_assert_eq!(StreamMsg::decode(&m.encode()).unwrap(), m);
    }

    /// Both sides driven in any interleaving: the decode reads a chunk only while the
    /// source's slot still holds it, every chunk is read once in order, both sides finish.
    #[test]
    fn any_interleaving_moves_every_chunk_through_the_right_slot(
        n in 0usize..30, slots in 1usize..5, dst_slots in 1usize..4,
        order in proptest::collection::vec(0u8..4, 0..400),
    ) {
        let chunks: Vec<ChunkRange> =
            (0..n as u64).map(|k| [k, k + 1, 10 * k, 10 * k + 10]).collect();
        let offsets: Vec<u64> = (0..slots as u64).map(|s| 64 * s).collect();
        let mut src = StreamSource::new(9, chunks.clone(), offsets.clone()).unwrap();
        let mut sink = StreamSink::new(9, chunks, offsets, 10, dst_slots).unwrap();
        let (mut to_sink, mut to_src): (VecDeque<StreamMsg>, VecDeque<StreamMsg>) =
            (VecDeque::new(), VecDeque::new());
        // What each source slot holds; the first chunks are packed as the ticket is sent
        // and announced like every later one.
        let mut holds: Vec<Option<usize>> = vec![None; slots];
        for (k, s) in src.first() {
            holds[s] = Some(k);
            to_sink.push_back(src.ready(k).unwrap());
        }
        let mut reading: VecDeque<usize> = VecDeque::new();
        let mut read_order = Vec::new();
        let steps = order.iter().copied().chain((0..32 * n + 32).map(|i| (i % 4) as u8));
        for step in steps {
            match step % 4 {
                0 => for (k, s) in src.packable() {
                    prop_assert!(holds[s].is_none_or(|old| src.acked[old]));
                    holds[s] = Some(k);
                    to_sink.push_back(src.ready(k).unwrap());
                },
                1 => if let Some(m) = to_sink.pop_front() {
                    sink.receive(&m).unwrap();
                },
                2 => {
                    for (k, _, off, _) in sink.reads() {
                        let s = k % slots;
                        prop_assert_eq!(off, 64 * s as u64);
                        prop_assert_eq!(holds[s], Some(k));
                        reading.push_back(k);
                        read_order.push(k);
                    }
                    if let Some(k) = reading.pop_front() {
                        prop_assert_eq!(holds[k % slots], Some(k), "slot reused while read");
                        to_src.push_back(sink.landed(k).unwrap());
                    }
                }
                _ => if let Some(m) = to_src.pop_front() {
                    src.receive(&m).unwrap();
                },
            }
            // Nothing in flight (no read posted and not landed, no scatter queued) is exactly
            // when the read says it waits: then it cannot write anything.
            prop_assert_eq!(sink.quiet(), reading.is_empty());
            let want = if sink.done() { "DONE" } else if reading.is_empty() { "WAIT" } else { "PROC" };
            prop_assert_eq!(sink.status(), want);
        }
        prop_assert_eq!(read_order, (0..n).collect::<Vec<_>>());
        prop_assert!(src.done() && sink.done());
    }
}

#[test]
fn a_source_poll_packs_what_acks_free_and_announces_packs_in_order() {
    let (mut src, _) = stream_of(4, 2);
    assert_eq!(src.first(), [(0, 0), (1, 1)]);
    // The first chunks are announced like the others: once their packs have completed.
    assert!(src.announce(&[false, true]).is_empty(), "announced in order");
    let ready = src.announce(&[true, true]);
    assert_eq!(ready.iter().map(|m| (m.chunk, m.offset)).collect::<Vec<_>>(), [(0, 0), (1, 1024)]);
    let ack0 = StreamMsg::bare(StreamKind::Ack, 5, 0).encode();
    let (running, give_up, todo) = src.poll_at(&[ack0], false, 1.0, 9.0);
    assert!(running && !give_up);
    assert_eq!(todo, [(2, 0)]);
    // The pack of chunk 2 has not completed: nothing is announced yet.
    assert!(src.announce(&[false]).is_empty());
    let ready = src.announce(&[true]);
    assert_eq!(ready.iter().map(|m| (m.chunk, m.offset)).collect::<Vec<_>>(), [(2, 0)]);
    assert!(src.announce(&[true]).is_empty(), "announced once");
}

#[test]
fn a_source_gives_up_at_its_deadline_or_on_a_bad_message_and_tells_the_decode_once() {
    let (mut src, _) = stream_of(4, 2);
    src.first();
    assert_eq!(src.poll_at(&[], false, 9.0, 9.0), (false, true, vec![]));
    let abort = src.close(true).unwrap();
    assert_eq!((abort.kind, abort.stream), (StreamKind::Abort, 5));
    assert!(src.close(true).is_none(), "close is idempotent");

    let (mut src, _) = stream_of(4, 2);
    src.first();
    assert_eq!(src.poll_at(&[b"junk".to_vec()], false, 0.0, 9.0), (false, true, vec![]));
    let (mut src, _) = stream_of(4, 2);
    src.first();
    let abort = StreamMsg::bare(StreamKind::Abort, 5, 0).encode();
    assert_eq!(src.poll_at(&[abort], false, 0.0, 9.0), (false, false, vec![]));
    assert!(src.close(false).is_none(), "the decode gave it up: nothing to tell");
}

#[test]
fn a_whole_copy_is_read_in_chunks_from_its_offset_without_acks() {
    let chunks: Vec<ChunkRange> = (0..3u64).map(|k| [k, k + 1, 64 * k, 64 * k + 64]).collect();
    let mut sink = StreamSink::whole(chunks, 4096, 2).unwrap();
    let reads = sink.reads();
    assert_eq!(
        reads.iter().map(|r| (r.0, r.1, r.2)).collect::<Vec<_>>(),
        [(0, 0, 4096), (1, 1, 4160)]
    );
    let (landed, acks, err) = sink.observe(&[(0, "PROC".into()), (1, "DONE".into())]);
    assert_eq!((landed, acks, err), (vec![(1, 1)], vec![], None), "no ack for a whole copy");
    // Scatters complete in queue order: chunk 1's slot is free.
    assert_eq!(sink.scattered(&[true]), 1);
    assert_eq!(sink.reads().iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(), [(2, 1)]);
    let (_, _, err) = sink.observe(&[(0, "ERR".into())]);
    assert!(err.unwrap().contains("ERR for chunk 0"));
    let (_, _, err) = sink.observe(&[(1, "DONE".into())]);
    assert!(err.unwrap().contains("chunk 1 is not being read"));
    assert!(sink.close().is_none() && sink.status() == "PROC");
    let mut empty = StreamSink::whole(vec![], 0, 1).unwrap();
    assert_eq!((empty.status(), empty.close()), ("DONE", None));
}

#[test]
fn a_decode_acks_each_landed_read_and_tells_an_unfinished_source_once() {
    let (mut src, mut sink) = stream_of(3, 2);
    src.first();
    for m in src.announce(&[true, true]) {
        sink.receive(&m).unwrap();
    }
    sink.reads();
    assert_eq!(sink.take(&[], false, &[]).unwrap(), None);
    // A read that landed is acknowledged at once: the source's slot is free.
    let (_, acks, _) = sink.observe(&[(0, "DONE".into()), (1, "PROC".into())]);
    assert_eq!(acks.iter().map(|m| (m.kind, m.chunk)).collect::<Vec<_>>(), [(StreamKind::Ack, 0)]);
    assert_eq!(sink.scattered(&[true, true]), 1, "one scatter queued");
    let abort = sink.close().unwrap();
    assert_eq!((abort.kind, abort.stream), (StreamKind::Abort, 5));
    assert!(sink.close().is_none() && sink.reads().is_empty());
    let (_, mut gone) = stream_of(3, 2);
    let msg = StreamMsg::bare(StreamKind::Abort, 5, 0).encode();
    assert!(gone.take(&[msg], false, &[]).unwrap().unwrap().contains("gave stream 5 up"));
    assert!(gone.close().is_none(), "the source gave it up: nothing to tell");
    assert!(gone.take(&[b"junk".to_vec()], false, &[]).is_err());
}

#[test]
fn mailboxes_keep_the_notifications_of_open_streams_only() {
    let mut boxes = StreamMailboxes::default();
    let id = boxes.open("dec", 5);
    let ack = StreamMsg::bare(StreamKind::Ack, 5, 0).encode();
    let other = StreamMsg::bare(StreamKind::Ack, 6, 0).encode();
    boxes.route(
        vec![
            ("dec".into(), vec![ack.clone(), other, b"not a stream message".to_vec()]),
            ("elsewhere".into(), vec![ack.clone()]),
        ],
        0.0,
        TTL,
    );
    // Not a stream message: dropped; those of streams not open here wait for them.
    assert_eq!((boxes.dropped(), boxes.early()), (1, 2));
    assert_eq!(boxes.take(id), (vec![ack], false));
    assert_eq!(boxes.take(id), (vec![], false));
    boxes.close(id);
    boxes.close_stream("dec", 6);
    assert_eq!(boxes.early(), 1, "closing a stream drops what came for it early");
    boxes.forget("elsewhere");
    assert!(boxes.is_empty());
}

#[test]
fn forgetting_a_ticket_closes_the_stream_or_announcement_it_names_only() {
    use crate::wire::ticket::StagingTicket;
    let whole = StagingTicket {
        src_rank: 0,
        incarnation: 1,
        staged: true,
        offset: 0,
        nbytes: 64,
        stream: None,
        ready: None,
    };
    let early =
        |id| vec![("dec".to_owned(), vec![StreamMsg::bare(StreamKind::Ack, id, 0).encode()])];
    let mut boxes = StreamMailboxes::default();
    boxes.route(early(7), 0.0, TTL);
    boxes.route(early(8), 0.0, TTL);
    boxes.forget_ticket("dec", &whole);
    assert_eq!(boxes.early(), 2, "a ticket naming no notifications closes nothing");
    boxes.forget_ticket("dec", &StagingTicket { ready: Some(7), ..whole.clone() });
    assert_eq!(boxes.early(), 1);
    boxes.forget_ticket("other", &StagingTicket { ready: Some(8), ..whole });
    assert_eq!(boxes.early(), 1, "another peer's stream 8 stays");
}

/// How long an early notification waits for its stream in these tests (seconds).
const TTL: f64 = 30.0;

#[test]
fn an_early_notification_waits_for_its_stream_no_longer_than_a_stream_can_run() {
    let mut boxes = StreamMailboxes::default();
    let late = StreamMsg::bare(StreamKind::Ready, 7, 0).encode();
    let next = StreamMsg::bare(StreamKind::Ready, 8, 0).encode();
    // A notification of a stream that never opens here (its sender was forgotten before it
    // arrived, or its ticket was lost), then one whose ticket comes in time.
    boxes.route(vec![("pre".into(), vec![late])], 100.0, TTL);
    boxes.route(vec![("pre".into(), vec![next.clone()])], 120.0, TTL);
    boxes.route(vec![], 130.5, TTL);
    assert_eq!((boxes.early(), boxes.dropped()), (1, 1), "the first waited more than 30 s");
    let id = boxes.open("pre", 8);
    assert_eq!(boxes.take(id), (vec![next], false));
    boxes.route(vec![], 1e9, TTL);
    assert_eq!(boxes.dropped(), 1, "an open stream's notifications never expire");
    assert!(boxes.open("pre", 7) > id && boxes.early() == 0);
}

#[test]
fn an_announcement_that_overtakes_its_ticket_waits_for_its_stream() {
    let mut boxes = StreamMailboxes::default();
    let (mut src, mut sink) = stream_of(3, 2);
    src.first();
    let ready: Vec<Vec<u8>> = src.announce(&[true, true]).iter().map(StreamMsg::encode).collect();
    boxes.route(vec![("pre".into(), ready.clone())], 0.0, TTL);
    let id = boxes.open("pre", 5);
    assert_eq!(boxes.take(id), (ready.clone(), false));
    assert_eq!(sink.take(&ready, false, &[]).unwrap(), None);
    assert_eq!(sink.reads().len(), 2);
    // Bounded: the oldest early notification goes first.
    let mut full = StreamMailboxes::default();
    let msgs = (0..=MAX_EARLY_NOTIFS as u64)
        .map(|s| StreamMsg::bare(StreamKind::Abort, s, 0).encode())
        .collect();
    full.route(vec![("pre".into(), msgs)], 0.0, TTL);
    assert_eq!((full.early(), full.dropped()), (MAX_EARLY_NOTIFS, 1));
    let id = full.open("pre", 0);
    assert!(full.take(id).0.is_empty(), "stream 0's was the oldest");
}

#[test]
fn a_whole_copy_is_read_only_once_announced_and_the_announcement_ends_the_source() {
    let mut src = StreamSource::whole(7, 512, 192);
    assert!(src.packable().is_empty() && !src.done());
    // The pack has not completed: nothing announced, the stream runs.
    assert!(src.announce(&[false]).is_empty());
    assert_eq!(src.poll_at(&[], false, 0.0, 9.0), (true, false, vec![]));
    let ready = src.announce(&[true]);
    assert_eq!(
        ready.iter().map(|m| (m.chunk, m.slot, m.offset, m.nbytes)).collect::<Vec<_>>(),
        [(0, 0, 512, 192)]
    );
    assert!(src.done());
    assert_eq!(src.poll_at(&[], false, 1.0, 9.0), (false, false, vec![]));
    assert!(src.close(true).is_none(), "announced: nothing to tell");
    // Given up (released) before its pack completed: the decode is told.
    let mut early = StreamSource::whole(7, 512, 192);
    assert_eq!(early.close(true).map(|m| m.kind), Some(StreamKind::Abort));

    let chunks: Vec<ChunkRange> = (0..3u64).map(|k| [k, k + 1, 64 * k, 64 * k + 64]).collect();
    let mut sink = StreamSink::whole(chunks, 512, 2).unwrap().gated(7, 192);
    assert_eq!(sink.mailbox(), Some(7));
    assert!(sink.reads().is_empty(), "nothing is read before the announcement");
    for (field, bad) in [
        ("stream_msg.offset", StreamMsg { offset: 0, ..ready[0] }),
        ("stream_msg.nbytes", StreamMsg { nbytes: 64, ..ready[0] }),
        ("stream_msg.chunk", StreamMsg { chunk: 1, ..ready[0] }),
        ("stream_msg.stream", StreamMsg { stream: 8, ..ready[0] }),
    ] {
        match sink.receive(&bad) {
            Err(DisaggError::Wire { field: f, .. }) => assert_eq!(f, field, "{bad:?}"),
            other => panic!("{bad:?}: expected a Wire error, got {other:?}"),
        }
    }
    assert_eq!(sink.receive(&ready[0]).unwrap(), StreamKind::Ready);
    assert!(sink.receive(&ready[0]).is_err(), "announced twice");
    assert_eq!(sink.reads().iter().map(|r| (r.0, r.2)).collect::<Vec<_>>(), [(0, 512), (1, 576)]);
    let (_, acks, _) = sink.observe(&[(0, "DONE".into())]);
    assert!(acks.is_empty() && sink.close().is_none(), "a whole copy is never acknowledged");
    let mut plain = StreamSink::whole(vec![[0, 1, 0, 64]], 0, 1).unwrap();
    assert!(plain.mailbox().is_none() && plain.receive(&ready[0]).is_err());
}

#[test]
fn a_read_of_a_forgotten_peer_is_over_at_once_and_its_stream_id_is_free_again() {
    let mut boxes = StreamMailboxes::default();
    let old = boxes.open("pre", 7);
    let out = boxes.open("dec", 3);
    let msg = StreamMsg::bare(StreamKind::Abort, 7, 0).encode();
    boxes.route(vec![("pre".into(), vec![msg.clone()])], 0.0, TTL);
    boxes.forget("pre");
    assert_eq!(boxes.take(old), (vec![msg.clone()], true), "gone until closed");
    assert_eq!(boxes.take(out), (vec![], false), "another peer's mailbox is untouched");
    // The new incarnation numbers its streams anew: its stream 7 opens a mailbox of its own,
    // and closing the old one drops nothing of it.
    let announce = StreamSource::whole(7, 0, 64).announce(&[true])[0].encode();
    boxes.route(vec![("pre".into(), vec![announce.clone()])], 0.0, TTL);
    assert_eq!(boxes.take(old), (vec![], true), "a gone mailbox takes nothing more");
    let new = boxes.open("pre", 7);
    boxes.close(old);
    assert_eq!(boxes.take(new), (vec![announce], false));
    boxes.close(new);
    boxes.close(out);
    assert!(boxes.is_empty());

    // The read waiting for the announcement fails at once, quietly: nothing was posted, and
    // nothing is sent back to a peer that is gone.
    let mut sink = StreamSink::whole(vec![[0, 1, 0, 64]], 0, 1).unwrap().gated(7, 64);
    assert_eq!(sink.status(), "WAIT");
    let why = sink.take(&[msg], true, &[]).unwrap().unwrap();
    assert!(why.contains("stream 7 is gone"), "{why}");
    assert!(sink.reads().is_empty() && sink.quiet() && sink.close().is_none());
    // A source whose decode is gone is over with nothing to tell.
    let (mut src, _) = stream_of(3, 2);
    src.first();
    assert_eq!(src.poll_at(&[], true, 0.0, 9.0), (false, false, vec![]));
    assert!(src.close(false).is_none());
}

#[test]
fn a_peer_the_table_drops_or_names_with_another_incarnation_is_stale() {
    let table = |v: &[(&str, u64)]| v.iter().map(|&(n, i)| (n.to_owned(), i)).collect();
    let known = table(&[("dec", 1), ("pre0", 5), ("pre1", 5)]);
    // pre0 restarted (incarnation 6), pre1 declared lost (gone from the table), dec unchanged.
    let now = table(&[("dec", 1), ("pre0", 6), ("other", 2)]);
    assert_eq!(stale_peers(&known, &now), ["pre0", "pre1"]);
    assert!(stale_peers(&known, &known).is_empty());
}

#[test]
fn a_read_waiting_for_an_announcement_probes_its_source_and_ends_when_a_probe_is_refused() {
    let mut sink = StreamSink::whole(vec![[0, 1, 0, 64]], 0, 1).unwrap().gated(7, 64);
    // The first probe goes at once, the next one an interval later.
    assert_eq!(sink.probes(10.0), [STREAM_PROBE.to_vec()]);
    assert!(sink.probes(10.0 + PROBE_INTERVAL_S / 2.0).is_empty());
    assert_eq!(sink.probes(10.0 + 2.0 * PROBE_INTERVAL_S).len(), 1);
    // A probe sent: the wait goes on.
    assert_eq!(sink.take(&[], false, &[(true, String::new())]).unwrap(), None);
    // A probe refused (the source's process is gone): over, nothing sent back.
    let why = sink.take(&[], false, &[(false, "NIXL_ERR_REMOTE_DISCONNECT".into())]);
    assert!(why.unwrap().unwrap().contains("NIXL_ERR_REMOTE_DISCONNECT"));
    assert!(sink.probes(99.0).is_empty() && sink.close().is_none());
    // Once announced and read, nothing is probed; a read with nothing to wait for neither.
    let mut read = StreamSink::whole(vec![[0, 1, 0, 64]], 0, 1).unwrap().gated(7, 64);
    read.receive(&StreamSource::whole(7, 0, 64).announce(&[true])[0]).unwrap();
    assert!(read.probes(0.0).is_empty(), "announced: the next read goes out");
    assert_eq!(read.reads().len(), 1);
    assert!(read.probes(1.0).is_empty(), "a read in flight");
    let mut plain = StreamSink::whole(vec![[0, 1, 0, 64]], 0, 1).unwrap();
    assert!(plain.probes(0.0).is_empty());
    // A source drops the probes uncounted.
    let mut boxes = StreamMailboxes::default();
    boxes.route(vec![("dec".into(), vec![STREAM_PROBE.to_vec()])], 0.0, TTL);
    assert!(boxes.is_empty() && boxes.dropped() == 0);
}

#[test]
fn kinds_and_reads_have_names() {
    let names: Vec<_> =
        [StreamKind::Ready, StreamKind::Ack, StreamKind::Abort].map(StreamKind::name).to_vec();
    assert_eq!(names, ["ready", "ack", "abort"]);
    let whole = StreamSink::whole(vec![[0, 1, 0, 8]], 0, 1).unwrap();
    assert_eq!(whole.kind_name(), "chunked");
    let streamed = StreamSink::new(5, vec![[0, 1, 0, 8]], vec![0], 8, 1).unwrap();
    assert_eq!(streamed.kind_name(), "streamed");
}

#[test]
fn a_ticket_read_follows_its_stream_or_waits_for_its_announcement() {
    use crate::wire::ticket::{StagingTicket, StreamTicket};
    let whole = StagingTicket {
        src_rank: 0,
        incarnation: 1,
        staged: true,
        offset: 4096,
        nbytes: 192,
        stream: None,
        ready: None,
    };
    let rows = rows_of(&[4, 8]);
    // Held whole, cut in 64-byte slots: every chunk ready at once, no mailbox.
    let mut sink = StreamSink::of_ticket(&whole, &rows, 4, 16, 64, 2).unwrap();
    assert_eq!((sink.mailbox(), sink.reads().len()), (None, 2));
    // Announced: nothing is read before the announcement.
    let announced = StagingTicket { ready: Some(7), ..whole.clone() };
    let mut sink = StreamSink::of_ticket(&announced, &rows, 4, 16, 64, 2).unwrap();
    assert_eq!((sink.mailbox(), sink.reads().len()), (Some(7), 0));
    let mut one = StreamSink::one_piece(&announced).unwrap();
    assert_eq!((one.chunks().to_vec(), one.reads().len()), (vec![[0, 0, 0, 192]], 0));
    // Streamed: the stream's chunk size and slots.
    let st = StreamTicket { id: 3, chunk_bytes: 96, slot_bytes: 96, offsets: vec![0, 96] };
    let streamed = StagingTicket { stream: Some(st), offset: 0, ..whole };
    let sink = StreamSink::of_ticket(&streamed, &rows, 4, 16, 64, 2).unwrap();
    assert_eq!(sink.mailbox(), Some(3));
    assert!(sink.chunks().iter().all(|c| c[3] - c[2] <= 96));
}
