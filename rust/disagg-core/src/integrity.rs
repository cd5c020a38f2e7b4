//! The integrity digest table a handoff ticket carries (its `"integrity"` key), checked
//! against the tables the receiving model needs before any entry is read.
//!
//! Wire form: `{name: {"shape": [...], "data": bytes}, "chunk_tokens": int?}`, the data being
//! little-endian `u64` entries in row-major order of `shape`.

use crate::error::{DisaggError, DisaggResult};
use crate::wire::value::{Obj, WireValue};

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

/// [`check_table`] against `shapes` when the caller gives them, else only [`chunk_tokens`].
pub fn check_wire(
    wire: &WireValue,
    shapes: Option<&[(String, Vec<u64>)]>,
) -> DisaggResult<Option<u32>> {
    shapes.map_or_else(|| chunk_tokens(wire), |s| check_table(wire, s))
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

/// Bits of a layer number in a digest position key.
pub const LAYER_BITS: u32 = 16;
/// Bits of a unit (head, conv group row) number in a digest position key.
pub const UNIT_BITS: u32 = 16;

/// The spacing of equally spaced, increasing `offsets` (`Some(0)` for one or none): such
/// planes are one strided view, digested in one batch of kernels; `None` otherwise.
pub fn uniform_step(offsets: &[i128]) -> Option<u64> {
    let mut steps = offsets.windows(2).map(|w| w[1] - w[0]);
    let Some(first) = steps.next() else { return Some(0) };
    if first > 0 && steps.all(|s| s == first) {
        u64::try_from(first).ok()
    } else {
        None
    }
}

fn key_range(name: &str, value: i128, bits: u32) -> DisaggResult<()> {
    if value >= 1i128 << bits {
        return Err(DisaggError::argument(
            name,
            format!("integrity digest: {name}={value} does not fit the position key ({bits} bits)"),
        ));
    }
    Ok(())
}

/// How one rank digests one request's KV state (see [`DigestPlan::parse`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvDigestPlan {
    /// Block ids to read (the first ones of the request's list).
    pub blocks: u64,
    /// Tokens per digest chunk.
    pub per_chunk: u64,
    /// Chunks (at least one).
    pub chunks: u64,
    /// Byte spacing of the planes when they are equally spaced, else 0.
    pub step: u64,
    /// Planes digested per batch of kernels.
    pub planes_per_batch: u64,
}

/// How one rank digests one SSM slot's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsmDigestPlan {
    /// Byte spacing of the layers when they are equally spaced (one strided view).
    pub step: Option<u64>,
}

/// A digest plan of either kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DigestPlan {
    /// KV state.
    Kv(KvDigestPlan),
    /// SSM state.
    Ssm(SsmDigestPlan),
}

fn int(o: &Obj<'_>, key: &str) -> DisaggResult<i128> {
    match o.req(key)? {
        WireValue::Int(i) => Ok(*i),
        other => {
            Err(DisaggError::argument(key, format!("must be an int, got {}", other.type_name())))
        }
    }
}

fn ints(o: &Obj<'_>, key: &str) -> DisaggResult<Vec<i128>> {
    let bad = |t: &str| DisaggError::argument(key, format!("must be a list of ints, got {t}"));
    let WireValue::List(items) = o.req(key)? else { return Err(bad("another type")) };
    items
        .iter()
        .map(|x| match x {
            WireValue::Int(i) => Ok(*i),
            other => Err(bad(other.type_name())),
        })
        .collect()
}

impl DigestPlan {
    /// Check a digest request and plan it. `kind` `kv` facts: `num_kv`, `geometry_heads`,
    /// `geometry_layers`, `layout_heads`, `layout_layers` (they must agree), `block_ids` (how
    /// many given), `tokens_per_block`, `num_tokens`, `layer_end`, `head_end` (position key
    /// ranges), `chunk_tokens` (or None), `plane_offsets`, `row_bytes`, `batch_bytes` (cell
    /// bytes per batch of kernels). `kind` `ssm` facts: `slot`, `num_slots`, `layer_end`,
    /// `unit_end`, `layer_offsets`. `Argument` errors name the field.
    pub fn parse(kind: &str, facts: &WireValue) -> DisaggResult<Self> {
        let o = Obj::of(facts, "facts")?;
        match kind {
            "kv" => Self::kv(&o).map(Self::Kv),
            "ssm" => {
                let (slot, num_slots) = (int(&o, "slot")?, int(&o, "num_slots")?);
                if !(0..num_slots).contains(&slot) {
                    return Err(DisaggError::argument(
                        "ssm_slot",
                        format!("integrity digest: ssm slot={slot} outside [0, {num_slots})"),
                    ));
                }
                key_range("layer", int(&o, "layer_end")?, LAYER_BITS)?;
                key_range(o.name("unit_name")?, int(&o, "unit_end")?, UNIT_BITS)?;
                Ok(Self::Ssm(SsmDigestPlan { step: uniform_step(&ints(&o, "layer_offsets")?) }))
            }
            other => Err(DisaggError::argument(
                "kind",
                format!("unknown digest kind {other:?}; known: kv, ssm"),
            )),
        }
    }

    fn kv(o: &Obj<'_>) -> DisaggResult<KvDigestPlan> {
        let num_kv = int(o, "num_kv")?;
        if num_kv != 2 {
            return Err(DisaggError::argument(
                "num_kv",
                format!("integrity digest: num_kv={num_kv} (MLA) is not supported"),
            ));
        }
        let (g_heads, g_layers) = (int(o, "geometry_heads")?, int(o, "geometry_layers")?);
        let (l_heads, l_layers) = (int(o, "layout_heads")?, int(o, "layout_layers")?);
        if g_heads != l_heads || g_layers != l_layers {
            return Err(DisaggError::argument(
                "geometry",
                format!(
                    "integrity digest: geometry holds {g_layers} layers x {g_heads} heads but \
                     the layout {l_layers} x {l_heads}"
                ),
            ));
        }
        let (given, per_block) = (int(o, "block_ids")?, int(o, "tokens_per_block")?.max(1));
        let num_tokens = int(o, "num_tokens")?.max(0);
        let needed = (num_tokens + per_block - 1) / per_block;
        if given < needed {
            return Err(DisaggError::argument(
                "block_ids",
                format!(
                    "integrity digest: {given} block ids cover fewer than num_tokens={num_tokens} \
                     at {per_block} tokens per block"
                ),
            ));
        }
        key_range("layer", int(o, "layer_end")?, LAYER_BITS)?;
        key_range("head", int(o, "head_end")?, UNIT_BITS)?;
        key_range("num_tokens", num_tokens, TOKEN_BITS)?;
        let per_chunk = if o.some("chunk_tokens").is_some() {
            let c = int(o, "chunk_tokens")?;
            if c < 1 {
                return Err(DisaggError::argument(
                    "chunk",
                    format!("integrity digest: chunk_tokens={c} must be >= 1"),
                ));
            }
            c
        } else {
            num_tokens.max(1)
        };
        let chunks = ((num_tokens + per_chunk - 1) / per_chunk).max(1);
        let step = uniform_step(&ints(o, "plane_offsets")?);
        let plane_bytes = (num_tokens * g_heads * int(o, "row_bytes")?).max(1);
        let batch = match step {
            Some(_) => (int(o, "batch_bytes")? / plane_bytes).max(1),
            None => 1,
        };
        let u = |v: i128| u64::try_from(v).unwrap_or(u64::MAX);
        Ok(KvDigestPlan {
            blocks: u(needed),
            per_chunk: u(per_chunk),
            chunks: u(chunks),
            step: step.unwrap_or(0),
            planes_per_batch: u(batch),
        })
    }

    /// The plan as a wire map (`blocks`, `per_chunk`, `chunks`, `step`, `planes_per_batch`
    /// for KV; `step` or None for SSM).
    pub fn to_wire(&self) -> WireValue {
        let i = |v: u64| WireValue::Int(i128::from(v));
        let e = |k: &str, v: WireValue| (k.to_owned(), v);
        WireValue::Map(match self {
            Self::Kv(p) => vec![
                e("blocks", i(p.blocks)),
                e("per_chunk", i(p.per_chunk)),
                e("chunks", i(p.chunks)),
                e("step", i(p.step)),
                e("planes_per_batch", i(p.planes_per_batch)),
            ],
            Self::Ssm(p) => vec![e("step", p.step.map_or(WireValue::Null, i))],
        })
    }
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
    fn without_shapes_only_the_chunk_size_is_read() {
        let shapes = vec![("kv".to_owned(), vec![2, 3])];
        let no_table = map(vec![("chunk_tokens", WireValue::Int(8))]);
        assert_eq!(check_wire(&no_table, None).unwrap(), Some(8));
        assert_eq!(field(check_wire(&no_table, Some(&shapes))), "integrity.kv");
        let ok = map(vec![("kv", table(&[2, 3], 48))]);
        assert_eq!(check_wire(&ok, Some(&shapes)).unwrap(), None);
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

    fn kv_facts(changes: &[(&str, WireValue)]) -> WireValue {
        let mut e: Vec<(&str, WireValue)> = vec![
            ("num_kv", WireValue::Int(2)),
            ("geometry_heads", WireValue::Int(4)),
            ("geometry_layers", WireValue::Int(3)),
            ("layout_heads", WireValue::Int(4)),
            ("layout_layers", WireValue::Int(3)),
            ("block_ids", WireValue::Int(3)),
            ("tokens_per_block", WireValue::Int(4)),
            ("num_tokens", WireValue::Int(10)),
            ("layer_end", WireValue::Int(3)),
            ("head_end", WireValue::Int(4)),
            ("chunk_tokens", WireValue::Null),
            ("plane_offsets", ints(&[0, 100, 200, 300, 400, 500])),
            ("row_bytes", WireValue::Int(8)),
            ("batch_bytes", WireValue::Int(1000)),
        ];
        for (k, v) in changes {
            e.iter_mut().find(|(key, _)| key == k).unwrap().1 = v.clone();
        }
        map(e)
    }
    fn kv_plan(changes: &[(&str, WireValue)]) -> DisaggResult<KvDigestPlan> {
        match DigestPlan::parse("kv", &kv_facts(changes))? {
            DigestPlan::Kv(p) => Ok(p),
            other @ DigestPlan::Ssm(_) => panic!("{other:?}"),
        }
    }
    fn arg_field<T: std::fmt::Debug>(r: DisaggResult<T>) -> String {
        match r {
            Err(DisaggError::Argument { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn uniform_steps_are_found_only_for_equal_increasing_spacing() {
        assert_eq!(uniform_step(&[]), Some(0));
        assert_eq!(uniform_step(&[7]), Some(0));
        assert_eq!(uniform_step(&[0, 64, 128]), Some(64));
        assert_eq!(uniform_step(&[0, 64, 100]), None);
        assert_eq!(uniform_step(&[128, 64, 0]), None);
        assert_eq!(uniform_step(&[5, 5]), None);
    }

    #[test]
    fn a_kv_digest_reads_the_covering_blocks_in_whole_chunks_and_bounded_batches() {
        let p = kv_plan(&[]).unwrap();
        // 10 tokens at 4 per block: 3 blocks; one chunk of all tokens; 10*4*8=320 bytes a plane.
        assert_eq!(
            p,
            KvDigestPlan { blocks: 3, per_chunk: 10, chunks: 1, step: 100, planes_per_batch: 3 }
        );
        let p = kv_plan(&[("chunk_tokens", WireValue::Int(4)), ("block_ids", WireValue::Int(9))])
            .unwrap();
        assert_eq!((p.blocks, p.per_chunk, p.chunks), (3, 4, 3));
        let p = kv_plan(&[("plane_offsets", ints(&[0, 100, 150]))]).unwrap();
        assert_eq!((p.step, p.planes_per_batch), (0, 1));
        let p = kv_plan(&[("num_tokens", WireValue::Int(0))]).unwrap();
        assert_eq!((p.blocks, p.per_chunk, p.chunks), (0, 1, 1));
    }

    #[test]
    fn a_kv_digest_request_names_its_bad_field() {
        for (change, field) in [
            (("num_kv", WireValue::Int(1)), "num_kv"),
            (("layout_heads", WireValue::Int(2)), "geometry"),
            (("geometry_layers", WireValue::Int(2)), "geometry"),
            (("block_ids", WireValue::Int(2)), "block_ids"),
            (("layer_end", WireValue::Int(1 << 16)), "layer"),
            (("head_end", WireValue::Int(1 << 16)), "head"),
            (("chunk_tokens", WireValue::Int(0)), "chunk"),
        ] {
            assert_eq!(arg_field(kv_plan(&[change])), field);
        }
        let tokens =
            [("num_tokens", WireValue::Int(1 << 26)), ("block_ids", WireValue::Int(1 << 25))];
        assert_eq!(arg_field(kv_plan(&tokens)), "num_tokens");
    }

    #[test]
    fn an_ssm_digest_checks_the_slot_and_key_ranges() {
        let facts = |slot: i128, unit_end: i128, offsets: &[i128]| {
            map(vec![
                ("slot", WireValue::Int(slot)),
                ("num_slots", WireValue::Int(4)),
                ("layer_end", WireValue::Int(2)),
                ("unit_name", WireValue::Str("unit".into())),
                ("unit_end", WireValue::Int(unit_end)),
                ("layer_offsets", ints(offsets)),
            ])
        };
        let plan = DigestPlan::parse("ssm", &facts(3, 8, &[0, 64])).unwrap();
        assert_eq!(plan, DigestPlan::Ssm(SsmDigestPlan { step: Some(64) }));
        assert_eq!(plan.to_wire(), map(vec![("step", WireValue::Int(64))]));
        let plan = DigestPlan::parse("ssm", &facts(0, 8, &[64, 0])).unwrap();
        assert_eq!(plan.to_wire(), map(vec![("step", WireValue::Null)]));
        assert_eq!(arg_field(DigestPlan::parse("ssm", &facts(4, 8, &[0]))), "ssm_slot");
        assert_eq!(arg_field(DigestPlan::parse("ssm", &facts(-1, 8, &[0]))), "ssm_slot");
        assert_eq!(arg_field(DigestPlan::parse("ssm", &facts(0, 1 << 16, &[0]))), "unit");
        assert_eq!(arg_field(DigestPlan::parse("mla", &facts(0, 1, &[0]))), "kind");
    }
}
