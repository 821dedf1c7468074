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

/// The boundary of a `multipart/form-data` content type, where its
/// parameters are plain (see [`params`]) and name it once.
pub fn boundary(content_type: &str) -> Option<&str> {
    let (media, rest) = content_type.split_once(';')?;
    if !media.trim_matches(' ').eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    let mut boundary = None;
    for (name, value) in params(rest.as_bytes())? {
        if name.eq_ignore_ascii_case(b"boundary") && boundary.replace(value).is_some() {
            return None;
        }
    }
    let boundary = std::str::from_utf8(boundary?).ok()?;
    // RFC 2046: 1 to 70 of its characters, not ending with a space.
    let plain = boundary.bytes().all(|c| c.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(&c));
    (!boundary.is_empty() && boundary.len() <= 70 && !boundary.ends_with(' ') && plain).then_some(boundary)
}

/// A header's `; name=value` parameters, where they are plain: each a token
/// name (no `*`: RFC 2231's encoded and continued forms) and a token or a
/// quoted string without `"`, `\`, `;` or bytes past ASCII, each name
/// once, separated by `;` and spaces only. Another parser (Go's
/// `mime.ParseMediaType`) reads those as this one does; anything else,
/// `None`.
const MAX_PARAMS: usize = 8;

fn params(mut text: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    let token = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'+-.^_`|~".contains(b);
    let mut params: Vec<(&[u8], &[u8])> = Vec::new();
    loop {
        text = text.trim_ascii_start();
        if text.is_empty() {
            return Some(params);
        }
        let name_len = text.iter().take_while(|b| token(b)).count();
        let (name, rest) = text.split_at(name_len);
        let rest = rest.strip_prefix(b"=")?;
        let (value, rest) = match rest.strip_prefix(b"\"") {
            Some(quoted) => {
                let end = quoted.iter().position(|b| *b == b'"')?;
                let value = &quoted[..end];
                if value.iter().any(|b| matches!(b, b'\\' | b';') || !(b' '..=b'~').contains(b)) {
                    return None;
                }
                (value, &quoted[end + 1..])
            }
            None => {
                let len = rest.iter().take_while(|b| token(b)).count();
                if len == 0 {
                    return None;
                }
                rest.split_at(len)
            }
        };
        // A few at most: a form's parts name two, its type one or two.
        if name.is_empty()
            || params.len() == MAX_PARAMS
            || params.iter().any(|(seen, _)| seen.eq_ignore_ascii_case(name))
        {
            return None;
        }
        params.push((name, value));
        let rest = rest.trim_ascii_start();
        text = match rest.strip_prefix(b";") {
            Some(next) => next,
            None if rest.is_empty() => rest,
            None => return None,
        };
    }
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
        if let Some(after) = rest.strip_prefix(b"--") {
            // The close delimiter: padding, then the line's end or the
            // body's (anything else, Go refuses).
            let after = &after[after.iter().take_while(|b| matches!(b, b' ' | b'\t')).count()..];
            if after.is_empty() || after.starts_with(b"\r\n") {
                return Ok(fields);
            }
            return Err(FormError::Malformed("the close delimiter is followed by more than padding"));
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
/// tab), of printable ASCII and spaces only: one pass.
fn plain_headers(headers: &[u8]) -> bool {
    let folded = |at: usize| headers.get(at).is_some_and(|b| matches!(b, b' ' | b'\t'));
    !folded(0)
        && headers.iter().enumerate().all(|(i, b)| match b {
            b'\r' => headers.get(i + 1) == Some(&b'\n'),
            b'\n' => i > 0 && headers[i - 1] == b'\r' && !folded(i + 1),
            b' '..=b'~' => true,
            _ => false,
        })
}

/// The `name` of a part's first `Content-Disposition: form-data`, if it is
/// a field: a part that names a file (a `filename` that is not empty) is
/// not. Refused where the disposition's parameters are not plain, name
/// other than `name` and `filename`, or a filename is empty (another parser
/// reads such a part as a field); and where a part is encoded
/// (`Content-Transfer-Encoding` other than `7bit`, `8bit`, `binary`), which
/// another parser decodes.
fn field_name(headers: &[u8]) -> Result<Option<&[u8]>, FormError> {
    let refused = |what| Err(FormError::Malformed(what));
    let mut disposition = None;
    for line in headers.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            return refused("a part's header has no colon");
        };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"content-transfer-encoding")
            && !["7bit", "8bit", "binary"].iter().any(|plain| value.eq_ignore_ascii_case(plain.as_bytes()))
        {
            return refused("a part is encoded");
        }
        if name.eq_ignore_ascii_case(b"content-disposition") && disposition.is_none() {
            disposition = Some(value);
        }
    }
    let Some(disposition) = disposition else { return Ok(None) };
    let (kind, rest) = match disposition.iter().position(|b| *b == b';') {
        Some(at) => (disposition[..at].trim_ascii(), &disposition[at + 1..]),
        None => (disposition, &disposition[disposition.len()..]),
    };
    if !kind.eq_ignore_ascii_case(b"form-data") {
        return Ok(None);
    }
    let Some(params) = params(rest) else { return refused("a part's Content-Disposition is not plain") };
    let (mut name, mut file) = (None, false);
    for (key, value) in params {
        if key.eq_ignore_ascii_case(b"name") {
            name = Some(value);
        } else if key.eq_ignore_ascii_case(b"filename") && !value.is_empty() {
            file = true;
        } else {
            return refused("a part's Content-Disposition has more than a name and a filename");
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
        // Parameters other parsers read another way.
        for content_type in [
            "multipart/form-data; boundary=bar; boundary*=utf-8''foo",
            "multipart/form-data; x=\"; boundary=foo;\"; boundary=bar",
            "multipart/form-data; boundary=a; BOUNDARY=b",
            "multipart/form-data;; boundary=a",
            "multipart/form-data; boundary",
            "multipart/form-data; boundary=b; charset=",
        ] {
            assert_eq!(boundary(content_type), None, "{content_type}");
        }
        for (headers, what) in [
            ("Content-Disposition: form-data; name=\"model\"; filename=\"\"", "an empty filename is a field to Go"),
            ("Content-Disposition: form-data; x=\"; name=zzz;\"; name=model", "a quoted ;"),
            ("Content-Disposition: form-data;\u{a0}name=\"model\"", "a space past ASCII"),
            ("Content-Disposition: form-data; name=\"model\"; NAME=\"x\"", "a name twice"),
            (
                "Content-Disposition: form-data; name=\"model\"\r\nContent-Transfer-Encoding: quoted-printable",
                "encoded",
            ),
        ] {
            let body = part(headers, "m");
            assert!(matches!(scan(body.as_bytes(), "XyZ"), Err(FormError::Malformed(_))), "{what}: {body:?}");
        }
        assert!(matches!(scan(b"--XyZ\r\nno colon\r\n\r\nm\r\n--XyZ--\r\n", "XyZ"), Err(FormError::Malformed(_))));
        let closed =
            |end: &str| format!("--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--XyZ--{end}");
        assert_eq!(scan(closed(" \r\nepilogue").as_bytes(), "XyZ").unwrap().model, Some("m"));
        assert!(scan(closed("junk").as_bytes(), "XyZ").is_err(), "Go refuses text after the close delimiter");
        let many: String = (0..100).map(|i| format!("; p{i}=1")).collect();
        let many = part(&format!("Content-Disposition: form-data{many}"), "m");
        assert!(scan(many.as_bytes(), "XyZ").is_err(), "a few parameters at most");
        // Many header lines are read in one pass: at once, not in hours.
        let many = format!("--XyZ\r\n{}\r\nm\r\n--XyZ--\r\n", "a: b\r\n".repeat(1 << 16));
        assert_eq!(scan(many.as_bytes(), "XyZ").unwrap().model, None);
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
