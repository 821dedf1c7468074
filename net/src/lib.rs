//! The networking the proxies share (an agent's proxy, a data plane): the
//! pooled HTTP/1.1 client to upstreams, the serving loop, the rustls
//! configurations of both, and what runs around them in every server:
//! which connections each listener takes and how it accepts them,
//! logs and traces, signals, reconnection backoff, and log lines that
//! would repeat held back. Wire types and errors are `inferyes-proto`'s.

pub mod admit;
pub mod backoff;
pub mod base_url;
pub mod forwarded;
pub mod listen;
pub mod log;
pub mod pool;
pub mod process;
pub mod serve;
pub mod telemetry;
pub mod tls;
