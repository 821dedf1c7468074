//! Integration tests on real sockets with a real etcd. Each test builds its
//! own fleet, so tests are independent and can run in parallel.

mod allowances;
mod auth;
mod chaos;
mod churn;
mod connections;
mod control;
mod ctl;
mod dashboard;
mod errors;
mod etcd_access;
mod failover;
mod kinds;
mod metrics;
mod placement;
mod queue;
mod routing;
mod shares;
mod slot_shares;
mod support;
mod swap;
mod tls;
mod usage;
mod walking;
