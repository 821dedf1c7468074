//! The controller's gRPC services. Only this module (and `store`) see wire
//! types as wire types; the rest treats them as plain data.

mod agent;
mod fleet;
mod routing;

pub use agent::{AgentSvc, Seats, WritePacing};
pub use fleet::FleetSvc;
pub use routing::RoutingSvc;

use inferyes_proto::ErrorKind;

use crate::store::StoreError;

fn status(kind: ErrorKind, message: impl Into<String>) -> tonic::Status {
    tonic::Status::new(kind.grpc_code(), message)
}

impl From<StoreError> for tonic::Status {
    fn from(error: StoreError) -> tonic::Status {
        status(error.kind(), format!("fleet store unavailable, nothing was changed: {error}"))
    }
}
