//! Everything the controller keeps in etcd, and the only code that talks to
//! it. Keys live under a configurable prefix (default `/inferyes/v1/`):
//!
//! * `nodes/<node_id>`: a `NodeRecord`, bound to the lease of the agent's
//!   stream, so a node disappears when its agent does;
//! * `config/drain/<node_id>`: a `DrainRecord`, persistent;
//! * `controllers/<controller_id>`: a `ControllerRecord`, bound to the
//!   controller's own lease: how its peers reach it.

mod etcd;
mod keys;
mod usage;

pub use etcd::{
    DbSize, EtcdAccess, EtcdStore, FleetSecret, Lease, StoreError, Watch, WatchBatch, WatchEvent, held_by_another,
};
pub use keys::{Key, Keys};
pub use usage::{Application, Versioned};
