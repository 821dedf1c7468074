//! Reading the host: what each backend serves and how busy it is, and what
//! each GPU holds. The parsers are pure; `client` does the I/O.

mod backend;
mod client;
pub mod fingerprint;
mod gguf;
mod gpu;
mod throughput;

pub use backend::{
    BackendProbe, Probed, parse_llamacpp_metrics, parse_llamaswap_models, parse_openai_models, parse_slots,
};
pub use client::ProbeClient;
pub use gpu::{GpuReader, GpuReading};
pub use throughput::{Counters, Rates, Throughput};
