//! The model-parallel coordinator's book of terminal transfer reports for the handoffs of an
//! engine without a ledger: every rank reports each request once, the [`CompletionQuorum`]
//! decides (all ok, or the first failure), decisions queue until drained, and a request decided
//! as failed absorbs any later report (its attempt is closed).

use std::collections::BTreeSet;

use crate::error::DisaggResult;
use crate::ledger::{CompletionQuorum, QuorumDecision, RankOutcome};

/// One attempt per request: the tracker has no epochs.
const EPOCH: u64 = 0;

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct CompletionTracker {
    quorum: CompletionQuorum,
    open: BTreeSet<u64>,
    decided: Vec<(u64, bool)>,
    failed: BTreeSet<u64>,
}

impl CompletionTracker {
    /// A tracker over `world_size` ranks (`Argument` error for zero).
    pub fn new(world_size: u32) -> DisaggResult<Self> {
        Ok(Self {
            quorum: CompletionQuorum::new(world_size)?,
            open: BTreeSet::new(),
            decided: Vec::new(),
            failed: BTreeSet::new(),
        })
    }

    /// Ranks that report.
    pub fn world_size(&self) -> u32 {
        self.quorum.world_size()
    }

    /// Record `rank`'s report for `request_id`. A rank contradicting its own report is a
    /// `State` error that changes nothing; a report for a request decided as failed is absorbed.
    pub fn record(&mut self, request_id: u64, rank: u32, failed: bool) -> DisaggResult<()> {
        if self.failed.contains(&request_id) {
            return Ok(());
        }
        let outcome = if failed { RankOutcome::Error } else { RankOutcome::Ok };
        match self.quorum.report((request_id, EPOCH), rank, outcome)? {
            None => {
                self.open.insert(request_id);
            }
            Some(decision) => {
                self.open.remove(&request_id);
                self.quorum.forget((request_id, EPOCH));
                let failure = matches!(decision, QuorumDecision::Failure { .. });
                if failure {
                    self.failed.insert(request_id);
                }
                self.decided.push((request_id, failure));
            }
        }
        Ok(())
    }

    /// Decisions since the last drain, `(request_id, failed)` in decision order.
    pub fn drain(&mut self) -> Vec<(u64, bool)> {
        std::mem::take(&mut self.decided)
    }

    /// Requests with reports and no decision yet, ascending.
    pub fn open_ids(&self) -> Vec<u64> {
        self.open.iter().copied().collect()
    }

    /// Attempts the quorum holds votes for.
    pub fn num_open(&self) -> usize {
        self.quorum.num_open()
    }

    /// Drop everything known about a request that ended (its id may be reused).
    pub fn forget(&mut self, request_id: u64) {
        self.quorum.forget((request_id, EPOCH));
        self.open.remove(&request_id);
        self.failed.remove(&request_id);
    }

    /// Drop every open report and undrained decision (engine reset); requests decided as
    /// failed stay closed.
    pub fn reset(&mut self) {
        self.quorum.clear();
        self.open.clear();
        self.decided.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::error::DisaggError;

    /// Oracle: all-ok or first-failure per request, failures absorbing later reports, a
    /// decided success forgotten (a new report opens a new round).
    #[derive(Default)]
    struct Model {
        seen: BTreeMap<(u64, u32), bool>,
        failed: BTreeSet<u64>,
        decided: Vec<(u64, bool)>,
    }

    proptest! {
        #[test]
        fn the_tracker_decides_like_an_all_ok_or_first_failure_model(
            world in 1u32..4,
            ops in proptest::collection::vec((0u64..4, 0u32..4, any::<bool>(), 0u8..10), 0..40),
        ) {
            let mut t = CompletionTracker::new(world).unwrap();
            let mut m = Model::default();
            let mut drained = Vec::new();
            for (rid, rank, failed, op) in ops {
                let rank = rank % world;
                match op {
                    0 => {
                        t.forget(rid);
                        m.failed.remove(&rid);
                        m.seen.retain(|(r, _), _| *r != rid);
                    }
                    1 => {
                        drained.extend(t.drain());
                    }
                    _ => {
                        let r = t.record(rid, rank, failed);
                        if m.failed.contains(&rid) {
                            prop_assert!(r.is_ok());
                            continue;
                        }
                        match m.seen.get(&(rid, rank)) {
                            Some(&prev) if prev != failed => {
                                let conflict = matches!(r, Err(DisaggError::State { .. }));
                                prop_assert!(conflict);
                                continue;
                            }
                            _ => prop_assert!(r.is_ok()),
                        }
                        m.seen.insert((rid, rank), failed);
                        if failed {
                            m.failed.insert(rid);
                            m.decided.push((rid, true));
                            m.seen.retain(|(r, _), _| *r != rid);
                        } else if (0..world).all(|k| m.seen.get(&(rid, k)) == Some(&false)) {
                            m.decided.push((rid, false));
                            m.seen.retain(|(r, _), _| *r != rid);
                        }
                    }
                }
                let open: Vec<u64> = m.seen.keys().map(|(r, _)| *r).collect::<BTreeSet<_>>().into_iter().collect();
                prop_assert_eq!(t.open_ids(), open);
            }
            drained.extend(t.drain());
            prop_assert_eq!(drained, m.decided);
            prop_assert!(t.drain().is_empty());
        }
    }

    #[test]
    fn a_reset_keeps_failed_requests_closed() {
        let mut t = CompletionTracker::new(2).unwrap();
        t.record(1, 0, true).unwrap();
        t.record(2, 0, false).unwrap();
        assert_eq!((t.open_ids(), t.num_open()), (vec![2], 1));
        t.reset();
        assert!(t.drain().is_empty() && t.open_ids().is_empty());
        t.record(1, 1, false).unwrap();
        assert!(t.open_ids().is_empty());
        assert!(matches!(CompletionTracker::new(0), Err(DisaggError::Argument { .. })));
    }
}
