/// The key layout under the fleet's etcd prefix. Parsing and formatting live
/// together so they cannot disagree.
#[derive(Clone, Debug)]
pub struct Keys {
    prefix: String,
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
}

const NODES: &str = "nodes/";
const DRAIN: &str = "config/drain/";
const POLICY: &str = "config/policy";
const NODE_POLICY: &str = "config/node/";
const ALIAS: &str = "config/alias/";
const API_KEY: &str = "keys/";

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Keys { prefix }
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
        assert_eq!(keys.parse(b"/inferyes/v1/nodes/"), None);
        assert_eq!(keys.parse(b"/inferyes/v1/usage/x"), None);
        assert_eq!(keys.parse(b"/other/nodes/gpu-1"), None);
    }
}
