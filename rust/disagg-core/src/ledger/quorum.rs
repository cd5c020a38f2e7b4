//! Model-parallel agreement on the outcome of one handoff attempt.

use crate::args::{named, Kind};
use crate::error::{DisaggError, DisaggResult};
use crate::pool::IdMap;

/// The terminal report of one rank's local transfer handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RankOutcome {
    /// Every transfer of the rank completed; its destinations hold the data and are quiet.
    Ok,
    /// The rank's transfer failed and its handle settled: nothing can write any more.
    Error,
    /// The rank's transfer passed its deadline; the transport may still write.
    Timeout,
    /// The rank's transfer failed but the transport cannot promise it stopped writing.
    MayStillWrite,
}

impl RankOutcome {
    /// Whether the local destinations are provably quiet after this report.
    pub fn is_quiet(self) -> bool {
        matches!(self, Self::Ok | Self::Error)
    }

    /// Stable lower-case name (`ok`, `error`, `timeout`, `may_still_write`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::MayStillWrite => "may_still_write",
        }
    }

    /// Parse the name given by [`RankOutcome::name`].
    pub fn parse(s: &str) -> DisaggResult<Self> {
        match s {
            "ok" => Ok(Self::Ok),
            "error" => Ok(Self::Error),
            "timeout" => Ok(Self::Timeout),
            "may_still_write" => Ok(Self::MayStillWrite),
            other => Err(DisaggError::argument(
                "outcome",
                format!("outcome={other:?} must be one of ok, error, timeout, may_still_write"),
            )),
        }
    }
}

/// What one poll of a local transfer handle said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleState {
    /// Still moving data.
    Running,
    /// Completed.
    Done,
    /// Passed its deadline: the transport may still write.
    TimedOut,
    /// Failed and settled.
    Failed,
}

impl HandleState {
    /// Parse `running`, `done`, `timeout` or `error`.
    pub fn parse(s: &str) -> DisaggResult<Self> {
        match s {
            "running" => Ok(Self::Running),
            "done" => Ok(Self::Done),
            "timeout" => Ok(Self::TimedOut),
            "error" => Ok(Self::Failed),
            other => Err(DisaggError::argument(
                "handle_states",
                format!("handle state {other:?} must be one of running, done, timeout, error"),
            )),
        }
    }
}

impl RankOutcome {
    /// This rank's terminal outcome of one import from its handles' states, or `None` while a
    /// handle still runs (a start that threw after posting part of the import is an error only
    /// once the parts already posted are terminal: until then they may write). A timed-out
    /// handle makes it `MayStillWrite`; otherwise a failed start (`failed_locally`) or a
    /// failed handle makes it `Error`.
    pub fn fold_local(failed_locally: bool, handles: &[HandleState]) -> Option<Self> {
        if handles.contains(&HandleState::Running) {
            None
        } else if handles.contains(&HandleState::TimedOut) {
            Some(Self::MayStillWrite)
        } else if failed_locally || handles.contains(&HandleState::Failed) {
            Some(Self::Error)
        } else {
            Some(Self::Ok)
        }
    }
}

/// What the quorum decided for one attempt; each attempt gets at most one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuorumDecision {
    /// All ranks reported ok.
    Success,
    /// The first non-ok report, from `rank`; later failures add no second decision.
    Failure {
        /// The first rank that reported a failure.
        rank: u32,
        /// What it reported.
        outcome: RankOutcome,
    },
}

#[derive(Debug, Clone)]
struct Votes {
    reports: Vec<Option<RankOutcome>>,
    decided: bool,
}

/// Collects per-rank terminal reports of handoff attempts keyed by `(request_id, epoch)` and
/// decides once: success when all `world_size` ranks are ok, failure at the first non-ok report.
/// A rank repeating its report is ignored and counted; a rank contradicting itself is an error
/// and changes nothing.
#[derive(Debug, Clone)]
pub struct CompletionQuorum {
    world_size: u32,
    votes: IdMap<(u64, u64), Votes>,
    ignored: u64,
}

impl CompletionQuorum {
    /// A quorum over `world_size` model-parallel ranks.
    pub fn new(world_size: u32) -> DisaggResult<Self> {
        Kind::Argument.at_least_one(&named!(world_size))?;
        Ok(Self { world_size, votes: IdMap::default(), ignored: 0 })
    }

    /// Number of model-parallel ranks.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// Duplicate reports ignored so far.
    pub fn ignored(&self) -> u64 {
        self.ignored
    }

    /// Attempts with at least one report that were not forgotten yet.
    pub fn num_open(&self) -> usize {
        self.votes.len()
    }

    /// `rank` is one of the `world_size` ranks, else an `Argument` error naming it.
    pub fn check_rank(&self, rank: u32) -> DisaggResult<()> {
        if rank >= self.world_size {
            return Err(DisaggError::argument(
                "rank",
                format!("rank={rank} must be < world_size={}", self.world_size),
            ));
        }
        Ok(())
    }

    /// Record `rank`'s report for the attempt `(request_id, epoch)`; returns the decision if
    /// this report makes it.
    pub fn report(
        &mut self,
        attempt: (u64, u64),
        rank: u32,
        outcome: RankOutcome,
    ) -> DisaggResult<Option<QuorumDecision>> {
        self.check_rank(rank)?;
        let (request_id, epoch) = attempt;
        let n = self.world_size as usize;
        let v = self
            .votes
            .entry(attempt)
            .or_insert_with(|| Votes { reports: vec![None; n], decided: false });
        match v.reports[rank as usize] {
            Some(prev) if prev == outcome => {
                self.ignored += 1;
                return Ok(None);
            }
            Some(prev) => {
                return Err(DisaggError::State {
                    request_id,
                    detail: format!(
                        "epoch {epoch}: rank {rank} reported {} after {}",
                        outcome.name(),
                        prev.name()
                    ),
                });
            }
            None => {}
        }
        v.reports[rank as usize] = Some(outcome);
        if v.decided {
            return Ok(None);
        }
        if outcome != RankOutcome::Ok {
            v.decided = true;
            return Ok(Some(QuorumDecision::Failure { rank, outcome }));
        }
        if v.reports.iter().all(|r| *r == Some(RankOutcome::Ok)) {
            v.decided = true;
            return Ok(Some(QuorumDecision::Success));
        }
        Ok(None)
    }

    /// Whether `rank`'s report for the attempt `(request_id, epoch)` would contradict what it
    /// reported before (without recording it).
    pub fn would_conflict(&self, attempt: (u64, u64), rank: u32, outcome: RankOutcome) -> bool {
        self.votes
            .get(&attempt)
            .and_then(|v| v.reports.get(rank as usize).copied().flatten())
            .is_some_and(|prev| prev != outcome)
    }

    /// Drop the votes of the finished attempt `(request_id, epoch)`.
    pub fn forget(&mut self, attempt: (u64, u64)) {
        self.votes.remove(&attempt);
    }

    /// Drop every open attempt (engine reset).
    pub fn clear(&mut self) {
        self.votes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_needs_every_rank_and_failure_is_decided_once() {
        let mut q = CompletionQuorum::new(3).unwrap();
        assert_eq!(q.report((1, 0), 0, RankOutcome::Ok).unwrap(), None);
        assert_eq!(q.report((1, 0), 1, RankOutcome::Ok).unwrap(), None);
        assert_eq!(q.report((1, 0), 2, RankOutcome::Ok).unwrap(), Some(QuorumDecision::Success));
        let f = q.report((2, 0), 1, RankOutcome::Timeout).unwrap();
        assert_eq!(f, Some(QuorumDecision::Failure { rank: 1, outcome: RankOutcome::Timeout }));
        assert_eq!(q.report((2, 0), 0, RankOutcome::Error).unwrap(), None);
        assert_eq!(q.report((2, 0), 0, RankOutcome::Error).unwrap(), None);
        assert_eq!(q.ignored(), 1);
        assert!(q.report((2, 0), 0, RankOutcome::Ok).is_err());
        assert!(q.report((2, 0), 3, RankOutcome::Ok).is_err());
    }
}
