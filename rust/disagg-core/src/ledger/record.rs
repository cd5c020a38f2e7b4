//! A [`LedgerAction`] as one flat record: the shape the Python bindings hand out.

use std::fmt;

use super::{FailReason, LedgerAction, ReleaseCause, StartImport};

/// One action of a ledger tagged by `kind`: `start`, `admit`, `complete`, `fail` or
/// `release`; the fields a kind does not use are empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActionRecord {
    /// `start`, `admit`, `complete`, `fail` or `release`.
    pub kind: &'static str,
    /// The request.
    pub request_id: u64,
    /// The attempt (or pin) epoch.
    pub epoch: u64,
    /// A failure's reason or a release's cause, by name.
    pub reason: Option<&'static str>,
    /// Whether a failed attempt's destinations went to quarantine.
    pub quarantined: bool,
    /// `start`: the first prompt token transferred.
    pub token_start: u32,
    /// `start`: source blocks to read.
    pub src_block_ids: Vec<u32>,
    /// `start`: local blocks that receive them.
    pub dst_block_ids: Vec<u32>,
    /// `start`: cached prefix blocks reused.
    pub cached_block_ids: Vec<u32>,
    /// `start`: blocks reserved for the resume tokens and lookahead.
    pub continuation_block_ids: Vec<u32>,
    /// `admit`: every block of the request in token order.
    pub block_ids: Vec<u32>,
    /// `start` and `admit`: the SSM slot.
    pub ssm_slot: Option<u32>,
}

impl ActionRecord {
    fn empty(kind: &'static str, request_id: u64, epoch: u64) -> Self {
        Self { kind, request_id, epoch, ..Self::default() }
    }
}

impl From<LedgerAction> for ActionRecord {
    fn from(a: LedgerAction) -> Self {
        match a {
            LedgerAction::StartImport(s) => {
                let StartImport { request_id, epoch, token_start, ssm_slot, .. } = s;
                Self {
                    token_start,
                    src_block_ids: s.src_block_ids,
                    dst_block_ids: s.dst_block_ids,
                    cached_block_ids: s.cached_block_ids,
                    continuation_block_ids: s.continuation_block_ids,
                    ssm_slot,
                    ..Self::empty("start", request_id, epoch)
                }
            }
            LedgerAction::Admit { request_id, epoch, block_ids, ssm_slot } => {
                Self { block_ids, ssm_slot, ..Self::empty("admit", request_id, epoch) }
            }
            LedgerAction::CompleteWithoutForward { request_id, epoch } => {
                Self::empty("complete", request_id, epoch)
            }
            LedgerAction::Fail { request_id, epoch, reason, quarantined } => Self {
                reason: Some(FailReason::name(reason)),
                quarantined,
                ..Self::empty("fail", request_id, epoch)
            },
            LedgerAction::Released { request_id, epoch, cause } => Self {
                reason: Some(ReleaseCause::name(cause)),
                ..Self::empty("release", request_id, epoch)
            },
        }
    }
}

/// `x` as Python prints it (`None` for none).
struct PyOpt<T>(Option<T>);

impl<T: fmt::Display> fmt::Display for PyOpt<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(x) => write!(f, "{x}"),
            None => write!(f, "None"),
        }
    }
}

/// The Python repr: `LedgerAction(admit, request_id=1, epoch=2, block_ids=[3], ssm_slot=None)`.
impl fmt::Display for ActionRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (rid, epoch) = (self.request_id, self.epoch);
        write!(f, "LedgerAction({}, request_id={rid}, epoch={epoch}, ", self.kind)?;
        match self.kind {
            "start" => write!(
                f,
                "token_start={}, src={:?}, dst={:?}, cached={:?}, continuation={:?}, ssm_slot={})",
                self.token_start,
                self.src_block_ids,
                self.dst_block_ids,
                self.cached_block_ids,
                self.continuation_block_ids,
                PyOpt(self.ssm_slot)
            ),
            "admit" => {
                write!(f, "block_ids={:?}, ssm_slot={})", self.block_ids, PyOpt(self.ssm_slot))
            }
            _ => {
                let reason = PyOpt(self.reason.map(|r| format!("'{r}'")));
                let quarantined = if self.quarantined { "True" } else { "False" };
                write!(f, "reason={reason}, quarantined={quarantined})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_flattened_and_shown_as_python_prints_it() {
        let start = LedgerAction::StartImport(StartImport {
            request_id: 1,
            epoch: 2,
            token_start: 16,
            src_block_ids: vec![3],
            dst_block_ids: vec![4],
            cached_block_ids: vec![5],
            continuation_block_ids: vec![],
            ssm_slot: Some(7),
        });
        let r = ActionRecord::from(start);
        assert_eq!(
            (r.kind, r.token_start, r.ssm_slot, r.block_ids.len()),
            ("start", 16, Some(7), 0)
        );
        assert_eq!(
            r.to_string(),
            "LedgerAction(start, request_id=1, epoch=2, token_start=16, src=[3], dst=[4], \
             cached=[5], continuation=[], ssm_slot=7)"
        );
        let admit =
            LedgerAction::Admit { request_id: 1, epoch: 2, block_ids: vec![9], ssm_slot: None };
        assert_eq!(
            ActionRecord::from(admit).to_string(),
            "LedgerAction(admit, request_id=1, epoch=2, block_ids=[9], ssm_slot=None)"
        );
        let fail = LedgerAction::Fail {
            request_id: 1,
            epoch: 2,
            reason: FailReason::Deadline,
            quarantined: true,
        };
        assert_eq!(
            ActionRecord::from(fail).to_string(),
            "LedgerAction(fail, request_id=1, epoch=2, reason='deadline', quarantined=True)"
        );
        let done =
            ActionRecord::from(LedgerAction::CompleteWithoutForward { request_id: 1, epoch: 2 });
        assert_eq!((done.kind, done.reason), ("complete", None));
        assert!(done.to_string().ends_with("reason=None, quarantined=False)"));
        let released =
            LedgerAction::Released { request_id: 1, epoch: 2, cause: ReleaseCause::Horizon };
        assert_eq!(ActionRecord::from(released).reason, Some("horizon"));
    }
}
