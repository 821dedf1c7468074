//! A routing decision's words, as people read them on the dashboard and
//! in `inferyesctl explain`: one spelling for both.

use crate::v1::{CacheSource, Standing};

impl Standing {
    pub fn name(self) -> &'static str {
        match self {
            Standing::Unspecified => "-",
            Standing::Resident => "resident",
            Standing::Warm => "warm",
            Standing::Cold => "cold",
            Standing::Ejected => "ejected",
        }
    }
}

impl CacheSource {
    pub fn name(self) -> &'static str {
        match self {
            CacheSource::None => "none",
            CacheSource::Resident => "resident",
            CacheSource::Carried => "carried",
        }
    }
}
