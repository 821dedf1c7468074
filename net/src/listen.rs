//! Taking connections off a listener: an accept loop that outlives
//! running out of descriptors, what a new connection speaks (read off its
//! first bytes), the client a trusted proxy relays it for (its PROXY
//! protocol header), and, for servers that take a stream of connections
//! (tonic's), connections admitted by an [`Admission`] and handed over only
//! once they have spoken.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use crate::admit::{Admission, Refused, Ticket};
use crate::backoff::Backoff;

/// What an accept loop waits after a failure: out of descriptors, say,
/// the next accept fails at once until a connection closes.
const ACCEPT_BACKOFF: Backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));

/// A listener's accept loop: a failure is logged once, however long it
/// lasts, and waited out with a growing backoff instead of spinning.
pub struct Acceptor {
    listener: TcpListener,
    backoff: Backoff,
    failures: u64,
}

impl Acceptor {
    pub fn new(listener: TcpListener) -> Acceptor {
        Acceptor { listener, backoff: ACCEPT_BACKOFF, failures: 0 }
    }

    /// The next connection, however many accepts fail before it.
    pub async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok(accepted) => {
                    if self.failures > 0 {
                        tracing::info!(failed = self.failures, "accepting connections again");
                        self.failures = 0;
                        self.backoff.reset();
                    }
                    return accepted;
                }
                // A connection reset before it was taken: nothing is short.
                Err(error) if error.kind() == std::io::ErrorKind::ConnectionAborted => {}
                Err(error) => {
                    if self.failures == 0 {
                        tracing::warn!(
                            %error,
                            "accept failed (out of descriptors?); backing off until a connection closes"
                        );
                    }
                    self.failures += 1;
                    tokio::time::sleep(self.backoff.next_wait()).await;
                }
            }
        }
    }
}

/// A connection a listener took, holding its place until closed. A
/// stranger's connection fails every read and write once the listener
/// wants it closed ([`Ticket::closing`]).
pub struct Admitted {
    stream: TcpStream,
    _ticket: Ticket,
    /// Resolves once the listener wants it closed ([`Ticket::closing`]).
    closing: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    closed: bool,
}

impl Admitted {
    pub fn peer(&self) -> std::io::Result<SocketAddr> {
        self.stream.peer_addr()
    }
}

/// Accepts connections off `listener` until the returned stream is
/// dropped: each one `admission` takes, once it has sent its first bytes
/// within `first_byte` (the HTTP/2 preface, whole, or anything else: a
/// silent connection holds a descriptor and its place, never a server's
/// task, and is closed at the deadline); `refused` is told of each one it
/// does not take, which is closed at once.
pub fn incoming(
    listener: TcpListener,
    admission: Arc<Admission>,
    first_byte: Duration,
    refused: Option<Arc<dyn Fn(Refused) + Send + Sync>>,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<Admitted>> {
    // Bounded only by what the admission takes.
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    tokio::spawn(async move {
        let mut acceptor = Acceptor::new(listener);
        loop {
            let (stream, peer) = tokio::select! {
                () = tx.closed() => return,
                accepted = acceptor.accept() => accepted,
            };
            let ticket = match admission.admit(peer.ip()) {
                Ok(ticket) => {
                    if let Some(refused) = refused.as_ref().filter(|_| ticket.made_room()) {
                        refused(Refused::Strangers);
                    }
                    ticket
                }
                Err(why) => {
                    if let Some(refused) = &refused {
                        refused(why);
                    }
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut closing: Option<Pin<Box<dyn Future<Output = ()> + Send>>> =
                    ticket.closing().map(|closing| Box::pin(closing) as _);
                // The HTTP/2 preface, or a TLS hello: anything else is
                // refused by the server at once. A stranger's connection
                // closed meanwhile (to make room) goes now.
                let spoke = match closing.as_mut() {
                    Some(closing) => tokio::select! {
                        spoke = sniff(&stream, first_byte) => spoke.is_some(),
                        () = closing => false,
                    },
                    None => sniff(&stream, first_byte).await.is_some(),
                };
                if !spoke {
                    tracing::debug!(%peer, "no request on a new connection, or closed to make room");
                    // Its place is given back before the peer sees it closed.
                    drop(ticket);
                    return;
                }
                let _ = tx.send(Ok(Admitted { stream, _ticket: ticket, closing, closed: false })).await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A tower layer for a gRPC server fed by [`incoming`]: a peer one of
/// whose calls succeeded (the server checked its credential, where it asks
/// for one) is vouched for, and its next connections are a member's.
#[derive(Clone)]
pub struct Vouching {
    admission: Arc<Admission>,
}

impl Vouching {
    pub fn new(admission: Arc<Admission>) -> Vouching {
        Vouching { admission }
    }
}

impl<S> tower::Layer<S> for Vouching {
    type Service = Vouched<S>;

    fn layer(&self, inner: S) -> Vouched<S> {
        Vouched { inner, admission: Arc::clone(&self.admission) }
    }
}

#[derive(Clone)]
pub struct Vouched<S> {
    inner: S,
    admission: Arc<Admission>,
}

impl<S, B, R> tower::Service<http::Request<B>> for Vouched<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
        let extensions = request.extensions();
        let peer = extensions
            .get::<TcpConnectInfo>()
            .or_else(|| extensions.get::<TlsConnectInfo<TcpConnectInfo>>().map(TlsConnectInfo::get_ref))
            .and_then(TcpConnectInfo::remote_addr);
        let answer = self.inner.call(request);
        let admission = Arc::clone(&self.admission);
        Box::pin(async move {
            let response = answer.await?;
            // A call that failed says so in its headers (a trailers-only
            // answer); one that goes on has passed its checks.
            let failed = response.headers().get("grpc-status").is_some_and(|status| status != "0");
            if let Some(peer) = peer
                && response.status().is_success()
                && !failed
            {
                admission.vouch(peer.ip());
            }
            Ok(response)
        })
    }
}

impl Admitted {
    /// Whether the listener wants the connection closed; once it does,
    /// every read and write fails, so that the server drops the connection
    /// (and its descriptor) even while a peer that stopped reading keeps
    /// its writes pending.
    fn poll_closed(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.closed
            && let Some(closing) = self.closing.as_mut()
            && closing.as_mut().poll(cx).is_ready()
        {
            tracing::debug!(peer = ?self.peer(), "a stranger's connection closed (unproven, or to make room)");
            self.closed = true;
        }
        self.closed
    }
}

fn aborted<T>() -> Poll<std::io::Result<T>> {
    Poll::Ready(Err(std::io::ErrorKind::ConnectionAborted.into()))
}

impl AsyncRead for Admitted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if self.poll_closed(cx) {
            return aborted();
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        if self.poll_closed(cx) {
            return aborted();
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.poll_closed(cx) {
            return aborted();
        }
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.poll_closed(cx) {
            return aborted();
        }
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.poll_closed(cx) {
            return aborted();
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Admitted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// What a new plain connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sniffed {
    Http1,
    Http2,
}

/// HTTP/2 with prior knowledge (h2c) opens with this.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The protocol of a new plain connection, read off its first bytes without
/// taking them: HTTP/2 if they are the preface, else HTTP/1.1. `None` when
/// it closes, or sends too little to tell within `timeout` (nothing at all,
/// or a piece of the preface).
pub(crate) async fn sniff(tcp: &TcpStream, timeout: Duration) -> Option<Sniffed> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut first = [0u8; H2_PREFACE.len()];
    let mut retry = SNIFF_RETRY_MIN;
    loop {
        let n = tokio::time::timeout_at(deadline, tcp.peek(&mut first)).await.ok()?.ok()?;
        if n == 0 {
            return None;
        }
        if first[..n] != H2_PREFACE[..n] {
            return Some(Sniffed::Http1);
        }
        if n == H2_PREFACE.len() {
            return Some(Sniffed::Http2);
        }
        // A piece of the preface: the rest is on its way, or never comes.
        // Peeking sees the same bytes until more arrive, so wait a little,
        // longer each time: a connection that stops there costs a few
        // wake-ups, not hundreds a second.
        if tokio::time::Instant::now() + retry >= deadline {
            return None;
        }
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(SNIFF_RETRY_MAX);
    }
}

/// The most bytes of a PROXY protocol header read: a v1 header is at most
/// 107, a v2 header's addresses at most 216 (UNIX sockets), and the TLVs
/// proxies add (a TLS summary, an id) fit in the rest.
const MAX_PROXY_HEADER: usize = 1024;

/// Why a connection's PROXY protocol header was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProxyHeaderError {
    /// None came within the time given, or the connection closed first.
    Missing,
    /// What came is not one (v1 or v2), or is longer than any proxy sends.
    Invalid,
}

/// Reads the PROXY protocol header (HAProxy's, v1 text or v2 binary) a
/// trusted proxy sends ahead of the connection it relays, and nothing
/// after it: the client's address, or `None` where the proxy speaks for
/// itself (`LOCAL`, `UNKNOWN`: its health checks).
pub(crate) async fn read_proxy_header(
    tcp: &TcpStream,
    timeout: Duration,
) -> Result<Option<SocketAddr>, ProxyHeaderError> {
    use ppp::{HeaderResult, PartialResult};
    let deadline = tokio::time::Instant::now() + timeout;
    let mut peeked = vec![0u8; MAX_PROXY_HEADER];
    let mut retry = SNIFF_RETRY_MIN;
    let (length, client) = loop {
        let peek = tokio::time::timeout_at(deadline, tcp.peek(&mut peeked)).await;
        let n = match peek {
            Ok(Ok(n)) if n > 0 => n,
            _ => return Err(ProxyHeaderError::Missing),
        };
        let parsed = HeaderResult::parse(&peeked[..n]);
        if parsed.is_complete() {
            break match parsed {
                HeaderResult::V1(Ok(header)) => (header.header.len(), v1_client(header.addresses)),
                HeaderResult::V2(Ok(header)) => (header.len(), v2_client(header.command, header.addresses)),
                _ => return Err(ProxyHeaderError::Invalid),
            };
        }
        if n == MAX_PROXY_HEADER {
            return Err(ProxyHeaderError::Invalid);
        }
        // The rest is on its way, or never comes (see `sniff`).
        if tokio::time::Instant::now() + retry >= deadline {
            return Err(ProxyHeaderError::Missing);
        }
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(SNIFF_RETRY_MAX);
    };
    // Off the socket, exactly: it was peeked, so it is there.
    let mut left = length;
    while left > 0 {
        tokio::time::timeout_at(deadline, tcp.readable()).await.map_err(|_| ProxyHeaderError::Missing)?.ok();
        match tcp.try_read(&mut peeked[..left]) {
            Ok(0) => return Err(ProxyHeaderError::Missing),
            Ok(n) => left -= n,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return Err(ProxyHeaderError::Missing),
        }
    }
    Ok(client)
}

fn v1_client(addresses: ppp::v1::Addresses) -> Option<SocketAddr> {
    match addresses {
        ppp::v1::Addresses::Tcp4(a) => Some(SocketAddr::new(a.source_address.into(), a.source_port)),
        ppp::v1::Addresses::Tcp6(a) => Some(SocketAddr::new(a.source_address.into(), a.source_port)),
        ppp::v1::Addresses::Unknown => None,
    }
}

fn v2_client(command: ppp::v2::Command, addresses: ppp::v2::Addresses) -> Option<SocketAddr> {
    match (command, addresses) {
        (ppp::v2::Command::Proxy, ppp::v2::Addresses::IPv4(a)) => {
            Some(SocketAddr::new(a.source_address.into(), a.source_port))
        }
        (ppp::v2::Command::Proxy, ppp::v2::Addresses::IPv6(a)) => {
            Some(SocketAddr::new(a.source_address.into(), a.source_port))
        }
        _ => None,
    }
}

/// How soon, and at most how long after, a connection that sent a piece of
/// the HTTP/2 preface is looked at again.
const SNIFF_RETRY_MIN: Duration = Duration::from_millis(5);
const SNIFF_RETRY_MAX: Duration = Duration::from_millis(500);

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;

    use super::*;
    use crate::admit::Limits;

    #[tokio::test]
    async fn a_connection_is_handed_over_once_it_speaks_and_a_silent_one_never() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let admission = Admission::new(Limits { max: 0, per_peer: 2, strangers: 0, prove_within: None }, None);
        let refusals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&refusals);
        let refused: Arc<dyn Fn(Refused) + Send + Sync> = Arc::new(move |why| {
            assert_eq!(why, Refused::Peer);
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        let mut connections = incoming(listener, Arc::clone(&admission), Duration::from_secs(2), Some(refused));
        let mut silent = TcpStream::connect(address).await.unwrap();
        let mut speaking = TcpStream::connect(address).await.unwrap();
        speaking.write_all(b"hello").await.unwrap();
        let mut admitted = connections.next().await.unwrap().unwrap();
        let mut heard = [0u8; 5];
        admitted.read_exact(&mut heard).await.unwrap();
        assert_eq!(&heard, b"hello", "the one that spoke is handed over");
        // The peer's share is taken: a third connection is closed at once.
        let mut third = TcpStream::connect(address).await.unwrap();
        assert_eq!(third.read(&mut heard).await.unwrap(), 0, "refused and closed");
        assert_eq!(refusals.load(std::sync::atomic::Ordering::Relaxed), 1);
        // The silent one is closed at its deadline, never handed over, and
        // gives its place back.
        assert_eq!(silent.read(&mut heard).await.unwrap(), 0);
        assert_eq!(admission.open(), (1, 1));
        drop(admitted);
        assert_eq!(admission.open(), (0, 0));
    }

    #[tokio::test]
    async fn a_connection_its_listener_closes_fails_its_writes_though_its_peer_reads_nothing() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let limits = Limits { max: 0, per_peer: 0, strangers: 0, prove_within: Some(Duration::from_millis(300)) };
        let admission = Admission::new(limits, None);
        let mut connections = incoming(listener, Arc::clone(&admission), Duration::from_secs(2), None);
        let mut peer = TcpStream::connect(address).await.unwrap();
        peer.write_all(H2_PREFACE).await.unwrap();
        let mut admitted = connections.next().await.unwrap().unwrap();
        // More than the sockets' buffers hold: the write waits on a peer
        // that reads nothing, until the stranger's deadline.
        let written = tokio::time::timeout(Duration::from_secs(10), admitted.write_all(&vec![0u8; 64 << 20])).await;
        let error = written.expect("not left waiting").expect_err("cut off");
        assert_eq!(error.kind(), std::io::ErrorKind::ConnectionAborted);
        drop(admitted);
        assert_eq!(admission.open(), (0, 0));
        drop(peer);
    }
}
