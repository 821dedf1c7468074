//! The networking the proxies share (an agent's proxy, a data plane): the
//! pooled HTTP/1.1 client to upstreams, the serving loop, the rustls
//! configurations of both, and the process around them (logs, traces,
//! signals). Wire types and errors are `inferyes-proto`'s.

pub mod base_url;
pub mod pool;
pub mod process;
pub mod serve;
pub mod telemetry;
pub mod tls;
