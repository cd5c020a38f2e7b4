//! How a destination reads each source of a compiled program: the packed copy the source
//! staged, or its blocks directly.

use crate::error::{DisaggError, DisaggResult};

/// One source's read: its rank, whether it reads the staged copy, and (staged) how many
/// staged reads are left to post including this one (its share of the free staging pool).
pub type RouteStep = (u32, bool, usize);

/// The reads of a pull, in program order. `sources`: `(rank, the compiler prefers staging,
/// packed bytes)` of each source of the program; `known`: the source ranks whose metadata was
/// given (the plan must read no other); `tickets`: `(rank, staged, nbytes)` of the staging
/// tickets received. A source reads its packed copy when it made one and the compiler
/// prefers staging for it (the ticket's size must be the plan's); otherwise its blocks
/// directly (always possible). Staged reads need a staging pool (`has_staging`).
pub fn pull_route(
    sources: &[(u32, bool, u64)],
    known: &[u32],
    tickets: &[(u32, bool, u64)],
    has_staging: bool,
) -> DisaggResult<Vec<RouteStep>> {
    let mut route = Vec::with_capacity(sources.len());
    for &(rank, prefer_staged, packed_bytes) in sources {
        if !known.contains(&rank) {
            return Err(DisaggError::wire(
                "peer_meta",
                format!("the plan reads source rank {rank} but no metadata names it"),
            ));
        }
        let ticket = tickets.iter().find(|t| t.0 == rank && t.1);
        let staged = match ticket {
            Some(&(_, _, nbytes)) if prefer_staged => {
                if nbytes != packed_bytes {
                    return Err(DisaggError::wire(
                        "staged",
                        format!(
                            "ticket of rank {rank} packs {nbytes} bytes, the plan {packed_bytes}"
                        ),
                    ));
                }
                true
            }
            _ => false,
        };
        route.push((rank, staged, 0));
    }
    let staged = route.iter().filter(|r| r.1).count();
    if staged > 0 && !has_staging {
        return Err(DisaggError::Capacity {
            resource: "staging_bytes".into(),
            detail: "staged pull needs staging_bytes > 0".into(),
        });
    }
    let mut left = staged;
    for r in route.iter_mut().filter(|r| r.1) {
        r.2 = left;
        left -= 1;
    }
    Ok(route)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_reads_its_staged_copy_only_when_it_made_one_and_staging_is_preferred() {
        let p = [(0, true, 64), (1, true, 32), (2, false, 16), (3, true, 8)];
        let tickets = [(0, true, 64), (1, false, 0), (2, true, 16), (3, true, 8)];
        let route = pull_route(&p, &[0, 1, 2, 3], &tickets, true).unwrap();
        assert_eq!(route, vec![(0, true, 2), (1, false, 0), (2, false, 0), (3, true, 1)]);
        assert!(pull_route(&p, &[0, 1, 2, 3], &[], false).unwrap().iter().all(|r| !r.1));
    }

    #[test]
    fn a_wrong_ticket_a_missing_rank_and_a_missing_pool_are_refused_naming_them() {
        let p = [(0, true, 64), (1, false, 8)];
        let field = |e: DisaggError| match e {
            DisaggError::Wire { field, .. } => field,
            DisaggError::Capacity { resource, .. } => resource,
            other => other.kind().to_owned(),
        };
        assert_eq!(field(pull_route(&p, &[0], &[], true).unwrap_err()), "peer_meta");
        let bad = [(0, true, 63)];
        assert_eq!(field(pull_route(&p, &[0, 1], &bad, true).unwrap_err()), "staged");
        let good = [(0, true, 64)];
        assert_eq!(field(pull_route(&p, &[0, 1], &good, false).unwrap_err()), "staging_bytes");
    }
}
