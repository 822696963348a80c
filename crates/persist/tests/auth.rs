//! Authenticated streams on a real socket pair: the key file loader, the mutual handshake, and
//! the per-record MAC against altered, dropped, repeated, reordered, injected and cut records.
#![allow(clippy::cast_possible_truncation)] // small test sizes

use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::thread;

use vmhost_persist::auth::{handshake, AuthError, AuthKey, Role, Session, MIN_KEY_LEN};
use vmhost_persist::container::{ContainerError, Reader, RecordKind, Writer};

const KNOWN: &[RecordKind] = &[RecordKind::SPEC, RecordKind::PAGES];
const VERSION: &str = "0.1.0";

fn key(byte: u8) -> AuthKey {
    AuthKey::from_bytes(&[byte; 32]).expect("32-byte key")
}

/// Runs the handshake on a socket pair: source here, target on a thread. Returns both results
/// and both ends of the socket.
fn pair(
    source_key: AuthKey,
    target_key: AuthKey,
) -> (
    Result<Session, AuthError>,
    Result<Session, AuthError>,
    UnixStream,
    UnixStream,
) {
    let (mut s, t) = UnixStream::pair().expect("socket pair");
    let target = thread::spawn(move || {
        let mut t = t;
        let r = handshake(&mut t, &target_key, Role::Target);
        (r, t)
    });
    let src = handshake(&mut s, &source_key, Role::Source);
    let (tgt, t) = target.join().expect("target thread");
    (src, tgt, s, t)
}

fn sessions() -> (Session, Session) {
    let (s, t, _, _) = pair(key(7), key(7));
    (s.expect("source"), t.expect("target"))
}

/// An authenticated container of three records, as the source sends it.
fn stream(session: Session) -> (Vec<u8>, Vec<(u16, Vec<u8>)>) {
    let records = vec![
        (RecordKind::SPEC.0, b"name: web-1".to_vec()),
        (RecordKind::PAGES.0, vec![0xab; 100]),
        (RecordKind::PAGES.0, vec![0xcd; 50]),
    ];
    let mut w = Writer::authenticated(Vec::new(), VERSION, session.send).expect("header");
    for (k, p) in &records {
        w.write_record(RecordKind(*k), p).expect("record");
    }
    (w.finish().expect("end"), records)
}

/// The length of a record tag of this format (Poly1305, from format 3).
const TAG: usize = 16;

/// The frames of an authenticated container: the header, each record, the end record (each
/// with its tag).
fn frames(bytes: &[u8]) -> Vec<Vec<u8>> {
    let header = 8 + 4 + 2 + VERSION.len() + 8 + TAG;
    let mut out = vec![bytes[..header].to_vec()];
    let mut at = header;
    while at < bytes.len() {
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().expect("4")) as usize;
        let end = at + 8 + len + 8 + TAG;
        out.push(bytes[at..end].to_vec());
        at = end;
    }
    out
}

fn read(bytes: &[u8], session: Session) -> Result<Vec<(u16, Vec<u8>)>, ContainerError> {
    let mut r = Reader::authenticated(bytes, KNOWN, session.recv)?;
    let mut out = Vec::new();
    while let Some(rec) = r.next_record()? {
        out.push((rec.kind.0, rec.payload));
    }
    Ok(out)
}

#[test]
fn the_right_key_works_both_ways_on_a_socket() {
    let (src, tgt, s, t) = pair(key(3), key(3));
    let (src, tgt) = (src.expect("source"), tgt.expect("target"));
    let reader = thread::spawn(move || {
        let mut r = Reader::authenticated(&t, KNOWN, tgt.recv).expect("header");
        let rec = r.next_record().expect("record").expect("one");
        assert!(r.next_record().expect("end").is_none());
        // And the target answers on the same connection.
        let mut w = Writer::authenticated(&t, VERSION, tgt.send).expect("header");
        w.write_record(RecordKind::SPEC, b"accepted")
            .expect("reply");
        w.finish().expect("end");
        rec.payload
    });
    let mut w = Writer::authenticated(&s, VERSION, src.send).expect("header");
    w.write_record(RecordKind::PAGES, &[9u8; 4096])
        .expect("pages");
    w.finish().expect("end");
    let mut r = Reader::authenticated(&s, KNOWN, src.recv).expect("reply header");
    let reply = r.next_record().expect("reply").expect("one");
    assert_eq!(reply.payload, b"accepted");
    assert!(r.next_record().expect("end").is_none());
    assert_eq!(reader.join().expect("target"), vec![9u8; 4096]);
}

#[test]
fn a_wrong_key_is_refused_on_both_sides_before_any_record() {
    let (src, tgt, s, mut t) = pair(key(1), key(2));
    assert!(
        matches!(src, Err(AuthError::BadProof { peer: Role::Target })),
        "{src:?}"
    );
    assert!(
        matches!(tgt, Err(AuthError::BadProof { peer: Role::Source })),
        "{tgt:?}"
    );
    let text = src.expect_err("refused").to_string();
    assert!(text.contains("--auth-key"), "{text}");
    // The source sent nothing after the handshake: its end closes and the target's socket
    // holds no further byte.
    drop(s);
    let mut rest = Vec::new();
    t.read_to_end(&mut rest).expect("read to EOF");
    assert!(rest.is_empty(), "{} bytes after the handshake", rest.len());
}

#[test]
fn a_peer_that_is_not_a_vmhost_or_has_the_same_role_is_refused() {
    let (mut a, mut b) = UnixStream::pair().expect("pair");
    let fake = thread::spawn(move || {
        use std::io::Write;
        b.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789012345678")
            .expect("write");
        b
    });
    let err = handshake(&mut a, &key(1), Role::Source).expect_err("not vmhost");
    assert!(matches!(err, AuthError::BadHello { .. }), "{err:?}");
    drop(fake.join());

    let (mut a, b) = UnixStream::pair().expect("pair");
    let other = thread::spawn(move || {
        let mut b = b;
        handshake(&mut b, &key(1), Role::Source)
    });
    let err = handshake(&mut a, &key(1), Role::Source).expect_err("two sources");
    assert!(
        matches!(
            err,
            AuthError::BadRole {
                found: 1,
                ours: Role::Source,
                peer: Role::Target
            }
        ),
        "{err:?}"
    );
    drop(a);
    assert!(other.join().expect("thread").is_err());
}

#[test]
fn a_peer_that_hangs_up_is_a_clear_error() {
    let (mut a, b) = UnixStream::pair().expect("pair");
    drop(b);
    let err = handshake(&mut a, &key(1), Role::Target).expect_err("closed");
    assert!(
        matches!(err, AuthError::Closed { .. } | AuthError::Io { .. }),
        "{err:?}"
    );
}

#[test]
fn an_untouched_stream_reads_back() {
    let (src, tgt) = sessions();
    let (bytes, records) = stream(src);
    assert_eq!(read(&bytes, tgt).expect("reads"), records);
}

/// A fresh session's stream, changed by `tamper`, read by the target of the same session.
fn tampered(
    tamper: impl FnOnce(Vec<Vec<u8>>) -> Vec<Vec<u8>>,
) -> Result<Vec<(u16, Vec<u8>)>, ContainerError> {
    let (src, tgt) = sessions();
    let (bytes, _) = stream(src);
    read(&tamper(frames(&bytes)).concat(), tgt)
}

fn assert_auth_failure(r: Result<Vec<(u16, Vec<u8>)>, ContainerError>, offset: u64, seq: u64) {
    match r {
        Err(e @ ContainerError::Authentication { .. }) => {
            let ContainerError::Authentication {
                offset: o, seq: q, ..
            } = &e
            else {
                unreachable!()
            };
            assert_eq!((*o, *q), (offset, seq), "{e}");
            assert!(e.to_string().contains("fails authentication"), "{e}");
        }
        other => panic!("expected an authentication failure at {offset}, seq {seq}: {other:?}"),
    }
}

fn offset_of(frames: &[Vec<u8>], index: usize) -> u64 {
    frames[..index].iter().map(|f| f.len() as u64).sum()
}

#[test]
fn every_flipped_bit_is_detected() {
    let (src, _) = sessions();
    let len = stream(src).0.len();
    for at in 0..len {
        let r = tampered(|f| {
            let mut bytes = f.concat();
            bytes[at] ^= 0x01;
            vec![bytes]
        });
        // Mostly an authentication failure; a flip in a length field may first make the record
        // run past the end (truncated) or over the cap. Never a success.
        assert!(r.is_err(), "flip at byte {at} went unnoticed");
    }
    // A flipped payload bit in the second record: refused at that record, sequence number 2.
    let (src, _) = sessions();
    let f = frames(&stream(src).0);
    let r = tampered(|mut f| {
        f[2][10] ^= 0x80;
        f
    });
    assert_auth_failure(r, offset_of(&f, 2), 2);
}

#[test]
fn a_dropped_record_is_detected() {
    let (src, _) = sessions();
    let f = frames(&stream(src).0);
    let r = tampered(|mut f| {
        f.remove(2);
        f
    });
    // The third record arrives where the second was expected.
    assert_auth_failure(r, offset_of(&f, 2), 2);
}

#[test]
fn a_repeated_record_is_detected() {
    let (src, _) = sessions();
    let f = frames(&stream(src).0);
    let r = tampered(|mut f| {
        let again = f[1].clone();
        f.insert(2, again);
        f
    });
    assert_auth_failure(r, offset_of(&f, 2), 2);
}

#[test]
fn reordered_records_are_detected() {
    let (src, _) = sessions();
    let f = frames(&stream(src).0);
    let r = tampered(|mut f| {
        f.swap(2, 3);
        f
    });
    assert_auth_failure(r, offset_of(&f, 2), 2);
}

#[test]
fn an_injected_record_is_detected() {
    let (src, _) = sessions();
    let f = frames(&stream(src).0);
    // A record with a right CRC and a tag made with another key.
    let r = tampered(|mut f| {
        let (other, _) = sessions();
        let forged = frames(&stream(other).0)[1].clone();
        f.insert(1, forged);
        f
    });
    assert_auth_failure(r, offset_of(&f, 1), 1);
}

#[test]
fn records_reflected_back_to_their_sender_are_refused() {
    let (_, tgt) = sessions();
    let Session { send, recv } = tgt;
    // The target's own outgoing stream, fed back to the target's reader.
    let mut w = Writer::authenticated(Vec::new(), VERSION, send).expect("header");
    w.write_record(RecordKind::SPEC, b"x").expect("record");
    let bytes = w.finish().expect("end");
    let r = read(
        &bytes,
        Session {
            send: sessions().0.send,
            recv,
        },
    );
    assert_auth_failure(r, 0, 0);
}

#[test]
fn a_cut_stream_is_detected() {
    // Without its end record, and cut inside a record.
    let r = tampered(|mut f| {
        f.pop();
        f
    });
    assert!(matches!(r, Err(ContainerError::Truncated { .. })), "{r:?}");
    let r = tampered(|mut f| {
        let last = f.len() - 2;
        f[last].truncate(20);
        f.truncate(last + 1);
        f
    });
    assert!(matches!(r, Err(ContainerError::Truncated { .. })), "{r:?}");
}

#[test]
fn a_key_file_must_be_private_and_long_enough() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("key");
    fs::write(&path, [5u8; MIN_KEY_LEN]).expect("write");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod");
    let loaded = AuthKey::load(&path).expect("0600, 32 bytes");
    assert!(!format!("{loaded:?}").contains('5'), "{loaded:?}");

    for mode in [0o640, 0o604, 0o660, 0o644] {
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).expect("chmod");
        let err = AuthKey::load(&path).expect_err("open to others");
        assert!(
            matches!(err, AuthError::KeyMode { mode: m, .. } if m == mode),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&path.display().to_string()) && text.contains("chmod 600"),
            "{text}"
        );
    }
    fs::set_permissions(&path, fs::Permissions::from_mode(0o400)).expect("chmod");
    AuthKey::load(&path).expect("0400 is private too");

    let short = dir.path().join("short");
    fs::write(&short, [5u8; MIN_KEY_LEN - 1]).expect("write");
    fs::set_permissions(&short, fs::Permissions::from_mode(0o600)).expect("chmod");
    let err = AuthKey::load(&short).expect_err("short");
    assert!(
        matches!(err, AuthError::KeyLength { len: 31, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("/dev/urandom"), "{err}");

    let err = AuthKey::load(dir.path()).expect_err("a directory");
    assert!(
        matches!(
            err,
            AuthError::KeyNotFile { .. } | AuthError::KeyMode { .. }
        ),
        "{err:?}"
    );
    let err = AuthKey::load(&dir.path().join("absent")).expect_err("missing");
    assert!(matches!(err, AuthError::ReadKey { .. }), "{err:?}");
}
