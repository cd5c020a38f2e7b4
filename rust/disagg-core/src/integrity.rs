//! The integrity digest table a handoff ticket carries (its `"integrity"` key), checked
//! against the tables the receiving model needs before any entry is read.
//!
//! Wire form: `{name: {"shape": [...], "data": bytes}, "chunk_tokens": int?}`, the data being
//! little-endian `u64` entries in row-major order of `shape`.

use crate::error::{DisaggError, DisaggResult};
use crate::wire::value::WireValue;

/// Bits of a token position in a digest key: `chunk_tokens` must be below `2**TOKEN_BITS`.
pub const TOKEN_BITS: u32 = 26;

fn bad(field: String, detail: String) -> DisaggError {
    DisaggError::wire(field, detail)
}

/// A list of ints as Python prints it (`[2, 3, 3]`); anything else as canonical JSON.
fn shown(v: &WireValue) -> String {
    match v {
        WireValue::List(items) if items.iter().all(|x| matches!(x, WireValue::Int(_))) => {
            let parts: Vec<String> = items
                .iter()
                .filter_map(|x| match x {
                    WireValue::Int(i) => Some(i.to_string()),
                    _ => None,
                })
                .collect();
            format!("[{}]", parts.join(", "))
        }
        other => {
            let mut s = other.canonical_json();
            if s.len() > 60 {
                let mut end = 60;
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                s.truncate(end);
                s.push('…');
            }
            s
        }
    }
}

fn entries(v: &WireValue) -> Option<&[(String, WireValue)]> {
    match v {
        WireValue::Map(e) => Some(e),
        _ => None,
    }
}

fn get<'a>(map: &'a [(String, WireValue)], key: &str) -> Option<&'a WireValue> {
    map.iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// The table's `chunk_tokens`: `None` when absent, `None` or `wire` is not a map; a `Wire`
/// error naming `integrity.chunk_tokens` when it is not an int in `[1, 2**TOKEN_BITS)`.
pub fn chunk_tokens(wire: &WireValue) -> DisaggResult<Option<u32>> {
    let Some(c) = entries(wire).and_then(|m| get(m, "chunk_tokens")) else { return Ok(None) };
    match c {
        WireValue::Null => Ok(None),
        WireValue::Int(n) if (1..1i128 << TOKEN_BITS).contains(n) => Ok(u32::try_from(*n).ok()),
        other => Err(bad(
            "integrity.chunk_tokens".into(),
            format!(
                "ticket integrity.chunk_tokens={} must be an int in [1, 2**{TOKEN_BITS})",
                shown(other)
            ),
        )),
    }
}

/// Check a ticket's table against the `shapes` this model needs (per table name, in order):
/// a map holding, per name, a `shape` equal to the needed one and `data` of exactly
/// `8 * prod(shape)` bytes. Returns its `chunk_tokens`. `Wire` errors name the field
/// (`integrity`, `integrity.<name>`, `integrity.<name>.shape`, `integrity.<name>.data`,
/// `integrity.chunk_tokens`).
pub fn check_table(wire: &WireValue, shapes: &[(String, Vec<u64>)]) -> DisaggResult<Option<u32>> {
    let Some(map) = entries(wire) else {
        return Err(bad(
            "integrity".into(),
            format!("ticket integrity must be a map of tables, got {}", wire.type_name()),
        ));
    };
    for (name, shape) in shapes {
        let Some(entry) = get(map, name).and_then(entries) else {
            return Err(bad(
                format!("integrity.{name}"),
                format!("ticket integrity has no '{name}' table"),
            ));
        };
        let want: Vec<WireValue> = shape.iter().map(|&d| WireValue::Int(i128::from(d))).collect();
        let got = get(entry, "shape").unwrap_or(&WireValue::Null);
        if !matches!(got, WireValue::List(items) if *items == want) {
            return Err(bad(
                format!("integrity.{name}.shape"),
                format!(
                    "ticket integrity.{name}.shape={} but this model needs {}",
                    shown(got),
                    shown(&WireValue::List(want))
                ),
            ));
        }
        let need = shape.iter().try_fold(8u64, |acc, &d| acc.checked_mul(d));
        let data = get(entry, "data");
        let ok =
            matches!((data, need), (Some(WireValue::Bytes(b)), Some(n)) if b.len() as u64 == n);
        if !ok {
            let got = match data {
                Some(WireValue::Bytes(b)) => b.len().to_string(),
                Some(other) => other.type_name().to_owned(),
                None => "None".to_owned(),
            };
            let need = need.map_or_else(|| "more than 2**64".to_owned(), |n| n.to_string());
            return Err(bad(
                format!("integrity.{name}.data"),
                format!("ticket integrity.{name}.data has {got} bytes, expected {need}"),
            ));
        }
    }
    chunk_tokens(wire)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(entries: Vec<(&str, WireValue)>) -> WireValue {
        WireValue::Map(entries.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }
    fn ints(v: &[i128]) -> WireValue {
        WireValue::List(v.iter().map(|&i| WireValue::Int(i)).collect())
    }
    fn table(shape: &[i128], bytes: usize) -> WireValue {
        map(vec![("shape", ints(shape)), ("data", WireValue::Bytes(vec![0; bytes]))])
    }
    fn field(r: DisaggResult<Option<u32>>) -> String {
        match r {
            Err(DisaggError::Wire { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_table_of_the_needed_shapes_and_lengths_passes_with_its_chunk_size() {
        let shapes = vec![("kv".to_owned(), vec![1, 2, 3, 2]), ("conv".to_owned(), vec![4, 5])];
        let ok = map(vec![
            ("kv", table(&[1, 2, 3, 2], 96)),
            ("conv", table(&[4, 5], 160)),
            ("chunk_tokens", WireValue::Int(16)),
        ]);
        assert_eq!(check_table(&ok, &shapes).unwrap(), Some(16));
        // Only the tables the model needs are read; extra ones are ignored.
        assert_eq!(check_table(&ok, &shapes[..1]).unwrap(), Some(16));
        let no_chunk = map(vec![("kv", table(&[1, 2, 3, 2], 96))]);
        assert_eq!(check_table(&no_chunk, &shapes[..1]).unwrap(), None);
    }

    #[test]
    fn each_bad_part_is_named() {
        let shapes = vec![("kv".to_owned(), vec![2, 3])];
        let e = check_table(&WireValue::Bytes(b"junk".to_vec()), &shapes).unwrap_err();
        assert!(e.to_string().contains("got bytes"), "{e}");
        assert_eq!(field(check_table(&map(vec![]), &shapes)), "integrity.kv");
        assert_eq!(field(check_table(&map(vec![("kv", ints(&[1]))]), &shapes)), "integrity.kv");
        let shape = check_table(&map(vec![("kv", table(&[3, 2], 48))]), &shapes);
        let e = shape.unwrap_err();
        assert!(e.to_string().contains("shape=[3, 2] but this model needs [2, 3]"), "{e}");
        let data = check_table(&map(vec![("kv", table(&[2, 3], 8))]), &shapes);
        assert_eq!(field(data), "integrity.kv.data");
        let chunk = map(vec![("kv", table(&[2, 3], 48)), ("chunk_tokens", WireValue::Bool(true))]);
        assert_eq!(field(check_table(&chunk, &shapes)), "integrity.chunk_tokens");
    }

    #[test]
    fn chunk_tokens_are_bounded_by_the_token_bits() {
        let c = |v: WireValue| chunk_tokens(&map(vec![("chunk_tokens", v)]));
        assert_eq!(c(WireValue::Int(1)).unwrap(), Some(1));
        assert_eq!(c(WireValue::Int((1 << TOKEN_BITS) - 1)).unwrap(), Some((1 << TOKEN_BITS) - 1));
        assert_eq!(c(WireValue::Null).unwrap(), None);
        for bad in [WireValue::Int(0), WireValue::Int(1 << TOKEN_BITS), WireValue::Float(2.0)] {
            assert_eq!(field(c(bad)), "integrity.chunk_tokens");
        }
        // Not a map at all: no chunk size (the table check reports the type).
        assert_eq!(chunk_tokens(&WireValue::Int(3)).unwrap(), None);
    }
}
