//! A real headless Chromium, driven over WebDriver by Debian's
//! `chromedriver`: plain HTTP and JSON, so no driver crate is needed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use serde_json::{Value, json};

use crate::HttpClient;

/// Flags Chromium needs to run headless as root in a container.
const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
];

pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    profile: PathBuf,
    http: HttpClient,
}

fn find(name: &str, env: &str, hint: &str) -> PathBuf {
    let from_env = std::env::var_os(env).map(PathBuf::from);
    let found = from_env.or_else(|| {
        std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| PathBuf::from(dir).join(name)).find(|p| p.is_file())
    });
    found.unwrap_or_else(|| panic!("{name} is required by the dashboard test and was not found: {hint}, or set {env}"))
}

impl Browser {
    pub async fn start() -> Browser {
        let driver_bin = find("chromedriver", "INFERYES_CHROMEDRIVER", "install Debian's chromium-driver");
        let chromium = find("chromium", "INFERYES_CHROMIUM", "install Debian's chromium");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        let driver = Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", driver_bin.display()));
        let base = format!("http://127.0.0.1:{port}");
        let http = HttpClient::default();
        crate::eventually("chromedriver ready", Duration::from_secs(20), || {
            let http = http.clone();
            let url = format!("{base}/status");
            async move {
                let Ok(Ok(response)) =
                    tokio::time::timeout(Duration::from_secs(1), tokio::spawn(async move { http.get(&url).await }))
                        .await
                else {
                    return false;
                };
                response.json()["value"]["ready"] == true
            }
        })
        .await;
        let profile = std::env::temp_dir().join(format!("inferyes-chromium-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&profile);
        let mut args: Vec<String> = CHROMIUM_FLAGS.iter().map(|f| (*f).to_string()).collect();
        args.push(format!("--user-data-dir={}", profile.display()));
        let capabilities = json!({
            "capabilities": { "alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": { "binary": chromium, "args": args },
            }}
        });
        let mut browser = Browser { driver, base, session: String::new(), profile, http };
        let created = browser.call(Method::POST, "/session", &capabilities).await;
        browser.session = created["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {created}")).to_string();
        browser
    }

    async fn call(&self, method: Method, path: &str, body: &Value) -> Value {
        let url = format!("{}{path}", self.base);
        let body = if method == Method::GET { Bytes::new() } else { Bytes::from(body.to_string()) };
        let response = self.http.send(method, &url, body, &[]).await;
        let value = response.json()["value"].clone();
        assert!(response.status.is_success(), "webdriver {path}: {} {value}", response.status);
        value
    }

    pub async fn goto(&self, url: &str) {
        self.call(Method::POST, &format!("/session/{}/url", self.session), &json!({ "url": url })).await;
    }

    /// Runs `script` (a function body: `return …`) in the page.
    pub async fn eval(&self, script: &str) -> Value {
        self.call(
            Method::POST,
            &format!("/session/{}/execute/sync", self.session),
            &json!({ "script": script, "args": [] }),
        )
        .await
    }

    /// Polls `script` until it returns `true`.
    pub async fn wait_for(&self, what: &str, timeout: Duration, script: &str) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let value = self.eval(script).await;
            if value == true {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {timeout:?} waiting for: {what} (last: {value})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Saves a PNG of the page.
    pub async fn screenshot(&self, path: &Path) {
        let value = self.call(Method::GET, &format!("/session/{}/screenshot", self.session), &Value::Null).await;
        let png = base64_decode(value.as_str().expect("base64 screenshot"));
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot dir");
        }
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session quits Chromium; killing the driver alone could
        // leave it behind. Best effort, synchronously: this is a drop.
        let _ = delete_session(&self.base, &self.session);
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// `DELETE /session/<id>` over a plain socket: drop cannot await.
fn delete_session(base: &str, session: &str) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let address = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "DELETE /session/{session} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    Ok(())
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for v in text.bytes().filter_map(value) {
        buffer = (buffer << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buffer >> bits) as u8);
        }
    }
    out
}
