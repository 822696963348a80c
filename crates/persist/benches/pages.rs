//! The page stream's cost per byte, on this host's CPU: guest pages written as page-run
//! records (what a snapshot's memory files and each migration round carry), plain (a snapshot
//! file: a checksum per record, XXH64 from format 5) and authenticated (a migration stream: a Poly1305 tag per record,
//! format 3), and read back the same two ways. The sink is memory (`io::sink` / a `Vec`): this
//! is the CPU's share of a round, without the socket.
//!
//! Run: `cargo bench -p vmhost-persist --bench pages` (docs/benchmarks.md, "Page stream").

use std::io::{Cursor, Read, Write};
use std::os::unix::net::UnixStream;

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use vmhost_persist::auth::{handshake, AuthKey, Role, Session};
use vmhost_persist::container::{Reader, RecordKind, Writer};
use vmhost_persist::pages::{decode_run, write_pages, CellGeometry};

/// 16 MiB of non-zero 4 KiB pages (no page is skipped).
const BYTES: usize = 16 << 20;

fn memory() -> Vec<u8> {
    (0..BYTES)
        .map(|i| u8::try_from(i % 251).unwrap_or(0) | 1)
        .collect()
}

/// A sending and a receiving session of one handshake over a socket pair.
fn sessions() -> (Session, Session) {
    let key = AuthKey::from_bytes(&[7u8; 48]).expect("key");
    let (mut a, mut b) = UnixStream::pair().expect("socket pair");
    let k2 = AuthKey::from_bytes(&[7u8; 48]).expect("key");
    let target = std::thread::spawn(move || handshake(&mut b, &k2, Role::Target).expect("target"));
    let source = handshake(&mut a, &key, Role::Source).expect("source");
    (source, target.join().expect("join"))
}

fn write_all<W: Write>(mut w: Writer<W>, geometry: &CellGeometry, mem: &[u8]) -> W {
    write_pages(&mut w, geometry, 0, mem, |_, _| false).expect("write");
    w.finish().expect("finish")
}

fn read_all<R: Read>(mut r: Reader<R>, geometry: &CellGeometry) -> usize {
    let mut n = 0;
    while let Some(rec) = r.next_record().expect("record") {
        if rec.kind == RecordKind::PAGES {
            n += decode_run(&rec.payload, geometry).expect("run").bytes.len();
        }
    }
    n
}

fn bench(c: &mut Criterion) {
    let mem = memory();
    let geometry = CellGeometry::new(0, 4096, BYTES as u64).expect("geometry");
    let mut g = c.benchmark_group("page_stream");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.sample_size(20);
    g.bench_function("write_plain", |b| {
        b.iter(|| {
            write_all(
                Writer::new(std::io::sink(), "bench").expect("w"),
                &geometry,
                &mem,
            )
        })
    });
    g.bench_function("write_authenticated", |b| {
        b.iter_batched(
            || sessions().0,
            |s| {
                let w = Writer::authenticated(std::io::sink(), "bench", s.send).expect("w");
                write_all(w, &geometry, &mem)
            },
            criterion::BatchSize::PerIteration,
        )
    });
    let plain = write_all(
        Writer::new(Vec::new(), "bench").expect("w"),
        &geometry,
        &mem,
    );
    g.bench_function("read_plain", |b| {
        b.iter(|| {
            let r = Reader::new(Cursor::new(black_box(&plain)), &[RecordKind::PAGES]).expect("r");
            assert_eq!(read_all(r, &geometry), BYTES);
        })
    });
    g.bench_function("read_authenticated", |b| {
        b.iter_batched(
            || {
                let (s, t) = sessions();
                let w = Writer::authenticated(Vec::new(), "bench", s.send).expect("w");
                (write_all(w, &geometry, &mem), t)
            },
            |(bytes, t)| {
                let r = Reader::authenticated(Cursor::new(bytes), &[RecordKind::PAGES], t.recv)
                    .expect("r");
                assert_eq!(read_all(r, &geometry), BYTES);
            },
            criterion::BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
