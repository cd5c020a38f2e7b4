//! Decisions of a decode import that need no pool: how many blocks an imported request needs
//! past its prompt, whether a prefilled request may enter the decode batch, the deadline of an
//! import under the source's lease, and whether the handed-off tokens already finish it.
//!
//! Pure functions of plain numbers: the engine reads its context and the ticket, and decides
//! nothing itself.

use crate::args::{Int, Kind};
use crate::error::{DisaggError, DisaggResult};

/// Share of the source's pin lease (percent) a decode import may use, submit to admission, by
/// the decode's own clock; the rest covers the ticket's transit from the source.
pub const LEASE_READ_PERCENT: u64 = 50;

/// Smallest lease a ticket may state (a shorter one leaves no time to read).
pub const MIN_LEASE: u64 = 2;

fn ceil_div(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Blocks an imported request needs beyond its prompt blocks: room for its `input_tokens`
/// (the sampled token plus speculative proposals) and, with a speculative KV cache
/// (`mtp_kv_cache`), for the drafts beyond them (`input_tokens - 2`).
pub fn continuation_blocks(
    prompt_len: u64,
    input_tokens: u64,
    block_size: u64,
    mtp_kv_cache: bool,
) -> DisaggResult<u64> {
    if block_size == 0 {
        return Err(DisaggError::wire("block_size", "block_size=0 must be >= 1"));
    }
    let drafts = if mtp_kv_cache { input_tokens.saturating_sub(2) } else { 0 };
    let total = prompt_len.checked_add(input_tokens).and_then(|t| t.checked_add(drafts));
    let Some(total) = total else {
        return Err(DisaggError::argument(
            "prompt_length",
            format!(
                "prompt_length={prompt_len} + input_token_count={input_tokens} + \
                 drafts={drafts} overflows u64"
            ),
        ));
    };
    Ok(ceil_div(total, block_size) - ceil_div(prompt_len, block_size))
}

/// A decode batch's occupancy, as its context reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchRoom {
    /// Requests in the batch.
    pub total_requests: u64,
    /// The batch's request capacity.
    pub max_requests: u64,
    /// Query tokens of the next step.
    pub active_tokens: u64,
    /// The step's token capacity.
    pub max_tokens: u64,
}

impl BatchRoom {
    /// Whether one more request with `input_tokens` query tokens fits the next step.
    pub fn fits(&self, input_tokens: u64) -> bool {
        self.total_requests < self.max_requests
            && self.active_tokens.saturating_add(input_tokens) <= self.max_tokens
    }
}

/// What a prefilled request brings to the decode batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefilledRequest {
    /// The request.
    pub request_id: u64,
    /// Prompt tokens (already in the cache).
    pub prompt_len: u64,
    /// Blocks holding the prompt.
    pub prompt_blocks: u64,
    /// Empty blocks reserved after the prompt.
    pub continuation_blocks: u64,
    /// Query tokens of its first decode step.
    pub input_tokens: u64,
    /// Whether it brings an SSM state slot.
    pub has_ssm_slot: bool,
}

/// The decode engine's static settings that admission checks against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeSettings {
    /// Tokens per KV block.
    pub block_size: u64,
    /// Speculative proposals per step (a request's query is this plus one tokens).
    pub num_speculative_tokens: u64,
    /// Whether the KV cache also holds the speculative drafts.
    pub mtp_kv_cache: bool,
    /// Whether the model has SSM layers (a request then needs its state slot).
    pub hybrid: bool,
}

/// Check, before anything changes, that `req` may enter a batch with `room` now: the batch has
/// a place and the token budget, the block lists cover exactly the prompt and the continuation,
/// the query is `num_speculative_tokens + 1` tokens, and a hybrid model brings a state slot.
pub fn check_prefilled_admission(
    req: &PrefilledRequest,
    room: &BatchRoom,
    settings: &DecodeSettings,
) -> DisaggResult<()> {
    let rid = req.request_id;
    if !room.fits(req.input_tokens) {
        return Err(DisaggError::State {
            request_id: rid,
            detail: format!(
                "the decode batch cannot take request {rid} now: total_request_count={} of {}, \
                 active_token_count={} + {} of {}",
                room.total_requests,
                room.max_requests,
                room.active_tokens,
                req.input_tokens,
                room.max_tokens
            ),
        });
    }
    if settings.block_size == 0 {
        return Err(DisaggError::wire("block_size", "block_size=0 must be >= 1"));
    }
    let want_prompt = ceil_div(req.prompt_len, settings.block_size);
    if req.prompt_blocks != want_prompt {
        return Err(DisaggError::block(
            "prompt_block_ids",
            format!(
                "request {rid}: len(prompt_block_ids)={} but {} prompt tokens at block_size={} \
                 need {want_prompt}",
                req.prompt_blocks, req.prompt_len, settings.block_size
            ),
        ));
    }
    let want_more = continuation_blocks(
        req.prompt_len,
        req.input_tokens,
        settings.block_size,
        settings.mtp_kv_cache,
    )?;
    if req.continuation_blocks != want_more {
        return Err(DisaggError::block(
            "continuation_block_ids",
            format!(
                "request {rid}: len(continuation_block_ids)={} but {} input tokens need \
                 {want_more}",
                req.continuation_blocks, req.input_tokens
            ),
        ));
    }
    let want_inputs = settings.num_speculative_tokens.saturating_add(1);
    if req.input_tokens != want_inputs {
        return Err(DisaggError::wire(
            "input_tokens",
            format!(
                "request {rid}: len(input_tokens)={} but the decode expects \
                 num_speculative_tokens+1={want_inputs}",
                req.input_tokens
            ),
        ));
    }
    if settings.hybrid && !req.has_ssm_slot {
        return Err(DisaggError::wire(
            "ssm_state_idx",
            format!("request {rid}: a hybrid model needs ssm_state_idx, got None"),
        ));
    }
    Ok(())
}

/// The deadline of an import submitted at `now`: `timeout` after it, and, when the ticket
/// states the source's `lease` (`lease_ns`), no later than [`LEASE_READ_PERCENT`] of that
/// lease after it (the source frees its blocks when the lease ends, and the two clocks are not
/// comparable: the rest of the lease absorbs the ticket's transit).
pub fn import_deadline(
    request_id: u64,
    now: u64,
    timeout: u64,
    lease: Option<i128>,
) -> DisaggResult<u64> {
    let mut budget = timeout;
    if let Some(lease) = lease {
        let lease = u64::try_from(lease).ok().filter(|&l| l >= MIN_LEASE).ok_or_else(|| {
            DisaggError::wire(
                "lease_ns",
                format!(
                    "request {request_id}: ticket lease_ns={lease} must be an int >= {MIN_LEASE}"
                ),
            )
        })?;
        budget =
            budget.min(lease / 100 * LEASE_READ_PERCENT + lease % 100 * LEASE_READ_PERCENT / 100);
    }
    Ok(now.saturating_add(budget))
}

/// The ticket's `lease_until_wall_ns` as the ledger takes it: checked (an int >= 0) only when
/// this side reads a wall clock (`now_wall`); `None` when either is missing.
pub fn source_lease_end(
    request_id: u64,
    lease_until_wall: Option<i128>,
    now_wall: Option<i128>,
) -> DisaggResult<Option<(u64, u64)>> {
    let (Some(end), Some(wall)) = (lease_until_wall, now_wall) else { return Ok(None) };
    let end = u64::try_from(end).map_err(|_| {
        DisaggError::wire(
            "lease_until_wall_ns",
            format!("request {request_id}: ticket lease_until_wall_ns={end} must be an int >= 0"),
        )
    })?;
    let wall = u64::try_from(wall).map_err(|_| {
        DisaggError::argument("now_wall", format!("handoff_wall_now_ns={wall} must be >= 0"))
    })?;
    Ok(Some((end, wall)))
}

/// A ticket's integer field `field` as given: anything but an int (a bool, a float, a string)
/// is a `Wire` error naming the field.
pub fn ticket_int(request_id: u64, field: &str, v: &Int) -> DisaggResult<i128> {
    v.0.clone().map_err(|what| {
        let detail = format!("request {request_id}: ticket {field}={what} must be an int");
        DisaggError::wire(field, detail)
    })
}

/// [`source_lease_end`] of a ticket's `lease_until_wall_ns` and this side's `now_wall` as
/// given: the ticket's field is read only when this side reads a wall clock.
pub fn source_lease_of(
    request_id: u64,
    lease_until_wall_ns: Option<&Int>,
    now_wall: Option<&Int>,
) -> DisaggResult<Option<(u64, u64)>> {
    let wall = now_wall.map(|w| w.to_i64(Kind::Argument, "now_wall")).transpose()?;
    let end = match (lease_until_wall_ns, wall) {
        (Some(v), Some(_)) => Some(ticket_int(request_id, "lease_until_wall_ns", v)?),
        _ => None,
    };
    source_lease_end(request_id, end, wall.map(i128::from))
}

/// Whether the handed-off `resume` tokens already finish the request: they reach its limit of
/// `max_new_tokens`, end with its `termination` token, or end with one of its `stop_words`
/// (empty stop words never match).
pub fn resume_finishes(
    resume: &[i64],
    max_new_tokens: i64,
    termination: Option<i64>,
    stop_words: &[Vec<i64>],
) -> bool {
    let reached = i64::try_from(resume.len()).map_or(true, |n| n >= max_new_tokens);
    let terminated = termination.is_some() && resume.last().copied() == termination;
    let stopped = stop_words.iter().any(|w| !w.is_empty() && resume.ends_with(w));
    reached || terminated || stopped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::Given;

    #[test]
    fn a_ticket_field_of_another_type_is_a_wire_error_and_a_lease_is_read_with_a_wall_clock() {
        assert_eq!(ticket_int(7, "lease_ns", &Int::of(5)), Ok(5));
        let e = ticket_int(7, "lease_ns", &Given(Err("a float (1.5)".into()))).unwrap_err();
        let want = "request 7: ticket lease_ns=a float (1.5) must be an int";
        assert_eq!(e, DisaggError::wire("lease_ns", want));
        let bad: Int = Given(Err("a str ('x')".into()));
        assert_eq!(source_lease_of(7, Some(&bad), None), Ok(None));
        assert!(source_lease_of(7, Some(&bad), Some(&Int::of(3))).is_err());
        assert_eq!(source_lease_of(7, Some(&Int::of(9)), Some(&Int::of(3))), Ok(Some((9, 3))));
        assert_eq!(source_lease_of(7, None, Some(&Int::of(3))), Ok(None));
        let e = source_lease_of(7, None, Some(&Given(Err("None".into())))).unwrap_err();
        assert_eq!(e.kind(), "ArgumentType");
    }

    #[test]
    fn continuation_blocks_cover_the_tokens_after_the_prompt() {
        assert_eq!(continuation_blocks(8, 2, 4, false), Ok(1));
        assert_eq!(continuation_blocks(7, 1, 4, false), Ok(0));
        assert_eq!(continuation_blocks(7, 4, 4, true), Ok(2));
        assert!(matches!(continuation_blocks(1, 1, 0, false), Err(DisaggError::Wire { .. })));
    }

    #[test]
    fn a_lease_shortens_the_deadline_to_half_of_it() {
        assert_eq!(import_deadline(1, 10, 100, None), Ok(110));
        assert_eq!(import_deadline(1, 10, 100, Some(60)), Ok(40));
        assert_eq!(import_deadline(1, 10, 100, Some(1000)), Ok(110));
        assert!(import_deadline(1, 10, 100, Some(1)).is_err());
        assert!(import_deadline(1, 10, 100, Some(-5)).is_err());
    }
}
