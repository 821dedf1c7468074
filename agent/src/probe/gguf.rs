//! Just enough of a GGUF file's header to tell whether its model uses
//! sliding-window attention, whose slots move only with `--swa-full`.
//! Pure: it reads bytes already read.

/// What the header says, or why it could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// The model attends over a sliding window of this many tokens.
    Sliding(u64),
    /// Every key read, none of a sliding window.
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file")]
    NotGguf,
    #[error("GGUF version {0} is not read")]
    Version(u32),
    #[error("the metadata runs past the bytes read")]
    Truncated,
    #[error("a metadata value of unknown type {0}")]
    UnknownType(u32),
}

/// Metadata keys a header may hold at most: more is not a model file.
const MAX_KEYS: u64 = 1 << 20;

/// Reads the metadata keys of a GGUF header (versions 2 and 3) until one
/// names a sliding window (`<arch>.attention.sliding_window`, non-zero).
pub fn window(bytes: &[u8]) -> Result<Window, GgufError> {
    let mut reader = Reader { bytes, at: 0 };
    if reader.take(4)? != b"GGUF" {
        return Err(GgufError::NotGguf);
    }
    let version = reader.u32()?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version(version));
    }
    let _tensors = reader.u64()?;
    let keys = reader.u64()?;
    if keys > MAX_KEYS {
        return Err(GgufError::NotGguf);
    }
    for _ in 0..keys {
        let key = reader.string()?;
        let kind = reader.u32()?;
        if key.ends_with(b".attention.sliding_window") {
            let size = reader.integer(kind)?;
            if size > 0 {
                return Ok(Window::Sliding(size));
            }
        } else {
            reader.skip_value(kind, 0)?;
        }
    }
    Ok(Window::Full)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], GgufError> {
        let n = usize::try_from(n).map_err(|_| GgufError::Truncated)?;
        let end = self.at.checked_add(n).filter(|end| *end <= self.bytes.len()).ok_or(GgufError::Truncated)?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        let bytes = self.take(4)?;
        Ok(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        let bytes = self.take(8)?;
        let mut array = [0u8; 8];
        array.copy_from_slice(bytes);
        Ok(u64::from_le_bytes(array))
    }

    fn string(&mut self) -> Result<&'a [u8], GgufError> {
        let len = self.u64()?;
        self.take(len)
    }

    /// An unsigned or signed integer value of type `kind`, negatives as 0.
    fn integer(&mut self, kind: u32) -> Result<u64, GgufError> {
        let bytes = self.take(fixed_size(kind).ok_or(GgufError::UnknownType(kind))?)?;
        let mut array = [0u8; 8];
        array[..bytes.len()].copy_from_slice(bytes);
        let value = u64::from_le_bytes(array);
        let signed = matches!(kind, 1 | 3 | 5 | 11);
        let negative = signed && bytes.last().is_some_and(|b| b & 0x80 != 0);
        Ok(match kind {
            0..=5 | 10 | 11 if !negative => value,
            _ => 0,
        })
    }

    fn skip_value(&mut self, kind: u32, depth: u8) -> Result<(), GgufError> {
        match kind {
            8 => {
                self.string()?;
            }
            9 => {
                // Arrays of arrays are allowed, but not without end.
                if depth > 4 {
                    return Err(GgufError::UnknownType(kind));
                }
                let item = self.u32()?;
                let count = self.u64()?;
                match fixed_size(item) {
                    Some(size) => {
                        self.take(size.checked_mul(count).ok_or(GgufError::Truncated)?)?;
                    }
                    None => {
                        for _ in 0..count {
                            self.skip_value(item, depth + 1)?;
                        }
                    }
                }
            }
            _ => {
                self.take(fixed_size(kind).ok_or(GgufError::UnknownType(kind))?)?;
            }
        }
        Ok(())
    }
}

/// The size of a fixed-size value of GGUF type `kind`.
fn fixed_size(kind: u32) -> Option<u64> {
    match kind {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(keys: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend(3u32.to_le_bytes());
        bytes.extend(0u64.to_le_bytes());
        bytes.extend((keys.len() as u64).to_le_bytes());
        for (key, kind, value) in keys {
            bytes.extend((key.len() as u64).to_le_bytes());
            bytes.extend(key.as_bytes());
            bytes.extend(kind.to_le_bytes());
            bytes.extend(value);
        }
        bytes
    }

    fn string(text: &str) -> Vec<u8> {
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend(text.as_bytes());
        bytes
    }

    fn strings(items: &[&str]) -> Vec<u8> {
        let mut bytes = 8u32.to_le_bytes().to_vec();
        bytes.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|item| bytes.extend(string(item)));
        bytes
    }

    #[test]
    fn a_sliding_window_is_found_past_strings_and_arrays() {
        let bytes = header(&[
            ("general.architecture", 8, string("gemma3")),
            ("tokenizer.ggml.tokens", 9, strings(&["<bos>", "a", "b"])),
            ("gemma3.context_length", 4, 32_768u32.to_le_bytes().to_vec()),
            ("gemma3.attention.sliding_window", 4, 512u32.to_le_bytes().to_vec()),
        ]);
        assert_eq!(window(&bytes), Ok(Window::Sliding(512)));
        let full = header(&[("general.architecture", 8, string("llama")), ("llama.block_count", 4, vec![16, 0, 0, 0])]);
        assert_eq!(window(&full), Ok(Window::Full));
        let zero = header(&[("x.attention.sliding_window", 4, vec![0; 4])]);
        assert_eq!(window(&zero), Ok(Window::Full), "a window of 0 is none");
    }

    #[test]
    fn damaged_headers_are_errors_never_a_guess_or_a_panic() {
        let bytes = header(&[
            ("general.architecture", 8, string("gemma3")),
            ("gemma3.attention.sliding_window", 4, 512u32.to_le_bytes().to_vec()),
        ]);
        for cut in 0..bytes.len() - 1 {
            assert!(window(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(window(b"GGML\x03\0\0\0"), Err(GgufError::NotGguf));
        let mut lying = b"GGUF".to_vec();
        lying.extend(3u32.to_le_bytes());
        lying.extend(0u64.to_le_bytes());
        lying.extend(1u64.to_le_bytes());
        lying.extend(u64::MAX.to_le_bytes());
        assert_eq!(window(&lying), Err(GgufError::Truncated), "a key longer than the file");
        let unknown = header(&[("a", 99, vec![0; 8])]);
        assert_eq!(window(&unknown), Err(GgufError::UnknownType(99)));
    }
}
