//! The proxies' HTTP/1.1 client: a pool of keep-alive connections to
//! upstreams (agents, backends), one pool per worker thread.
//!
//! Why not hyper-util's pooled client: per request it clones its connector,
//! boxes a future, races a checkout against a connect, and spawns a task
//! that waits for the connection to be idle again; about a sixth of a
//! proxied request's instructions (docs/performance.md). Here a request
//! takes the most recently used idle connection of its origin, and its
//! answer's body puts the connection back when it reaches its end.
//!
//! A connection is driven by a task on the runtime that opened it: give
//! each worker thread its own pool, so that a request, its connection and
//! every wake-up between them stay on one thread.
//!
//! Retries: a request is sent again, on another connection, when the
//! connection it was given turned out closed before the request was
//! written (an idle connection the upstream closed at that moment). Once a
//! byte of it may have reached the upstream, only [`Pool::send_replayable`]
//! sends it again, and only once: for upstreams that serve nothing of a
//! request whose connection closes before they answer.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// Where connections go: scheme, host and port, read once from a URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// `scheme://host:port`, the pool's key.
    key: Arc<str>,
    /// To connect to, and the name a TLS certificate must carry (an IPv6
    /// address without its brackets).
    host: Arc<str>,
    port: u16,
    tls: bool,
}

impl Origin {
    /// `None` for a scheme other than `http` and `https`.
    pub fn new(scheme: &http::uri::Scheme, authority: &http::uri::Authority) -> Option<Origin> {
        let tls = match scheme.as_str() {
            "http" => false,
            "https" => true,
            _ => return None,
        };
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let host = authority.host();
        let key = format!("{scheme}://{host}:{port}");
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        Some(Origin { key: Arc::from(key), host: Arc::from(host), port, tls })
    }

    pub fn as_str(&self) -> &str {
        &self.key
    }
}

/// Why a request got no response.
#[derive(Debug)]
pub enum Error {
    /// No TCP connection within the connect timeout.
    ConnectTimeout,
    Connect(std::io::Error),
    /// An `https` origin, and the pool has no TLS configuration.
    NoTls,
    Tls(std::io::Error),
    /// The connection broke, or the upstream answered something that is
    /// not HTTP/1.1.
    Http(hyper::Error),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::ConnectTimeout => f.write_str("connect timed out"),
            Error::Connect(error) => write!(f, "connect failed: {error}"),
            Error::NoTls => f.write_str("an https upstream, and no TLS configured for it"),
            Error::Tls(error) => write!(f, "TLS handshake failed: {error}"),
            Error::Http(error) => write!(f, "{error}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Connect(error) | Error::Tls(error) => Some(error),
            Error::Http(error) => Some(error),
            Error::ConnectTimeout | Error::NoTls => None,
        }
    }
}

/// How soon after its sending a request whose reused connection closed
/// under it is sent again ([`Pool::send_replayable`]): an idle connection
/// closed as the request went out is found closed within milliseconds.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(1);

/// A send that failed, and whether on a connection that had served before.
struct Failed {
    reused: bool,
    error: Error,
}

/// Whether a connection closed under a written request before its answer
/// began: its end came first (hyper's incomplete message), or a reset.
fn closed_under(error: &hyper::Error) -> bool {
    if error.is_incomplete_message() {
        return true;
    }
    let io = std::error::Error::source(error).and_then(|source| source.downcast_ref::<std::io::Error>());
    io.is_some_and(|io| matches!(io.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe))
}

/// How a pool connects.
#[derive(Clone)]
pub struct Settings {
    pub connect_timeout: Duration,
    /// An idle connection older than this is closed rather than used. Keep
    /// it below the upstream's own idle timeout, so that the upstream is not
    /// the one closing it as a request goes out.
    pub idle_timeout: Duration,
    /// For `https` origins. Its ALPN protocols are set to HTTP/1.1.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The longest an answer's body may go without a byte: past it, the
    /// body ends with [`ReadTimeout`], as a broken connection's would. An
    /// upstream that hangs (its process stuck, its host gone without a
    /// word) holds no request for ever.
    pub read_timeout: Duration,
    /// How many idle connections are kept.
    pub idle_limits: IdleLimits,
}

/// The most idle connections a pool keeps: per origin, and in all. Past
/// either, the least recently used one is closed. Without bounds a burst
/// of concurrency to many upstreams would leave its connections (and
/// their file descriptors, and the upstreams' slots for them) held for
/// the whole idle timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdleLimits {
    pub per_origin: usize,
    pub total: usize,
}

impl Default for IdleLimits {
    /// More than any node's slots (a node serves tens of requests at
    /// once), per worker thread.
    fn default() -> IdleLimits {
        IdleLimits { per_origin: 256, total: 4096 }
    }
}

/// TCP keep-alive probes on every connection: an upstream whose host went
/// away without a word (power lost, cable pulled) is found out within about
/// a minute of silence, not when the read timeout is over.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 3;

/// An answer's body went without a byte for longer than the read timeout.
#[derive(Debug)]
pub struct ReadTimeout(pub Duration);

impl std::fmt::Display for ReadTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no bytes from the upstream for {:?}", self.0)
    }
}

impl std::error::Error for ReadTimeout {}

/// What an answer's body ends with when it breaks.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// One worker's connections, by origin. Cloning it shares them.
pub struct Pool<B> {
    shared: Arc<Shared<B>>,
}

impl<B> Clone for Pool<B> {
    fn clone(&self) -> Self {
        Pool { shared: Arc::clone(&self.shared) }
    }
}

struct Shared<B> {
    idle: Mutex<IdleSet<B>>,
    limits: IdleLimits,
    connect_timeout: Duration,
    idle_timeout: Duration,
    tls: Option<tokio_rustls::TlsConnector>,
    read_timeout: Duration,
}

struct Idle<B> {
    sender: SendRequest<B>,
    since: Instant,
}

/// The idle connections, per origin, each origin's oldest first, and how
/// many there are in all.
struct IdleSet<B> {
    by_origin: inferyes_proto::FastMap<Arc<str>, Vec<Idle<B>>>,
    total: usize,
}

impl<B> Default for IdleSet<B> {
    fn default() -> IdleSet<B> {
        IdleSet { by_origin: inferyes_proto::FastMap::default(), total: 0 }
    }
}

impl<B> IdleSet<B> {
    /// Keeps `sender` as `key`'s most recently used, closing the least
    /// recently used where a limit would be passed.
    fn push(&mut self, key: Arc<str>, sender: SendRequest<B>, now: Instant, limits: IdleLimits) {
        if limits.per_origin == 0 || limits.total == 0 {
            return;
        }
        let list = self.by_origin.entry(key).or_default();
        if list.len() >= limits.per_origin {
            list.remove(0);
            self.total -= 1;
        }
        list.push(Idle { sender, since: now });
        self.total += 1;
        if self.total > limits.total {
            self.evict_oldest();
        }
    }

    /// Closes the connection idle the longest, whichever its origin
    /// (each origin's oldest is its first).
    fn evict_oldest(&mut self) {
        let oldest = self
            .by_origin
            .iter()
            .filter_map(|(key, list)| Some((list.first()?.since, key)))
            .min_by_key(|(since, _)| *since)
            .map(|(_, key)| Arc::clone(key));
        let Some(key) = oldest else { return };
        if let Some(list) = self.by_origin.get_mut(&key) {
            list.remove(0);
            self.total -= 1;
            if list.is_empty() {
                self.by_origin.remove(&key);
            }
        }
    }
}

impl<B> Shared<B> {
    fn expired(&self, entry: &Idle<B>, now: Instant) -> bool {
        now.duration_since(entry.since) > self.idle_timeout
    }
}

impl<B> Pool<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    pub fn new(settings: Settings) -> Pool<B> {
        let tls = settings.tls.map(|config| {
            let mut config = Arc::unwrap_or_clone(config);
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            tokio_rustls::TlsConnector::from(Arc::new(config))
        });
        Pool {
            shared: Arc::new(Shared {
                idle: Mutex::default(),
                limits: settings.idle_limits,
                connect_timeout: settings.connect_timeout,
                idle_timeout: settings.idle_timeout,
                tls,
                read_timeout: settings.read_timeout,
            }),
        }
    }

    /// Sends `request` to `origin` and resolves with the response's head.
    /// The request's URI is what goes on the request line (origin-form:
    /// `/v1/chat/completions`), and it must carry its `Host` header.
    ///
    /// Dropping the future before the head has come closes the connection
    /// the request went out on.
    pub async fn send(&self, origin: &Origin, request: Request<B>) -> Result<Response<Incoming<B>>, Error> {
        self.send_on(origin, request, true).await.map_err(|failed| failed.error)
    }

    /// [`Pool::send`], and `again` on a new connection when a reused one
    /// closed after taking `request`, before any of its answer came and
    /// within [`REPLAY_WINDOW`] of its sending.
    ///
    /// That is how an idle connection the upstream closes just as a request
    /// goes out on it fails once the request is written, and it is not rare:
    /// llama-server closes idle connections within a second once as many
    /// are open as it has HTTP threads (its slots and four). Only for
    /// upstreams that serve nothing of a request whose connection closes
    /// before they answer, as llama-server stops such a job; and only
    /// soon after sending: a connection lost later (a server that crashed
    /// on the request) is not given the request again.
    pub async fn send_replayable(
        &self,
        origin: &Origin,
        request: Request<B>,
        again: Request<B>,
    ) -> Result<Response<Incoming<B>>, Error> {
        let sent = Instant::now();
        match self.send_on(origin, request, true).await {
            Err(Failed { reused: true, error: Error::Http(error) })
                if closed_under(&error) && sent.elapsed() < REPLAY_WINDOW =>
            {
                self.send_on(origin, again, false).await.map_err(|failed| failed.error)
            }
            sent => sent.map_err(|failed| failed.error),
        }
    }

    async fn send_on(
        &self,
        origin: &Origin,
        mut request: Request<B>,
        reuse: bool,
    ) -> Result<Response<Incoming<B>>, Failed> {
        let fresh = |error| Failed { reused: false, error };
        loop {
            let checked_out = if reuse { self.checkout(&origin.key) } else { None };
            let (mut sender, reused) = match checked_out {
                Some(sender) => (sender, true),
                // Boxed: connecting (resolve, TCP, TLS, handshake) is most of
                // this future's size, and every request's future would
                // carry it, moved and allocated with the handler's, for the
                // few requests that open a connection.
                None => (Box::pin(self.connect(origin)).await.map_err(fresh)?, false),
            };
            // A connection is ready once its task has taken up the previous
            // answer's end (or, new, its first poll); an error means closed.
            if let Err(error) = sender.ready().await {
                if reused {
                    continue;
                }
                return Err(fresh(Error::Http(error)));
            }
            match sender.try_send_request(request).await {
                Ok(response) => {
                    // An answer without a body (a 204, a `content-length: 0`)
                    // may never be read: its connection goes back at once.
                    let home = if response.body().is_end_stream() {
                        self.finished(Arc::clone(&origin.key), sender);
                        None
                    } else {
                        Some(Home { sender, pool: self.clone(), key: Arc::clone(&origin.key) })
                    };
                    let read_timeout = self.shared.read_timeout;
                    return Ok(response.map(|inner| Incoming::new(inner, home, read_timeout)));
                }
                Err(mut error) => match error.take_message() {
                    // Not written: the idle connection was closed under it.
                    Some(returned) if reused => request = returned,
                    _ => return Err(Failed { reused, error: Error::Http(error.into_error()) }),
                },
            }
        }
    }

    /// The most recently used idle connection to `key` that is still open
    /// and not past the idle timeout.
    fn checkout(&self, key: &str) -> Option<SendRequest<B>> {
        // A poisoned lock (a panic elsewhere) costs a new connection, never
        // a request.
        let mut idle = self.shared.idle.lock().ok()?;
        let IdleSet { by_origin, total } = &mut *idle;
        let list = by_origin.get_mut(key)?;
        let now = Instant::now();
        // Oldest first: the expired ones are a prefix.
        let expired = list.partition_point(|entry| self.shared.expired(entry, now));
        list.drain(..expired);
        *total -= expired;
        while let Some(entry) = list.pop() {
            *total -= 1;
            if !entry.sender.is_closed() {
                return Some(entry.sender);
            }
        }
        None
    }

    /// Opens a connection to `origin`. Connections are opened far less
    /// often than requests are sent: each time, closed and expired idle
    /// ones (of upstreams gone from the fleet, say) are let go.
    async fn connect(&self, origin: &Origin) -> Result<SendRequest<B>, Error> {
        self.sweep();
        let tcp = self.tcp(origin).await?;
        let _ = tcp.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES);
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
        if !origin.tls {
            return handshake(tcp).await;
        }
        let tls = self.shared.tls.as_ref().ok_or(Error::NoTls)?;
        let name = rustls::pki_types::ServerName::try_from(origin.host.to_string())
            .map_err(|error| Error::Tls(std::io::Error::new(std::io::ErrorKind::InvalidInput, error)))?;
        let stream = tls.connect(name, tcp).await.map_err(Error::Tls)?;
        handshake(stream).await
    }

    /// A TCP connection to one of the origin's addresses, tried in turn,
    /// each with its share of the connect timeout: one that never answers
    /// (an IPv6 address without a route, say) leaves time for the next.
    async fn tcp(&self, origin: &Origin) -> Result<TcpStream, Error> {
        let timeout = self.shared.connect_timeout;
        let addresses: Vec<SocketAddr> = match origin.host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, origin.port)],
            Err(_) => tokio::time::timeout(timeout, tokio::net::lookup_host((&*origin.host, origin.port)))
                .await
                .map_err(|_| Error::ConnectTimeout)?
                .map_err(Error::Connect)?
                .collect(),
        };
        let share = timeout / u32::try_from(addresses.len().max(1)).unwrap_or(u32::MAX);
        let mut last = Error::Connect(std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address"));
        for address in addresses {
            match tokio::time::timeout(share, TcpStream::connect(address)).await {
                Ok(Ok(tcp)) => return Ok(tcp),
                Ok(Err(error)) => last = Error::Connect(error),
                Err(_) => last = Error::ConnectTimeout,
            }
        }
        Err(last)
    }

    fn sweep(&self) {
        let Ok(mut idle) = self.shared.idle.lock() else { return };
        let now = Instant::now();
        idle.by_origin.retain(|_, list| {
            list.retain(|entry| !entry.sender.is_closed() && !self.shared.expired(entry, now));
            !list.is_empty()
        });
        idle.total = idle.by_origin.values().map(Vec::len).sum();
    }

    /// A body of a connection the pool does not own (an HTTP/2 one), with
    /// the pool's read timeout.
    pub fn unpooled(&self, inner: hyper::body::Incoming) -> Incoming<B> {
        Incoming::new(inner, None, self.shared.read_timeout)
    }

    /// Idle connections held, all origins together.
    pub fn idle_connections(&self) -> usize {
        self.shared.idle.lock().map_or(0, |idle| idle.total)
    }
}

impl<B> Pool<B> {
    /// Takes back a connection whose answer has ended.
    fn finished(&self, key: Arc<str>, sender: SendRequest<B>) {
        // A connection that cannot take a request now (closed, or, were an
        // upload still going on, busy) is let go: a request handed it would
        // wait, or fail. hyper makes a connection ready by the time its
        // answer has ended, an early answer to an upload included.
        if sender.is_ready() {
            self.keep(key, sender);
        }
    }

    fn keep(&self, key: Arc<str>, sender: SendRequest<B>) {
        let Ok(mut idle) = self.shared.idle.lock() else { return };
        idle.push(key, sender, Instant::now(), self.shared.limits);
    }
}

async fn handshake<S, B>(io: S) -> Result<SendRequest<B>, Error>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (sender, connection) =
        hyper::client::conn::http1::Builder::new().handshake(TokioIo::new(io)).await.map_err(Error::Http)?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "upstream connection ended");
        }
    });
    Ok(sender)
}

/// A pooled connection, on its way home with the answer's body.
struct Home<B> {
    sender: SendRequest<B>,
    pool: Pool<B>,
    key: Arc<str>,
}

pin_project_lite::pin_project! {
    /// An answer's body. Read to its end, it puts its connection back in the
    /// pool; dropped before, it closes it (an HTTP/1.1 connection cannot be
    /// reused in the middle of an answer), which also tells the upstream to
    /// stop generating.
    pub struct Incoming<B> {
        #[pin]
        inner: hyper::body::Incoming,
        home: Option<Home<B>>,
        read_timeout: Duration,
        // Set when the body starts waiting for bytes, not at every byte:
        // answers that come whole never set a timer. Boxed, as a timer is
        // large and most answers need none.
        silence: Option<Pin<Box<tokio::time::Sleep>>>,
        waiting: bool,
    }

    impl<B> PinnedDrop for Incoming<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            // A reader that stopped at the last event (`data: [DONE]`) may
            // have left only the answer's end unread; if it is here already,
            // the connection is still good.
            if let Some(Home { sender, pool, key }) = this.home.take() {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                if let Poll::Ready(None) = this.inner.poll_frame(&mut cx) {
                    pool.finished(key, sender);
                }
            }
        }
    }
}

impl<B> Incoming<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn new(inner: hyper::body::Incoming, home: Option<Home<B>>, read_timeout: Duration) -> Incoming<B> {
        Incoming { inner, home, read_timeout, silence: None, waiting: false }
    }
}

impl<B> std::fmt::Debug for Incoming<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming").field("pooled", &self.home.is_some()).finish_non_exhaustive()
    }
}

impl<B> Body for Incoming<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        if polled.is_pending() {
            let deadline = tokio::time::Instant::now() + *this.read_timeout;
            let silence = match this.silence {
                Some(silence) if *this.waiting => silence,
                Some(silence) => {
                    silence.as_mut().reset(deadline);
                    silence
                }
                None => this.silence.insert(Box::pin(tokio::time::sleep_until(deadline))),
            };
            *this.waiting = true;
            if silence.as_mut().poll(cx).is_ready() {
                // The connection cannot be used again: it closes.
                *this.home = None;
                return Poll::Ready(Some(Err(Box::new(ReadTimeout(*this.read_timeout)))));
            }
            return Poll::Pending;
        }
        *this.waiting = false;
        match &polled {
            // Trailers, when they come, are an answer's last frame.
            Poll::Ready(Some(Ok(frame))) if frame.is_data() && !this.inner.is_end_stream() => {}
            Poll::Ready(Some(Ok(_)) | None) => {
                if let Some(Home { sender, pool, key }) = this.home.take() {
                    pool.finished(key, sender);
                }
            }
            Poll::Ready(Some(Err(_))) => *this.home = None,
            Poll::Pending => {}
        }
        polled.map_err(BodyError::from)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    use super::*;

    type Client = Pool<Upload>;

    /// A request body: none, or an upload that never goes on.
    enum Upload {
        Empty,
        Stalled,
    }

    impl Body for Upload {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            match *self {
                Upload::Empty => Poll::Ready(None),
                Upload::Stalled => Poll::Pending,
            }
        }
        fn is_end_stream(&self) -> bool {
            matches!(self, Upload::Empty)
        }
        fn size_hint(&self) -> SizeHint {
            match self {
                Upload::Empty => SizeHint::with_exact(0),
                Upload::Stalled => SizeHint::default(),
            }
        }
    }

    fn pool(idle_timeout: Duration) -> Client {
        pool_reading(idle_timeout, Duration::from_secs(60))
    }

    fn pool_reading(idle_timeout: Duration, read_timeout: Duration) -> Client {
        pool_limited(idle_timeout, read_timeout, IdleLimits::default())
    }

    fn pool_limited(idle_timeout: Duration, read_timeout: Duration, idle_limits: IdleLimits) -> Client {
        Pool::new(Settings {
            connect_timeout: Duration::from_secs(2),
            idle_timeout,
            tls: None,
            read_timeout,
            idle_limits,
        })
    }

    fn origin(addr: std::net::SocketAddr) -> Origin {
        let authority = addr.to_string().parse().unwrap();
        Origin::new(&http::uri::Scheme::HTTP, &authority).unwrap()
    }

    fn request(path: &'static str) -> Request<Upload> {
        Request::builder().uri(path).header(http::header::HOST, "upstream").body(Upload::Empty).unwrap()
    }

    /// Waits for an event the test expects, failing rather than hanging.
    async fn soon<T>(event: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), event).await.expect("the event did not come")
    }

    /// A body that sends one chunk and then never ends.
    struct Endless(bool);

    impl Body for Endless {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if std::mem::replace(&mut self.0, true) {
                Poll::Pending
            } else {
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"data: 1\n\n")))))
            }
        }
    }

    /// A body of twenty chunks, one every 25 ms.
    struct Drip(tokio::time::Interval, u32);

    impl Body for Drip {
        type Data = Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.1 == 20 {
                return Poll::Ready(None);
            }
            std::task::ready!(self.0.poll_tick(cx));
            self.1 += 1;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b".")))))
        }
    }

    /// An upstream that counts its connections and says when each ends:
    /// `/hello` answers with a body, `/empty` with none, `/endless` with a
    /// body that never ends, `/drip` with one that takes its time; none
    /// reads the request's body first.
    struct Upstream {
        addr: std::net::SocketAddr,
        accepted: Arc<AtomicUsize>,
        ended: mpsc::UnboundedReceiver<usize>,
    }

    async fn upstream() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let index = counter.fetch_add(1, Ordering::SeqCst);
                let ended_tx = ended_tx.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|request: Request<hyper::body::Incoming>| async move {
                        let body = match request.uri().path() {
                            "/hello" => Full::new(Bytes::from_static(b"hello")).boxed(),
                            "/endless" => Endless(false).boxed(),
                            "/drip" => Drip(tokio::time::interval(Duration::from_millis(25)), 0).boxed(),
                            _ => Full::default().boxed(),
                        };
                        Ok::<_, Infallible>(Response::new(body))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    let _ = ended_tx.send(index);
                });
            }
        });
        Upstream { addr, accepted, ended }
    }

    async fn text(response: Response<Incoming<Upload>>) -> String {
        String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
    }

    #[tokio::test]
    async fn an_answer_read_to_its_end_gives_its_connection_to_the_next_request() {
        let upstream = upstream().await;
        let (pool, origin) = (pool(Duration::from_secs(60)), origin(upstream.addr));
        for _ in 0..3 {
            assert_eq!(text(pool.send(&origin, request("/hello")).await.unwrap()).await, "hello");
            assert_eq!(pool.idle_connections(), 1);
        }
        // Bodiless answers go back without being read.
        for _ in 0..2 {
            let response = pool.send(&origin, request("/empty")).await.unwrap();
            assert_eq!(response.status(), http::StatusCode::OK);
            assert_eq!(pool.idle_connections(), 1);
        }
        assert_eq!(upstream.accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn answers_open_at_once_each_hold_a_connection_and_all_come_back() {
        let upstream = upstream().await;
        let (pool, origin) = (pool(Duration::from_secs(60)), origin(upstream.addr));
        let first = pool.send(&origin, request("/hello")).await.unwrap();
        let second = pool.send(&origin, request("/hello")).await.unwrap();
        assert_eq!(pool.idle_connections(), 0);
        assert_eq!((text(first).await, text(second).await), ("hello".to_string(), "hello".to_string()));
        assert_eq!(pool.idle_connections(), 2);
        assert_eq!(upstream.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn idle_connections_are_bounded_per_origin_and_in_all_and_the_least_recent_goes() {
        let (mut a, mut b) = (upstream().await, upstream().await);
        let limits = IdleLimits { per_origin: 2, total: 3 };
        let pool = pool_limited(Duration::from_secs(60), Duration::from_secs(60), limits);
        let (to_a, to_b) = (origin(a.addr), origin(b.addr));
        let open = |origin: &Origin, n| {
            let (pool, origin) = (pool.clone(), origin.clone());
            async move {
                let mut answers = Vec::new();
                for _ in 0..n {
                    answers.push(pool.send(&origin, request("/hello")).await.unwrap());
                }
                for answer in answers {
                    assert_eq!(text(answer).await, "hello");
                }
            }
        };
        open(&to_a, 3).await;
        assert_eq!(pool.idle_connections(), 2, "at most two per origin");
        assert_eq!(soon(a.ended.recv()).await, Some(0), "the least recently used is closed");
        open(&to_b, 2).await;
        assert_eq!(pool.idle_connections(), 3, "at most three in all");
        // The oldest of all (origin a's first kept) went for b's second.
        assert_eq!(soon(a.ended.recv()).await, Some(1));
        assert!(b.ended.try_recv().is_err(), "the newest stay");
        let before = b.accepted.load(Ordering::SeqCst);
        open(&to_b, 2).await;
        assert_eq!(b.accepted.load(Ordering::SeqCst), before, "kept connections are used again");
    }

    #[tokio::test]
    async fn an_answer_dropped_in_the_middle_closes_its_connection() {
        let mut upstream = upstream().await;
        let (pool, origin) = (pool(Duration::from_secs(60)), origin(upstream.addr));
        let mut body = pool.send(&origin, request("/endless")).await.unwrap().into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, Bytes::from_static(b"data: 1\n\n"));
        drop(body);
        // The upstream sees its connection end: the generation stops.
        assert_eq!(soon(upstream.ended.recv()).await, Some(0));
        assert_eq!(pool.idle_connections(), 0);
        assert_eq!(text(pool.send(&origin, request("/hello")).await.unwrap()).await, "hello");
        assert_eq!(upstream.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_answer_silent_past_the_read_timeout_ends_with_an_error_and_its_connection() {
        let mut upstream = upstream().await;
        let (pool, origin) = (pool_reading(Duration::from_secs(60), Duration::from_millis(300)), origin(upstream.addr));
        // Bytes every 25 ms: the timeout counts from the last.
        assert_eq!(text(pool.send(&origin, request("/drip")).await.unwrap()).await, ".".repeat(20));
        assert_eq!(pool.idle_connections(), 1);
        let mut body = pool.send(&origin, request("/endless")).await.unwrap().into_body();
        assert!(body.frame().await.unwrap().unwrap().is_data());
        let error = soon(body.frame()).await.expect("a frame").expect_err("the silence is an error");
        assert!(error.downcast_ref::<ReadTimeout>().is_some(), "{error}");
        drop(body);
        assert_eq!(soon(upstream.ended.recv()).await, Some(0));
        assert_eq!(pool.idle_connections(), 0);
    }

    #[tokio::test]
    async fn idle_connections_past_the_idle_timeout_are_not_used() {
        let mut upstream = upstream().await;
        let (pool, origin) = (pool(Duration::from_nanos(1)), origin(upstream.addr));
        for _ in 0..2 {
            assert_eq!(text(pool.send(&origin, request("/hello")).await.unwrap()).await, "hello");
        }
        assert_eq!(upstream.accepted.load(Ordering::SeqCst), 2);
        // ...and are closed.
        assert_eq!(soon(upstream.ended.recv()).await, Some(0));
    }

    #[tokio::test]
    async fn an_answer_that_ends_before_its_upload_does_not_hold_up_the_next_request() {
        // The upstream answers before the request's body has come (as one
        // refusing an upload does); the upload never ends.
        let upstream = upstream().await;
        let (pool, origin) = (pool(Duration::from_secs(60)), origin(upstream.addr));
        let mut upload = request("/hello");
        *upload.body_mut() = Upload::Stalled;
        assert_eq!(text(pool.send(&origin, upload).await.unwrap()).await, "hello");
        // The next request is answered at once, not after the upload.
        assert_eq!(text(soon(pool.send(&origin, request("/hello"))).await.unwrap()).await, "hello");
    }

    #[tokio::test]
    async fn an_idle_connection_the_upstream_closed_costs_a_new_one_not_an_error() {
        // Answers one request per connection, then, when told to, closes the
        // connection without having said so (no `connection: close`), as an
        // upstream's idle timeout does.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (close_tx, mut close) = mpsc::unbounded_channel::<()>();
        let (closed_tx, mut closed) = mpsc::unbounded_channel::<()>();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    // A client that closes early gets no answer: the test's
                    // own assertions then fail.
                    let Ok(n @ 1..) = stream.read(&mut buf).await else { return };
                    head.extend_from_slice(&buf[..n]);
                }
                stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.unwrap();
                close.recv().await;
                drop(stream);
                closed_tx.send(()).unwrap();
            }
        });
        let (pool, origin) = (pool(Duration::from_secs(60)), origin(addr));
        assert_eq!(text(pool.send(&origin, request("/")).await.unwrap()).await, "ok");
        for _ in 0..20 {
            assert_eq!(pool.idle_connections(), 1);
            close_tx.send(()).unwrap();
            soon(closed.recv()).await.unwrap();
            // The pool has not looked at the connection since it closed.
            assert_eq!(text(pool.send(&origin, request("/")).await.unwrap()).await, "ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 21);
    }

    /// Answers the first `answers` requests on each connection; takes the
    /// next one in whole and closes without a word, as an upstream does that
    /// closes an idle connection just as a request goes out on it. Counts
    /// connections.
    async fn closing_after(answers: usize) -> (SocketAddr, Arc<AtomicUsize>) {
        async fn read_head(stream: &mut tokio::net::TcpStream) -> bool {
            let (mut head, mut buf) = (Vec::new(), [0u8; 1024]);
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let Ok(n @ 1..) = stream.read(&mut buf).await else { return false };
                head.extend_from_slice(&buf[..n]);
            }
            true
        }
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    for _ in 0..answers {
                        if !read_head(&mut stream).await {
                            return;
                        }
                        stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.unwrap();
                    }
                    read_head(&mut stream).await;
                });
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn a_replayable_request_a_reused_connection_dropped_goes_once_more_on_a_new_one() {
        let (addr, accepted) = closing_after(1).await;
        let (pool, origin) = (pool(Duration::from_secs(60)), origin(addr));
        assert_eq!(text(pool.send(&origin, request("/")).await.unwrap()).await, "ok");
        let answer = soon(pool.send_replayable(&origin, request("/"), request("/"))).await.unwrap();
        assert_eq!(text(answer).await, "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);

        // Without a copy to send again, the same race is an error.
        let error = soon(pool.send(&origin, request("/"))).await.unwrap_err();
        assert!(matches!(&error, Error::Http(error) if closed_under(error)), "{error}");
    }

    #[tokio::test]
    async fn a_new_connection_that_drops_a_replayable_request_is_an_error_not_a_retry() {
        // The upstream itself let the request go: sending it again would
        // only go the same way.
        let (addr, accepted) = closing_after(0).await;
        let (pool, origin) = (pool(Duration::from_secs(60)), origin(addr));
        let error = soon(pool.send_replayable(&origin, request("/"), request("/"))).await.unwrap_err();
        assert!(matches!(&error, Error::Http(error) if closed_under(error)), "{error}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn unreachable_upstreams_and_https_without_tls_are_errors() {
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let pool = pool(Duration::from_secs(60));
        let error = pool.send(&origin(closed), request("/")).await.unwrap_err();
        assert!(matches!(error, Error::Connect(_)), "{error}");
        let upstream = upstream().await;
        let https = Origin::new(&http::uri::Scheme::HTTPS, &upstream.addr.to_string().parse().unwrap()).unwrap();
        let error = pool.send(&https, request("/")).await.unwrap_err();
        assert!(matches!(error, Error::NoTls), "{error}");
    }
}
