//! virtio-vsock with Linux's own driver (`vmw_vsock_virtio_transport` over `virtio_mmio`, found
//! through vmhost's DSDT), in one guest boot:
//!
//! - host → guest: the test connects to the VM's Unix socket, writes `CONNECT 5000\n`, gets
//!   `OK <host port>\n`, sends 512 KiB and reads them back from the guest's echo server
//!   (`testbed/guest/vsock-test.c`), byte for byte;
//! - guest → host: the guest connects to CID 2 port 6000, which vmhost maps to the Unix socket
//!   `<socket>_6000` where the test listens and echoes; the guest checks 256 KiB came back and
//!   the test checks what it received;
//! - the guest powers off (exit 0) and the socket is gone.
//!
//! 512 KiB is twice the credit vmhost gives a connection and far more than the guest's
//! buffers, so flow control (credit updates both ways) is exercised too.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::host;
use crate::linux_tests::{assets, linux_spec, Assets};
use crate::vm::{Env, Running};
use crate::{ensure, Outcome};

/// How long the guest may take to boot and reach its echo server, and the host side to wait
/// for the guest's connection (emulated host, debug vmhost). Not an assertion on speed: only a
/// bound so a broken device fails instead of hanging the suite.
const LIMIT: Duration = Duration::from_secs(150);
/// Bytes the host sends through the guest's echo server.
const HOST_TO_GUEST: usize = 512 * 1024;
/// Bytes the guest sends through the host's echo listener (vsock-test's argument).
const GUEST_TO_HOST: usize = 256 * 1024;

/// The test pattern, as vsock-test.c makes it: byte i = (i * 131 + (i >> 8)) mod 256.
fn pattern(i: usize) -> u8 {
    u8::try_from(i.wrapping_mul(131).wrapping_add(i >> 8) & 0xff).unwrap_or(0)
}

/// The first index where `data` differs from the pattern.
fn mismatch(data: &[u8]) -> Option<usize> {
    data.iter().enumerate().position(|(i, &b)| b != pattern(i))
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(12)..].join(" | ")
}

/// Waits until the VM's console (its stdout file) shows `marker`.
fn wait_for_console(vm: &Running, out: &Path, marker: &str) -> Result<(), String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        // Whether it had ended before the console is read: its last lines are then in.
        let ended = vm.ended();
        let serial = std::fs::read_to_string(out).unwrap_or_default();
        if serial.contains(marker) {
            return Ok(());
        }
        ensure!(
            !ended,
            "the VM ended before {marker:?} on the guest console: {}; stderr: {}",
            tail(&serial),
            vm.stderr()
        );
        ensure!(
            Instant::now() < deadline,
            "no {marker:?} on the guest console: {}; stderr: {}",
            tail(&serial),
            vm.stderr()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The host's listener for guest port 6000: accepts one connection, echoes it until the guest
/// shuts its side, and returns what it received.
fn echo_listener(
    path: PathBuf,
) -> Result<std::thread::JoinHandle<Result<Vec<u8>, String>>, String> {
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).map_err(|e| format!("listen on {}: {e}", path.display()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("non-blocking listener: {e}"))?;
    Ok(std::thread::spawn(move || {
        let deadline = Instant::now() + LIMIT * 2;
        let mut stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(format!("the guest never connected to {}", path.display()));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(format!("accept on {}: {e}", path.display())),
            }
        };
        let setup = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(LIMIT)));
        setup.map_err(|e| format!("guest connection setup: {e}"))?;
        let got = echo_until_eof(&mut stream);
        let _ = std::fs::remove_file(&path);
        got
    }))
}

/// Host → guest through `CONNECT 5000`: returns the assigned host port and the echoed bytes.
fn connect_and_echo(socket: &Path) -> Result<(u32, Vec<u8>), String> {
    let mut s = UnixStream::connect(socket)
        .map_err(|e| format!("connect to the VM's vsock socket {}: {e}", socket.display()))?;
    s.set_read_timeout(Some(LIMIT))
        .map_err(|e| format!("read timeout: {e}"))?;
    s.write_all(b"CONNECT 5000\n")
        .map_err(|e| format!("write CONNECT: {e}"))?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while byte[0] != b'\n' {
        let n = s
            .read(&mut byte)
            .map_err(|e| format!("reading the OK line (got {line:?}): {e}"))?;
        ensure!(
            n == 1,
            "the socket closed before OK (got {:?})",
            String::from_utf8_lossy(&line)
        );
        line.push(byte[0]);
        ensure!(
            line.len() < 32,
            "no newline after {:?}",
            String::from_utf8_lossy(&line)
        );
    }
    let text = String::from_utf8_lossy(&line).to_string();
    let port = text
        .trim_end()
        .strip_prefix("OK ")
        .and_then(|p| p.parse::<u32>().ok())
        .ok_or_else(|| format!("vmhost answered {text:?}, want \"OK <port>\\n\""))?;
    let writer = s
        .try_clone()
        .map_err(|e| format!("clone the stream: {e}"))?;
    let back = send_and_read_back(s, writer, |w| {
        w.shutdown(std::net::Shutdown::Write)
            .map_err(|e| format!("shutdown(SHUT_WR): {e}"))
    })?;
    Ok((port, back))
}

/// Echoes what the peer sends until it shuts its side; returns what it sent.
fn echo_until_eof<S: Read + Write>(stream: &mut S) -> Result<Vec<u8>, String> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream
            .read(&mut buf)
            .map_err(|e| format!("reading the guest's bytes after {}: {e}", got.len()))?;
        if n == 0 {
            return Ok(got);
        }
        got.extend_from_slice(&buf[..n]);
        stream
            .write_all(&buf[..n])
            .map_err(|e| format!("echoing to the guest: {e}"))?;
    }
}

/// Sends [`HOST_TO_GUEST`] pattern bytes through `writer` (then `finish`, the half close) on a
/// thread while reading the echo from `reader` until EOF.
fn send_and_read_back<R: Read, W: Write + Send + 'static>(
    mut reader: R,
    mut writer: W,
    finish: fn(&W) -> Result<(), String>,
) -> Result<Vec<u8>, String> {
    let sender = std::thread::spawn(move || -> Result<(), String> {
        let data: Vec<u8> = (0..HOST_TO_GUEST).map(pattern).collect();
        writer
            .write_all(&data)
            .map_err(|e| format!("sending to the guest: {e}"))?;
        finish(&writer)
    });
    let mut back = Vec::new();
    let read = reader.read_to_end(&mut back);
    let sent = sender.join().map_err(|_| "the sender thread panicked")?;
    read.map_err(|e| format!("reading the echo after {} bytes: {e}", back.len()))?;
    sent?;
    Ok(back)
}

/// The echoes' bytes, the guest's own account, and exit 0 after its poweroff.
fn check_both_ways(env: &Env, vm: &Running, out: &Path, back: &[u8], received: &[u8]) -> Outcome {
    ensure!(
        back.len() == HOST_TO_GUEST && mismatch(back).is_none(),
        "host → guest echo: {} of {HOST_TO_GUEST} bytes back, first difference at {:?}",
        back.len(),
        mismatch(back)
    );
    ensure!(
        received.len() == GUEST_TO_HOST && mismatch(received).is_none(),
        "guest → host: the listener got {} of {GUEST_TO_HOST} bytes, first difference at {:?}",
        received.len(),
        mismatch(received)
    );
    let code = env.wait(vm.pid)?;
    let serial = std::fs::read_to_string(out).unwrap_or_default();
    ensure!(
        serial.contains(&format!("GUEST vsock_served={HOST_TO_GUEST}"))
            && serial.contains(&format!("GUEST vsock_g2h=ok bytes={GUEST_TO_HOST}")),
        "the guest's own account: {}",
        tail(&serial)
    );
    ensure!(
        code == 0,
        "exit {code} after the guest powered off: {}; stderr: {}",
        tail(&serial),
        vm.stderr()
    );
    Ok(())
}

/// Starts VM `name` (2 vCPUs, 256 MiB, `vmhost.action=vsock`) with `devices` appended to its
/// spec and waits for its guest to listen on vsock port 5000; returns the VM and its console
/// file.
fn start_listening_guest(
    env: &Env,
    a: &Assets,
    name: &str,
    devices: &str,
) -> Result<(Running, PathBuf), String> {
    let mut toml = linux_spec(name, (1, 2), "", "256Mi", &a.vmlinux, &a.initrd, "vsock");
    toml.push_str(devices);
    let spec = env.spec(name, &toml)?;
    let vm = env.start(name, env.command(&["--config", &spec.to_string_lossy()]), 2)?;
    let out = env.work.join(format!("{name}.out"));
    wait_for_console(&vm, &out, "GUEST-VSOCK-LISTENING port=5000")?;
    Ok((vm, out))
}

/// One Linux guest with a vsock device (`autoattach_vsock`: CID 3, `<run dir>/linvsock.vsock`):
/// an echo from the host through `CONNECT`, an echo from the guest through `<socket>_6000`,
/// exit 0, the socket removed.
pub fn linux_guest_echo_both_ways(env: &Env) -> Outcome {
    let a = assets(env)?;
    host::set_2m_pools(&[128, 0])?;
    // KubeVirt's autoattachVSOCK in TOML: CID 3, the socket named after the VM in the run dir.
    let socket = env.run_dir.join("linvsock.vsock");
    let _ = std::fs::remove_file(&socket);
    let g2h = echo_listener(PathBuf::from(format!("{}_6000", socket.display())))?;
    let (vm, out) =
        start_listening_guest(env, &a, "linvsock", "[devices]\nautoattach_vsock = true\n")?;
    let (port, back) = connect_and_echo(&socket)?;
    ensure!(port >= 1 << 30, "host port {port}, want one from 2^30 on");
    let received = g2h.join().map_err(|_| "the listener thread panicked")??;
    check_both_ways(env, &vm, &out, &back, &received)?;
    ensure!(
        !socket.exists(),
        "{} is still there after the VM stopped",
        socket.display()
    );
    Ok(())
}

/// A second VM asking vhost-vsock for CID 3 while the first holds it: exit 1 naming the field.
fn cid_taken_is_refused(env: &Env, kernel: &Path) -> Outcome {
    let toml = format!(
        "name = \"linvhost2\"\n[cpu]\ncores = 1\n[memory]\nguest = \"256Mi\"\n\
         [boot]\nkernel = \"{}\"\n[devices.vsock]\ncid = 3\nbackend = \"vhost\"\n",
        kernel.display()
    );
    let spec = env.spec("linvhost2", &toml)?;
    let out = env.run(&["--config", &spec.to_string_lossy()])?;
    ensure!(
        out.code == 1 && out.stderr.contains("devices.vsock.cid") && out.stderr.contains("taken"),
        "a second VM on CID 3: exit {}, want 1 naming devices.vsock.cid; stderr: {}",
        out.code,
        out.stderr
    );
    Ok(())
}

/// The same guest and echoes on `backend = "vhost"`: the kernel's vhost-vsock serves the queues,
/// the host side is `AF_VSOCK` (the test connects to CID 3 port 5000 and listens on port 6000),
/// a second VM cannot take CID 3, the guest powers off (exit 0).
pub fn vhost_linux_guest_echo_both_ways(env: &Env) -> Outcome {
    vhost_echo_both_ways(env, "linvhost", "")
}

/// [`vhost_linux_guest_echo_both_ways`] with the device on virtio-pci
/// (`boot.virtio_announce = "pci"`): the kernel uses both rings at once and its call
/// eventfds come to vmhost as one event, so each used ring's MSI-X vector must be raised (the
/// guest's driver serves a queue only on its own vector).
pub fn vhost_pci_linux_guest_echo_both_ways(env: &Env) -> Outcome {
    vhost_echo_both_ways(env, "linvhostpci", "virtio_announce = \"pci\"\n")
}

/// The vhost echo test of the guest `name`, `boot_extra` added to its `[boot]`.
fn vhost_echo_both_ways(env: &Env, name: &str, boot_extra: &str) -> Outcome {
    ensure!(
        Path::new("/dev/vhost-vsock").exists(),
        "/dev/vhost-vsock is missing in the emulated host (vhost_vsock did not load)"
    );
    let a = assets(env)?;
    host::set_2m_pools(&[128, 0])?;
    let listener = crate::vsock_af::listen(6000)?;
    // A failure below stops the listener's thread and waits for it, so that port 6000 is free
    // again for the next test (a failed guest once left it bound and failed the next test too).
    let stop = Arc::new(AtomicBool::new(false));
    let g2h = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut s = crate::vsock_af::accept(&listener, LIMIT * 2, &stop)?;
            echo_until_eof(&mut s)
        })
    };
    let echoed = (|| {
        let (vm, out) = start_listening_guest(
            env,
            &a,
            name,
            &format!("{boot_extra}[devices.vsock]\ncid = 3\nbackend = \"vhost\"\n"),
        )?;
        cid_taken_is_refused(env, &a.vmlinux)?;
        let s = crate::vsock_af::connect(3, 5000, LIMIT)?;
        let writer = s
            .try_clone()
            .map_err(|e| format!("clone the vsock stream: {e}"))?;
        let back = send_and_read_back(s, writer, crate::vsock_af::shutdown_write)?;
        Ok::<_, String>((vm, out, back))
    })();
    let (vm, out, back) = match echoed {
        Ok(done) => done,
        Err(e) => {
            stop.store(true, Ordering::Relaxed);
            let _ = g2h.join();
            return Err(e);
        }
    };
    let received = g2h.join().map_err(|_| "the listener thread panicked")??;
    check_both_ways(env, &vm, &out, &back, &received)
}
