//! What both ends of a key's fleet-wide limits agree on: the part a data
//! plane takes of a key its answer lists no part of.

/// A data plane's part of a key no data plane asked of lately: an even
/// split among `dataplanes`, the remainder of the division going to the
/// first places, so the parts add up to the limit.
pub fn even_part(limit: u64, dataplanes: u32, place: u32) -> u64 {
    if dataplanes == 0 {
        return limit;
    }
    let (dataplanes, place) = (u64::from(dataplanes), u64::from(place));
    limit / dataplanes + u64::from(place < limit % dataplanes)
}

/// A data plane's part of `limit`, a key's, that `parts` does not list.
pub fn unlisted_part(limit: u64, parts: &crate::v1::Allowances) -> u64 {
    let here = even_part(limit, parts.dataplanes, parts.place);
    match (parts.settling, parts.before_dataplanes) {
        (false, _) => here,
        (true, 0) => 0,
        (true, before) => here.min(even_part(limit, before, parts.before_place)),
    }
}

/// [`unlisted_part`] of a limit counted in `u32`.
pub fn unlisted_part_u32(limit: u32, parts: &crate::v1::Allowances) -> u32 {
    // No more than the limit.
    u32::try_from(unlisted_part(u64::from(limit), parts)).unwrap_or(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_parts_add_up_to_the_limit() {
        for (limit, dataplanes) in [(60, 4), (2, 4), (7, 3), (0, 2), (5, 1), (u64::MAX, 3)] {
            let sum: u128 = (0..dataplanes).map(|place| u128::from(even_part(limit, dataplanes, place))).sum();
            assert_eq!(sum, u128::from(limit));
        }
        assert_eq!((even_part(2, 4, 1), even_part(2, 4, 2)), (1, 0));
    }

    #[test]
    fn a_settling_data_plane_takes_the_lesser_even_part_of_the_old_split_and_the_new() {
        let split = |dataplanes, place, settling, before_dataplanes, before_place| crate::v1::Allowances {
            dataplanes,
            place,
            settling,
            before_dataplanes,
            before_place,
            ..Default::default()
        };
        assert_eq!(unlisted_part(60, &split(4, 1, false, 0, 0)), 15);
        assert_eq!(unlisted_part(60, &split(4, 1, true, 0, 0)), 0, "a newcomer holds none");
        assert_eq!(unlisted_part(60, &split(4, 1, true, 3, 0)), 15, "a join: the new split is less");
        assert_eq!(unlisted_part(60, &split(3, 0, true, 4, 1)), 15, "a leave: the old split is less");
        assert_eq!(unlisted_part_u32(60, &split(4, 1, false, 0, 0)), 15);
    }
}
