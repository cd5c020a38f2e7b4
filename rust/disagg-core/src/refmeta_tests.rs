use super::*;

fn map(pairs: &[(&str, WireValue)]) -> WireValue {
    WireValue::Map(pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect())
}

fn i(v: i128) -> WireValue {
    WireValue::Int(v)
}

/// A TP2 rank 1 cache `[2, L=4, B=8, T=16, H=2, d=8]` of 4-byte elements, as the reference
/// design exports it.
fn reference_kv() -> Vec<(&'static str, WireValue)> {
    let bps = 16 * 2 * 8 * 4;
    vec![
        ("agent_name", WireValue::Str("p1".into())),
        ("base_addr", i(1 << 20)),
        ("outer_stride_bytes", i(8 * bps)),
        ("num_outer", i(8)),
        ("bytes_per_slice", i(bps)),
        ("blocks_axis", i(2)),
        ("num_blocks", i(8)),
        ("heads_per_partition", i(2)),
        ("head_dim", i(8)),
        ("tokens_per_block", i(16)),
        ("element_size", i(4)),
        ("global_rank", i(1)),
        ("tp_size", i(2)),
        ("tp_rank", i(1)),
        ("pp_size", i(1)),
        ("pp_rank", i(0)),
        ("num_layers_global", i(4)),
        ("num_kv_heads_global", i(4)),
        ("layer_start", i(0)),
        ("layer_end", i(4)),
        ("agent_metadata_b64", WireValue::Str("blob".into())),
    ]
}

fn local() -> LocalFacts {
    LocalFacts {
        backend: "nixl".into(),
        state_kind: "kv".into(),
        element_size: 4,
        dtype: "torch.float32".into(),
    }
}

fn field_of(e: &DisaggError) -> (&'static str, String) {
    match e {
        DisaggError::Wire { field, .. }
        | DisaggError::Geometry { field, .. }
        | DisaggError::Layout { field, .. } => (e.kind(), field.clone()),
        other => (other.kind(), String::new()),
    }
}

#[test]
fn a_reference_kv_peer_reads_as_our_schema_with_its_layout_and_geometry() {
    let out = meta_from_reference(&map(&reference_kv()), &local()).unwrap();
    let o = Obj::of(&out, "").unwrap();
    assert_eq!(o.name("backend").unwrap(), "nixl");
    assert_eq!(o.name("dtype").unwrap(), "torch.float32");
    assert_eq!(o.name("agent_metadata").unwrap(), "blob");
    assert!(o.flag("reference_only").unwrap());
    let g = KvGeometry::from_wire(&o.obj("geometry", "geometry").unwrap()).unwrap();
    let s = g.spec();
    assert_eq!((s.num_kv, s.num_layers, s.num_heads, s.head_dim), (2, 4, 2, 8));
    assert_eq!((s.token_stride, s.head_stride), (2 * 8 * 4, 8 * 4));
    assert_eq!(s.plane_bases[1] - s.plane_bases[0], 8 * 16 * 2 * 8 * 4);
    let l = o.obj("layout", "layout").unwrap();
    assert_eq!((l.u32("tp_rank").unwrap(), l.u32("num_kv_heads").unwrap()), (1, 4));
    assert_eq!(o.obj("buffer", "buffer").unwrap().name("mem_type").unwrap(), "VRAM");
}

#[test]
fn a_peer_without_layout_fields_is_a_matched_layout_of_whole_slices() {
    let mut m = reference_kv();
    m.retain(|(k, _)| !REFERENCE_LAYOUT_FIELDS.contains(k));
    let out = meta_from_reference(&map(&m), &LocalFacts { element_size: 2, ..local() }).unwrap();
    let o = Obj::of(&out, "").unwrap();
    assert_eq!(o.name("dtype").unwrap(), "4-byte elements");
    let g = KvGeometry::from_wire(&o.obj("geometry", "geometry").unwrap()).unwrap();
    assert_eq!((g.spec().num_kv, g.spec().num_layers, g.spec().head_dim), (1, 8, 256));
}

#[test]
fn every_wrong_field_is_refused_naming_it() {
    for (key, value, want) in [
        ("bytes_per_slice", None, ("Wire", "bytes_per_slice")),
        ("num_outer", Some(i(-2)), ("Wire", "num_outer")),
        ("agent_metadata_b64", None, ("Wire", "agent_metadata_b64")),
        ("transport", Some(WireValue::Str("nccl".into())), ("Wire", "transport")),
        ("num_outer", Some(i(6)), ("Geometry", "num_outer")),
        ("head_dim", Some(i(4)), ("Geometry", "bytes_per_slice")),
        ("tp_size", Some(i(0)), ("Layout", "tp_size")),
        ("layer_end", None, ("Wire", "layer_end")),
        ("ssm_layout", Some(map(&[])), ("Wire", "ssm_layout")),
    ] {
        let mut m = reference_kv();
        m.retain(|(k, _)| *k != key);
        if let Some(v) = value {
            m.push((key, v));
        }
        let e = meta_from_reference(&map(&m), &local()).unwrap_err();
        assert_eq!(field_of(&e), (want.0, want.1.to_owned()), "{key}: {e}");
    }
    let nccl = LocalFacts { backend: "nccl".into(), ..local() };
    let mut m = reference_kv();
    m.push(("transport", WireValue::Str("nccl".into())));
    let e = meta_from_reference(&map(&m), &nccl).unwrap_err();
    assert_eq!(field_of(&e).1, "nccl_rank");
    m.push(("nccl_rank", i(3)));
    let out = meta_from_reference(&map(&m), &nccl).unwrap();
    assert_eq!(Obj::of(&out, "").unwrap().u32("dist_rank").unwrap(), 3);
}
