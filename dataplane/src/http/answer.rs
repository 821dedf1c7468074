//! The one body every streamed answer reaches its client through. It
//! meters the stream, keeps its tail, takes out the usage chunk the client
//! did not ask for, checks the end (`data: [DONE]`), and ends a stream
//! that failed with an error event rather than a cut connection. Two
//! states are optional: a prelude, SSE notes while a cold load runs before
//! the answer's head, and a resume, the stream continued on another node
//! when it breaks. What each end of a stream means is
//! [`classify_end`]'s to say.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use http_body::{Body as _, Frame, SizeHint};
use inferyes_proto::kinds::ErrorShape;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use super::attempt::{Hops, OpenStream};
use super::classify::{EndVerdict, Ended, UpstreamError, classify_end};
use super::client::NodeBody;
use super::continuation::{self, Continuation};
use crate::error::{ApiError, ErrorCode};
use crate::targets::{Endpoint, InFlight, Observed, Witness};
use crate::usage::{Meter, Outcome};

/// Enough of a stream's end to see its last events, usage included.
const TAIL_BYTES: usize = inferyes_proto::usage::TAIL_BYTES;
/// Enough of a stream's start to see its first event, where Anthropic's
/// says the prompt's tokens.
const HEAD_BYTES: usize = inferyes_proto::usage::HEAD_BYTES;
/// How often a client waiting on a cold load hears about it.
const LOADING_NOTE_EVERY: Duration = Duration::from_secs(1);

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// How a stream's body is passed on, whichever node answers: its opening
/// event, how it ends, its usage chunk, its meter, its error shape.
pub(crate) struct Plan {
    /// The event the stream must open with, where its kind has one.
    pub opening: Option<super::opening::Opening>,
    /// Fills in what a Responses stream's events leave out.
    pub responses: Option<super::responses::EventFields>,
    /// How the stream ends when it ends well (chat's `data: [DONE]`,
    /// Messages' `message_stop`, or an error event); the last bytes tell
    /// whether this one did.
    pub stream_end: inferyes_proto::kinds::StreamEnd,
    /// The data plane asked for usage the client did not: its chunk is
    /// taken out, which needs whole events.
    pub strip_usage: bool,
    /// What is done with llama-server's prompt progress events.
    pub progress: super::progress::ProgressEvents,
    pub meter: Option<Meter>,
    pub request_id: HeaderValue,
    /// The envelope of the error event a failed stream ends with.
    pub errors: ErrorShape,
    /// The snapshot the request was routed on, for an ejection.
    pub version: u64,
    /// What the request's body holds of the budget, while a continuation
    /// may need it; and its caller's share, until the stream ends.
    pub reservation: Option<super::body::Reservation>,
}

/// A streamed answer on its way to the client.
pub(crate) struct StreamBody {
    state: State,
}

// Unboxed: the body is boxed once already, by axum's `Body::new`; a box of
// the variant would be a second allocation for every stream.
#[allow(clippy::large_enum_variant)]
enum State {
    Loading(Box<Loading>),
    Streaming(Streaming),
    Ended,
}

/// A cold load under way: a note each second until the answer's head.
struct Loading {
    answer: Boxed<Result<StreamBody, ApiError>>,
    ticker: tokio::time::Interval,
    started: tokio::time::Instant,
    awaited: Awaited,
    meter: Option<Meter>,
    errors: ErrorShape,
}

/// What a stream whose answer is still to come waits for, as its notes say.
pub(crate) enum Awaited {
    /// `model` loading on `node`; `evicts`: the node unloads another model
    /// to load it.
    Load { model: String, node: String, evicts: bool },
    /// A free slot for `model`, in the data plane's queue.
    Slot { model: String },
}

/// A node's stream, passed on.
struct Streaming {
    inner: NodeBody,
    /// Counts the stream against its node until it ends.
    guard: InFlight,
    endpoint: Arc<Endpoint>,
    event_stream: bool,
    status: u16,
    /// The stream's first bytes, kept where its usage is partly there.
    head: Option<Vec<u8>>,
    /// Holds the first bytes back until the first event is whole, to put
    /// the kind's opening event (`message_start`) ahead where the node left
    /// it out; `None` once done, or where not needed.
    opening: Option<super::opening::Opening>,
    /// A Responses stream's events, their fields filled in.
    responses: Option<super::responses::EventFields>,
    tail: Vec<u8>,
    /// A partial event, where events are read whole.
    events: super::sse::Events,
    /// Reads the prompt progress events, until the first other event.
    progress: Option<super::progress::Progress>,
    /// The node's body has ended (what is left of it is being passed on).
    inner_done: bool,
    hard_stop: Pin<Box<WaitForCancellationFutureOwned>>,
    plan: Plan,
    /// Where the stream may go on: the nodes left, and what it said so far.
    continuing: Option<Box<Continuing>>,
    /// The request's span ends with the stream, not with its headers.
    span: tracing::Span,
    ended: bool,
}

/// A stream that may go on at another node if it breaks.
struct Continuing {
    continuation: Arc<Continuation>,
    /// The nodes left to ask.
    left: Hops,
    /// What the stream said so far, and in how many chunks.
    partial: String,
    generated: u64,
    continued: bool,
    /// The next nodes being asked to continue.
    asking: Option<Boxed<(Option<OpenStream>, Hops)>>,
}

impl StreamBody {
    /// The body of a stream whose head passed, and the head it goes with;
    /// it ends early when `hard_stop` is cancelled. `continuing`: what it
    /// needs to go on elsewhere, and where, if it breaks.
    pub(crate) fn streaming(
        open: OpenStream,
        plan: Plan,
        hard_stop: CancellationToken,
        continuing: Option<(Arc<Continuation>, Hops)>,
    ) -> (http::response::Parts, StreamBody) {
        let OpenStream { parts, body, guard, endpoint } = open;
        let event_stream = super::sse::is_event_stream(&parts.headers);
        let mut plan = plan;
        let opening = plan.opening.take().filter(|_| event_stream && parts.status.is_success());
        let responses = plan.responses.take().filter(|_| event_stream && parts.status.is_success());
        let continuing =
            continuing.filter(|(_, left)| event_stream && left.peek().is_some()).map(|(continuation, left)| {
                Box::new(Continuing {
                    continuation,
                    left,
                    partial: String::new(),
                    generated: 0,
                    continued: false,
                    asking: None,
                })
            });
        let streaming = Streaming {
            inner: body,
            guard,
            endpoint,
            event_stream,
            status: parts.status.as_u16(),
            head: plan.meter.as_ref().filter(|m| m.reads_head()).map(|_| Vec::new()),
            opening,
            responses,
            tail: Vec::new(),
            events: super::sse::Events::default(),
            progress: super::progress::Progress::new(plan.progress).filter(|_| event_stream),
            inner_done: false,
            hard_stop: Box::pin(hard_stop.cancelled_owned()),
            plan,
            continuing,
            span: tracing::Span::current(),
            ended: false,
        };
        (parts, StreamBody { state: State::Streaming(streaming) })
    }

    /// A stream whose answer is still to come (`answer`, which runs as the
    /// body is read): a note each second, as SSE comments, of what it
    /// waits for; then the answer, or its error as the last event.
    pub(crate) fn loading(
        answer: impl Future<Output = Result<StreamBody, ApiError>> + Send + 'static,
        awaited: Awaited,
        meter: Option<Meter>,
        errors: ErrorShape,
    ) -> StreamBody {
        let mut ticker = tokio::time::interval(LOADING_NOTE_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let loading = Loading {
            answer: Box::pin(tracing::Instrument::in_current_span(answer)),
            ticker,
            started: tokio::time::Instant::now(),
            awaited,
            meter,
            errors,
        };
        StreamBody { state: State::Loading(Box::new(loading)) }
    }
}

impl http_body::Body for StreamBody {
    type Data = Bytes;
    type Error = inferyes_net::pool::BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            let polled = match &mut this.state {
                State::Ended => return Poll::Ready(None),
                State::Loading(loading) => loading.poll(cx),
                State::Streaming(streaming) => return streaming.poll(cx),
            };
            match polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Prelude::Note(note)) => return Poll::Ready(Some(Ok(Frame::data(note)))),
                Poll::Ready(Prelude::Body(body, note)) => {
                    this.state = body.state;
                    if let Some(note) = note {
                        return Poll::Ready(Some(Ok(Frame::data(note))));
                    }
                }
                Poll::Ready(Prelude::Failed(event)) => {
                    this.state = State::Ended;
                    return Poll::Ready(Some(Ok(Frame::data(event))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // Only once `poll_frame` has seen the end: an HTTP/2 answer says it
        // ends with its last data frame, and a body taken as ended is not
        // polled again, so its usage would never be recorded nor a missing
        // `[DONE]` noticed.
        match &self.state {
            State::Ended => true,
            State::Streaming(streaming) => streaming.ended,
            State::Loading(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        // Not the node's: frames may be taken out or added.
        SizeHint::default()
    }
}

/// What polling a cold load comes to: a note to send, the answer's body
/// to switch to (after a note, where there is one), or its error as the
/// stream's last event.
enum Prelude {
    Note(Bytes),
    Body(Box<StreamBody>, Option<Bytes>),
    /// The answer failed before its head: its error event, the last.
    Failed(Bytes),
}

impl Loading {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Prelude> {
        match self.answer.as_mut().poll(cx) {
            Poll::Ready(Ok(body)) => {
                // A stream let out of the queue went out without
                // `x-inferyes-node`: this names the node that serves it.
                // Named only where it can be a header value: nothing in it
                // can end the comment.
                let note = match (&self.awaited, &body.state) {
                    (Awaited::Slot { .. }, State::Streaming(streaming)) if streaming.endpoint.id_header.is_some() => {
                        Some(Bytes::from(format!(": sent to node {}\n\n", streaming.endpoint.id)))
                    }
                    _ => None,
                };
                return Poll::Ready(Prelude::Body(Box::new(body), note));
            }
            Poll::Ready(Err(error)) => {
                // The client's status was 200 long ago: the meter is told of
                // the failure here, or its drop would count a cancelled
                // request and estimate its tokens.
                if let Some(meter) = &self.meter {
                    meter.finish(error.status().as_u16(), Outcome::Error, None);
                }
                return Poll::Ready(Prelude::Failed(error.in_shape(self.errors).event()));
            }
            Poll::Pending => {}
        }
        if self.ticker.poll_tick(cx).is_pending() {
            return Poll::Pending;
        }
        let seconds = self.started.elapsed().as_secs();
        let note = match &self.awaited {
            Awaited::Load { model, node, evicts } => {
                let unloading = if *evicts { ", unloading the model it used least lately" } else { "" };
                format!(": loading model {model} on node {node}{unloading} ({seconds}s)\n\n")
            }
            Awaited::Slot { model } => format!(": waiting for a free slot for model {model} ({seconds}s)\n\n"),
        };
        Poll::Ready(Prelude::Note(Bytes::from(note)))
    }
}

type Polled = Poll<Option<Result<Frame<Bytes>, inferyes_net::pool::BodyError>>>;

impl Streaming {
    fn poll(&mut self, cx: &mut Context<'_>) -> Polled {
        if self.ended {
            return Poll::Ready(None);
        }
        if self.hard_stop.as_mut().poll(cx).is_ready() {
            return self.end(cx, Ended::Shutdown, None);
        }
        if let Some(polled) = self.poll_continuation(cx) {
            return polled;
        }
        if self.inner_done {
            return self.end(cx, Ended::Closed { complete: self.closed_complete() }, None);
        }
        loop {
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(frame) = self.pass_on(frame) {
                        return Poll::Ready(Some(Ok(frame)));
                    }
                }
                Poll::Ready(None) => return self.node_ended(cx),
                Poll::Ready(Some(Err(error))) => {
                    let complete = self.event_stream && self.checks_end() && self.ended_well();
                    return self.end(cx, Ended::Failed { complete }, Some(error));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// While a broken stream asks the nodes left to continue it: the
    /// continuation's first bytes (a note saying where it went on), or
    /// the error that none could. `None` when it is not asking.
    fn poll_continuation(&mut self, cx: &mut Context<'_>) -> Option<Polled> {
        let continuing = self.continuing.as_mut()?;
        let asking = continuing.asking.as_mut()?;
        let Poll::Ready((next, left)) = asking.as_mut().poll(cx) else { return Some(Poll::Pending) };
        continuing.asking = None;
        continuing.left = left;
        let Some(OpenStream { body, guard, endpoint, .. }) = next else {
            let error = ApiError::new(
                inferyes_proto::ErrorKind::Upstream,
                format!("node `{}` failed in the middle of the stream and no node could continue it", self.endpoint.id),
                ErrorCode::UpstreamBroken,
            )
            .in_shape(self.plan.errors);
            self.finish(Outcome::Broken);
            self.ended = true;
            return Some(Poll::Ready(Some(Ok(Frame::data(error.event())))));
        };
        continuing.continuation.metrics.continuations.inc();
        let note = format!(
            ": continued on node {} after node {} broke ({} chunks in)\n\n",
            endpoint.id, self.endpoint.id, continuing.generated
        );
        continuing.continued = true;
        // What the first node said of the prompt is not the stream's now.
        self.progress = None;
        if let Some(meter) = &self.plan.meter {
            meter.forget_progress();
        }
        self.guard = guard;
        self.endpoint = endpoint;
        self.inner = body;
        self.inner_done = false;
        self.events = super::sse::Events::default();
        self.tail.clear();
        Some(Poll::Ready(Some(Ok(Frame::data(Bytes::from(note))))))
    }

    /// A frame from the node as the client gets it, counted and kept for
    /// the stream's end on the way; `None` while it is held (part of an
    /// event the next frames complete, or one the client does not get).
    fn pass_on(&mut self, mut frame: Frame<Bytes>) -> Option<Frame<Bytes>> {
        let Some(data) = frame.data_ref() else { return Some(frame) };
        if let Some(meter) = &self.plan.meter {
            if self.event_stream {
                meter.frame(|| super::sse::carries_output(data));
            }
            // One event, one token: an estimate for streams that say
            // nothing of their usage.
            meter.data_events(super::sse::count_data_events(data));
        }
        if let Some(head) = self.head.as_mut().filter(|head| head.len() < HEAD_BYTES) {
            let room = HEAD_BYTES - head.len();
            head.extend_from_slice(&data[..data.len().min(room)]);
        }
        self.tail.extend_from_slice(data);
        if self.tail.len() > 2 * TAIL_BYTES {
            self.tail.drain(..self.tail.len() - TAIL_BYTES);
        }
        if let Some(progress) = self.progress.as_mut() {
            let meter = self.plan.meter.as_ref();
            let passed = progress.push(data.clone(), |seen| {
                if let Some(meter) = meter {
                    match seen {
                        super::progress::Noticed::Progress(read) => meter.no_token(read),
                        super::progress::Noticed::NoToken => meter.no_token(None),
                    }
                }
            });
            frame = match passed {
                super::progress::Passed::Held => return None,
                super::progress::Passed::On(kept) => Frame::data(kept),
                super::progress::Passed::Last(kept) => {
                    self.progress = None;
                    Frame::data(kept)
                }
            };
        }
        let Some(data) = frame.data_ref() else { return Some(frame) };
        if let Some(opening) = self.opening.as_mut() {
            let opened = opening.push(data)?;
            self.opening = None;
            frame = Frame::data(opened);
        }
        if let Some(responses) = self.responses.as_mut() {
            let Some(data) = frame.data_ref() else { return Some(frame) };
            frame = Frame::data(responses.push(data)?);
        }
        let Some(data) = frame.data_ref() else { return Some(frame) };
        if self.continuing.is_some() {
            // Read event by event, for what was said so far.
            return self.read_events(data).map(Frame::data);
        }
        if self.plan.strip_usage && self.event_stream {
            // Whole events only, without the usage chunk the client did
            // not ask for.
            return self.events.without_usage(data.clone()).map(Frame::data);
        }
        Some(frame)
    }

    /// The node's body ended: what it left unfinished passed on as it is,
    /// then the stream's end.
    fn node_ended(&mut self, cx: &mut Context<'_>) -> Polled {
        self.inner_done = true;
        // A progress event cut short: passed on as it is.
        if let Some(held) = self.progress.take().and_then(|mut progress| progress.take_rest()) {
            return Poll::Ready(Some(Ok(Frame::data(held))));
        }
        // A first event cut short: passed on as it is.
        if let Some(held) = self.opening.take().and_then(|mut opening| opening.take_rest()) {
            return Poll::Ready(Some(Ok(Frame::data(held))));
        }
        if let Some(held) = self.responses.take().and_then(|mut responses| responses.take_rest()) {
            return Poll::Ready(Some(Ok(Frame::data(held))));
        }
        let complete = self.closed_complete();
        // A last event without its blank line: passed on as it is, unless
        // the stream goes on elsewhere.
        if !self.events.is_empty() && (self.continuing.is_none() || complete) {
            return Poll::Ready(Some(Ok(Frame::data(self.events.take_rest()))));
        }
        self.end(cx, Ended::Closed { complete }, None)
    }

    /// The whole events `data` completes, as passed on to a stream that
    /// may be continued: what they say kept for a continuation, the
    /// usage-only chunk and a continued stream's second preamble left out.
    fn read_events(&mut self, data: &[u8]) -> Option<Bytes> {
        let continuing = self.continuing.as_mut()?;
        let mut kept: Vec<Bytes> = Vec::new();
        for event in self.events.push(data) {
            if self.plan.strip_usage && super::sse::is_usage_only_event(&event) {
                continue;
            }
            match continuation::read(&event) {
                continuation::Event::Chunk { preamble: true, .. } if continuing.continued => continue,
                continuation::Event::Chunk { content: Some(content), .. } => {
                    continuing.partial.push_str(&content);
                    continuing.generated += 1;
                }
                _ => {}
            }
            kept.push(event);
        }
        // A frame is most often one event: passed on without a copy.
        match kept.len() {
            0 => None,
            1 => kept.pop(),
            _ => Some(kept.concat().into()),
        }
    }

    /// The stream's end, as [`classify_end`] judges it; `failure`, the
    /// node's connection's, where it failed.
    fn end(&mut self, cx: &mut Context<'_>, end: Ended, failure: Option<inferyes_net::pool::BodyError>) -> Polled {
        let span = self.span.clone();
        let _entered = span.enter();
        let continuable = self.continuing.as_ref().is_some_and(|continuing| continuing.left.peek().is_some());
        let witness = Witness { request_id: &self.plan.request_id, version: self.plan.version };
        let verdict = classify_end(end, self.event_stream, continuable);
        let observed = match &verdict {
            // Its head said already that the node answered: a stream
            // ending well ends no ejection that other requests' failures
            // earned it since.
            EndVerdict::Done => Observed::Unjudged,
            EndVerdict::Continue => Observed::Failed { what: "broke mid-stream; continuing elsewhere", eject: true },
            EndVerdict::Fail { eject: true, .. } | EndVerdict::Cut { eject: true } => {
                Observed::Failed { what: "failed mid-stream", eject: true }
            }
            EndVerdict::Fail { error: UpstreamError::StreamCut, .. } => {
                Observed::Failed { what: "ended a stream before its end event", eject: false }
            }
            EndVerdict::Fail { .. } | EndVerdict::Cut { .. } => Observed::Unjudged,
        };
        self.endpoint.observe(observed, witness);
        let error = match verdict {
            EndVerdict::Done => {
                self.ended = true;
                self.finish(Outcome::Ok);
                return Poll::Ready(None);
            }
            EndVerdict::Continue => match self.continuing.as_mut() {
                Some(continuing) => {
                    let left = std::mem::take(&mut continuing.left);
                    let continuation = Arc::clone(&continuing.continuation);
                    let asking =
                        continuation::continue_on(continuation, left, continuing.partial.clone(), continuing.generated);
                    continuing.asking = Some(Box::pin(tracing::Instrument::instrument(asking, span.clone())));
                    drop(_entered);
                    return self.poll(cx);
                }
                // Resumable only with nodes left: never here.
                None => Some(UpstreamError::StreamBroken),
            },
            EndVerdict::Fail { error, .. } => Some(error),
            EndVerdict::Cut { .. } => None,
        };
        self.ended = true;
        self.finish(Outcome::Broken);
        match (error, failure) {
            (Some(error), _) if self.event_stream => {
                Poll::Ready(Some(Ok(Frame::data(error.into_api(&self.endpoint.id).in_shape(self.plan.errors).event()))))
            }
            // No event can tell the client: the connection is cut, as the
            // node's was.
            (_, Some(failure)) => Poll::Ready(Some(Err(failure))),
            _ => Poll::Ready(None),
        }
    }

    /// Whether a stream its node closed ended as a whole answer does.
    fn closed_complete(&self) -> bool {
        !(self.event_stream && self.checks_end()) || self.ended_well()
    }

    /// Whether the stream's kind says how it ends.
    fn checks_end(&self) -> bool {
        self.plan.stream_end != inferyes_proto::kinds::StreamEnd::Own
    }

    /// Whether the last bytes are how the stream's kind ends.
    fn ended_well(&self) -> bool {
        match self.plan.stream_end {
            inferyes_proto::kinds::StreamEnd::Done => super::sse::ended_well(&self.tail),
            inferyes_proto::kinds::StreamEnd::Event(name) => super::sse::ended_with_event(&self.tail, name),
            inferyes_proto::kinds::StreamEnd::Own => true,
        }
    }

    fn finish(&self, outcome: Outcome) {
        self.finish_as(self.status, outcome);
    }

    fn finish_as(&self, status: u16, outcome: Outcome) {
        if let Some(meter) = &self.plan.meter {
            // A continued answer's usage is partly the first node's: it is
            // estimated (prompt from the request, one token per event).
            let continued = self.continuing.as_ref().is_some_and(|continuing| continuing.continued);
            let usage =
                if continued { None } else { meter.usage(self.head.as_deref().unwrap_or_default(), &self.tail) };
            // A continued answer's timings are the last node's part only: its
            // nodes' time is counted from when it was first sent.
            if !continued {
                meter.timed(&self.tail);
            }
            meter.finish(status, outcome, usage);
        }
    }
}

impl Drop for Streaming {
    /// A client that hangs up before the end: what the tail says of the
    /// usage (a stream's usage chunk may have come before the client went)
    /// is kept, not estimated from nothing.
    fn drop(&mut self) {
        if !self.ended {
            self.finish_as(499, Outcome::Cancelled);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body_util::BodyExt;

    use super::*;
    use crate::usage::Ledger;

    const CONTENT: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"},\"finish_reason\":null}]}\n\n";
    const USAGE: &str =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    /// A node's streamed answer of `frames`, over an in-memory connection.
    async fn answer(frames: Vec<&'static str>) -> OpenStream {
        let (client, server) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |_request: http::Request<hyper::body::Incoming>| {
                let frames = frames.clone();
                async move {
                    let chunks: Vec<Result<Frame<Bytes>, Infallible>> =
                        frames.iter().map(|f| Ok(Frame::data(Bytes::from_static(f.as_bytes())))).collect();
                    let body = http_body_util::StreamBody::new(tokio_stream::iter(chunks));
                    Ok::<_, Infallible>(
                        http::Response::builder().header("content-type", "text/event-stream").body(body).unwrap(),
                    )
                }
            });
            let io = hyper_util::rt::TokioIo::new(server);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(client)).await.unwrap();
        tokio::spawn(connection);
        let request = http::Request::builder().uri("/").body(http_body_util::Full::new(Bytes::new())).unwrap();
        let response = sender.send_request(request).await.unwrap();
        let pool = inferyes_net::pool::Pool::<http_body_util::Full<Bytes>>::new(inferyes_net::pool::Settings {
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            tls: None,
            read_timeout: Duration::from_secs(5),
            idle_limits: inferyes_net::pool::IdleLimits::default(),
        });
        let (parts, body) = response.into_parts();
        let states = crate::targets::NodeStates::default();
        let url = inferyes_net::base_url::BaseUrl::new("http://node-a");
        let endpoint = Arc::new(states.endpoint(&Arc::from("node-a"), url, false, true, 1));
        OpenStream { parts, body: pool.unpooled(body), guard: endpoint.enter(None), endpoint }
    }

    /// The body of `frames`, metered for key `k` into the ledger returned.
    async fn body(frames: Vec<&'static str>) -> (StreamBody, Arc<Ledger>) {
        body_of(frames, inferyes_proto::kinds::row("/v1/chat/completions").unwrap()).await
    }

    /// The same, as an answer on `row`'s path.
    async fn body_of(frames: Vec<&'static str>, row: &inferyes_proto::kinds::Row) -> (StreamBody, Arc<Ledger>) {
        let ledger = Ledger::new("test", true);
        let meter = Meter::new(
            Arc::clone(&ledger),
            "req",
            Some("k".into()),
            "m".into(),
            true,
            crate::usage::Counted { usage: row.usage, prompt_estimate: 1_000, output_limit: 0 },
            None,
        );
        let plan = Plan {
            opening: super::super::opening::Opening::new(row.stream_start, "m", "req", 1_000),
            responses: None,
            stream_end: row.stream_end,
            strip_usage: row.asks_usage,
            progress: if row.asks_progress {
                super::super::progress::ProgressEvents::Taken
            } else {
                super::super::progress::ProgressEvents::Ignored
            },
            meter: Some(meter),
            request_id: HeaderValue::from_static("req"),
            errors: row.errors,
            version: 1,
            reservation: None,
        };
        let (_, body) = StreamBody::streaming(answer(frames).await, plan, CancellationToken::new(), None);
        (body, ledger)
    }

    async fn text(body: StreamBody) -> String {
        String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_stream_goes_on_without_the_usage_chunk_it_was_asked_for_and_is_metered_by_it() {
        let (body, ledger) = body(vec![CONTENT, USAGE, DONE]).await;
        assert_eq!(text(body).await, format!("{CONTENT}{DONE}"));
        assert_eq!(ledger.unacknowledged_tokens("k"), 11, "the backend's own count");
    }

    #[tokio::test]
    async fn a_stream_its_node_ends_early_ends_with_an_error_event() {
        let (body, _) = body(vec![CONTENT]).await;
        let text = text(body).await;
        assert!(text.starts_with(CONTENT), "{text}");
        assert!(text.ends_with("\n\n") && text.contains("\"code\":\"upstream_broken\""), "{text}");
    }

    #[tokio::test]
    async fn a_messages_stream_that_ends_before_message_stop_ends_with_anthropic_s_error_event() {
        const DELTA: &str = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\"}\n\n";
        const STOP: &str = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        const START: &str = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n";
        let messages = inferyes_proto::kinds::row("/v1/messages").unwrap();
        let (whole, _) = body_of(vec![START, DELTA, STOP], messages).await;
        assert_eq!(text(whole).await, format!("{START}{DELTA}{STOP}"));
        let (cut, _) = body_of(vec![START, DELTA], messages).await;
        let cut = text(cut).await;
        let error = cut.strip_prefix(&format!("{START}{DELTA}")).unwrap_or_else(|| panic!("{cut}"));
        let data = error.strip_prefix("event: error\ndata: ").unwrap_or_else(|| panic!("{cut}"));
        let data: serde_json::Value = serde_json::from_str(data.trim_end()).unwrap();
        assert_eq!(
            (data["type"].as_str(), data["error"]["type"].as_str()),
            (Some("error"), Some("api_error")),
            "{cut}"
        );
    }

    #[tokio::test]
    async fn a_messages_stream_its_node_started_without_message_start_gets_one_first() {
        const BLOCK: &str = "event: content_block_start\ndata: {\"type\":\"content_block_start\"}\n\n";
        const DELTA: &str =
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":8}}\n\n";
        const STOP: &str = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let messages = inferyes_proto::kinds::row("/v1/messages").unwrap();
        let (body, ledger) = body_of(vec![BLOCK, DELTA, STOP], messages).await;
        let opened = text(body).await;
        let rest = opened.strip_prefix("event: message_start\ndata: ").unwrap_or_else(|| panic!("{opened}"));
        let (start, rest) = rest.split_once("\n\n").unwrap();
        let start: serde_json::Value = serde_json::from_str(start).unwrap();
        assert_eq!(start["message"]["usage"]["input_tokens"], 1_000, "the prompt as the ledger counts it");
        assert_eq!(rest, format!("{BLOCK}{DELTA}{STOP}"), "then the stream as it came");
        // Estimated throughout, as is every stream that says nothing of its
        // prompt: the same prompt, and an output token per event.
        assert_eq!(ledger.unacknowledged_tokens("k"), 1_003);
        // One that opens with it goes on untouched.
        let start =
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5}}}\n\n";
        let (body, ledger) = body_of(vec![start, BLOCK, DELTA, STOP], messages).await;
        assert_eq!(text(body).await, format!("{start}{BLOCK}{DELTA}{STOP}"));
        assert_eq!(ledger.unacknowledged_tokens("k"), 13);
    }

    #[tokio::test]
    async fn a_client_that_hangs_up_after_the_usage_went_by_is_metered_by_it() {
        let (mut body, ledger) = body(vec![CONTENT, USAGE, DONE]).await;
        let mut seen = String::new();
        while !seen.contains("[DONE]") {
            let frame = body.frame().await.unwrap().unwrap();
            seen.push_str(std::str::from_utf8(frame.data_ref().unwrap()).unwrap());
        }
        drop(body);
        assert_eq!(ledger.unacknowledged_tokens("k"), 11, "the usage in the tail, not an estimate");
    }

    #[tokio::test]
    async fn a_client_that_hangs_up_after_the_first_token_is_metered_by_the_prompt_the_server_read() {
        const PROGRESS: [&str; 2] = [
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}],\"prompt_progress\":{\"total\":818,\"cache\":18,\"processed\":18,\"time_ms\":0}}\n\n",
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}],\"prompt_progress\":{\"total\":818,\"cache\":18,\"processed\":818,\"time_ms\":9}}\n\n",
        ];
        const ROLE: &str = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n";
        let (mut cut, ledger) = body(vec![PROGRESS[0], PROGRESS[1], ROLE, CONTENT, CONTENT, DONE]).await;
        let first = cut.frame().await.unwrap().unwrap();
        assert_eq!(first.data_ref().unwrap(), ROLE, "the progress the data plane asked for is not the client's");
        let token = cut.frame().await.unwrap().unwrap();
        assert_eq!(token.data_ref().unwrap(), CONTENT);
        drop(cut);
        // 818 read (18 of them from the cache), and the one token sent (the
        // role chunk is none).
        assert_eq!(ledger.unacknowledged_tokens("k"), 819, "the server's count, not the body's estimate");
        // Without it: the estimate.
        let (mut cut, ledger) = body(vec![CONTENT, CONTENT, DONE]).await;
        cut.frame().await.unwrap().unwrap();
        drop(cut);
        assert_eq!(ledger.unacknowledged_tokens("k"), 1_001);
    }
}
