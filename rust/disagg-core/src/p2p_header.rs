//! The in-band header of every two-sided (point-to-point) handoff message.
//!
//! NCCL matches point-to-point messages strictly by post order per peer pair and ignores
//! tags: a receive posted for one request that never gets its send takes the next send on
//! that pair, another request's bytes. So every pushed message starts with a fixed-size header
//! saying what it is, and the receiver checks it against what it posted before the bytes can
//! be admitted: a message meant for another request (or another incarnation, chunk or size)
//! is refused with a [`DisaggError::MessageOrder`] naming the field and both values, which
//! fails that import as corrupt and marks the pair as out of step.
//!
//! A sender that cannot send the real bytes of a posted receive (the request is unknown, no
//! longer pinned, refused or its lease ended) sends a filler of the posted size whose header
//! kind is [`MessageKind::Aborted`]: the receive completes at once, the import fails without
//! waiting for its deadline, and the next request on the pair still matches.
//!
//! Layout (little-endian, [`HEADER_BYTES`] bytes): magic `u32`, version `u16`, kind `u16`,
//! tag `u64`, incarnation `u64`, chunk `u32`, chunks `u32`, payload nbytes `u64`, then zeros.

use std::collections::BTreeMap;

use crate::error::{DisaggError, DisaggResult};

/// Bytes of one header; the payload starts right after it (64 keeps 16-byte lanes aligned).
pub const HEADER_BYTES: usize = 64;
/// The first four bytes of every header (`"DGP2"`).
pub const MAGIC: u32 = u32::from_le_bytes(*b"DGP2");
/// Format version written and accepted.
pub const VERSION: u16 = 1;
/// Largest payload a header may announce (1 TiB): caps what a peer can make a receiver expect.
pub const MAX_PAYLOAD_BYTES: u64 = 1 << 40;
/// Most messages (chunks) one handoff may move between one pair.
pub const MAX_CHUNKS: u32 = 1 << 24;
/// The incarnation a receive expects when its sender's metadata carries none (the
/// reference design exports no incarnation): the header's is then not compared.
pub const UNKNOWN_INCARNATION: u64 = 0;

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// The real packed bytes of the handoff.
    Data = 0,
    /// A filler of the posted size: the sender gave the handoff up, the bytes mean nothing.
    Aborted = 1,
}

impl MessageKind {
    /// `"data"` or `"aborted"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Data => "data",
            Self::Aborted => "aborted",
        }
    }

    /// What a sender posts: `Aborted` fillers when it gave the handoff up, else `Data`.
    pub fn sent(filler: bool) -> Self {
        if filler {
            Self::Aborted
        } else {
            Self::Data
        }
    }

    /// The kind called `name`.
    pub fn from_name(name: &str) -> DisaggResult<Self> {
        match name {
            "data" => Ok(Self::Data),
            "aborted" => Ok(Self::Aborted),
            other => Err(DisaggError::argument(
                "kind",
                format!("kind={other:?} must be \"data\" or \"aborted\""),
            )),
        }
    }
}

/// One message's identity: what the sender writes and the receiver expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageHeader {
    /// Data or filler.
    pub kind: MessageKind,
    /// The handoff's message tag (request and state kind, see [`crate::tags`]).
    pub tag: u64,
    /// The sending engine's incarnation.
    pub incarnation: u64,
    /// This message's index among the pair's messages of the handoff.
    pub chunk: u32,
    /// How many messages the pair moves for the handoff.
    pub chunks: u32,
    /// Payload bytes after the header.
    pub nbytes: u64,
}

fn order_err(field: &str, expected: u64, got: u64) -> DisaggError {
    DisaggError::MessageOrder { field: field.into(), expected, got }
}

fn read_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

impl MessageHeader {
    /// A header, its fields checked against the caps (`chunk < chunks <= MAX_CHUNKS`,
    /// `nbytes <= MAX_PAYLOAD_BYTES`).
    pub fn new(
        kind: MessageKind,
        tag: u64,
        incarnation: u64,
        chunk: u32,
        chunks: u32,
        nbytes: u64,
    ) -> DisaggResult<Self> {
        if chunks == 0 || chunks > MAX_CHUNKS {
            return Err(DisaggError::argument(
                "chunks",
                format!("chunks={chunks} must be in [1, {MAX_CHUNKS}]"),
            ));
        }
        if chunk >= chunks {
            return Err(DisaggError::argument(
                "chunk",
                format!("chunk={chunk} must be < chunks={chunks}"),
            ));
        }
        if nbytes > MAX_PAYLOAD_BYTES {
            return Err(DisaggError::argument(
                "nbytes",
                format!("nbytes={nbytes} must be <= {MAX_PAYLOAD_BYTES}"),
            ));
        }
        Ok(Self { kind, tag, incarnation, chunk, chunks, nbytes })
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        out[8..16].copy_from_slice(&self.tag.to_le_bytes());
        out[16..24].copy_from_slice(&self.incarnation.to_le_bytes());
        out[24..28].copy_from_slice(&self.chunk.to_le_bytes());
        out[28..32].copy_from_slice(&self.chunks.to_le_bytes());
        out[32..40].copy_from_slice(&self.nbytes.to_le_bytes());
        out
    }

    /// Read a header; a wrong length, magic, version, kind or non-zero padding is a
    /// [`DisaggError::MessageOrder`] naming that field (the bytes are no header at all,
    /// typically payload of a message that was meant for another receive).
    pub fn decode(bytes: &[u8]) -> DisaggResult<Self> {
        if bytes.len() != HEADER_BYTES {
            return Err(order_err("header_bytes", HEADER_BYTES as u64, bytes.len() as u64));
        }
        let magic = read_u32(bytes, 0);
        if magic != MAGIC {
            return Err(order_err("magic", u64::from(MAGIC), u64::from(magic)));
        }
        let version = read_u16(bytes, 4);
        if version != VERSION {
            return Err(order_err("version", u64::from(VERSION), u64::from(version)));
        }
        let kind = match read_u16(bytes, 6) {
            0 => MessageKind::Data,
            1 => MessageKind::Aborted,
            other => return Err(order_err("kind", MessageKind::Data as u64, u64::from(other))),
        };
        if let Some(at) = bytes[40..].iter().position(|&b| b != 0) {
            return Err(order_err("padding", 0, u64::from(bytes[40 + at])));
        }
        Ok(Self {
            kind,
            tag: read_u64(bytes, 8),
            incarnation: read_u64(bytes, 16),
            chunk: read_u32(bytes, 24),
            chunks: read_u32(bytes, 28),
            nbytes: read_u64(bytes, 32),
        })
    }

    /// Check received header bytes against what the receive was posted for (`self`; its
    /// kind is ignored, and its incarnation when [`UNKNOWN_INCARNATION`]): returns the
    /// received kind, or the first field that differs as a [`DisaggError::MessageOrder`]
    /// with both values.
    pub fn check(&self, bytes: &[u8]) -> DisaggResult<MessageKind> {
        let got = Self::decode(bytes)?;
        let incarnation = if self.incarnation == UNKNOWN_INCARNATION {
            got.incarnation
        } else {
            self.incarnation
        };
        let fields = [
            ("tag", self.tag, got.tag),
            ("incarnation", incarnation, got.incarnation),
            ("chunks", u64::from(self.chunks), u64::from(got.chunks)),
            ("chunk", u64::from(self.chunk), u64::from(got.chunk)),
            ("nbytes", self.nbytes, got.nbytes),
        ];
        match fields.into_iter().find(|(_, want, have)| want != have) {
            Some((field, want, have)) => Err(order_err(field, want, have)),
            None => Ok(got.kind),
        }
    }
}

/// The headers of one pair's messages of a handoff, concatenated: message `i` of
/// `nbytes.len()` carries `nbytes[i]` payload bytes.
pub fn encode_headers(
    kind: MessageKind,
    tag: u64,
    incarnation: u64,
    nbytes: &[u64],
) -> DisaggResult<Vec<u8>> {
    let chunks = chunk_count(nbytes.len())?;
    let mut out = Vec::with_capacity(nbytes.len() * HEADER_BYTES);
    for (i, &n) in nbytes.iter().enumerate() {
        let chunk = u32::try_from(i).unwrap_or(u32::MAX); // i < chunks <= MAX_CHUNKS
        out.extend_from_slice(
            &MessageHeader::new(kind, tag, incarnation, chunk, chunks, n)?.encode(),
        );
    }
    Ok(out)
}

/// Check the received headers of messages `first..first + got.len() / HEADER_BYTES` of a
/// pair's `nbytes.len()` messages (all of them when `first` is 0 and every header is given):
/// `Data` when every one is real data, `Aborted` when every one is a filler, a
/// [`DisaggError::MessageOrder`] at the first message that is not what was posted (a mix
/// of data and filler included, field `kind`).
pub fn check_headers(
    got: &[u8],
    tag: u64,
    incarnation: u64,
    nbytes: &[u64],
    first: usize,
) -> DisaggResult<MessageKind> {
    let chunks = chunk_count(nbytes.len())?;
    if !got.len().is_multiple_of(HEADER_BYTES) || got.is_empty() {
        return Err(order_err("header_bytes", HEADER_BYTES as u64, got.len() as u64));
    }
    let count = got.len() / HEADER_BYTES;
    if first + count > nbytes.len() {
        return Err(DisaggError::argument(
            "first",
            format!("messages {first}..{} past the {} posted", first + count, nbytes.len()),
        ));
    }
    let mut kind = None;
    for (k, bytes) in got.chunks_exact(HEADER_BYTES).enumerate() {
        let i = first + k;
        let chunk = u32::try_from(i).unwrap_or(u32::MAX);
        let want =
            MessageHeader::new(MessageKind::Data, tag, incarnation, chunk, chunks, nbytes[i])?;
        let have = want.check(bytes)?;
        match kind {
            Some(k) if k != have => return Err(order_err("kind", k as u64, have as u64)),
            _ => kind = Some(have),
        }
    }
    Ok(kind.unwrap_or(MessageKind::Data))
}

/// The peers of one rank whose messages are still in step, decided from the headers it
/// receives: a mismatch marks the peer out of step for good (every later message on the pair
/// is shifted), and later receives from it are refused before anything is posted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerSteps {
    out_of_step: BTreeMap<u64, String>,
}

impl PeerSteps {
    /// Check received headers from `peer` (see [`check_headers`]): `Ok` for data; a filler
    /// is a [`DisaggError::PushAborted`] (the pair stays in step); a mismatch is the
    /// [`DisaggError::MessageOrder`] and marks `peer` out of step.
    pub fn check(
        &mut self,
        peer: u64,
        got: &[u8],
        tag: u64,
        incarnation: u64,
        nbytes: &[u64],
        first: usize,
    ) -> DisaggResult<()> {
        match check_headers(got, tag, incarnation, nbytes, first) {
            Ok(MessageKind::Data) => Ok(()),
            Ok(MessageKind::Aborted) => Err(DisaggError::PushAborted { peer, tag }),
            Err(e @ DisaggError::MessageOrder { .. }) => {
                self.out_of_step.entry(peer).or_insert_with(|| e.to_string());
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Refuse receives from `peers` if one is out of step: a
    /// [`DisaggError::HandoffState`] naming it and its first mismatch.
    pub fn refuse(&self, peers: &[u64]) -> DisaggResult<()> {
        match peers.iter().find_map(|p| self.out_of_step.get(p).map(|why| (p, why))) {
            Some((peer, why)) => Err(DisaggError::handoff_state(
                "peer_meta",
                format!(
                    "rank {peer} is out of step with this rank (its messages no longer match \
                     their receives): {why}"
                ),
            )),
            None => Ok(()),
        }
    }

    /// Peers out of step, with their first mismatch.
    pub fn out_of_step(&self) -> &BTreeMap<u64, String> {
        &self.out_of_step
    }
}

fn chunk_count(n: usize) -> DisaggResult<u32> {
    match u32::try_from(n) {
        Ok(c) if (1..=MAX_CHUNKS).contains(&c) => Ok(c),
        _ => Err(DisaggError::argument(
            "nbytes",
            format!("{n} messages must be in [1, {MAX_CHUNKS}]"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(kind: MessageKind) -> MessageHeader {
        MessageHeader::new(kind, 4 * 17, 3, 1, 4, 4096).unwrap()
    }

    #[test]
    fn a_header_round_trips_and_checks_as_its_kind() {
        for kind in [MessageKind::Data, MessageKind::Aborted] {
            let h = header(kind);
            let bytes = h.encode();
            assert_eq!(MessageHeader::decode(&bytes).unwrap(), h);
            assert_eq!(header(MessageKind::Data).check(&bytes).unwrap(), kind);
        }
    }

    fn order(e: DisaggError) -> (String, u64, u64) {
        match e {
            DisaggError::MessageOrder { field, expected, got } => (field, expected, got),
            other => panic!("expected MessageOrder, got {other:?}"),
        }
    }

    #[test]
    fn every_field_mismatch_names_the_field_and_both_values() {
        let want = header(MessageKind::Data);
        let cases: [(&str, MessageHeader, u64, u64); 5] = [
            ("tag", MessageHeader { tag: 4 * 18, ..want }, 68, 72),
            ("incarnation", MessageHeader { incarnation: 4, ..want }, 3, 4),
            ("chunks", MessageHeader { chunks: 5, ..want }, 4, 5),
            ("chunk", MessageHeader { chunk: 2, ..want }, 1, 2),
            ("nbytes", MessageHeader { nbytes: 4095, ..want }, 4096, 4095),
        ];
        for (field, sent, expected, got) in cases {
            let e = want.check(&sent.encode()).unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
            assert_eq!(order(e), (field.to_string(), expected, got));
        }
    }

    #[test]
    fn a_receive_that_does_not_know_its_senders_incarnation_checks_the_rest() {
        let want = MessageHeader { incarnation: UNKNOWN_INCARNATION, ..header(MessageKind::Data) };
        assert_eq!(want.check(&header(MessageKind::Data).encode()).unwrap(), MessageKind::Data);
        let other = MessageHeader { tag: 4, ..header(MessageKind::Data) };
        assert_eq!(order(want.check(&other.encode()).unwrap_err()), ("tag".into(), 68, 4));
    }

    #[test]
    fn bytes_that_are_no_header_are_refused_by_field() {
        let want = header(MessageKind::Data);
        let good = want.encode();
        let mut magic = good;
        magic[0] ^= 1;
        assert_eq!(order(want.check(&magic).unwrap_err()).0, "magic");
        let mut version = good;
        version[4] = 9;
        assert_eq!(order(want.check(&version).unwrap_err()), ("version".into(), 1, 9));
        let mut kind = good;
        kind[6] = 7;
        assert_eq!(order(want.check(&kind).unwrap_err()), ("kind".into(), 0, 7));
        let mut pad = good;
        pad[63] = 5;
        assert_eq!(order(want.check(&pad).unwrap_err()), ("padding".into(), 0, 5));
        assert_eq!(order(want.check(&good[..63]).unwrap_err()), ("header_bytes".into(), 64, 63));
        // Payload bytes (a message meant for another receive) are no header.
        assert_eq!(order(want.check(&[0xAB; HEADER_BYTES]).unwrap_err()).0, "magic");
    }

    #[test]
    fn caps_are_checked_when_building() {
        let d = MessageKind::Data;
        assert!(MessageHeader::new(d, 0, 0, 0, 0, 1).is_err());
        assert!(MessageHeader::new(d, 0, 0, 2, 2, 1).is_err());
        assert!(MessageHeader::new(d, 0, 0, 0, MAX_CHUNKS + 1, 1).is_err());
        assert!(MessageHeader::new(d, 0, 0, 0, 1, MAX_PAYLOAD_BYTES + 1).is_err());
        assert!(encode_headers(d, 0, 0, &[]).is_err());
        assert!(MessageKind::from_name("late").is_err());
    }

    #[test]
    fn a_batch_checks_every_message_and_refuses_a_mix_of_data_and_filler() {
        let sizes = [256u64, 256, 128];
        let data = encode_headers(MessageKind::Data, 8, 1, &sizes).unwrap();
        let filler = encode_headers(MessageKind::Aborted, 8, 1, &sizes).unwrap();
        assert_eq!(check_headers(&data, 8, 1, &sizes, 0).unwrap(), MessageKind::Data);
        assert_eq!(check_headers(&filler, 8, 1, &sizes, 0).unwrap(), MessageKind::Aborted);
        // One header at a time (the host-memory loop checks each before its scatter).
        let second = &data[HEADER_BYTES..2 * HEADER_BYTES];
        assert_eq!(check_headers(second, 8, 1, &sizes, 1).unwrap(), MessageKind::Data);
        assert_eq!(order(check_headers(second, 8, 1, &sizes, 0).unwrap_err()).0, "chunk");
        let mut mixed = data.clone();
        mixed[HEADER_BYTES..].copy_from_slice(&filler[HEADER_BYTES..]);
        assert_eq!(
            order(check_headers(&mixed, 8, 1, &sizes, 0).unwrap_err()),
            ("kind".into(), 0, 1)
        );
        assert!(check_headers(&data, 8, 1, &sizes, 1).is_err());
        assert_eq!(order(check_headers(&data, 9, 1, &sizes, 0).unwrap_err()), ("tag".into(), 9, 8));
    }

    #[test]
    fn peer_steps_pass_data_abort_on_a_filler_and_mark_a_mismatch_out_of_step() {
        let sizes = [256u64, 128];
        let data = encode_headers(MessageKind::Data, 8, 1, &sizes).unwrap();
        let filler = encode_headers(MessageKind::Aborted, 8, 1, &sizes).unwrap();
        let other = encode_headers(MessageKind::Data, 12, 1, &sizes).unwrap();
        let mut steps = PeerSteps::default();
        steps.check(3, &data, 8, 1, &sizes, 0).unwrap();
        let e = steps.check(3, &filler, 8, 1, &sizes, 0).unwrap_err();
        assert_eq!(e, DisaggError::PushAborted { peer: 3, tag: 8 });
        steps.refuse(&[3]).unwrap();
        assert!(steps.out_of_step().is_empty());
        let e = steps.check(3, &other[..HEADER_BYTES], 8, 1, &sizes, 0).unwrap_err();
        assert_eq!(order(e), ("tag".into(), 8, 12));
        let refused = steps.refuse(&[1, 3]).unwrap_err();
        assert!(refused.to_string().contains("rank 3 is out of step"), "{refused}");
        assert!(refused.to_string().contains("`tag` is 12"), "{refused}");
        steps.refuse(&[1]).unwrap();
        assert_eq!(steps.out_of_step().keys().copied().collect::<Vec<_>>(), vec![3]);
    }

    proptest! {
        #[test]
        fn any_header_round_trips(
            aborted in any::<bool>(), tag in any::<u64>(), inc in any::<u64>(),
            chunks in 1u32..=MAX_CHUNKS, pick in any::<u32>(), nbytes in 0..=MAX_PAYLOAD_BYTES,
        ) {
            let kind = if aborted { MessageKind::Aborted } else { MessageKind::Data };
            let h = MessageHeader::new(kind, tag, inc, pick % chunks, chunks, nbytes).unwrap();
            prop_assert_eq!(MessageHeader::decode(&h.encode()).unwrap(), h);
            prop_assert_eq!(h.check(&h.encode()).unwrap(), kind);
        }

        #[test]
        fn a_header_of_another_message_never_checks(
            tag in any::<u64>(), other in any::<u64>(), nbytes in 0..=MAX_PAYLOAD_BYTES,
        ) {
            prop_assume!(tag != other);
            let want = MessageHeader::new(MessageKind::Data, tag, 1, 0, 1, nbytes).unwrap();
            let sent = MessageHeader { tag: other, ..want };
            prop_assert_eq!(order(want.check(&sent.encode()).unwrap_err()), ("tag".into(), tag, other));
        }
    }
}
