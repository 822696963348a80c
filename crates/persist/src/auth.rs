//! Authenticated streams: the pre-shared key, the mutual handshake and the per-record MAC.
//!
//! Both sides of a migration hold the same key file (`--auth-key FILE`, mode 0600, at least
//! [`MIN_KEY_LEN`] bytes; its bytes are the key). Before any record moves, each side proves it
//! holds the key:
//!
//! ```text
//! 1. each side sends hello: "VMHOSTAU" | handshake version u32 | role u8 (1 source, 2 target)
//!                           | 32-byte nonce from getrandom
//! 2. each side sends proof: HMAC-SHA256(key, "vmhost-persist-1 proof " | own role label
//!                           | source nonce | target nonce)
//! 3. each side checks the peer's proof (constant time) and hangs up on a mismatch
//! ```
//!
//! A proof binds both fresh nonces and the prover's role, so it cannot be replayed from an
//! earlier session nor reflected back to its sender, and it reveals nothing of the key. The
//! source sends no record before the target has proved the key, and the target reads no record
//! before the source has.
//!
//! Each direction then gets its own key, `HMAC-SHA256(key, "vmhost-persist-1 key " | direction
//! label | source nonce | target nonce)`, and every header and record on the stream carries a
//! tag keyed with it and bound to its sequence number (0 for the header, then 1, 2, …; see
//! [`crate::container`]). Which tag depends on the container's format version:
//!
//! - from format 4, a 16-byte tag that is exactly RFC 8439's ChaCha20-Poly1305 tag of an empty
//!   plaintext under the direction key:
//!   - of a record: the associated data is its payload, and the nonce is the record's kind
//!     u16 | flags u16 | sequence number u64. The payload's length is in the tag's own length
//!     block, so every byte of the record head is bound; the checksum field after the payload
//!     must be zero (a reader refuses anything else);
//!   - of the header: the associated data is the header's bytes, the nonce 4 zero bytes |
//!     sequence number 0 (as in format 3).
//!
//!   A record's payload is authenticated where it lies, with no copy to join it to its head,
//!   by `ring`'s ChaCha20-Poly1305 (a 64-bit Poly1305): 3 times as fast as format 3's tag in
//!   the emulated host and 2.4 times on the CI host's CPU (docs/dependencies.md, "ring");
//! - format 3: the same AEAD tag with the header's or record's whole bytes (head, payload,
//!   checksum field) as associated data and the nonce 4 zero bytes | sequence number u64 (the
//!   one-time key is the first 32 bytes of that nonce's ChaCha20 keystream), computed over the
//!   parts with the `poly1305` crate;
//! - formats 1 and 2: a 32-byte `HMAC-SHA256(direction key, direction label | sequence number
//!   u64 | bytes)`.
//!
//! Poly1305 needs no SHA extensions: in the emulated host (TCG, which has none) format 3's tag
//! ran about 5.8 times as fast as HMAC-SHA256, and on the CI host's CPU, which has them, about
//! 1.5 times (docs/benchmarks.md, "Page stream"). A changed, injected, replayed, reordered or
//! dropped record fails its tag; a cut stream lacks the authenticated end record.
//!
//! The handshake does no I/O timing of its own: set read and write timeouts on the socket.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use chacha20::cipher::{KeyIvInit, StreamCipher};
use chacha20::ChaCha20;
use hmac::{Hmac, Mac};
use poly1305::universal_hash::{KeyInit, UniversalHash};
use poly1305::Poly1305;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The shortest key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 32;
/// The longest key file accepted, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// The longest record tag (HMAC-SHA256's, formats 1 and 2; Poly1305's is 16 bytes).
pub const TAG_LEN: usize = 32;
/// The first container format version whose records carry Poly1305 tags.
const POLY1305_FROM: u32 = 3;
/// The first container format version whose record tags bind the head through the nonce.
const BOUND_FROM: u32 = 4;

const HELLO_MAGIC: [u8; 8] = *b"VMHOSTAU";
const HANDSHAKE_VERSION: u32 = 1;
const NONCE_LEN: usize = 32;
const HELLO_LEN: usize = 8 + 4 + 1 + NONCE_LEN;

/// Why a key could not be loaded or a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The key file could not be opened or read.
    #[error("cannot read the key file {path}")]
    ReadKey {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The key file is not a regular file.
    #[error("the key file {path} is not a regular file; give a file holding the key")]
    KeyNotFile {
        /// The file.
        path: PathBuf,
    },
    /// The key file is open to group or others.
    #[error("the key file {path} has mode {mode:04o}: group or others may read or change it; run `chmod 600 {path}`")]
    KeyMode {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The key is too short or too long.
    #[error("the key file {path} holds {len} bytes; a key is {MIN_KEY_LEN} to {MAX_KEY_LEN} bytes (make one with `head -c 32 /dev/urandom > {path}; chmod 600 {path}`)")]
    KeyLength {
        /// The file (`<memory>` for a key given as bytes).
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// The system's random source failed.
    #[error("cannot draw a nonce from the system's random source: {0}")]
    Random(String),
    /// Sending or receiving during the handshake failed.
    #[error("the authentication handshake failed while {step}")]
    Io {
        /// What was being sent or received.
        step: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The peer closed the connection during the handshake.
    #[error("the peer closed the connection while {step} (it may have refused our key: check that both sides use the same --auth-key file)")]
    Closed {
        /// What was being received.
        step: &'static str,
    },
    /// The peer's hello is not a vmhost handshake of this version.
    #[error("the peer is not a vmhost migration endpoint of handshake version {HANDSHAKE_VERSION}: its hello starts {found:02x?}")]
    BadHello {
        /// The peer's first 12 bytes (magic and version).
        found: [u8; 12],
    },
    /// The peer claims the same role, or an unknown one.
    #[error("the peer's role byte is {found}; a {ours} talks only to a {peer}")]
    BadRole {
        /// The role byte received.
        found: u8,
        /// This side's role.
        ours: Role,
        /// The role expected of the peer.
        peer: Role,
    },
    /// The peer's proof does not match: it does not hold our key.
    #[error("the peer ({peer}) did not prove the pre-shared key: the two sides use different --auth-key files; nothing was sent or accepted")]
    BadProof {
        /// The peer's role.
        peer: Role,
    },
}

/// A pre-shared key. Its bytes never appear in `Debug` output.
pub struct AuthKey(Vec<u8>);

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthKey({} bytes, redacted)", self.0.len())
    }
}

impl AuthKey {
    /// Loads the key file at `path`: a regular file of [`MIN_KEY_LEN`] to [`MAX_KEY_LEN`]
    /// bytes that neither group nor others may read or write (mode 0600 or 0400). Its bytes,
    /// as they are, are the key. Symbolic links are followed (Kubernetes mounts secrets
    /// through them); the file reached is what is checked.
    pub fn load(path: &Path) -> Result<AuthKey, AuthError> {
        let read_err = |source| AuthError::ReadKey {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(read_err)?;
        let meta = file.metadata().map_err(read_err)?;
        if !meta.is_file() {
            return Err(AuthError::KeyNotFile {
                path: path.to_path_buf(),
            });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            let path = path.to_path_buf();
            return Err(AuthError::KeyMode { path, mode });
        }
        let mut bytes = Vec::new();
        // Read one byte past the limit so that a longer file is seen as too long.
        (&mut file)
            .take(MAX_KEY_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(read_err)?;
        Self::checked(bytes, path)
    }

    /// A key from bytes already in memory (length checked as for a file).
    pub fn from_bytes(bytes: &[u8]) -> Result<AuthKey, AuthError> {
        Self::checked(bytes.to_vec(), Path::new("<memory>"))
    }

    fn checked(bytes: Vec<u8>, path: &Path) -> Result<AuthKey, AuthError> {
        if !(MIN_KEY_LEN..=MAX_KEY_LEN).contains(&bytes.len()) {
            let len = bytes.len() as u64;
            let path = path.to_path_buf();
            return Err(AuthError::KeyLength { path, len });
        }
        Ok(AuthKey(bytes))
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        keyed_mac(&self.0, parts)
    }
}

/// HMAC-SHA256 keyed with `key`, fed `parts`.
fn keyed(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        mac.update(p);
    }
    mac
}

fn keyed_mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    keyed(key, parts).finalize().into_bytes().into()
}

/// Which end of a migration stream this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that sends the VM.
    Source,
    /// The side that receives it.
    Target,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Source => 1,
            Role::Target => 2,
        }
    }

    fn peer(self) -> Role {
        match self {
            Role::Source => Role::Target,
            Role::Target => Role::Source,
        }
    }

    fn label(self) -> &'static [u8] {
        match self {
            Role::Source => b"source",
            Role::Target => b"target",
        }
    }

    /// The label of the direction this role sends in.
    fn sending(self) -> &'static [u8] {
        match self {
            Role::Source => b"source->target",
            Role::Target => b"target->source",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Source => "source",
            Role::Target => "target",
        })
    }
}

/// The per-record MAC of one direction of a session: its key, its direction label, the next
/// sequence number and the tag of the container's format. Made only by [`handshake`].
pub struct RecordMac {
    key: [u8; 32],
    /// The same key for `ring`'s AEAD (format 4's record tags).
    aead: LessSafeKey,
    label: &'static [u8],
    seq: u64,
    tag: TagKind,
}

/// Which tag a container's format version gives its header and records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TagKind {
    /// Formats 1 and 2.
    HmacSha256,
    /// Format 3: the AEAD tag of the whole bytes.
    Poly1305,
    /// Format 4: a record's head bound through the nonce, its payload as associated data.
    Bound,
}

impl std::fmt::Debug for RecordMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordMac")
            .field("label", &String::from_utf8_lossy(self.label))
            .field("seq", &self.seq)
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl RecordMac {
    fn new(key: [u8; 32], label: &'static [u8]) -> RecordMac {
        let aead = UnboundKey::new(&CHACHA20_POLY1305, &key)
            .map(LessSafeKey::new)
            .unwrap_or_else(|_| unreachable!("ChaCha20-Poly1305 takes a 32-byte key"));
        RecordMac {
            key,
            aead,
            label,
            seq: 0,
            tag: TagKind::Bound,
        }
    }

    /// Tags as containers of format `version` do (set before the header's tag).
    pub(crate) fn use_format(&mut self, version: u32) {
        self.tag = if version >= BOUND_FROM {
            TagKind::Bound
        } else if version >= POLY1305_FROM {
            TagKind::Poly1305
        } else {
            TagKind::HmacSha256
        };
    }

    /// The length of this format's tag.
    pub(crate) fn tag_len(&self) -> usize {
        if self.tag != TagKind::HmacSha256 {
            16
        } else {
            TAG_LEN
        }
    }

    fn hmac(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut mac = keyed(&self.key, &[self.label, &self.seq.to_le_bytes()]);
        for p in parts {
            mac.update(p);
        }
        mac
    }

    /// Poly1305 fed `parts` under this sequence number's one-time key: their concatenation,
    /// zero-padded to 16 bytes, then its length (u64), padded; so the tag of a header or
    /// record does not depend on how its bytes are split into parts.
    fn poly1305(&self, parts: &[&[u8]]) -> Poly1305 {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&self.seq.to_le_bytes());
        let mut one_time = [0u8; 32];
        ChaCha20::new(&self.key.into(), &nonce.into()).apply_keystream(&mut one_time);
        let mut mac = Poly1305::new(&one_time.into());
        let (mut carry, mut held, mut total) = ([0u8; 16], 0usize, 0u64);
        for part in parts {
            total += part.len() as u64;
            let mut rest = *part;
            if held > 0 {
                let n = rest.len().min(16 - held);
                carry[held..held + n].copy_from_slice(&rest[..n]);
                (held, rest) = (held + n, &rest[n..]);
                if held < 16 {
                    continue;
                }
                mac.update_padded(&carry);
            }
            let whole = rest.len() - rest.len() % 16;
            mac.update_padded(&rest[..whole]);
            held = rest.len() - whole;
            carry[..held].copy_from_slice(&rest[whole..]);
        }
        mac.update_padded(&carry[..held]);
        mac.update_padded(&total.to_le_bytes());
        mac
    }

    /// The tag of the next header (the concatenation of `parts`, [`Self::tag_len`] bytes of
    /// the returned array), or of a record in formats before 4; advances the sequence number.
    pub(crate) fn sign(&mut self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let mut tag = [0u8; TAG_LEN];
        if self.tag == TagKind::HmacSha256 {
            tag = self.hmac(parts).finalize().into_bytes().into();
        } else {
            tag[..16].copy_from_slice(&self.poly1305(parts).finalize());
        }
        self.seq += 1;
        tag
    }

    /// Format 4's nonce of the next record: its kind and flags (the head's first 4 bytes),
    /// then the sequence number.
    fn record_nonce(&self, head: &[u8; 8]) -> Nonce {
        let mut nonce = [0u8; 12];
        nonce[..4].copy_from_slice(&head[..4]);
        nonce[4..].copy_from_slice(&self.seq.to_le_bytes());
        Nonce::assume_unique_for_key(nonce)
    }

    /// The tag of the next record: `head` (kind, flags, length), `payload` and the checksum
    /// field `sum`, as its format binds them ([`Self::tag_len`] bytes of the returned array);
    /// advances the sequence number.
    pub(crate) fn sign_record(
        &mut self,
        head: &[u8; 8],
        payload: &[u8],
        sum: &[u8; 8],
    ) -> [u8; TAG_LEN] {
        if self.tag != TagKind::Bound {
            return self.sign(&[head, payload, sum]);
        }
        let mut tag = [0u8; TAG_LEN];
        let nonce = self.record_nonce(head);
        // An empty plaintext cannot exceed the algorithm's length limit.
        if let Ok(t) = self
            .aead
            .seal_in_place_separate_tag(nonce, Aad::from(payload), &mut [])
        {
            tag[..16].copy_from_slice(t.as_ref());
        }
        self.seq += 1;
        tag
    }

    /// Checks `tag` against the next record in constant time ([`Self::sign_record`]'s
    /// binding; in format 4 the checksum field must be zero); advances the sequence number
    /// when it matches.
    pub(crate) fn verify_record(
        &mut self,
        head: &[u8; 8],
        payload: &[u8],
        sum: &[u8; 8],
        tag: &[u8],
    ) -> bool {
        if self.tag != TagKind::Bound {
            return self.verify(&[head, payload, sum], tag);
        }
        let mut got = [0u8; 16];
        if tag.len() != got.len() || *sum != [0u8; 8] {
            return false;
        }
        got.copy_from_slice(tag);
        let nonce = self.record_nonce(head);
        // Constant time (`ring`'s tag comparison); `got` is an empty ciphertext and its tag.
        let ok = self
            .aead
            .open_in_place(nonce, Aad::from(payload), &mut got)
            .is_ok();
        if ok {
            self.seq += 1;
        }
        ok
    }

    /// Checks `tag` against the next header (or a record in formats before 4) in constant
    /// time; advances the sequence number when it matches.
    pub(crate) fn verify(&mut self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let ok = if self.tag != TagKind::HmacSha256 {
            // Constant time (`UniversalHash::verify`).
            tag.len() == 16
                && self
                    .poly1305(parts)
                    .verify(poly1305::Block::from_slice(tag))
                    .is_ok()
        } else {
            self.hmac(parts).verify_slice(tag).is_ok()
        };
        if ok {
            self.seq += 1;
        }
        ok
    }

    /// The sequence number of the next header or record.
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// An authenticated session: the MAC for what this side sends and for what it receives.
#[derive(Debug)]
pub struct Session {
    /// Hand to [`crate::container::Writer::authenticated`].
    pub send: RecordMac,
    /// Hand to [`crate::container::Reader::authenticated`].
    pub recv: RecordMac,
}

fn exchange<S: Read + Write>(
    stream: &mut S,
    out: &[u8],
    input: &mut [u8],
    step: &'static str,
) -> Result<(), AuthError> {
    stream
        .write_all(out)
        .and_then(|()| stream.flush())
        .map_err(|source| AuthError::Io { step, source })?;
    stream.read_exact(input).map_err(|source| {
        if source.kind() == io::ErrorKind::UnexpectedEof {
            AuthError::Closed { step }
        } else {
            AuthError::Io { step, source }
        }
    })
}

/// Runs the mutual handshake as `role` on `stream` with `key`. Returns the session when both
/// sides hold the same key; otherwise an error, and this side must close the stream.
pub fn handshake<S: Read + Write>(
    stream: &mut S,
    key: &AuthKey,
    role: Role,
) -> Result<Session, AuthError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| AuthError::Random(e.to_string()))?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(&HELLO_MAGIC);
    hello.extend_from_slice(&HANDSHAKE_VERSION.to_le_bytes());
    hello.push(role.byte());
    hello.extend_from_slice(&nonce);
    let mut theirs = [0u8; HELLO_LEN];
    exchange(stream, &hello, &mut theirs, "exchanging hellos")?;
    let mut head = [0u8; 12];
    head.copy_from_slice(&theirs[..12]);
    if head[..8] != HELLO_MAGIC || head[8..12] != HANDSHAKE_VERSION.to_le_bytes() {
        return Err(AuthError::BadHello { found: head });
    }
    let peer = role.peer();
    if theirs[12] != peer.byte() {
        let (found, ours) = (theirs[12], role);
        return Err(AuthError::BadRole { found, ours, peer });
    }
    let peer_nonce = &theirs[13..];
    let (ns, nt): (&[u8], &[u8]) = match role {
        Role::Source => (&nonce, peer_nonce),
        Role::Target => (peer_nonce, &nonce),
    };
    let proof_of = |r: Role| key.mac(&[b"vmhost-persist-1 proof ", r.label(), ns, nt]);
    let mut their_proof = [0u8; 32];
    exchange(
        stream,
        &proof_of(role),
        &mut their_proof,
        "exchanging proofs",
    )?;
    // Constant-time comparison (`verify_slice`).
    let peer_parts: [&[u8]; 4] = [b"vmhost-persist-1 proof ", peer.label(), ns, nt];
    if keyed(&key.0, &peer_parts)
        .verify_slice(&their_proof)
        .is_err()
    {
        return Err(AuthError::BadProof { peer });
    }
    let direction = |r: Role| {
        RecordMac::new(
            key.mac(&[b"vmhost-persist-1 key ", r.sending(), ns, nt]),
            r.sending(),
        )
    };
    Ok(Session {
        send: direction(role),
        recv: direction(peer),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chacha20poly1305::aead::{AeadInPlace, KeyInit as AeadKeyInit};
    use chacha20poly1305::ChaCha20Poly1305;

    fn mac(seq: u64) -> RecordMac {
        let mut m = RecordMac::new(
            std::array::from_fn(|i| u8::try_from(i * 7 + 1).unwrap_or(0)),
            b"source->target",
        );
        m.seq = seq;
        m.use_format(3);
        m
    }

    /// A format-3 tag is RFC 8439's ChaCha20-Poly1305 tag of an empty plaintext whose
    /// associated data is the header's or record's bytes, under the direction key and the
    /// nonce 0 | sequence number; it does not depend on how the bytes are split into parts,
    /// and it verifies in the next sequence number's place only.
    #[test]
    fn a_format_3_tag_is_the_rfc_8439_aead_tag_of_the_bytes() {
        let bytes: Vec<u8> = (0..200u32).map(|i| (i * 31 % 251) as u8).collect();
        for seq in [0u64, 1, 0x0102_0304_0506_0708] {
            let m = mac(seq);
            let mut nonce = [0u8; 12];
            nonce[4..].copy_from_slice(&seq.to_le_bytes());
            let aead = ChaCha20Poly1305::new(&m.key.into());
            let want = aead
                .encrypt_in_place_detached(&nonce.into(), &bytes, &mut [])
                .expect("an empty plaintext");
            for split in [
                (0, 0),
                (0, 200),
                (1, 17),
                (15, 16),
                (16, 32),
                (33, 199),
                (100, 100),
            ] {
                let (a, rest) = bytes.split_at(split.0);
                let (b, c) = rest.split_at(split.1 - split.0);
                let mut signer = mac(seq);
                let tag = signer.sign(&[a, b, c]);
                assert_eq!(&tag[..16], want.as_slice(), "seq {seq}, split {split:?}");
                assert_eq!(signer.seq(), seq + 1);
                assert!(mac(seq).verify(&[&bytes], &tag[..16]));
                assert!(!mac(seq + 1).verify(&[&bytes], &tag[..16]));
                assert!(!mac(seq).verify(&[&bytes], &tag[..15]));
            }
        }
    }

    /// A format-4 record tag is RFC 8439's ChaCha20-Poly1305 tag of an empty plaintext whose
    /// associated data is the payload, under the nonce kind | flags | sequence number (checked
    /// against the RustCrypto AEAD, an independent implementation). It verifies only with
    /// the same kind, flags, payload, length, sequence number and a zero checksum field.
    #[test]
    fn a_format_4_record_tag_binds_the_head_through_the_nonce() {
        let payload: Vec<u8> = (0..300u32).map(|i| (i * 31 % 251) as u8).collect();
        let head = |kind: u16, flags: u16, len: usize| {
            let mut h = [0u8; 8];
            h[0..2].copy_from_slice(&kind.to_le_bytes());
            h[2..4].copy_from_slice(&flags.to_le_bytes());
            h[4..8].copy_from_slice(&u32::try_from(len).unwrap().to_le_bytes());
            h
        };
        let at = |seq: u64| {
            let mut m = mac(seq);
            m.use_format(4);
            m
        };
        let zero = [0u8; 8];
        for seq in [1u64, 7, 0x0102_0304_0506_0708] {
            let h = head(0x0102, 1, payload.len());
            let mut nonce = [0u8; 12];
            nonce[..4].copy_from_slice(&h[..4]);
            nonce[4..].copy_from_slice(&seq.to_le_bytes());
            let aead = ChaCha20Poly1305::new(&at(seq).key.into());
            let want = aead
                .encrypt_in_place_detached(&nonce.into(), &payload, &mut [])
                .expect("an empty plaintext");
            let mut signer = at(seq);
            let tag = signer.sign_record(&h, &payload, &zero);
            assert_eq!(&tag[..16], want.as_slice(), "seq {seq}");
            assert_eq!(signer.seq(), seq + 1);
            let tag = &tag[..16];
            let mut ok = at(seq);
            assert!(ok.verify_record(&h, &payload, &zero, tag));
            assert_eq!(ok.seq(), seq + 1);
            let mut changed = payload.clone();
            changed[150] ^= 1;
            let refused: [(&str, bool); 8] = [
                (
                    "next seq",
                    at(seq + 1).verify_record(&h, &payload, &zero, tag),
                ),
                (
                    "kind",
                    at(seq).verify_record(&head(0x0103, 1, 300), &payload, &zero, tag),
                ),
                (
                    "flags",
                    at(seq).verify_record(&head(0x0102, 0, 300), &payload, &zero, tag),
                ),
                ("payload", at(seq).verify_record(&h, &changed, &zero, tag)),
                (
                    "length",
                    at(seq).verify_record(&head(0x0102, 1, 299), &payload[..299], &zero, tag),
                ),
                (
                    "checksum field",
                    at(seq).verify_record(&h, &payload, &[1, 0, 0, 0, 0, 0, 0, 0], tag),
                ),
                (
                    "short tag",
                    at(seq).verify_record(&h, &payload, &zero, &tag[..15]),
                ),
                ("format 3", mac(seq).verify_record(&h, &payload, &zero, tag)),
            ];
            for (what, verified) in refused {
                assert!(!verified, "seq {seq}: a changed {what} verified");
            }
        }
    }

    /// Formats 1 and 2 keep their 32-byte HMAC-SHA256 tags.
    #[test]
    fn formats_before_3_keep_hmac_sha256_tags() {
        let mut m = mac(5);
        m.use_format(2);
        assert_eq!(m.tag_len(), 32);
        let want = keyed_mac(&m.key, &[b"source->target", &5u64.to_le_bytes(), b"record"]);
        assert_eq!(m.sign(&[b"rec", b"ord"]), want);
        m.use_format(3);
        assert_eq!(m.tag_len(), 16);
    }
}
