//! The transfer metadata a reference-design engine (its own allocator, no ledger) writes into a
//! prefill's ticket and reads back when it pushes, built in one place from the static metadata
//! its ranks gathered at setup.
//!
//! [`prefill_metas`] turns a batch of finished prefills into one ticket `kv_meta` each: the KV
//! descriptors (per pipeline stage with the request's blocks, or the engine's own descriptor),
//! the first tokens, and, on a hybrid engine, the SSM descriptors pointing at the pinned slot.
//! [`push_metas`] picks a push's destinations out of the decode ranks' metadata. Every refusal
//! names the field.

use crate::error::{DisaggError, DisaggResult};
use crate::reference::ReferenceCheck;
use crate::wire::value::{Obj, WireValue};

/// The SSM state kinds a hybrid engine hands off, in the order it registers them.
pub const SSM_STATE_KINDS: [&str; 2] = ["conv", "recurrent"];

/// `entries` with `key` set to `value` (replaced in place, or appended).
fn with_key(v: &WireValue, key: &str, value: WireValue) -> DisaggResult<WireValue> {
    let WireValue::Map(entries) = v else {
        return Err(DisaggError::handoff_metadata(
            key,
            format!("a descriptor must be a dict to carry {key}, got {}", v.type_name()),
        ));
    };
    let mut out = entries.clone();
    match out.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => out.push((key.to_owned(), value)),
    }
    Ok(WireValue::Map(out))
}

fn ids(blocks: &[u64]) -> WireValue {
    WireValue::List(blocks.iter().map(|&b| WireValue::Int(i128::from(b))).collect())
}

fn map(entries: Vec<(&str, WireValue)>) -> WireValue {
    WireValue::Map(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
}

fn list_of<'a>(v: &'a WireValue, field: &str) -> DisaggResult<&'a [WireValue]> {
    match v {
        WireValue::List(items) => Ok(items),
        other => Err(DisaggError::handoff_metadata(
            field,
            format!("must be a list, got {}", other.type_name()),
        )),
    }
}

/// One stage's descriptor(s) of `kind` with `block_ids` set to the pinned `slot`: one
/// descriptor, or a list with one per TP rank.
fn ssm_stage(stage: &WireValue, kind: &str, slot: i128) -> DisaggResult<WireValue> {
    let missing = || {
        DisaggError::handoff_metadata(
            kind,
            format!("static {kind} SSM handoff metadata is missing"),
        )
    };
    let metas = match stage {
        WireValue::Map(entries) => {
            entries.iter().find(|(k, _)| k == kind).map(|(_, v)| v).ok_or_else(missing)?
        }
        _ => return Err(missing()),
    };
    let ids = WireValue::List(vec![WireValue::Int(slot)]);
    match metas {
        WireValue::Null => Err(missing()),
        WireValue::List(per_rank) => Ok(WireValue::List(
            per_rank
                .iter()
                .map(|m| with_key(m, "block_ids", ids.clone()))
                .collect::<DisaggResult<_>>()?,
        )),
        one => with_key(one, "block_ids", ids),
    }
}

/// The stages' values under one pipeline: wrapped per stage when `pp_size > 1`, else the one
/// stage's value itself.
fn per_pipeline(
    pp_size: u64,
    stages: Vec<WireValue>,
    wrap: impl Fn(WireValue) -> WireValue,
) -> WireValue {
    if pp_size > 1 {
        map(vec![("pp_metas", WireValue::List(stages.into_iter().map(wrap).collect()))])
    } else {
        stages.into_iter().next().unwrap_or(WireValue::Null)
    }
}

/// One request of a prefill batch.
struct Finished<'a> {
    request_id: u64,
    blocks: &'a [u64],
    resume_tokens: &'a WireValue,
}

/// The ticket `kv_meta` of every finished prefill in `facts`, in order, after the whole batch
/// is checked (see [`ReferenceCheck::Prefill`]); `blocks` are the requests' prompt blocks and
/// `slots` (a hybrid engine: per request, the SSM slot cached for its final block) adds the
/// SSM descriptors.
///
/// `facts`: `requests` (rows of `request_id`, `blocks` (their count), `resume_tokens`),
/// `kv_stages` and
/// `ssm_stages` (per pipeline stage, the static metadata gathered at setup; `None` before
/// setup: a `HandoffState` error naming `setup_kv_transfer`), `pp_size`,
/// `num_speculative_tokens`. An empty batch needs nothing and returns nothing.
pub fn prefill_metas(
    facts: &WireValue,
    blocks: &[Vec<u64>],
    slots: Option<&[i64]>,
) -> DisaggResult<Vec<WireValue>> {
    let o = Obj::of(facts, "facts")?;
    let rows = list_of(o.req("requests")?, "requests")?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    ReferenceCheck::parse("prefill", facts)?.check()?;
    let pp_size = o.u64("pp_size")?;
    let kv_stages = list_of(o.req("kv_stages")?, "kv_stages")?;
    if blocks.len() != rows.len() {
        return Err(DisaggError::argument(
            "blocks",
            format!("{} block lists for {} requests", blocks.len(), rows.len()),
        ));
    }
    let finished = rows
        .iter()
        .zip(blocks)
        .map(|(row, ids)| {
            let r = Obj::of(row, "requests")?;
            let (request_id, count) = (r.u64("request_id")?, r.u64("blocks")?);
            if count != ids.len() as u64 {
                return Err(DisaggError::argument(
                    "blocks",
                    format!("request {request_id}: {count} blocks counted but {} given", ids.len()),
                ));
            }
            Ok(Finished { request_id, blocks: ids, resume_tokens: r.req("resume_tokens")? })
        })
        .collect::<DisaggResult<Vec<_>>>()?;
    if let Some(s) = slots.filter(|s| s.len() != finished.len()) {
        return Err(DisaggError::argument(
            "slots",
            format!("{} slots for {} requests", s.len(), finished.len()),
        ));
    }
    finished
        .iter()
        .enumerate()
        .map(|(i, req)| {
            let kv = if pp_size > 1 {
                let stages = kv_stages
                    .iter()
                    .map(|m| map(vec![("tp_metas", m.clone()), ("block_ids", ids(req.blocks))]))
                    .collect();
                map(vec![("pp_metas", WireValue::List(stages))])
            } else {
                match &kv_stages[0] {
                    tp @ WireValue::List(_) => map(vec![("tp_metas", tp.clone())]),
                    shared @ WireValue::Map(_) => shared.clone(),
                    other => {
                        return Err(DisaggError::handoff_metadata(
                            "kv_meta",
                            format!(
                                "static KV metadata must be a dict or a list, got {}",
                                other.type_name()
                            ),
                        ))
                    }
                }
            };
            let kv = with_key(&kv, "resume_tokens", req.resume_tokens.clone())?;
            match slots {
                None => Ok(kv),
                Some(slots) => {
                    let ssm = ssm_meta(&o, pp_size, req.request_id, slots[i], req.blocks)?;
                    with_key(&kv, "ssm", ssm)
                }
            }
        })
        .collect()
}

/// The SSM descriptors of one request: per state kind, each stage's descriptors at `slot`.
fn ssm_meta(
    o: &Obj<'_>,
    pp_size: u64,
    request_id: u64,
    slot: i64,
    blocks: &[u64],
) -> DisaggResult<WireValue> {
    let block = blocks.last().copied().unwrap_or(0);
    ReferenceCheck::SsmSlot { request_id, slot, block }.check()?;
    let stages = list_of(o.req("ssm_stages")?, "ssm_stages")?;
    let kinds = SSM_STATE_KINDS
        .iter()
        .map(|kind| {
            let per_stage = stages
                .iter()
                .map(|st| ssm_stage(st, kind, i128::from(slot)))
                .collect::<DisaggResult<_>>()?;
            Ok((
                (*kind).to_owned(),
                per_pipeline(pp_size, per_stage, |m| map(vec![("tp_metas", m)])),
            ))
        })
        .collect::<DisaggResult<_>>()?;
    Ok(WireValue::Map(kinds))
}

/// A push's destinations: `kv`, the decode ranks' KV descriptors (`tp_metas`), and, when the
/// push carries SSM state (`slot`: the slot cached for the final `block`), `ssm`, per state
/// kind the decode ranks' descriptors of that kind. A decode rank without one is a
/// `HandoffMetadata` error naming the kind; a missing slot a `HandoffState` error.
pub fn push_metas(
    request_id: u64,
    decode_metas: &WireValue,
    slot: Option<i64>,
    block: u64,
) -> DisaggResult<WireValue> {
    let ranks = list_of(decode_metas, "decode_metas")?;
    let kv = map(vec![("tp_metas", decode_metas.clone())]);
    let Some(slot) = slot else {
        return Ok(map(vec![("kv", kv), ("ssm", WireValue::List(Vec::new()))]));
    };
    ReferenceCheck::SsmSlot { request_id, slot, block }.check()?;
    let ssm = SSM_STATE_KINDS
        .iter()
        .map(|kind| {
            let peers = ranks
                .iter()
                .map(|rank| {
                    let entry = match rank {
                        WireValue::Map(e) => e.iter().find(|(k, _)| k == "ssm").map(|(_, v)| v),
                        _ => None,
                    };
                    let of_kind = match entry {
                        Some(WireValue::Map(e)) => {
                            e.iter().find(|(k, _)| k == kind).map(|(_, v)| v)
                        }
                        _ => None,
                    };
                    of_kind.cloned().ok_or_else(|| {
                        DisaggError::handoff_metadata(
                            *kind,
                            format!(
                                "request {request_id}: decode metadata is missing {kind} SSM \
                                 transfer state"
                            ),
                        )
                    })
                })
                .collect::<DisaggResult<Vec<_>>>()?;
            Ok(WireValue::List(vec![
                WireValue::Str((*kind).to_owned()),
                map(vec![("tp_metas", WireValue::List(peers))]),
            ]))
        })
        .collect::<DisaggResult<_>>()?;
    Ok(map(vec![("kv", kv), ("ssm", WireValue::List(ssm))]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn i(v: i128) -> WireValue {
        WireValue::Int(v)
    }
    fn s(v: &str) -> WireValue {
        WireValue::Str(v.to_owned())
    }
    fn ints(v: &[i128]) -> WireValue {
        WireValue::List(v.iter().map(|&x| i(x)).collect())
    }
    fn get<'a>(v: &'a WireValue, key: &str) -> &'a WireValue {
        let WireValue::Map(e) = v else { panic!("{v:?}") };
        &e.iter().find(|(k, _)| k == key).unwrap_or_else(|| panic!("{key} in {v:?}")).1
    }
    fn desc(name: &str) -> WireValue {
        map(vec![("agent_name", s(name)), ("block_ids", ints(&[]))])
    }
    /// A batch over `pp` stages of `tp` ranks each; SSM kinds per stage as one descriptor.
    fn facts(
        pp: usize,
        tp: usize,
        kv_stages: Option<WireValue>,
        rows: Vec<WireValue>,
    ) -> WireValue {
        let stage =
            |p: usize| WireValue::List((0..tp).map(|t| desc(&format!("kv{p}{t}"))).collect());
        let ssm_stage = |p: usize| {
            map(vec![("conv", desc(&format!("conv{p}"))), ("recurrent", desc(&format!("rec{p}")))])
        };
        map(vec![
            ("requests", WireValue::List(rows)),
            (
                "kv_stages",
                kv_stages.unwrap_or_else(|| WireValue::List((0..pp).map(stage).collect())),
            ),
            ("ssm_stages", WireValue::List((0..pp).map(ssm_stage).collect())),
            ("pp_size", i(pp as i128)),
            ("num_speculative_tokens", i(0)),
        ])
    }
    fn row(rid: i128, blocks: &[i128], resume: &[i128]) -> WireValue {
        let n = i(blocks.len() as i128);
        map(vec![("request_id", i(rid)), ("blocks", n), ("resume_tokens", ints(resume))])
    }
    fn field(e: DisaggError) -> String {
        match e {
            DisaggError::HandoffState { field, .. }
            | DisaggError::HandoffMetadata { field, .. }
            | DisaggError::Argument { field, .. } => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn one_stage_tickets_carry_the_ranks_descriptors_and_first_tokens() {
        let f = facts(1, 2, None, vec![row(5, &[3, 4], &[9]), row(6, &[7], &[8])]);
        let metas = prefill_metas(&f, &[vec![3, 4], vec![7]], None).unwrap();
        assert_eq!(metas.len(), 2);
        let tp = get(&metas[0], "tp_metas");
        assert_eq!(tp, &WireValue::List(vec![desc("kv00"), desc("kv01")]));
        assert_eq!(get(&metas[0], "resume_tokens"), &ints(&[9]));
        assert_eq!(get(&metas[1], "resume_tokens"), &ints(&[8]));
        let WireValue::Map(e) = &metas[0] else { panic!() };
        assert!(e.iter().all(|(k, _)| k != "ssm"));
        // The engine's one shared descriptor is copied, first tokens replacing any given.
        let shared =
            WireValue::List(vec![map(vec![("agent", s("a")), ("resume_tokens", ints(&[]))])]);
        let metas =
            prefill_metas(&facts(1, 1, Some(shared), vec![row(5, &[3], &[1])]), &[vec![3]], None)
                .unwrap();
        assert_eq!(metas[0], map(vec![("agent", s("a")), ("resume_tokens", ints(&[1]))]));
    }

    #[test]
    fn pipeline_tickets_name_each_stage_with_the_blocks_and_the_pinned_slot() {
        let f = facts(2, 1, None, vec![row(5, &[3, 4], &[9])]);
        let metas = prefill_metas(&f, &[vec![3, 4]], Some(&[11])).unwrap();
        let WireValue::List(stages) = get(&metas[0], "pp_metas") else { panic!() };
        assert_eq!(stages.len(), 2);
        for (p, st) in stages.iter().enumerate() {
            assert_eq!(get(st, "tp_metas"), &WireValue::List(vec![desc(&format!("kv{p}0"))]));
            assert_eq!(get(st, "block_ids"), &ints(&[3, 4]));
        }
        let ssm = get(&metas[0], "ssm");
        let WireValue::List(conv) = get(get(ssm, "conv"), "pp_metas") else { panic!() };
        assert_eq!(get(get(&conv[1], "tp_metas"), "block_ids"), &ints(&[11]));
        assert_eq!(get(get(&conv[1], "tp_metas"), "agent_name"), &s("conv1"));
    }

    #[test]
    fn a_batch_is_refused_whole_naming_the_field() {
        assert!(prefill_metas(&facts(1, 1, None, vec![]), &[], None).unwrap().is_empty());
        let unset = facts(1, 1, Some(WireValue::Null), vec![row(1, &[1], &[1])]);
        assert_eq!(
            field(prefill_metas(&unset, &[vec![1]], None).unwrap_err()),
            "setup_kv_transfer"
        );
        let two = facts(1, 1, None, vec![row(1, &[1], &[1]), row(2, &[1], &[1, 2])]);
        assert_eq!(
            field(prefill_metas(&two, &[vec![1], vec![1]], None).unwrap_err()),
            "resume_tokens"
        );
        let one = facts(1, 1, None, vec![row(1, &[1], &[1])]);
        assert_eq!(field(prefill_metas(&one, &[vec![1]], Some(&[-1])).unwrap_err()), "ssm_slot");
        assert_eq!(field(prefill_metas(&one, &[vec![1]], Some(&[1, 2])).unwrap_err()), "slots");
        assert_eq!(field(prefill_metas(&one, &[vec![1, 2]], None).unwrap_err()), "blocks");
        assert_eq!(field(prefill_metas(&one, &[], None).unwrap_err()), "blocks");
        let mut no_conv = one.clone();
        if let WireValue::Map(e) = &mut no_conv {
            e[2].1 = WireValue::List(vec![map(vec![("recurrent", desc("r"))])]);
        }
        assert_eq!(field(prefill_metas(&no_conv, &[vec![1]], Some(&[0])).unwrap_err()), "conv");
    }

    #[test]
    fn push_destinations_pick_each_kind_from_every_decode_rank() {
        let rank = |n: i128| {
            map(vec![
                ("kv", i(n)),
                ("ssm", map(vec![("conv", i(10 + n)), ("recurrent", i(20 + n))])),
            ])
        };
        let ranks = WireValue::List(vec![rank(0), rank(1)]);
        let plain = push_metas(3, &ranks, None, 7).unwrap();
        assert_eq!(get(get(&plain, "kv"), "tp_metas"), &ranks);
        assert_eq!(get(&plain, "ssm"), &WireValue::List(vec![]));
        let out = push_metas(3, &ranks, Some(2), 7).unwrap();
        let WireValue::List(kinds) = get(&out, "ssm") else { panic!() };
        let want = |kind: &str, a: i128| {
            WireValue::List(vec![s(kind), map(vec![("tp_metas", ints(&[a, a + 1]))])])
        };
        assert_eq!(kinds, &vec![want("conv", 10), want("recurrent", 20)]);
        assert_eq!(field(push_metas(3, &ranks, Some(-1), 7).unwrap_err()), "ssm_slot");
        let bare = WireValue::List(vec![rank(0), map(vec![("kv", i(1))])]);
        assert_eq!(field(push_metas(3, &bare, Some(2), 7).unwrap_err()), "conv");
    }
}
