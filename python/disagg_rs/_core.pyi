# Hand-written stub of the Rust extension; checked by `python -m mypy.stubtest disagg_rs._core`.
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final, Generic, Literal, Self, TypeAlias, TypeVar, final, overload

__version__: str

_Range: TypeAlias = tuple[int, int]
_Band: TypeAlias = Literal["x", "B", "C", "recurrent"]
_T = TypeVar("_T")
_L = TypeVar("_L")

def _sample_errors() -> dict[str, BaseException]: ...
def decode_control_message(data: bytes, to_coordinator: bool = False) -> dict[str, Any]: ...

MAX_TWO_SIDED_REQUEST_ID: int
P2P_HEADER_BYTES: int
PACK_PARTS: int
REFERENCE_LAYOUT_FIELDS: list[str]
REFERENCE_ADDRESS_FIELDS: list[str]

def two_sided_tag(request_id: int, kind: str) -> int: ...
def two_sided_tag_owner(tag: int) -> tuple[int, str]: ...
def p2p_matching(
    group_backend: str, match_by_order: bool | None = None
) -> tuple[bool, bool, bool]: ...

@final
class PeerSteps:
    def __init__(self) -> None: ...
    def check(
        self, peer: int, got: bytes, tag: int, incarnation: int, nbytes: list[int], first: int = 0
    ) -> None: ...
    def refuse(self, peers: list[int]) -> None: ...
    out_of_step: Final[dict[int, str]]

def chunk_schedule(
    pairs: Sequence[tuple[bool, bool, int, int, int, Sequence[int]]],
    slot_bytes: int,
    slots: int,
    match_by_order: bool,
) -> tuple[list[int], list[bytes], list[int]]: ...

@final
class ClientDeadlines:
    def __new__(cls, default_timeout_s: float, grace_s: float) -> ClientDeadlines: ...
    def submit(self, request_id: int, timeout_s: float | None, now: float) -> None: ...
    def answered(self, kind: str, request_id: int | None) -> None: ...
    def expired(self, now: float) -> list[int]: ...

@final
class LinkLiveness:
    def __new__(cls, timeout_s: float | None, now: float) -> LinkLiveness: ...
    def sent(self, kind: str, request_id: int | None, delivered: bool, now: float) -> None: ...
    def receive(
        self, frames: list[bytes], peers: dict[str, Any], now: float
    ) -> tuple[list[dict[str, Any]], dict[str, Any], bool]: ...
    awaiting_registered: Final[bool]
    def awaiting_registration(self, since: float, timeout_s: float, now: float) -> bool: ...
    fenced: Final[int]
    malformed: Final[int]
    def heartbeat_due(self, interval_s: float, now: float) -> bool: ...
    def check(self, now: float) -> list[tuple[int, int]]: ...
    lost: Final[bool]
    last_heard: Final[float]
    def counters(self) -> dict[str, int]: ...

_D = TypeVar("_D")

class _Record(Generic[_D]):
    """Plain data that round-trips through its dict (``to_dict`` / ``from_dict``), and pickles
    through it: the layouts, the SSM dims and the geometries."""

    def to_dict(self) -> _D: ...
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self: ...
    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]: ...
    def __eq__(self, value: object, /) -> bool: ...

class _DataRecord(_Record[_D]):
    """A hashable record that is also a dataclass to ``dataclasses`` (fields, ``asdict``,
    ``replace``): the layouts and the SSM dims."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    def __hash__(self) -> int: ...

@final
class KVShardLayout(_DataRecord[dict[str, int | None]]):
    """One rank's KV slice. The reference design's positional order and keywords; ``num_kv_heads``
    is an alias of ``num_heads`` (give one)."""

    def __new__(
        cls,
        num_layers: int,
        num_heads: int | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
        global_rank: int | None = None,
        ep_size: int = 1,
        ep_rank: int = 0,
        etp_size: int = 1,
        etp_rank: int = 0,
        layer_start: int | None = None,
        num_local_layers: int | None = None,
        *,
        num_kv_heads: int | None = None,
    ) -> KVShardLayout: ...
    num_layers: Final[int]
    num_heads: Final[int]
    num_kv_heads: Final[int]
    tp_size: Final[int]
    tp_rank: Final[int]
    pp_size: Final[int]
    pp_rank: Final[int]
    global_rank: Final[int]
    ep_size: Final[int]
    ep_rank: Final[int]
    etp_size: Final[int]
    etp_rank: Final[int]
    layer_start: Final[int]
    layer_end: Final[int]
    num_local_layers: Final[int]
    head_start: Final[int]
    head_end: Final[int]
    heads_per_partition: Final[int]
    layers: Final[_Range]
    heads: Final[_Range]
    def layer_range(self) -> _Range: ...
    def head_range(self) -> _Range: ...
    def local_num_layers(self) -> int: ...
    def local_num_heads(self) -> int: ...
    def kv_shard_key(self) -> tuple[int, int]: ...
    gqa_replication: Final[int]
    explicit_window: Final[bool]

@final
class SSMStateDims(_DataRecord[dict[str, int]]):
    """Global SSM dims. The reference design's names (``nheads``, ``headdim``, ``ngroups``);
    ``num_heads``, ``head_dim``, ``n_groups`` are keyword aliases (give one of each pair)."""

    def __new__(
        cls,
        nheads: int | None = None,
        headdim: int | None = None,
        d_state: int | None = None,
        ngroups: int | None = None,
        d_conv: int = 4,
        *,
        num_heads: int | None = None,
        head_dim: int | None = None,
        n_groups: int | None = None,
    ) -> SSMStateDims: ...
    nheads: Final[int]
    num_heads: Final[int]
    headdim: Final[int]
    head_dim: Final[int]
    d_state: Final[int]
    ngroups: Final[int]
    n_groups: Final[int]
    d_conv: Final[int]
    conv_channels: Final[int]

@final
class SSMShardLayout(_DataRecord[dict[str, Any]]):
    """One rank's SSM state. Two call forms: the reference design's (``num_layers`` counts the
    stage's layers, ``layer_start`` required) and ours (``num_layers`` is the model's total).
    ``replicate_groups=True`` opts in to ``tp_size > ngroups``."""

    conv_bands: ClassVar[tuple[str, str, str]]
    @overload
    def __new__(
        cls,
        global_rank: int,
        tp_size: int,
        tp_rank: int,
        layer_start: int,
        num_layers: int,
        dims: SSMStateDims | dict[str, int],
        *,
        pp_size: int = 1,
        pp_rank: int = 0,
        ep_rank: int = 0,
        etp_rank: int = 0,
        total_layers: int | None = None,
        replicate_groups: bool = False,
    ) -> SSMShardLayout: ...
    @overload
    def __new__(
        cls,
        num_layers: int,
        dims: SSMStateDims | dict[str, int],
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
        global_rank: int | None = None,
        *,
        ep_rank: int = 0,
        etp_rank: int = 0,
        layer_start: int | None = None,
        num_local_layers: int | None = None,
        total_layers: int | None = None,
        replicate_groups: bool = False,
    ) -> SSMShardLayout: ...
    num_layers: Final[int]
    total_layers: Final[int | None]
    dims: Final[SSMStateDims]
    tp_size: Final[int]
    tp_rank: Final[int]
    pp_size: Final[int]
    pp_rank: Final[int]
    global_rank: Final[int]
    ep_rank: Final[int]
    etp_rank: Final[int]
    replicate_groups: Final[bool]
    layers: Final[_Range]
    def layer_range(self) -> _Range: ...
    layer_map: Final[dict[int, int]]
    layer_start: Final[int]
    layer_end: Final[int]
    num_local_layers: Final[int]
    heads: Final[_Range]
    groups: Final[_Range]
    d_inner: Final[int]
    nheads_local: Final[int]
    d_inner_local: Final[int]
    ngroups_local: Final[int]
    local_conv_channels: Final[int]
    conv_dim_local: Final[int]
    def shard_key(self) -> tuple[int, int]: ...
    def band(self, name: _Band) -> tuple[int, int, int]: ...
    def band_span(self, name: _Band) -> tuple[_Range, _Range]: ...

@final
class KVReshardTransfer:
    src_rank: Final[int]
    dst_rank: Final[int]
    layers: Final[_Range]
    heads: Final[_Range]
    global_layer_lo: Final[int]
    global_layer_hi: Final[int]
    global_head_lo: Final[int]
    global_head_hi: Final[int]
    def src_layer_slice(self, src: KVShardLayout) -> slice: ...
    def src_head_slice(self, src: KVShardLayout) -> slice: ...
    def dst_layer_slice(self, dst: KVShardLayout) -> slice: ...
    def dst_head_slice(self, dst: KVShardLayout) -> slice: ...
    num_layers: Final[int]
    num_heads: Final[int]
    def src_local_layers(self) -> _Range: ...
    def src_local_heads(self) -> _Range: ...
    def dst_local_layers(self) -> _Range: ...
    def dst_local_heads(self) -> _Range: ...
    def bytes_per_token(self, head_dim: int, element_size: int = 2) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

class _ReshardPlan(Sequence[_T], Generic[_T, _L]):
    """What both reshard plans offer: a read-only sequence of transfers over two layout lists."""

    def __len__(self) -> int: ...
    def __getitem__(self, key: int, /) -> _T: ...  # type: ignore[override]
    @property
    def transfers(self) -> list[_T]: ...
    @property
    def srcs(self) -> list[_L]: ...
    @property
    def dsts(self) -> list[_L]: ...
    def for_src(self, global_rank: int) -> list[_T]: ...
    def for_dst(self, global_rank: int) -> list[_T]: ...
    def verify(self) -> None: ...

@final
class KVReshardPlan(_ReshardPlan[KVReshardTransfer, KVShardLayout]):
    def bytes_per_token(self, head_dim: int, element_size: int = 2) -> int: ...

@final
class SSMReshardTransfer:
    src_rank: Final[int]
    dst_rank: Final[int]
    layers: Final[_Range]
    band: Final[_Band]
    is_conv: Final[bool]
    global_layer: Final[int]
    src_layer: Final[int]
    dst_layer: Final[int]
    src_lo: Final[int]
    src_hi: Final[int]
    dst_lo: Final[int]
    dst_hi: Final[int]
    state_kind: Final[Literal["conv", "recurrent"]]
    global_range: Final[_Range]
    src_local: Final[_Range]
    dst_local: Final[_Range]
    def src_local_layers(self) -> _Range: ...
    def dst_local_layers(self) -> _Range: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class SSMReshardPlan(_ReshardPlan[SSMReshardTransfer, SSMShardLayout]):
    """Single-layer transfers (the reference design's records); ``ranges`` merges layers."""

    ranges: Final[list[SSMReshardTransfer]]

def plan_kv_reshard(
    srcs: Sequence[KVShardLayout], dsts: Sequence[KVShardLayout]
) -> KVReshardPlan: ...
def plan_ssm_reshard(
    src_layouts: Sequence[SSMShardLayout], dst_layouts: Sequence[SSMShardLayout]
) -> SSMReshardPlan: ...
def transfer_peer_records(
    peer_meta: Any, src_block_ids: Sequence[int]
) -> list[tuple[dict[str, Any], list[int]]]: ...
def transfer_block_count(peer_meta: Any, src_block_ids: Sequence[int]) -> int: ...
def drop_transfer_prefix_blocks(
    peer_meta: Any, src_block_ids: Sequence[int], prefix_count: int
) -> tuple[Any, list[int]]: ...

# --- pools and ledgers ---

_Outcome: TypeAlias = Literal["ok", "error", "timeout", "may_still_write"]
_ActionKind: TypeAlias = Literal["start", "admit", "complete", "fail", "release"]
_SlotState: TypeAlias = Literal["free", "allocated", "detached"]
_HandoffState: TypeAlias = Literal["deferred", "importing", "ready"]

@final
class BlockPool:
    def __new__(cls, num_blocks: int, block_size_tokens: int) -> BlockPool: ...
    num_blocks: Final[int]
    block_size_tokens: Final[int]
    num_free: Final[int]
    num_evictable: Final[int]
    def can_allocate(self, n: int) -> bool: ...
    def allocate(self, n: int) -> list[int]: ...
    def retain(self, block_ids: Sequence[int]) -> None: ...
    def release(self, block_ids: Sequence[int]) -> None: ...
    def refcount(self, block_id: int) -> int: ...
    def block_hashes(self, tokens: Sequence[int]) -> list[int]: ...
    def register_cached(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None: ...
    def match_prefix(self, hashes: Sequence[int]) -> list[int]: ...
    def check(self) -> None: ...
    def __len__(self) -> int: ...

@final
class PullParts:
    def __new__(
        cls, parts: Sequence[tuple[bool, bool, bool, bool, str]], error: str | None = None
    ) -> PullParts: ...
    error: Final[str | None]
    def begin(self) -> tuple[list[int], list[int], list[int]]: ...
    def observe(
        self,
        landed: Sequence[bool],
        steps: Sequence[tuple[bool, str]],
        xfers: Sequence[tuple[bool, str]],
    ) -> list[int]: ...
    def after_on_done(
        self, asked: Sequence[int], done: Sequence[tuple[bool, str]]
    ) -> list[int]: ...
    def settle(
        self, landed: Sequence[bool], now: float = 0.0, deadline: float = ...
    ) -> tuple[tuple[list[int], list[int], list[int]], bool]: ...
    def cancel(self) -> tuple[list[int], list[int], list[int]]: ...

@final
class StagingRanges:
    def __new__(cls, capacity: int, alignment: int = 256) -> StagingRanges: ...
    capacity: Final[int]
    alignment: Final[int]
    in_use: Final[int]
    largest_free: Final[int]
    def alloc(self, size: int) -> int: ...
    def alloc_slots(
        self, item_bytes: int, share: int, max_slots: int
    ) -> tuple[int, list[int]] | None: ...
    def alloc_stream(
        self,
        item_bytes: int | None,
        peer_staging: Mapping[str, int] | None,
        sources: int,
        share: int,
        max_slots: int,
    ) -> tuple[int, list[int]] | None: ...
    def free(self, offset: int) -> bool: ...
    def free_all(self, offsets: Sequence[int]) -> None: ...
    def ranges(self) -> list[tuple[int, int]]: ...
    def __len__(self) -> int: ...

def stream_abort_msgs(ticket: Any) -> list[bytes]: ...
def staging_release(ticket: Any) -> tuple[int, list[int]]: ...

@final
class StreamSource:
    def __new__(
        cls, stream: int, chunks: Sequence[Sequence[int]], offsets: Sequence[int]
    ) -> StreamSource: ...
    @staticmethod
    def whole(stream: int, offset: int, nbytes: int) -> StreamSource: ...
    def packable(self) -> list[tuple[int, int]]: ...
    def first(self) -> list[tuple[int, int]]: ...
    def poll(
        self, msgs: Sequence[bytes], now: float, deadline: float, gone: bool = False
    ) -> tuple[bool, bool, list[tuple[int, int]]]: ...
    def announce(self, landed: Sequence[bool]) -> list[bytes]: ...
    def close(self, give_up: bool) -> list[bytes]: ...
    def ready(self, chunk: int) -> bytes: ...
    def receive(self, msg: bytes) -> str: ...
    done: Final[bool]
    aborted: Final[bool]
    def __len__(self) -> int: ...

@final
class StreamSink:
    def __new__(
        cls,
        stream: int,
        chunks: Sequence[Sequence[int]],
        src_offsets: Sequence[int],
        slot_bytes: int,
        dst_slots: int,
    ) -> StreamSink: ...
    @staticmethod
    def whole(chunks: Sequence[Sequence[int]], offset: int, dst_slots: int) -> StreamSink: ...
    @staticmethod
    def one_piece(ticket: Any) -> StreamSink: ...
    @staticmethod
    def of_ticket(
        ticket: Any,
        rows: Sequence[tuple[int, int]],
        tokens_per_block: int,
        n_tok: int,
        slot_bytes: int,
        dst_slots: int,
    ) -> StreamSink: ...
    stream_id: Final[int]
    chunks: Final[list[list[int]]]
    kind: Final[str]
    def receive(self, msg: bytes) -> str: ...
    def take(
        self,
        msgs: Sequence[bytes],
        gone: bool = False,
        probed: Sequence[tuple[bool, str]] = ...,
    ) -> str | None: ...
    def probes(self, now: float) -> list[bytes]: ...
    def reads(self) -> list[tuple[int, int, int, list[int]]]: ...
    def observe(
        self, states: Sequence[tuple[int, str]]
    ) -> tuple[list[tuple[int, int]], list[bytes], str | None]: ...
    def scattered(self, completed: Sequence[bool]) -> int: ...
    def landed(self, chunk: int) -> bytes: ...
    status: Final[str]
    def close(self) -> list[bytes]: ...
    done: Final[bool]
    aborted: Final[bool]

@final
class StreamMailboxes:
    def __new__(cls) -> StreamMailboxes: ...
    def open(self, peer: str, stream: int) -> int: ...
    def close(self, id: int) -> None: ...
    def forget_ticket(self, peer: str, ticket: Any) -> None: ...
    def forget(self, peer: str) -> None: ...
    early: Final[int]
    def route(
        self, notifs: Sequence[tuple[str, Sequence[bytes]]], now: float, early_ttl_s: float
    ) -> None: ...
    def take(self, id: int) -> tuple[list[bytes], bool]: ...
    dropped: Final[int]

@final
class SlotPool:
    def __new__(cls, num_slots: int) -> SlotPool: ...
    num_slots: Final[int]
    num_free: Final[int]
    num_detached: Final[int]
    def allocate(self) -> int: ...
    def free(self, slot: int) -> None: ...
    def detach(self, slot: int) -> None: ...
    def state(self, slot: int) -> _SlotState: ...
    def check(self) -> None: ...

@final
class LedgerAction:
    kind: Final[_ActionKind]
    request_id: Final[int]
    epoch: Final[int]
    reason: Final[str | None]
    quarantined: Final[bool]
    token_start: Final[int]
    src_block_ids: Final[list[int]]
    dst_block_ids: Final[list[int]]
    cached_block_ids: Final[list[int]]
    continuation_block_ids: Final[list[int]]
    block_ids: Final[list[int]]
    ssm_slot: Final[int | None]

@final
class ImportLedger:
    def __new__(
        cls,
        num_blocks: int,
        block_size_tokens: int,
        num_ssm_slots: int = 0,
        *,
        world_size: int = 1,
        rank: int = 0,
        pull: bool = True,
        lookahead_tokens: int = 0,
        drain_horizon: int = 30_000_000_000,
        clock_offset_bound: int = 1_000_000_000,
    ) -> ImportLedger: ...
    block_pool: Final[BlockPool]
    slot_pool: Final[SlotPool]
    LEASE_READ_PERCENT: ClassVar[int]
    @staticmethod
    def continuation_blocks(
        prompt_length: int, input_token_count: int, block_size: int, mtp_kv_cache: bool = False
    ) -> int: ...
    @staticmethod
    def batch_fits(
        total_request_count: int,
        max_requests: int,
        active_token_count: int,
        max_tokens: int,
        input_tokens: int,
    ) -> bool: ...
    @staticmethod
    def check_prefilled_admission(
        request_id: int,
        prompt_length: int,
        prompt_blocks: int,
        continuation_blocks: int,
        input_tokens: int,
        *,
        has_ssm_slot: bool,
        block_size: int,
        num_speculative_tokens: int,
        mtp_kv_cache: bool,
        hybrid: bool,
        total_request_count: int,
        max_requests: int,
        active_token_count: int,
        max_tokens: int,
    ) -> None: ...
    @staticmethod
    def import_deadline(request_id: int, now: int, timeout: int, lease_ns: Any = None) -> int: ...
    @staticmethod
    def source_lease(
        request_id: int, lease_until_wall_ns: Any = None, now_wall: int | None = None
    ) -> tuple[int, int] | tuple[None, None]: ...
    @staticmethod
    def resume_finishes(
        resume_tokens: Sequence[int],
        max_new_tokens: int,
        termination_id: int | None = None,
        stop_word_ids: Sequence[Sequence[int]] = [],
    ) -> bool: ...
    def submit(
        self,
        request_id: int,
        prompt_tokens: _BlockIds | None = None,
        *,
        num_prompt_tokens: int | None = None,
        prompt_hashes: Sequence[int] | None = None,
        src_block_ids: Sequence[int],
        src_block_size_tokens: int | None = None,
        resume_tokens: int = 0,
        has_ssm: bool = False,
        finished: bool = False,
        deadline: int,
        now: int,
        reuse_align_tokens: int = 1,
        lease_until_wall: int | None = None,
        now_wall: int | None = None,
    ) -> list[LedgerAction]: ...
    def report(
        self, request_id: int, epoch: int, rank: int, outcome: _Outcome, now: int
    ) -> list[LedgerAction]: ...
    def settle(self, request_id: int, epoch: int) -> list[LedgerAction]: ...
    def abort(self, request_id: int, now: int) -> list[LedgerAction]: ...
    def quarantine_due(self, now: int) -> list[tuple[int, int]]: ...
    def hold_quarantine(self, request_id: int, epoch: int, running: bool, now: int) -> bool: ...
    def poll(self, now: int) -> list[LedgerAction]: ...
    def admit(self, batch_room: int, now: int | None = None) -> list[LedgerAction]: ...
    def reset(self, now: int) -> list[LedgerAction]: ...
    def check(self) -> None: ...
    pending_kv_import_count: Final[int]
    has_admittable_kv_import: Final[bool]
    num_deferred: Final[int]
    num_importing: Final[int]
    num_ready: Final[int]
    num_quarantined: Final[int]
    num_quarantined_blocks: Final[int]
    lookahead_tokens: Final[int]
    def deferred_ids(self) -> list[int]: ...
    def drain_started_pushes(self) -> list[tuple[int, int]]: ...
    def state_of(self, request_id: int) -> _HandoffState | None: ...
    def epoch_of(self, request_id: int) -> int | None: ...
    def counters(self) -> dict[str, int]: ...

@final
class PinLedger:
    def __new__(
        cls, num_blocks: int, block_size_tokens: int, num_ssm_slots: int = 0
    ) -> PinLedger: ...
    block_pool: Final[BlockPool]
    slot_pool: Final[SlotPool]
    def pin(
        self,
        request_id: int,
        block_ids: Sequence[int],
        ssm_slot: int | None = None,
        *,
        lease_until: int,
        now: int,
    ) -> int: ...
    def start_push(
        self, request_id: int, decode_metas: Sequence[Any]
    ) -> tuple[int, list[int], list[int], int, int | None, int | None]: ...
    def filler_push(
        self, request_id: int, decode_metas: Sequence[Any]
    ) -> tuple[int, list[int], list[int], int, int | None, int | None]: ...
    def begin_push(self, request_id: int, epoch: int) -> None: ...
    def push_settled(self, request_id: int, epoch: int) -> list[LedgerAction]: ...
    def release(self, request_id: int, epoch: int | None = None) -> list[LedgerAction]: ...
    def expire(self, now: int) -> list[LedgerAction]: ...
    def reset(self) -> list[LedgerAction]: ...
    def check(self) -> None: ...
    num_pinned: Final[int]
    def pinned_blocks(self, request_id: int) -> list[int] | None: ...
    def pinned_ssm_slot(self, request_id: int) -> int | None: ...
    def pinned_request_ids(self) -> list[int]: ...
    pending_kv_push_count: Final[int]
    def epoch_of(self, request_id: int) -> int | None: ...
    def counters(self) -> dict[str, int]: ...

@final
class CompletionQuorum:
    def __new__(cls, world_size: int) -> CompletionQuorum: ...
    @staticmethod
    def local_outcome(
        failed_locally: bool,
        handle_states: Sequence[Literal["running", "done", "timeout", "error"]],
    ) -> _Outcome | None: ...
    world_size: Final[int]
    ignored: Final[int]
    num_open: Final[int]
    def report(
        self, request_id: int, epoch: int, rank: int, outcome: _Outcome
    ) -> tuple[Literal["success", "failure"], int | None, _Outcome | None] | None: ...
    def forget(self, request_id: int, epoch: int) -> None: ...

# --- descriptor compiler (geometry.rs, compile.rs) ---
import numpy as _np  # noqa: E402  (appended section: stubs stay append-only)
import numpy.typing as _npt  # noqa: E402

_U64Array: TypeAlias = _npt.NDArray[_np.uint64]
_BlockIds: TypeAlias = Sequence[int] | _npt.NDArray[_np.integer[Any]]

@final
class KVGeometry(_Record[dict[str, Any]]):
    def __new__(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        tokens_per_block: int,
        num_heads: int,
        head_dim: int,
        element_size: int,
        block_stride: int,
        token_stride: int,
        head_stride: int,
        plane_bases: Sequence[int],
        num_kv: int = 2,
        device_id: int = 0,
        dtype: str | None = None,
    ) -> KVGeometry: ...
    @classmethod
    def from_tensor(
        cls, tensor: Any, axes: str = "kv layer block token head dim", device_id: int | None = None
    ) -> KVGeometry: ...
    @classmethod
    def from_mla_tensor(cls, tensor: Any, device_id: int | None = None) -> KVGeometry: ...
    @classmethod
    def from_layer_tensors(
        cls, tensors: Any, axes: str = "kv block token head dim", device_id: int | None = None
    ) -> KVGeometry: ...
    num_kv: Final[int]
    num_layers: Final[int]
    num_blocks: Final[int]
    tokens_per_block: Final[int]
    num_heads: Final[int]
    head_dim: Final[int]
    element_size: Final[int]
    strides: Final[tuple[int, int, int]]
    plane_bases: Final[list[int]]
    device_id: Final[int]
    dtype: Final[str | None]

@final
class SSMGeometry(_Record[dict[str, Any]]):
    def __new__(
        cls,
        *,
        conv: dict[str, Any] | None = None,
        recurrent: dict[str, Any] | None = None,
        device_id: int = 0,
    ) -> SSMGeometry: ...
    @classmethod
    def from_tensors(
        cls, conv: Any = None, recurrent: Any = None, device_id: int | None = None
    ) -> SSMGeometry: ...
    @classmethod
    def from_tensor(
        cls, conv: Any = None, recurrent: Any = None, device_id: int | None = None
    ) -> SSMGeometry: ...
    num_layers: Final[int]
    num_slots: Final[int]
    device_id: Final[int]
    has_conv: Final[bool]
    has_recurrent: Final[bool]

@final
class TransferProgram:
    dst_rank: Final[int]
    src_ranks: Final[list[int]]
    def mode(self, src_rank: int) -> Literal["direct", "staged"]: ...
    def packed_bytes(self, src_rank: int) -> int: ...
    def descriptors(
        self,
        src_rank: int,
        src_staging: int = 0,
        dst_staging: int = 0,
        *,
        out: tuple[_U64Array, _U64Array] | None = None,
    ) -> tuple[_U64Array, _U64Array]: ...
    def row_count(
        self, src_rank: int, which: Literal["descriptors", "gather", "scatter"]
    ) -> int: ...
    def direct_descriptors(self, src_rank: int) -> tuple[_U64Array, _U64Array]: ...
    def gather(self, src_rank: int, *, out: _U64Array | None = None) -> _U64Array: ...
    def scatter(self, src_rank: int, *, out: _U64Array | None = None) -> _U64Array: ...
    def gather_runs(self, src_rank: int) -> _U64Array: ...
    def scatter_runs(self, src_rank: int) -> _U64Array: ...
    def device_plan(self, src_rank: int) -> dict[str, Any] | None: ...
    stats: Final[dict[str, Any]]
    def verify(self) -> None: ...

def compile_kv_transfer(
    src: Sequence[tuple[KVShardLayout, KVGeometry]],
    dst: tuple[KVShardLayout, KVGeometry | None],
    src_block_ids: _BlockIds | dict[int, _BlockIds],
    dst_block_ids: _BlockIds | None,
    num_tokens: int,
    mode: Literal["direct", "staged", "auto"] = "auto",
    *,
    token_start: int = 0,
    per_descriptor_s: float = 8e-6,
    link_bytes_per_s: float = 388e9,
    gather_bytes_per_s: float = 1.6e12,
) -> TransferProgram: ...
def compile_ssm_transfer(
    src: Sequence[tuple[SSMShardLayout, SSMGeometry]],
    dst: tuple[SSMShardLayout, SSMGeometry | None],
    src_slot: int | dict[int, int],
    dst_slot: int | None,
    mode: Literal["direct", "staged", "auto"] = "auto",
    *,
    per_descriptor_s: float = 8e-6,
    link_bytes_per_s: float = 388e9,
    gather_bytes_per_s: float = 1.6e12,
) -> TransferProgram: ...

# -- the typed wire contract -------------------------------------------------------------------

@final
class Peer:
    meta: Final[Any]
    agent_name: Final[str]
    incarnation: Final[int]
    global_rank: Final[int]
    num_blocks: Final[int]
    tokens_per_block: Final[int | None]
    state_kind: Final[Literal["kv", "conv", "recurrent"]]
    layout: Final[KVShardLayout | SSMShardLayout]
    geometry: Final[KVGeometry | SSMGeometry | None]
    def check_addresses(self, rows: _U64Array, field: str) -> None: ...
    buffer_regions: Final[list[tuple[int, int]]]
    def split_descriptors(
        self, src_rows: _U64Array, dst_rows: _U64Array, local: Peer
    ) -> tuple[_U64Array, _U64Array]: ...

def plan_buffer(
    tensor: Any,
    layers: Any,
    ssm_layout: SSMShardLayout | None,
    *,
    backend: str,
    contiguous: bool,
    expected_num_blocks: int,
    ssm_state_kind: str | None = None,
    axes: str | None = None,
    blocks_axis: int | None = None,
    reference_only: bool = False,
    **layout: int | None,
) -> dict[str, Any]: ...
def kv_layout_from_reference(meta: Any) -> KVShardLayout: ...
def meta_from_reference(
    meta: Any, backend: str, state_kind: str, element_size: int, dtype: str
) -> dict[str, Any]: ...
def rows_by_region(
    rows: _U64Array, form: Literal["gather", "scatter"], regions: Any
) -> list[tuple[int, _U64Array]]: ...

@final
class PeerTable:
    def __new__(
        cls,
        backend: str,
        *,
        state_kind: str,
        dtype: str,
        head_dim: int,
        num_layers: int | None,
        compat_hash: str,
    ) -> PeerTable: ...
    def lookup(self, meta: Any) -> Peer | None: ...
    def adopt(self, meta: Any, schema: Any = None) -> Peer: ...
    def __len__(self) -> int: ...

def check_peer_transfer(
    srcs: Sequence[Peer],
    src_block_ids: Any,
    dst_block_ids: Any,
    num_tokens: int | None,
    *,
    local_is_dst: bool,
    local_num_blocks: int,
    local_tokens_per_block: int | None,
) -> int | None: ...
def pull_ids_len(ids: Any, sources: int, rank: int | None = None) -> int: ...
def write_pull_ids(
    out: _npt.NDArray[_np.int64],
    srcs: Sequence[Peer],
    ranks: Sequence[int],
    src_block_ids: Any,
    dst_block_ids: Any,
    num_tokens: int | None,
    *,
    local_num_blocks: int,
    local_tokens_per_block: int | None,
    tokens_per_block: int,
    checked: bool = False,
) -> tuple[int, int, int, int] | None: ...
def compile_peer_transfer(
    srcs: Sequence[Peer],
    dst: Peer,
    src_block_ids: Any,
    dst_block_ids: Any,
    num_tokens: int | None,
    mode: str,
    *,
    checked: bool = False,
) -> TransferProgram: ...
def parse_peer_meta(meta: Any, backend: str) -> Peer: ...
def check_staging_tickets_of(
    tickets: Sequence[Any], peers: Sequence[Peer]
) -> dict[int, dict[str, Any]]: ...
def check_handoff_ticket(
    ticket: Any,
    *,
    request_id: int | None = None,
    sources: list[str] = ...,
    has_ssm: bool = False,
    integrity: bool = False,
) -> None: ...
def check_reference(stage: str, facts: Mapping[str, Any]) -> None: ...
def integrity_shapes(
    kv_layout: KVShardLayout | None, ssm_layout: SSMShardLayout | None, num_chunks: int = 1
) -> list[tuple[str, list[int]]]: ...
def integrity_conv_bands(
    layout: SSMShardLayout,
) -> list[tuple[Literal["x", "B", "C"], tuple[int, int], tuple[int, int]]]: ...
def integrity_merge(
    shapes: Sequence[tuple[str, Sequence[int]]],
    pieces: Sequence[tuple[str, int, int, _U64Array]],
) -> list[_U64Array]: ...
def integrity_first_mismatch(
    shapes: Sequence[tuple[str, Sequence[int]]],
    tables: Sequence[_U64Array],
    pieces: Sequence[tuple[str, int, int, _U64Array]],
    first_chunk: int = 0,
    chunk_tokens: int | None = None,
) -> tuple[int, str, int, int, int, int, str | None, tuple[int, int] | None] | None: ...
def integrity_mismatch_text(
    table: str,
    layer: int,
    unit: int,
    expected: int,
    got: int,
    kv: str | None = None,
    band: str | None = None,
    tokens: tuple[int, int] | None = None,
) -> str: ...
def reference_prefill_metas(
    facts: Mapping[str, Any],
    blocks: Sequence[Sequence[int]],
    slots: Sequence[int] | None = None,
) -> list[dict[str, Any]]: ...
def reference_push_metas(
    request_id: int, decode_metas: Sequence[Any], slot: int | None = None, block: int = 0
) -> dict[str, Any]: ...
def reference_ticket_blocks(facts: Mapping[str, Any], kv_meta: Any, src_block_ids: Any) -> int: ...
def check_integrity_wire(
    wire: Any, shapes: Sequence[tuple[str, Sequence[int]]] | None = None
) -> int | None: ...
def digest_plan(kind: Literal["kv", "ssm"], facts: Mapping[str, Any]) -> dict[str, Any]: ...
def compat_hash(facts: Any) -> str: ...
def peer_meta_parses() -> int: ...
def peer_meta_lookups() -> int: ...
def block_id_checks() -> int: ...

# --- engine-side handoff driver (driver.rs) ---
_DriverAction: TypeAlias = Literal[
    "peers", "prefill", "ticket", "send_kv", "release", "abort", "shutdown"
]

@final
class EngineDriverState:
    def __new__(cls, capacity: int = 65536) -> EngineDriverState: ...
    def inbox(
        self, msgs: list[dict[str, Any]], peers: dict[str, Any], peers_type: object
    ) -> list[dict[str, Any]]: ...
    def dispatch(self, msg: dict[str, Any], role: str) -> _DriverAction | None: ...
    def source_of(self, request_id: object) -> str | None: ...
    def stamp(self, request_id: object, epoch: int | None = None) -> int | None: ...
    def imports_settled(
        self,
        settled: list[tuple[int, bool]],
        quarantined: Iterable[int],
        reasons: dict[int, str | None],
    ) -> list[tuple[int, int, bool, bool, str]]: ...
    def shutdown(self, now_ns: int, grace_ns: int) -> None: ...
    stopping: Final[bool]
    def running(self, now_ns: int, busy: bool) -> bool: ...
    def turn(self, busy: bool) -> int: ...
    def counters(self) -> dict[str, int]: ...

_RowList = tuple[_U64Array, str, int, tuple[int, int]]

def run_table(
    list: _RowList, align: list[int]
) -> tuple[_npt.NDArray[_np.int64], int, int, int, int, int, int] | None: ...
def row_copy(
    list: _RowList, offsets: tuple[int, int]
) -> tuple[int, tuple[int, int], _npt.NDArray[_np.int64], _npt.NDArray[_np.int64] | None, int]: ...

# --- model-parallel completion reports (tracker.rs) ---
@final
class CompletionTracker:
    def __new__(cls, world_size: int) -> CompletionTracker: ...
    def record(self, request_id: int, rank: int, failed: bool) -> None: ...
    def drain(self) -> list[tuple[int, bool]]: ...
    def open_ids(self) -> list[int]: ...
    def forget(self, request_id: int) -> None: ...
    def reset(self) -> None: ...
    world_size: Final[int]
    num_open: Final[int]

# --- reference-design engine imports (ledger.rs) ---
@final
class ReferenceImports:
    def __new__(cls) -> ReferenceImports: ...
    def start(self, request_id: int, safe: bool) -> None: ...
    def importing(self) -> list[int]: ...
    def unreported(self) -> list[int]: ...
    def report(
        self, outcomes: Sequence[tuple[int, bool | None]], shared: bool, model_parallel: int
    ) -> list[tuple[int, bool]]: ...
    def decide(self, request_id: int, failed: bool) -> None: ...
    def decided_in_order(self) -> list[tuple[int, bool]]: ...
    def admitted(self, request_id: int) -> None: ...
    def may_release(self, request_id: int) -> bool: ...
    def failed(self, request_id: int, quiet: bool) -> bool: ...
    def reset(
        self,
        pinned: Sequence[int],
        pushes: Sequence[tuple[int, bool]],
        imports: Sequence[tuple[int, bool]],
    ) -> None: ...
    num_importing: Final[int]
    num_quarantined: Final[int]

def ticket_import(
    request_id: int,
    prompt: Sequence[int],
    sampling_params: Any,
    ticket: Any,
    *,
    eos_token: int | None,
    sources: list[str],
    has_ssm: bool,
    integrity: bool,
    two_sided: bool,
    now: int,
    timeout: int,
    wall_now: int | None,
) -> tuple[int, list[int], dict[str, Any]]: ...
def import_failure(
    request_id: int, reason: str, mismatch: Any, rank_error: str | None
) -> tuple[str, str, bool, str]: ...
def import_pulls(
    action: LedgerAction,
    ticket: dict[str, Any],
    *,
    num_tokens: int,
    kinds: list[str],
    two_sided: bool,
    kv_backend: Any = None,
) -> list[tuple[str, list[Any], list[int], list[int], dict[str, Any]]]: ...
def push_sends(
    pins: PinLedger,
    request_id: int,
    decode_metas: Sequence[Any],
    own: Sequence[Any],
    kinds: list[str],
    *,
    filler: bool,
) -> tuple[int, int, list[tuple[str, list[Any], list[int], list[int], dict[str, Any]]]]: ...
def handoff_peer_plan(
    peers: Mapping[str, Any], kinds: list[str]
) -> tuple[list[tuple[str, str, list[Any]]], dict[str, str]]: ...
def import_local_outcomes(
    imports: Sequence[tuple[str | None, Sequence[object]]],
) -> list[tuple[str | None, str]]: ...
def fold_import_reports(
    ledger: ImportLedger,
    gathered: Sequence[Sequence[tuple[int, int, str, Any, str]]],
    now: int,
) -> tuple[list[LedgerAction], list[tuple[int, Any]], list[tuple[int, str]]]: ...
def settle_quiet_quarantines(
    ledger: ImportLedger, quarantines: Sequence[tuple[int, int, bool]]
) -> list[LedgerAction]: ...
def refuse_reset_while_pinned(pinned: Sequence[int]) -> None: ...
def refuse_close_in_flight(
    imports: Sequence[tuple[int, bool]],
    quarantined: Sequence[tuple[int, bool]],
    pushes: Sequence[int],
    fillers: Sequence[int],
) -> None: ...
def gathered_integrity_pieces(gathered: Sequence[Any]) -> list[Any]: ...

# -- transfer backends' host-side rules (disagg_core::backend_rules) ----------------------

@overload
def group_layouts(layout: KVShardLayout) -> list[KVShardLayout | None]: ...
@overload
def group_layouts(layout: SSMShardLayout) -> list[SSMShardLayout | None]: ...
def chunkable(metas: Sequence[Mapping[str, Any]]) -> bool: ...
def staging_slots(
    pool_bytes: int | None,
    chunk_bytes: int | None,
    default_pool_bytes: int,
    default_chunk_bytes: int,
) -> tuple[int, int]: ...
def check_chunk_blocks(field: str, held: int, num_tokens: int, needs: Sequence[int]) -> None: ...
def packed_window(
    range: tuple[int, int | None], table: tuple[int, int], chunk_units: int
) -> tuple[int, int, int]: ...
def pipeline_launches(
    gather: tuple[int, int], scatter: tuple[int, int], chunk_bytes: int, chunk_units: int
) -> list[tuple[tuple[int, int], tuple[int, int, int], tuple[int, int, int]]]: ...
def staging_path(forced: str, cuda_with_triton: bool) -> Literal["triton", "torch"]: ...
def ipc_same_host(mine: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None) -> bool: ...
def ipc_reader_gpu(home: int, local: Any, unset: int) -> int: ...
def buffer_tensors(memory_buffer: Any) -> tuple[list[Any], list[Any] | None]: ...
def backend_peer_records(peer_meta: Any, src_block_ids: Any) -> list[tuple[Any, Any]]: ...
def no_blocks(*block_ids: Any) -> bool: ...
def poll_verdict(
    done: bool, error: str | None, now: float, deadline: float, timeout_s: float
) -> bool: ...
def p2p_outcome(
    posted: str | None, works: Sequence[str | None], threads: Sequence[str]
) -> str | None: ...
def p2p_receives(
    program: Any, peers: Sequence[Peer], tag: int, match_by_order: bool
) -> tuple[int, list[tuple[int, int, int, int]]]: ...
def p2p_sends(
    me: int, programs: Sequence[Any], filler: bool, wire: tuple[int, int, bool]
) -> tuple[int, list[tuple[int, int, bytes]]]: ...

@final
class PeerResolver:
    def __new__(
        cls, table: PeerTable, backend: str, state_kind: str, element_size: int, dtype: str
    ) -> PeerResolver: ...
    @property
    def table(self) -> PeerTable: ...
    def adopt(self, meta: Any) -> Peer: ...
    def peer(self, meta: Any) -> Peer: ...
    def resolve(self, peer_meta: Any, src_block_ids: Any) -> tuple[list[Peer], Any]: ...

# --- the NIXL transport's decisions (nixl_route.rs) ---
def ucx_tls_allows_cuda(tls: str | None) -> bool: ...
def nixl_cuda_major_mismatch(variant: str | None, torch_cuda: str | None) -> str | None: ...
def backend_supports_vram(mem_types: Sequence[Any]) -> bool: ...
def nixl_setup(
    have_nixl: bool, mode: str, on_gpu: bool, tls: str | None, memtype_cache: str | None
) -> tuple[Literal["auto", "direct", "staged"], list[tuple[str, str]]]: ...
def nixl_source_packs(
    mode: str, on_gpu: bool, mine: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None
) -> bool: ...
def nixl_source_stages(me: int, sources: Sequence[int], staging_bytes: int) -> bool: ...
def check_nixl_cuda_support(
    on_gpu: bool, variant: str | None, torch_cuda: str | None, mem_types: Sequence[Any] | None
) -> None: ...
def check_xfer_posted(state: object, label: str) -> None: ...
def nixl_source_read(
    staged: bool,
    ticket: Mapping[str, Any] | None,
    plan: PackedRows | None,
    peer: Mapping[str, Any],
    *,
    largest_free: int,
    alignment: int,
    share: int,
    on_gpu: bool,
    num_tokens: int | None,
    dst_blocks: int,
    local_mem: str,
) -> tuple[Literal["direct", "whole", "rows", "chunked"], bool, int, tuple[str, str]]: ...
def slice_reads(
    peer: Mapping[str, Any],
    local: Mapping[str, Any],
    src_block_ids: _U64Array,
    dst_block_ids: _U64Array,
    outer: tuple[int, int, int],
    heads: tuple[int, int, int],
    peer_id: str,
) -> tuple[_U64Array, _U64Array, str, str, str]: ...
def ipc_bounds_hold(
    plans: Sequence[tuple[PackedRows, int, int]], dst_blocks: int, dst_bytes: int
) -> bool: ...
def check_matched_slices(
    peer_name: str,
    peer: Sequence[tuple[str, int | None]],
    mine: Sequence[tuple[str, int | None]],
) -> None: ...

@final
class NixlAgentPeers:
    def __new__(cls, agent_name: str) -> NixlAgentPeers: ...
    @staticmethod
    def agent_options(have_nixl: bool, backends: Sequence[str]) -> dict[str, Any]: ...
    def retain(self) -> None: ...
    def release(self) -> list[tuple[str, str]]: ...
    def check_open(self) -> None: ...
    def admit(
        self, name: str, incarnation: int, digest: str
    ) -> tuple[str | None, list[tuple[str, str]]]: ...
    def register(
        self, name: str, incarnation: int, digest: str, added: bool, loaded: Any
    ) -> str: ...
    def peers(self) -> dict[str, tuple[int, str, str]]: ...
    def forget_stale(self, current: Mapping[str, int]) -> list[tuple[str, str]]: ...
    @property
    def refs(self) -> int: ...

def nixl_pull_route(
    sources: Sequence[tuple[int, str, int]],
    known: Sequence[int],
    tickets: Mapping[int, Mapping[str, Any]],
    staging_bytes: int,
) -> tuple[list[tuple[int, bool, int]], list[int]]: ...

_Out: TypeAlias = tuple[str | None, bytes | None, str, bytes]
_Auth: TypeAlias = tuple[str, Mapping[str, str]]

@final
class CoordinatorCore:
    def __new__(
        cls, request_timeout_s: float, push_transport: bool, engine_timeout_s: float | None
    ) -> CoordinatorCore: ...
    def handle(self, identity: bytes, frame: bytes, now: float) -> list[_Out]: ...
    def receive(
        self, identity: bytes, frame: bytes, now: float, auth: _Auth | None = None
    ) -> tuple[str, list[_Out]]: ...
    def refused(self, identity: bytes, msg: Any, error: str) -> list[_Out]: ...
    def refused_frame(self, identity: bytes, data: bytes, error: str) -> list[_Out]: ...
    def poll(self, now: float) -> list[_Out]: ...
    def fence(self, engine_id: str, why: str) -> list[_Out]: ...
    def shutdown(self) -> list[_Out]: ...
    def address(self, to_engine: str | None, to_client: bytes | None) -> bytes | None: ...
    def authentic(
        self,
        identity: bytes,
        kind: str,
        claimed: str | None,
        user_key: str,
        keys: Mapping[str, str],
    ) -> bool: ...
    def engines(self) -> dict[str, tuple[str, str, int, Any, bytes, float]]: ...
    def requests(
        self,
    ) -> dict[int, tuple[int, str, str | None, str | None, bool, bool, float]]: ...
    def counters(self) -> dict[str, Any]: ...

def timeout_seconds(value: Any, field: str = "timeout_s") -> float: ...
def curve_mode(what: str, have: bool, insecure: bool) -> bool: ...

@final
class FaultPlan:
    def __new__(cls, rate: float, seed: int, max_delay_rounds: int) -> FaultPlan: ...
    def apply(self, out: Sequence[Any]) -> list[Any]: ...
    @property
    def injected(self) -> int: ...

@final
class PackedRows:
    def __new__(
        cls,
        planes: Sequence[Sequence[int]],
        tokens_per_block: int,
        strides: tuple[int, int, int, int],
    ) -> PackedRows: ...
    def offset(self, k: int, n_tok: int) -> int: ...
    def chunks(self, n_tok: int, max_bytes: int) -> list[tuple[int, int, int, int]]: ...
    def unit(self, addresses: Sequence[int]) -> int: ...
    def paged_end(self, kind_name: str, num_blocks: int) -> int: ...
    def prepare(
        self, a: tuple[str, int], b: tuple[str, int, int]
    ) -> tuple[tuple[int, tuple[int, int, int, bool], tuple[int, int, int, bool]], int | None]: ...
    def check_copy(
        self,
        n_tok: int,
        items: tuple[int, int] | None,
        a: tuple[str, int | None, int, int, int, int],
        b: tuple[str, int | None, int, int, int, int],
        sets: int,
        paged_only: bool,
    ) -> tuple[list[int], tuple[int, tuple[int, int, int, bool], tuple[int, int, int, bool]]]: ...
    def launch(
        self,
        n_tok: int,
        parts: Sequence[tuple[int, int, int]],
        window: int | None,
        unit: int,
        ids: tuple[int, int, int, int],
    ) -> tuple[int, int, int, list[int]]: ...

# -- a reference-design engine's handoff steps (disagg_core::refdecode) ---------------------

def reference_setup(facts: Mapping[str, Any]) -> tuple[bool, int]: ...
def reference_hash_registration(
    local_blocks: Sequence[Any], hashes: Sequence[Any], cached: int
) -> tuple[list[Any], list[Any], list[Any], list[Any] | None]: ...
def reference_first_token(
    limit: int, generated: int, first: int, termination_id: int | None, stop_hit: bool
) -> tuple[int, bool]: ...
def reference_live_slot(slot: int | None) -> int: ...
def reference_import_sizes(
    is_push: bool, num_blocks: int, prompt_length: int, resume_tokens: int, block_size: int
) -> tuple[int, int]: ...
def reference_cached_prefix(found: Sequence[int | None]) -> list[int]: ...
def reference_record_sink(
    use_coordinator: bool, is_mp_coordinator: bool
) -> Literal["coordinator", "caller", "elsewhere"]: ...
