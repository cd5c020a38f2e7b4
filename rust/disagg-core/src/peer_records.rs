//! The reference design's peer-metadata shapes: flat, TP-wrapped (`{"tp_metas": [...]}`) and
//! PP-wrapped (`{"pp_metas": [{"tp_metas": [...], "block_ids": [...]}, ...]}`) metadata
//! flattened into one `(meta, block_ids)` record per source rank, and a cached prefix dropped
//! from every `block_ids` list. The rules walk the caller's own values ([`MetaNode`]) and
//! hand them back as they are.

use crate::error::DisaggError;

/// A metadata value as the caller holds it (the bindings: a Python object).
pub trait MetaNode: Sized + Clone {
    /// The caller's error.
    type Err;
    /// A core error as the caller's.
    fn lift(e: DisaggError) -> Self::Err;
    /// The items of a list (`None`: not a list).
    fn list(&self) -> Option<Vec<Self>>;
    /// Whether the value is a map.
    fn is_map(&self) -> bool;
    /// The value at `key` of a map (`None`: missing, or not a map).
    fn get(&self, key: &str) -> Result<Option<Self>, Self::Err>;
    /// The items of any iterable.
    fn items(&self) -> Result<Vec<Self>, Self::Err>;
    /// The value as a sequence of ints (`None`: it is not one).
    fn ints(&self) -> Option<Vec<i64>>;
    /// The value as shown in an error.
    fn show(&self) -> String;
    /// A copy of this map with `sets` set.
    fn copy_with(&self, sets: Vec<(&str, Self)>) -> Result<Self, Self::Err>;
    /// A list of `items` (made where this value lives).
    fn new_list(&self, items: Vec<Self>) -> Result<Self, Self::Err>;
    /// A list of block ids (made where this value lives).
    fn id_list(&self, ids: &[u32]) -> Result<Self, Self::Err>;
}

/// One record: a peer's metadata and the block ids to move from it.
pub type Record<N> = (N, Vec<u32>);

/// `v` as block ids in `[0, 2**32)`; `BlockIdError` naming `field` otherwise.
pub fn block_ids<N: MetaNode>(v: &N, field: &str) -> Result<Vec<u32>, N::Err> {
    let bad = |detail: String| N::lift(DisaggError::block(field, detail));
    let ids = v
        .ints()
        .ok_or_else(|| bad(format!("{field} must be a sequence of ints, got {}", v.show())))?;
    ids.iter()
        .map(|&b| {
            u32::try_from(b).map_err(|_| bad(format!("{field} holds {b}, not in [0, 2**32)")))
        })
        .collect()
}

/// Append one record per metadata map of `raw` (a map or a list of maps); a map's own
/// `block_ids` override `default_blocks`.
fn append<N: MetaNode>(
    raw: &N,
    default_blocks: &[u32],
    out: &mut Vec<Record<N>>,
) -> Result<(), N::Err> {
    for meta in raw.list().unwrap_or_else(|| vec![raw.clone()]) {
        if !meta.is_map() {
            let e = DisaggError::wire(
                "tp_metas",
                "transfer peer metadata entries must be dictionaries",
            );
            return Err(N::lift(e));
        }
        let blocks = match meta.get("block_ids")? {
            Some(v) => block_ids(&v, "block_ids")?,
            None => default_blocks.to_vec(),
        };
        out.push((meta, blocks));
    }
    Ok(())
}

/// Flat, TP-wrapped or PP-wrapped peer metadata as `(meta, block_ids)` records, one per source
/// rank. A PP entry's own `block_ids` (or its ranks') override `src_block_ids`.
pub fn records<N: MetaNode>(peer_meta: &N, src_block_ids: &N) -> Result<Vec<Record<N>>, N::Err> {
    let mut out = Vec::new();
    if let Some(stages) = peer_meta.get("pp_metas")? {
        for entry in stages.items()? {
            if !entry.is_map() {
                let e = DisaggError::wire("pp_metas", "pp_metas entries must be dictionaries");
                return Err(N::lift(e));
            }
            let blocks = match entry.get("block_ids")? {
                Some(v) => block_ids(&v, "block_ids")?,
                None => Vec::new(),
            };
            append(&entry.get("tp_metas")?.unwrap_or_else(|| entry.clone()), &blocks, &mut out)?;
        }
        return Ok(out);
    }
    let blocks = block_ids(src_block_ids, "src_block_ids")?;
    append(&peer_meta.get("tp_metas")?.unwrap_or_else(|| peer_meta.clone()), &blocks, &mut out)?;
    Ok(out)
}

/// A copy of `value` with the first `prefix` ids of every `block_ids` list removed, through
/// `pp_metas` and `tp_metas`.
fn trim<N: MetaNode>(value: &N, prefix: usize) -> Result<N, N::Err> {
    if let Some(items) = value.list() {
        return value.new_list(items.iter().map(|v| trim(v, prefix)).collect::<Result<_, _>>()?);
    }
    if !value.is_map() {
        return Ok(value.clone());
    }
    let mut sets = Vec::new();
    if let Some(v) = value.get("block_ids")? {
        let ids = block_ids(&v, "block_ids")?;
        let rest = ids.get(prefix..).ok_or_else(|| {
            let n = ids.len();
            N::lift(DisaggError::block(
                "block_ids",
                format!("cannot remove {prefix} blocks from a {n}-block peer"),
            ))
        })?;
        sets.push(("block_ids", value.id_list(rest)?));
    }
    for key in ["pp_metas", "tp_metas"] {
        if let Some(v) = value.get(key)? {
            sets.push((key, trim(&v, prefix)?));
        }
    }
    value.copy_with(sets)
}

/// The block count of a transfer: that of the first of [`records`] (0 when there is none).
pub fn block_count<N: MetaNode>(peer_meta: &N, src_block_ids: &N) -> Result<usize, N::Err> {
    Ok(records(peer_meta, src_block_ids)?.first().map_or(0, |(_, b)| b.len()))
}

/// Peer metadata and `src_block_ids` without a cached prefix of `prefix_count` blocks (the
/// decode reuses its cached prefix and pulls only the suffix). Fails before returning anything
/// when a `block_ids` list is shorter than the prefix; the inputs are never modified.
pub fn drop_prefix<N: MetaNode>(
    peer_meta: &N,
    src_block_ids: &N,
    prefix_count: i64,
) -> Result<(N, Vec<u32>), N::Err> {
    let prefix = usize::try_from(prefix_count).map_err(|_| {
        let detail = format!("prefix_count={prefix_count} must be non-negative");
        N::lift(DisaggError::argument("prefix_count", detail))
    })?;
    let ids = block_ids(src_block_ids, "src_block_ids")?;
    if prefix == 0 {
        return Ok((peer_meta.clone(), ids));
    }
    // PP-wrapped metadata carries its block ids per stage; `src_block_ids` may then be shorter
    // than the prefix (even empty), and its suffix is simply what remains.
    let rest = ids.get(prefix..).unwrap_or_default().to_vec();
    Ok((trim(peer_meta, prefix)?, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A metadata value: a map, a list, ints or text.
    #[derive(Debug, Clone, PartialEq)]
    enum V {
        Map(Vec<(String, V)>),
        List(Vec<V>),
        Int(i64),
        Text(&'static str),
    }

    impl MetaNode for V {
        type Err = DisaggError;
        fn lift(e: DisaggError) -> DisaggError {
            e
        }
        fn list(&self) -> Option<Vec<V>> {
            match self {
                V::List(v) => Some(v.clone()),
                _ => None,
            }
        }
        fn is_map(&self) -> bool {
            matches!(self, V::Map(_))
        }
        fn get(&self, key: &str) -> Result<Option<V>, DisaggError> {
            let V::Map(e) = self else { return Ok(None) };
            Ok(e.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone()))
        }
        fn items(&self) -> Result<Vec<V>, DisaggError> {
            Ok(self.list().unwrap_or_default())
        }
        fn ints(&self) -> Option<Vec<i64>> {
            let items = self.list()?;
            items.iter().map(|v| if let V::Int(i) = v { Some(*i) } else { None }).collect()
        }
        fn show(&self) -> String {
            format!("{self:?}")
        }
        fn copy_with(&self, sets: Vec<(&str, V)>) -> Result<V, DisaggError> {
            let V::Map(mut e) = self.clone() else { return Ok(self.clone()) };
            for (k, v) in sets {
                match e.iter_mut().find(|(key, _)| key == k) {
                    Some(slot) => slot.1 = v,
                    None => e.push((k.to_owned(), v)),
                }
            }
            Ok(V::Map(e))
        }
        fn new_list(&self, items: Vec<V>) -> Result<V, DisaggError> {
            Ok(V::List(items))
        }
        fn id_list(&self, ids: &[u32]) -> Result<V, DisaggError> {
            Ok(ids_of(&ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>()))
        }
    }

    fn ids_of(ids: &[i64]) -> V {
        V::List(ids.iter().map(|&i| V::Int(i)).collect())
    }
    fn map(entries: Vec<(&str, V)>) -> V {
        V::Map(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }

    #[test]
    fn flat_tp_and_pp_metadata_give_one_record_per_source_rank() {
        let a = map(vec![("agent", V::Text("a"))]);
        let b = map(vec![("agent", V::Text("b")), ("block_ids", ids_of(&[7, 8]))]);
        assert_eq!(records(&a, &ids_of(&[1, 2])).unwrap(), vec![(a.clone(), vec![1, 2])]);
        let tp = map(vec![("tp_metas", V::List(vec![a.clone(), b.clone()]))]);
        let got = records(&tp, &ids_of(&[3, 4])).unwrap();
        assert_eq!(got, vec![(a.clone(), vec![3, 4]), (b.clone(), vec![7, 8])]);
        let stage = map(vec![("tp_metas", V::List(vec![a.clone()])), ("block_ids", ids_of(&[5]))]);
        let pp = map(vec![("pp_metas", V::List(vec![stage, b.clone()]))]);
        let got = records(&pp, &ids_of(&[9])).unwrap();
        assert_eq!(got, vec![(a.clone(), vec![5]), (b, vec![7, 8])]);
        let e = records(
            &map(vec![("tp_metas", V::List(vec![a.clone(), V::Text("b")]))]),
            &ids_of(&[1]),
        );
        assert_eq!(e.unwrap_err().kind(), "Wire");
        let e = records(&a, &ids_of(&[0, -1])).unwrap_err();
        assert!(e.to_string().contains("src_block_ids holds -1"), "{e}");
        assert!(records(&a, &V::Text("x")).unwrap_err().to_string().contains("sequence of ints"));
    }

    #[test]
    fn a_transfer_counts_the_blocks_of_its_first_record() {
        let a = map(vec![("agent", V::Text("a")), ("block_ids", ids_of(&[7, 8, 9]))]);
        let b = map(vec![("agent", V::Text("b"))]);
        let tp = map(vec![("tp_metas", V::List(vec![b.clone(), a.clone()]))]);
        assert_eq!(block_count(&tp, &ids_of(&[1])).unwrap(), 1);
        let tp = map(vec![("tp_metas", V::List(vec![a, b]))]);
        assert_eq!(block_count(&tp, &ids_of(&[1])).unwrap(), 3);
        assert_eq!(
            block_count(&map(vec![("tp_metas", V::List(vec![]))]), &ids_of(&[1])).unwrap(),
            0
        );
    }

    #[test]
    fn a_prefix_is_dropped_from_every_block_list_or_refused_whole() {
        let rank = |ids: &[i64]| map(vec![("agent", V::Text("a")), ("block_ids", ids_of(ids))]);
        let meta = map(vec![("tp_metas", V::List(vec![rank(&[1, 2, 3]), rank(&[4, 5, 6])]))]);
        let (trimmed, src) = drop_prefix(&meta, &ids_of(&[7, 8, 9]), 2).unwrap();
        assert_eq!(src, vec![9]);
        assert_eq!(trimmed, map(vec![("tp_metas", V::List(vec![rank(&[3]), rank(&[6])]))]));
        let (same, src) = drop_prefix(&meta, &ids_of(&[7, 8]), 0).unwrap();
        assert_eq!((same, src), (meta.clone(), vec![7, 8]));
        let e = drop_prefix(&meta, &ids_of(&[7, 8, 9, 10]), 4).unwrap_err();
        assert!(e.to_string().contains("cannot remove 4 blocks from a 3-block peer"), "{e}");
        assert_eq!(drop_prefix(&meta, &ids_of(&[]), -1).unwrap_err().kind(), "Argument");
    }

    #[test]
    fn a_reference_ticket_check_counts_the_source_blocks_of_its_metadata_first() {
        use crate::reference::{check_reference, check_ticket_blocks};
        use crate::wire::value::WireValue;
        let facts = |blocks: Option<i128>| {
            let b = WireValue::Bool;
            let mut e = vec![
                ("prefix_caching", b(true)),
                ("hybrid", b(false)),
                ("has_backend", b(true)),
                ("request_id", WireValue::Int(4)),
                ("decode_has_ssm", b(false)),
                ("resume_tokens", WireValue::Int(1)),
                ("num_speculative_tokens", WireValue::Int(0)),
                ("return_log_probs", b(false)),
                ("prompt_tokens", WireValue::Int(9)),
                ("block_size", WireValue::Int(4)),
            ];
            e.extend(blocks.map(|n| ("src_blocks", WireValue::Int(n))));
            WireValue::Map(e.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
        };
        let flat = map(vec![("agent", V::Text("a"))]);
        assert_eq!(check_ticket_blocks(facts(None), &flat, &ids_of(&[1, 2, 3])), Ok(3));
        assert_eq!(check_ticket_blocks(facts(Some(0)), &flat, &ids_of(&[1, 2, 3])), Ok(3));
        let short = check_ticket_blocks(facts(None), &flat, &ids_of(&[1, 2])).unwrap_err();
        assert_eq!(short, check_reference("ticket", &facts(Some(2))).unwrap_err());
        assert_eq!(short.kind(), "HandoffMetadata", "{short}");
        let bad = check_ticket_blocks(facts(None), &flat, &V::Text("x")).unwrap_err();
        assert_eq!(bad, block_count(&flat, &V::Text("x")).unwrap_err(), "the count comes first");
    }
}
