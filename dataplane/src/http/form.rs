//! The routing fields of a `multipart/form-data` body (an upload: audio
//! to transcribe, an image to edit): its `model` and `stream` fields, read
//! from the parts' headers and values without copying the body. The parts
//! after them (the file) are only searched for their delimiters.
//!
//! The body goes on as it came, and the server behind reads it with a
//! parser of its own (llama-swap: Go's `mime/multipart`): where two parsers
//! could read one body two ways, a client could be routed and checked for
//! one model and served another. So only a plain subset is taken: CRLF line
//! ends, headers in every part and never folded, a boundary of RFC 2046's
//! characters, `Content-Disposition` parameters with no encoded (`name*`)
//! or escaped forms; a part that names a file is a file, never a field.

use std::ops::Range;

/// What routing reads of a form.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FormFields<'a> {
    pub model: Option<&'a str>,
    /// Where the model's value stands in the body: an alias is rewritten
    /// there.
    pub model_span: Option<Range<usize>>,
    pub stream: bool,
}

/// Why a form was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum FormError {
    /// The body is not parts delimited by the boundary.
    Malformed(&'static str),
    /// A routing field given twice: which backend reads which is unknown.
    Duplicate(&'static str),
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<&str> {
    let mut params = content_type.split(';');
    let media = params.next()?.trim();
    if !media.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params
        .find_map(|param| {
            let (name, value) = param.split_once('=')?;
            name.trim().eq_ignore_ascii_case("boundary").then(|| unquote(value.trim()))
        })
        // RFC 2046: 1 to 70 of its characters, not ending with a space.
        .filter(|b| {
            !b.is_empty()
                && b.len() <= 70
                && !b.ends_with(' ')
                && b.bytes().all(|c| c.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(&c))
        })
}

fn unquote(value: &str) -> &str {
    value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value)
}

/// Reads `body`'s `model` and `stream` fields, its parts delimited by
/// `boundary`.
pub fn scan<'a>(body: &'a [u8], boundary: &str) -> Result<FormFields<'a>, FormError> {
    let delimiter = format!("--{boundary}");
    let finder = memchr::memmem::Finder::new(delimiter.as_bytes());
    // The first delimiter may have a preamble before it; every later one
    // starts a line.
    let Some(first) = finder.find(body) else { return Err(FormError::Malformed("no part starts")) };
    if first != 0 && !body[..first].ends_with(b"\r\n") {
        return Err(FormError::Malformed("the first delimiter does not start a line"));
    }
    let line_and_delimiter = format!("\r\n{delimiter}");
    let next_delimiter = memchr::memmem::Finder::new(line_and_delimiter.as_bytes());
    let mut fields = FormFields::default();
    let (mut model_seen, mut stream_seen) = (false, false);
    let mut at = first + delimiter.len();
    loop {
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            return Ok(fields);
        }
        // Transport padding, then the line's end.
        let Some(line_end) = memchr::memmem::find(rest, b"\r\n") else {
            return Err(FormError::Malformed("a delimiter line does not end"));
        };
        if rest[..line_end].iter().any(|b| !matches!(b, b' ' | b'\t')) {
            return Err(FormError::Malformed("a delimiter is followed by more than padding"));
        }
        let part_start = at + line_end + 2;
        if body[part_start..].starts_with(b"\r\n") {
            return Err(FormError::Malformed("a part has no headers"));
        }
        let Some(headers_len) = memchr::memmem::find(&body[part_start..], b"\r\n\r\n") else {
            return Err(FormError::Malformed("a part's headers do not end"));
        };
        let headers = &body[part_start..part_start + headers_len];
        if !plain_headers(headers) {
            return Err(FormError::Malformed("a part's headers are folded or not ended by CRLF"));
        }
        let value_start = part_start + headers_len + 4;
        if body[value_start..].starts_with(delimiter.as_bytes()) {
            return Err(FormError::Malformed("a part's value starts with the boundary"));
        }
        let Some(value_len) = next_delimiter.find(&body[value_start..]) else {
            return Err(FormError::Malformed("the last part is not closed"));
        };
        let value = value_start..value_start + value_len;
        match field_name(headers)? {
            Some(b"model") => {
                if std::mem::replace(&mut model_seen, true) {
                    return Err(FormError::Duplicate("model"));
                }
                let text = std::str::from_utf8(&body[value.clone()])
                    .map_err(|_| FormError::Malformed("the model field is not UTF-8"))?;
                fields.model = Some(text);
                fields.model_span = Some(value.clone());
            }
            Some(b"stream") => {
                if std::mem::replace(&mut stream_seen, true) {
                    return Err(FormError::Duplicate("stream"));
                }
                fields.stream = body[value.clone()].eq_ignore_ascii_case(b"true");
            }
            _ => {}
        }
        at = value.end + 2 + delimiter.len();
    }
}

/// Header lines ended by CRLF each, none folded (begun with a space or a
/// tab).
fn plain_headers(headers: &[u8]) -> bool {
    let folded = |line: &[u8]| line.first().is_some_and(|b| matches!(b, b' ' | b'\t'));
    headers.split(|b| *b == b'\n').enumerate().all(|(i, line)| {
        let last = i == memchr::memchr_iter(b'\n', headers).count();
        // Every line but the last (whose CRLF ends the headers) ends in CR.
        let ended = last || line.ends_with(b"\r");
        ended && !line[..line.len() - usize::from(!last)].contains(&b'\r') && !folded(line)
    })
}

/// The `name` of a part's first `Content-Disposition: form-data`, if it is
/// a field: a part that names a file is not. Refused where a parameter is
/// in a form other parsers read differently (`name*`, escapes).
fn field_name(headers: &[u8]) -> Result<Option<&[u8]>, FormError> {
    let disposition = headers.split(|b| *b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|b| *b == b':')?;
        line[..colon].eq_ignore_ascii_case(b"content-disposition").then(|| &line[colon + 1..])
    });
    let Some(disposition) = disposition else { return Ok(None) };
    let mut params = disposition.split(|b| *b == b';');
    if !params.next().is_some_and(|kind| kind.trim_ascii().eq_ignore_ascii_case(b"form-data")) {
        return Ok(None);
    }
    let (mut name, mut file) = (None, false);
    for param in params {
        let param = param.trim_ascii();
        let Some(eq) = param.iter().position(|b| *b == b'=') else { continue };
        let (key, value) = (param[..eq].trim_ascii(), param[eq + 1..].trim_ascii());
        if key.contains(&b'*') || value.contains(&b'\\') {
            return Err(FormError::Malformed("a part's Content-Disposition is encoded or escaped"));
        }
        let value = value.strip_prefix(b"\"").and_then(|v| v.strip_suffix(b"\"")).unwrap_or(value);
        if key.eq_ignore_ascii_case(b"name") {
            name.get_or_insert(value);
        } else if key.eq_ignore_ascii_case(b"filename") {
            file = true;
        }
    }
    Ok(name.filter(|_| !file))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(parts: &[(&str, &[u8])]) -> Vec<u8> {
        let mut body = Vec::new();
        for (name, value) in parts {
            body.extend_from_slice(b"--XyZ\r\n");
            let filename = if *name == "file" { "; filename=\"a.wav\"" } else { "" };
            body.extend_from_slice(format!("Content-Disposition: form-data; name=\"{name}\"{filename}\r\n").as_bytes());
            if *name == "file" {
                body.extend_from_slice(b"Content-Type: audio/wav\r\n");
            }
            body.extend_from_slice(b"\r\n");
            body.extend_from_slice(value);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(b"--XyZ--\r\n");
        body
    }

    #[test]
    fn the_boundary_is_read_from_the_content_type() {
        assert_eq!(boundary("multipart/form-data; boundary=XyZ"), Some("XyZ"));
        assert_eq!(boundary("Multipart/Form-Data;charset=utf-8; BOUNDARY=\"a b\""), Some("a b"));
        assert_eq!(boundary("application/json"), None);
        assert_eq!(boundary("multipart/form-data"), None);
        assert_eq!(boundary(&format!("multipart/form-data; boundary={}", "b".repeat(71))), None);
    }

    #[test]
    fn the_model_and_stream_are_read_wherever_they_are_and_the_file_is_not() {
        // A file that holds what looks like a field, but not a delimiter.
        let file = b"RIFF\x00\x01name=\"model\"\r\n--Xy\r\n\xff\xfe";
        let body = form(&[("file", file), ("model", b"whisper-large"), ("stream", b"true"), ("language", b"en")]);
        let fields = scan(&body, "XyZ").unwrap();
        assert_eq!(fields.model, Some("whisper-large"));
        assert_eq!(&body[fields.model_span.unwrap()], b"whisper-large");
        assert!(fields.stream);
        let body = form(&[("model", b"m"), ("file", file)]);
        assert_eq!(
            scan(&body, "XyZ").unwrap(),
            FormFields { model: Some("m"), model_span: Some(55..56), stream: false }
        );
    }

    #[test]
    fn a_form_other_parsers_could_read_another_way_is_refused() {
        let part = |headers: &str, value: &str| format!("--XyZ\r\n{headers}\r\n\r\n{value}\r\n--XyZ--\r\n");
        let nested = "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm";
        for (headers, value) in [
            ("Content-Disposition: form-data; name*=UTF-8''model", "m"),
            ("Content-Disposition: form-data; name=\"mod\\el\"", "m"),
            ("Content-Disposition: form-data;\r\n name=\"model\"", "m"),
            ("Content-Disposition: form-data; name=\"model\"\nX-Bare: lf", "m"),
            ("Content-Disposition: form-data; name=\"x\"", nested),
        ] {
            let body = part(headers, value);
            assert!(matches!(scan(body.as_bytes(), "XyZ"), Err(FormError::Malformed(_))), "{body:?}");
        }
        // A part with no headers at all.
        assert!(matches!(scan(b"--XyZ\r\n\r\nm\r\n--XyZ--\r\n", "XyZ"), Err(FormError::Malformed(_))));
        // A file named `model` is a file.
        let file = part("Content-Disposition: form-data; name=\"model\"; filename=\"m.txt\"", "m");
        assert_eq!(scan(file.as_bytes(), "XyZ").unwrap().model, None);
        // Two headers, as clients send them, are fine.
        let two = part("Content-Disposition: form-data; name=\"model\"\r\nContent-Type: text/plain", "m");
        assert_eq!(scan(two.as_bytes(), "XyZ").unwrap().model, Some("m"));
        assert_eq!(boundary("multipart/form-data; boundary=\"a\\\"b\""), None, "escaped quotes");
        assert_eq!(boundary("multipart/form-data; boundary=\"a b \""), None, "ends with a space");
    }

    #[test]
    fn forms_that_are_not_whole_or_say_a_field_twice_are_refused() {
        let whole = form(&[("model", b"m"), ("file", b"abc")]);
        assert_eq!(scan(&whole[..whole.len() - 10], "XyZ"), Err(FormError::Malformed("the last part is not closed")));
        assert!(matches!(scan(b"no parts", "XyZ"), Err(FormError::Malformed(_))));
        assert!(matches!(scan(b"junk--XyZ\r\n", "XyZ"), Err(FormError::Malformed(_))));
        let twice = form(&[("model", b"a"), ("model", b"b")]);
        assert_eq!(scan(&twice, "XyZ"), Err(FormError::Duplicate("model")));
        let not_utf8 = form(&[("model", b"\xff")]);
        assert!(matches!(scan(&not_utf8, "XyZ"), Err(FormError::Malformed(_))));
        // No model at all is the caller's to refuse.
        assert_eq!(scan(&form(&[("file", b"x")]), "XyZ").unwrap().model, None);
    }
}
