//! Ports for what a test stops and starts again on the same address (etcd,
//! a controller). A port the kernel hands out for `bind(0)` is in its
//! ephemeral range, where any other test's listener or connection may take
//! it in the moment it is free; these come from below that range, where
//! only another of these could, and are checked free when taken.

use std::net::TcpListener;

/// Where the kernel's ephemeral range starts, read from
/// `/proc/sys/net/ipv4/ip_local_port_range` (Linux's default where it
/// cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A loopback port below the ephemeral range that is free now.
pub fn stable_port() -> u16 {
    let end = ephemeral_start();
    let start = end.saturating_sub(12_000).max(1_024);
    for _ in 0..1_000 {
        let port = fastrand::u16(start..end);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {start}..{end}")
}
