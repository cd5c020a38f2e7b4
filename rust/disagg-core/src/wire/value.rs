//! A decoded wire value (what msgpack, JSON or a Python dict carries) and the size caps every
//! value obeys, plus the typed field accessors the parsers of [`crate::wire`] share.
//!
//! The bindings convert a foreign object into a [`WireValue`] through a [`Budget`], which
//! refuses anything deeper, longer or larger than the caps before it is copied; the parsers
//! then read typed fields through [`Obj`], whose every error names the full field path.

use std::fmt::Write as _;

use crate::error::{DisaggError, DisaggResult};

/// Deepest nesting of lists and maps a wire value may have.
pub const MAX_DEPTH: usize = 8;
/// Most entries one list or map may have.
pub const MAX_ITEMS: usize = 1 << 16;
/// Most bytes one string may have (NIXL agent metadata, base64, is the largest).
pub const MAX_STR_BYTES: usize = 4 << 20;
/// Most values (scalars, lists and maps together) one wire value may hold.
pub const MAX_NODES: usize = 1 << 18;
/// Most bytes one short text field (a name, a dtype, a hash) may have.
pub const MAX_NAME_BYTES: usize = 256;

/// One decoded value.
#[derive(Debug, Clone, PartialEq)]
pub enum WireValue {
    /// `None` / `nil` / `null`.
    Null,
    /// A boolean (never read as an int).
    Bool(bool),
    /// An integer in `[-2**63, 2**64)`.
    Int(i128),
    /// A float.
    Float(f64),
    /// A text string.
    Str(String),
    /// A byte string (msgpack bin).
    Bytes(Vec<u8>),
    /// A list (or tuple).
    List(Vec<WireValue>),
    /// A map with text keys, in the order given.
    Map(Vec<(String, WireValue)>),
}

impl WireValue {
    /// The type name used in error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::Null => "None",
            Self::Bool(_) => "bool",
            Self::Int(_) => "int",
            Self::Float(_) => "float",
            Self::Str(_) => "str",
            Self::Bytes(_) => "bytes",
            Self::List(_) => "list",
            Self::Map(_) => "dict",
        }
    }

    /// A stable 64-bit content key (FNV-1a over a canonical encoding; map keys sorted), used
    /// to find a value parsed before. Equal values have equal keys; callers compare the values
    /// themselves on a key hit.
    pub fn content_key(&self) -> u64 {
        let mut h = Fnv::new();
        self.feed(&mut h);
        h.finish()
    }

    fn feed(&self, h: &mut Fnv) {
        match self {
            Self::Null => h.write(&[0]),
            Self::Bool(b) => h.write(&[1, u8::from(*b)]),
            Self::Int(i) => {
                h.write(&[2]);
                h.write(&i.to_le_bytes());
            }
            Self::Float(f) => {
                h.write(&[3]);
                h.write(&f.to_bits().to_le_bytes());
            }
            Self::Str(s) => {
                h.write(&[4]);
                h.write(&(s.len() as u64).to_le_bytes());
                h.write(s.as_bytes());
            }
            Self::Bytes(b) => {
                h.write(&[7]);
                h.write(&(b.len() as u64).to_le_bytes());
                h.write(b);
            }
            Self::List(items) => {
                h.write(&[5]);
                h.write(&(items.len() as u64).to_le_bytes());
                for v in items {
                    v.feed(h);
                }
            }
            Self::Map(entries) => {
                h.write(&[6]);
                h.write(&(entries.len() as u64).to_le_bytes());
                let mut sorted: Vec<&(String, WireValue)> = entries.iter().collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                for (k, v) in sorted {
                    h.write(&(k.len() as u64).to_le_bytes());
                    h.write(k.as_bytes());
                    v.feed(h);
                }
            }
        }
    }

    /// The canonical JSON text of this value (map keys sorted, no spaces), as Python's
    /// `json.dumps(v, sort_keys=True, separators=(",", ":"))` writes it for ints, strings,
    /// booleans, `None`, lists and dicts.
    pub fn canonical_json(&self) -> String {
        let mut out = String::new();
        self.write_json(&mut out);
        out
    }

    fn write_json(&self, out: &mut String) {
        match self {
            Self::Null => out.push_str("null"),
            Self::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Self::Int(i) => out.push_str(&i.to_string()),
            Self::Float(f) => {
                let _ = write!(out, "{f:?}");
            }
            Self::Str(s) => write_json_str(s, out),
            Self::Bytes(b) => {
                let _ = write!(out, "\"<{} bytes>\"", b.len());
            }
            Self::List(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.write_json(out);
                }
                out.push(']');
            }
            Self::Map(entries) => {
                let mut sorted: Vec<&(String, WireValue)> = entries.iter().collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                out.push('{');
                for (i, (k, v)) in sorted.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_json_str(k, out);
                    out.push(':');
                    v.write_json(out);
                }
                out.push('}');
            }
        }
    }
}

fn write_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// FNV-1a, 64 bits.
pub(crate) struct Fnv(u64);

impl Fnv {
    pub(crate) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

/// The caps a conversion into a [`WireValue`] obeys: the converter asks before it descends
/// into a container, copies a string or adds a value.
#[derive(Debug, Clone)]
pub struct Budget {
    nodes_left: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Self { nodes_left: MAX_NODES }
    }
}

/// A `Wire` error under `field` saying `why()` when `over`, else `Ok`.
fn refuse_if(over: bool, field: &str, why: impl FnOnce() -> String) -> DisaggResult<()> {
    if over {
        Err(DisaggError::wire(field, why()))
    } else {
        Ok(())
    }
}

impl Budget {
    /// Account for one more value at `depth` (0 for the top level) under `field`.
    pub fn node(&mut self, field: &str, depth: usize) -> DisaggResult<()> {
        refuse_if(depth > MAX_DEPTH, field, || {
            format!("nesting depth {depth} exceeds the cap of {MAX_DEPTH}")
        })?;
        refuse_if(self.nodes_left == 0, field, || {
            format!("the value holds more than {MAX_NODES} items in all")
        })?;
        self.nodes_left -= 1;
        Ok(())
    }

    /// Refuse a list or map of `len` entries under `field` when it exceeds [`MAX_ITEMS`].
    pub fn items(&self, field: &str, len: usize) -> DisaggResult<()> {
        refuse_if(len > MAX_ITEMS, field, || format!("{len} entries exceed the cap of {MAX_ITEMS}"))
    }

    /// Refuse a string of `len` bytes under `field` when it exceeds [`MAX_STR_BYTES`].
    pub fn string(&self, field: &str, len: usize) -> DisaggResult<()> {
        refuse_if(len > MAX_STR_BYTES, field, || {
            format!("a {len}-byte string exceeds the cap of {MAX_STR_BYTES} bytes")
        })
    }

    /// Refuse an integer outside `[-2**63, 2**64)` (the converter passes the decimal text of
    /// one that did not fit `i128`, or its value).
    pub fn int_out_of_range(field: &str, text: &str) -> DisaggError {
        let shown: String = text.chars().take(40).collect();
        DisaggError::wire(field, format!("integer {shown} is outside [-2**63, 2**64)"))
    }
}

/// A map of a wire value being read, with the path of the map for error messages.
#[derive(Debug, Clone, Copy)]
pub struct Obj<'a> {
    entries: &'a [(String, WireValue)],
    path: &'a str,
}

/// `path.key` (or `key` at the top level).
pub fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// `s` cut to at most `max` bytes (on a character boundary) and marked `...` when cut: how
/// error messages quote a value.
pub(crate) fn clipped(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

fn shown(v: &WireValue) -> String {
    clipped(v.canonical_json(), 60)
}

impl<'a> Obj<'a> {
    /// View `v` as a map, or a `Wire` error naming `path`.
    pub fn of(v: &'a WireValue, path: &'a str) -> DisaggResult<Self> {
        match v {
            WireValue::Map(entries) => Ok(Self { entries, path }),
            other => Err(DisaggError::wire(
                if path.is_empty() { "peer_meta" } else { path },
                format!("expected a dict, got a {}", other.type_name()),
            )),
        }
    }

    /// The path of this map.
    pub fn path(&self) -> &'a str {
        self.path
    }

    /// Whether `key` is present (even as `None`).
    pub fn has(&self, key: &str) -> bool {
        self.entries.iter().any(|(k, _)| k == key)
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&'a WireValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The value of `key`, present and not `None`.
    pub fn some(&self, key: &str) -> Option<&'a WireValue> {
        self.get(key).filter(|v| !matches!(v, WireValue::Null))
    }

    /// The value of `key`, or a `Wire` error naming it as missing.
    pub fn req(&self, key: &str) -> DisaggResult<&'a WireValue> {
        self.get(key).ok_or_else(|| {
            DisaggError::wire(join(self.path, key), "missing required field".to_owned())
        })
    }

    fn bad(&self, key: &str, want: &str, v: &WireValue) -> DisaggError {
        DisaggError::wire(
            join(self.path, key),
            format!("must be {want}, got {} {}", v.type_name(), shown(v)),
        )
    }

    /// A non-negative integer of at most `max`.
    pub fn uint(&self, key: &str, max: u64) -> DisaggResult<u64> {
        let v = self.req(key)?;
        as_uint(v, max).ok_or_else(|| self.bad(key, &format!("an int in [0, {max}]"), v))
    }

    /// A `u32` field.
    pub fn u32(&self, key: &str) -> DisaggResult<u32> {
        let v = self.uint(key, u64::from(u32::MAX))?;
        u32::try_from(v).map_err(|_| self.bad(key, "a u32", &WireValue::Int(i128::from(v))))
    }

    /// An optional `u32` field (absent or `None`: `None`).
    pub fn opt_u32(&self, key: &str) -> DisaggResult<Option<u32>> {
        match self.some(key) {
            None => Ok(None),
            Some(_) => self.u32(key).map(Some),
        }
    }

    /// A `u64` field.
    pub fn u64(&self, key: &str) -> DisaggResult<u64> {
        self.uint(key, u64::MAX)
    }

    /// An optional `u64` field.
    pub fn opt_u64(&self, key: &str) -> DisaggResult<Option<u64>> {
        match self.some(key) {
            None => Ok(None),
            Some(_) => self.u64(key).map(Some),
        }
    }

    /// A text field of at most `max` bytes.
    pub fn str_max(&self, key: &str, max: usize) -> DisaggResult<&'a str> {
        let v = self.req(key)?;
        match v {
            WireValue::Str(s) if s.len() <= max => Ok(s),
            WireValue::Str(s) => Err(DisaggError::wire(
                join(self.path, key),
                format!("a {}-byte string exceeds the cap of {max} bytes", s.len()),
            )),
            other => Err(self.bad(key, "a str", other)),
        }
    }

    /// A short text field (a name, a dtype).
    pub fn name(&self, key: &str) -> DisaggResult<&'a str> {
        self.str_max(key, MAX_NAME_BYTES)
    }

    /// An optional short text field.
    pub fn opt_name(&self, key: &str) -> DisaggResult<Option<&'a str>> {
        match self.some(key) {
            None => Ok(None),
            Some(_) => self.name(key).map(Some),
        }
    }

    /// An optional boolean field (absent: false).
    pub fn flag(&self, key: &str) -> DisaggResult<bool> {
        match self.get(key) {
            None => Ok(false),
            Some(WireValue::Bool(b)) => Ok(*b),
            Some(other) => Err(self.bad(key, "a bool", other)),
        }
    }

    /// A map field.
    pub fn obj(&self, key: &str, path: &'a str) -> DisaggResult<Obj<'a>> {
        Obj::of(self.req(key)?, path)
    }

    /// A list of non-negative ints, each at most `max`.
    pub fn uints(&self, key: &str, max: u64) -> DisaggResult<Vec<u64>> {
        let v = self.req(key)?;
        let WireValue::List(items) = v else {
            return Err(self.bad(key, "a list of ints", v));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, x)| {
                as_uint(x, max).ok_or_else(|| {
                    DisaggError::wire(
                        format!("{}[{i}]", join(self.path, key)),
                        format!("must be an int in [0, {max}], got {}", shown(x)),
                    )
                })
            })
            .collect()
    }

    /// Reject keys outside `known`, so a typo never silently becomes a default.
    pub fn only(&self, known: &[&str], what: &str) -> DisaggResult<()> {
        for (k, _) in self.entries {
            if !known.contains(&k.as_str()) {
                return Err(DisaggError::wire(
                    join(self.path, k),
                    format!("unknown field in {what}; known: {known:?}"),
                ));
            }
        }
        Ok(())
    }
}

/// `v` as an int in `[0, max]` (never a bool).
pub fn as_uint(v: &WireValue, max: u64) -> Option<u64> {
    match v {
        WireValue::Int(i) if *i >= 0 && *i <= i128::from(max) => u64::try_from(*i).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quoted_value_is_clipped_on_a_character_boundary() {
        assert_eq!(clipped("abc".into(), 3), "abc");
        assert_eq!(clipped("abcd".into(), 3), "abc...");
        // "é" is two bytes: a cut inside it moves back to before it.
        assert_eq!(clipped("aé".into(), 2), "a...");
    }

    fn map(entries: &[(&str, WireValue)]) -> WireValue {
        WireValue::Map(entries.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect())
    }

    #[test]
    fn content_key_ignores_map_order_and_tells_values_apart() {
        let a = map(&[("x", WireValue::Int(1)), ("y", WireValue::Str("a".into()))]);
        let b = map(&[("y", WireValue::Str("a".into())), ("x", WireValue::Int(1))]);
        let c = map(&[("x", WireValue::Int(2)), ("y", WireValue::Str("a".into()))]);
        assert_eq!(a.content_key(), b.content_key());
        assert_ne!(a.content_key(), c.content_key());
        assert_ne!(WireValue::Bool(true).content_key(), WireValue::Int(1).content_key());
    }

    #[test]
    fn canonical_json_matches_pythons_sorted_compact_dump() {
        let v = map(&[
            ("b", WireValue::List(vec![WireValue::Int(-3), WireValue::Null])),
            ("a", WireValue::Str("é\"q".into())),
            ("c", WireValue::Bool(false)),
        ]);
        assert_eq!(v.canonical_json(), r#"{"a":"\u00e9\"q","b":[-3,null],"c":false}"#);
    }

    #[test]
    fn field_errors_name_the_full_path_and_the_value() {
        let v = map(&[("n", WireValue::Int(-1)), ("s", WireValue::Bool(true))]);
        let o = Obj::of(&v, "buffer").unwrap();
        let e = o.u64("n").unwrap_err();
        assert!(matches!(&e, DisaggError::Wire { field, .. } if field == "buffer.n"), "{e}");
        assert!(e.to_string().contains("-1"), "{e}");
        let e = o.name("s").unwrap_err();
        assert!(matches!(&e, DisaggError::Wire { field, .. } if field == "buffer.s"), "{e}");
        let e = o.u32("missing").unwrap_err();
        assert!(e.to_string().contains("missing required field"), "{e}");
        let e = o.only(&["n"], "buffer").unwrap_err();
        assert!(matches!(&e, DisaggError::Wire { field, .. } if field == "buffer.s"), "{e}");
    }

    #[test]
    fn budget_refuses_deep_long_and_huge_values() {
        let mut b = Budget::default();
        assert!(b.node("x", MAX_DEPTH + 1).is_err());
        assert!(b.items("x", MAX_ITEMS + 1).is_err());
        assert!(b.string("x", MAX_STR_BYTES + 1).is_err());
        let mut b = Budget { nodes_left: 1 };
        assert!(b.node("x", 0).is_ok());
        assert!(b.node("x", 0).is_err());
    }
}
