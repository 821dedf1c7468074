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
            let client_url = format!("http://127.0.0.1:{client_port}");
            let peer_url = format!("http://127.0.0.1:{peer_port}");
            let command = vec![
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
            let child = spawn(&command, &dir);
            let mut etcd = Etcd { child, dir, client_url, command };
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
            let options = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_millis(500));
            if let Ok(mut client) = etcd_client::Client::connect([self.client_url.as_str()], Some(options)).await
                && client.status().await.is_ok()
            {
                return true;
            }
            // etcd has no readiness event to await from outside the process.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
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
