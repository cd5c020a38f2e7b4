use proptest::prelude::*;

use super::*;
use crate::layout::{SsmLayoutSpec, SsmStateDims};

/// A contiguous tensor view of `shape` (byte strides from `es`).
fn view(shape: &[u64], es: u32) -> TensorView {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = u64::from(es);
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i];
    }
    TensorView {
        ptr: 4096,
        shape: shape.to_vec(),
        strides,
        element_size: es,
        dtype: Some("float32".into()),
        device: None,
    }
}

fn args(shape: &[u64], blocks: i128) -> BufferArgs {
    BufferArgs {
        backend: "B".into(),
        view: view(shape, 4),
        contiguous: true,
        expected_num_blocks: blocks,
        ..BufferArgs::default()
    }
}

fn field(e: &DisaggError) -> (&'static str, String) {
    match e {
        DisaggError::Geometry { field, .. } => ("Geometry", field.clone()),
        DisaggError::Layout { field, .. } => ("Layout", field.clone()),
        other => (other.kind(), String::new()),
    }
}

#[test]
fn a_megatron_kv_cache_infers_its_layout_from_the_shape() {
    let p = plan_buffer(&args(&[2, 3, 5, 4, 2, 8], 5), None).unwrap();
    let StateLayout::Kv(l) = p.layout else { panic!("a KV layout") };
    assert_eq!((p.state_kind, p.axes.as_str()), ("kv", KV_AXES));
    assert_eq!((l.num_layers, l.num_kv_heads, l.heads.len()), (3, 2, 2));
    assert_eq!((p.head_dim, p.tokens_per_block), (8, Some(4)));
    let r = &p.reference;
    assert_eq!((r.blocks_axis, r.num_outer, r.bytes_per_slice), (2, 6, 4 * 2 * 8 * 4));
    assert_eq!(r.outer_stride_bytes, 5 * r.bytes_per_slice);
    assert_eq!((r.heads_per_partition, r.layout), (Some(2), Some(l)));
}

/// Layout arguments giving only the TP and PP coordinates.
fn grid(tp_size: i128, tp_rank: i128, pp_size: i128, pp_rank: i128) -> LayoutArgs {
    LayoutArgs {
        tp_size: Some(tp_size),
        tp_rank: Some(tp_rank),
        pp_size: Some(pp_size),
        pp_rank: Some(pp_rank),
        ..LayoutArgs::default()
    }
}

#[test]
fn tp_and_pp_arguments_scale_the_model_totals() {
    let mut a = args(&[2, 3, 5, 4, 2, 8], 5);
    a.kv = grid(2, 1, 2, 1);
    let StateLayout::Kv(l) = plan_buffer(&a, None).unwrap().layout else { panic!("KV") };
    assert_eq!((l.num_layers, l.num_kv_heads, l.ranks.global_rank), (6, 4, 3));
    assert_eq!((l.layers.lo, l.heads.lo), (3, 2));
}

#[test]
fn an_argument_that_disagrees_with_the_buffer_is_named() {
    for (set, name) in [
        (LayoutArgs { head_dim: Some(64), ..LayoutArgs::default() }, "head_dim"),
        (LayoutArgs { tokens_per_block: Some(3), ..LayoutArgs::default() }, "tokens_per_block"),
        (
            LayoutArgs { heads_per_partition: Some(1), ..LayoutArgs::default() },
            "heads_per_partition",
        ),
        (
            LayoutArgs { layer_start: Some(0), layer_end: Some(2), ..LayoutArgs::default() },
            "layer_end",
        ),
    ] {
        let mut a = args(&[2, 3, 5, 4, 2, 8], 5);
        a.kv = set;
        let e = plan_buffer(&a, None).unwrap_err();
        assert_eq!(field(&e), ("Geometry", name.to_owned()), "{e}");
    }
    let e = plan_buffer(&args(&[2, 3, 5, 4, 2, 8], 6), None).unwrap_err();
    assert_eq!(field(&e).1, "expected_num_blocks");
}

#[test]
fn a_non_contiguous_buffer_and_a_per_layer_ssm_state_are_refused() {
    let mut a = args(&[2, 3, 5, 4, 2, 8], 5);
    a.contiguous = false;
    assert_eq!(field(&plan_buffer(&a, None).unwrap_err()).1, "memory_buffer");
    let mut a = args(&[2, 3, 5, 4, 2, 8], 5);
    a.per_layer = true;
    a.ssm_state_kind = Some("conv".into());
    assert_eq!(field(&plan_buffer(&a, None).unwrap_err()), ("Layout", "memory_buffer".into()));
}

#[test]
fn a_buffer_of_other_rank_is_a_matched_layout_of_whole_slices() {
    let p = plan_buffer(&args(&[3, 7, 10], 7), None).unwrap();
    assert_eq!((p.axes.as_str(), p.head_dim, p.tokens_per_block), (MATCHED_AXES, 10, Some(1)));
    let StateLayout::Kv(l) = p.layout else { panic!("a KV layout") };
    assert_eq!((l.num_layers, l.num_kv_heads), (3, 1));
    assert_eq!(p.reference.layout, None);
    let e = plan_buffer(&args(&[3, 3, 5], 3), None).unwrap_err();
    assert!(e.to_string().contains("2 axes of memory_buffer shape [3, 3, 5]"), "{e}");
    let e = plan_buffer(&args(&[3, 7, 0], 7), None).unwrap_err();
    assert!(e.to_string().contains("holds no bytes per block"), "{e}");
}

fn ssm_layout() -> SsmShardLayout {
    let dims = SsmStateDims::new(4, 2, 3, 2, 4).unwrap();
    SsmShardLayout::new(SsmLayoutSpec::single_rank(2, dims)).unwrap()
}

#[test]
fn ssm_state_is_checked_against_the_shape_its_layout_gives() {
    let l = ssm_layout();
    let mut a = args(&[2, 3, 4, 2, 3], 3);
    a.ssm_layout = Some(l);
    a.ssm_state_kind = Some("recurrent".into());
    let p = plan_buffer(&a, None).unwrap();
    assert_eq!(
        (p.state_kind, p.axes.as_str(), p.head_dim),
        ("recurrent", "layer slot head p n", 2)
    );
    assert_eq!((p.reference.blocks_axis, p.reference.num_outer), (1, 2));
    a.view = view(&[2, 3, 4, 2, 4], 4);
    let e = plan_buffer(&a, None).unwrap_err();
    assert!(e.to_string().contains("recurrent buffer shape [2, 3, 4, 2, 4] != [2, 3, 4, 2, 3]"));
    a.ssm_state_kind = Some("x".into());
    assert_eq!(field(&plan_buffer(&a, None).unwrap_err()), ("Layout", "ssm_state_kind".into()));
}

#[test]
fn a_full_reference_layout_is_checked_against_the_buffer() {
    let mut a = args(&[2, 3, 5, 4, 2, 8], 5);
    a.kv = LayoutArgs {
        global_rank: Some(0),
        num_layers_global: Some(3),
        num_kv_heads_global: Some(2),
        heads_per_partition: Some(2),
        head_dim: Some(8),
        tokens_per_block: Some(4),
        layer_start: Some(0),
        layer_end: Some(3),
        ..grid(1, 0, 1, 0)
    };
    let r = reference_geometry(&a).unwrap();
    assert_eq!(r.layout.map(|l| l.layers.len()), Some(3));
    a.kv.heads_per_partition = Some(1);
    assert_eq!(field(&reference_geometry(&a).unwrap_err()).1, "heads_per_partition");
}

#[test]
fn register_answers_the_reference_alone_or_the_plan_with_the_state_layout() {
    let mut a = args(&[2, 3, 4, 2, 3], 3);
    a.ssm_layout = Some(ssm_layout());
    a.ssm_state_kind = Some("recurrent".into());
    let r = register(&a, None, true).unwrap();
    assert_eq!(r, Registration::Reference(reference_geometry(&a).unwrap()));
    let Registration::Plan(p) = register(&a, None, false).unwrap() else { panic!("a plan") };
    assert_eq!(p.layout, StateLayout::Ssm(ssm_layout()));
    assert_eq!(p, plan_buffer(&a, None).unwrap());
    // The checks come before the per-layer list is read.
    a.contiguous = false;
    let bad = [LayerTensors::One(view(&[1], 4))];
    assert_eq!(field(&register(&a, Some(&bad), false).unwrap_err()).1, "memory_buffer");
    assert!(register(&a, Some(&bad), true).is_ok());
}

#[test]
fn a_per_layer_list_is_read_as_tensors_or_as_k_v_pairs_like_its_first_entry() {
    let layer = view(&[2, 5, 4, 2, 8], 4);
    let mut a = args(&[2, 5, 4, 2, 8], 5);
    a.per_layer = true;
    let at = |v: &TensorView, i: u64| TensorView { ptr: v.ptr + (i << 20), ..v.clone() };
    let ones: Vec<_> = (0..3).map(|i| LayerTensors::One(at(&layer, i))).collect();
    let Registration::Plan(p) = register(&a, Some(&ones), false).unwrap() else { panic!() };
    assert_eq!(p.axes, LAYER_KV_AXES);
    let StateLayout::Kv(layout) = p.layout else { panic!("a KV layout") };
    assert_eq!((layout.layers.len(), layout.heads.len()), (3, 2));
    let half = view(&[5, 4, 2, 8], 4);
    let pairs: Vec<_> =
        (0..2).map(|i| LayerTensors::Pair(at(&half, i), at(&half, i + 2))).collect();
    let spec = KvGeometrySpec::from_layers(&pairs, "block token head dim", None).unwrap();
    assert_eq!((spec.num_kv, spec.num_layers), (2, 2));
    let (keys, values) = ([at(&half, 0), at(&half, 1)], [at(&half, 2), at(&half, 3)]);
    let want = KvGeometrySpec::from_kv_layer_tensors(&keys, &values, "block token head dim", None);
    assert_eq!(spec, want.unwrap());
    let mixed = [pairs[0].clone(), LayerTensors::One(half.clone())];
    let e = KvGeometrySpec::from_layers(&mixed, "block token head dim", None).unwrap_err();
    assert!(e.to_string().contains("tensors[1] is a tensor, not a (K, V) pair"), "{e}");
    let mixed = [LayerTensors::One(half.clone()), pairs[0].clone()];
    let e = KvGeometrySpec::from_layers(&mixed, "block token head dim", None).unwrap_err();
    assert_eq!(field(&e), ("Geometry", "tensors".into()));
}

#[test]
fn ssm_state_tensors_take_the_given_device_else_the_first_named() {
    let (mut c, mut r) = (view(&[2, 3, 4, 2], 4), view(&[2, 3, 4, 2, 3], 4));
    r.device = Some(5);
    let g = SsmGeometry::from_tensors(Some(&c), Some(&r), None).unwrap();
    assert_eq!((g.device_id, g.num_layers(), g.num_slots()), (5, 2, 3));
    c.device = Some(4);
    assert_eq!(SsmGeometry::from_tensors(Some(&c), Some(&r), None).unwrap().device_id, 4);
    assert_eq!(SsmGeometry::from_tensors(None, Some(&r), Some(1)).unwrap().device_id, 1);
    let e = SsmGeometry::from_tensors(Some(&r), None, None).unwrap_err();
    assert_eq!(field(&e), ("Geometry", "conv".into()));
}

proptest! {
    /// Oracle: the reference geometry's slices tile the buffer exactly, whatever the shape
    /// and blocks axis.
    #[test]
    fn reference_slices_tile_the_buffer(
        shape in proptest::collection::vec(1u64..6, 1..6),
        pick in 0usize..6,
        es in prop_oneof![Just(1u32), Just(2), Just(4)],
    ) {
        let axis = pick % shape.len();
        let mut a = args(&shape, i128::from(shape[axis]));
        a.view = view(&shape, es);
        a.blocks_axis = Some(axis as i128);
        let r = reference_geometry(&a).unwrap();
        let total: u64 = shape.iter().product::<u64>() * u64::from(es);
        prop_assert_eq!(r.num_outer * r.outer_stride_bytes, total);
        prop_assert_eq!(r.num_blocks * r.bytes_per_slice, r.outer_stride_bytes);
        prop_assert_eq!(r.num_blocks, shape[axis]);
    }
}
