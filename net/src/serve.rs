//! HTTP serving for the proxies on the request path (the data plane and the
//! agent): one single-threaded runtime per worker thread, each owning the
//! connections it is handed for their whole life.
//!
//! Why not the work-stealing runtime: a proxied request is a few socket
//! reads and writes and two hand-offs between tasks (the task serving the
//! client's connection and the task driving the pooled upstream
//! connection). On a work-stealing runtime those tasks often run on
//! different threads, and every hand-off is then a futex wake and cold
//! caches. Here a client connection, the upstream connections its requests
//! open (each worker keeps its own client pool: give each its own service)
//! and every wake-up between them stay on one thread; see
//! docs/performance.md for what it measured.
//!
//! One acceptor, on the caller's runtime, hands each accepted connection to
//! the worker with the fewest open connections. A worker makes one service
//! per connection, told the client's address: requests then carry nothing
//! for it (an extension map costs two allocations per request). Speaks HTTP/1.1 and, on the
//! same port, HTTP/2 with prior knowledge (h2c); with a TLS configuration,
//! both over TLS (ALPN).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::admit::{Admission, Refused, Ticket};
use crate::listen::{Acceptor, Sniffed, sniff};

/// How a server is run.
pub struct Options {
    /// Worker threads are named `<name>-<index>`.
    pub name: &'static str,
    /// Serve TLS (HTTP/1.1 and h2 by ALPN) instead of plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Concurrent requests one HTTP/2 connection may carry; past it the
    /// client waits for a stream to end. A stranger's connection (see
    /// [`crate::admit`]) carries at most [`DEFAULT_HTTP2_STREAMS`].
    pub http2_streams: u32,
    /// On shutdown, how long requests in flight may go on.
    pub shutdown_grace: Duration,
    /// Cancelled when the grace is over, for bodies that can end themselves
    /// cleanly (a stream's final error event); they get one more second.
    pub past_grace: CancellationToken,
    /// How long a client may take to send a request's head, and a new
    /// connection its first byte ([`HEADER_READ_TIMEOUT`] unless a test
    /// needs it short).
    pub header_read_timeout: Duration,
    /// Which connections may be open at once.
    pub limit: ConnectionLimit,
    /// Requests one connection may carry; past them it is closed once its
    /// requests in flight are answered (HTTP/1.1: the last answer says
    /// `connection: close`; HTTP/2: a GOAWAY). 0: no limit.
    pub max_requests_per_connection: u64,
    /// Peers whose connections start with a PROXY protocol header (v1 or
    /// v2), naming the client they relay: that client's address is then
    /// the connection's, for its share and for the service. None: no
    /// connection has one.
    pub proxy_protocol: Option<crate::admit::KnownPeers>,
}

/// Which connections a listener holds open at once, all workers together
/// ([`Admission`]). One it does not take is sent `refusal` (a whole
/// HTTP/1.1 response: the client's request is not read, so it need not be
/// parsed) and closed, and `refused` is told why: past its descriptors or
/// memory a process would refuse everyone.
#[derive(Clone, Default)]
pub struct ConnectionLimit {
    /// None: every connection.
    pub admission: Option<Arc<Admission>>,
    pub refusal: Bytes,
    pub refused: Option<Arc<dyn Fn(Refused) + Send + Sync>>,
}

impl Options {
    /// For a port only operators' tools reach (metrics, health, a
    /// dashboard), served by one worker: a short grace (its long requests
    /// are event streams, which end with the shutdown), and `limits` on
    /// its connections, a refused one told so in plain text.
    pub fn operators(
        name: &'static str,
        limits: crate::admit::Limits,
        refused: Option<Arc<dyn Fn(Refused) + Send + Sync>>,
    ) -> Options {
        let body = "this server holds all the connections it takes; try again\n";
        let refusal = overloaded("text/plain; charset=utf-8", body, None);
        Options {
            name,
            tls: None,
            http2_streams: DEFAULT_HTTP2_STREAMS,
            shutdown_grace: Duration::from_secs(1),
            past_grace: CancellationToken::new(),
            header_read_timeout: HEADER_READ_TIMEOUT,
            limit: ConnectionLimit { admission: Some(Admission::new(limits, None)), refusal, refused },
            max_requests_per_connection: 0,
            proxy_protocol: None,
        }
    }
}

/// A whole HTTP/1.1 503 answer that closes its connection, `Retry-After:
/// 1`, for a connection refused before any request on it is read; with
/// one more header where given.
pub fn overloaded(content_type: &str, body: &str, header: Option<(&str, &str)>) -> Bytes {
    let extra = header.map(|(name, value)| format!("{name}: {value}\r\n")).unwrap_or_default();
    Bytes::from(format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         retry-after: 1\r\n{extra}connection: close\r\n\r\n{body}",
        body.len()
    ))
}

/// What an operators' port holds open at once by default, all together and
/// from one address: a handful of scrapers, probes and browsers.
pub const OPERATORS_LIMITS: crate::admit::Limits =
    crate::admit::Limits { max: 256, per_peer: 64, strangers: 0, prove_within: None };

/// How long a refused connection is given to take its refusal.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);
/// Refusals under way at once: past them a connection is closed without
/// one, so a flood of connections holds no more descriptors than this.
const REFUSALS_AT_ONCE: usize = 256;

/// Sends `refusal` once the client has sent its request's first bytes
/// (a client that has not sent its request yet does not take an answer),
/// and closes, reading what the client sent (up to a bound): a socket
/// closed with unread bytes is reset, and a reset can reach the client
/// before the refusal does.
async fn refuse(mut stream: TcpStream, refusal: Bytes) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(REFUSAL_TIMEOUT, async {
        let mut sink = [0u8; 4096];
        if stream.read(&mut sink).await? == 0 {
            return Ok(());
        }
        stream.write_all(&refusal).await?;
        stream.shutdown().await?;
        let mut read = 0;
        while read < 64 << 10 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => read += n,
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// hyper's own limit of concurrent HTTP/2 streams, for listeners open to
/// any client.
pub const DEFAULT_HTTP2_STREAMS: u32 = 200;

/// How long a TLS client may take over its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's head (HTTP/1.1). hyper
/// counts an idle keep-alive connection's wait for its next request too: a
/// connection idle this long is closed. A new connection must send its
/// first byte within it too.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// HTTP/2 clients are pinged this often when quiet, and closed when a ping
/// goes unanswered this long: a client gone without a word holds nothing.
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(20);
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client of these servers (a data plane's pool of connections
/// to agents) keeps a connection idle: well inside [`HEADER_READ_TIMEOUT`],
/// so that the server never closes one as a request goes out.
pub const CLIENT_IDLE_TIMEOUT: Duration = Duration::from_secs(HEADER_READ_TIMEOUT.as_secs() * 2 / 3);

/// The number of workers to run when none is configured: one per core.
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// The workers to run for a `workers` setting: as configured, 0 being one
/// per core.
pub fn workers(configured: usize) -> usize {
    if configured == 0 { default_workers() } else { configured }
}

/// Serves until `shutdown` is cancelled and every connection has finished
/// its requests (idle ones are closed at once), or the shutdown grace is
/// over: then what still runs is cut. One worker thread per service maker
/// given, which makes the service of each connection it serves from the
/// client's address. Dropping the returned future stops the workers and
/// cuts their connections.
///
/// A tower service (an axum `Router`) is served as
/// `move |_| TowerToHyperService::new(router.clone())`.
pub async fn serve<M, S, B>(
    listener: TcpListener,
    services: Vec<M>,
    options: Options,
    shutdown: CancellationToken,
) -> std::io::Result<()>
where
    M: Fn(SocketAddr) -> S + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if services.is_empty() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "no workers to serve with"));
    }
    let Options {
        name,
        tls,
        http2_streams,
        shutdown_grace,
        past_grace,
        header_read_timeout,
        limit,
        max_requests_per_connection,
        proxy_protocol,
    } = options;
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    let refusals = Arc::new(tokio::sync::Semaphore::new(REFUSALS_AT_ONCE));
    // Cancelled when this future ends or is dropped: workers stop at once.
    let stop_now = CancellationToken::new();
    let _stop_on_drop = stop_now.clone().drop_guard();
    let mut workers = Vec::with_capacity(services.len());
    for (index, make_service) in services.into_iter().enumerate() {
        let (connections, inbox) = mpsc::unbounded_channel();
        let (done, finished) = oneshot::channel::<()>();
        let open = Arc::new(AtomicUsize::new(0));
        let worker = Worker {
            inbox,
            make_service,
            tls: tls.clone(),
            http2_streams,
            header_read_timeout,
            max_requests: max_requests_per_connection,
            open: Arc::clone(&open),
            stop_now: stop_now.clone(),
        };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        std::thread::Builder::new().name(format!("{name}-{index}")).spawn(move || {
            runtime.block_on(worker.run());
            // Dropping the runtime here ends whatever it still runs.
            drop(runtime);
            let _ = done.send(());
        })?;
        workers.push(WorkerHandle { connections, open, finished });
    }
    let mut acceptor = Acceptor::new(listener);
    // Connections whose PROXY header was read, by tasks of their own.
    let (relayed, mut relayed_rx) = mpsc::unbounded_channel::<Handed>();
    loop {
        let connection = tokio::select! {
            () = shutdown.cancelled() => break,
            Some(relayed) = relayed_rx.recv() => relayed,
            (stream, peer) = acceptor.accept() => {
                let _ = stream.set_nodelay(true);
                let Some(ticket) = limit.admit(stream, peer.ip(), &refusals) else { continue };
                if proxy_protocol.as_ref().is_some_and(|from| from(peer.ip())) {
                    let (limit, refusals, relayed) = (limit.clone(), Arc::clone(&refusals), relayed.clone());
                    let shutdown = shutdown.clone();
                    tokio::spawn(async move {
                        tokio::select! {
                            () = shutdown.cancelled() => {}
                            handed = relay(ticket, limit, refusals, header_read_timeout) => {
                                if let Some(handed) = handed {
                                    let _ = relayed.send(handed);
                                }
                            }
                        }
                    });
                    continue;
                }
                let Ok(stream) = ticket.stream.into_std() else { continue };
                Handed { stream, peer, ticket: ticket.ticket }
            }
        };
        hand_to_least_busy(&mut workers, connection, name)?;
    }
    drop(acceptor);
    finish(workers, shutdown_grace, past_grace).await;
    // Returning drops `stop_now`'s guard: workers still running stop.
    Ok(())
}

/// Hands `connection` to the worker with the fewest open. A worker that
/// stopped (a bug panicked it) would have the fewest connections forever:
/// it takes none again.
fn hand_to_least_busy(workers: &mut Vec<WorkerHandle>, mut connection: Handed, name: &str) -> std::io::Result<()> {
    loop {
        let Some(index) = (0..workers.len()).min_by_key(|&i| workers[i].open.load(Ordering::Relaxed)) else {
            return Err(std::io::Error::other("every worker thread has stopped"));
        };
        let worker = &workers[index];
        worker.open.fetch_add(1, Ordering::Relaxed);
        match worker.connections.send(connection) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::SendError(returned)) => {
                tracing::error!("a {name} worker thread stopped; serving on the others");
                workers.swap_remove(index);
                connection = returned;
            }
        }
    }
}

/// Closing the inboxes tells each worker to finish its connections: they
/// have `grace` to, then what still runs is cut (`past_grace`).
async fn finish(workers: Vec<WorkerHandle>, grace: Duration, past_grace: CancellationToken) {
    let finished: Vec<_> = workers.into_iter().map(|worker| worker.finished).collect();
    let all_finished = async {
        for finished in finished {
            let _ = finished.await;
        }
    };
    tokio::pin!(all_finished);
    if tokio::time::timeout(grace, &mut all_finished).await.is_err() {
        tracing::warn!(grace_ms = grace.as_millis(), "requests still in flight after the shutdown grace; ending them");
        past_grace.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(1), all_finished).await;
    }
}

impl ConnectionLimit {
    /// `stream` from `address`, taken with its place, or refused (told
    /// so, and closed in a task of its own, at most `refusals` at once).
    fn admit(
        &self,
        stream: TcpStream,
        address: std::net::IpAddr,
        refusals: &Arc<tokio::sync::Semaphore>,
    ) -> Option<Admitted> {
        match self.admission.as_ref().map(|admission| admission.admit(address)).transpose() {
            Ok(ticket) => {
                if let (Some(refused), Some(true)) = (&self.refused, ticket.as_ref().map(Ticket::made_room)) {
                    refused(Refused::Strangers);
                }
                Some(Admitted { stream, ticket })
            }
            Err(why) => {
                if let Some(refused) = &self.refused {
                    refused(why);
                }
                if let Ok(permit) = Arc::clone(refusals).try_acquire_owned() {
                    let refusal = self.refusal.clone();
                    tokio::spawn(async move {
                        refuse(stream, refusal).await;
                        drop(permit);
                    });
                }
                None
            }
        }
    }
}

/// A connection taken, with its place.
struct Admitted {
    stream: TcpStream,
    ticket: Option<Ticket>,
}

/// A connection from a proxy that relays a client's (`taken` as the
/// proxy's), once its PROXY header named the client: taken again as that
/// client's, within its share, and handed on as its. None where the header
/// did not come or the client is past its share.
async fn relay(
    taken: Admitted,
    limit: ConnectionLimit,
    refusals: Arc<tokio::sync::Semaphore>,
    timeout: Duration,
) -> Option<Handed> {
    let Admitted { stream, ticket } = taken;
    let proxy = stream.peer_addr().ok()?;
    let client = match crate::listen::read_proxy_header(&stream, timeout).await {
        Ok(client) => client,
        Err(error) => {
            tracing::debug!(%proxy, ?error, "no PROXY protocol header from a proxy that sends one; closed");
            return None;
        }
    };
    // The proxy speaking for itself (its health checks) stays the proxy's.
    let Some(client) = client else {
        return Some(Handed { stream: stream.into_std().ok()?, peer: proxy, ticket });
    };
    // Its place given back first: the client takes it, not one more.
    drop(ticket);
    let Admitted { stream, ticket } = limit.admit(stream, client.ip(), &refusals)?;
    Some(Handed { stream: stream.into_std().ok()?, peer: client, ticket })
}

/// An accepted connection, handed to a worker with its place.
struct Handed {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    ticket: Option<Ticket>,
}

/// The acceptor's end of a worker.
struct WorkerHandle {
    /// Accepted connections, handed over.
    connections: mpsc::UnboundedSender<Handed>,
    /// Its connections still open, counted by the worker.
    open: Arc<AtomicUsize>,
    /// Resolves once its thread has ended.
    finished: oneshot::Receiver<()>,
}

struct Worker<M> {
    inbox: mpsc::UnboundedReceiver<Handed>,
    make_service: M,
    tls: Option<tokio_rustls::TlsAcceptor>,
    http2_streams: u32,
    header_read_timeout: Duration,
    max_requests: u64,
    open: Arc<AtomicUsize>,
    stop_now: CancellationToken,
}

/// One open connection of a worker, counted until it is dropped, however
/// its task ends.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Closes a worker's inbox if dropped while its thread unwinds. A panic
/// outside any task (a bug) ends the worker's thread, and with it the
/// inbox; but the runtime unwinds first, closing the connection in hand,
/// and a connection handed over in between would be lost. Closed at once,
/// the inbox refuses it, and the acceptor gives it to another worker.
struct CloseOnPanic<'a, T>(&'a mut mpsc::UnboundedReceiver<T>);

impl<T> Drop for CloseOnPanic<'_, T> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.close();
        }
    }
}

impl<M, S, B> Worker<M>
where
    M: Fn(SocketAddr) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    async fn run(mut self) {
        // Tokio wakes its I/O driver (an eventfd write, and one more return
        // from epoll) whenever a timer is set while no earlier one is
        // pending, as between two requests on an idle worker: every request's
        // header timeout would cost that. A one-second tick keeps an earlier
        // timer pending at all times.
        tokio::spawn(async {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
            }
        });
        let builders = Arc::new(builders(self.header_read_timeout, self.http2_streams));
        let (first_byte_timeout, max_requests) = (self.header_read_timeout, self.max_requests);
        // Every connection's task, waited for on shutdown.
        let connections = tokio_util::task::TaskTracker::new();
        // Cancelled when shutdown begins: a connection that has sent no
        // request yet (or not finished its TLS handshake) is idle, and closes
        // at once rather than holding the shutdown.
        let draining = CancellationToken::new();
        loop {
            let Handed { stream, peer, ticket } = tokio::select! {
                () = self.stop_now.cancelled() => return,
                next = self.inbox.recv() => match next {
                    Some(next) => next,
                    None => break,
                },
            };
            let open = Open(Arc::clone(&self.open));
            let Ok(tcp) = TcpStream::from_std(stream) else { continue };
            // Declared after the connection, so dropped before it: a client
            // that sees its connection closed by a panic here knows the
            // acceptor can hand this worker nothing more.
            let closes_if_panicking = CloseOnPanic(&mut self.inbox);
            let activity = Arc::new(Activity::new(max_requests));
            let service = Counting { inner: (self.make_service)(peer), activity: Arc::clone(&activity) };
            drop(closes_if_panicking);
            let (builders, tls) = (Arc::clone(&builders), self.tls.clone());
            let draining = draining.clone();
            let watched = (activity, first_byte_timeout, draining.clone());
            let stranger = ticket.as_ref().is_some_and(Ticket::is_stranger);
            // A stranger's HTTP/2 connection offered fewer streams than a
            // member's is asked to go (GOAWAY, its streams finished) once
            // its peer proves a credential: its next connection is a
            // member's, with every stream a member is offered.
            let promoted = ticket
                .as_ref()
                .filter(|_| stranger && self.http2_streams > DEFAULT_HTTP2_STREAMS)
                .and_then(Ticket::promoted)
                .map(|promoted| Box::pin(promoted) as Promoted);
            connections.spawn(async move {
                let served = async move {
                    let (http1, members, strangers) = &*builders;
                    let http2 = if stranger { strangers } else { members };
                    match tls {
                        None => {
                            let version = tokio::select! {
                                version = sniff(&tcp, first_byte_timeout) => version,
                                () = draining.cancelled() => return,
                            };
                            let Some(version) = version else {
                                tracing::debug!(%peer, "no request on a new connection; closed");
                                return;
                            };
                            let builder = if version == Sniffed::Http2 { http2 } else { http1 };
                            let connection = builder.serve_connection(TokioIo::new(tcp), service);
                            let promoted = promoted.filter(|_| version == Sniffed::Http2);
                            serve_watched(connection.into_owned(), watched, promoted).await;
                        }
                        Some(acceptor) => {
                            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp));
                            let handshake = tokio::select! {
                                done = handshake => done,
                                () = draining.cancelled() => return,
                            };
                            match handshake {
                                Ok(Ok(tls)) => {
                                    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                                    let builder = if h2 { http2 } else { http1 };
                                    let connection = builder.serve_connection(TokioIo::new(tls), service);
                                    serve_watched(connection.into_owned(), watched, promoted.filter(|_| h2)).await;
                                }
                                Ok(Err(error)) => tracing::debug!(%error, %peer, "TLS handshake failed"),
                                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                            }
                        }
                    }
                };
                // A stranger's connection is closed when the listener says
                // so: its peer proved nothing in time, or a newer stranger
                // needed its place.
                match ticket.as_ref().and_then(Ticket::closing) {
                    Some(closing) => tokio::select! {
                        () = served => {}
                        () = closing => tracing::debug!(%peer, "a stranger's connection closed (unproven, or to make room)"),
                    },
                    None => served.await,
                }
                drop((open, ticket));
            });
        }
        draining.cancel();
        // Shutdown: idle connections close, busy ones finish their requests.
        connections.close();
        tokio::select! {
            () = connections.wait() => {}
            () = self.stop_now.cancelled() => {}
        }
    }
}

/// The connection builders a worker serves with: HTTP/1.1 only, HTTP/2
/// only for members, and HTTP/2 only for strangers. The protocol is chosen
/// before hyper sees the connection (by ALPN, or by the first bytes): its
/// own sniffing has no timeout. (Plain `serve_connection` follows a
/// builder's version; the one "with upgrades" sniffs whatever it is told.
/// Upgrades are hop-by-hop: no proxy here passes one on.) A stranger's
/// connection is offered no more streams than any open listener's,
/// whatever its members are offered: each stream is a request held open.
fn builders(
    header_read_timeout: Duration,
    http2_streams: u32,
) -> (Builder<TokioExecutor>, Builder<TokioExecutor>, Builder<TokioExecutor>) {
    let mut builder = Builder::new(TokioExecutor::new());
    // Without a timer hyper has no header read timeout at all: a client
    // could hold a connection (and a shutdown) with half a request.
    builder.http1().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(header_read_timeout);
    builder
        .http2()
        .max_concurrent_streams(http2_streams)
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(HTTP2_PING_INTERVAL)
        .keep_alive_timeout(HTTP2_PING_TIMEOUT);
    let mut strangers = builder.clone().http2_only();
    strangers.http2().max_concurrent_streams(http2_streams.min(DEFAULT_HTTP2_STREAMS));
    (builder.clone().http1_only(), builder.http2_only(), strangers)
}

/// Serves `connection` until shutdown begins (`draining`), it goes idle,
/// has carried all the requests it may, or its client stops taking what it
/// is sent (its `activity` watched every `period`, by a task of its own:
/// the connection's task, woken several times a request, only reads a flag
/// the watcher sets). Then it is closed: at once, its answers under way
/// cut, where its client takes nothing; else gracefully, its requests in
/// flight answered (HTTP/1.1 closes after the answer under way, HTTP/2
/// sends a GOAWAY), and watched until it is done.
async fn serve_watched<C>(
    connection: C,
    (activity, period, draining): (Arc<Activity>, Duration, CancellationToken),
    promoted: Option<Promoted>,
) where
    C: Future + GracefulConnection,
{
    let signal = Arc::new(Signal::default());
    let watcher = tokio::spawn(watch(activity, Arc::clone(&signal), period, draining, promoted));
    let _stop_watching = tokio_util::task::AbortOnDropHandle::new(watcher);
    Watched { connection, signal, closing: false }.await;
}

/// A stranger's connection that is to close gracefully once it is no
/// stranger's.
type Promoted = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Tells `signal` how the connection whose `activity` it watches is to
/// close, once it is to: on shutdown, on `promoted`, gracefully.
async fn watch(
    activity: Arc<Activity>,
    signal: Arc<Signal>,
    period: Duration,
    draining: CancellationToken,
    promoted: Option<Promoted>,
) {
    let mut closing = false;
    let mut promoted = promoted.unwrap_or_else(|| Box::pin(std::future::pending()));
    loop {
        let close = tokio::select! {
            () = draining.cancelled(), if !closing => Close::Gracefully,
            () = &mut promoted, if !closing => {
                tracing::debug!("a stranger's HTTP/2 connection proved a credential; asked to go for a member's");
                Close::Gracefully
            }
            close = activity.watch(period) => close,
        };
        match close {
            Close::Now => {
                tracing::debug!("a client took nothing of its answers for a while; its connection cut");
                signal.tell(Close::Now);
                return;
            }
            Close::Gracefully if !closing => {
                closing = true;
                signal.tell(Close::Gracefully);
            }
            Close::Gracefully => {}
        }
    }
}

/// What a connection's watcher tells it, and the connection's task to wake.
#[derive(Default)]
struct Signal {
    /// 0: serve on; else a [`Close`].
    close: std::sync::atomic::AtomicU8,
    waker: atomic_waker::AtomicWaker,
}

impl Signal {
    fn tell(&self, close: Close) {
        let value = match close {
            Close::Gracefully => 1,
            Close::Now => 2,
        };
        self.close.store(value, Ordering::Release);
        self.waker.wake();
    }
}

pin_project_lite::pin_project! {
    /// A connection that closes as its watcher says.
    struct Watched<C> {
        #[pin]
        connection: C,
        signal: Arc<Signal>,
        closing: bool,
    }
}

impl<C: Future + GracefulConnection> Future for Watched<C> {
    type Output = ();

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        let mut this = self.project();
        this.signal.waker.register(cx.waker());
        match this.signal.close.load(Ordering::Acquire) {
            2 => return std::task::Poll::Ready(()),
            1 if !*this.closing => {
                *this.closing = true;
                this.connection.as_mut().graceful_shutdown();
            }
            _ => {}
        }
        this.connection.poll(cx).map(|_| ())
    }
}

/// A connection that can be told to finish what it has and close.
trait GracefulConnection {
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>);
}

impl<I, S, E> GracefulConnection for hyper_util::server::conn::auto::Connection<'_, I, S, E>
where
    S: hyper::service::HttpService<Incoming>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::ResBody: http_body::Body + Send + 'static,
    <S::ResBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, S::ResBody>,
{
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        hyper_util::server::conn::auto::Connection::graceful_shutdown(self);
    }
}

/// What one connection's requests are doing: how many it has been sent,
/// how many are not answered whole yet (until the answer's body is done
/// or dropped), and how its answers are read: how often their bodies were
/// polled, and how many handed a frame and have not been polled since
/// (the client is not taking what it was sent). A few relaxed atomic
/// operations a request and a frame, no clock: every request of a proxy
/// pays for it.
struct Activity {
    started: AtomicU64,
    open: AtomicU64,
    polls: AtomicU64,
    awaiting: AtomicU64,
    /// Requests it may be sent; 0: no limit.
    max_requests: u64,
    /// Told once it has been sent them all.
    spent: tokio::sync::Notify,
}

/// How a watched connection is to end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Close {
    /// Its requests in flight answered first.
    Gracefully,
    /// At once: its client takes nothing of what it was sent.
    Now,
}

impl Activity {
    fn new(max_requests: u64) -> Activity {
        Activity {
            started: AtomicU64::new(0),
            open: AtomicU64::new(0),
            polls: AtomicU64::new(0),
            awaiting: AtomicU64::new(0),
            max_requests,
            spent: tokio::sync::Notify::new(),
        }
    }

    /// Resolves once the connection is to close, its activity looked at
    /// every `period`: gracefully once it has had no request for a whole
    /// period (between one and two after its last answer) or has been
    /// sent all its requests; at once where an answer has waited a whole
    /// period for its client to take a frame, no answer of the
    /// connection's read meanwhile. (A client that reads one answer of an
    /// HTTP/2 connection keeps the others alive.)
    async fn watch(&self, period: Duration) -> Close {
        let spent = self.spent.notified();
        let watched = async {
            let (mut seen_started, mut seen_polls) = (u64::MAX, u64::MAX);
            loop {
                let started = self.started.load(Ordering::Relaxed);
                let quiet = self.open.load(Ordering::Relaxed) == 0;
                if quiet && started == seen_started {
                    return Close::Gracefully;
                }
                let polls = self.polls.load(Ordering::Relaxed);
                let awaiting = self.awaiting.load(Ordering::Relaxed) > 0;
                if awaiting && polls == seen_polls {
                    return Close::Now;
                }
                seen_started = if quiet { started } else { u64::MAX };
                seen_polls = if awaiting { polls } else { u64::MAX };
                tokio::time::sleep(period).await;
            }
        };
        tokio::select! {
            () = spent => Close::Gracefully,
            close = watched => close,
        }
    }
}

/// A connection's service, counting its requests into its [`Activity`].
struct Counting<S> {
    inner: S,
    activity: Arc<Activity>,
}

/// One request not answered whole yet; `handed`: its body handed a frame
/// and has not been polled since.
struct Unanswered {
    activity: Arc<Activity>,
    handed: bool,
}

impl Unanswered {
    fn polled(&mut self) {
        if std::mem::take(&mut self.handed) {
            self.activity.awaiting.fetch_sub(1, Ordering::Relaxed);
        }
        self.activity.polls.fetch_add(1, Ordering::Relaxed);
    }

    fn handed(&mut self) {
        self.handed = true;
        self.activity.awaiting.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.handed {
            self.activity.awaiting.fetch_sub(1, Ordering::Relaxed);
        }
        self.activity.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<S, B> hyper::service::Service<Request<Incoming>> for Counting<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>,
{
    type Response = Response<CountedBody<B>>;
    type Error = Infallible;
    type Future = CountedAnswer<S::Future>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let started = self.activity.started.fetch_add(1, Ordering::Relaxed) + 1;
        let last = started == self.activity.max_requests;
        if last {
            // A permit, kept until the connection's watcher takes it.
            self.activity.spent.notify_one();
        }
        self.activity.open.fetch_add(1, Ordering::Relaxed);
        let unanswered = Unanswered { activity: Arc::clone(&self.activity), handed: false };
        // An HTTP/1.1 client learns from the last answer itself that the
        // connection closes, whenever the watcher acts: a client that sent
        // another request meanwhile would see it fail.
        let closes = last && request.version() < http::Version::HTTP_2;
        CountedAnswer { inner: self.inner.call(request), unanswered: Some(unanswered), closes }
    }
}

pin_project_lite::pin_project! {
    /// A counted request's answer, to its head.
    struct CountedAnswer<F> {
        #[pin]
        inner: F,
        unanswered: Option<Unanswered>,
        closes: bool,
    }
}

impl<F, B> Future for CountedAnswer<F>
where
    F: Future<Output = Result<Response<B>, Infallible>>,
{
    type Output = Result<Response<CountedBody<B>>, Infallible>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let Ok(mut response) = std::task::ready!(this.inner.poll(cx));
        if *this.closes {
            response.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
        }
        let unanswered = this.unanswered.take();
        std::task::Poll::Ready(Ok(response.map(|inner| CountedBody { inner, unanswered })))
    }
}

pin_project_lite::pin_project! {
    /// A counted request's answer's body: the request is answered once it
    /// is done or dropped.
    pub struct CountedBody<B> {
        #[pin]
        inner: B,
        unanswered: Option<Unanswered>,
    }
}

impl<B: http_body::Body> http_body::Body for CountedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        if let Some(unanswered) = this.unanswered.as_mut() {
            unanswered.polled();
        }
        let polled = this.inner.as_mut().poll_frame(cx);
        // The last frame is not waited on: a whole answer is one frame, which
        // a client reading slowly may take minutes to take.
        if let (std::task::Poll::Ready(Some(Ok(_))), Some(unanswered)) = (&polled, this.unanswered.as_mut())
            && !this.inner.is_end_stream()
        {
            unanswered.handed();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Answers with the worker's index, its thread and the peer its
    /// connection was made for; `/slow` says it has started, then waits
    /// until released.
    struct Echo {
        worker: usize,
        peer: SocketAddr,
        entered: Arc<tokio::sync::Notify>,
        release: Arc<tokio::sync::Notify>,
    }

    impl hyper::service::Service<Request<Incoming>> for Echo {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

        fn call(&self, request: Request<Incoming>) -> Self::Future {
            let (worker, peer) = (self.worker, self.peer);
            let (entered, release) = (Arc::clone(&self.entered), Arc::clone(&self.release));
            Box::pin(async move {
                if request.uri().path() == "/slow" {
                    entered.notify_one();
                    release.notified().await;
                }
                let thread = std::thread::current().name().unwrap_or_default().to_string();
                Ok(Response::new(Full::new(Bytes::from(format!("{worker} {thread} {peer}")))))
            })
        }
    }

    struct Server {
        addr: SocketAddr,
        entered: Arc<tokio::sync::Notify>,
        release: Arc<tokio::sync::Notify>,
        shutdown: CancellationToken,
        served: tokio::task::JoinHandle<std::io::Result<()>>,
    }

    /// Plain HTTP, a grace long enough never to cut a test's request.
    fn options(name: &'static str) -> Options {
        Options {
            name,
            tls: None,
            http2_streams: DEFAULT_HTTP2_STREAMS,
            shutdown_grace: Duration::from_secs(60),
            past_grace: CancellationToken::new(),
            header_read_timeout: HEADER_READ_TIMEOUT,
            limit: ConnectionLimit::default(),
            max_requests_per_connection: 0,
            proxy_protocol: None,
        }
    }

    async fn start(workers: usize) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (entered, release) = (Arc::new(tokio::sync::Notify::new()), Arc::new(tokio::sync::Notify::new()));
        let services = (0..workers)
            .map(|worker| {
                let (entered, release) = (Arc::clone(&entered), Arc::clone(&release));
                move |peer| Echo { worker, peer, entered: Arc::clone(&entered), release: Arc::clone(&release) }
            })
            .collect();
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(listener, services, options("test"), shutdown.clone()));
        Server { addr, entered, release, shutdown, served }
    }

    async fn get(client: &Client<HttpConnector, Full<Bytes>>, url: String) -> String {
        let response = client.get(url.parse().unwrap()).await.unwrap();
        String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
    }

    #[tokio::test]
    async fn connections_are_spread_over_the_workers_each_on_its_own_thread() {
        let Server { addr, shutdown, served, .. } = start(2).await;
        // Eight connections at once, each held open by the others' requests.
        let mut answers = Vec::new();
        let mut streams = Vec::new();
        for _ in 0..8 {
            let stream = TcpStream::connect(addr).await.unwrap();
            let local = stream.local_addr().unwrap();
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
            tokio::spawn(connection);
            let request = Request::get("/").body(Full::new(Bytes::new())).unwrap();
            let body = sender.send_request(request).await.unwrap().into_body().collect().await.unwrap().to_bytes();
            let answer = String::from_utf8(body.to_vec()).unwrap();
            assert!(answer.ends_with(&local.to_string()), "the service is told its client: {answer} for {local}");
            answers.push(answer);
            streams.push(sender);
        }
        let workers: HashSet<_> = answers.iter().map(|a| a.split(' ').next().unwrap().to_string()).collect();
        assert_eq!(workers.len(), 2, "both workers serve: {answers:?}");
        for answer in &answers {
            let mut fields = answer.split(' ');
            let (worker, thread) = (fields.next().unwrap(), fields.next().unwrap());
            assert_eq!(thread, format!("test-{worker}"), "a worker's service runs on its own thread");
        }
        let per_worker = answers.iter().filter(|a| a.starts_with("0 ")).count();
        assert_eq!(per_worker, 4, "the fewest-connections pick balances: {answers:?}");
        shutdown.cancel();
        drop(streams);
        served.await.unwrap().unwrap();
    }

    /// Answers 200.
    struct Ok200;

    impl hyper::service::Service<Request<Incoming>> for Ok200 {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;

        fn call(&self, _: Request<Incoming>) -> Self::Future {
            std::future::ready(Ok(Response::new(Full::new(Bytes::from_static(b"ok")))))
        }
    }

    /// A service maker that kills its worker (it panics, outside any
    /// task) when `boom` is set; the one that panics clears it.
    fn fragile(boom: Arc<std::sync::atomic::AtomicBool>) -> impl Fn(SocketAddr) -> Ok200 + Send + 'static {
        move |_| {
            assert!(!boom.swap(false, Ordering::SeqCst), "worker bug");
            Ok200
        }
    }

    #[tokio::test]
    async fn a_worker_that_died_gets_no_more_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let boom = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let services = (0..2).map(|_| fragile(Arc::clone(&boom))).collect();
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(listener, services, options("fragile"), shutdown.clone()));
        // The first connection kills the worker it is handed to.
        boom.store(true, Ordering::SeqCst);
        let mut first = TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        let closed = tokio::io::AsyncReadExt::read(&mut first, &mut byte).await;
        assert!(matches!(closed, Ok(0) | Err(_)), "the dead worker's connection is closed");
        // Every later connection is served, none handed to the dead worker
        // (which, with the fewest open, would otherwise get every other one).
        let mut senders = Vec::new();
        for _ in 0..4 {
            let stream = TcpStream::connect(addr).await.unwrap();
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
            tokio::spawn(connection);
            let response = sender.send_request(Request::get("/").body(Full::new(Bytes::new())).unwrap()).await;
            assert_eq!(response.unwrap().status(), http::StatusCode::OK);
            senders.push(sender);
        }
        shutdown.cancel();
        drop(senders);
        served.await.unwrap().unwrap();
    }

    /// One worker answering 200, with `header_read_timeout`.
    async fn serve_ok(
        header_read_timeout: Duration,
    ) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<std::io::Result<()>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let options = Options { header_read_timeout, ..options("quiet") };
        let shutdown = CancellationToken::new();
        (addr, shutdown.clone(), tokio::spawn(serve(listener, vec![|_| Ok200], options, shutdown)))
    }

    /// A request on a new connection is answered 200; its sender.
    async fn answered(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let response = sender.send_request(Request::get("/").body(Full::new(Bytes::new())).unwrap()).await;
        assert_eq!(response.unwrap().status(), http::StatusCode::OK);
        sender
    }

    #[tokio::test]
    async fn a_connection_that_sends_nothing_is_closed_after_the_header_timeout() {
        let (addr, shutdown, served) = serve_ok(Duration::from_millis(200)).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(&mut silent, &mut byte));
        assert!(matches!(read.await, Ok(Ok(0) | Err(_))), "the silent connection is closed");
        // One that speaks is served.
        let sender = answered(addr).await;
        shutdown.cancel();
        drop(sender);
        served.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_connection_that_sends_a_piece_of_the_http2_preface_and_stops_is_closed() {
        let (addr, shutdown, served) = serve_ok(Duration::from_millis(200)).await;
        let mut halting = TcpStream::connect(addr).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut halting, b"PRI * HTTP").await.unwrap();
        let mut byte = [0u8; 1];
        let read =
            tokio::time::timeout(Duration::from_secs(10), tokio::io::AsyncReadExt::read(&mut halting, &mut byte));
        assert!(matches!(read.await, Ok(Ok(0) | Err(_))), "the halting connection is closed");
        // Whole, the preface is HTTP/2's; a request line is HTTP/1.1's.
        let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http::<Full<Bytes>>();
        let response = client.get(format!("http://{addr}/").parse().unwrap()).await.unwrap();
        assert_eq!((response.status(), response.version()), (http::StatusCode::OK, http::Version::HTTP_2));
        drop(client);
        drop(answered(addr).await);
        shutdown.cancel();
        served.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_connection_that_has_sent_nothing_yet_does_not_hold_a_shutdown() {
        let (addr, shutdown, served) = serve_ok(Duration::from_secs(60)).await;
        let mut quiet = TcpStream::connect(addr).await.unwrap();
        // Served a request once, the worker has surely taken the quiet one.
        drop(answered(addr).await);
        shutdown.cancel();
        let ended = tokio::time::timeout(Duration::from_secs(10), served).await;
        ended.expect("the quiet connection held the shutdown").unwrap().unwrap();
        let mut byte = [0u8; 1];
        assert!(matches!(tokio::io::AsyncReadExt::read(&mut quiet, &mut byte).await, Ok(0) | Err(_)));
    }

    #[tokio::test]
    async fn h2c_with_prior_knowledge_is_served_on_the_same_port() {
        let Server { addr, shutdown, served, .. } = start(1).await;
        let client = Client::builder(TokioExecutor::new()).http2_only(true).build_http();
        assert!(get(&client, format!("http://{addr}/")).await.starts_with("0 test-0"));
        drop(client);
        shutdown.cancel();
        served.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn shutdown_lets_a_request_in_flight_finish_and_refuses_new_connections() {
        let Server { addr, entered, release, shutdown, served } = start(2).await;
        let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let slow = tokio::spawn(async move { get(&client, format!("http://{addr}/slow")).await });
        entered.notified().await;
        shutdown.cancel();
        // The listener closes; the request in its handler is not cut.
        while TcpStream::connect(addr).await.is_ok() {
            tokio::task::yield_now().await;
        }
        assert!(!served.is_finished(), "the server waits for the request in flight");
        release.notify_one();
        assert!(slow.await.unwrap().starts_with(['0', '1']), "the request in flight is answered");
        served.await.unwrap().unwrap();
    }

    /// Answers each request with the address its connection was served
    /// as.
    struct Peer(SocketAddr);

    impl hyper::service::Service<Request<Incoming>> for Peer {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;

        fn call(&self, _: Request<Incoming>) -> Self::Future {
            std::future::ready(Ok(Response::new(Full::new(Bytes::from(self.0.to_string())))))
        }
    }

    /// What a connection that sends `first` and then a request is
    /// answered: its status line and body, or nothing where it is closed.
    async fn relayed(addr: SocketAddr, first: &[&[u8]]) -> Option<String> {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        for piece in first {
            stream.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let request = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";
        if stream.write_all(request).await.is_err() {
            return None;
        }
        let mut answer = String::new();
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer)).await;
        let _ = read.expect("answered or closed in time");
        let status = answer.lines().next()?.to_string();
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        Some(format!("{status} {body}"))
    }

    #[tokio::test]
    async fn a_trusted_proxy_s_connection_is_its_client_s_by_its_proxy_protocol_header() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let proxy: crate::admit::KnownPeers = Arc::new(|ip: std::net::IpAddr| ip.is_loopback());
        let limits = crate::admit::Limits { max: 100, per_peer: 1, strangers: 0, prove_within: None };
        let options = Options {
            header_read_timeout: Duration::from_millis(500),
            limit: ConnectionLimit {
                admission: Some(Admission::new(limits, Some(Arc::clone(&proxy)))),
                refusal: overloaded("text/plain", "full", None),
                refused: None,
            },
            proxy_protocol: Some(proxy),
            ..options("relayed")
        };
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(listener, vec![Peer], options, shutdown.clone()));

        let v1 = b"PROXY TCP4 192.0.2.9 127.0.0.1 5555 80\r\n";
        assert_eq!(relayed(addr, &[v1]).await.as_deref(), Some("HTTP/1.1 200 OK 192.0.2.9:5555"));
        // In pieces, as a proxy may send it.
        let answer = relayed(addr, &[&v1[..9], &v1[9..]]).await;
        assert_eq!(answer.as_deref(), Some("HTTP/1.1 200 OK 192.0.2.9:5555"));
        // Version 2, an IPv6 client.
        let mut v2 = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
        v2.extend([0x21, 0x21, 0, 36]);
        v2.extend("2001:db8::7".parse::<std::net::Ipv6Addr>().unwrap().octets());
        v2.extend(std::net::Ipv6Addr::LOCALHOST.octets());
        v2.extend([0x1f, 0x90, 0, 80]);
        assert_eq!(relayed(addr, &[&v2]).await.as_deref(), Some("HTTP/1.1 200 OK [2001:db8::7]:8080"));
        // The proxy's own health check (LOCAL) stays the proxy's.
        let local = [b"\r\n\r\n\0\r\nQUIT\n".as_slice(), &[0x20, 0x00, 0, 0]].concat();
        let answer = relayed(addr, &[&local]).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK 127.0.0.1:"), "{answer}");
        // Without one, or with a malformed one, nothing is served.
        assert_eq!(relayed(addr, &[]).await, None, "a request without the header");
        assert_eq!(relayed(addr, &[b"PROXY TCP4 banana\r\n"]).await, None);

        // Each client has its share, whatever proxy relays it.
        let mut held = TcpStream::connect(addr).await.unwrap();
        held.write_all(v1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let refused = relayed(addr, &[v1]).await.unwrap();
        assert!(refused.starts_with("HTTP/1.1 503"), "past the client's share: {refused}");
        let other = relayed(addr, &[b"PROXY TCP4 192.0.2.10 127.0.0.1 5555 80\r\n"]).await;
        assert_eq!(other.as_deref(), Some("HTTP/1.1 200 OK 192.0.2.10:5555"));
        drop(held);
        shutdown.cancel();
        served.await.unwrap().unwrap();
    }

    /// Answers 200 after `0` of waiting.
    #[derive(Clone)]
    struct Slow(Duration);

    impl hyper::service::Service<Request<Incoming>> for Slow {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

        fn call(&self, _: Request<Incoming>) -> Self::Future {
            let wait = self.0;
            Box::pin(async move {
                tokio::time::sleep(wait).await;
                Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
            })
        }
    }

    async fn serve_slow(
        wait: Duration,
        idle: Duration,
        max_requests: u64,
    ) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<std::io::Result<()>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let options =
            Options { header_read_timeout: idle, max_requests_per_connection: max_requests, ..options("idle") };
        let shutdown = CancellationToken::new();
        let service = move |_| Slow(wait);
        (addr, shutdown.clone(), tokio::spawn(serve(listener, vec![service], options, shutdown)))
    }

    /// An HTTP/2 connection to `addr`: its sender, and what resolves when
    /// the server has closed it.
    async fn http2(
        addr: SocketAddr,
    ) -> (hyper::client::conn::http2::SendRequest<Full<Bytes>>, tokio::task::JoinHandle<()>) {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
        (sender, tokio::spawn(async move { connection.await.unwrap_or_default() }))
    }

    fn get_root() -> Request<Full<Bytes>> {
        Request::get("http://x/").body(Full::new(Bytes::new())).unwrap()
    }

    #[tokio::test]
    async fn an_idle_http2_connection_is_closed_and_a_busy_one_is_not() {
        let idle = Duration::from_millis(200);
        // Each answer takes three idle periods.
        let (addr, shutdown, served) = serve_slow(idle * 3, idle, 0).await;
        let (mut sender, closed) = http2(addr).await;
        let answer = sender.send_request(get_root()).await.expect("answered, though it took longer than idle");
        assert_eq!(answer.status(), http::StatusCode::OK);
        assert!(!closed.is_finished(), "busy until then");
        // Then nothing: closed within two idle periods, and a little.
        tokio::time::timeout(idle * 4, closed).await.expect("an idle connection is closed").unwrap();
        shutdown.cancel();
        served.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_connection_carries_at_most_its_requests_and_answers_those_it_took() {
        // Answered at once, so before the connection's watcher is polled:
        // the answer itself must say that the connection closes.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let options = Options { max_requests_per_connection: 3, ..options("at-once") };
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(listener, vec![|_| Ok200], options, shutdown.clone()));
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        let connection = tokio::spawn(connection);
        for n in 1..=3 {
            sender.ready().await.unwrap_or_else(|e| panic!("request {n}: {e}"));
            let answer = sender.send_request(get_root()).await.unwrap();
            let closes = answer.headers().get(http::header::CONNECTION).is_some_and(|v| v == "close");
            assert_eq!(closes, n == 3, "request {n}");
        }
        tokio::time::timeout(Duration::from_secs(5), connection).await.expect("closed after its third").unwrap().ok();
        shutdown.cancel();
        served.await.unwrap().unwrap();

        let (addr, shutdown, served) = serve_slow(Duration::ZERO, Duration::from_secs(60), 3).await;
        // HTTP/1.1: the third answer closes the connection.
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        let connection = tokio::spawn(connection);
        for n in 1..=3 {
            sender.ready().await.unwrap_or_else(|e| panic!("request {n}: {e}"));
            let answer = sender.send_request(get_root()).await.unwrap();
            assert_eq!(answer.status(), http::StatusCode::OK);
            let closes = answer.headers().get(http::header::CONNECTION).is_some_and(|v| v == "close");
            assert_eq!(closes, n == 3, "request {n}");
            answer.into_body().collect().await.unwrap();
        }
        tokio::time::timeout(Duration::from_secs(5), connection).await.expect("closed after its third").unwrap().ok();
        // HTTP/2: a GOAWAY after the third; the third is answered.
        let (mut sender, closed) = http2(addr).await;
        for n in 1..=3 {
            let answer = sender.send_request(get_root()).await.unwrap_or_else(|e| panic!("request {n}: {e}"));
            assert_eq!(answer.status(), http::StatusCode::OK);
        }
        tokio::time::timeout(Duration::from_secs(5), closed).await.expect("closed after its third").unwrap();
        assert!(sender.send_request(get_root()).await.is_err(), "no fourth on it");
        shutdown.cancel();
        served.await.unwrap().unwrap();
    }

    /// Answers with `frames` of 64 KiB (no end where `None`), one each
    /// `gap`; sets `cut` once its answer's body is dropped before its end.
    #[derive(Clone)]
    struct Frames {
        frames: Option<usize>,
        gap: Duration,
        cut: Arc<std::sync::atomic::AtomicBool>,
    }

    type FrameStream = tokio_stream::wrappers::ReceiverStream<Result<http_body::Frame<Bytes>, Infallible>>;

    impl hyper::service::Service<Request<Incoming>> for Frames {
        type Response = Response<http_body_util::StreamBody<FrameStream>>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;

        fn call(&self, _: Request<Incoming>) -> Self::Future {
            let (tx, rx) = mpsc::channel(1);
            let Frames { frames, gap, cut } = self.clone();
            tokio::spawn(async move {
                for sent in 0.. {
                    if frames.is_some_and(|n| sent >= n) {
                        return;
                    }
                    tokio::time::sleep(gap).await;
                    if tx.send(Ok(http_body::Frame::data(Bytes::from(vec![b'x'; 64 << 10])))).await.is_err() {
                        cut.store(true, Ordering::SeqCst);
                        return;
                    }
                }
            });
            let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            std::future::ready(Ok(Response::new(body)))
        }
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_off_and_one_that_waits_on_its_answer_is_not() {
        let period = Duration::from_millis(200);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let endless = Frames { frames: None, gap: Duration::ZERO, cut: Arc::clone(&cut) };
        let stalled_options = Options { header_read_timeout: period, ..options("stalled") };
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(listener, vec![move |_| endless.clone()], stalled_options, shutdown.clone()));
        // Asks for an endless answer and takes none of it.
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let dropped = async {
            while !cut.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(period * 10, dropped).await.expect("its answer cut within a few periods");
        drop(stalled);
        shutdown.cancel();
        served.await.unwrap().unwrap();

        // An answer whose frames come three periods apart, read as they
        // come, goes to its end.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let slow = Frames { frames: Some(3), gap: period * 3, cut: Arc::clone(&cut) };
        let slow_options = Options { header_read_timeout: period, ..options("slow") };
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(listener, vec![move |_| slow.clone()], slow_options, shutdown.clone()));
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        let answer = sender.send_request(get_root()).await.unwrap();
        let body = answer.into_body().collect().await.expect("the whole answer").to_bytes();
        assert_eq!(body.len(), 3 * (64 << 10));
        assert!(!cut.load(Ordering::SeqCst));
        shutdown.cancel();
        served.await.unwrap().unwrap();
    }
}
