//! Shard layouts, SSM dims and geometries as wire maps (`to_dict` / `from_dict`), and the
//! KV layout and SSM dims constructor calls: every field check, alias and default the
//! bindings' constructors and `from_dict` apply.

use crate::args::{one_of, required, Flag, Int, Kind};
use crate::error::{DisaggError, DisaggResult};
use crate::wire::value::{Obj, WireValue};
use crate::{
    KvGeometry, KvLayoutSpec, KvShardLayout, RankCoords, SsmGeometry, SsmLayoutSpec,
    SsmShardLayout, SsmStateDims,
};

/// A record with a wire map form: `from_obj(to_wire())` round-trips.
pub trait WireRecord: Sized {
    /// Decode and validate a wire map: `Wire` errors for a missing, unknown or mistyped field,
    /// the record's own errors for invalid values.
    fn from_obj(o: &Obj<'_>) -> DisaggResult<Self>;
    /// The wire map (JSON and msgpack safe).
    fn to_wire(&self) -> WireValue;
}

/// The integer fields `keys` of a wire map (absent or `None`: `None`); anything but an int in
/// `[0, 2**32)` is a `Wire` error naming the key.
fn u32_fields<'k>(o: &Obj<'_>, keys: &[&'k str]) -> DisaggResult<Vec<(&'k str, Option<u32>)>> {
    let one = |key: &'k str| {
        let Some(v) = o.some(key) else { return Ok((key, None)) };
        let WireValue::Int(n) = v else {
            return Err(DisaggError::wire(key, format!("expected an int, got {}", shown(v))));
        };
        let n = u32::try_from(*n)
            .map_err(|_| DisaggError::wire(key, format!("{key}={n} must be in [0, 2**32)")))?;
        Ok((key, Some(n)))
    };
    keys.iter().map(|&k| one(k)).collect()
}

fn shown(v: &WireValue) -> String {
    format!("{} {}", v.type_name(), v.canonical_json())
}

/// A map of `fields`, `None` as null.
fn map<V: Copy>(fields: &[(&str, V)], to: impl Fn(V) -> WireValue) -> Vec<(String, WireValue)> {
    fields.iter().map(|&(k, v)| (k.to_owned(), to(v))).collect()
}

fn opt(v: Option<u32>) -> WireValue {
    v.map_or(WireValue::Null, |n| WireValue::Int(i128::from(n)))
}

fn int(v: u32) -> WireValue {
    WireValue::Int(i128::from(v))
}

impl WireRecord for KvShardLayout {
    fn from_obj(o: &Obj<'_>) -> DisaggResult<Self> {
        o.only(&KvLayoutSpec::WIRE_KEYS, "KVShardLayout dict")?;
        Self::new(KvLayoutSpec::from_wire(&u32_fields(o, &KvLayoutSpec::WIRE_KEYS)?)?)
    }
    fn to_wire(&self) -> WireValue {
        WireValue::Map(map(&self.spec().wire_fields(), opt))
    }
}

impl WireRecord for SsmStateDims {
    fn from_obj(o: &Obj<'_>) -> DisaggResult<Self> {
        o.only(&Self::WIRE_KEYS, "SSMStateDims dict")?;
        Self::from_wire(&u32_fields(o, &Self::WIRE_KEYS)?)
    }
    fn to_wire(&self) -> WireValue {
        WireValue::Map(map(&self.wire_fields(), int))
    }
}

impl WireRecord for SsmShardLayout {
    fn from_obj(o: &Obj<'_>) -> DisaggResult<Self> {
        o.only(&SsmLayoutSpec::WIRE_KEYS, "SSMShardLayout dict")?;
        let dims = SsmStateDims::from_obj(&o.obj("dims", "dims")?)?;
        let fields = u32_fields(o, SsmLayoutSpec::int_wire_keys())?;
        Self::new(SsmLayoutSpec::from_wire(&fields, dims, o.flag("replicate_groups")?)?)
    }
    fn to_wire(&self) -> WireValue {
        let s = self.spec();
        let mut m = map(&s.wire_fields(), opt);
        m.push(("dims".to_owned(), s.dims.to_wire()));
        m.push(("replicate_groups".to_owned(), WireValue::Bool(s.replicate_groups)));
        WireValue::Map(m)
    }
}

impl WireRecord for KvGeometry {
    fn from_obj(o: &Obj<'_>) -> DisaggResult<Self> {
        Self::from_wire(o)
    }
    fn to_wire(&self) -> WireValue {
        Self::to_wire(self)
    }
}

impl WireRecord for SsmGeometry {
    fn from_obj(o: &Obj<'_>) -> DisaggResult<Self> {
        Self::from_wire(o)
    }
    fn to_wire(&self) -> WireValue {
        Self::to_wire(self)
    }
}

/// A layout field: an int in `[0, 2**32)`, else the typed error naming it.
fn field(name: &str, v: &Int) -> DisaggResult<u32> {
    v.to_u32(Kind::Layout, name)
}

/// The parallel fields of a [`KvLayoutCall`], in its order.
const PARALLEL: [&str; 8] =
    ["tp_size", "tp_rank", "pp_size", "pp_rank", "ep_size", "ep_rank", "etp_size", "etp_rank"];

/// The arguments of a `KVShardLayout(...)` call, the reference design's names with our alias
/// `num_kv_heads`.
#[derive(Debug, Clone)]
pub struct KvLayoutCall {
    /// Layers of the whole model.
    pub num_layers: Int,
    /// KV heads of the whole model (the reference design's name).
    pub num_heads: Option<Int>,
    /// Alias of `num_heads`.
    pub num_kv_heads: Option<Int>,
    /// `tp_size, tp_rank, pp_size, pp_rank, ep_size, ep_rank, etp_size, etp_rank`.
    pub parallel: [Int; 8],
    /// Defaults to `pp_rank * tp_size + tp_rank`.
    pub global_rank: Option<Int>,
    /// First global layer held (default: the even split).
    pub layer_start: Option<Int>,
    /// Layers held (default: the even split).
    pub num_local_layers: Option<Int>,
}

impl KvLayoutCall {
    /// The validated layout.
    pub fn layout(&self) -> DisaggResult<KvShardLayout> {
        let one = one_of(
            "num_heads",
            self.num_heads.as_ref(),
            "num_kv_heads",
            self.num_kv_heads.as_ref(),
        )?;
        let heads = required("num_heads (or num_kv_heads)", one)?;
        let mut p = [0u32; 8];
        for ((slot, name), v) in p.iter_mut().zip(PARALLEL).zip(&self.parallel) {
            *slot = field(name, v)?;
        }
        let [tp_size, tp_rank, pp_size, pp_rank, ep_size, ep_rank, etp_size, etp_rank] = p;
        let default_rank = Int::from(u64::from(pp_rank) * u64::from(tp_size) + u64::from(tp_rank));
        let global_rank = self.global_rank.as_ref().unwrap_or(&default_rank);
        let opt = |name: &str, v: &Option<Int>| v.as_ref().map(|x| field(name, x)).transpose();
        KvShardLayout::new(KvLayoutSpec {
            num_layers: field("num_layers", &self.num_layers)?,
            num_kv_heads: field("num_kv_heads", heads)?,
            ranks: RankCoords {
                tp_size,
                tp_rank,
                pp_size,
                pp_rank,
                global_rank: field("global_rank", global_rank)?,
                ep_rank,
                etp_rank,
            },
            ep_size,
            etp_size,
            layer_start: opt("layer_start", &self.layer_start)?,
            num_local_layers: opt("num_local_layers", &self.num_local_layers)?,
        })
    }
}

/// An `SSMStateDims(...)` call: each of `nheads`, `headdim`, `ngroups` given under the
/// reference design's name or its alias (`num_heads`, `head_dim`, `n_groups`), not both;
/// `ngroups` defaults to 1.
pub fn dims_call(
    [nheads, num_heads]: [Option<Int>; 2],
    [headdim, head_dim]: [Option<Int>; 2],
    [ngroups, n_groups]: [Option<Int>; 2],
    d_state: Option<Int>,
    d_conv: &Int,
) -> DisaggResult<SsmStateDims> {
    let heads =
        required("nheads (or num_heads)", one_of("nheads", nheads, "num_heads", num_heads)?)?;
    let dim = required("headdim (or head_dim)", one_of("headdim", headdim, "head_dim", head_dim)?)?;
    let groups = one_of("ngroups", ngroups, "n_groups", n_groups)?.unwrap_or_else(|| Int::of(1));
    SsmStateDims::new(
        field("num_heads", &heads)?,
        field("head_dim", &dim)?,
        field("d_state", &required("d_state", d_state)?)?,
        field("n_groups", &groups)?,
        field("d_conv", d_conv)?,
    )
}

/// The parameter name of each argument of an `SSMShardLayout(*args, **kwargs)` call: the
/// positional ones in the call form's order (see [`SsmLayoutSpec::call_order`]), then the
/// `keywords` in order; else the `TypeError` message Python gives for the call.
fn ssm_call_names(
    n_positional: usize,
    second_is_dims: bool,
    keywords: &[&str],
) -> Result<Vec<&'static str>, String> {
    let order =
        SsmLayoutSpec::call_order(n_positional, second_is_dims, keywords.contains(&"num_layers"));
    if n_positional > order.len() {
        let (n, names) = (order.len(), order.join(", "));
        return Err(format!(
            "SSMShardLayout takes at most {n} positional arguments ({names}), {n_positional} given"
        ));
    }
    let mut names = order[..n_positional].to_vec();
    for &key in keywords {
        let Some(&name) = SsmLayoutSpec::CALL_KEYS.iter().find(|&&n| n == key) else {
            return Err(format!("SSMShardLayout got an unexpected keyword argument {key:?}"));
        };
        if names.contains(&name) {
            return Err(format!("SSMShardLayout got multiple values for argument {name:?}"));
        }
        names.push(name);
    }
    Ok(names)
}

/// One argument of an `SSMShardLayout(*args, **kwargs)` call as a binding holds it, read as
/// the parameter it binds to needs (see [`ssm_layout_call`]).
pub trait SsmCallArg: Sized {
    /// The binding's error.
    type Error;
    /// A core error as the binding's.
    fn error(e: DisaggError) -> Self::Error;
    /// The `TypeError` Python gives for arguments that bind to no parameters.
    fn call_error(message: String) -> Self::Error;
    /// Whether the argument is dims (an `SSMStateDims` or a dict): picks the call form.
    fn is_dims(&self) -> bool;
    /// The argument as an integer.
    fn int(&self) -> Int;
    /// The argument as a bool.
    fn flag(&self) -> Flag;
    /// The argument as dims.
    fn dims(&self) -> Result<SsmStateDims, Self::Error>;
}

/// The layout of an `SSMShardLayout(*positional, **keywords)` call: the arguments bound to
/// their parameters (an argument `None` counts as not given), `dims` read as dims, `replicate_groups` as
/// a bool (default false), every other parameter as an integer field (see
/// [`SsmLayoutSpec::from_call`]); a missing `dims` or stage count is a type error, as Python
/// reports a missing argument.
pub fn ssm_layout_call<A: SsmCallArg>(
    positional: Vec<Option<A>>,
    keywords: Vec<(String, Option<A>)>,
) -> Result<SsmShardLayout, A::Error> {
    let keys: Vec<&str> = keywords.iter().map(|(k, _)| k.as_str()).collect();
    let second_is_dims = positional.get(1).is_some_and(|v| v.as_ref().is_some_and(A::is_dims));
    let names = ssm_call_names(positional.len(), second_is_dims, &keys).map_err(A::call_error)?;
    let values = positional.into_iter().chain(keywords.into_iter().map(|(_, v)| v));
    let given: Vec<_> = names.into_iter().zip(values).filter_map(|(n, v)| Some((n, v?))).collect();
    let get = |name: &str| given.iter().find(|(n, _)| *n == name).map(|(_, v)| v);
    let dims = required("dims", get("dims")).map_err(A::error)?;
    let flag = get("replicate_groups").map(A::flag);
    let replicate = flag.map_or(Ok(false), |f| f.get("replicate_groups")).map_err(A::error)?;
    let dims = dims.dims()?;
    let ints = SsmLayoutSpec::CALL_KEYS
        .iter()
        .filter(|&&k| k != "dims" && k != "replicate_groups")
        .map(|&k| Ok((k, get(k).map(|v| field(k, &v.int())).transpose()?)))
        .collect::<DisaggResult<Vec<_>>>()
        .map_err(A::error)?;
    let spec = SsmLayoutSpec::from_call(&ints, dims, replicate).map_err(|e| match e {
        DisaggError::Argument { field, .. } => {
            let detail = format!("missing required argument {field}");
            DisaggError::argument_type(field, detail)
        }
        e => e,
    });
    spec.and_then(SsmShardLayout::new).map_err(A::error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::Given;

    fn obj_of(v: &WireValue) -> Obj<'_> {
        Obj::of(v, "").unwrap()
    }

    fn fields(e: DisaggError) -> (&'static str, String, String) {
        let kind = e.kind();
        match e {
            DisaggError::Wire { field, detail }
            | DisaggError::Layout { field, detail }
            | DisaggError::ArgumentType { field, detail } => (kind, field, detail),
            other => panic!("{other:?}"),
        }
    }

    fn kv_call() -> KvLayoutCall {
        KvLayoutCall {
            num_layers: Int::of(8),
            num_heads: Some(Int::of(8)),
            num_kv_heads: None,
            parallel: [1, 0, 1, 0, 1, 0, 1, 0].map(Int::of),
            global_rank: None,
            layer_start: None,
            num_local_layers: None,
        }
    }

    #[test]
    fn layouts_and_dims_round_trip_through_their_wire_maps() {
        let mut call = kv_call();
        call.parallel[0] = Int::of(2);
        call.parallel[1] = Int::of(1);
        let kv = call.layout().unwrap();
        assert_eq!(kv.ranks.global_rank, 1);
        assert_eq!(KvShardLayout::from_obj(&obj_of(&kv.to_wire())).unwrap(), kv);
        let dims = SsmStateDims::new(8, 4, 16, 2, 4).unwrap();
        assert_eq!(SsmStateDims::from_obj(&obj_of(&dims.to_wire())).unwrap(), dims);
        let ssm = SsmShardLayout::new(SsmLayoutSpec::single_rank(4, dims)).unwrap();
        assert_eq!(SsmShardLayout::from_obj(&obj_of(&ssm.to_wire())).unwrap(), ssm);
    }

    fn with(v: &WireValue, key: &str, x: Option<WireValue>) -> WireValue {
        let WireValue::Map(mut m) = v.clone() else { panic!() };
        m.retain(|(k, _)| k != key);
        if let Some(x) = x {
            m.push((key.to_owned(), x));
        }
        WireValue::Map(m)
    }

    #[test]
    fn a_wire_map_names_the_missing_unknown_or_mistyped_field() {
        let kv = kv_call().layout().unwrap().to_wire();
        let e = KvShardLayout::from_obj(&obj_of(&with(&kv, "tp_size", None))).unwrap_err();
        assert_eq!(fields(e), ("Wire", "tp_size".into(), "missing required field".into()));
        let typo = with(&kv, "tp_szie", Some(WireValue::Int(2)));
        assert_eq!(fields(KvShardLayout::from_obj(&obj_of(&typo)).unwrap_err()).1, "tp_szie");
        let text = with(&kv, "tp_rank", Some(WireValue::Str("0".into())));
        let (kind, field, detail) = fields(KvShardLayout::from_obj(&obj_of(&text)).unwrap_err());
        assert_eq!((kind, field.as_str()), ("Wire", "tp_rank"));
        assert_eq!(detail, "expected an int, got str \"0\"");
        let big = with(&kv, "tp_rank", Some(WireValue::Int(1 << 40)));
        assert!(fields(KvShardLayout::from_obj(&obj_of(&big)).unwrap_err()).2.contains("2**32"));
        let bad = with(&kv, "tp_rank", Some(WireValue::Int(5)));
        let (kind, _, detail) = fields(KvShardLayout::from_obj(&obj_of(&bad)).unwrap_err());
        assert_eq!(kind, "Layout");
        assert!(detail.contains("tp_rank=5"), "{detail}");
        let dims = SsmStateDims::new(8, 4, 16, 2, 4).unwrap();
        let ssm = SsmShardLayout::new(SsmLayoutSpec::single_rank(4, dims)).unwrap().to_wire();
        let listed = with(&ssm, "dims", Some(WireValue::List(vec![WireValue::Int(8)])));
        let (_, field, detail) = fields(SsmShardLayout::from_obj(&obj_of(&listed)).unwrap_err());
        assert_eq!((field.as_str(), detail.as_str()), ("dims", "expected a dict, got a list"));
    }

    #[test]
    fn a_kv_call_takes_one_head_count_defaults_the_global_rank_and_names_bad_fields() {
        let mut c = kv_call();
        c.num_kv_heads = Some(Int::of(8));
        assert_eq!(fields(c.layout().unwrap_err()).0, "ArgumentType");
        c.num_heads = None;
        assert_eq!(c.layout().unwrap().num_kv_heads, 8);
        c.num_kv_heads = None;
        assert_eq!(fields(c.layout().unwrap_err()).1, "num_heads (or num_kv_heads)");
        let mut c = kv_call();
        c.parallel[0] = Int::of(-1);
        assert_eq!(
            fields(c.layout().unwrap_err()),
            ("Layout", "tp_size".into(), "tp_size=-1 must be in [0, 2**32)".into())
        );
        c.parallel[0] = Given(Err("a bool (True)".into()));
        assert_eq!(fields(c.layout().unwrap_err()).0, "ArgumentType");
        let mut c = kv_call();
        c.parallel = [u32::MAX.into(), 0, 1, u32::MAX.into(), 1, 0, 1, 0].map(|v: i64| Int::of(v));
        let (kind, field, _) = fields(c.layout().unwrap_err());
        assert_eq!((kind, field.as_str()), ("Layout", "global_rank"));
    }

    #[test]
    fn a_dims_call_takes_either_name_and_defaults_the_groups() {
        let d = dims_call(
            [Some(Int::of(8)), None],
            [None, Some(Int::of(4))],
            [None, None],
            Some(Int::of(16)),
            &Int::of(4),
        )
        .unwrap();
        assert_eq!((d.num_heads, d.head_dim, d.n_groups), (8, 4, 1));
        let e = dims_call(
            [None, None],
            [Some(Int::of(4)), None],
            [None, None],
            Some(Int::of(16)),
            &Int::of(4),
        );
        assert_eq!(fields(e.unwrap_err()).1, "nheads (or num_heads)");
        let e = dims_call(
            [Some(Int::of(8)), None],
            [Some(Int::of(4)), None],
            [None, None],
            None,
            &Int::of(4),
        );
        assert_eq!(fields(e.unwrap_err()).1, "d_state");
    }

    #[test]
    fn an_ssm_call_binds_either_call_form_and_refuses_what_python_would() {
        assert_eq!(
            ssm_call_names(2, true, &["tp_size"]),
            Ok(vec!["num_layers", "dims", "tp_size"])
        );
        assert_eq!(ssm_call_names(2, false, &[]), Ok(vec!["global_rank", "tp_size"]));
        assert!(ssm_call_names(9, true, &[]).unwrap_err().contains("at most 7 positional"));
        assert!(ssm_call_names(0, false, &["tp_szie"]).unwrap_err().contains("unexpected keyword"));
        let twice = ssm_call_names(1, false, &["num_layers", "num_layers"]);
        assert!(twice.unwrap_err().contains("multiple values"));
    }

    /// An argument of a test call.
    #[derive(Debug, Clone, Copy)]
    enum Arg {
        N(i64),
        B(bool),
        D(SsmStateDims),
        None,
    }

    impl SsmCallArg for Arg {
        type Error = DisaggError;
        fn error(e: DisaggError) -> DisaggError {
            e
        }
        fn call_error(message: String) -> DisaggError {
            DisaggError::argument_type("call", message)
        }
        fn is_dims(&self) -> bool {
            matches!(self, Self::D(_))
        }
        fn int(&self) -> Int {
            match *self {
                Self::N(n) => Int::of(n),
                _ => Given(Err(format!("{self:?}"))),
            }
        }
        fn flag(&self) -> Flag {
            match *self {
                Self::B(b) => Flag::of(b),
                _ => Given(Err(format!("{self:?}"))),
            }
        }
        fn dims(&self) -> DisaggResult<SsmStateDims> {
            match *self {
                Self::D(d) => Ok(d),
                _ => Err(DisaggError::argument_type("dims", format!("{self:?}"))),
            }
        }
    }

    /// A call with `Arg::None` as Python's `None`.
    fn call(positional: &[Arg], keywords: &[(&str, Arg)]) -> DisaggResult<SsmShardLayout> {
        let some = |v: Arg| (!matches!(v, Arg::None)).then_some(v);
        let keywords = keywords.iter().map(|&(k, v)| (k.to_owned(), some(v))).collect();
        ssm_layout_call(positional.iter().map(|&v| some(v)).collect(), keywords)
    }

    #[test]
    fn an_ssm_call_reads_dims_the_flag_and_every_other_parameter_as_an_int() {
        let dims = Arg::D(SsmStateDims::new(8, 4, 16, 2, 4).unwrap());
        let l = call(&[Arg::N(4), dims], &[("tp_size", Arg::N(2)), ("tp_rank", Arg::N(1))]);
        let l = l.unwrap();
        assert_eq!(
            (l.layers.len(), l.ranks.tp_size, l.ranks.tp_rank, l.replicate_groups),
            (4, 2, 1, false)
        );
        // The reference design's form: global_rank, tp_size, tp_rank, layer_start, num_layers, dims.
        let r = [Arg::N(1), Arg::N(2), Arg::N(1), Arg::N(0), Arg::N(4), dims];
        let r = call(&r, &[]).unwrap();
        assert_eq!(
            (r.layers, r.ranks.tp_rank, r.ranks.global_rank),
            (l.layers, l.ranks.tp_rank, l.ranks.global_rank)
        );
        let flagged = call(&[Arg::N(4), dims], &[("replicate_groups", Arg::B(true))]);
        assert!(flagged.unwrap().replicate_groups);
        // None is as if not given; a missing dims or stage count is a type error naming it.
        let e = call(&[Arg::N(4), Arg::None], &[]).unwrap_err();
        assert_eq!(
            fields(e),
            ("ArgumentType", "dims".into(), "missing required argument dims".into())
        );
        let e = call(&[], &[("dims", dims), ("layer_start", Arg::N(0))]).unwrap_err();
        assert_eq!(
            fields(e),
            ("ArgumentType", "num_layers".into(), "missing required argument num_layers".into())
        );
        // Each parameter is read as its type: a flag is no int, an int no flag or dims.
        let e = call(&[Arg::N(4), dims], &[("tp_size", Arg::B(true))]).unwrap_err();
        assert_eq!(fields(e).0, "ArgumentType");
        let e = call(&[Arg::N(4), dims], &[("replicate_groups", Arg::N(1))]).unwrap_err();
        assert_eq!(fields(e).1, "replicate_groups");
        assert_eq!(fields(call(&[Arg::N(4), Arg::N(2)], &[]).unwrap_err()).1, "dims");
        let e = call(&[Arg::N(4), dims], &[("tp_size", Arg::N(-1))]).unwrap_err();
        assert_eq!(fields(e).0, "Layout");
        let e = call(&[Arg::N(4), dims], &[("tp_szie", Arg::N(2))]).unwrap_err();
        assert!(fields(e).2.contains("unexpected keyword argument"));
    }
}
