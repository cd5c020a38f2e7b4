//! The order of the steps of a chunked two-sided transfer through a staging pool.
//!
//! A handoff moves in chunks; chunk `k` travels through pool slot `(start + k) % slots`. The
//! sender packs a chunk and posts its send; the receiver posts a receive and, later, lands the
//! chunk (makes its stream wait for the message and queues the scatter out of the slot). On a
//! GPU a message waits for everything queued on the stream when it was posted, so landing
//! chunk `k` before posting the receive of chunk `k + 1` would serialise every receive behind
//! the previous scatter. [`chunk_steps`] lets receives run ahead of their landings by up to
//! `slots - 1` chunks, and never reuses a slot before the landing that reads it is queued.

use std::collections::VecDeque;

use crate::backend_rules::check_slot_capacity;
use crate::error::{DisaggError, DisaggResult};
use crate::p2p_header::{encode_headers, MessageKind};
use crate::tags::p2p_wire_tag;

/// One step of a chunked transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkStep {
    /// Claim the next slot, pack (a send) and post chunk `k`'s message.
    Post(usize),
    /// Wait for chunk `k`'s receive and scatter it out of its slot.
    Land(usize),
}

impl ChunkStep {
    /// The step as one signed number: `k` posts chunk `k`, `-(k + 1)` lands it.
    #[must_use]
    pub fn signed(self) -> i64 {
        // A chunk index is below the number of chunks, which fits an i64.
        let index = |k: usize| i64::try_from(k).unwrap_or(i64::MAX);
        match self {
            ChunkStep::Post(k) => index(k),
            ChunkStep::Land(k) => -index(k) - 1,
        }
    }
}

/// The steps of a transfer whose chunk `k` is a send when `sends[k]` (a receive otherwise),
/// through a pool of `slots` slots used round-robin: every chunk posted once in order, every
/// receive landed once in order after its post, a slot's landing queued before the slot is
/// posted into again, and before any send (a send packs into its slot when posted).
pub fn chunk_steps(sends: &[bool], slots: usize) -> DisaggResult<Vec<ChunkStep>> {
    if slots == 0 {
        return Err(DisaggError::Argument {
            field: "slots".into(),
            detail: "slots=0: a staging pool has at least one slot".into(),
        });
    }
    let mut steps = Vec::with_capacity(2 * sends.len());
    let mut landing = VecDeque::new();
    for (k, &send) in sends.iter().enumerate() {
        while !landing.is_empty() && (send || landing.len() >= slots) {
            steps.extend(landing.pop_front().map(ChunkStep::Land));
        }
        steps.push(ChunkStep::Post(k));
        if !send {
            landing.push_back(k);
        }
    }
    steps.extend(landing.into_iter().map(ChunkStep::Land));
    Ok(steps)
}

/// One peer pair of a chunked transfer, as its schedule needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkPair {
    /// Whether this side sends (else it receives).
    pub send: bool,
    /// Whether the messages say `aborted` (a send that cannot send the blocks' bytes).
    pub filler: bool,
    /// The handoff's tag.
    pub tag: u64,
    /// The sender's incarnation.
    pub incarnation: u64,
    /// Bytes of one block of the pair's largest plane: one slot must hold it.
    pub item_bytes: u64,
    /// Payload bytes of each chunk, in order.
    pub sizes: Vec<u64>,
}

/// What a chunked transfer posts, pair by pair: [`chunk_steps`] of every pair's chunks in
/// turn, signed ([`ChunkStep::signed`]); each pair's headers, one per chunk (sent, or for a
/// receive expected); the tag each pair's messages travel on ([`wire_tag`]).
pub type ChunkSchedule = (Vec<i64>, Vec<Vec<u8>>, Vec<i64>);

/// The schedule of a chunked transfer of `pairs` through `slots` staging slots of
/// `slot_bytes`: refused (`Capacity` on `chunk_bytes`) before anything is posted when a pair's
/// block does not fit a slot; else the steps, headers and wire tags of every pair (messages
/// matched by post order when `match_by_order`). `Argument` on `slots` for an empty pool,
/// `Argument` on `tag` for a tag past `i64`.
pub fn chunk_schedule(
    pairs: &[ChunkPair],
    slot_bytes: u64,
    slots: usize,
    match_by_order: bool,
) -> DisaggResult<ChunkSchedule> {
    check_slot_capacity(&pairs.iter().map(|p| p.item_bytes).collect::<Vec<_>>(), slot_bytes)?;
    let sends: Vec<bool> =
        pairs.iter().flat_map(|p| std::iter::repeat_n(p.send, p.sizes.len())).collect();
    let steps: Vec<i64> = chunk_steps(&sends, slots)?.into_iter().map(ChunkStep::signed).collect();
    let mut headers = Vec::with_capacity(pairs.len());
    let mut wire_tags = Vec::with_capacity(pairs.len());
    for p in pairs {
        headers.push(encode_headers(MessageKind::sent(p.filler), p.tag, p.incarnation, &p.sizes)?);
        wire_tags.push(wire_tag(p.tag, match_by_order)?);
    }
    Ok((steps, headers, wire_tags))
}

/// `tags::p2p_wire_tag` of a handoff's `tag` (`Argument` on `tag` past `i64`).
pub fn wire_tag(tag: u64, match_by_order: bool) -> DisaggResult<i64> {
    let tag = i64::try_from(tag)
        .map_err(|_| DisaggError::argument("tag", format!("tag={tag} is past 2**63")))?;
    Ok(p2p_wire_tag(tag, match_by_order))
}

#[cfg(test)]
mod tests {
    #[test]
    fn steps_sign_posts_and_lands() {
        let signed =
            [super::ChunkStep::Post(0), super::ChunkStep::Land(0), super::ChunkStep::Land(3)]
                .map(super::ChunkStep::signed);
        assert_eq!(signed, [0, -1, -4]);
    }

    use super::*;
    use proptest::prelude::*;

    /// Where each chunk's post and land stand in `steps`.
    fn positions(steps: &[ChunkStep], n: usize) -> (Vec<Option<usize>>, Vec<Option<usize>>) {
        let (mut post, mut land) = (vec![None; n], vec![None; n]);
        for (i, s) in steps.iter().enumerate() {
            let (slot, k) = match *s {
                ChunkStep::Post(k) => (&mut post, k),
                ChunkStep::Land(k) => (&mut land, k),
            };
            assert!(slot[k].is_none(), "step {s:?} twice");
            slot[k] = Some(i);
        }
        (post, land)
    }

    #[test]
    fn a_pool_without_slots_is_refused() {
        assert!(matches!(
            chunk_steps(&[false], 0),
            Err(DisaggError::Argument { field, .. }) if field == "slots"
        ));
    }

    #[test]
    fn one_slot_lands_each_receive_before_the_next_is_posted() {
        use ChunkStep::{Land, Post};
        let steps = chunk_steps(&[false, false, false], 1).unwrap();
        assert_eq!(steps, [Post(0), Land(0), Post(1), Land(1), Post(2), Land(2)]);
    }

    #[test]
    fn two_slots_post_each_receive_before_landing_the_previous_one() {
        use ChunkStep::{Land, Post};
        let steps = chunk_steps(&[false, false, false], 2).unwrap();
        assert_eq!(steps, [Post(0), Post(1), Land(0), Post(2), Land(1), Land(2)]);
    }

    fn pair(send: bool, item_bytes: u64, sizes: &[u64]) -> ChunkPair {
        ChunkPair { send, filler: false, tag: 9, incarnation: 2, item_bytes, sizes: sizes.to_vec() }
    }

    #[test]
    fn a_schedule_orders_every_pair_s_chunks_and_heads_them() {
        let pairs =
            [pair(false, 64, &[256, 128]), ChunkPair { filler: true, ..pair(true, 64, &[256]) }];
        let got = chunk_schedule(&pairs, 256, 2, false).unwrap();
        let want: Vec<i64> = chunk_steps(&[false, false, true], 2)
            .unwrap()
            .into_iter()
            .map(ChunkStep::signed)
            .collect();
        assert_eq!(got.0, want);
        let heads = [
            encode_headers(MessageKind::Data, 9, 2, &[256, 128]).unwrap(),
            encode_headers(MessageKind::Aborted, 9, 2, &[256]).unwrap(),
        ];
        assert_eq!(got.1, heads);
        assert_eq!(got.2, [9, 9]);
        assert_eq!(chunk_schedule(&pairs, 256, 2, true).unwrap().2, [0, 0]);
    }

    #[test]
    fn a_block_past_a_slot_is_refused_before_the_pool_or_the_tag() {
        let big = [pair(false, 64, &[64]), pair(true, 300, &[300])];
        let err = chunk_schedule(&big, 256, 0, false).unwrap_err();
        assert!(
            matches!(&err, DisaggError::Capacity { resource, .. } if resource == "chunk_bytes")
        );
        assert!(err.to_string().contains("300 bytes"), "{err}");
        let empty_pool = chunk_schedule(&big[..1], 256, 0, false).unwrap_err();
        assert!(matches!(empty_pool, DisaggError::Argument { field, .. } if field == "slots"));
        let far = [ChunkPair { tag: u64::MAX, ..pair(false, 64, &[64]) }];
        let tag = chunk_schedule(&far, 256, 1, false).unwrap_err();
        assert!(matches!(tag, DisaggError::Argument { field, .. } if field == "tag"));
    }

    proptest! {
        #[test]
        fn steps_are_complete_ordered_and_never_reuse_a_slot_early(
            sends in proptest::collection::vec(any::<bool>(), 0..40), slots in 1usize..6
        ) {
            let n = sends.len();
            let steps = chunk_steps(&sends, slots).unwrap();
            let (post, land) = positions(&steps, n);
            let posts: Vec<usize> = steps.iter().filter_map(|s| match s {
                ChunkStep::Post(k) => Some(*k), ChunkStep::Land(_) => None }).collect();
            prop_assert_eq!(posts, (0..n).collect::<Vec<_>>());
            let lands: Vec<usize> = steps.iter().filter_map(|s| match s {
                ChunkStep::Land(k) => Some(*k), ChunkStep::Post(_) => None }).collect();
            let receives: Vec<usize> = (0..n).filter(|&k| !sends[k]).collect();
            prop_assert_eq!(lands, receives);
            for k in 0..n {
                prop_assert!(land[k].is_none_or(|l| Some(l) > post[k]));
                // Every earlier receive in k's slot, or any earlier receive before a send, is
                // landed before k is posted.
                for j in (0..k).filter(|&j| !sends[j] && (sends[k] || (k - j) % slots == 0)) {
                    prop_assert!(land[j] < post[k], "chunk {} posted before {} landed", k, j);
                }
            }
        }

        #[test]
        fn receives_run_as_far_ahead_as_the_slots_allow(
            n in 1usize..40, slots in 1usize..6
        ) {
            let steps = chunk_steps(&vec![false; n], slots).unwrap();
            let (post, land) = positions(&steps, n);
            for (k, posted) in post.iter().enumerate() {
                // Receive k is posted before receives k - (slots - 1) .. k - 1 land.
                let ahead = k.saturating_sub(slots - 1)..k;
                prop_assert!(land[ahead].iter().all(|l| posted < l), "receive {} waited", k);
            }
        }
    }
}
