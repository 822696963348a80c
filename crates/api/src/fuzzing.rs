//! Fuzzing entry points (feature `fuzzing`): the request reader alone
//! (`fuzz/fuzz_targets/api_request.rs`), and the whole connection path
//! (`fuzz/fuzz_targets/api_routing.rs`), where the server's own per-connection code reads a
//! request from a real Unix socket, routes it to a [`VmControl`] and writes the answer.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::http::read_request;
use crate::{server, ServerLimits, VmControl};

/// Serves one connection whose client sends `input` and then closes its sending side, with the
/// default [`ServerLimits`], and returns every byte the server wrote back (nothing when `input`
/// is empty). Only what fits in the socket's send buffer at once is sent (over 200 KiB, more
/// than the request head and body limits together); the rest of `input` is dropped. An error
/// is the harness's (no runtime, no socket pair), never the server's.
pub fn fuzz_serve_connection(
    input: &[u8],
    control: Arc<dyn VmControl>,
) -> std::io::Result<Vec<u8>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    rt.block_on(async {
        let (mut client, server_end) = UnixStream::pair()?;
        let mut sent = 0;
        while sent < input.len() {
            match client.try_write(&input[sent..]) {
                Ok(n) => sent += n,
                Err(_) => break, // the send buffer is full
            }
        }
        client.shutdown().await?;
        let limits = Arc::new(ServerLimits::default());
        let mut answer = Vec::new();
        // The server may close with unread bytes: the client then reads ECONNRESET after the
        // answer, which is kept.
        let read = client.read_to_end(&mut answer);
        let _ = tokio::join!(server::connection(server_end, control, limits), read);
        Ok(answer)
    })
}

/// Fuzzing entry point (feature `fuzzing`): parses `input` as one request with the default
/// limits, as the server reads it from a connection, and returns the method, path and body
/// length, or the status the server would answer.
pub fn fuzz_read_request(input: &[u8]) -> Result<Option<(String, String, usize)>, u16> {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::{AsyncRead, AsyncWrite};

    /// A connection whose client sends `input` and then closes; replies are discarded.
    struct Conn<'a>(&'a [u8]);
    impl AsyncRead for Conn<'_> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let n = buf.remaining().min(self.0.len());
            buf.put_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Poll::Ready(Ok(()))
        }
    }
    impl AsyncWrite for Conn<'_> {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            b: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            Poll::Ready(Ok(b.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|_| 500u16)?;
    let mut conn = Conn(input);
    match rt.block_on(read_request(&mut conn, &ServerLimits::default())) {
        Ok(Some(r)) => Ok(Some((r.method, r.path, r.body.len()))),
        Ok(None) => Ok(None),
        Err(e) => Err(e.status()),
    }
}
