//! A bounded msgpack decoder for frames that come from other processes, and the encoder of
//! the frames this library sends.
//!
//! Every length prefix is checked against the bytes that remain before anything is allocated
//! (an array of `n` elements needs at least `n` more bytes, a map `2 n`), nesting is capped at
//! [`MAX_DEPTH`], strings must be UTF-8, map keys must be scalars (hashable on the Python side),
//! extension types are refused and trailing bytes after the value are an error. So a frame of
//! `b` bytes never makes the decoder allocate much more than `b` bytes' worth of values.

use crate::error::{DisaggError, DisaggResult};

/// Deepest nesting of arrays and maps a frame may carry.
pub const MAX_DEPTH: usize = 32;

/// One decoded msgpack value.
#[derive(Debug, Clone)]
pub enum Value {
    /// `nil`.
    Nil,
    /// `true` / `false`.
    Bool(bool),
    /// A signed integer (every msgpack int that fits `i64`).
    Int(i64),
    /// An unsigned integer above `i64::MAX`.
    UInt(u64),
    /// A float32 or float64 (any value, NaN included: schemas decide).
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// A byte string.
    Bin(Vec<u8>),
    /// An array.
    Array(Vec<Value>),
    /// A non-empty array whose items are all ints that fit `i64`, as the decoder holds token and
    /// block-id lists (8 bytes an item, not a value each); equal to the `Array` of those ints.
    Ints(Vec<i64>),
    /// A map, pairs in frame order (the last of duplicate keys wins where looked up).
    Map(Vec<(Value, Value)>),
}

impl Value {
    /// Short name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Self::Nil => "nil",
            Self::Bool(_) => "bool",
            Self::Int(_) | Self::UInt(_) => "int",
            Self::Float(_) => "float",
            Self::Str(_) => "str",
            Self::Bin(_) => "bytes",
            Self::Array(_) | Self::Ints(_) => "list",
            Self::Map(_) => "map",
        }
    }
}

impl PartialEq for Value {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Nil, Self::Nil) => true,
            (Self::Bool(a), Self::Bool(b)) => a == b,
            (Self::Int(a), Self::Int(b)) => a == b,
            (Self::UInt(a), Self::UInt(b)) => a == b,
            (Self::Float(a), Self::Float(b)) => a == b,
            (Self::Str(a), Self::Str(b)) => a == b,
            (Self::Bin(a), Self::Bin(b)) => a == b,
            (Self::Array(a), Self::Array(b)) => a == b,
            (Self::Ints(a), Self::Ints(b)) => a == b,
            (Self::Ints(ints), Self::Array(items)) | (Self::Array(items), Self::Ints(ints)) => {
                ints.len() == items.len()
                    && ints.iter().zip(items).all(|(i, v)| matches!(v, Self::Int(x) if x == i))
            }
            (Self::Map(a), Self::Map(b)) => a == b,
            _ => false,
        }
    }
}

/// Whether a msgpack type byte starts an int.
fn int_tag(tag: u8) -> bool {
    matches!(tag, 0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xcf | 0xd0..=0xd3)
}

fn uint(v: u64) -> Value {
    i64::try_from(v).map_or(Value::UInt(v), Value::Int)
}

fn frame_err(detail: impl Into<String>) -> DisaggError {
    DisaggError::wire("<frame>", detail)
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    fn take(&mut self, n: usize) -> DisaggResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(frame_err(format!(
                "truncated: {n} bytes needed at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let out = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn be(&mut self, n: usize) -> DisaggResult<u64> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn len(&mut self, n: usize) -> DisaggResult<usize> {
        usize::try_from(self.be(n)?).map_err(|_| frame_err("length does not fit usize"))
    }

    /// `count` items of at least `min_bytes` each must fit in what remains.
    fn check_count(&self, count: usize, min_bytes: usize) -> DisaggResult<()> {
        if count.saturating_mul(min_bytes) > self.remaining() {
            return Err(frame_err(format!(
                "a container of {count} items cannot fit in the {} bytes left",
                self.remaining()
            )));
        }
        Ok(())
    }

    fn value(&mut self, depth: usize) -> DisaggResult<Value> {
        let tag = self.take(1)?[0];
        Ok(match tag {
            0x00..=0x7f => Value::Int(i64::from(tag)),
            0xe0..=0xff => Value::Int(i64::from(tag.cast_signed())),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xcc => uint(self.be(1)?),
            0xcd => uint(self.be(2)?),
            0xce => uint(self.be(4)?),
            0xcf => uint(self.be(8)?),
            0xd0 => Value::Int(i64::from(self.take(1)?[0].cast_signed())),
            0xd1 => {
                let b = self.take(2)?;
                Value::Int(i64::from(i16::from_be_bytes([b[0], b[1]])))
            }
            0xd2 => {
                let b = self.take(4)?;
                Value::Int(i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]])))
            }
            0xd3 => Value::Int(i64::from_be_bytes(self.be(8)?.to_be_bytes())),
            0xca => {
                let b = self.take(4)?;
                Value::Float(f64::from(f32::from_be_bytes([b[0], b[1], b[2], b[3]])))
            }
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xa0..=0xbf => self.str(usize::from(tag & 0x1f))?,
            // str 8/16/32, bin 8/16/32, array 16/32, map 16/32: a 1-, 2- or 4-byte length first.
            0xd9..=0xdb => {
                let n = self.len(1 << (tag - 0xd9))?;
                self.str(n)?
            }
            0xc4..=0xc6 => {
                let n = self.len(1 << (tag - 0xc4))?;
                Value::Bin(self.take(n)?.to_vec())
            }
            0x90..=0x9f => self.array(usize::from(tag & 0x0f), depth)?,
            0xdc | 0xdd => {
                let n = self.len(2 << (tag - 0xdc))?;
                self.array(n, depth)?
            }
            0x80..=0x8f => self.map(usize::from(tag & 0x0f), depth)?,
            0xde | 0xdf => {
                let n = self.len(2 << (tag - 0xde))?;
                self.map(n, depth)?
            }
            _ => return Err(frame_err(format!("unsupported msgpack type 0x{tag:02x}"))),
        })
    }

    fn str(&mut self, n: usize) -> DisaggResult<Value> {
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes)
            .map(|s| Value::Str(s.to_owned()))
            .map_err(|e| frame_err(format!("string is not UTF-8: {e}")))
    }

    fn enter(depth: usize) -> DisaggResult<usize> {
        if depth >= MAX_DEPTH {
            return Err(frame_err(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        Ok(depth + 1)
    }

    /// An array of `n` items: [`Value::Ints`] when they all are ints that fit `i64`.
    fn array(&mut self, n: usize, depth: usize) -> DisaggResult<Value> {
        let depth = Self::enter(depth)?;
        self.check_count(n, 1)?;
        let starts_int = |r: &Self| r.data.get(r.pos).is_some_and(|t| int_tag(*t));
        // Room for ints only when the list starts with one (a list of maps needs none).
        let mut ints = Vec::with_capacity(if starts_int(self) { n } else { 0 });
        let mut other = None;
        while ints.len() < n && starts_int(self) {
            match self.value(depth)? {
                Value::Int(i) => ints.push(i),
                v => {
                    other = Some(v);
                    break;
                }
            }
        }
        if n > 0 && ints.len() == n {
            return Ok(Value::Ints(ints));
        }
        let mut out: Vec<Value> = Vec::with_capacity(n);
        out.extend(ints.into_iter().map(Value::Int).chain(other));
        while out.len() < n {
            out.push(self.value(depth)?);
        }
        Ok(Value::Array(out))
    }

    fn map(&mut self, n: usize, depth: usize) -> DisaggResult<Value> {
        let depth = Self::enter(depth)?;
        self.check_count(n, 2)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let key = self.value(depth)?;
            if matches!(key, Value::Array(_) | Value::Ints(_) | Value::Map(_)) {
                return Err(frame_err(format!("a map key is a {} (unhashable)", key.type_name())));
            }
            out.push((key, self.value(depth)?));
        }
        Ok(Value::Map(out))
    }
}

/// Decode exactly one value from `data` (trailing bytes are an error).
pub fn decode(data: &[u8]) -> DisaggResult<Value> {
    let mut r = Reader { data, pos: 0 };
    let v = r.value(0)?;
    if r.remaining() != 0 {
        return Err(frame_err(format!("{} bytes after the value", r.remaining())));
    }
    Ok(v)
}

/// Encode `v` as msgpack, each length and int in its smallest form, floats as float64 and bytes
/// as bin: the bytes Python's `msgpack.packb(..., use_bin_type=True)` writes for the same value.
pub fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write(v, &mut out);
    out
}

/// A length-prefixed head: `fix | n` under the fix form's cap, else the 1-byte form (where
/// the type has one), the 2- or the 4-byte form (`tags`).
fn head(out: &mut Vec<u8>, n: usize, fix: Option<(u8, usize)>, tags: (Option<u8>, u8, u8)) {
    let be = n.to_be_bytes();
    let low = |k: usize| &be[be.len() - k..];
    match (fix, tags.0) {
        (Some((tag, cap)), _) if n < cap => out.push(tag | low(1)[0]),
        (_, Some(tag)) if n <= 0xff => out.extend([tag, low(1)[0]]),
        _ if n <= 0xffff => {
            out.push(tags.1);
            out.extend(low(2));
        }
        _ => {
            out.push(tags.2);
            out.extend(low(4));
        }
    }
}

fn write_int(i: i64, out: &mut Vec<u8>) {
    let b = i.to_be_bytes();
    match i {
        -32..=0x7f => out.push(b[7]),
        0x80..=0xff => out.extend([0xcc, b[7]]),
        0x100..=0xffff => out.extend([0xcd, b[6], b[7]]),
        0x1_0000..=0xffff_ffff => out.extend([0xce, b[4], b[5], b[6], b[7]]),
        0x1_0000_0000.. => {
            out.push(0xcf);
            out.extend(b);
        }
        -0x80..=-33 => out.extend([0xd0, b[7]]),
        -0x8000..=-0x81 => out.extend([0xd1, b[6], b[7]]),
        -0x8000_0000..=-0x8001 => out.extend([0xd2, b[4], b[5], b[6], b[7]]),
        _ => {
            out.push(0xd3);
            out.extend(b);
        }
    }
}

fn write(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Nil => out.push(0xc0),
        Value::Bool(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
        Value::Int(i) => write_int(*i, out),
        Value::UInt(u) => {
            out.push(0xcf);
            out.extend(u.to_be_bytes());
        }
        Value::Float(f) => {
            out.push(0xcb);
            out.extend(f.to_bits().to_be_bytes());
        }
        Value::Str(s) => {
            head(out, s.len(), Some((0xa0, 32)), (Some(0xd9), 0xda, 0xdb));
            out.extend(s.as_bytes());
        }
        Value::Bin(b) => {
            head(out, b.len(), None, (Some(0xc4), 0xc5, 0xc6));
            out.extend(b);
        }
        Value::Array(items) => {
            head(out, items.len(), Some((0x90, 16)), (None, 0xdc, 0xdd));
            for x in items {
                write(x, out);
            }
        }
        Value::Ints(items) => {
            head(out, items.len(), Some((0x90, 16)), (None, 0xdc, 0xdd));
            for i in items {
                write_int(*i, out);
            }
        }
        Value::Map(pairs) => {
            head(out, pairs.len(), Some((0x80, 16)), (None, 0xde, 0xdf));
            for (k, x) in pairs {
                write(k, out);
                write(x, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Any value the decoder yields (map keys scalars, as it requires).
    fn any_value() -> impl Strategy<Value = Value> {
        let scalar = prop_oneof![
            Just(Value::Nil),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::Int),
            (i64::MAX.cast_unsigned() + 1..=u64::MAX).prop_map(Value::UInt),
            any::<f64>().prop_filter("NaN != NaN", |f| !f.is_nan()).prop_map(Value::Float),
            ".{0,40}".prop_map(Value::Str),
            proptest::collection::vec(any::<u8>(), 0..300).prop_map(Value::Bin),
        ];
        scalar.clone().prop_recursive(4, 64, 20, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..20).prop_map(Value::Array),
                proptest::collection::vec(any::<i64>(), 1..40).prop_map(Value::Ints),
                proptest::collection::vec((scalar.clone(), inner), 0..18).prop_map(Value::Map),
            ]
        })
    }

    #[test]
    fn a_list_of_ints_is_held_as_ints_and_equals_the_list_of_their_values() {
        let ints = decode(&[0x93, 0x01, 0xff, 0xcd, 0x01, 0x2c]).unwrap();
        assert!(matches!(&ints, Value::Ints(v) if v == &[1, -1, 300]));
        let values = Value::Array(vec![Value::Int(1), Value::Int(-1), Value::Int(300)]);
        assert_eq!(ints, values);
        assert_eq!(values, ints);
        assert_ne!(ints, Value::Ints(vec![1, -1]));
        // Not all ints of i64 (a str, a u64 past it) or empty: the list of values.
        let mixed = decode(&[0x92, 0x01, 0xa1, b'x']).unwrap();
        assert_eq!(mixed, Value::Array(vec![Value::Int(1), Value::Str("x".into())]));
        assert!(matches!(mixed, Value::Array(_)));
        let big = [0x92, 0x01, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(decode(&big).unwrap(), Value::Array(v) if v[1] == Value::UInt(u64::MAX)));
        assert!(matches!(decode(&[0x90]).unwrap(), Value::Array(v) if v.is_empty()));
        // A truncated list of ints is still refused.
        assert!(decode(&[0x93, 0x01, 0x02]).is_err());
        assert_eq!(encode(&ints), encode(&values));
    }

    proptest! {
        #[test]
        fn encode_then_decode_is_the_identity(v in any_value()) {
            prop_assert_eq!(decode(&encode(&v)).unwrap(), v);
        }
    }

    #[test]
    fn every_length_and_int_takes_its_smallest_form() {
        let widths = [(0usize, 1usize), (15, 1), (16, 3), (0xffff, 3), (0x1_0000, 5)];
        for (n, head) in widths {
            let a = encode(&Value::Array(vec![Value::Nil; n]));
            assert_eq!(a.len(), head + n, "array of {n}");
        }
        let strs = [(31usize, 1usize), (32, 2), (0xff, 2), (0x100, 3), (0x1_0000, 5)];
        for (n, head) in strs {
            assert_eq!(encode(&Value::Str("x".repeat(n))).len(), head + n, "str of {n}");
        }
        let ints = [
            (0i64, 1usize),
            (127, 1),
            (128, 2),
            (255, 2),
            (256, 3),
            (65_536, 5),
            (1 << 32, 9),
            (-32, 1),
            (-33, 2),
            (-128, 2),
            (-129, 3),
            (-32_769, 5),
            (-(1 << 31) - 1, 9),
        ];
        for (i, len) in ints {
            assert_eq!(encode(&Value::Int(i)).len(), len, "int {i}");
        }
        assert_eq!(encode(&Value::Bin(vec![])), [0xc4, 0]);
    }

    #[test]
    fn scalars_and_containers_decode() {
        // {"a": [1, -1, 300, true, nil, "x"]}
        let frame = [0x81, 0xa1, b'a', 0x96, 0x01, 0xff, 0xcd, 0x01, 0x2c, 0xc3, 0xc0, 0xa1, b'x'];
        let v = decode(&frame).unwrap();
        let Value::Map(pairs) = v else { panic!("not a map") };
        assert_eq!(pairs[0].0, Value::Str("a".into()));
        assert_eq!(
            pairs[0].1,
            Value::Array(vec![
                Value::Int(1),
                Value::Int(-1),
                Value::Int(300),
                Value::Bool(true),
                Value::Nil,
                Value::Str("x".into())
            ])
        );
    }

    #[test]
    fn a_huge_length_prefix_is_refused_before_allocating() {
        for frame in [&[0xdd, 0xff, 0xff, 0xff, 0xff][..], &[0xdf, 0xff, 0xff, 0xff, 0xff, 0x01]] {
            assert!(matches!(decode(frame), Err(DisaggError::Wire { .. })));
        }
    }

    #[test]
    fn nesting_past_the_cap_is_refused() {
        let frame = vec![0x91; MAX_DEPTH + 1];
        assert!(decode(&frame).is_err());
        let mut ok = vec![0x91; MAX_DEPTH - 1];
        ok.push(0x90);
        assert!(decode(&ok).is_ok());
    }

    #[test]
    fn trailing_bytes_truncation_bad_utf8_and_unhashable_keys_are_refused() {
        for frame in [
            &[0x01, 0x02][..],
            &[0xa2, b'a'],
            &[0xa1, 0xff],
            &[0x81, 0x90, 0x01],
            &[0x81, 0x91, 0x01, 0x01],
            &[0xd4, 0x00, 0x00],
            &[],
        ] {
            assert!(decode(frame).is_err(), "{frame:?}");
        }
    }

    #[test]
    fn every_length_width_of_str_array_and_map_decodes_the_same() {
        let s = Value::Str("x".into());
        for frame in
            [&[0xa1, b'x'][..], &[0xd9, 1, b'x'], &[0xda, 0, 1, b'x'], &[0xdb, 0, 0, 0, 1, b'x']]
        {
            assert_eq!(decode(frame).unwrap(), s, "{frame:?}");
        }
        let a = Value::Array(vec![Value::Int(7)]);
        for frame in [&[0x91, 7][..], &[0xdc, 0, 1, 7], &[0xdd, 0, 0, 0, 1, 7]] {
            assert_eq!(decode(frame).unwrap(), a, "{frame:?}");
        }
        let m = Value::Map(vec![(Value::Int(1), Value::Int(2))]);
        for frame in [&[0x81, 1, 2][..], &[0xde, 0, 1, 1, 2], &[0xdf, 0, 0, 0, 1, 1, 2]] {
            assert_eq!(decode(frame).unwrap(), m, "{frame:?}");
        }
    }

    #[test]
    fn every_int_width_decodes_to_its_value() {
        assert_eq!(decode(&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]).unwrap(), Value::Int(i64::MIN));
        assert_eq!(
            decode(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).unwrap(),
            Value::UInt(u64::MAX)
        );
        assert_eq!(decode(&[0xd1, 0xff, 0x00]).unwrap(), Value::Int(-256));
        assert_eq!(decode(&[0xd2, 0xff, 0xff, 0xff, 0xfe]).unwrap(), Value::Int(-2));
        assert_eq!(decode(&[0xce, 0xff, 0xff, 0xff, 0xff]).unwrap(), Value::Int(0xffff_ffff));
    }
}
