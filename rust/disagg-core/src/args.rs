//! Typed reading of a caller's arguments: every type and range decision the bindings make
//! about an argument, so each bad argument, of any type, gives one typed error naming it.
//!
//! The bindings read a foreign value into a [`Given`]: the value when it has the right type,
//! else a short description of what was given (`a float (1.5)`, from [`describe`]). Reading
//! never fails; the conversion that needs the value does: [`DisaggError::ArgumentType`] for a
//! wrong type, the field's [`Kind`] of error for a value out of range, with the value given and
//! the valid range.

use crate::error::{DisaggError, DisaggResult};
use crate::wire::value::WireValue;

/// Which error a value out of range raises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`DisaggError::Layout`]: a layout or dims field.
    Layout,
    /// [`DisaggError::Argument`]: a plain argument (counts, ranks, modes, sizes).
    Argument,
    /// [`DisaggError::Block`]: a block or slot id or id list.
    Block,
    /// [`DisaggError::Geometry`]: a field of a buffer geometry.
    Geometry,
}

impl Kind {
    /// The error of this kind naming `field`.
    pub fn error(self, field: &str, detail: String) -> DisaggError {
        match self {
            Self::Layout => DisaggError::layout(field, detail),
            Self::Argument => DisaggError::argument(field, detail),
            Self::Block => DisaggError::block(field, detail),
            Self::Geometry => DisaggError::geometry(field, detail),
        }
    }

    /// Every count in `fields` is at least 1, else the error of this kind naming the first
    /// `(field, value)` that is 0 (checked in the order given).
    pub fn at_least_one(self, fields: &[(&str, u32)]) -> DisaggResult<()> {
        match fields.iter().find(|&&(_, value)| value == 0) {
            Some(&(field, _)) => Err(self.error(field, format!("{field}=0 must be >= 1"))),
            None => Ok(()),
        }
    }
}

/// `[("a", s.a), ("b", s.b)]` (or `[("a", a), ("b", b)]` for locals): values under the names
/// they are spelled with, for [`Kind::at_least_one`], so a field and its name in the error
/// cannot drift apart.
macro_rules! named {
    ($s:ident; $($field:ident),+ $(,)?) => {
        [$((stringify!($field), $s.$field)),+]
    };
    ($($local:ident),+ $(,)?) => {
        [$((stringify!($local), $local)),+]
    };
}
pub(crate) use named;

/// `a float (1.5)`: a value's type name and a repr cut to 40 characters, for error messages;
/// `None` for Python's `None`.
pub fn describe(type_name: &str, repr: &str, is_none: bool) -> String {
    if is_none {
        return "None".to_owned();
    }
    let mut repr = repr.to_owned();
    if repr.len() > 40 {
        let cut = (0..=37).rev().find(|&i| repr.is_char_boundary(i)).unwrap_or(0);
        repr.truncate(cut);
        repr.push_str("...");
    }
    let article = if type_name.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" };
    format!("{article} {type_name} ({repr})")
}

/// What an int list argument accepts, for its type errors.
pub const LIST_EXPECTED: &str = "a list of ints or a 1-D integer numpy array or torch tensor";

/// Whether an array of `ndim` dimensions and dtype kind `kind` (numpy's `i`, `u`, `f`, ...)
/// is an id list: `Ok(true)` for unsigned, `Ok(false)` for signed, else what to say.
pub fn int_array_kind(ndim: usize, kind: &str) -> Result<bool, String> {
    if ndim != 1 || !(kind == "i" || kind == "u") {
        return Err(format!("{LIST_EXPECTED}, got an array with ndim={ndim}, dtype kind {kind:?}"));
    }
    Ok(kind == "u")
}

/// The description of a list whose item `index` is not an int (`what` describes it).
pub fn bad_list_item(index: usize, what: &str) -> String {
    format!("{LIST_EXPECTED}; item {index} is {what}")
}

/// The description of an int that does not fit 128 bits.
pub fn beyond_128_bits(what: &str) -> String {
    format!("{what} (beyond 128 bits)")
}

/// An argument as given: its value, or a description of what was given instead.
#[derive(Debug, Clone, PartialEq)]
pub struct Given<T>(pub Result<T, String>);

/// An integer argument (never a bool, a float or a string).
pub type Int = Given<i128>;
/// A list of integers.
pub type IntList = Given<Vec<i128>>;
/// A string argument.
pub type Text = Given<String>;
/// A real-number argument (an int or a float).
pub type Real = Given<f64>;
/// A bool argument.
pub type Flag = Given<bool>;

/// A [`DisaggError::ArgumentType`] naming `field`.
fn type_error(field: &str, detail: String) -> DisaggError {
    DisaggError::argument_type(field, detail)
}

impl<T> Given<T> {
    /// The value, else a type error naming `field` and what was `expected`.
    pub fn typed(self, field: &str, expected: &str) -> DisaggResult<T> {
        self.0.map_err(|what| type_error(field, format!("{field} must be {expected}, got {what}")))
    }

    fn value(&self, field: &str, expected: &str) -> DisaggResult<&T> {
        self.0
            .as_ref()
            .map_err(|what| type_error(field, format!("{field} must be {expected}, got {what}")))
    }
}

impl Int {
    /// A given value (a default).
    pub fn of(v: i64) -> Self {
        Self(Ok(i128::from(v)))
    }

    /// The value in `[lo, hi]` (`hi_text` spells the exclusive bound), else the error of
    /// `kind` naming `field`.
    pub fn in_range(
        &self,
        kind: Kind,
        field: &str,
        lo: i128,
        hi: i128,
        hi_text: &str,
    ) -> DisaggResult<i128> {
        let v = *self.value(field, "an int")?;
        if (lo..=hi).contains(&v) {
            Ok(v)
        } else {
            Err(kind.error(field, format!("{field}={v} must be in [{lo}, {hi_text})")))
        }
    }

    fn fit<T: IntType>(&self, kind: Kind, field: &str) -> DisaggResult<T> {
        let v = self.in_range(kind, field, T::LO, T::HI, T::HI_TEXT)?;
        T::try_from(v).map_err(|_| kind.error(field, format!("{field}={v} out of range")))
    }

    /// A value in `[0, 2**32)`.
    pub fn to_u32(&self, kind: Kind, field: &str) -> DisaggResult<u32> {
        self.fit(kind, field)
    }

    /// A value in `[-2**63, 2**63)`.
    pub fn to_i64(&self, kind: Kind, field: &str) -> DisaggResult<i64> {
        self.fit(kind, field)
    }

    /// A value in `[0, 2**64)`.
    pub fn to_u64(&self, kind: Kind, field: &str) -> DisaggResult<u64> {
        self.fit(kind, field)
    }
}

/// An integer type an [`Int`] converts to: its closed range `[LO, HI]`, and the exclusive
/// upper bound as messages spell it.
trait IntType: TryFrom<i128> {
    const LO: i128;
    const HI: i128;
    const HI_TEXT: &'static str;
}

impl IntType for u32 {
    const LO: i128 = 0;
    const HI: i128 = u32::MAX as i128;
    const HI_TEXT: &'static str = "2**32";
}

impl IntType for i64 {
    const LO: i128 = i64::MIN as i128;
    const HI: i128 = i64::MAX as i128;
    const HI_TEXT: &'static str = "2**63";
}

impl IntType for u64 {
    const LO: i128 = 0;
    const HI: i128 = u64::MAX as i128;
    const HI_TEXT: &'static str = "2**64";
}

impl From<i64> for Int {
    fn from(v: i64) -> Self {
        Self(Ok(i128::from(v)))
    }
}

impl From<i128> for Int {
    fn from(v: i128) -> Self {
        Self(Ok(v))
    }
}

impl From<u64> for Int {
    fn from(v: u64) -> Self {
        Self(Ok(i128::from(v)))
    }
}

impl IntList {
    /// Every value in `[0, 2**32)`; errors name `field[i]`.
    pub fn to_u32s(&self, kind: Kind, field: &str) -> DisaggResult<Vec<u32>> {
        self.each(kind, field, "must be in [0, 2**32)")
    }

    /// Every value in `[0, 2**64)`; errors name `field[i]`.
    pub fn to_u64s(&self, kind: Kind, field: &str) -> DisaggResult<Vec<u64>> {
        self.each(kind, field, "must be in [0, 2**64)")
    }

    /// Every value in `[-2**63, 2**63)`; errors name `field[i]`.
    pub fn to_i64s(&self, kind: Kind, field: &str) -> DisaggResult<Vec<i64>> {
        self.each(kind, field, "must fit a signed 64-bit int")
    }

    /// Every value converted to `T`; the first that does not fit is named with `range`.
    fn each<T: TryFrom<i128>>(&self, kind: Kind, field: &str, range: &str) -> DisaggResult<Vec<T>> {
        let values =
            self.0.as_ref().map_err(|what| type_error(field, format!("{field} must be {what}")))?;
        let bad = |i: usize, v: i128| kind.error(field, format!("{field}[{i}]={v} {range}"));
        values.iter().enumerate().map(|(i, &v)| T::try_from(v).map_err(|_| bad(i, v))).collect()
    }
}

impl Text {
    /// A given value (a default).
    pub fn of(v: &str) -> Self {
        Self(Ok(v.to_owned()))
    }

    /// The string, else a type error naming `field`.
    pub fn get(&self, field: &str) -> DisaggResult<&str> {
        self.value(field, "a str").map(String::as_str)
    }
}

impl Real {
    /// A given value (a default).
    pub fn of(v: f64) -> Self {
        Self(Ok(v))
    }

    /// A finite value `> 0`, else an [`DisaggError::Argument`] naming `field`.
    pub fn positive(&self, field: &str) -> DisaggResult<f64> {
        let v = *self.value(field, "a number")?;
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(DisaggError::argument(field, format!("{field}={v} must be finite and > 0")))
        }
    }
}

impl Flag {
    /// A given value (a default).
    pub fn of(v: bool) -> Self {
        Self(Ok(v))
    }

    /// The bool, else a type error naming `field`.
    pub fn get(&self, field: &str) -> DisaggResult<bool> {
        self.value(field, "a bool").copied()
    }
}

/// `a str ("x")`: a wire value's type and a short form of it, for error messages.
pub fn describe_wire(v: &WireValue) -> String {
    describe(v.type_name(), &v.canonical_json(), matches!(v, WireValue::Null))
}

impl Int {
    /// A wire value as an integer argument (a bool is not one).
    pub fn of_wire(v: &WireValue) -> Self {
        match v {
            WireValue::Int(i) => Self(Ok(*i)),
            other => Self(Err(describe_wire(other))),
        }
    }
}

impl IntList {
    /// A wire list of integers as a list argument.
    pub fn of_wire(v: &WireValue) -> Self {
        let WireValue::List(items) = v else {
            return Self(Err(format!("{LIST_EXPECTED}, got {}", describe_wire(v))));
        };
        let one = |(i, x): (usize, &WireValue)| Int::of_wire(x).0.map_err(|w| bad_list_item(i, &w));
        Self(items.iter().enumerate().map(one).collect())
    }
}

/// Item `index` of a `prompt_tokens` list: an int fitting `i64`, else an `Argument` error
/// naming `prompt_tokens` and the item.
pub fn token(index: usize, v: &Int) -> DisaggResult<i64> {
    let what = match &v.0 {
        Ok(t) => match i64::try_from(*t) {
            Ok(t) => return Ok(t),
            Err(_) => describe("int", &t.to_string(), false),
        },
        Err(what) => what.clone(),
    };
    Err(DisaggError::argument("prompt_tokens", format!("item {index} is {what}")))
}

/// A caller's `out` array for descriptor rows: `[m, 3]` and C-contiguous, else an
/// `Argument` error naming `out`.
pub fn out_rows(shape: &[usize], c_contiguous: bool) -> DisaggResult<()> {
    if shape.len() == 2 && shape[1] == 3 && c_contiguous {
        return Ok(());
    }
    let detail = format!("out arrays must be C-contiguous with shape [m, 3], got {shape:?}");
    Err(DisaggError::argument("out", detail))
}

/// A pair of `out` arrays: the same array twice is an `Argument` error naming `out`.
pub fn distinct_outs(same: bool) -> DisaggResult<()> {
    if same {
        return Err(DisaggError::argument("out", "out must be two distinct arrays"));
    }
    Ok(())
}

/// One argument given under its name or an alias (not both): a type error naming `name`
/// when both are given.
pub fn one_of<T>(
    name: &str,
    value: Option<T>,
    alias: &str,
    alias_value: Option<T>,
) -> DisaggResult<Option<T>> {
    match (value, alias_value) {
        (Some(_), Some(_)) => {
            Err(type_error(name, format!("give {name} or its alias {alias}, not both")))
        }
        (v, None) | (None, v) => Ok(v),
    }
}

/// A required argument: a type error naming `name` when it is missing.
pub fn required<T>(name: &str, v: Option<T>) -> DisaggResult<T> {
    v.ok_or_else(|| type_error(name, format!("missing required argument {name}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_detail(e: &DisaggError) -> (&'static str, String, String) {
        match e {
            DisaggError::ArgumentType { field, detail } => ("type", field.clone(), detail.clone()),
            DisaggError::Argument { field, detail } => ("argument", field.clone(), detail.clone()),
            DisaggError::Layout { field, detail } => ("layout", field.clone(), detail.clone()),
            DisaggError::Block { field, detail } => ("block", field.clone(), detail.clone()),
            DisaggError::Geometry { field, detail } => ("geometry", field.clone(), detail.clone()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn at_least_one_names_the_first_zero_count_with_the_error_of_its_kind() {
        assert!(Kind::Layout.at_least_one(&[("a", 1), ("b", 7)]).is_ok());
        assert!(Kind::Layout.at_least_one(&[]).is_ok());
        let e = Kind::Geometry.at_least_one(&[("a", 2), ("b", 0), ("c", 0)]).unwrap_err();
        assert_eq!(field_detail(&e), ("geometry", "b".to_owned(), "b=0 must be >= 1".to_owned()));
        let e = Kind::Block.at_least_one(&[("c", 0)]).unwrap_err();
        assert_eq!(field_detail(&e), ("block", "c".to_owned(), "c=0 must be >= 1".to_owned()));
    }

    #[test]
    fn an_int_of_the_wrong_type_is_a_type_error_naming_the_field_and_what_was_given() {
        let e = Int::from(Given(Err("a float (1.5)".to_owned())))
            .to_u32(Kind::Layout, "tp_size")
            .unwrap_err();
        let (kind, field, detail) = field_detail(&e);
        assert_eq!((kind, field.as_str()), ("type", "tp_size"));
        assert_eq!(detail, "tp_size must be an int, got a float (1.5)");
        assert_eq!(e.kind(), "ArgumentType");
    }

    #[test]
    fn an_int_out_of_range_is_the_fields_kind_naming_the_value_and_the_range() {
        for (kind, name) in
            [(Kind::Layout, "layout"), (Kind::Argument, "argument"), (Kind::Block, "block")]
        {
            let e = Int::of(-1).to_u32(kind, "n").unwrap_err();
            let (k, field, detail) = field_detail(&e);
            assert_eq!((k, field.as_str()), (name, "n"));
            assert_eq!(detail, "n=-1 must be in [0, 2**32)");
        }
        let big = Int::from(i128::from(u64::MAX) + 1);
        assert!(field_detail(&big.to_u64(Kind::Argument, "t").unwrap_err()).2.contains("2**64"));
        assert!(field_detail(&Int::from(u64::MAX).to_i64(Kind::Argument, "t").unwrap_err())
            .2
            .contains("2**63"));
        assert_eq!(Int::from(u64::MAX).to_u64(Kind::Argument, "t"), Ok(u64::MAX));
        assert_eq!(Int::of(-5).to_i64(Kind::Argument, "t"), Ok(-5));
        assert_eq!(Int::of(7).to_u32(Kind::Argument, "t"), Ok(7));
    }

    #[test]
    fn a_list_names_the_first_bad_item_with_its_index_and_value() {
        let l = IntList::from(Given(Ok(vec![0, 3, -1, -2])));
        let (k, field, detail) = field_detail(&l.to_u32s(Kind::Block, "block_ids").unwrap_err());
        assert_eq!((k, field.as_str()), ("block", "block_ids"));
        assert_eq!(detail, "block_ids[2]=-1 must be in [0, 2**32)");
        assert_eq!(Given(Ok(vec![1, 2])).to_u64s(Kind::Argument, "h"), Ok(vec![1u64, 2]));
        let wide = Given(Ok(vec![i128::from(u64::MAX)]));
        assert!(field_detail(&wide.to_i64s(Kind::Argument, "h").unwrap_err()).2.contains("h[0]="));
        let e = IntList::from(Given(Err(bad_list_item(1, "a bool (True)"))))
            .to_u32s(Kind::Block, "ids");
        let (k, _, detail) = field_detail(&e.unwrap_err());
        assert_eq!(k, "type");
        assert_eq!(detail, format!("ids must be {LIST_EXPECTED}; item 1 is a bool (True)"));
    }

    #[test]
    fn text_real_flag_and_typed_values_name_the_field_on_a_wrong_type() {
        assert_eq!(Text::of("auto").get("mode"), Ok("auto"));
        let e = Text::from(Given(Err("None".into()))).get("mode").unwrap_err();
        assert_eq!(field_detail(&e).2, "mode must be a str, got None");
        assert_eq!(Real::of(2.5).positive("rate"), Ok(2.5));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let (k, field, detail) = field_detail(&Real::of(bad).positive("rate").unwrap_err());
            assert_eq!((k, field.as_str()), ("argument", "rate"));
            assert!(detail.ends_with("must be finite and > 0"), "{detail}");
        }
        let e = Real::from(Given(Err("a str ('x')".into()))).positive("rate").unwrap_err();
        assert_eq!(field_detail(&e).2, "rate must be a number, got a str ('x')");
        assert_eq!(Flag::of(true).get("pull"), Ok(true));
        let e = Flag::from(Given(Err("an int (1)".into()))).get("pull").unwrap_err();
        assert_eq!(field_detail(&e).2, "pull must be a bool, got an int (1)");
        let e =
            Given::<u8>(Err("a str ('x')".into())).typed("srcs", "a list of layouts").unwrap_err();
        assert_eq!(field_detail(&e).2, "srcs must be a list of layouts, got a str ('x')");
    }

    #[test]
    fn wire_values_read_as_int_arguments_like_python_values() {
        assert_eq!(Int::of_wire(&WireValue::Int(-3)), Int::of(-3));
        assert_eq!(Int::of_wire(&WireValue::Bool(true)).0, Err("a bool (true)".to_owned()));
        assert_eq!(Int::of_wire(&WireValue::Null).0, Err("None".to_owned()));
        let l = WireValue::List(vec![WireValue::Int(1), WireValue::Str("x".into())]);
        assert_eq!(IntList::of_wire(&l).0, Err(bad_list_item(1, "a str (\"x\")")));
        let ok = WireValue::List(vec![WireValue::Int(1), WireValue::Int(2)]);
        assert_eq!(IntList::of_wire(&ok), Given(Ok(vec![1, 2])));
        assert!(IntList::of_wire(&WireValue::Int(1)).0.unwrap_err().ends_with("got an int (1)"));
    }

    #[test]
    fn a_prompt_token_is_an_int_that_fits_64_bits() {
        assert_eq!(token(0, &Int::of(-7)), Ok(-7));
        let e = token(3, &Int::from(i128::from(i64::MAX) + 1)).unwrap_err();
        let want = format!("item 3 is an int ({})", i128::from(i64::MAX) + 1);
        assert_eq!(e, DisaggError::argument("prompt_tokens", want));
        let e = token(1, &Given(Err("a float (1.5)".into()))).unwrap_err();
        assert_eq!(e, DisaggError::argument("prompt_tokens", "item 1 is a float (1.5)"));
    }

    #[test]
    fn out_arrays_are_distinct_c_contiguous_rows_of_three() {
        assert_eq!(out_rows(&[8, 3], true), Ok(()));
        let e = out_rows(&[8, 4], true).unwrap_err();
        let want = "out arrays must be C-contiguous with shape [m, 3], got [8, 4]";
        assert_eq!(e, DisaggError::argument("out", want));
        assert!(out_rows(&[8, 3], false).is_err());
        assert_eq!(distinct_outs(false), Ok(()));
        assert_eq!(distinct_outs(true).unwrap_err().kind(), "Argument");
    }

    #[test]
    fn describe_picks_the_article_and_cuts_long_reprs() {
        assert_eq!(describe("float", "1.5", false), "a float (1.5)");
        assert_eq!(describe("int", "1", false), "an int (1)");
        assert_eq!(describe("NoneType", "None", true), "None");
        let long = describe("str", &"x".repeat(60), false);
        assert_eq!(long, format!("a str ({}...)", "x".repeat(37)));
        assert_eq!(beyond_128_bits("an int (1)"), "an int (1) (beyond 128 bits)");
    }

    #[test]
    fn array_kinds_accept_1d_integer_arrays_only() {
        assert_eq!(int_array_kind(1, "i"), Ok(false));
        assert_eq!(int_array_kind(1, "u"), Ok(true));
        assert!(int_array_kind(2, "i").unwrap_err().contains("ndim=2"));
        assert!(int_array_kind(1, "f").unwrap_err().contains("dtype kind \"f\""));
    }

    #[test]
    fn an_argument_and_its_alias_are_one_argument_and_a_missing_one_is_named() {
        assert_eq!(one_of("nheads", Some(1), "num_heads", None), Ok(Some(1)));
        assert_eq!(one_of("nheads", None, "num_heads", Some(2)), Ok(Some(2)));
        assert_eq!(one_of::<u8>("nheads", None, "num_heads", None), Ok(None));
        let e = one_of("nheads", Some(1), "num_heads", Some(2)).unwrap_err();
        assert_eq!(
            field_detail(&e),
            ("type", "nheads".into(), "give nheads or its alias num_heads, not both".into())
        );
        let e = required::<u8>("d_state", None).unwrap_err();
        assert_eq!(
            field_detail(&e),
            ("type", "d_state".into(), "missing required argument d_state".into())
        );
    }
}
