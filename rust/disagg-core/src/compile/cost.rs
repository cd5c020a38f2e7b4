//! Transfer modes and the cost model that picks one per source rank.

use crate::error::{DisaggError, DisaggResult};

use super::program::SourceProgram;

/// How one source rank's bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferMode {
    /// One descriptor pair per byte range contiguous on both sides.
    Direct,
    /// Gather into a packed region, move it with one descriptor, scatter at the destination.
    Staged,
}

impl TransferMode {
    /// The Python name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Staged => "staged",
        }
    }
}

/// The mode asked of the compiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModeChoice {
    /// Direct for every source rank.
    Direct,
    /// Staged for every source rank.
    Staged,
    /// Per source rank, whichever the [`CostModel`] says is faster.
    Auto,
}

impl ModeChoice {
    /// Parse `"direct"`, `"staged"` or `"auto"`.
    pub fn parse(name: &str) -> DisaggResult<Self> {
        match name {
            "direct" => Ok(Self::Direct),
            "staged" => Ok(Self::Staged),
            "auto" => Ok(Self::Auto),
            other => Err(DisaggError::argument(
                "mode",
                format!("mode={other:?} is not one of 'direct', 'staged', 'auto'"),
            )),
        }
    }
}

/// docs/architecture.md §4 cost model: direct costs `n_desc * per_descriptor_s + bytes / link_bytes_per_s`,
/// staged costs `2 * bytes / gather_bytes_per_s + bytes / link_bytes_per_s` plus one
/// descriptor. Defaults are the H200 measurements of docs/architecture.md §4.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Seconds one extra descriptor costs the transport (measured: about 8 us).
    pub per_descriptor_s: f64,
    /// Bytes per second of the link for large descriptors (measured: 388 GB/s over `NVLink`).
    pub link_bytes_per_s: f64,
    /// Bytes per second of the pack or unpack kernel (measured: about 1.6 TB/s).
    pub gather_bytes_per_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self { per_descriptor_s: 8e-6, link_bytes_per_s: 388e9, gather_bytes_per_s: 1.6e12 }
    }
}

impl CostModel {
    /// The largest direct descriptor count for which direct is not slower than staged.
    // Costs are estimates; f64 precision is plenty and the result saturates into u64.
    #[allow(clippy::cast_precision_loss, clippy::cast_sign_loss)]
    pub fn max_direct_descriptors(&self, bytes: u64) -> u64 {
        let pack = 2.0 * bytes as f64 / self.gather_bytes_per_s;
        let n = (pack / self.per_descriptor_s).floor() + 1.0;
        if n.is_finite() && n > 0.0 {
            n as u64
        } else {
            u64::MAX
        }
    }
}

pub(super) fn choose_mode(choice: ModeChoice, cost: &CostModel, s: &SourceProgram) -> TransferMode {
    match choice {
        ModeChoice::Direct => TransferMode::Direct,
        ModeChoice::Staged => TransferMode::Staged,
        ModeChoice::Auto => {
            let limit = cost.max_direct_descriptors(s.packed_bytes);
            if s.count_direct(limit) <= limit {
                TransferMode::Direct
            } else {
                TransferMode::Staged
            }
        }
    }
}

pub(super) fn check_mode_needs(choice: ModeChoice, has_destination: bool) -> DisaggResult<()> {
    if !has_destination && choice != ModeChoice::Staged {
        return Err(DisaggError::block(
            "dst_block_ids",
            "mode='direct' and mode='auto' need the destination blocks and geometry; without \
             them only mode='staged' (gather side) compiles",
        ));
    }
    Ok(())
}
