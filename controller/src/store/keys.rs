/// The key layout under the fleet's etcd prefix. Parsing and formatting live
/// together so they cannot disagree.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
    /// The usage ledger's keys live beside the fleet's, not under them: the
    /// fleet watch must not see a write per batch.
    usage: String,
}

/// A key the controller understands, parsed from its etcd form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key {
    Node(String),
    Drain(String),
    Policy,
    NodePolicy(String),
    Alias(String),
    ApiKey(String),
    UsageToday,
    Controller(String),
    Placement,
}

const NODES: &str = "nodes/";
const DRAIN: &str = "config/drain/";
const POLICY: &str = "config/policy";
const NODE_POLICY: &str = "config/node/";
const ALIAS: &str = "config/alias/";
const API_KEY: &str = "keys/";
const USAGE_TODAY: &str = "usage/today";
const CONTROLLERS: &str = "controllers/";
const PLACEMENT: &str = "placement";
const FLEET_KEY: &str = "secrets/fleet-key";

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        let usage = format!("{}-usage/", prefix.trim_end_matches('/'));
        Keys { prefix, usage }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn node(&self, node_id: &str) -> String {
        format!("{}{NODES}{node_id}", self.prefix)
    }

    pub fn drain(&self, node_id: &str) -> String {
        format!("{}{DRAIN}{node_id}", self.prefix)
    }

    pub fn policy(&self) -> String {
        format!("{}{POLICY}", self.prefix)
    }

    pub fn node_policy(&self, node_id: &str) -> String {
        format!("{}{NODE_POLICY}{node_id}", self.prefix)
    }

    pub fn alias(&self, alias: &str) -> String {
        format!("{}{ALIAS}{alias}", self.prefix)
    }

    pub fn api_key(&self, key_id: &str) -> String {
        format!("{}{API_KEY}{key_id}", self.prefix)
    }

    /// A controller's address for its peers, under its own lease.
    pub fn controller(&self, controller_id: &str) -> String {
        format!("{}{CONTROLLERS}{controller_id}", self.prefix)
    }

    /// The fleet's secret ([`inferyes_proto::bearer::FleetKey`]): made once,
    /// by the first controller, never changed by another. Not parsed: the
    /// fleet's watch ignores it.
    pub fn fleet_key(&self) -> String {
        format!("{}{FLEET_KEY}", self.prefix)
    }

    /// The placement leader's outstanding orders, under its lease.
    pub fn placement(&self) -> String {
        format!("{}{PLACEMENT}", self.prefix)
    }

    /// Tokens per key today: in the fleet's prefix, so snapshots carry it.
    pub fn usage_today(&self) -> String {
        format!("{}{USAGE_TODAY}", self.prefix)
    }

    /// The ledger's own prefix (`<prefix>-usage/`): batches waiting to be
    /// rolled up (`pending/`), batches already counted (`applied/`), hourly
    /// roll-ups (`hourly/<YYYYMMDDHH>/<key>/<model>`), raw records
    /// (`raw/<YYYYMMDDHH>/<batch>`) and the leader election (`leader`).
    pub fn usage(&self, rest: &str) -> String {
        format!("{}{rest}", self.usage)
    }

    /// `None` for keys under the prefix that this version does not know:
    /// a newer controller may have written them, and they are ignored.
    pub fn parse(&self, key: &[u8]) -> Option<Key> {
        let key = std::str::from_utf8(key).ok()?.strip_prefix(&self.prefix)?;
        if let Some(id) = key.strip_prefix(NODES) {
            return (!id.is_empty()).then(|| Key::Node(id.to_string()));
        }
        if let Some(id) = key.strip_prefix(DRAIN) {
            return (!id.is_empty()).then(|| Key::Drain(id.to_string()));
        }
        if key == POLICY {
            return Some(Key::Policy);
        }
        if let Some(id) = key.strip_prefix(NODE_POLICY) {
            return (!id.is_empty()).then(|| Key::NodePolicy(id.to_string()));
        }
        if let Some(alias) = key.strip_prefix(ALIAS) {
            return (!alias.is_empty()).then(|| Key::Alias(alias.to_string()));
        }
        if let Some(id) = key.strip_prefix(API_KEY) {
            return (!id.is_empty()).then(|| Key::ApiKey(id.to_string()));
        }
        if key == USAGE_TODAY {
            return Some(Key::UsageToday);
        }
        if key == PLACEMENT {
            return Some(Key::Placement);
        }
        if let Some(id) = key.strip_prefix(CONTROLLERS) {
            return (!id.is_empty()).then(|| Key::Controller(id.to_string()));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::{Key, Keys};

    #[test]
    fn keys_round_trip() {
        let keys = Keys::new("/inferyes/v1");
        assert_eq!(keys.parse(keys.node("gpu-1").as_bytes()), Some(Key::Node("gpu-1".into())));
        assert_eq!(keys.parse(keys.drain("gpu-1").as_bytes()), Some(Key::Drain("gpu-1".into())));
        assert_eq!(keys.parse(keys.policy().as_bytes()), Some(Key::Policy));
        assert_eq!(keys.parse(keys.node_policy("n").as_bytes()), Some(Key::NodePolicy("n".into())));
        assert_eq!(keys.parse(keys.alias("org/model").as_bytes()), Some(Key::Alias("org/model".into())));
        assert_eq!(keys.parse(keys.api_key("abc").as_bytes()), Some(Key::ApiKey("abc".into())));
        assert_eq!(keys.parse(keys.usage_today().as_bytes()), Some(Key::UsageToday));
        assert_eq!(keys.parse(keys.controller("c1").as_bytes()), Some(Key::Controller("c1".into())));
        // The ledger is outside the fleet's prefix, so outside its watch.
        assert!(!keys.usage("pending/x").starts_with(keys.prefix()));
        assert_eq!(keys.usage("pending/x"), "/inferyes/v1-usage/pending/x");
        assert_eq!(keys.parse(b"/inferyes/v1/nodes/"), None);
        assert_eq!(keys.parse(b"/inferyes/v1/usage/x"), None);
        assert_eq!(keys.parse(b"/other/nodes/gpu-1"), None);
    }
}
