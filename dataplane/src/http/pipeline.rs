//! One inference request, through its phases in order: authenticate, read
//! the routing view, admit (the key's models, rate and budget), route,
//! attempt each target ([`super::attempt`]), stream the answer
//! ([`super::answer`]), record. [`Exchange`] is the request's context,
//! carried through every phase; what it learns on the way is what the
//! record says.

use std::net::IpAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, header};
use inferyes_proto::ErrorKind;
use inferyes_proto::kinds::{ModelIn, Row, Session};
use inferyes_proto::v1::RoutingDecision;

use super::AppState;
use super::answer::{Awaited, Plan, StreamBody};
use super::attempt::{Answer, Attempts, Hops, NODE_HEADER, OpenStream, Outbound, ROUTE_HEADER, SessionTurn};
use super::body::Full;
use super::classify::Purpose;
use super::client::{Facts, upstream_headers};
use super::continuation::Continuation;
use super::opening::Opening;
use super::progress::ProgressEvents;
use super::responses::EventFields;
use super::view::{
    RoutingView, estimated_prompt_tokens, least_prompt_tokens, metered_prompt_estimate, parse_request_view,
    session_key, with_model, with_usage_requested,
};
use crate::auth::Caller;
use crate::error::{ApiError, ErrorCode};
use crate::queue::{Ask, Queue, Turn};
use crate::routing::{self, Route, RouteReason, RouteRequest, Weighed};
use crate::snapshot::RoutingSnapshot;
use crate::targets::InFlight;
use crate::usage::{Meter, Served};
use crate::waiting::{Class, Entry, Refused};

/// Serves one inference request and records it.
pub(crate) async fn inference(
    state: Arc<AppState>,
    row: &'static Row,
    request: http::Request<hyper::body::Incoming>,
    request_id: HeaderValue,
    client: IpAddr,
) -> Response {
    let span = tracing::info_span!(
        target: inferyes_net::telemetry::SPAN_TARGET,
        "request",
        otel.name = request.uri().path(),
        otel.kind = "server",
        request_id = super::id_text(&request_id),
        model = tracing::field::Empty,
        node = tracing::field::Empty,
        route = tracing::field::Empty,
        // The first target's cost, term by term (routing::cost).
        cost.ms = tracing::field::Empty,
        cost.wait_ms = tracing::field::Empty,
        cost.prefill_ms = tracing::field::Empty,
        cost.carry_ms = tracing::field::Empty,
        cost.move_ms = tracing::field::Empty,
        cost.cached_tokens = tracing::field::Empty,
        cost.queue_ahead = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    inferyes_net::telemetry::continue_trace(&span, request.headers());
    let mut exchange = Exchange {
        state: &state,
        row,
        request_id,
        client,
        started: std::time::Instant::now(),
        facts: RequestFacts::default(),
        held: None,
    };
    // The request's work, boxed where it is made: the futures around it
    // (the span's, this one, the edge's, the connection's box) then move a
    // pointer, not its few kilobytes, each time one is built.
    let served = tracing::Instrument::instrument(Box::pin(exchange.serve(request)), span.clone()).await;
    let response = match served {
        Ok(response) => response,
        Err(error) => {
            exchange.facts.error_code = error.code_str().map(str::to_string);
            // A node that timed out or broke off may have generated for
            // minutes: its work is counted, estimated, not dropped.
            use crate::error::{Code, ErrorCode};
            exchange.facts.node_worked = matches!(
                error.code,
                Some(Code::Gateway(
                    ErrorCode::UpstreamTimeout | ErrorCode::UpstreamBroken | ErrorCode::UpstreamAnswerTooLarge
                ))
            );
            error.in_shape(row.errors).into_response()
        }
    };
    exchange.record(&span, response)
}

/// One request's context through its phases.
struct Exchange<'s> {
    state: &'s Arc<AppState>,
    /// The path's row of the kinds table.
    row: &'static Row,
    request_id: HeaderValue,
    client: IpAddr,
    started: std::time::Instant,
    facts: RequestFacts,
    /// The request's body, held against the budget until it is answered.
    held: Option<super::body::Reservation>,
}

/// What the metrics and the decision tail need to know of a request once
/// it is answered.
#[derive(Default)]
struct RequestFacts {
    /// The model asked for, resolved where it is an alias.
    model: String,
    /// The fleet knows it (else its metrics label is `_unknown`, so client
    /// chosen names cannot grow the label set).
    model_known: bool,
    stream: bool,
    session: Option<String>,
    error_code: Option<String>,
    key_id: Option<String>,
    /// Once the request is admitted: its usage record.
    meter: Option<crate::usage::Meter>,
    /// The request failed after a node took it on (a timeout, an answer
    /// broken off): its prompt was read, and tokens perhaps generated.
    node_worked: bool,
}

/// A request as its nodes are sent it.
struct Prepared {
    path_and_query: PathAndQuery,
    headers: HeaderMap,
    body: Bytes,
    /// The body asks for usage the client did not ask for: its chunk is
    /// taken out of the stream.
    strip_usage: bool,
    /// What is done with llama-server's prompt progress events; `Taken`:
    /// they are asked for, of the nodes that send them.
    progress: ProgressEvents,
    /// The body is a form, not JSON.
    form: bool,
}

impl<'s> Exchange<'s> {
    async fn serve(&mut self, request: http::Request<hyper::body::Incoming>) -> Result<Response, ApiError> {
        let (parts, body) = request.into_parts();
        let snapshot = self.state.snapshots.current().ok_or_else(ApiError::not_ready)?;
        let caller = self.state.authenticate(&parts.headers, self.client, &snapshot).await?;
        self.facts.key_id = caller.key_id().map(str::to_string);
        let class = priority(&caller, &parts.headers)?;
        let share = self.state.take_share(&caller)?;
        let mut held = super::body::Budget::reservation(self.state.forwarder.budget(), share.as_ref());
        let body = read_body(body, &parts.headers, self.state, &mut held).await?;
        self.held = Some(held);
        if self.row.model == ModelIn::Multipart && parts.uri.query().is_some() {
            // The server behind may read a `model` there before the form's
            // (Go's `FormValue` does), not the one checked here.
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                "an upload takes no query string: name the model in the form",
                ErrorCode::InvalidPath,
            ));
        }
        let view = parse_request_view(self.row, &parts.headers, &body)?;
        let model = snapshot.resolve(&view.model);
        let rate = self.admit(&caller, &snapshot, &view, model, body.len())?;
        self.hold_slot(&caller, model);
        let prepared = self.prepare(parts, body, &view, model, &caller);
        let answered = match self.route(&snapshot, &view, model, prepared.body.len()) {
            Ok(mut route) => match self.state.queue.clone() {
                Some(queue) if route.waits || queue.holds_any() || !self.try_start() => {
                    self.queued(&queue, (&caller, class), (&snapshot, route), model, prepared, &view).await
                }
                // The gateway decides who waits: a request it sends on holds
                // its slot from here, or waits where another took it.
                Some(queue) => match crate::queue::take_slot(&snapshot, model, &route) {
                    Ok(reserved) => self.answer(&snapshot, route, reserved, model, prepared, &view).await,
                    Err(crate::queue::SlotTaken) => {
                        self.unstart();
                        route.waits = true;
                        self.queued(&queue, (&caller, class), (&snapshot, route), model, prepared, &view).await
                    }
                },
                None => self.answer(&snapshot, route, None, model, prepared, &view).await,
            },
            Err(error) => Err(error),
        };
        match answered {
            Ok(mut response) => {
                response.headers_mut().extend(rate);
                Ok(response)
            }
            Err(mut error) => {
                error.headers.extend(rate);
                Err(error)
            }
        }
    }

    /// Counts a keyed request in its flow's share of `model`'s slots
    /// ([`crate::slot_shares`]) for as long as its reservation lives: a
    /// stream, to its end.
    fn hold_slot(&mut self, caller: &Caller, model: &str) {
        let (Caller::Key(grant), Some(held)) = (caller, self.held.as_mut()) else { return };
        let weight = grant.weight.clamp(1, inferyes_proto::apikey::MAX_WEIGHT);
        held.keep_slot(Arc::new(self.state.slot_shares.hold(&keyed_flow(grant), model, weight)));
    }

    fn slot(&self) -> Option<&Arc<crate::slot_shares::Hold>> {
        self.held.as_ref()?.slot()
    }

    /// Counts the request running in its flow's share, where the flow may
    /// have one more running here now: it goes to a node.
    fn try_start(&self) -> bool {
        self.slot().is_none_or(|slot| slot.try_start(std::time::Instant::now()))
    }

    /// Counts it no longer running: the slot it was to take was taken.
    fn unstart(&self) {
        if let Some(slot) = self.slot() {
            slot.unstart();
        }
    }

    /// Whether the caller may have `model` now: it may use it, the fleet
    /// has it, and the key's rate and budget allow. Returns the key's rate
    /// headers (none without a rate) and makes the request's meter, which
    /// records its usage from here on.
    fn admit(
        &mut self,
        caller: &Caller,
        snapshot: &RoutingSnapshot,
        view: &RoutingView,
        model: &str,
        body_len: usize,
    ) -> Result<Vec<(http::HeaderName, HeaderValue)>, ApiError> {
        if !caller.may_use(&view.model) && !caller.may_use(model) {
            return Err(ApiError::no_such_model(&view.model));
        }
        self.facts.model = model.to_string();
        self.facts.stream = view.stream;
        if snapshot.placements(model).is_none() {
            // Checked before the meter is made, as routing checks it: the
            // usage ledger holds the fleet's models only, not every name a
            // client sends.
            return Err(routing::model_not_found(snapshot, model, |entry| caller.may_see(entry)).into());
        }
        self.facts.model_known = true;
        let state: &AppState = self.state;
        let part = match caller {
            Caller::Key(grant) => state.allowances.requests_per_minute(grant),
            Caller::Open => 0,
        };
        let rate = state.auth.admit(caller, part, std::time::Instant::now()).map_err(|(r, e)| state.refused(r, e))?;
        // What the request may use, held against the key's daily budget
        // while it runs, so that requests at once cannot each spend what
        // is left: its body's bytes (no prompt has more tokens) and its
        // limit, or the model's window where it sets none.
        // The model's window is looked up only for a request that sets no
        // limit.
        let limit = view.max_tokens.unwrap_or_else(|| {
            let window = snapshot.model(model).map_or(0, |entry| u64::from(entry.context_window));
            if window > 0 { window } else { DEFAULT_TOKEN_LIMIT }
        });
        let mut held = crate::usage::Hold::default();
        if let Caller::Key(grant) = caller
            && grant.tokens_per_day > 0
        {
            let tokens = (body_len as u64).saturating_add(limit);
            let today = snapshot.tokens_today(&grant.key_id);
            let forget_before = state.allowances.forget_acknowledged_before(std::time::Instant::now());
            let part = state.allowances.budget(grant, today > 0);
            let budget = (grant.tokens_per_day, today);
            match state.ledger.hold(&grant.key_id, budget, tokens, part, forget_before) {
                Ok(hold) => held = hold,
                Err(unheld) => {
                    if let crate::usage::Unheld::PartHeld { tokens, .. } = unheld {
                        state.allowances.refused_tokens(&grant.key_id, tokens);
                    }
                    let error = budget_refusal(grant.tokens_per_day, unheld);
                    return Err(state.refused(crate::auth::Refusal::TokenBudget, error));
                }
            }
        }
        let meter = crate::usage::Meter::new(
            Arc::clone(&state.ledger),
            super::id_text(&self.request_id),
            caller.key_id().map(str::to_string),
            model.to_string(),
            view.stream,
            crate::usage::Counted {
                usage: self.row.usage,
                prompt_estimate: u64::from(metered_prompt_estimate(body_len)),
                // A batch generates nothing.
                output_limit: if inferyes_proto::kinds::is_batch(self.row.kind) { 0 } else { limit },
            },
            view.stream.then(|| {
                let labels = crate::metrics::ModelLabels { model: model.to_string() };
                crate::usage::StreamTimers {
                    first_token: state.metrics.first_token_seconds.get_or_create(&labels).clone(),
                    whole: state.metrics.stream_seconds.get_or_create(&labels).clone(),
                }
            }),
        );
        meter.holds(held);
        self.facts.meter = Some(meter);
        Ok(rate.to_vec())
    }

    /// The request as nodes get it: an alias resolved in the body, usage
    /// asked for where a stream would end without it; its session key,
    /// scoped by `caller`.
    fn prepare(
        &mut self,
        parts: http::request::Parts,
        body: Bytes,
        view: &RoutingView,
        model: &str,
        caller: &Caller,
    ) -> Prepared {
        let body = if model == view.model { body } else { with_model(&body, view, model) };
        // A stream that would end without usage is asked for it; the
        // client, which did not ask, does not see the extra chunk.
        let wants_usage = view.stream && self.row.asks_usage && !view.has_stream_options;
        let (body, strip_usage) = match wants_usage.then(|| with_usage_requested(&body)).flatten() {
            Some(spliced) => (spliced, true),
            None => (body, false),
        };
        // Kept in the request's facts (the decision tail shows it, whatever
        // becomes of the request) and read from there.
        // Scoped by the caller: one tenant's conversation is never
        // another's, whatever key either sends or derives.
        self.facts.session = if self.row.session == Session::None {
            None
        } else {
            session_key(&parts.headers, view, caller.session_scope())
        };
        // Likewise the prompt's progress, where the node's server tells it:
        // a stream cut short is then counted for the prompt read.
        let progress = match (view.stream && self.row.asks_progress, view.has_return_progress) {
            (false, _) => ProgressEvents::Ignored,
            (true, true) => ProgressEvents::Read,
            (true, false) => ProgressEvents::Taken,
        };
        let path_and_query = parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        Prepared { path_and_query, headers: parts.headers, body, strip_usage, progress, form: view.in_form }
    }

    fn route(
        &self,
        snapshot: &RoutingSnapshot,
        view: &RoutingView,
        model: &str,
        body_len: usize,
    ) -> Result<Route, ApiError> {
        let window = snapshot.model(model).map_or(0, |entry| u64::from(entry.context_window));
        let least = least_prompt_tokens(body_len, view);
        if window > 0 && least > window {
            let message = format!(
                "the prompt ({body_len} bytes, at least {least} tokens for any tokenizer) does not fit the context \
                 window of `{model}` (at most {window} tokens on any node)"
            );
            return Err(
                ApiError::new(ErrorKind::BadRequest, message, ErrorCode::ContextLengthExceeded).param("messages")
            );
        }
        let ticket = self.state.tickets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let request = RouteRequest {
            model,
            kind: self.row.kind,
            session: self.facts.session.as_deref(),
            prompt_tokens: estimated_prompt_tokens(body_len, view),
            mode: self.state.mode,
            carry: self.state.carry,
            ticket,
            now_ms: inferyes_proto::unix_ms(),
        };
        Ok(routing::select(snapshot, snapshot.local(), &request)?)
    }

    /// A request no node can start now (or any while others wait), through
    /// the queue: let in (or refused, 429 past its flow's share), then
    /// answered once a node can start it, routed as it leaves. A stream
    /// that waits past [`QUIET_WAIT`] is answered at once, with a note
    /// each second while it waits. `route`: where it would go now; one
    /// that need not wait is not refused by the queue's bounds, but sent
    /// on, as long as its slot is still free as it goes.
    async fn queued(
        &mut self,
        queue: &Arc<Queue>,
        (caller, class): (&Caller, Class),
        (snapshot, route): (&Arc<RoutingSnapshot>, Route),
        model: &str,
        prepared: Prepared,
        view: &RoutingView,
    ) -> Result<Response, ApiError> {
        // A tenant's keys are one flow; keyless requests, one per client
        // address, all named `_open` in metrics (addresses are not bounded).
        let (flow, flow_label, whose) = match caller {
            Caller::Key(grant) if grant.tenant.is_empty() => (keyed_flow(grant), grant.key_id.as_str(), "key"),
            Caller::Key(grant) => (keyed_flow(grant), grant.tenant.as_str(), "tenant"),
            Caller::Open => (format!("a:{}", inferyes_net::admit::peer_of(self.client)), "_open", "client"),
        };
        let prompt_tokens = estimated_prompt_tokens(prepared.body.len(), view);
        // Its cost in the fair order: its prompt (a body's bytes over four
        // where the estimate knows none, as for media) and its limit, at
        // most the model's window.
        let window = snapshot.model(model).map_or(u64::from(u32::MAX), |m| u64::from(m.context_window.max(1)));
        let prompt = u64::from(prompt_tokens).max(prepared.body.len() as u64 / 4);
        let output = view.max_tokens.unwrap_or(QUEUE_OUTPUT_ESTIMATE).min(window);
        let entry = Entry {
            flow: Arc::from(flow),
            weight: match caller {
                Caller::Key(grant) => grant.weight.clamp(1, inferyes_proto::apikey::MAX_WEIGHT),
                Caller::Open => 1,
            },
            class,
            cost: prompt.saturating_add(output),
            bytes: prepared.body.len(),
            model: Arc::from(model),
        };
        let settles = (Arc::clone(&entry.flow), entry.weight, entry.cost);
        let ask = Ask {
            kind: self.row.kind,
            session: self.facts.session.clone(),
            prompt_tokens,
            mode: self.state.mode,
            carry: self.state.carry,
            caller: caller.clone(),
            slot: self.slot().cloned(),
        };
        let entered = queue.enter(entry, ask, flow_label);
        // Let in, its flow is charged its cost: made good by what it spends.
        if let (Ok(place), Some(meter)) = (&entered, &self.facts.meter) {
            let (queue, ticket, (flow, weight, charged)) = (Arc::clone(queue), place.ticket(), settles);
            meter.settles(Box::new(move |spent| queue.settle(ticket, &flow, weight, charged, spent)));
        }
        // Sent on past the queue's bounds only while its slot is free.
        if entered.is_err() && !route.waits && self.try_start() {
            match crate::queue::take_slot(snapshot, model, &route) {
                Ok(reserved) => return self.answer(snapshot, route, reserved, model, prepared, view).await,
                Err(crate::queue::SlotTaken) => self.unstart(),
            }
        }
        let mut place = entered.map_err(|not_in| {
            let error = match not_in.why {
                Refused::Full => ApiError::overloaded("requests waiting for a free slot"),
                Refused::FlowShare => ApiError::new(
                    ErrorKind::RateLimited,
                    format!(
                        "Rate limit reached: this {whose} holds all the requests waiting for a free slot its \
                         share of the gateway's queue allows. Try again when some have been served."
                    ),
                    ErrorCode::RateLimitExceeded,
                ),
            };
            error.retry_after(not_in.retry_after_s)
        })?;
        // A stream that gets its turn soon is answered as any other; one
        // that waits longer is answered at once, with notes, while it does.
        let turn = if view.stream {
            tokio::time::timeout(QUIET_WAIT, place.turn()).await.ok()
        } else {
            Some(place.turn().await)
        };
        if let Some(turn) = turn {
            return match turn {
                Turn::Go { route, snapshot, reserved } => {
                    self.answer(&snapshot, *route, reserved, model, prepared, view).await
                }
                Turn::Refused(error) => Err(error.into()),
                Turn::TooLong { waited_ms, retry_after_s } => Err(waited_too_long(waited_ms, retry_after_s)),
                Turn::Closed => Err(shutting_down()),
            };
        }
        let snapshot = self.state.snapshots.current().ok_or_else(ApiError::not_ready)?;
        let continues = self.row.continues && snapshot.policy().continues(model) && !view.constrained;
        let (out, strip_usage, progress) = self.outbound(prepared, model, view);
        let stream = self.stream((strip_usage, progress), continues, model, snapshot.version());
        Ok(stream.queued(place, model, out))
    }

    /// The answer of the first target that gives one, streamed or whole.
    /// `reserved`: the first target's count of the request, taken with
    /// its slot ([`crate::queue::take_slot`]).
    async fn answer(
        &mut self,
        snapshot: &Arc<RoutingSnapshot>,
        route: Route,
        reserved: Option<InFlight>,
        model: &str,
        prepared: Prepared,
        view: &RoutingView,
    ) -> Result<Response, ApiError> {
        let continues = view.stream && self.row.continues && snapshot.policy().continues(model) && !view.constrained;
        let (mut out, strip_usage, progress) = self.outbound(prepared, model, view);
        let mut route = route;
        let request_id = super::id_text(&self.request_id);
        super::carry::carry(&self.state.forwarder, snapshot, &mut route, self.facts.session.as_deref(), request_id)
            .await;
        let mut hops = Hops::of(snapshot, &route, model).reserved(reserved);
        let weighed = Weighed::of(&route);
        if route.cold() && view.stream {
            tracing::debug!(
                request_id = super::id_text(&self.request_id),
                model,
                "cold load for a stream: answering at once"
            );
            let stream = self.stream((strip_usage, progress), continues, model, snapshot.version());
            return Ok(stream.cold(snapshot, &route, model, (out, hops), weighed));
        }
        let attempts = Attempts {
            forwarder: &self.state.forwarder,
            metrics: &self.state.metrics,
            request_id: &self.request_id,
            version: snapshot.version(),
            meter: self.facts.meter.as_ref(),
            share: self.held.as_ref().and_then(super::body::Reservation::share),
            weighed: &weighed,
        };
        let answered = attempts.run(&mut out, &mut hops, Purpose::First).await;
        let request_id = super::id_text(&self.request_id);
        match &answered {
            Ok(_) => tracing::debug!(request_id, model, route = route.reason.as_str(), "request routed"),
            Err(error) => tracing::debug!(request_id, model, code = ?error.code_str(), "request failed"),
        }
        Ok(match answered? {
            Answer::Whole(response) => response,
            Answer::Stream(open) => {
                let stream = self.stream((strip_usage, progress), continues, model, snapshot.version());
                let (parts, body) = stream.body(open, hops, out);
                Response::from_parts(parts, Body::new(body))
            }
        })
    }

    /// The request as every attempt sends it (its headers made for nodes
    /// once, in place), and what its stream's body does with the answer.
    fn outbound(&self, prepared: Prepared, model: &str, view: &RoutingView) -> (Outbound, bool, ProgressEvents) {
        let Prepared { path_and_query, headers, body, strip_usage, progress, form } = prepared;
        let facts = Facts { model, session: self.facts.session.as_deref(), request_id: &self.request_id, form };
        let turn = self.facts.session.as_deref().map(|session| {
            let session = crate::snapshot::session_hash(session);
            let snapshots = &self.state.snapshots;
            SessionTurn {
                turns: Arc::clone(snapshots.node_states().turns()),
                session,
                tokens: estimated_prompt_tokens(body.len(), view),
                reported: snapshots.current().and_then(|snapshot| snapshot.reported(session)),
            }
        });
        let out = Outbound {
            path_and_query,
            headers: upstream_headers(headers, &facts),
            body,
            stream: view.stream,
            asks_progress: progress == ProgressEvents::Taken,
            turn,
        };
        (out, strip_usage, progress)
    }

    /// The setup of the request's stream, with what its body holds of the
    /// budget: the body goes with the stream where the stream outlives
    /// this handler (a cold load, a stream that may be continued).
    fn stream(
        &mut self,
        (strip_usage, progress): (bool, ProgressEvents),
        continues: bool,
        model: &str,
        version: u64,
    ) -> StreamSetup {
        let prompt_estimate = self.facts.meter.as_ref().map_or(0, Meter::prompt_estimate);
        let opening = Opening::new(self.row.stream_start, model, super::id_text(&self.request_id), prompt_estimate);
        StreamSetup {
            state: Arc::clone(self.state),
            plan: Plan {
                opening,
                responses: self.row.numbers_events.then(EventFields::default),
                stream_end: self.row.stream_end,
                strip_usage,
                progress,
                meter: self.facts.meter.clone(),
                request_id: self.request_id.clone(),
                errors: self.row.errors,
                version,
                reservation: None,
            },
            continues,
            held: self.held.take(),
        }
    }

    /// The request's metrics, span and decision, from its answer and what
    /// served it; a stream's once it has ended.
    fn record(self, span: &tracing::Span, response: Response) -> Response {
        let Exchange { state, request_id, started, mut facts, .. } = self;
        let status = response.status();
        let meter = facts.meter.take();
        if !status.is_success()
            && let Some(meter) = &meter
        {
            let outcome = if facts.node_worked { crate::usage::Outcome::Broken } else { crate::usage::Outcome::Error };
            meter.finish(status.as_u16(), outcome, None);
        }
        span.record("model", facts.model.as_str());
        span.record("http.response.status_code", status.as_u16());
        // Label values are moved in and out of the label sets, not copied: a
        // family is looked up by reference. An unknown model is labelled
        // `_unknown` (client-chosen names cannot grow the label set), and
        // its decision keeps the name asked for.
        let model = if facts.model_known { std::mem::take(&mut facts.model) } else { "_unknown".to_string() };
        let elapsed = started.elapsed();
        // A stream's time to its first token is observed by its meter.
        let model = if status.is_success() && !facts.stream {
            let labels = crate::metrics::ModelLabels { model };
            state.metrics.request_seconds.get_or_create(&labels).observe(elapsed.as_secs_f64());
            labels.model
        } else {
            model
        };
        let latency_ms = u32::try_from(elapsed.as_millis()).unwrap_or(u32::MAX);
        let record =
            Record { state: Arc::clone(state), span: span.clone(), request_id, model, status, latency_ms, facts };
        record.finish(meter, response)
    }
}

/// What a request's record says, once it is known what served it. Its
/// routing decision is made only where the decision queue takes it: in a
/// busy second it is counted, not built.
struct Record {
    state: Arc<AppState>,
    span: tracing::Span,
    request_id: HeaderValue,
    model: String,
    status: http::StatusCode,
    latency_ms: u32,
    facts: RequestFacts,
}

impl Record {
    /// Written now, or, for a stream that goes on, when it ends.
    fn finish(self, meter: Option<Meter>, response: Response) -> Response {
        match meter {
            // The work is kept by the meter, and holds no handle of it: the
            // meter's last handle going (a client gone during a cold load)
            // still finishes it, and so writes this.
            Some(meter) if self.facts.stream && self.status.is_success() => {
                meter.at_end(Box::new(move |served, ttft_ms| self.write(served, ttft_ms)));
            }
            meter => {
                // A whole answer's first token reaches the client with its end.
                let ttft_ms = if self.status.is_success() { self.latency_ms } else { 0 };
                self.write(meter.as_ref().and_then(Meter::served_by), ttft_ms);
            }
        }
        response
    }

    fn write(self, served: Option<&Served>, ttft_ms: u32) {
        let Record { state, span, request_id, model, status, latency_ms, facts } = self;
        let (node, route) = served.map_or(("", "none"), |served| (&*served.node, served.route));
        span.record("node", node);
        span.record("route", route);
        if let Some(terms) = served.and_then(|served| served.weighed.first()) {
            span.record("cost.ms", terms.cost_ms());
            span.record("cost.wait_ms", terms.wait_ms);
            span.record("cost.prefill_ms", terms.prefill_ms);
            span.record("cost.carry_ms", terms.carry_ms);
            span.record("cost.move_ms", terms.move_ms);
            span.record("cost.cached_tokens", terms.cached_tokens);
            span.record("cost.queue_ahead", terms.queue_ahead);
        }
        let labels = crate::metrics::RequestLabels { model, node: node.to_string(), status: status.as_u16(), route };
        state.metrics.requests.get_or_create(&labels).inc();
        let crate::metrics::RequestLabels { model: label, node: node_id, .. } = labels;
        state.decisions.record(|| RoutingDecision {
            request_id: super::id_text(&request_id).to_string(),
            unix_ms: inferyes_proto::unix_ms(),
            model: if facts.model_known { label } else { facts.model },
            node_id,
            route: route.to_string(),
            status: u32::from(status.as_u16()),
            error_code: facts.error_code.unwrap_or_default(),
            latency_ms,
            stream: facts.stream,
            session_tag: facts.session.as_deref().map(inferyes_proto::session_tag).unwrap_or_default(),
            key_id: facts.key_id.unwrap_or_default(),
            ttft_ms,
            expected_ttft_ms: served.map_or(0, |served| served.weighed.ttft_ms),
            home_expected_ttft_ms: served.map_or(0, |served| served.weighed.home_ttft_ms),
            candidates: served
                .map(|served| served.weighed.to_wire(state.snapshots.current().as_deref()))
                .unwrap_or_default(),
        });
    }
}

/// What the handler hands its stream: the body's [`Plan`], whether the
/// stream may continue at another node, and what the request's body holds
/// of the budget, kept only while a continuation may need it.
struct StreamSetup {
    state: Arc<AppState>,
    plan: Plan,
    /// The fleet continues this stream on another node if it breaks.
    continues: bool,
    /// What the request's body holds of the budget.
    held: Option<super::body::Reservation>,
}

impl StreamSetup {
    /// The body of the stream whose head passed, able to go on at the
    /// nodes left in `hops` where it continues. `out` is what the attempts
    /// left of the request.
    fn body(self, open: OpenStream, hops: Hops, out: Outbound) -> (http::response::Parts, StreamBody) {
        let StreamSetup { state, mut plan, continues, held } = self;
        let resume = (continues && hops.peek().is_some()).then(|| {
            let continuation = Continuation {
                forwarder: state.forwarder.clone(),
                metrics: Arc::clone(&state.metrics),
                path_and_query: out.path_and_query,
                headers: out.headers,
                body: out.body,
                request_id: plan.request_id.clone(),
                version: plan.version,
                turn: out.turn,
            };
            (Arc::new(continuation), hops)
        });
        // Only a stream that may be continued keeps the request's body;
        // every stream keeps its caller's share until it ends.
        plan.reservation = if resume.is_some() { held } else { held.map(super::body::Reservation::emptied) };
        let hard_stop = state.forwarder.hard_stop().clone();
        StreamBody::streaming(open, plan, hard_stop, resume)
    }

    /// A streaming request that starts a cold load: the client gets its
    /// headers at once (`x-inferyes-route: cold`) and a note each second
    /// while the model loads, instead of minutes of silence; then the
    /// stream of whichever node answers, or a final error event.
    fn cold(
        self,
        snapshot: &RoutingSnapshot,
        route: &Route,
        model: &str,
        (mut out, mut hops): (Outbound, Hops),
        weighed: Weighed,
    ) -> Response {
        let first = hops.peek();
        let node_header = first.and_then(|hop| hop.endpoint.id_header.clone());
        let node_id = first.map(|hop| hop.endpoint.id.to_string()).unwrap_or_default();
        // The client is told the load unloads another model, as it may take
        // that model's sessions' caches with it.
        let evicts = route
            .targets
            .first()
            .and_then(|t| snapshot.placements(model)?.iter().find(|p| p.target == *t))
            .is_some_and(|p| p.evicts);
        let meter = self.plan.meter.clone();
        let errors = self.plan.errors;
        let state = Arc::clone(&self.state);
        let request_id = self.plan.request_id.clone();
        let version = self.plan.version;
        let answer = async move {
            let attempts = Attempts {
                forwarder: &state.forwarder,
                metrics: &state.metrics,
                request_id: &request_id,
                version,
                meter: self.plan.meter.as_ref(),
                share: self.held.as_ref().and_then(super::body::Reservation::share),
                weighed: &weighed,
            };
            match attempts.run(&mut out, &mut hops, Purpose::First).await? {
                Answer::Stream(open) => Ok(self.body(open, hops, out).1),
                Answer::Whole(_) => Err(ApiError::internal()),
            }
        };
        let awaited = Awaited::Load { model: model.to_string(), node: node_id, evicts };
        let body = StreamBody::loading(answer, awaited, meter, errors);
        let mut response = Response::new(Body::new(body));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        if let Some(value) = node_header {
            headers.insert(NODE_HEADER, value);
        }
        headers.insert(ROUTE_HEADER, HeaderValue::from_static(RouteReason::Cold.as_str()));
        response
    }
}

impl StreamSetup {
    /// A streaming request waiting in the queue: the client gets its
    /// headers at once (`x-inferyes-route: queued`) and a note each second
    /// while it waits; then the stream of the node the queue let it out
    /// to, or a final error event (429's, where it waited too long).
    fn queued(mut self, mut place: crate::queue::Place, model: &str, mut out: Outbound) -> Response {
        let meter = self.plan.meter.clone();
        let errors = self.plan.errors;
        let state = Arc::clone(&self.state);
        let request_id = self.plan.request_id.clone();
        let owned_model = model.to_string();
        let answer = async move {
            let (route, snapshot, reserved) = match place.turn().await {
                Turn::Go { route, snapshot, reserved } => (route, snapshot, reserved),
                Turn::Refused(error) => return Err(error.into()),
                Turn::TooLong { waited_ms, retry_after_s } => return Err(waited_too_long(waited_ms, retry_after_s)),
                Turn::Closed => return Err(shutting_down()),
            };
            self.plan.version = snapshot.version();
            let mut route = route;
            let session = out.headers.get(inferyes_proto::headers::SESSION).and_then(|v| v.to_str().ok());
            let id = super::id_text(&request_id);
            super::carry::carry(&state.forwarder, &snapshot, &mut route, session, id).await;
            let mut hops = Hops::of(&snapshot, &route, &owned_model).reserved(reserved);
            let weighed = Weighed::of(&route);
            let attempts = Attempts {
                forwarder: &state.forwarder,
                metrics: &state.metrics,
                request_id: &request_id,
                version: snapshot.version(),
                meter: self.plan.meter.as_ref(),
                share: self.held.as_ref().and_then(super::body::Reservation::share),
                weighed: &weighed,
            };
            match attempts.run(&mut out, &mut hops, Purpose::First).await? {
                Answer::Stream(open) => Ok(self.body(open, hops, out).1),
                Answer::Whole(_) => Err(ApiError::internal()),
            }
        };
        let body = StreamBody::loading(answer, Awaited::Slot { model: model.to_string() }, meter, errors);
        let mut response = Response::new(Body::new(body));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        headers.insert(ROUTE_HEADER, HeaderValue::from_static(QUEUED));
        response
    }
}

/// `x-inferyes-route` of a stream answered while it waits in the queue.
const QUEUED: &str = "queued";

/// The tokens a request that sets no limit is taken to generate, where its
/// model's window is not known.
const DEFAULT_TOKEN_LIMIT: u64 = 4_096;

/// The tokens a waiting request that sets no limit is taken to generate,
/// for its cost in the queue's order: a typical answer, not the most it
/// may say (that would put every such request behind those that set one).
const QUEUE_OUTPUT_ESTIMATE: u64 = 512;

/// The class a request waits in: its key's, or a lower one its
/// `x-inferyes-priority` asks for; a higher one is refused.
fn priority(caller: &Caller, headers: &HeaderMap) -> Result<Class, ApiError> {
    let most = match caller {
        Caller::Key(grant) if grant.priority() == inferyes_proto::v1::Priority::Batch => Class::Batch,
        _ => Class::Interactive,
    };
    let Some(asked) = headers.get(PRIORITY_HEADER) else { return Ok(most) };
    let asked = match asked.as_bytes() {
        b"interactive" => Class::Interactive,
        b"batch" => Class::Batch,
        _ => {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                "x-inferyes-priority is `interactive` or `batch`",
                ErrorCode::InvalidRequest,
            ));
        }
    };
    if asked < most {
        return Err(ApiError::new(
            ErrorKind::PermissionDenied,
            "this key's requests are batch: x-inferyes-priority may not ask for interactive",
            ErrorCode::InvalidRequest,
        ));
    }
    Ok(asked)
}

/// How long a waiting stream goes without a word before it is answered
/// with notes: most waits for a slot are shorter, and those are answered
/// as any other (the node's headers, its route).
const QUIET_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// A client's choice of its request's class in the queue.
const PRIORITY_HEADER: http::HeaderName = http::HeaderName::from_static("x-inferyes-priority");

/// The refusal of a request still waiting when the data plane's shutdown
/// grace period ends.
fn shutting_down() -> ApiError {
    ApiError::new(
        ErrorKind::Unavailable,
        "the gateway shut down while the request waited for a free slot; send it again",
        ErrorCode::GatewayShutdown,
    )
    .retry_after(1)
}

/// The refusal of a request that waited in the queue as long as it may.
fn waited_too_long(waited_ms: u64, retry_after_s: u32) -> ApiError {
    ApiError::new(
        ErrorKind::RateLimited,
        format!(
            "Rate limit reached: the request waited {:.1} s for a free slot, as long as the gateway lets one \
             wait. Try again later.",
            waited_ms as f64 / 1e3
        ),
        ErrorCode::RateLimitExceeded,
    )
    .retry_after(retry_after_s)
}

/// The answer to a request whose tokens its key's daily `budget` does not
/// hold.
fn budget_refusal(budget: u64, unheld: crate::usage::Unheld) -> ApiError {
    let (message, retry_after) = match unheld {
        crate::usage::Unheld::Spent(spent) if spent.used >= budget => {
            (format!("{} used today (UTC)", spent.used), seconds_to_utc_midnight())
        }
        // Spent by requests still running: some of it comes back.
        crate::usage::Unheld::Spent(spent) => {
            (format!("{} used and {} held by requests in flight", spent.used, spent.held), 1)
        }
        // The next split, within a second or two, may give this gateway
        // more of what is left, or another may have room.
        crate::usage::Unheld::PartHeld { part, holds, tokens } => (
            format!(
                "this gateway's part of what is left today ({part}) holds {holds} for requests in flight or not \
                 yet counted, and this request may use up to {tokens}"
            ),
            1,
        ),
    };
    ApiError::new(
        ErrorKind::RateLimited,
        format!("Rate limit reached for tokens: {budget} per day for this key, {message}."),
        ErrorCode::RateLimitExceeded,
    )
    .retry_after(retry_after)
}

/// Seconds until the next UTC midnight, when daily token budgets start over.
fn seconds_to_utc_midnight() -> u32 {
    let now_s = inferyes_proto::unix_ms() / 1000;
    u32::try_from(86_400 - now_s % 86_400).unwrap_or(86_400)
}

/// Reads the whole body, refusing more than `max_body_bytes` with 413
/// before reading it when the client announced its length, with 429 when
/// the caller's share holds all it may of bodies and with 503 when the
/// data plane does (`held` takes what this one holds).
async fn read_body(
    body: hyper::body::Incoming,
    headers: &http::HeaderMap,
    state: &AppState,
    held: &mut super::body::Reservation,
) -> Result<Bytes, ApiError> {
    let (limit, timeout) = (state.max_body_bytes, state.request_body_timeout);
    let too_large = || {
        ApiError::new(
            ErrorKind::PayloadTooLarge,
            format!("the request body is larger than the limit of {limit} bytes"),
            ErrorCode::RequestTooLarge,
        )
    };
    let announced =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    // A body that came with its head is read without a timer ever being set.
    let read = super::body::read_whole_within(body, limit, Some(held));
    let Ok(read) = tokio::time::timeout(timeout, read).await else {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            format!("the request body did not arrive within {} s", timeout.as_secs_f32()),
            ErrorCode::RequestTimeout,
        )
        .with_status(http::StatusCode::REQUEST_TIMEOUT));
    };
    read.map_err(|error| match error {
        super::body::ReadError::TooLarge => too_large(),
        super::body::ReadError::OverBudget(Full::DataPlane) => ApiError::overloaded("request bodies"),
        super::body::ReadError::OverBudget(Full::Share(whose)) => state.refused(
            crate::auth::Refusal::BytesShare,
            ApiError::past_share(whose, "all the bytes of request bodies and answers"),
        ),
        super::body::ReadError::Body(_) => {
            ApiError::new(ErrorKind::BadRequest, "the request body could not be read", ErrorCode::InvalidBody)
        }
    })
}

/// A keyed caller's flow: its tenant, or its key where it has none.
fn keyed_flow(grant: &inferyes_proto::v1::ApiKey) -> String {
    if grant.tenant.is_empty() { format!("k:{}", grant.key_id) } else { format!("t:{}", grant.tenant) }
}
