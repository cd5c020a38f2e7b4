//! A [`LedgerAction`] as one flat record: the shape the Python bindings hand out.

use std::fmt;

use super::{FailReason, LedgerAction, ReleaseCause, StartImport};

/// One action of a ledger tagged by `kind`: `start`, `admit`, `complete`, `fail` or
/// `release`; the fields a kind does not use are empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ActionRecord {
    /// `start`, `admit`, `complete`, `fail` or `release`.
    pub kind: &'static str,
    /// The request and epoch of every kind; the transfers of `start` (empty otherwise); the
    /// SSM slot of `start` and `admit`.
    pub start: StartImport,
    /// A failure's reason or a release's cause, by name.
    pub reason: Option<&'static str>,
    /// Whether a failed attempt's destinations went to quarantine.
    pub quarantined: bool,
    /// `admit`: every block of the request in token order.
    pub block_ids: Vec<u32>,
}

impl ActionRecord {
    fn empty(kind: &'static str, request_id: u64, epoch: u64) -> Self {
        let start = StartImport { request_id, epoch, ..StartImport::default() };
        Self { kind, start, ..Self::default() }
    }
}

impl From<LedgerAction> for ActionRecord {
    fn from(a: LedgerAction) -> Self {
        match a {
            LedgerAction::StartImport(start) => Self { kind: "start", start, ..Self::default() },
            LedgerAction::Admit { request_id, epoch, block_ids, ssm_slot } => {
                let mut r = Self { block_ids, ..Self::empty("admit", request_id, epoch) };
                r.start.ssm_slot = ssm_slot;
                r
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
        let s = &self.start;
        let (rid, epoch) = (s.request_id, s.epoch);
        write!(f, "LedgerAction({}, request_id={rid}, epoch={epoch}, ", self.kind)?;
        match self.kind {
            "start" => write!(
                f,
                "token_start={}, src={:?}, dst={:?}, cached={:?}, continuation={:?}, ssm_slot={})",
                s.token_start,
                s.src_block_ids,
                s.dst_block_ids,
                s.cached_block_ids,
                s.continuation_block_ids,
                PyOpt(s.ssm_slot)
            ),
            "admit" => write!(f, "block_ids={:?}, ssm_slot={})", self.block_ids, PyOpt(s.ssm_slot)),
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
            (r.kind, r.start.token_start, r.start.ssm_slot, r.block_ids.len()),
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
