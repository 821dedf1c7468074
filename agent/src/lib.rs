//! The Inferyes agent: one per GPU host.
pub mod sim;
