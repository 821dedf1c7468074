//! A server's slot as the agent sees it: what `/slots` shows of it, and
//! one the agent restored into. Pure.

/// A slot as `/slots` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub id: u32,
    pub busy: bool,
    /// The last task it ran, if any.
    pub task: Option<u64>,
    /// Tokens its cache holds (the last prompt and reply), if it ran one.
    pub tokens: Option<u32>,
}

/// A slot restored into, and what `/slots` showed of it then: until it
/// runs a task, it shows no sign of what it holds, and must not be taken
/// for empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restored {
    pub slot: Slot,
}
