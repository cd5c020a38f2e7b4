use proptest::prelude::*;

use super::*;
use crate::staging::StagingRanges;
use crate::wire::ticket::StreamTicket;

#[test]
fn a_ucx_tls_needs_a_cuda_transport_left() {
    for (tls, ok) in [
        (None, true),
        (Some(""), true),
        (Some("tcp,self,sm"), false),
        (Some("tcp,cuda_copy,cuda_ipc"), true),
        (Some("rc"), false),
        (Some("all"), true),
        (Some("CUDA"), true),
        (Some("^cuda_copy,cuda_ipc,cuda"), false),
        (Some("^cuda_copy,cuda_ipc,gdr_copy"), false),
        (Some("^cuda_copy,cuda_ipc"), true),
        (Some("^ib"), true),
        (Some("rc, \\cuda_ipc"), true),
    ] {
        assert_eq!(ucx_tls_allows_cuda(tls), ok, "{tls:?}");
        assert_eq!(ucx_tls_refusal(tls).is_none(), ok, "{tls:?}");
    }
    assert_eq!(ucx_tls_refusal(Some("rc")).map(|r| r.field), Some("UCX_TLS"));
}

#[test]
fn a_nixl_build_for_another_cuda_major_or_without_vram_is_refused() {
    assert!(nixl_cuda_major_mismatch(Some("nixl-cu12"), Some("13.0")).is_some());
    assert!(nixl_cuda_major_mismatch(Some("nixl_cu13"), Some("13.0")).is_none());
    assert!(nixl_cuda_major_mismatch(Some("nixl-cu13"), None).is_none());
    assert!(nixl_cuda_major_mismatch(Some("nixl"), Some("12.4")).is_none());
    let types = |t: &[&str]| t.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert!(backend_supports_vram(&types(&["DRAM_SEG", "VRAM_SEG"])));
    assert!(!backend_supports_vram(&types(&["DRAM_SEG"])));
    let dram = types(&["DRAM_SEG"]);
    let r = cuda_support_refusal(true, None, Some("12.4"), Some(&dram)).unwrap();
    assert!(r.detail.contains("['DRAM_SEG']"), "{}", r.detail);
    assert!(cuda_support_refusal(true, None, Some("12.4"), None).is_none());
    assert!(cuda_support_refusal(true, Some("nixl_cu12"), Some("13.0"), None).is_some());
    // Host buffers are not checked, whatever the build and its memory types.
    assert!(cuda_support_refusal(false, Some("nixl_cu12"), Some("13.0"), Some(&dram)).is_none());
}

#[test]
fn a_backend_needs_the_nixl_package_and_a_known_mode() {
    for m in [TransferMode::Auto, TransferMode::Direct, TransferMode::Staged] {
        assert_eq!(backend_mode(true, m.name()), Ok(m));
    }
    match backend_mode(false, "auto") {
        Err(Unbuildable::Runtime(r)) => {
            assert_eq!(r.field, "nixl");
            assert!(r.detail.contains("pip install nixl"), "{}", r.detail);
        }
        other => panic!("{other:?}"),
    }
    match backend_mode(true, "Auto") {
        Err(Unbuildable::Argument(DisaggError::Argument { field, detail })) => {
            assert_eq!(field, "mode");
            assert!(detail.contains("got 'Auto'"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn only_an_err_state_refuses_a_post() {
    assert_eq!(
        post_refusal(Some("ERR"), "chunk 3").as_deref(),
        Some("NIXL refused to post chunk 3")
    );
    for state in [Some("PROC"), Some("DONE"), Some("err"), None] {
        assert_eq!(post_refusal(state, "x"), None, "{state:?}");
    }
}

#[test]
fn a_reference_only_peer_is_read_into_a_vram_list() {
    let owned = |(a, b): (&str, &str)| (a.to_owned(), b.to_owned());
    assert_eq!(read_mem_types(false, "DRAM", "DRAM"), owned(("DRAM", "DRAM")));
    assert_eq!(read_mem_types(true, "DRAM", "VRAM"), owned(("VRAM", "VRAM")));
    assert_eq!(read_mem_types(false, "VRAM", "DRAM"), owned(("VRAM", "DRAM")));
}

fn ticket(nbytes: u64, chunk: Option<u64>) -> StagingTicket {
    StagingTicket {
        src_rank: 0,
        incarnation: 1,
        staged: true,
        offset: 0,
        nbytes,
        stream: chunk.map(|c| StreamTicket {
            id: 7,
            chunk_bytes: c,
            slot_bytes: c,
            offsets: vec![0],
        }),
        ready: None,
    }
}

const PLAN: PlanFacts = PlanFacts { tokens_per_block: 4, bytes_per_token: 64, item_bytes: 256 };

fn pool(largest_free: u64) -> DecodePool {
    DecodePool {
        largest_free,
        alignment: 256,
        share: 1,
        on_gpu: true,
        num_tokens: Some(16),
        dst_blocks: 4,
    }
}

#[test]
fn a_copy_that_fits_is_read_whole_else_in_chunks_else_directly() {
    let t = ticket(1024, None);
    assert_eq!(
        source_read(true, Some(&t), Some(PLAN), &pool(4096)),
        SourceRead::Whole { by_plan: true }
    );
    let host = DecodePool { on_gpu: false, ..pool(4096) };
    assert_eq!(
        source_read(true, Some(&t), Some(PLAN), &host),
        SourceRead::Whole { by_plan: false }
    );
    let other_blocks = DecodePool { dst_blocks: 5, ..pool(4096) };
    assert_eq!(
        source_read(true, Some(&t), Some(PLAN), &other_blocks),
        SourceRead::Whole { by_plan: false }
    );
    assert_eq!(
        source_read(true, Some(&t), Some(PLAN), &pool(512)),
        SourceRead::Chunked { slot_bytes_min: 256 }
    );
    assert_eq!(source_read(true, Some(&t), None, &pool(512)), SourceRead::Direct { give_up: true });
    assert_eq!(
        source_read(true, Some(&t), Some(PLAN), &pool(256)),
        SourceRead::Direct { give_up: true }
    );
    let streamed = ticket(1024, Some(512));
    assert_eq!(
        source_read(true, Some(&streamed), Some(PLAN), &pool(4096)),
        SourceRead::Chunked { slot_bytes_min: 512 }
    );
    let too_small = ticket(1024, Some(128));
    assert_eq!(
        source_read(true, Some(&too_small), Some(PLAN), &pool(4096)),
        SourceRead::Direct { give_up: true }
    );
    assert_eq!(
        source_read(true, Some(&ticket(0, None)), Some(PLAN), &pool(4096)),
        SourceRead::Direct { give_up: false }
    );
    assert_eq!(
        source_read(false, Some(&t), Some(PLAN), &pool(4096)),
        SourceRead::Direct { give_up: true }
    );
    assert_eq!(
        source_read(false, None, Some(PLAN), &pool(4096)),
        SourceRead::Direct { give_up: false }
    );
}

proptest! {
    /// A chunked read is chosen only when the pool then gives it its slots.
    #[test]
    fn a_chunked_read_always_gets_its_slots(
        cap in 0u64..1 << 16, held in proptest::collection::vec(1u64..4096, 0..6),
        chunk in proptest::option::of(1u64..4096), share in 1u64..4,
        tpb in 1u64..8, per_tok in 1u64..64, n_tok in 1u64..64,
    ) {
        let mut ranges = StagingRanges::new(cap, 256).unwrap();
        for h in held { let _ = ranges.alloc(h); }
        let plan = PlanFacts { tokens_per_block: tpb, bytes_per_token: per_tok, item_bytes: per_tok * tpb };
        let t = ticket(per_tok * n_tok, chunk);
        let p = DecodePool {
            largest_free: ranges.largest_free(), alignment: 256, share, on_gpu: true,
            num_tokens: Some(n_tok), dst_blocks: n_tok.div_ceil(tpb),
        };
        match source_read(true, Some(&t), Some(plan), &p) {
            SourceRead::Chunked { slot_bytes_min } => {
                let got = ranges.alloc_slots(slot_bytes_min, share, CHUNK_SLOTS);
                prop_assert!(got.is_some_and(|(b, o)| b >= slot_bytes_min && o.len() >= 2));
            }
            SourceRead::Whole { .. } => prop_assert!(t.nbytes <= p.largest_free && chunk.is_none()),
            SourceRead::Direct { give_up } => prop_assert!(give_up || t.nbytes == 0),
        }
    }

    /// Slice reads match a direct computation of every address.
    #[test]
    fn slice_reads_match_the_address_formula(
        ids in proptest::collection::vec((0u64..64, 0u64..64), 0..6), outer in 1u64..4,
        heads in 0u64..3, o0 in 0u64..3, h0 in 0u64..2,
    ) {
        let src = SliceSide { base: 1 << 20, outer_stride: 1 << 12, bytes_per_slice: 64, outer_start: o0, head_start: h0, heads_per_partition: 4, device: 1 };
        let dst = SliceSide { base: 1 << 24, outer_stride: 1 << 13, bytes_per_slice: 32, outer_start: 1, head_start: 0, heads_per_partition: 2, device: 0 };
        let span = HeadSpan { heads, head_bytes: 8, tokens_per_block: 2 };
        let (s, d): (Vec<u64>, Vec<u64>) = ids.iter().copied().unzip();
        let (local, remote) = slice_read_rows(&src, &dst, &s, &d, outer, &span).unwrap();
        let model = |side: &SliceSide, ids: &[u64]| {
            let mut rows = Vec::new();
            for &b in ids { for o in 0..outer {
                let slice = side.base + (side.outer_start + o) * side.outer_stride + b * side.bytes_per_slice;
                if heads == 0 { rows.push([slice, side.bytes_per_slice, side.device]); continue; }
                for t in 0..2 {
                    rows.push([slice + side.head_start * 8 + t * side.heads_per_partition * 8, heads * 8, side.device]);
                }
            } }
            rows
        };
        prop_assert_eq!(local, model(&dst, &d));
        prop_assert_eq!(remote, model(&src, &s));
    }
}

#[test]
fn a_slice_side_and_head_span_read_unstated_fields_as_zero() {
    let side = SliceSide::stated((1 << 20, 4096, 64), (2, 3), None, None);
    let want = SliceSide {
        base: 1 << 20,
        outer_stride: 4096,
        bytes_per_slice: 64,
        outer_start: 2,
        head_start: 3,
        heads_per_partition: 0,
        device: 0,
    };
    assert_eq!(side, want);
    let side = SliceSide::stated((1, 2, 3), (0, 0), Some(8), Some(5));
    assert_eq!((side.heads_per_partition, side.device), (8, 5));
    assert_eq!(
        HeadSpan::stated(4, Some(128), Some(2), Some(16)),
        HeadSpan { heads: 4, head_bytes: 256, tokens_per_block: 16 }
    );
    assert_eq!(
        HeadSpan::stated(4, Some(128), None, None),
        HeadSpan { heads: 4, head_bytes: 0, tokens_per_block: 0 }
    );
    assert_eq!(
        HeadSpan::stated(0, Some(u64::MAX), Some(2), Some(1)).head_bytes,
        u64::MAX,
        "saturates"
    );
}

#[test]
fn slice_reads_of_unequal_id_lists_are_refused() {
    let side = SliceSide::default();
    let err = slice_read_rows(&side, &side, &[1, 2], &[1], 1, &HeadSpan::default()).unwrap_err();
    assert!(matches!(err, DisaggError::Block { ref field, .. } if field == "dst_block_ids"));
}

#[test]
fn ipc_bounds_need_one_block_size_and_every_byte_inside() {
    assert!(ipc_bounds_hold(&[(16, 100, 100, 50), (16, 10, 20, 50)], 50));
    assert!(!ipc_bounds_hold(&[(16, 100, 100, 50), (8, 10, 20, 50)], 50));
    assert!(!ipc_bounds_hold(&[(16, 101, 100, 50)], 50));
    assert!(!ipc_bounds_hold(&[(16, 100, 100, 51)], 50));
    assert!(!ipc_bounds_hold(&[], 50));
}

#[test]
fn a_matched_layout_peer_must_share_the_slice_geometry_it_states() {
    let f = |v: &[(&str, Option<i64>)]| {
        v.iter().map(|(k, x)| ((*k).to_owned(), *x)).collect::<Vec<_>>()
    };
    let mine = f(&[("num_outer", Some(4)), ("bytes_per_slice", Some(64))]);
    assert!(check_matched_slices(
        "p",
        &f(&[("num_outer", Some(4)), ("bytes_per_slice", None)]),
        &mine
    )
    .is_ok());
    let err = check_matched_slices("p", &f(&[("bytes_per_slice", Some(32))]), &mine).unwrap_err();
    assert!(matches!(err, DisaggError::Geometry { ref field, .. } if field == "bytes_per_slice"));
}

#[test]
fn peers_are_registered_once_per_incarnation_and_forgotten_with_the_last_registration() {
    let pair = |n: &str, id: &str| (n.to_owned(), id.to_owned());
    let fresh = || Admission::Register { stale: vec![] };
    let mut t = AgentPeers::default();
    assert!(t.release().is_empty());
    t.retain();
    t.retain();
    assert_eq!(t.admit("a", 1, "d"), fresh());
    assert_eq!(t.register("a", (1, "d"), true, None), Ok("a".into()));
    assert_eq!(t.register("b", (1, "d"), true, Some("id-b".into())), Ok("id-b".into()));
    // A registration NIXL refused is named and records nothing.
    let refused =
        t.register("c", (1, "d"), false, Some("RuntimeError('bad blob')".into())).unwrap_err();
    assert_eq!(refused.field, "agent_metadata");
    assert_eq!(refused.detail, "cannot register NIXL peer 'c': RuntimeError('bad blob')");
    let refused = t.register("c", (1, "d"), false, None).unwrap_err();
    assert_eq!(refused.detail, "cannot register NIXL peer 'c': ");
    let id = AgentPeers::default().register("e", (1, "d"), true, Some(String::new()));
    assert_eq!(id, Ok("e".into()), "an empty id is the peer's name");
    assert_eq!(t.admit("c", 1, "d"), fresh());
    assert_eq!(t.admit("a", 1, "d"), Admission::Known("a".into()));
    // Another incarnation or metadata forgets the old registration, to remove from NIXL.
    assert_eq!(t.admit("a", 2, "d"), Admission::Register { stale: vec![pair("a", "a")] });
    assert_eq!(t.admit("a", 2, "d"), fresh());
    assert_eq!(t.register("a", (2, "d"), true, None), Ok("a".into()));
    assert_eq!(t.admit("a", 2, "e"), Admission::Register { stale: vec![pair("a", "a")] });
    assert_eq!(t.register("a", (1, "d"), true, Some("id-a".into())), Ok("id-a".into()));
    t.register("x", (1, "d"), true, None).unwrap();
    let now: BTreeMap<String, u64> = [("a".to_owned(), 1), ("x".to_owned(), 2)].into();
    assert_eq!(t.stale(&now), vec!["b".to_owned(), "x".to_owned()]);
    assert_eq!(t.forget_stale(&now), vec![pair("b", "id-b"), pair("x", "x")]);
    assert!(t.forget_stale(&now).is_empty());
    assert_eq!(t.forget(&["zz".into()]), vec![]);
    assert!(t.release().is_empty());
    assert_eq!(t.release(), vec![pair("a", "id-a")]);
    assert!(t.peers().is_empty());
    assert!(t.release().is_empty());
    assert_eq!(t.refs(), 0);
}

#[test]
fn slice_reads_are_labelled_and_typed_as_the_reference_design_does() {
    assert_eq!(slice_read_label("p", 1, 2, (0, 0), 3), "matched peer=p outer[1:+2] blocks=3");
    assert_eq!(
        slice_read_label("p", 1, 2, (4, 2), 3),
        "reshard peer=p outer[1:+2] heads[4:+2] blocks=3"
    );
    assert_eq!(slice_read_mem_type(None), "VRAM");
    assert_eq!(slice_read_mem_type(Some("DRAM".into())), "DRAM");
    assert_eq!(agent_backends(true, &["UCX".to_owned()]), Ok(None));
    assert_eq!(
        agent_backends(true, &["GDS".to_owned()]).map(|b| b.map(<[String]>::len)),
        Ok(Some(1))
    );
    let refused = agent_backends(false, &["UCX".to_owned()]).unwrap_err();
    assert_eq!(refused.field, "nixl");
    assert!(refused.detail.contains("pip install nixl"), "{}", refused.detail);
}

#[test]
fn an_agent_is_open_while_a_registration_holds_it() {
    let mut t = AgentPeers::named("rank0");
    let closed = t.check_open().unwrap_err();
    assert_eq!((closed.field, closed.detail.as_str()), ("agent", "NIXL agent 'rank0' is closed"));
    t.retain();
    assert_eq!(t.check_open(), Ok(()));
    assert!(t.release().is_empty());
    assert!(t.check_open().is_err());
}

#[test]
fn a_head_fragment_needs_the_peers_heads_per_partition() {
    let side = SliceSide { bytes_per_slice: 64, heads_per_partition: 2, ..SliceSide::default() };
    let span = HeadSpan { heads: 1, head_bytes: 8, tokens_per_block: 2 };
    let peer = SliceSide { heads_per_partition: 0, ..side };
    let err = slice_read_rows(&peer, &side, &[1], &[1], 1, &span).unwrap_err();
    assert!(matches!(err, DisaggError::Wire { ref field, .. } if field == "heads_per_partition"));
    assert!(slice_read_rows(&side, &side, &[1], &[1], 1, &span).is_ok());
    // Whole slices need no heads.
    assert!(slice_read_rows(&peer, &side, &[1], &[1], 1, &HeadSpan::default()).is_ok());
}

#[test]
fn an_ipc_route_holds_when_every_plans_paged_ends_fit_both_buffers() {
    // One plane row of 16 bytes per token, 4 tokens per block; block strides 64 both sides.
    let table = |tpb| PlaneTable::new(&[[0, 0, 0, 16]], tpb, [64, 16, 64, 16]).unwrap();
    let (a, b) = (table(4), table(2));
    // Last byte + 1 of `n` blocks: (n - 1) * 64 + (tpb - 1) * 16 + 16.
    let end = |t: &PlaneTable, n: u64| {
        let src = t.paged_end(crate::packed_items::SideKind::Src, n).unwrap();
        u64::try_from(src).unwrap()
    };
    assert_eq!(end(&a, 4), 3 * 64 + 64);
    for (src_blocks, src_bytes, dst_blocks, dst_bytes) in
        [(4, 256, 4, 256), (4, 255, 4, 256), (4, 256, 5, 256), (1, 64, 1, 64), (2, 64, 1, 64)]
    {
        let got = ipc_plans_hold(&[(&a, src_blocks, src_bytes)], dst_blocks, dst_bytes).unwrap();
        let model = (end(&a, src_blocks), end(&a, dst_blocks));
        assert_eq!(got, model.0 <= src_bytes && model.1 <= dst_bytes);
        assert_eq!(got, ipc_bounds_hold(&[(4, model.0, src_bytes, model.1)], dst_bytes));
    }
    // Source ranks cutting the prompt into other blocks never share a route.
    assert_eq!(ipc_plans_hold(&[(&a, 1, 1 << 20), (&b, 1, 1 << 20)], 1, 1 << 20), Ok(false));
    assert_eq!(ipc_plans_hold(&[], 1, 1 << 20), Ok(false));
    // A plan whose bytes all lie below the source buffer's base is outside it.
    let below = PlaneTable::new(&[[-4096, 0, 0, 16]], 4, [64, 16, 64, 16]).unwrap();
    assert_eq!(ipc_plans_hold(&[(&below, 1, 1 << 20)], 1, 1 << 20), Ok(false));
}

#[test]
fn a_pull_reads_a_staged_copy_where_the_compiler_prefers_it_and_a_pool_exists() {
    let sources = [(0, "staged".to_owned(), 1024), (1, "direct".to_owned(), 0)];
    let tickets = [(0, ticket(1024, None))];
    let (route, direct) = pull_reads(&sources, &[0, 1], &tickets, 4096).unwrap();
    assert_eq!((route, direct), (vec![(0, true, 1), (1, false, 0)], vec![1]));
    assert!(pull_reads(&sources, &[0, 1], &tickets, 0).is_err());
    let (route, direct) = pull_reads(&sources, &[0, 1], &[], 0).unwrap();
    assert_eq!((route, direct), (vec![(0, false, 0), (1, false, 0)], vec![0, 1]));
}

#[test]
fn gpu_buffers_turn_the_memtype_cache_off_unless_set_and_need_a_cuda_transport() {
    let set = |on_gpu, tls, cache| ucx_env(on_gpu, tls, cache);
    assert_eq!(set(true, None, None), Ok(vec![("UCX_MEMTYPE_CACHE", "n")]));
    assert_eq!(set(true, Some("cuda_copy"), Some("y")), Ok(vec![]));
    // Host memory may use any transports and keeps UCX's defaults.
    assert_eq!(set(false, Some("tcp,self,sm"), None), Ok(vec![]));
    let refused = set(true, Some("tcp,self,sm"), None).unwrap_err();
    assert_eq!(refused, ucx_tls_refusal(Some("tcp,self,sm")).unwrap());
}

#[test]
fn a_source_plan_is_the_read_and_the_memory_types_of_its_reads() {
    let t = ticket(1024, None);
    for (staged, plan, free, reference_only) in
        [(false, None, 4096, false), (true, Some(PLAN), 4096, true), (true, Some(PLAN), 512, false)]
    {
        let peer = (reference_only, "DRAM");
        let (read, mems) = source_plan(staged, Some(&t), plan, &pool(free), peer, "DRAM");
        assert_eq!(read, source_read(staged, Some(&t), plan, &pool(free)));
        assert_eq!(mems, read_mem_types(reference_only, "DRAM", "DRAM"));
    }
}

#[test]
fn a_setup_checks_the_package_and_mode_before_the_ucx_transports() {
    let gpu_env = vec![("UCX_MEMTYPE_CACHE", "n")];
    assert_eq!(setup(true, "staged", true, None, None), Ok((TransferMode::Staged, gpu_env)));
    assert_eq!(setup(true, "direct", false, Some("tcp"), None), Ok((TransferMode::Direct, vec![])));
    // The package and the mode come first: a bad UCX_TLS is not reached.
    for (have, mode) in [(false, "auto"), (true, "fast")] {
        let want = backend_mode(have, mode).unwrap_err();
        assert_eq!(setup(have, mode, true, Some("tcp"), None), Err(want));
    }
    let refused = ucx_tls_refusal(Some("tcp")).unwrap();
    assert_eq!(setup(true, "auto", true, Some("tcp"), None), Err(Unbuildable::Runtime(refused)));
}

#[test]
fn a_source_packs_unless_read_directly_and_needs_a_pool_when_it_does() {
    use TransferMode::{Auto, Direct, Staged};
    for (mode, on_gpu, same_host, packs) in [
        (Auto, false, false, true),
        (Staged, true, false, true),
        (Direct, false, false, false),
        (Auto, true, true, false),
        (Staged, true, true, false),
        // Host memory exports no CUDA IPC mapping: one host changes nothing.
        (Auto, false, true, true),
    ] {
        assert_eq!(source_packs(mode, on_gpu, same_host), packs, "{mode:?} {on_gpu} {same_host}");
    }
    assert_eq!(source_stages(1, &[0, 1], 4096), Ok(true));
    assert_eq!(source_stages(2, &[0, 1], 4096), Ok(false));
    assert_eq!(source_stages(2, &[0, 1], 0), Ok(false));
    match source_stages(1, &[0, 1], 0) {
        Err(DisaggError::Capacity { resource, detail }) => {
            assert_eq!(resource, "staging_bytes");
            assert!(detail.contains("staging_bytes > 0"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_plans_facts_are_its_block_size_token_bytes_and_largest_item() {
    let table = PlaneTable::new(&[[0, 0, 0, 16], [64, 64, 64, 48], [8, 8, 256, 8]], 4, [0; 4]);
    let facts = PlanFacts::of(&table.unwrap());
    let want = PlanFacts { tokens_per_block: 4, bytes_per_token: 72, item_bytes: 48 * 4 };
    assert_eq!(facts, want);
}
