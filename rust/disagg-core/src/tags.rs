//! Message tags of two-sided transfers (torch.distributed send/recv over NCCL or gloo).
//!
//! Both sides of a two-sided handoff compute the tag of each message from the request id and
//! the kind of state it carries, without talking to each other, so the mapping must be the
//! same on both sides and injective: two requests in flight at once must never share a tag
//! (a receive would match another request's send and land its bytes). Tags are 31-bit
//! non-negative ints (`int32` on the wire of every backend), so `request_id * KINDS + kind`
//! must fit: an id outside `[0, MAX_TWO_SIDED_REQUEST_ID]` is refused with a typed error
//! instead of wrapping onto another request's tag.

use crate::error::{DisaggError, DisaggResult};

/// The state a two-sided message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TagKind {
    /// The paged KV cache.
    Kv = 0,
    /// The SSM convolution state.
    Conv = 1,
    /// The SSM recurrent state.
    Recurrent = 2,
}

/// Tag slots per request (a power of two above the number of kinds).
pub const KINDS: i64 = 4;

/// Largest tag a backend accepts (`i32::MAX`).
pub const MAX_TAG: i64 = i32::MAX as i64;

/// Largest request id a two-sided transport can tag.
pub const MAX_TWO_SIDED_REQUEST_ID: i64 = (MAX_TAG + 1) / KINDS - 1;

impl TagKind {
    /// Every kind.
    pub const ALL: [TagKind; 3] = [TagKind::Kv, TagKind::Conv, TagKind::Recurrent];

    /// The kind called `name` (`"kv"`, `"conv"`, `"recurrent"`).
    pub fn from_name(name: &str) -> DisaggResult<TagKind> {
        match name {
            "kv" => Ok(TagKind::Kv),
            "conv" => Ok(TagKind::Conv),
            "recurrent" => Ok(TagKind::Recurrent),
            other => Err(DisaggError::Argument {
                field: "kind".into(),
                detail: format!("kind={other:?} must be one of \"kv\", \"conv\", \"recurrent\""),
            }),
        }
    }

    /// The name [`Self::from_name`] reads.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            TagKind::Kv => "kv",
            TagKind::Conv => "conv",
            TagKind::Recurrent => "recurrent",
        }
    }
}

/// The tag of `request_id`'s `kind` message: injective over every accepted id and kind.
pub fn two_sided_tag(request_id: i64, kind: TagKind) -> DisaggResult<i64> {
    if !(0..=MAX_TWO_SIDED_REQUEST_ID).contains(&request_id) {
        return Err(DisaggError::Argument {
            field: "request_id".into(),
            detail: format!(
                "request_id={request_id} must be in [0, {MAX_TWO_SIDED_REQUEST_ID}] on a \
                 two-sided transport (its message tags are 31-bit)"
            ),
        });
    }
    Ok(request_id * KINDS + kind as i64)
}

/// [`two_sided_tag`] of the kind called `kind` for a request id read as `Some(i64)`, or
/// `None` for a value that is not a 64-bit int (`repr` shows it in the error).
pub fn two_sided_tag_named(
    request_id: Option<i64>,
    repr: impl FnOnce() -> String,
    kind: &str,
) -> DisaggResult<i64> {
    let kind = TagKind::from_name(kind)?;
    let rid = request_id.unwrap_or(-1);
    match two_sided_tag(rid, kind) {
        Err(_) if rid == -1 => Err(DisaggError::Argument {
            field: "request_id".into(),
            detail: format!(
                "request_id={} must be an int in [0, {MAX_TWO_SIDED_REQUEST_ID}] on a two-sided \
                 transport (its message tags are 31-bit)",
                repr()
            ),
        }),
        r => r,
    }
}

/// [`tag_owner`] with the kind by name.
pub fn tag_owner_named(tag: i64) -> DisaggResult<(i64, &'static str)> {
    tag_owner(tag).map(|(rid, kind)| (rid, kind.name()))
}

/// The request and kind a tag was made from (the inverse of [`two_sided_tag`]).
pub fn tag_owner(tag: i64) -> DisaggResult<(i64, TagKind)> {
    let kind = TagKind::ALL.into_iter().find(|k| *k as i64 == tag.rem_euclid(KINDS));
    match kind {
        Some(kind) if (0..=MAX_TAG).contains(&tag) => Ok((tag / KINDS, kind)),
        _ => Err(DisaggError::Argument {
            field: "tag".into(),
            detail: format!("tag={tag} is not a two-sided handoff tag"),
        }),
    }
}

/// How a two-sided backend on a process group of backend `group_backend` (`"nccl"`,
/// `"gloo"`, ...) matches messages: `(nccl, match_by_order, ordered)`. NCCL ignores tags and
/// matches point-to-point messages by post order per peer pair, so `match_by_order` defaults
/// to on there and off elsewhere (`requested` overrides it: gloo run under NCCL's rule).
/// `ordered`: host-memory transfers (every group but NCCL's) must then run one after the
/// other, in the order they were started, so each side posts in its serving order.
pub fn p2p_matching(group_backend: &str, requested: Option<bool>) -> (bool, bool, bool) {
    let nccl = group_backend == "nccl";
    let by_order = requested.unwrap_or(nccl);
    (nccl, by_order, by_order && !nccl)
}

/// The tag a message of a handoff tagged `tag` travels on: its own, or one tag for every
/// handoff where messages match by post order (the in-band header then names the handoff).
pub fn p2p_wire_tag(tag: i64, match_by_order: bool) -> i64 {
    if match_by_order {
        0
    } else {
        tag
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kind_names_round_trip() {
        for k in super::TagKind::ALL {
            assert_eq!(super::TagKind::from_name(k.name()).unwrap(), k);
        }
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nccl_matches_by_order_by_default_and_gloo_can_be_told_to() {
        assert_eq!(p2p_matching("nccl", None), (true, true, false));
        assert_eq!(p2p_matching("gloo", None), (false, false, false));
        assert_eq!(p2p_matching("gloo", Some(true)), (false, true, true));
        assert_eq!(p2p_matching("nccl", Some(false)), (true, false, false));
        assert_eq!(p2p_wire_tag(44, true), 0);
        assert_eq!(p2p_wire_tag(44, false), 44);
    }
    use std::collections::HashMap;

    #[test]
    fn ids_two_to_the_29_apart_get_different_tags_or_are_refused() {
        let a = two_sided_tag(5, TagKind::Kv).unwrap();
        assert!(two_sided_tag(5 + (1 << 29), TagKind::Kv).is_err());
        let b = two_sided_tag(MAX_TWO_SIDED_REQUEST_ID, TagKind::Recurrent).unwrap();
        assert_ne!(a, b);
        assert!(b <= MAX_TAG);
    }

    #[test]
    fn negative_and_too_large_ids_are_refused_naming_the_field() {
        for rid in [-1, MAX_TWO_SIDED_REQUEST_ID + 1, i64::MAX, i64::MIN] {
            match two_sided_tag(rid, TagKind::Conv) {
                Err(DisaggError::Argument { field, detail }) => {
                    assert_eq!(field, "request_id");
                    assert!(detail.contains(&rid.to_string()));
                }
                other => panic!("{rid}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_request_id_that_is_not_a_64_bit_int_is_refused_showing_what_was_given() {
        assert_eq!(two_sided_tag_named(Some(5), String::new, "conv").unwrap(), 5 * KINDS + 1);
        let e = two_sided_tag_named(None, || "2**70".into(), "kv").unwrap_err();
        assert!(e.to_string().contains("request_id=2**70 must be an int in [0, "), "{e}");
        assert!(two_sided_tag_named(Some(5), String::new, "ssm").is_err());
        assert_eq!(tag_owner_named(5 * KINDS + 2).unwrap(), (5, "recurrent"));
    }

    #[test]
    fn unknown_kind_names_and_foreign_tags_are_refused() {
        assert!(TagKind::from_name("ssm").is_err());
        assert!(tag_owner(-1).is_err());
        assert!(tag_owner(3).is_err());
        assert!(tag_owner(MAX_TAG + 1).is_err());
    }

    proptest! {
        #[test]
        fn tags_are_injective_and_invert_to_their_request(
            ids in proptest::collection::vec(prop_oneof![
                0..=64i64,
                (MAX_TWO_SIDED_REQUEST_ID - 64)..=MAX_TWO_SIDED_REQUEST_ID,
                -(1i64 << 40)..(1i64 << 40),
            ], 1..64)
        ) {
            let mut seen: HashMap<i64, (i64, TagKind)> = HashMap::new();
            for &rid in &ids {
                for kind in TagKind::ALL {
                    match two_sided_tag(rid, kind) {
                        Ok(tag) => {
                            prop_assert!((0..=MAX_TAG).contains(&tag));
                            prop_assert_eq!(tag_owner(tag).unwrap(), (rid, kind));
                            let prev = seen.insert(tag, (rid, kind));
                            prop_assert!(prev.is_none() || prev == Some((rid, kind)));
                        }
                        Err(_) => prop_assert!(!(0..=MAX_TWO_SIDED_REQUEST_ID).contains(&rid)),
                    }
                }
            }
        }
    }
}
