//! A real headless Chromium driven over the Chrome DevTools Protocol (CDP), and a TCP
//! proxy that records what a server sent, for end-to-end tests of the web console.
//!
//! The tests act as a person would: open a page, fill a form, submit it, read what came
//! back. Everything a test waits for is polled with a deadline, never slept for.
//! Chromium comes from Debian (`apt-get install chromium-headless-shell`); nothing is
//! downloaded.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::stream::SplitSink;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Where Debian puts Chromium, best first. `/usr/bin/chromium-headless-shell` is a shell
/// script that runs the real binary as its child without `exec`: killing the script
/// would leave Chromium running, so the binary itself is preferred.
const CHROMIUM: [&str; 3] = [
    "/usr/lib/chromium/chromium-headless-shell",
    "/usr/bin/chromium-headless-shell",
    "/usr/bin/chromium",
];
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(20);
const GOTO_TIMEOUT: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(50);

/// A headless Chromium with one page, killed (with its temp profile removed) on drop.
pub struct Browser {
    cdp: Cdp,
    process: Process,
}

impl Browser {
    /// Starts Chromium on a fresh profile and connects to its page. The network flags
    /// matter here: the machine has no network, and Chromium's background fetches
    /// would otherwise stall and litter the log.
    pub async fn start() -> anyhow::Result<Browser> {
        let exe = CHROMIUM
            .iter()
            .map(Path::new)
            .find(|p| p.exists())
            .with_context(|| {
                format!("no Chromium at {CHROMIUM:?}: apt-get install chromium-headless-shell")
            })?;
        let dir = tempfile::Builder::new()
            .prefix("latchkey-chromium-")
            .tempdir()?;
        let profile = dir.path().join("profile");
        let log = dir.path().join("chromium.log");
        let log_file = std::fs::File::create(&log)?;
        let child = Command::new(exe)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--remote-debugging-port=0",
                "--window-size=1280,900",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        // From here on, an early return kills Chromium through `Process`'s drop.
        let mut process = Process {
            child,
            log,
            _dir: dir,
        };
        let port = process.devtools_port(&profile).await?;
        let ws_url = page_target(port)
            .await
            .with_context(|| format!("finding a page target; {}", process.log_tail()))?;
        let mut cdp = Cdp::connect(&ws_url).await?;
        cdp.call("Page.enable", json!({})).await?;
        cdp.call("Runtime.enable", json!({})).await?;
        Ok(Browser { cdp, process })
    }

    /// Opens `url` and waits until the new document has loaded (readyState "complete").
    /// A network failure (refused, DNS, ...) is an error; an HTTP error page is not.
    pub async fn goto(&mut self, url: &str) -> anyhow::Result<()> {
        // Mark the old document, so the wait below cannot mistake it for the new one.
        // A page that is itself mid-navigation may refuse; the wait still holds then.
        let _ = self.eval("window.__latchkeyOldDocument = true").await;
        let nav = self
            .cdp
            .call("Page.navigate", json!({ "url": url }))
            .await?;
        if let Some(err) = nav
            .get("errorText")
            .and_then(Value::as_str)
            .filter(|e| !e.is_empty())
        {
            bail!("navigating to {url}: {err}");
        }
        if nav.get("loaderId").is_none() {
            return Ok(()); // A same-document (fragment) navigation: there is no new document.
        }
        let loaded = "!window.__latchkeyOldDocument && document.readyState === 'complete'";
        self.wait_for(&format!("{url} to load"), loaded, GOTO_TIMEOUT)
            .await
    }

    /// Evaluates `js` in the page (awaiting a promise result) and returns its value as
    /// JSON; `undefined` and values JSON cannot hold come back as `Null`. A thrown
    /// exception is an error carrying its description.
    pub async fn eval(&mut self, js: &str) -> anyhow::Result<Value> {
        let params = json!({ "expression": js, "returnByValue": true, "awaitPromise": true });
        let reply = self.cdp.call("Runtime.evaluate", params).await?;
        if let Some(ex) = reply.get("exceptionDetails") {
            let text = ex
                .pointer("/exception/description")
                .or_else(|| ex.get("text"));
            let text = text.and_then(Value::as_str).unwrap_or("exception");
            bail!("evaluating `{}`: {text}", clip(js, 200));
        }
        Ok(reply
            .pointer("/result/value")
            .cloned()
            .unwrap_or(Value::Null))
    }

    /// Polls the expression `js` every 50 ms until it is truthy, or fails after `timeout`
    /// saying what was waited for (`what`), where the page is and what it shows.
    /// Evaluation errors count as "not yet": a navigation destroys the context that an
    /// evaluation ran in, and waiting across navigations is the common case.
    pub async fn wait_for(
        &mut self,
        what: &str,
        js: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let expr = format!("!!({js})");
        let mut last_error = None;
        loop {
            // Bounded by the deadline: an evaluation can hang while a navigation commits.
            let left = deadline.saturating_duration_since(Instant::now()).max(POLL);
            match tokio::time::timeout(left, self.eval(&expr)).await {
                Ok(Ok(Value::Bool(true))) => return Ok(()),
                Ok(Ok(_)) => last_error = None,
                Ok(Err(err)) => last_error = Some(err),
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                break;
            }
            sleep(POLL).await;
        }
        let last = last_error
            .map(|e| format!("; last error: {e:#}"))
            .unwrap_or_default();
        let page = self.describe().await;
        bail!(
            "timed out after {timeout:?} waiting for {what} (`{}`){last}; {page}",
            clip(js, 200)
        )
    }

    /// Saves a PNG of the viewport to `path`, creating its parent directories.
    pub async fn screenshot(&mut self, path: &Path) -> anyhow::Result<()> {
        let shot = self
            .cdp
            .call("Page.captureScreenshot", json!({ "format": "png" }))
            .await?;
        let data = shot
            .get("data")
            .and_then(Value::as_str)
            .context("screenshot without data")?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, base64_decode(data)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// The page's visible text (`document.body.innerText`).
    pub async fn text(&mut self) -> anyhow::Result<String> {
        let text = self
            .eval("document.body ? document.body.innerText : ''")
            .await?;
        Ok(text.as_str().unwrap_or_default().to_owned())
    }

    /// The page's current address (`location.href`).
    pub async fn url(&mut self) -> anyhow::Result<String> {
        let href = self.eval("location.href").await?;
        Ok(href.as_str().unwrap_or_default().to_owned())
    }

    /// Forgets every cookie, so that the next sign-in starts from nothing.
    pub async fn clear_cookies(&mut self) -> anyhow::Result<()> {
        self.cdp
            .call("Network.clearBrowserCookies", json!({}))
            .await
            .map(drop)
    }

    /// The last lines of Chromium's own log, for error messages.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    /// Where the page is and the start of its text, for a failed wait. Short timeouts:
    /// this runs when something is already wrong and must not hang on its own.
    async fn describe(&mut self) -> String {
        let mut probe = async |js: &str| match timeout(Duration::from_secs(2), self.eval(js)).await
        {
            Ok(Ok(v)) => v.as_str().map_or_else(|| v.to_string(), str::to_owned),
            Ok(Err(err)) => format!("(unknown: {err:#})"),
            Err(_) => "(unknown: no answer within 2 s)".to_owned(),
        };
        let href = probe("location.href").await;
        let text = probe("document.body ? document.body.innerText : ''").await;
        format!("page at {href} shows: {:?}", clip(&text, 500))
    }
}

/// The Chromium process and its profile. Killing the main process is enough: its
/// helpers (zygotes, renderer, GPU, network service) exit when it does.
struct Process {
    child: Child,
    log: PathBuf,
    _dir: TempDir,
}

impl Process {
    /// Reads the port Chromium chose from `DevToolsActivePort` (its first line), which
    /// appears in the profile once the DevTools server listens.
    async fn devtools_port(&mut self, profile: &Path) -> anyhow::Result<u16> {
        let file = profile.join("DevToolsActivePort");
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            if let Some(Ok(port)) = text.lines().next().map(str::parse::<u16>) {
                return Ok(port);
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "Chromium exited ({status}) before listening; {}",
                    self.log_tail()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "no {} after {STARTUP_TIMEOUT:?}; {}",
                    file.display(),
                    self.log_tail()
                );
            }
            sleep(POLL).await;
        }
    }

    /// The last 20 lines of the log. The D-Bus complaints are left out: there is no
    /// D-Bus on test machines, Chromium says so on every start, and it does not matter.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|l| !l.contains("dbus")).collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        format!("Chromium's log ({}) ends:\n{tail}", self.log.display())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // Waited for, so the profile is not removed under a running Chromium.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The WebSocket address of a page target: one from `/json/list` (which also lists
/// service workers and the like), else a new one from `/json/new`.
async fn page_target(port: u16) -> anyhow::Result<String> {
    let ws_url = |target: &Value| {
        target
            .get("webSocketDebuggerUrl")?
            .as_str()
            .map(str::to_owned)
    };
    let list = http_json(port, "GET", "/json/list").await?;
    let pages = list.as_array().into_iter().flatten();
    if let Some(url) = pages
        .filter(|t| t.get("type") == Some(&json!("page")))
        .find_map(ws_url)
    {
        return Ok(url);
    }
    // Chromium answers 405 to a GET here: /json/new takes PUT only.
    let new = http_json(port, "PUT", "/json/new?about:blank").await?;
    ws_url(&new).with_context(|| format!("/json/new answered {new}"))
}

/// One HTTP/1.1 request to the DevTools server, whose answers carry a Content-Length.
async fn http_json(port: u16, method: &str, path: &str) -> anyhow::Result<Value> {
    let exchange = async {
        let mut conn = TcpStream::connect(("127.0.0.1", port)).await?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
        );
        conn.write_all(request.as_bytes()).await?;
        let mut buf = Vec::new();
        loop {
            if conn.read_buf(&mut buf).await? == 0 {
                bail!("connection closed after {} bytes", buf.len());
            }
            let text = String::from_utf8_lossy(&buf);
            let Some((head, body)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            let length = head.lines().find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse::<usize>().ok())?
            });
            if length.is_some_and(|n| body.len() < n) {
                continue;
            }
            if !head.starts_with("HTTP/1.1 200") {
                bail!("{}", head.lines().next().unwrap_or_default());
            }
            return Ok(serde_json::from_str(body)?);
        }
    };
    timeout(COMMAND_TIMEOUT, exchange)
        .await
        .with_context(|| format!("{method} {path}: no answer within {COMMAND_TIMEOUT:?}"))?
        .with_context(|| format!("{method} {path} on the DevTools port {port}"))
}

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;
/// Replies awaited, by command id; `None` once the connection has closed.
type Pending = Arc<Mutex<Option<HashMap<u64, oneshot::Sender<Value>>>>>;

/// A CDP connection: commands go out on the socket, and one reader task hands each
/// reply to the command that waits for it. Events are dropped: the polling above
/// needs none of them.
struct Cdp {
    sink: SplitSink<Ws, Message>,
    pending: Pending,
    next_id: u64,
    reader: JoinHandle<()>,
}

impl Cdp {
    async fn connect(url: &str) -> anyhow::Result<Cdp> {
        let (ws, _) = tokio_tungstenite::connect_async(url)
            .await
            .with_context(|| format!("connecting to {url}"))?;
        let (sink, mut stream) = ws.split();
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        let routes = Arc::clone(&pending);
        let reader = tokio::spawn(async move {
            while let Some(Ok(message)) = stream.next().await {
                let Message::Text(text) = message else {
                    continue;
                };
                let Ok(reply) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                let Some(id) = reply.get("id").and_then(Value::as_u64) else {
                    continue;
                };
                if let Some(waiter) = lock(&routes).as_mut().and_then(|m| m.remove(&id)) {
                    let _ = waiter.send(reply);
                }
            }
            // Dropping the senders fails every waiting command now rather than at its timeout.
            lock(&routes).take();
        });
        Ok(Cdp {
            sink,
            pending,
            next_id: 0,
            reader,
        })
    }

    /// Sends one command and returns its `result`; a CDP error, a closed connection and
    /// no reply within 20 s are errors naming the method.
    async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        self.next_id += 1;
        let id = self.next_id;
        let (tx, rx) = oneshot::channel();
        match lock(&self.pending).as_mut() {
            Some(waiting) => waiting.insert(id, tx),
            None => bail!("CDP {method}: the connection to Chromium is closed"),
        };
        let message = json!({ "id": id, "method": method, "params": params }).to_string();
        let reply = match self.sink.send(Message::text(message)).await {
            Err(err) => Err(anyhow::anyhow!("CDP {method}: sending: {err}")),
            Ok(()) => match timeout(COMMAND_TIMEOUT, rx).await {
                Ok(Ok(reply)) => Ok(reply),
                Ok(Err(_)) => Err(anyhow::anyhow!(
                    "CDP {method}: the connection to Chromium closed"
                )),
                Err(_) => Err(anyhow::anyhow!(
                    "CDP {method}: no reply within {COMMAND_TIMEOUT:?}"
                )),
            },
        };
        if let Some(waiting) = lock(&self.pending).as_mut() {
            waiting.remove(&id);
        }
        let reply = reply?;
        if let Some(err) = reply.get("error") {
            bail!(
                "CDP {method}: {}",
                err.get("message")
                    .and_then(Value::as_str)
                    .unwrap_or(&err.to_string())
            );
        }
        Ok(reply.get("result").cloned().unwrap_or(Value::Null))
    }
}

impl Drop for Cdp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Locks, ignoring poisoning: the data (byte logs, reply senders) stays valid even if a
/// holder panicked.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// At most `max` characters of `s`, for error messages.
fn clip(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

/// Decodes standard base64 (CDP's encoding of binary data); padding is ignored.
fn base64_decode(text: &str) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        let sextet = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => continue,
            _ => bail!("not base64: byte {c:#04x}"),
        };
        acc = (acc << 6) | u32::from(sextet);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Ok(out)
}

/// Bytes served, one entry per connection, in the order connections were accepted.
type Served = Arc<Mutex<Vec<Vec<u8>>>>;

/// A loopback TCP proxy that records every byte its upstream sends back, so a test can
/// check what a browser was actually served (a page, a header, an event stream).
/// Stops accepting when dropped; open connections run on until either side closes.
pub struct RecordingProxy {
    addr: SocketAddr,
    served: Served,
    accept: JoinHandle<()>,
}

impl RecordingProxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`,
    /// both ways, passing on each side's half-close to the other.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<RecordingProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let served = Served::default();
        let record = Arc::clone(&served);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let index = {
                    let mut all = lock(&record);
                    all.push(Vec::new());
                    all.len() - 1
                };
                let record = Arc::clone(&record);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    let requests = async {
                        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                        let _ = server_write.shutdown().await;
                    };
                    let responses = async {
                        let mut buf = vec![0u8; 16 * 1024];
                        while let Ok(n @ 1..) = server_read.read(&mut buf).await {
                            let chunk = &buf[..n];
                            if let Some(bytes) = lock(&record).get_mut(index) {
                                bytes.extend_from_slice(chunk);
                            }
                            if client_write.write_all(chunk).await.is_err() {
                                break;
                            }
                        }
                        let _ = client_write.shutdown().await;
                    };
                    tokio::join!(requests, responses);
                });
            }
        });
        Ok(RecordingProxy {
            addr,
            served,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every byte the upstream has sent so far, connection after connection, including
    /// connections still open (such as a Server-Sent Events stream).
    pub fn served(&self) -> Vec<u8> {
        lock(&self.served).concat()
    }

    /// How many connections the proxy has accepted.
    pub fn connections(&self) -> usize {
        lock(&self.served).len()
    }
}

impl Drop for RecordingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Whether `needle` occurs in `haystack`; an empty needle always does.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty()
        || haystack
            .windows(needle.len())
            .any(|window| window == needle)
}
