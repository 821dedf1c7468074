//! The test harness: starts a real etcd, controllers, agents (in front of
//! simulated llama-servers) and data planes in one process, each on its own
//! port-0 listener, and offers waits on conditions instead of sleeps.

pub mod browser;
pub mod client;
pub mod etcd;
pub mod fleet;
pub mod ports;

pub use browser::Browser;
pub use client::{HttpClient, TestResponse};
pub use etcd::Etcd;
pub use fleet::{
    ADMIN_TOKEN, AgentHandle, ControllerHandle, DataplaneHandle, JOIN_TOKEN, SimHandle, SnapshotWatch, VIEWER_TOKEN,
    eventually,
};
