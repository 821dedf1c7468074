//! One pass over a request body that checks it is JSON and reads the few
//! fields routing needs ([`Fields`]), building nothing else. Every request
//! pays for it: a general deserializer (serde's visitors, a decoded key per
//! member, every borrowed string's UTF-8 checked again) cost several times
//! as much for a small body.
//!
//! It accepts what `serde_json` accepts for the same fields (the tests hold
//! it to that), with two differences, both stricter:
//! - the body must be an object, and each message an object (serde would
//!   also take a struct written as an array);
//! - nesting deeper than [`MAX_DEPTH`] is refused.
//!
//! Invalid UTF-8 is refused anywhere in the body, as JSON requires; serde
//! refuses it only in the strings it reads.

use std::borrow::Cow;
use std::ops::Range;

/// Containers open at once, at most.
pub const MAX_DEPTH: u32 = 128;

/// A JSON value's text, as it stands in the body.
pub type Raw<'a> = &'a str;

/// The fields routing reads. `None` where a field is missing or `null`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Fields<'a> {
    pub model: Option<Cow<'a, str>>,
    /// Where the model's name stands in the body, inside its quotes, as
    /// written (escapes and all): an alias is rewritten there.
    pub model_span: Option<Range<usize>>,
    pub stream: Option<bool>,
    pub prompt_cache_key: Option<Cow<'a, str>>,
    /// Chat: the conversation's opening, for its root.
    pub messages: Option<Opening<'a>>,
    /// Completions: the prompt, whose beginning is the conversation's root.
    pub prompt: Option<Raw<'a>>,
    /// Responses API: instructions and input.
    pub instructions: Option<Raw<'a>>,
    /// Messages API: the system prompt, beside the messages.
    pub system: Option<Raw<'a>>,
    pub input: Option<Raw<'a>>,
    /// Whether the client set stream options itself.
    pub stream_options: Option<Raw<'a>>,
    /// The body names `stream_options`, whatever it holds (`null`
    /// included): a member added beside it would make two.
    pub stream_options_named: bool,
    /// The body names `return_progress`: the client asked for llama-server's
    /// prompt progress itself (or said it does not want it).
    pub return_progress_named: bool,
    /// A string in the body (a part's type or key) is `image_url` or
    /// `input_audio`: its size is a poor measure of its tokens.
    pub has_media: bool,
    /// The output is constrained (tools, a response format, a grammar): a
    /// stream of it cannot be continued on another node.
    pub constrained: bool,
    /// Top-level members the data plane guards (`super::guard`), other
    /// than `null`: their place in its table, and their values as written.
    pub guarded: Vec<(usize, Raw<'a>)>,
}

/// What a conversation's root needs of its messages: the content of the
/// first message of each opening role (`None` inside: that message had
/// none). Read message by message: a long conversation is not kept.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Opening<'a> {
    pub system: Option<Option<Raw<'a>>>,
    pub developer: Option<Option<Raw<'a>>>,
    pub user: Option<Option<Raw<'a>>>,
}

/// Why a body was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum ScanError {
    /// Not JSON: what was wrong, and the byte offset where it was found.
    Syntax { what: &'static str, at: usize },
    /// JSON, but not an object.
    NotObject { found: &'static str },
    /// A field routing reads holds the wrong kind of value.
    Type { path: String, param: &'static str, expected: &'static str, found: &'static str },
    /// A field routing reads is given twice.
    Duplicate { path: String, param: &'static str },
}

impl ScanError {
    /// Line and column (both from 1) of a syntax error's offset in `body`.
    pub fn line_and_column(body: &[u8], at: usize) -> (usize, usize) {
        let before = &body[..at.min(body.len())];
        let line_start = memchr::memrchr(b'\n', before).map_or(0, |newline| newline + 1);
        (1 + memchr::memchr_iter(b'\n', before).count(), at - line_start + 1)
    }
}

/// Reads `body`'s routing fields, checking that the whole body is JSON.
pub fn scan(body: &[u8]) -> Result<Fields<'_>, ScanError> {
    let text = std::str::from_utf8(body)
        .map_err(|error| ScanError::Syntax { what: "invalid UTF-8", at: error.valid_up_to() })?;
    let mut scanner = Scanner { text, at: 0, media: false };
    scanner.whitespace();
    if scanner.peek() != Some(b'{') {
        // Say whether it is JSON at all before saying it is not an object.
        let found = scanner.peek().map_or("nothing", kind);
        scanner.value().and_then(|_| scanner.end()).map_err(|error| *error)?;
        return Err(ScanError::NotObject { found });
    }
    let mut fields = scanner.top().map_err(|error| *error)?;
    scanner.end().map_err(|error| *error)?;
    fields.has_media = scanner.media;
    Ok(fields)
}

/// How many prompts a `prompt` (a value [`scan`] checked, as written) asks
/// for, as llama-server reads one (b11434, `tokenize_input_prompts`): an
/// array with no integer among its elements is a prompt per element, a
/// task of the server's each; anything else (a string, tokens, strings and
/// tokens mixed) is one. An array with other numbers is counted as one
/// too: the server refuses it before it makes any task.
pub fn prompts(raw: Raw<'_>) -> usize {
    let mut scanner = Scanner { text: raw, at: 0, media: false };
    scanner.whitespace();
    if scanner.peek() != Some(b'[') {
        return 1;
    }
    scanner.at += 1;
    let mut elements = 0;
    loop {
        scanner.whitespace();
        match scanner.peek() {
            Some(b']') | None => return elements,
            // Tokens: the array is one prompt (or, not integers, refused).
            Some(b'-' | b'0'..=b'9') => return 1,
            Some(_) => {}
        }
        if scanner.value_at(1).is_err() {
            return elements.max(1);
        }
        elements += 1;
        scanner.whitespace();
        if scanner.next() != Some(b',') {
            return elements;
        }
    }
}

/// The kind of the value that starts with `byte`, for error messages.
fn kind(byte: u8) -> &'static str {
    match byte {
        b'"' => "a string",
        b'{' => "an object",
        b'[' => "an array",
        b't' | b'f' => "a boolean",
        b'n' => "null",
        b'-' | b'0'..=b'9' => "a number",
        _ => "something that is not JSON",
    }
}

struct Scanner<'a> {
    text: &'a str,
    at: usize,
    /// A string named an image or audio part.
    media: bool,
}

/// Boxed: a scan's functions return small values, in registers.
type Scanned<T> = Result<T, Box<ScanError>>;

impl<'a> Scanner<'a> {
    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    fn peek(&self) -> Option<u8> {
        self.bytes().get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek();
        self.at += 1;
        byte
    }

    fn whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.at += 1;
        }
    }

    fn syntax<T>(&self, what: &'static str) -> Scanned<T> {
        Err(Box::new(ScanError::Syntax { what, at: self.at.min(self.text.len()) }))
    }

    /// Only whitespace may follow the value.
    fn end(&mut self) -> Scanned<()> {
        self.whitespace();
        if self.at < self.text.len() { self.syntax("trailing characters") } else { Ok(()) }
    }

    /// The top-level object's members, the fields routing reads taken out.
    fn top(&mut self) -> Scanned<Fields<'a>> {
        let mut fields = Fields::default();
        let mut seen = GivenFields::default();
        let mut constraints = GivenFields::default();
        self.members(|scanner, key| {
            // Each field routing reads is read once; a second is refused.
            let mut once = |field, name: &'static str| seen.first(field, || name.into(), name);
            match &*key {
                "model" => {
                    once(0, "model")?;
                    let start = scanner.at;
                    fields.model = scanner.nullable_string(1, || "model".into(), "model")?;
                    fields.model_span = fields.model.is_some().then(|| start + 1..scanner.at - 1);
                }
                "stream" => {
                    once(1, "stream")?;
                    fields.stream = scanner.nullable_bool("stream")?;
                }
                "prompt_cache_key" => {
                    once(2, "prompt_cache_key")?;
                    fields.prompt_cache_key =
                        scanner.nullable_string(1, || "prompt_cache_key".into(), "prompt_cache_key")?;
                }
                "messages" => {
                    once(3, "messages")?;
                    fields.messages = scanner.opening()?;
                }
                raw @ ("prompt" | "instructions" | "input" | "stream_options" | "system") => {
                    // Kept as written: their text is hashed, or only seen.
                    let (field, name, slot) = match raw {
                        "prompt" => (4, "prompt", &mut fields.prompt),
                        "instructions" => (5, "instructions", &mut fields.instructions),
                        "input" => (6, "input", &mut fields.input),
                        "system" => (8, "system", &mut fields.system),
                        _ => (7, "stream_options", &mut fields.stream_options),
                    };
                    once(field, name)?;
                    *slot = scanner.nullable_value(1)?;
                    fields.stream_options_named |= field == 7;
                }
                "return_progress" => {
                    fields.return_progress_named = true;
                    // Checked by the guard, `null` as written too: only
                    // `true` is taken.
                    let raw = scanner.nullable_value(1)?.unwrap_or("null");
                    if let Some(guarded) = super::guard::index("return_progress") {
                        fields.guarded.push((guarded, raw));
                    }
                }
                other => match CONSTRAINTS.iter().position(|name| *name == other) {
                    Some(constraint) => {
                        // Given twice, it is not known which one a backend
                        // reads: constrained, to be safe.
                        let twice = constraints.again(constraint);
                        let raw = scanner.nullable_value(1)?;
                        fields.constrained |= raw.is_some() || twice;
                        // Some are held to a size too.
                        if let (Some(raw), Some(guarded)) = (raw, super::guard::index(other)) {
                            fields.guarded.push((guarded, raw));
                        }
                    }
                    None => match super::guard::index(other) {
                        Some(guarded) => {
                            if let Some(raw) = scanner.nullable_value(1)? {
                                fields.guarded.push((guarded, raw));
                            }
                        }
                        None => {
                            scanner.value_at(1)?;
                        }
                    },
                },
            }
            Ok(())
        })?;
        Ok(fields)
    }

    /// The messages' opening roles, or `None` for `null`.
    fn opening(&mut self) -> Scanned<Option<Opening<'a>>> {
        match self.peek() {
            Some(b'[') => {}
            Some(b'n') => return self.literal(b"null").map(|()| None),
            _ => return self.wrong_type(1, || "messages".into(), "messages", "an array"),
        }
        let mut opening = Opening::default();
        self.at += 1;
        self.whitespace();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(Some(opening));
        }
        for index in 0.. {
            let (role, content) = self.message(index)?;
            let first = match role.as_deref() {
                Some("system") => Some(&mut opening.system),
                Some("developer") => Some(&mut opening.developer),
                Some("user") => Some(&mut opening.user),
                _ => None,
            };
            if let Some(first) = first {
                first.get_or_insert(content);
            }
            self.whitespace();
            match self.next() {
                Some(b',') => self.whitespace(),
                Some(b']') => break,
                Some(_) => return self.back_one().syntax("expected `,` or `]`"),
                None => return self.syntax("EOF while parsing a list"),
            }
        }
        Ok(Some(opening))
    }

    /// One message's role and content.
    #[allow(clippy::type_complexity)]
    fn message(&mut self, index: usize) -> Scanned<(Option<Cow<'a, str>>, Option<Raw<'a>>)> {
        let path = |field: &str| format!("messages[{index}]{field}");
        if self.peek() != Some(b'{') {
            return self.wrong_type(2, || path(""), "messages", "an object");
        }
        let (mut role, mut content) = (None, None);
        let mut seen = GivenFields::default();
        self.members(|scanner, key| {
            match &*key {
                "role" => {
                    seen.first(0, || path(".role"), "messages")?;
                    role = scanner.nullable_string(3, || path(".role"), "messages")?;
                }
                "content" => {
                    seen.first(1, || path(".content"), "messages")?;
                    content = scanner.nullable_value(3)?;
                }
                _ => {
                    scanner.value_at(3)?;
                }
            }
            Ok(())
        })?;
        Ok((role, content))
    }

    /// An object's members (at its `{`), each key given to `member`, which
    /// reads the value.
    fn members(&mut self, mut member: impl FnMut(&mut Self, Cow<'a, str>) -> Scanned<()>) -> Scanned<()> {
        self.at += 1;
        self.whitespace();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(());
        }
        loop {
            let key = self.key()?;
            member(self, key)?;
            self.whitespace();
            match self.next() {
                Some(b',') => self.whitespace(),
                Some(b'}') => return Ok(()),
                Some(_) => return self.back_one().syntax("expected `,` or `}`"),
                None => return self.syntax("EOF while parsing an object"),
            }
        }
    }

    /// A member's key and its colon, up to its value.
    #[inline(always)]
    fn key(&mut self) -> Scanned<Cow<'a, str>> {
        match self.peek() {
            Some(b'"') => {}
            Some(_) => return self.syntax("key must be a string"),
            None => return self.syntax("EOF while parsing an object"),
        }
        let key = self.string()?;
        self.colon()?;
        Ok(key)
    }

    #[inline(always)]
    fn colon(&mut self) -> Scanned<()> {
        self.whitespace();
        match self.next() {
            Some(b':') => {
                self.whitespace();
                Ok(())
            }
            Some(_) => self.back_one().syntax("expected `:`"),
            None => self.syntax("EOF while parsing an object"),
        }
    }

    fn back_one(&mut self) -> &mut Self {
        self.at -= 1;
        self
    }

    /// The value here is not of the kind expected: said so once it is
    /// known to be JSON at all. `depth`: containers open around it.
    fn wrong_type<T>(
        &mut self,
        depth: u32,
        path: impl FnOnce() -> String,
        param: &'static str,
        expected: &'static str,
    ) -> Scanned<T> {
        let found = self.peek().map_or("nothing", kind);
        self.value_at(depth)?;
        Err(Box::new(ScanError::Type { path: path(), param, expected, found }))
    }

    fn nullable_string(
        &mut self,
        depth: u32,
        path: impl FnOnce() -> String,
        param: &'static str,
    ) -> Scanned<Option<Cow<'a, str>>> {
        match self.peek() {
            Some(b'"') => self.string().map(Some),
            Some(b'n') => self.literal(b"null").map(|()| None),
            _ => self.wrong_type(depth, path, param, "a string"),
        }
    }

    fn nullable_bool(&mut self, field: &'static str) -> Scanned<Option<bool>> {
        match self.peek() {
            Some(b't') => self.literal(b"true").map(|()| Some(true)),
            Some(b'f') => self.literal(b"false").map(|()| Some(false)),
            Some(b'n') => self.literal(b"null").map(|()| None),
            _ => self.wrong_type(1, || field.into(), field, "a boolean"),
        }
    }

    /// Any value's text, or `None` for `null`.
    fn nullable_value(&mut self, depth: u32) -> Scanned<Option<Raw<'a>>> {
        if self.peek() == Some(b'n') {
            return self.literal(b"null").map(|()| None);
        }
        self.value_at(depth).map(Some)
    }

    /// Any value, at the top.
    fn value(&mut self) -> Scanned<Raw<'a>> {
        self.value_at(0)
    }

    /// Skips any value (at its first byte), checking it, and gives its
    /// text. Nested containers are tracked in a bit stack, not by
    /// recursion. `depth`: containers already open around it.
    fn value_at(&mut self, depth: u32) -> Scanned<Raw<'a>> {
        let start = self.at;
        // Bit n: whether the container open at nesting n is an object.
        let mut objects: u128 = 0;
        let mut open: u32 = 0;
        loop {
            match self.peek() {
                Some(b'"') => self.skip_string()?,
                Some(container @ (b'{' | b'[')) => {
                    if depth + open >= MAX_DEPTH {
                        return self.syntax("nesting too deep");
                    }
                    self.at += 1;
                    self.whitespace();
                    let close = if container == b'{' { b'}' } else { b']' };
                    if self.peek() == Some(close) {
                        self.at += 1;
                    } else {
                        objects = objects & !(1 << open) | (u128::from(container == b'{') << open);
                        open += 1;
                        if container == b'{' {
                            self.key_skipped()?;
                        }
                        continue;
                    }
                }
                Some(b't') => self.literal(b"true")?,
                Some(b'f') => self.literal(b"false")?,
                Some(b'n') => self.literal(b"null")?,
                Some(b'-' | b'0'..=b'9') => self.number()?,
                Some(_) => return self.syntax("expected value"),
                None => return self.syntax("EOF while parsing a value"),
            }
            // After a value: close what ends here, up to the next element.
            loop {
                if open == 0 {
                    return Ok(&self.text[start..self.at]);
                }
                let in_object = objects & (1 << (open - 1)) != 0;
                self.whitespace();
                match (self.next(), in_object) {
                    (Some(b','), true) => {
                        self.whitespace();
                        self.key_skipped()?;
                        break;
                    }
                    (Some(b','), false) => {
                        self.whitespace();
                        break;
                    }
                    (Some(b'}'), true) | (Some(b']'), false) => open -= 1,
                    (None, true) => return self.syntax("EOF while parsing an object"),
                    (None, false) => return self.syntax("EOF while parsing a list"),
                    (Some(_), true) => return self.back_one().syntax("expected `,` or `}`"),
                    (Some(_), false) => return self.back_one().syntax("expected `,` or `]`"),
                }
            }
        }
    }

    /// A key of an object that is skipped: checked, not decoded.
    fn key_skipped(&mut self) -> Scanned<()> {
        match self.peek() {
            Some(b'"') => self.skip_string()?,
            Some(_) => return self.syntax("key must be a string"),
            None => return self.syntax("EOF while parsing an object"),
        }
        self.colon()
    }

    fn literal(&mut self, word: &[u8]) -> Scanned<()> {
        let rest = &self.bytes()[self.at..];
        if rest.starts_with(word) {
            self.at += word.len();
            return Ok(());
        }
        // Where the word goes wrong.
        self.at += rest.iter().zip(word).take_while(|(a, b)| a == b).count();
        if self.at == self.text.len() {
            self.syntax("EOF while parsing a value")
        } else {
            self.syntax("expected ident")
        }
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`
    fn number(&mut self) -> Scanned<()> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.next() {
            Some(b'0') => {
                if matches!(self.peek(), Some(b'0'..=b'9')) {
                    return self.syntax("invalid number");
                }
            }
            Some(b'1'..=b'9') => self.digits(),
            _ => return self.back_one().syntax("invalid number"),
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return self.syntax("invalid number");
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return self.syntax("invalid number");
            }
            self.digits();
        }
        Ok(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
    }

    /// A string (at its opening quote), decoded: borrowed unless it has
    /// escapes.
    #[inline(always)]
    fn string(&mut self) -> Scanned<Cow<'a, str>> {
        let (inside, escaped) = self.string_text()?;
        if !escaped {
            return Ok(Cow::Borrowed(inside));
        }
        let start = self.at - inside.len() - 1;
        let text =
            unescape(inside).map_err(|(what, offset)| Box::new(ScanError::Syntax { what, at: start + offset }))?;
        self.media |= is_media(&text);
        Ok(Cow::Owned(text))
    }

    #[inline(always)]
    fn skip_string(&mut self) -> Scanned<()> {
        let (inside, escaped) = self.string_text()?;
        // A media name written with escapes is one too: decoded where it
        // could be one, short and with `\u` escapes only (only they give
        // letters and `_`). Most escaped strings are text with a `\n`.
        if escaped && inside.len() <= 6 * "input_audio".len() && only_unicode_escapes(inside) {
            self.media |= unescape(inside).is_ok_and(|text| is_media(&text));
        }
        Ok(())
    }

    /// Moves past a string (from its opening quote), checking its escapes
    /// and that it holds no control characters; gives its text inside the
    /// quotes, and whether it has escapes (then it is the caller's to see
    /// whether it names media).
    #[inline(always)]
    fn string_text(&mut self) -> Scanned<(&'a str, bool)> {
        let start = self.at + 1;
        let rest = self.bytes().get(start..).unwrap_or_default();
        let end = special(rest);
        if rest.get(end) == Some(&b'"') {
            // Most strings: nothing escaped.
            self.at = start + end + 1;
            let inside = &self.text[start..start + end];
            self.media |= is_media(inside);
            return Ok((inside, false));
        }
        self.at = start + end;
        self.escaped_string_end()?;
        Ok((&self.text[start..self.at - 1], true))
    }

    /// The rest of a string from its first escape (or a byte that is not
    /// allowed in it).
    #[cold]
    fn escaped_string_end(&mut self) -> Scanned<()> {
        loop {
            match self.next() {
                Some(b'"') => return Ok(()),
                Some(b'\\') => match self.next() {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {}
                    Some(b'u') => {
                        let hex = self.bytes().get(self.at..self.at + 4);
                        if !hex.is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit)) {
                            return self.syntax("invalid escape");
                        }
                        self.at += 4;
                    }
                    Some(_) => return self.back_one().syntax("invalid escape"),
                    None => return self.syntax("EOF while parsing a string"),
                },
                Some(_) => {
                    return self.back_one().syntax("control character (\\u0000-\\u001F) found while parsing a string");
                }
                None => return self.syntax("EOF while parsing a string"),
            }
            self.at += special(self.bytes().get(self.at..).unwrap_or_default());
        }
    }
}

/// Whether every escape in a string's text is a `\u` escape.
fn only_unicode_escapes(escaped: &str) -> bool {
    let bytes = escaped.as_bytes();
    memchr::memchr_iter(b'\\', bytes).all(|at| bytes.get(at + 1) == Some(&b'u'))
}

/// A string that names an image, audio or video part (a part's type or
/// key), in OpenAI's, the Responses API's or Anthropic's words.
fn is_media(text: &str) -> bool {
    matches!(text, "image_url" | "input_audio" | "image" | "input_image" | "video_url" | "input_video")
}

/// The offset of the first quote, backslash or control character in
/// `bytes` (its length if none): eight bytes at a time, the way
/// serde_json skips a string (Mycroft's zero-byte test; the first flagged
/// byte is exact).
fn special(bytes: &[u8]) -> usize {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES << 7;
    let mut chunks = bytes.chunks_exact(8);
    let mut offset = 0;
    for chunk in &mut chunks {
        let word = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
        let control = word.wrapping_sub(ONES * 0x20) & !word;
        let quote = word ^ (ONES * u64::from(b'"'));
        let quote = quote.wrapping_sub(ONES) & !quote;
        let backslash = word ^ (ONES * u64::from(b'\\'));
        let backslash = backslash.wrapping_sub(ONES) & !backslash;
        let found = (control | quote | backslash) & HIGH;
        if found != 0 {
            return offset + found.trailing_zeros() as usize / 8;
        }
        offset += 8;
    }
    offset
        + chunks
            .remainder()
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
            .unwrap_or(chunks.remainder().len())
}

/// A string's text with its escapes decoded (their syntax already
/// checked). A UTF-16 surrogate must come in a pair, as serde_json requires
/// of the strings it decodes. An error says what, and where in `escaped`.
fn unescape(escaped: &str) -> Result<String, (&'static str, usize)> {
    let mut out = String::with_capacity(escaped.len());
    let mut rest = escaped;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let here = escaped.len() - rest.len() + at;
        let wrong = |what| (what, here);
        let code = rest.as_bytes().get(at + 1).copied().ok_or(wrong("invalid escape"))?;
        rest = &rest[at + 2..];
        let decoded = match code {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let high = hex4(rest).map_err(wrong)?;
                rest = &rest[4..];
                match high {
                    0xD800..=0xDBFF => {
                        let low = rest.strip_prefix("\\u").map(hex4).transpose().map_err(wrong)?;
                        let Some(low @ 0xDC00..=0xDFFF) = low else {
                            return Err(wrong("lone leading surrogate in hex escape"));
                        };
                        rest = &rest[6..];
                        char::from_u32(0x1_0000 + ((high - 0xD800) << 10) + (low - 0xDC00))
                            .ok_or(wrong("invalid escape"))?
                    }
                    0xDC00..=0xDFFF => return Err(wrong("lone trailing surrogate in hex escape")),
                    _ => char::from_u32(high).ok_or(wrong("invalid escape"))?,
                }
            }
            _ => return Err(wrong("invalid escape")),
        };
        out.push(decoded);
    }
    out.push_str(rest);
    Ok(out)
}

/// The four hex digits at the start of `text`.
fn hex4(text: &str) -> Result<u32, &'static str> {
    let hex = text.get(..4).filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit())).ok_or("invalid escape")?;
    u32::from_str_radix(hex, 16).map_err(|_| "invalid escape")
}

/// Top-level keys that constrain the output: a stream of it cannot be
/// continued on another node.
const CONSTRAINTS: [&str; 6] = ["tools", "tool_choice", "functions", "response_format", "grammar", "json_schema"];

/// Which of an object's fields (by number, below 16) were given.
#[derive(Default)]
struct GivenFields(u16);

impl GivenFields {
    /// Marks `field` given; says whether it was before.
    fn again(&mut self, field: usize) -> bool {
        let bit = 1 << field;
        let before = self.0 & bit != 0;
        self.0 |= bit;
        before
    }

    /// The first of a field read; the second refused.
    fn first(&mut self, field: usize, path: impl FnOnce() -> String, param: &'static str) -> Scanned<()> {
        if self.again(field) {
            return Err(Box::new(ScanError::Duplicate { path: path(), param }));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde::Deserialize;
    use serde_json::value::RawValue;

    use super::*;

    /// The same fields read by serde_json: what the scanner is held to.
    #[derive(Deserialize)]
    struct Wire<'a> {
        #[serde(borrow, default)]
        model: Option<Cow<'a, str>>,
        #[serde(default)]
        stream: Option<bool>,
        #[serde(borrow, default)]
        prompt_cache_key: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        messages: Option<Messages<'a>>,
        #[serde(borrow, default)]
        prompt: Option<&'a RawValue>,
        #[serde(borrow, default)]
        instructions: Option<&'a RawValue>,
        #[serde(borrow, default)]
        input: Option<&'a RawValue>,
        #[serde(borrow, default)]
        stream_options: Option<&'a RawValue>,
        #[serde(borrow, default)]
        system: Option<&'a RawValue>,
    }

    #[derive(Deserialize)]
    struct Message<'a> {
        #[serde(borrow, default)]
        role: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        content: Option<&'a RawValue>,
    }

    #[derive(Deserialize)]
    struct Messages<'a>(#[serde(borrow)] Vec<Message<'a>>);

    fn by_serde(body: &[u8]) -> Result<Fields<'_>, serde_json::Error> {
        let wire: Wire<'_> = serde_json::from_slice(body)?;
        fn raw(value: Option<&RawValue>) -> Option<&str> {
            value.map(RawValue::get)
        }
        let messages = wire.messages.map(|Messages(messages)| {
            let mut opening = Opening::default();
            for message in messages {
                let first = match message.role.as_deref() {
                    Some("system") => &mut opening.system,
                    Some("developer") => &mut opening.developer,
                    Some("user") => &mut opening.user,
                    _ => continue,
                };
                first.get_or_insert(message.content.map(RawValue::get));
            }
            opening
        });
        // Where serde builds a document of the whole body (not where a
        // string nothing reads holds a lone surrogate), its strings tell.
        let has_media = serde_json::from_slice(body).is_ok_and(|Media(media)| media);
        // A key given twice is an error to serde: constrained, to be safe.
        let constrained = serde_json::from_slice::<Constraints>(body).map_or(true, |constraints| {
            [
                constraints.tools,
                constraints.tool_choice,
                constraints.functions,
                constraints.response_format,
                constraints.grammar,
                constraints.json_schema,
            ]
            .iter()
            .any(Option::is_some)
        });
        Ok(Fields {
            has_media,
            constrained,
            // Not serde's to say: checked on its own below.
            model_span: None,
            model: wire.model,
            stream: wire.stream,
            prompt_cache_key: wire.prompt_cache_key,
            messages,
            prompt: raw(wire.prompt),
            instructions: raw(wire.instructions),
            input: raw(wire.input),
            stream_options: raw(wire.stream_options),
            system: raw(wire.system),
            // Not serde's to say (`null` reads as absent): checked apart.
            stream_options_named: false,
            return_progress_named: false,
            // Read by the guard's own tests.
            guarded: Vec::new(),
        })
    }

    #[derive(Deserialize)]
    struct Constraints {
        tools: Option<serde::de::IgnoredAny>,
        tool_choice: Option<serde::de::IgnoredAny>,
        functions: Option<serde::de::IgnoredAny>,
        response_format: Option<serde::de::IgnoredAny>,
        grammar: Option<serde::de::IgnoredAny>,
        json_schema: Option<serde::de::IgnoredAny>,
    }

    /// Whether a key or a string anywhere in a value is a media part's:
    /// every member visited, a key given twice included.
    struct Media(bool);

    impl<'de> Deserialize<'de> for Media {
        fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Media, D::Error> {
            deserializer.deserialize_any(MediaVisitor)
        }
    }

    struct MediaVisitor;

    impl<'de> serde::de::Visitor<'de> for MediaVisitor {
        type Value = Media;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("any JSON value")
        }

        fn visit_str<E>(self, text: &str) -> Result<Media, E> {
            Ok(Media(is_media(text)))
        }

        fn visit_bool<E>(self, _: bool) -> Result<Media, E> {
            Ok(Media(false))
        }

        fn visit_i64<E>(self, _: i64) -> Result<Media, E> {
            Ok(Media(false))
        }

        fn visit_u64<E>(self, _: u64) -> Result<Media, E> {
            Ok(Media(false))
        }

        fn visit_f64<E>(self, _: f64) -> Result<Media, E> {
            Ok(Media(false))
        }

        fn visit_unit<E>(self) -> Result<Media, E> {
            Ok(Media(false))
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut items: A) -> Result<Media, A::Error> {
            let mut media = false;
            while let Some(Media(item)) = items.next_element()? {
                media |= item;
            }
            Ok(Media(media))
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut members: A) -> Result<Media, A::Error> {
            let mut media = false;
            while let Some((Media(key), Media(value))) = members.next_entry()? {
                media |= key || value;
            }
            Ok(Media(media))
        }
    }

    /// The scanner agrees with serde: what it reads, serde reads the same;
    /// what serde reads, it reads too, but for the shapes it refuses on
    /// purpose (a body or message that is not an object).
    fn agrees_with_serde(body: &[u8]) -> Result<(), TestCaseError> {
        let ours = scan(body);
        let theirs = by_serde(body);
        if let Ok(ours) = &ours {
            // The model's span is its text as written: read as a JSON
            // string, it is the model.
            let span = ours.model_span.clone();
            let written = span.map(|span| format!("\"{}\"", String::from_utf8_lossy(&body[span])));
            let read = written.map(|text| serde_json::from_str::<String>(&text).expect("a JSON string"));
            prop_assert_eq!(read.as_deref(), ours.model.as_deref());
        }
        match (&ours, &theirs) {
            (Ok(ours), Ok(theirs)) if serde_json::from_slice::<Media>(body).is_err() => {
                let theirs = Fields {
                    has_media: ours.has_media,
                    model_span: ours.model_span.clone(),
                    stream_options_named: ours.stream_options_named,
                    return_progress_named: ours.return_progress_named,
                    guarded: ours.guarded.clone(),
                    ..theirs.clone()
                };
                prop_assert_eq!(ours, &theirs)
            }
            (Ok(ours), Ok(theirs)) => {
                // Named or not, serde tells only when it holds a value.
                prop_assert!(ours.stream_options_named || theirs.stream_options.is_none());
                let theirs = Fields {
                    model_span: ours.model_span.clone(),
                    stream_options_named: ours.stream_options_named,
                    return_progress_named: ours.return_progress_named,
                    guarded: ours.guarded.clone(),
                    ..theirs.clone()
                };
                prop_assert_eq!(ours, &theirs)
            }
            (Ok(_), Err(error)) => prop_assert!(false, "scanned, but serde refused: {error}"),
            (Err(ScanError::NotObject { .. }), Ok(_)) => {}
            (Err(ScanError::Type { path, expected: "an object", .. }), Ok(_)) if path.starts_with("messages[") => {}
            (Err(error), Ok(_)) => prop_assert!(false, "serde read it, but the scanner refused: {error:?}"),
            (Err(_), Err(_)) => {}
        }
        Ok(())
    }

    fn pick(options: &'static [&'static str]) -> impl Strategy<Value = String> {
        prop::sample::select(options).prop_map(str::to_string)
    }

    fn space() -> impl Strategy<Value = String> {
        pick(&["", "", "", " ", "\n", " \t\r\n "])
    }

    fn string() -> impl Strategy<Value = String> {
        let pieces = pick(&[
            "a",
            "hi",
            "user",
            "system",
            "developer",
            "assistant",
            "model",
            "image_url",
            "input_audio",
            "image\\u005furl",
            " ",
            "é",
            "😀",
            "\\\"",
            "\\\\",
            "\\/",
            "\\n",
            "\\t",
            "\\u0041",
            "\\u00e9",
            "\\u0075ser",
            "\\ud83d\\ude00",
            "\\ud800",
            "\\udc00x",
        ]);
        prop::collection::vec(pieces, 0..4).prop_map(|pieces| format!("\"{}\"", pieces.concat()))
    }

    fn value() -> impl Strategy<Value = String> {
        let leaf =
            prop_oneof![pick(&["null", "true", "false", "0", "-1", "3.25", "1e5", "-0.5E-3", "12", "-0"]), string(),];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                prop::collection::vec((space(), inner.clone(), space()), 0..4).prop_map(|items| format!(
                    "[{}]",
                    items.into_iter().map(|(a, v, b)| a + &v + &b).collect::<Vec<_>>().join(",")
                )),
                prop::collection::vec((string(), space(), inner), 0..4).prop_map(|members| {
                    let members: Vec<_> = members.into_iter().map(|(k, s, v)| format!("{k}{s}:{s}{v}")).collect();
                    format!("{{{}}}", members.join(","))
                }),
            ]
        })
    }

    fn message() -> impl Strategy<Value = String> {
        let member = prop_oneof![
            3 => pick(&["\"user\"", "\"system\"", "\"developer\"", "\"assistant\"", "\"us\\u0065r\"", "null"])
                .prop_map(|role| format!("\"role\":{role}")),
            3 => value().prop_map(|content| format!("\"content\":{content}")),
            1 => value().prop_map(|other| format!("\"name\":{other}")),
            1 => value().prop_map(|other| format!("\"ro\\u006ce\":{other}")),
        ];
        prop_oneof![
            12 => prop::collection::vec(member, 0..4).prop_map(|members| format!("{{{}}}", members.join(","))),
            1 => value(),
        ]
    }

    /// Each field routing reads, at most once (a second is added below),
    /// and other members, in any order.
    fn members() -> impl Strategy<Value = Vec<String>> {
        let key = |key: &'static str| move |value: String| format!("\"{key}\":{value}");
        let maybe = |member: BoxedStrategy<String>| prop::option::weighted(0.5, member);
        let known = (
            maybe(
                prop_oneof![
                    8 => pick(&["\"m\"", "\"qwen/7b\"", "\"\"", "\"q\\u0077en\""]).prop_map(key("model")),
                    1 => pick(&["\"m\""]).prop_map(key("mod\\u0065l")),
                    1 => value().prop_map(key("model")),
                ]
                .boxed(),
            ),
            maybe(prop_oneof![6 => pick(&["true", "false", "null"]), 1 => value()].prop_map(key("stream")).boxed()),
            maybe(prop_oneof![6 => string(), 1 => value()].prop_map(key("prompt_cache_key")).boxed()),
            maybe(
                prop_oneof![
                    8 => prop::collection::vec(message(), 0..5).prop_map(|messages| format!("[{}]", messages.join(","))),
                    1 => value(),
                ]
                .prop_map(key("messages"))
                .boxed(),
            ),
            maybe(value().prop_map(key("prompt")).boxed()),
            maybe(value().prop_map(key("instructions")).boxed()),
            maybe(value().prop_map(key("input")).boxed()),
            maybe(value().prop_map(key("stream_options")).boxed()),
            maybe(value().prop_map(key("system")).boxed()),
        );
        let others = prop::collection::vec(
            prop_oneof![
                4 => (string(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
                1 => (pick(&["\"tools\"", "\"response_format\"", "\"grammar\""]), value())
                    .prop_map(|(k, v)| format!("{k}:{v}")),
            ],
            0..3,
        );
        (known, others, prop::option::weighted(0.1, any::<prop::sample::Index>())).prop_flat_map(
            |((a, b, c, d, e, f, g, h, i), others, again)| {
                let mut members: Vec<String> =
                    [a, b, c, d, e, f, g, h, i].into_iter().flatten().chain(others).collect();
                if let Some(again) = again.filter(|_| !members.is_empty()) {
                    members.push(members[again.index(members.len())].clone());
                }
                Just(members).prop_shuffle()
            },
        )
    }

    fn body() -> impl Strategy<Value = String> {
        (space(), members(), space(), space()).prop_map(|(before, members, between, after)| {
            format!("{before}{{{}}}{after}", members.join(&format!(",{between}")))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn bodies_read_as_serde_reads_them(body in body()) {
            agrees_with_serde(body.as_bytes())?;
        }

        /// One byte changed, added or taken out anywhere (ASCII, so the
        /// body stays UTF-8): mostly broken JSON, refused by both.
        #[test]
        fn damaged_bodies_are_refused_as_serde_refuses_them(
            body in body(),
            at in any::<prop::sample::Index>(),
            byte in prop::sample::select(b"{}[]\",:\\ 0-.eEtnu\x01x".to_vec()),
            edit in 0..3u8,
        ) {
            let mut body = body.into_bytes();
            let at = at.index(body.len() + 1);
            match edit {
                0 if at < body.len() => body[at] = byte,
                1 => body.insert(at, byte),
                _ if at < body.len() => { body.remove(at); }
                _ => body.push(byte),
            }
            if std::str::from_utf8(&body).is_ok() {
                agrees_with_serde(&body)?;
            }
        }
    }

    #[test]
    fn fields_are_read_and_the_rest_is_skipped() {
        let body = br#" {"temperature":0.2,"model":"m","stream":true,"tools":[{"a":[1,{"b":null}]}],
            "messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text"}]},
            {"role":"user","content":"again"}],"prompt_cache_key":"k","stream_options":{"include_usage":true}} "#;
        let fields = scan(body).unwrap();
        assert_eq!(fields.model.as_deref(), Some("m"));
        assert_eq!(fields.stream, Some(true));
        assert_eq!(fields.prompt_cache_key.as_deref(), Some("k"));
        let opening = fields.messages.unwrap();
        assert_eq!(opening.system, Some(Some(r#""be brief""#)));
        assert_eq!(opening.user, Some(Some(r#"[{"type":"text"}]"#)), "the first user message's content, as written");
        assert_eq!(opening.developer, None);
        assert_eq!(fields.stream_options, Some(r#"{"include_usage":true}"#));
    }

    #[test]
    fn media_names_are_seen_however_written() {
        assert!(
            scan(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#).unwrap().has_media
        );
        assert!(scan(br#"{"model":"m","input":[{"type":"input\u005faudio"}]}"#).unwrap().has_media);
        assert!(!scan(br#"{"model":"m","input":"an image_url, as text"}"#).unwrap().has_media);
        assert!(!scan(br#"{"model":"m","input":[{"type":"input\u005faudio\n"}]}"#).unwrap().has_media);
        // Only `\u` escapes can spell a media name: other escaped text is
        // not decoded to look.
        assert!(only_unicode_escapes(r"input\u005faudio") && only_unicode_escapes("plain"));
        assert!(!only_unicode_escapes(r"a\nb") && !only_unicode_escapes(r"\\u005f") && !only_unicode_escapes(r"x\"));
    }

    #[test]
    fn escaped_keys_and_names_are_decoded() {
        let fields =
            scan(br#"{"mod\u0065l":"q\u0077en\ud83d\ude00","messages":[{"r\u006fle":"us\u0065r","content":"x"}]}"#)
                .unwrap();
        assert_eq!(fields.model.as_deref(), Some("qwen😀"));
        assert!(matches!(fields.model, Some(Cow::Owned(_))));
        assert_eq!(fields.messages.unwrap().user, Some(Some(r#""x""#)));
    }

    #[test]
    fn refusals_say_what_and_where() {
        assert_eq!(scan(b"{\n  \"model\": nope}"), Err(ScanError::Syntax { what: "expected ident", at: 14 }));
        assert_eq!(ScanError::line_and_column(b"{\n  \"model\": nope}", 14), (2, 13));
        assert!(matches!(scan(b""), Err(ScanError::Syntax { what: "EOF while parsing a value", .. })));
        assert!(matches!(scan(b"{} x"), Err(ScanError::Syntax { what: "trailing characters", at: 3 })));
        assert!(matches!(scan(b"{\"a\":1,}"), Err(ScanError::Syntax { what: "key must be a string", .. })));
        assert!(matches!(scan(b"{\"a\":01}"), Err(ScanError::Syntax { what: "invalid number", .. })));
        assert!(matches!(scan(b"{\"a\":\"\x01\"}"), Err(ScanError::Syntax { .. })));
        assert!(matches!(scan(b"{\"a\":\"\xff\"}"), Err(ScanError::Syntax { what: "invalid UTF-8", at: 6 })));
        assert_eq!(scan(b" [1, 2]"), Err(ScanError::NotObject { found: "an array" }));
        assert!(matches!(scan(b"[1, 2"), Err(ScanError::Syntax { .. })), "broken JSON is a syntax error first");
        assert_eq!(
            scan(br#"{"model":3}"#),
            Err(ScanError::Type { path: "model".into(), param: "model", expected: "a string", found: "a number" })
        );
        assert_eq!(
            scan(br#"{"messages":[{"role":"user"},{"role":{}}]}"#),
            Err(ScanError::Type {
                path: "messages[1].role".into(),
                param: "messages",
                expected: "a string",
                found: "an object"
            })
        );
        assert_eq!(
            scan(br#"{"model":"a","stream":false,"model":"b"}"#),
            Err(ScanError::Duplicate { path: "model".into(), param: "model" })
        );
        assert!(matches!(scan(br#"{"model":"\ud800"}"#), Err(ScanError::Syntax { .. })), "a lone surrogate in a name");
        assert_eq!(
            scan(br#"{"model":"abcdef\ud800"}"#),
            Err(ScanError::Syntax { what: "lone leading surrogate in hex escape", at: 16 }),
            "said at its escape"
        );
        assert!(scan(br#"{"model":"m","other":"\ud800"}"#).is_ok(), "but not where nothing reads it (as serde)");
    }

    #[test]
    fn nesting_is_bounded_without_recursion() {
        let nested = |depth: usize| format!("{{\"tools\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
        assert!(scan(nested(127).as_bytes()).is_ok());
        assert!(matches!(scan(nested(128).as_bytes()), Err(ScanError::Syntax { what: "nesting too deep", .. })));
        assert!(matches!(scan(nested(100_000).as_bytes()), Err(ScanError::Syntax { what: "nesting too deep", .. })));
    }

    #[test]
    fn strings_are_skipped_eight_bytes_at_a_time_to_the_exact_byte() {
        for len in 0..40 {
            for stop in [b'"', b'\\', b'\n', 0x1f] {
                let mut bytes = vec![b'a'; len];
                bytes.push(stop);
                bytes.extend_from_slice(b"\"\\");
                assert_eq!(special(&bytes), len, "{len} bytes before {stop:#x}");
            }
            assert_eq!(special(&vec![b' '; len]), len);
            assert_eq!(special("é".repeat(len).as_bytes()), 2 * len, "UTF-8 is not special");
        }
    }
}
