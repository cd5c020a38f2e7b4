//! The typed wire contract: everything that crosses a process boundary is parsed here, once,
//! into typed values with every field validated and size-capped, the field named in the error.
//!
//! - [`peer`]: peer metadata and the peer table (parsed once per peer incarnation).
//! - [`plan`]: the hot path in one call, parsed peers and block ids in, program out.
//! - [`ticket`]: handoff and staging tickets.
//! - [`value`]: the decoded wire value, its size caps and typed field accessors.
//! - [`control`]: control-plane messages, one schema per message type.
//! - [`layout`]: layouts, SSM dims and geometries as wire maps, and their constructor calls.

pub mod control;
pub mod layout;
pub mod msgpack;
pub mod peer;
pub mod plan;
pub mod ticket;
pub mod value;
