//! How many wrong tokens an address may present to the dashboard: a
//! bucket of [`BURST`] per peer (an IPv4 address or an IPv6 /64), one back
//! every [`REFILL_SECONDS`]. Each try is taken from the bucket before its
//! token is checked, and given back if it was right; an empty bucket
//! refuses the address's next try unchecked, so guessing cannot go
//! faster, and other addresses are not held back by it. Pure: time comes
//! in as an argument.

use std::collections::HashMap;
use std::net::IpAddr;

/// Wrong tokens an address may present in a row.
pub const BURST: u32 = 10;
/// How long an address waits for each one more.
pub const REFILL_SECONDS: u64 = 30;
/// Addresses followed at once: a flood of addresses beyond this starts the
/// count over for all of them, rather than grow without bound.
const MAX_ADDRESSES: usize = 16_384;

#[derive(Default)]
pub struct Attempts {
    /// Per peer: the wrong tokens it still owes, as of when (Unix seconds).
    owed: HashMap<IpAddr, (u32, u64)>,
}

impl Attempts {
    /// A try of `address`'s at `now`, counted as a wrong token until it is
    /// given back; or, where it has none left, the seconds until it has.
    pub fn take(&mut self, address: IpAddr, now: u64) -> Result<(), u64> {
        if let Some(&(owed, since)) = self.owed.get(&inferyes_net::admit::peer_of(address))
            && Self::owed_at(owed, since, now) >= BURST
        {
            // The next one comes back a whole period after the last counted.
            let elapsed = now.saturating_sub(since) % REFILL_SECONDS;
            return Err(REFILL_SECONDS - elapsed);
        }
        self.failed(address, now);
        Ok(())
    }

    /// A try taken was a right token after all.
    pub fn give_back(&mut self, address: IpAddr, now: u64) {
        let peer = inferyes_net::admit::peer_of(address);
        if let Some(entry) = self.owed.get_mut(&peer) {
            entry.0 = entry.0.saturating_sub(1);
            if Self::owed_at(entry.0, entry.1, now) == 0 {
                self.owed.remove(&peer);
            }
        }
    }

    /// `address` presented a wrong token at `now`.
    fn failed(&mut self, address: IpAddr, now: u64) {
        if self.owed.len() >= MAX_ADDRESSES {
            self.owed.retain(|_, &mut (owed, since)| Self::owed_at(owed, since, now) > 0);
            if self.owed.len() >= MAX_ADDRESSES {
                inferyes_net::warn_every!(
                    "wrong dashboard tokens from more than {MAX_ADDRESSES} addresses: their counts start over"
                );
                self.owed.clear();
            }
        }
        let entry = self.owed.entry(inferyes_net::admit::peer_of(address)).or_insert((0, now));
        let owed = Self::owed_at(entry.0, entry.1, now);
        // Paid back whole periods only: the part of one under way stays.
        let since = if owed == 0 { now } else { entry.1 + (entry.0 - owed) as u64 * REFILL_SECONDS };
        *entry = ((owed + 1).min(BURST), since);
    }

    fn owed_at(owed: u32, since: u64, now: u64) -> u32 {
        let repaid = now.saturating_sub(since) / REFILL_SECONDS;
        owed.saturating_sub(u32::try_from(repaid).unwrap_or(u32::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_that_guesses_waits_and_others_do_not() {
        let (guesser, other): (IpAddr, IpAddr) = ("192.0.2.7".parse().unwrap(), "192.0.2.8".parse().unwrap());
        let mut attempts = Attempts::default();
        for _ in 0..BURST {
            assert_eq!(attempts.take(guesser, 1_000), Ok(()));
        }
        assert_eq!(attempts.take(guesser, 1_000), Err(REFILL_SECONDS));
        assert_eq!(attempts.take(guesser, 1_010), Err(REFILL_SECONDS - 10));
        assert_eq!(attempts.take(other, 1_000), Ok(()), "another address is not held back");
        // One more try per period, and no more.
        assert_eq!(attempts.take(guesser, 1_000 + REFILL_SECONDS), Ok(()));
        assert_eq!(attempts.take(guesser, 1_000 + REFILL_SECONDS + 1), Err(REFILL_SECONDS - 1));
        // Quiet long enough, all is forgiven.
        let later = 1_000 + REFILL_SECONDS * u64::from(BURST + 1);
        for _ in 0..BURST {
            assert_eq!(attempts.take(guesser, later), Ok(()));
        }
        assert!(attempts.take(guesser, later).is_err());
    }

    #[test]
    fn a_right_token_gives_its_try_back() {
        let client: IpAddr = "192.0.2.9".parse().unwrap();
        let mut attempts = Attempts::default();
        for _ in 0..BURST * 3 {
            assert_eq!(attempts.take(client, 5), Ok(()));
            attempts.give_back(client, 5);
        }
        assert!(attempts.owed.is_empty(), "nothing owed, nothing kept");
        // Tries at once are counted as they are taken.
        for _ in 0..BURST {
            assert_eq!(attempts.take(client, 5), Ok(()));
        }
        assert!(attempts.take(client, 5).is_err());
    }

    #[test]
    fn an_ipv6_host_s_addresses_are_one_and_the_table_is_bounded() {
        let mut attempts = Attempts::default();
        for i in 0..BURST {
            attempts.take(format!("2001:db8::{i:x}").parse().unwrap(), 5).unwrap();
        }
        assert!(attempts.take("2001:db8::ffff".parse().unwrap(), 5).is_err(), "one /64, one bucket");
        assert!(attempts.take("2001:db8:0:1::1".parse().unwrap(), 5).is_ok());
        for i in 0..MAX_ADDRESSES as u32 + 10 {
            attempts.failed(IpAddr::V4(i.into()), 5);
        }
        assert!(attempts.owed.len() <= MAX_ADDRESSES);
    }
}
