//! The gRPC contracts of Inferyes (package `inferyes.v1`) and the one error
//! vocabulary every component maps its failures onto.

pub mod v1 {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("inferyes.v1");
}

mod error;
pub mod process;

pub use error::{ErrorKind, openai_error_body};

/// Milliseconds since the Unix epoch; 0 if the clock is before it.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
