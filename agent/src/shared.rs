//! A lock that outlives a panic, for the agent's shared state.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// A lock taken whatever panicked while it was held. What it guards is
/// changed a field at a time, so what a panic left is still the best the
/// agent knows; a lock skipped once poisoned would switch off for good
/// what it guards (residency, observations), and the node would go on
/// reporting as of the panic.
#[derive(Debug, Default)]
pub struct Shared<T>(pub(crate) Mutex<T>);

impl<T> Shared<T> {
    pub fn new(value: T) -> Shared<T> {
        Shared(Mutex::new(value))
    }

    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
