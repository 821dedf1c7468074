//! What both ends of a key's fleet-wide limits agree on: the part a data
//! plane takes of a key it was given no part of.

/// A data plane's part of a key no data plane asked of lately: an even
/// split among `dataplanes`, the remainder of the division going to the
/// first places, so the parts add up to the limit.
pub fn even_part(limit: u32, dataplanes: u32, place: u32) -> u32 {
    if dataplanes == 0 {
        return limit;
    }
    limit / dataplanes + u32::from(place < limit % dataplanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_parts_add_up_to_the_limit() {
        for (limit, dataplanes) in [(60, 4), (2, 4), (7, 3), (0, 2), (5, 1)] {
            let sum: u32 = (0..dataplanes).map(|place| even_part(limit, dataplanes, place)).sum();
            assert_eq!(sum, limit);
        }
        assert_eq!((even_part(2, 4, 1), even_part(2, 4, 2)), (1, 0));
    }
}
