use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A real etcd server on free loopback ports with a throwaway data dir,
/// killed when dropped.
pub struct Etcd {
    child: Child,
    dir: PathBuf,
    client_url: String,
    command: Vec<String>,
    /// How to reach it: TLS where it serves it, a user where it signs
    /// clients in.
    options: etcd_client::ConnectOptions,
}

/// How an etcd guards its clients' port beyond plain HTTP.
#[derive(Default)]
pub struct Guard<'a> {
    /// Serve TLS and take only clients with a certificate it signed.
    pub tls: Option<&'a EtcdTls>,
    /// Sign clients' tokens as JWTs of this key, which run out.
    pub jwt: Option<&'a EtcdJwt>,
}

/// The key an etcd signs its tokens with (ES256), and how long they
/// last: past it, a client must sign in again.
pub struct EtcdJwt {
    pub private_key: PathBuf,
    pub public_key: PathBuf,
    pub ttl: Duration,
}

/// The files of an etcd that serves TLS and asks clients for a
/// certificate signed by `ca`.
pub struct EtcdTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn etcd_binary() -> PathBuf {
    let from_env = std::env::var_os("INFERYES_ETCD_BIN").map(PathBuf::from);
    let found = from_env.or_else(|| {
        std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| PathBuf::from(dir).join("etcd")).find(|p| p.is_file())
    });
    match found {
        Some(path) => path,
        None => panic!(
            "etcd is required by the integration tests and was not found: install Debian's etcd-server \
             (`apt-get install -y etcd-server`) or set INFERYES_ETCD_BIN to an etcd binary"
        ),
    }
}

impl Etcd {
    pub async fn start() -> Etcd {
        Self::start_guarded(Guard::default()).await
    }

    /// An etcd whose clients' port serves TLS and takes only clients with
    /// a certificate `tls.ca` signed.
    pub async fn start_tls(tls: &EtcdTls) -> Etcd {
        Self::start_guarded(Guard { tls: Some(tls), ..Guard::default() }).await
    }

    pub async fn start_guarded(guard: Guard<'_>) -> Etcd {
        let Guard { tls, jwt } = guard;
        let binary = etcd_binary();
        // An external process needs its ports up front; a port taken in the
        // meantime makes etcd exit, and then we try new ones.
        for _ in 0..5 {
            // Below the ephemeral range: free again for a restart.
            let client_port = crate::ports::stable_port();
            let peer_port = crate::ports::stable_port();
            let dir = std::env::temp_dir().join(format!("inferyes-etcd-{}-{client_port}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("etcd data dir");
            let scheme = if tls.is_some() { "https" } else { "http" };
            let client_url = format!("{scheme}://127.0.0.1:{client_port}");
            let peer_url = format!("http://127.0.0.1:{peer_port}");
            let mut command = vec![
                binary.display().to_string(),
                "--name=test".into(),
                format!("--data-dir={}", dir.join("data").display()),
                format!("--listen-client-urls={client_url}"),
                format!("--advertise-client-urls={client_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=test={peer_url}"),
                // As every etcd the project starts (docs/operations.md).
                "--auto-compaction-mode=periodic".into(),
                "--auto-compaction-retention=5m".into(),
                "--quota-backend-bytes=2147483648".into(),
            ];
            if let Some(jwt) = jwt {
                command.push(format!(
                    "--auth-token=jwt,pub-key={},priv-key={},sign-method=ES256,ttl={}ms",
                    jwt.public_key.display(),
                    jwt.private_key.display(),
                    jwt.ttl.as_millis()
                ));
            }
            let mut options = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_millis(500));
            if let Some(tls) = tls {
                command.extend([
                    format!("--cert-file={}", tls.cert.display()),
                    format!("--key-file={}", tls.key.display()),
                    format!("--trusted-ca-file={}", tls.ca.display()),
                    "--client-cert-auth".into(),
                ]);
                let read = |path: &PathBuf| std::fs::read(path).expect("a PEM file");
                options = options.with_tls(
                    etcd_client::TlsOptions::new()
                        .ca_certificate(etcd_client::Certificate::from_pem(read(&tls.ca)))
                        .identity(etcd_client::Identity::from_pem(read(&tls.cert), read(&tls.key))),
                );
            }
            let child = spawn(&command, &dir);
            let mut etcd = Etcd { child, dir, client_url, command, options };
            if etcd.wait_ready().await {
                return etcd;
            }
        }
        panic!("etcd did not become ready on any of 5 port pairs");
    }

    async fn wait_ready(&mut self) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut client) = self.client().await
                && client.status().await.is_ok()
            {
                return true;
            }
            // etcd has no readiness event to await from outside the process.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// A client of it, as its tests' own.
    pub async fn client(&self) -> Result<etcd_client::Client, etcd_client::Error> {
        etcd_client::Client::connect([self.client_url.as_str()], Some(self.options.clone())).await
    }

    /// Turns authentication on, with a `root` user of `password`: every
    /// client must sign in from now on.
    pub async fn enable_auth(&mut self, password: &str) {
        let mut client = self.client().await.expect("etcd reachable");
        client.user_add("root", password, None).await.expect("the root user added");
        client.user_grant_role("root", "root").await.expect("the root role granted");
        client.auth_enable().await.expect("authentication on");
        self.options = self.options.clone().with_user("root", password);
    }

    /// The etcd process, to read its CPU time.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn endpoint(&self) -> String {
        self.client_url.clone()
    }

    /// Kills etcd, as a crash or a network cut would look to its clients.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops etcd's process where it stands (SIGSTOP): its connections
    /// stay open and nothing it was asked is answered, as a stalled disk
    /// or a long pause would look to its clients.
    pub fn pause(&self) {
        self.signal(rustix::process::Signal::STOP);
    }

    /// Lets a paused etcd go on (SIGCONT).
    pub fn resume(&self) {
        self.signal(rustix::process::Signal::CONT);
    }

    fn signal(&self, signal: rustix::process::Signal) {
        let pid = i32::try_from(self.child.id()).ok().and_then(rustix::process::Pid::from_raw).expect("etcd's pid");
        rustix::process::kill_process(pid, signal).expect("etcd signalled");
    }

    /// Starts etcd again on the same ports and data.
    pub async fn restart(&mut self) {
        self.child = spawn(&self.command, &self.dir);
        assert!(self.wait_ready().await, "etcd did not come back");
    }
}

fn spawn(command: &[String], dir: &std::path::Path) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("etcd.log")).expect("etcd log file");
    Command::new(&command[0])
        .args(&command[1..])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", command[0]))
}

impl Drop for Etcd {
    fn drop(&mut self) {
        // A paused process is killed all the same.
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
