//! A tensor and the backend layout arguments as the bindings read them from Python objects,
//! and the checks that turn them into a [`TensorView`] and [`LayoutArgs`].

use crate::args::{Int, Kind};
use crate::buffer::LayoutArgs;
use crate::error::{DisaggError, DisaggResult};
use crate::geometry::TensorView;

/// A tensor's attributes as read: torch gives strides in elements, numpy in bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    /// Address of element 0.
    pub ptr: u64,
    /// `shape`.
    pub shape: Vec<i64>,
    /// `stride()` (torch, elements) or `strides` (numpy, bytes).
    pub strides: Vec<i64>,
    /// Whether `strides` counts elements (torch) rather than bytes (numpy).
    pub strides_in_elements: bool,
    /// Bytes per element.
    pub element_size: u32,
    /// `str(dtype)` (`torch.bfloat16`, `float16`), if the tensor has one.
    pub dtype: Option<String>,
    /// The device index, if the tensor names one.
    pub device: Option<u64>,
}

/// Every entry of `v` as `u64`: a negative one is a `Geometry` error naming `field`.
fn nonneg(field: &str, v: &[i64]) -> DisaggResult<Vec<u64>> {
    let one = |&x: &i64| {
        u64::try_from(x).map_err(|_| {
            DisaggError::geometry(field, format!("{field} has a negative entry {x}; not supported"))
        })
    };
    v.iter().map(one).collect()
}

impl TensorView {
    /// The view of a tensor read as `raw`: shape and strides non-negative, strides in bytes
    /// (an overflow is an `AddressOverflow` error), the dtype without its `torch.` prefix.
    pub fn from_raw(raw: &RawTensor) -> DisaggResult<Self> {
        let shape = nonneg("shape", &raw.shape)?;
        let strides = if raw.strides_in_elements {
            let size = u64::from(raw.element_size);
            nonneg("stride", &raw.strides)?
                .into_iter()
                .map(|s| s.checked_mul(size))
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| DisaggError::overflow("tensor stride in bytes exceeds u64"))?
        } else {
            nonneg("strides", &raw.strides)?
        };
        let dtype = raw.dtype.as_ref().map(|s| s.strip_prefix("torch.").unwrap_or(s).to_owned());
        Ok(Self {
            ptr: raw.ptr,
            shape,
            strides,
            element_size: raw.element_size,
            dtype,
            device: raw.device,
        })
    }
}

/// `Some(&mut a.<name>)` for the listed field spelled `name`, `None` for any other name.
macro_rules! field_named {
    ($a:ident, $name:expr; $($field:ident),+ $(,)?) => {
        match $name {
            $(stringify!($field) => Some(&mut $a.$field),)+
            _ => None,
        }
    };
}

impl LayoutArgs {
    /// The layout arguments given by name (`tp_size=...`), each an int of any size; a name
    /// that is not a layout argument is a type error naming it.
    pub fn from_named(named: &[(&str, Option<&Int>)]) -> DisaggResult<Self> {
        let mut a = Self::default();
        for &(name, value) in named {
            let Some(slot) = field_named!(a, name;
                tp_size, tp_rank, num_kv_heads_global, heads_per_partition, head_dim,
                tokens_per_block, global_rank, pp_size, pp_rank, num_layers_global,
                layer_start, layer_end
            ) else {
                let detail = format!("`{name}` is not a KV layout argument");
                return Err(DisaggError::argument_type(name, detail));
            };
            *slot = any_int(value, name)?;
        }
        Ok(a)
    }
}

/// An optional int of any size (`None`: not given), else a type error naming `field`.
pub fn any_int(v: Option<&Int>, field: &str) -> DisaggResult<Option<i128>> {
    v.map(|v| v.in_range(Kind::Layout, field, i128::MIN, i128::MAX, "2**127")).transpose()
}

/// The device of SSM state: `given`, else that of the first part naming one, else 0.
pub fn state_device(given: Option<u64>, parts: [Option<u64>; 2]) -> u64 {
    given.or(parts[0]).or(parts[1]).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::Given;

    fn raw(strides: Vec<i64>, in_elements: bool) -> RawTensor {
        RawTensor {
            ptr: 4096,
            shape: vec![2, 3],
            strides,
            strides_in_elements: in_elements,
            element_size: 2,
            dtype: Some("torch.bfloat16".into()),
            device: Some(1),
        }
    }

    #[test]
    fn torch_strides_count_elements_and_numpy_strides_bytes() {
        let t = TensorView::from_raw(&raw(vec![3, 1], true)).unwrap();
        assert_eq!((t.shape.clone(), t.strides.clone()), (vec![2, 3], vec![6, 2]));
        assert_eq!(t.dtype.as_deref(), Some("bfloat16"));
        assert_eq!(TensorView::from_raw(&raw(vec![6, 2], false)).unwrap().strides, vec![6, 2]);
    }

    #[test]
    fn a_negative_extent_or_stride_and_an_overflowing_stride_are_named() {
        let e = TensorView::from_raw(&raw(vec![-3, 1], true)).unwrap_err();
        assert_eq!(
            e,
            DisaggError::geometry("stride", "stride has a negative entry -3; not supported")
        );
        let e = TensorView::from_raw(&raw(vec![-3, 1], false)).unwrap_err();
        assert!(matches!(e, DisaggError::Geometry { field, .. } if field == "strides"));
        let mut r = raw(vec![3, 1], true);
        r.shape = vec![-1, 3];
        assert!(
            matches!(TensorView::from_raw(&r).unwrap_err(), DisaggError::Geometry { field, .. } if field == "shape")
        );
        let mut r = raw(vec![i64::MAX, 1], true);
        r.element_size = 4;
        assert_eq!(TensorView::from_raw(&r).unwrap_err().kind(), "AddressOverflow");
    }

    #[test]
    fn ssm_state_takes_the_given_device_else_its_first_parts() {
        assert_eq!(state_device(Some(3), [Some(1), Some(2)]), 3);
        assert_eq!(state_device(None, [None, Some(2)]), 2);
        assert_eq!(state_device(None, [Some(1), Some(2)]), 1);
        assert_eq!(state_device(None, [None, None]), 0);
    }

    #[test]
    fn layout_arguments_are_read_by_name_and_an_unknown_name_is_a_type_error() {
        let (two, big) = (Int::of(2), Int::from(i128::from(u64::MAX) * 4));
        let a = LayoutArgs::from_named(&[
            ("tp_size", Some(&two)),
            ("layer_end", Some(&big)),
            ("pp_size", None),
        ])
        .unwrap();
        assert_eq!(
            (a.tp_size, a.layer_end, a.pp_size),
            (Some(2), Some(i128::from(u64::MAX) * 4), None)
        );
        let e = LayoutArgs::from_named(&[("tp_szie", Some(&two))]).unwrap_err();
        assert_eq!(
            e,
            DisaggError::argument_type("tp_szie", "`tp_szie` is not a KV layout argument")
        );
        let text = Given(Err("a str ('2')".to_owned()));
        let e = LayoutArgs::from_named(&[("tp_size", Some(&text))]).unwrap_err();
        assert_eq!(e.kind(), "ArgumentType");
    }
}
