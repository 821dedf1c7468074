//! A tool call that a request requires, answered as llama-server b11434
//! answers one for a model whose template offers tools in the Hermes form
//! (`deploy/local/gemma.jinja`): the model writes a word, then
//! `<tool_call>\n{"name": NAME, "arguments": ARGUMENTS}\n</tool_call>`, and
//! stops. The server streams the word as text, then the call: its name
//! with the first piece of its arguments, then the rest as written.
//!
//! A request that offers tools without requiring one is answered in text,
//! as a model may answer it.

use std::collections::HashSet;

use serde_json::{Map, Value, json};

use super::Kind;
use crate::tokens::{Generator, pieces};

/// The call a request requires: to the tool its choice names, or to its
/// first tool.
#[derive(Debug)]
pub(super) struct Call {
    pub(super) name: String,
    /// What the model writes, piece by piece.
    pub(super) script: Vec<(String, Part)>,
}

/// What a written piece is part of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
    /// The text before the call.
    Text,
    /// The call's tags and name, which the server parses and does not send.
    Frame,
    Arguments,
}

impl Call {
    /// The call `req`, of `kind`, requires; its arguments' words come from
    /// `generator`, so the same request gets the same call.
    pub(super) fn required(kind: Kind, req: &Value, generator: Generator) -> Option<Call> {
        let choice = req.get("tool_choice")?;
        // The tool the choice names; `None` where any tool will do.
        let named = match (kind, choice) {
            (Kind::Chat | Kind::Responses, Value::String(choice)) if choice == "required" => None,
            (Kind::Chat | Kind::Responses, Value::String(_)) => return None,
            (Kind::Chat, _) => Some(choice.pointer("/function/name")?.as_str()?),
            (Kind::Responses, _) => Some(choice.get("name")?.as_str()?),
            (Kind::Messages, _) => match choice.get("type")?.as_str()? {
                "any" => None,
                "tool" => Some(choice.get("name")?.as_str()?),
                _ => return None,
            },
            _ => return None,
        };
        let (name, schema) = req.get("tools")?.as_array()?.iter().find_map(|tool| {
            let (name, schema) = match kind {
                Kind::Chat => (tool.pointer("/function/name")?, tool.pointer("/function/parameters")),
                Kind::Messages => (tool.get("name")?, tool.get("input_schema")),
                _ => (tool.get("name")?, tool.get("parameters")),
            };
            let name = name.as_str().filter(|name| is_a_tool_name(name))?;
            named.is_none_or(|named| named == name).then_some((name, schema))
        })?;
        let arguments = arguments_for(schema, generator.piece(2))?.to_string();
        let mut script: Vec<(String, Part)> =
            [generator.piece(0), generator.piece(1)].into_iter().map(|p| (p.to_owned(), Part::Text)).collect();
        for (text, part) in [(opening(name).as_str(), Part::Frame), (&arguments, Part::Arguments), (CLOSE, Part::Frame)]
        {
            script.extend(pieces(text).map(|piece| (piece.to_owned(), part)));
        }
        Some(Call { name: name.to_owned(), script })
    }
}

/// A name as OpenAI's API takes a tool's: at most 64 letters, digits,
/// underscores and dashes. A model is not asked to call any other.
fn is_a_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
}

/// The most properties given a value: a call stays a few hundred tokens
/// whatever schema a client sends.
const MAX_PROPERTIES: usize = 32;

/// What follows a call's arguments.
const CLOSE: &str = "}\n</tool_call>";

/// What precedes a call's arguments; the name is a JSON string, quoted
/// as the model writes one.
fn opening(name: &str) -> String {
    format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", Value::from(name))
}

/// A call as a conversation's history holds it: what the model wrote for
/// it, so the next turn's prompt extends the last one token for token.
pub(super) fn render(name: &str, arguments: &str) -> String {
    format!("{}{arguments}{CLOSE}", opening(name))
}

/// The longest property name given a value.
const MAX_PROPERTY_NAME: usize = 256;

/// Arguments that fit `schema` at its top level: each required property
/// (every property where none is required) given a value of its type
/// (nested schemas, enums and formats are not followed). `None` where
/// they would be more than [`MAX_PROPERTIES`] or one's name longer than
/// [`MAX_PROPERTY_NAME`]: such a schema is answered in text rather than
/// with a call that leaves a required property out.
fn arguments_for(schema: Option<&Value>, word: &str) -> Option<Value> {
    let properties = schema.and_then(|s| s.get("properties")).and_then(Value::as_object);
    let required: Option<HashSet<&str>> = schema
        .and_then(|s| s.get("required"))
        .and_then(Value::as_array)
        .map(|names| names.iter().filter_map(Value::as_str).collect());
    let mut arguments = Map::new();
    let wanted = properties
        .into_iter()
        .flatten()
        .filter(|(name, _)| required.as_ref().is_none_or(|required| required.contains(name.as_str())));
    for (name, property) in wanted {
        if arguments.len() == MAX_PROPERTIES || name.len() > MAX_PROPERTY_NAME {
            return None;
        }
        let value = match property.get("type").and_then(Value::as_str) {
            Some("string") => Value::from(word),
            Some("integer" | "number") => Value::from(1),
            Some("boolean") => Value::Bool(true),
            Some("array") => json!([]),
            Some("object") => json!({}),
            _ => Value::Null,
        };
        arguments.insert(name.clone(), value);
    }
    Some(Value::Object(arguments))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::tokenize;

    fn weather() -> Value {
        json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city"]})
    }

    fn generator() -> Generator {
        Generator::new(&tokenize("what is the weather?"))
    }

    fn arguments(call: &Call) -> String {
        call.script.iter().filter(|(_, part)| *part == Part::Arguments).map(|(p, _)| p.as_str()).collect()
    }

    #[test]
    fn each_api_s_required_or_named_choice_makes_a_call_to_its_tool() {
        let chat_tools = json!([{"type": "function", "function": {"name": "other", "parameters": {}}},
                                {"type": "function", "function": {"name": "get_weather", "parameters": weather()}}]);
        let named =
            json!({"tools": chat_tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        let call = Call::required(Kind::Chat, &named, generator()).unwrap();
        assert_eq!(call.name, "get_weather");
        let word = generator().piece(2);
        assert_eq!(arguments(&call), format!(r#"{{"city":"{word}"}}"#));
        let required = json!({"tools": chat_tools, "tool_choice": "required"});
        assert_eq!(Call::required(Kind::Chat, &required, generator()).unwrap().name, "other");

        let messages = json!({"tools": [{"name": "get_weather", "input_schema": weather()}],
                              "tool_choice": {"type": "any"}});
        assert_eq!(Call::required(Kind::Messages, &messages, generator()).unwrap().name, "get_weather");
        let responses = json!({"tools": [{"type": "function", "name": "get_weather", "parameters": weather()}],
                               "tool_choice": {"type": "function", "name": "get_weather"}});
        assert_eq!(Call::required(Kind::Responses, &responses, generator()).unwrap().name, "get_weather");
    }

    #[test]
    fn a_choice_that_requires_nothing_or_names_no_tool_offered_makes_none() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": weather()}}]);
        for choice in
            [json!("auto"), json!("none"), json!({"type": "function", "function": {"name": "nope"}}), json!(7)]
        {
            assert!(Call::required(Kind::Chat, &json!({"tools": tools, "tool_choice": choice}), generator()).is_none());
        }
        assert!(Call::required(Kind::Chat, &json!({"tools": tools}), generator()).is_none());
        assert!(Call::required(Kind::Chat, &json!({"tool_choice": "required"}), generator()).is_none());
        let auto = json!({"tools": [{"name": "get_weather"}], "tool_choice": {"type": "auto"}});
        assert!(Call::required(Kind::Messages, &auto, generator()).is_none());
        for name in ["", "a b", "get_\"weather", &"x".repeat(65)] {
            let odd = json!({"tools": [{"name": name}], "tool_choice": {"type": "any"}});
            assert!(Call::required(Kind::Messages, &odd, generator()).is_none(), "{name}");
        }
        // At the bounds, a call: as many properties as may be given, a
        // name as long as may be, more properties of which few are required.
        let most: Map<String, Value> =
            (0..MAX_PROPERTIES).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
        let longest: Map<String, Value> =
            [("x".repeat(MAX_PROPERTY_NAME), json!({"type": "string"}))].into_iter().collect();
        let few = json!({"type": "object", "required": ["p0"], "properties":
            (0..=MAX_PROPERTIES).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect::<Map<String, Value>>()});
        for schema in
            [json!({"type": "object", "properties": most}), json!({"type": "object", "properties": longest}), few]
        {
            let req = json!({"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}});
            assert!(Call::required(Kind::Messages, &req, generator()).is_some(), "{schema}");
        }
        // A schema whose required properties cannot all be given a value.
        let many: Map<String, Value> =
            (0..=MAX_PROPERTIES).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
        let long: Map<String, Value> =
            [("x".repeat(MAX_PROPERTY_NAME + 1), json!({"type": "string"}))].into_iter().collect();
        for properties in [many, long] {
            let schema = json!({"type": "object", "properties": properties});
            let req = json!({"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}});
            assert!(Call::required(Kind::Messages, &req, generator()).is_none());
        }
        // Names a tool could not have are still a property's.
        let schema = json!({"type": "object", "properties": {"user.name": {"type": "string"}}});
        let req = json!({"tools": [{"name": "f", "input_schema": schema}], "tool_choice": {"type": "any"}});
        assert!(arguments(&Call::required(Kind::Messages, &req, generator()).unwrap()).contains("user.name"));
    }

    #[test]
    fn the_script_is_what_the_history_renders_after_the_text() {
        let req =
            json!({"tools": [{"name": "get-weather", "input_schema": weather()}], "tool_choice": {"type": "any"}});
        let call = Call::required(Kind::Messages, &req, generator()).unwrap();
        let text: String = call.script.iter().filter(|(_, p)| *p == Part::Text).map(|(p, _)| p.as_str()).collect();
        let written: String = call.script.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(written, format!("{text}{}", render(&call.name, &arguments(&call))));
        assert!(written.contains(r#"{"name": "get-weather", "arguments": {"city":"#), "{written}");
        // Each piece is one token of what was written.
        assert_eq!(tokenize(&written).len(), call.script.len());
    }
}
