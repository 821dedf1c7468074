//! What every Inferyes binary reads from files the same way: its TOML
//! configuration, and tokens (the fleet's join token, admin tokens).

use std::path::Path;

use serde::de::DeserializeOwned;

/// Reads a TOML configuration file; `T::default()` when there is none.
/// Errors name the file and, from the parser, the offending key.
pub fn load_toml<T: DeserializeOwned + Default>(path: Option<&Path>) -> anyhow::Result<T> {
    use anyhow::Context;
    let Some(path) = path else { return Ok(T::default()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))
}

/// Whether a shared-secret check is on (`token`, the default) or
/// explicitly off (`none`, for trusted networks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TokenAuth {
    #[default]
    Token,
    None,
}

/// Tokens shorter than this are refused: they would be guessable.
const MIN_TOKEN_CHARS: usize = 16;

/// A shared secret (admin or join token) to present: the value given
/// directly (from the environment), else the first line of `file`. Never
/// logged.
pub fn read_token(value: Option<&str>, file: Option<&Path>, what: &str) -> anyhow::Result<Option<String>> {
    Ok(read_tokens(value, file, what)?.and_then(|tokens| tokens.into_iter().next()))
}

/// A password kept in `file`: its first line, as written (spaces too), a
/// line end left off.
pub fn read_password(file: &Path, what: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read the {what} from {}", file.display()))?;
    let password = text.lines().next().unwrap_or_default();
    anyhow::ensure!(!password.is_empty(), "the {what} file {} is empty", file.display());
    Ok(password.to_string())
}

/// The tokens a shared secret may be: the value given directly, else every
/// line of `file`, the first being the one presented. Several lines let a
/// token be rotated without a moment in which two parts of the fleet refuse
/// each other: add the new one below, then move it to the top, then remove
/// the old one, restarting everything between steps.
pub fn read_tokens(value: Option<&str>, file: Option<&Path>, what: &str) -> anyhow::Result<Option<Vec<String>>> {
    use anyhow::Context;
    let tokens: Vec<String> = match (value, file) {
        (Some(value), _) => vec![value.trim().to_string()],
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("cannot read the {what} from {}", file.display()))?
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(str::to_string)
            .collect(),
        (None, None) => return Ok(None),
    };
    anyhow::ensure!(!tokens.is_empty(), "the {what} file is empty");
    for token in &tokens {
        anyhow::ensure!(
            token.len() >= MIN_TOKEN_CHARS && token.chars().all(|c| c.is_ascii_graphic()),
            "the {what} must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces \
             (e.g. `head -c 32 /dev/urandom | base64 | tr -d '=+/'`)"
        );
    }
    Ok(Some(tokens))
}
