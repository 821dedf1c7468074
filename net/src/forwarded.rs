//! Who a request comes from: the connection's peer, or, where the peer is
//! a proxy the operator trusts, the client that proxy names in
//! `X-Forwarded-For`. Anyone can write that header, so it is read only as
//! far back as trusted proxies wrote it.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use http::HeaderMap;
use serde::{Deserialize, Serialize};

/// An address block, `10.0.0.0/8` or `2001:db8::/32`; a bare address is
/// the block of that one address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Every address of its family: whoever connects is believed.
    pub fn is_everything(&self) -> bool {
        self.prefix == 0
    }

    /// Addresses in the block, as a power of two.
    pub fn host_bits(&self) -> u8 {
        let width = if self.network.is_ipv4() { 32 } else { 128 };
        width - self.prefix
    }

    pub fn contains(&self, addr: IpAddr) -> bool {
        match (self.network, addr.to_canonical()) {
            (IpAddr::V4(network), IpAddr::V4(addr)) => {
                prefix_of(u128::from(addr.to_bits()), self.prefix, 32) == u128::from(network.to_bits())
            }
            (IpAddr::V6(network), IpAddr::V6(addr)) => prefix_of(addr.to_bits(), self.prefix, 128) == network.to_bits(),
            _ => false,
        }
    }
}

/// The top `prefix` of `width` bits of `bits`.
fn prefix_of(bits: u128, prefix: u8, width: u8) -> u128 {
    let host_bits = u32::from(width - prefix);
    bits.checked_shr(host_bits).and_then(|top| top.checked_shl(host_bits)).unwrap_or(0)
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(text: &str) -> Result<Cidr, String> {
        let (addr, prefix) = text.split_once('/').map_or((text, None), |(a, p)| (a, Some(p)));
        let mut network: IpAddr =
            addr.trim().parse().map_err(|_| format!("{text:?} is not an address block like 10.0.0.0/8"))?;
        let width = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => width,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= width)
                .ok_or_else(|| format!("{text:?}: the prefix length must be 0 to {width}"))?,
        };
        let bits = match network {
            IpAddr::V4(v4) => u128::from(v4.to_bits()),
            IpAddr::V6(v6) => v6.to_bits(),
        };
        if prefix_of(bits, prefix, width) != bits {
            return Err(format!("{text:?} has bits set past its prefix length; write its network address"));
        }
        // Peers are compared as IPv4 where they are IPv4-mapped: so is a
        // block of mapped addresses.
        let mut prefix = prefix;
        if let IpAddr::V6(v6) = network
            && let Some(v4) = v6.to_ipv4_mapped()
            && prefix >= 96
        {
            (network, prefix) = (IpAddr::V4(v4), prefix - 96);
        }
        Ok(Cidr { network, prefix })
    }
}

impl TryFrom<String> for Cidr {
    type Error = String;

    fn try_from(text: String) -> Result<Cidr, String> {
        text.parse()
    }
}

impl From<Cidr> for String {
    fn from(cidr: Cidr) -> String {
        cidr.to_string()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// The client of a request that arrived from `peer`: `peer` itself, unless
/// it is a trusted proxy; then the address that proxy saw, read from the
/// right of `X-Forwarded-For` (each proxy appends the address it was
/// called from) and past every trusted proxy's entry. An entry that is
/// not an address stops the walk at the proxy that wrote it.
pub fn client_address(peer: IpAddr, headers: &HeaderMap, trusted: &[Cidr]) -> IpAddr {
    let is_trusted = |addr: IpAddr| is_trusted(addr, trusted);
    let mut client = peer.to_canonical();
    if !is_trusted(client) {
        return client;
    }
    // Bytes, not text: a value that is not text is an entry that is not
    // an address, which stops the walk (skipping it would read on into
    // what the client wrote).
    let values: Vec<&[u8]> = headers.get_all("x-forwarded-for").iter().map(http::HeaderValue::as_bytes).collect();
    for entry in values.iter().rev().flat_map(|value| value.rsplit(|byte| *byte == b',')) {
        let Some(named) = std::str::from_utf8(entry).ok().and_then(parse_entry) else { return client };
        client = named;
        if !is_trusted(client) {
            break;
        }
    }
    client
}

/// Whether `addr` is one of the `trusted` proxies (an IPv4 address mapped
/// into IPv6 counted as itself).
pub fn is_trusted(addr: IpAddr, trusted: &[Cidr]) -> bool {
    let addr = addr.to_canonical();
    trusted.iter().any(|cidr| cidr.contains(addr))
}

/// One `X-Forwarded-For` entry: an address, with or without a port
/// (`192.0.2.1:4711`, `[2001:db8::1]:4711`).
fn parse_entry(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    entry
        .parse::<IpAddr>()
        .or_else(|_| entry.parse::<std::net::SocketAddr>().map(|socket| socket.ip()))
        .ok()
        .map(|addr| addr.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidrs(list: &[&str]) -> Vec<Cidr> {
        list.iter().map(|c| c.parse().unwrap()).collect()
    }

    fn addr(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_block_holds_the_addresses_under_its_prefix() {
        let block: Cidr = "10.1.0.0/16".parse().unwrap();
        assert!(block.contains(addr("10.1.255.3")));
        assert!(block.contains(addr("::ffff:10.1.0.9")), "an IPv4 peer on a dual-stack socket");
        assert!(!block.contains(addr("10.2.0.1")));
        assert!(!block.contains(addr("::1")));
        let any: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(any.contains(addr("203.0.113.9")));
        let one: Cidr = "2001:db8::7".parse().unwrap();
        assert_eq!(one.to_string(), "2001:db8::7/128");
        assert!(one.contains(addr("2001:db8::7")) && !one.contains(addr("2001:db8::8")));
        let mapped: Cidr = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(mapped.to_string(), "10.0.0.0/8");
        assert!(mapped.contains(addr("10.9.8.7")) && mapped.contains(addr("::ffff:10.9.8.7")));
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains(addr("2001:db8:ffff::1")) && !v6.contains(addr("2001:db9::1")));
        for bad in ["10.0.0.0/33", "10.0.0.1/8", "ten/8", "", "::/129", "10.0.0.0/-1"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_client_is_read_back_through_trusted_proxies_only() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let mut headers = HeaderMap::new();
        headers.append("x-forwarded-for", "198.51.100.66, 203.0.113.5".parse().unwrap());
        headers.append("x-forwarded-for", "10.0.0.2".parse().unwrap());
        // The peer (a trusted balancer) appended 10.0.0.2, another of
        // ours, which appended 203.0.113.5: the client. 198.51.100.66 is
        // what the client wrote itself.
        assert_eq!(client_address(addr("10.0.0.1"), &headers, &trusted), addr("203.0.113.5"));
        // From anyone else, the header is the client's own say.
        assert_eq!(client_address(addr("192.0.2.7"), &headers, &trusted), addr("192.0.2.7"));
        assert_eq!(client_address(addr("10.0.0.1"), &headers, &[]), addr("10.0.0.1"));
        // Nothing forwarded: the proxy is the client.
        assert_eq!(client_address(addr("10.0.0.1"), &HeaderMap::new(), &trusted), addr("10.0.0.1"));
        let mut junk = HeaderMap::new();
        junk.insert("x-forwarded-for", "203.0.113.5, unknown".parse().unwrap());
        assert_eq!(client_address(addr("10.0.0.1"), &junk, &trusted), addr("10.0.0.1"));
        // A line that is not text, appended by the proxy to the client's
        // own: the walk stops there, not at what the client wrote.
        let mut bytes = HeaderMap::new();
        bytes.append("x-forwarded-for", "203.0.113.99".parse().unwrap());
        bytes.append("x-forwarded-for", http::HeaderValue::from_bytes(b"\xff10.0.0.9").unwrap());
        assert_eq!(client_address(addr("10.0.0.1"), &bytes, &trusted), addr("10.0.0.1"));
        let mut ported = HeaderMap::new();
        ported.insert("x-forwarded-for", "[2001:db8::5]:4711, 203.0.113.5:80".parse().unwrap());
        assert_eq!(client_address(addr("::ffff:10.0.0.1"), &ported, &trusted), addr("203.0.113.5"));
        let all_trusted = cidrs(&["0.0.0.0/0", "::/0"]);
        assert_eq!(client_address(addr("10.0.0.1"), &ported, &all_trusted), addr("2001:db8::5"));
    }
}
