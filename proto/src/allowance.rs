//! What both ends of a key's fleet-wide limits agree on: the part a data
//! plane takes of a key its answer lists no part of.

/// A data plane's part of a key no data plane asked of lately: an even
/// split among `dataplanes`, the remainder of the division going to the
/// first places, so the parts add up to the limit.
pub fn even_part(limit: u32, dataplanes: u32, place: u32) -> u32 {
    if dataplanes == 0 {
        return limit;
    }
    limit / dataplanes + u32::from(place < limit % dataplanes)
}

/// A data plane's part of `limit`, a key's, that `parts` does not list.
pub fn unlisted_part(limit: u32, parts: &crate::v1::Allowances) -> u32 {
    let here = even_part(limit, parts.dataplanes, parts.place);
    match (parts.settling, parts.before_dataplanes) {
        (false, _) => here,
        (true, 0) => 0,
        (true, before) => here.min(even_part(limit, before, parts.before_place)),
    }
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
    }
}
