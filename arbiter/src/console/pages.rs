//! The console's pages, rendered here as HTML: every value from the log, a
//! caller or the provider goes through [`esc`]. Each page's `<main>` is
//! rendered by [`main_of`], which the live streams call too, so a page and
//! its updates never differ.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::Uri;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::auth::{self, Who};
use super::view::{HoldRow, oldest};
use super::{Console, ago};

/// Rows a table shows at most (the filters narrow it).
const MAX_ROWS: usize = 500;
/// Rows on each of the hot-key lists.
const HOT_ROWS: usize = 20;
/// The longest key a page names (a lock key is at most 1 KiB).
const MAX_KEY_CHARS: usize = 1024;
/// Audit events on a key's timeline.
const TIMELINE_EVENTS: u32 = 50;
/// What the console calls itself as the channel of a force-release (where
/// latchctl's calls carry the operator's SVID).
const CONSOLE_CHANNEL: &str = "console";

/// HTML-escapes `text` for an element's content or a quoted attribute.
pub(super) fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes `text` for a URL's query.
pub(super) fn url_encode(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

/// At most `max` characters of `text`.
pub(super) fn short(text: &str, max: usize) -> String {
    text.chars().take(max).collect()
}

pub(super) fn secured(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // Not no-referrer: under it a browser sends `Origin: null` with a
    // form's POST, which the forms' Origin check refuses.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

pub(super) fn redirect(to: &str) -> Response {
    let Ok(location) = HeaderValue::from_str(to) else {
        return error_page(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Cannot redirect",
            "the console could not name where to go next",
        );
    };
    let mut r = StatusCode::SEE_OTHER.into_response();
    r.headers_mut().insert(header::LOCATION, location);
    secured(r)
}

/// `text` with every number replaced by `N`: seal reasons and store errors
/// name revisions, and with the epoch a revision is a fencing token. A
/// word with a digit in it goes whole (`0x1b3f`, `e3:r88`'s parts), and so
/// does a run of six or more hex letters (a hex revision without digits).
fn numberless(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        let numeric = word.chars().any(|c| c.is_ascii_digit())
            || (word.len() >= 6 && word.chars().all(|c| c.is_ascii_hexdigit()));
        match numeric {
            true => out.push('N'),
            false => out.push_str(word),
        }
        word.clear();
    };
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

pub(super) fn error_page(status: StatusCode, title: &str, detail: &str) -> Response {
    let body = format!(
        "<p class=\"error\">{}</p><p><a href=\"/keys\">Back to the keys</a> · <a href=\"/login\">Sign in</a></p>",
        esc(detail)
    );
    let mut r = Page::plain(title, &body);
    *r.status_mut() = status;
    r
}

pub(super) async fn not_found() -> Response {
    error_page(
        StatusCode::NOT_FOUND,
        "Not found",
        "the console has no such page",
    )
}

/// A whole page around a `<main>`.
pub(super) struct Page;

impl Page {
    /// A page without the signed-in header (sign-in errors, sign-out).
    pub(super) fn plain(title: &str, body: &str) -> Response {
        let html = format!(
            "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t} · Latchkey</title><link rel=\"stylesheet\" href=\"/static/console.css\"></head><body><header><strong>Latchkey</strong></header><main><h1>{t}</h1>{body}</main></body></html>",
            t = esc(title)
        );
        html_response(html)
    }

    /// A signed-in page; `live`: its `<main>` follows the server's changes.
    fn full(who: &Who, view: &View, main: &str, extra: &str, live: bool) -> Response {
        let mut nav = String::new();
        for (href, name) in [
            ("/keys", "Keys"),
            ("/hot", "Hot keys"),
            ("/sessions", "Sessions"),
            ("/elections", "Elections"),
            ("/force-release", "Force-release"),
            ("/system", "System"),
        ] {
            let here = if view.nav() == href {
                " class=\"here\""
            } else {
                ""
            };
            let _ = write!(nav, "<a href=\"{href}\"{here}>{name}</a>");
        }
        let role = if who.operator {
            "operator"
        } else if who.operator_without_mfa {
            "viewer (operator role without a second factor)"
        } else {
            "viewer"
        };
        let script = match live {
            true => "<script src=\"/static/console.js\" defer></script>",
            false => "",
        };
        let html = format!(
            "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title} · Latchkey</title><link rel=\"stylesheet\" href=\"/static/console.css\">{script}</head>\
             <body data-page=\"{page}\"><header><strong>Latchkey</strong><nav>{nav}</nav><span class=\"who\" id=\"who\">{subject} · {role}</span>\
             <form method=\"post\" action=\"/logout\" class=\"inline\"><input type=\"hidden\" name=\"csrf\" value=\"{csrf}\"><button>Sign out</button></form></header>\
             <main id=\"main\">{main}</main>{extra}<footer id=\"live\">live updates: <span id=\"live-state\">off (reload to refresh)</span></footer></body></html>",
            title = esc(&view.title()),
            page = view.nav().trim_start_matches('/'),
            subject = esc(&who.signed_in.subject),
            csrf = esc(&who.csrf),
        );
        html_response(html)
    }
}

fn html_response(html: String) -> Response {
    secured(([(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response())
}

/// Which page, with its filters: parsed from a page's path and query, by
/// the page itself and by its live stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum View {
    Keys(Filter),
    Key(String),
    Hot,
    Sessions(Filter),
    /// One election by name (empty: none asked yet).
    Elections(String),
    ForceRelease,
    System,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Deserialize)]
pub(super) struct Filter {
    #[serde(default)]
    pub ns: String,
    #[serde(default)]
    pub class: String,
    #[serde(default)]
    pub identity: String,
}

impl Filter {
    fn keeps(&self, row: &HoldRow) -> bool {
        (self.ns.is_empty() || row.namespace() == self.ns)
            && (self.class.is_empty() || row.class == self.class)
            && (self.identity.is_empty() || row.identity.contains(self.identity.as_str()))
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct KeyQuery {
    #[serde(default)]
    k: String,
}

impl View {
    /// The view a live stream renders: `path` is a page's path and query.
    pub(super) fn parse(path: &str) -> Option<View> {
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        let filter = || serde_urlencoded_filter(query);
        Some(match path {
            "/keys" => View::Keys(filter()),
            "/key" => View::Key(
                url::form_urlencoded::parse(query.as_bytes())
                    .find(|(k, _)| k == "k")
                    .map(|(_, v)| short(&v, MAX_KEY_CHARS))
                    .unwrap_or_default(),
            ),
            "/hot" => View::Hot,
            "/sessions" => View::Sessions(filter()),
            "/elections" => View::Elections(
                url::form_urlencoded::parse(query.as_bytes())
                    .find(|(k, _)| k == "e")
                    .map(|(_, v)| short(v.trim(), MAX_KEY_CHARS))
                    .unwrap_or_default(),
            ),
            "/force-release" => View::ForceRelease,
            "/system" => View::System,
            _ => return None,
        })
    }

    fn nav(&self) -> &'static str {
        match self {
            View::Keys(_) | View::Key(_) => "/keys",
            View::Hot => "/hot",
            View::Sessions(_) => "/sessions",
            View::Elections(_) => "/elections",
            View::ForceRelease => "/force-release",
            View::System => "/system",
        }
    }

    fn title(&self) -> String {
        match self {
            View::Keys(_) => "Keys".into(),
            View::Key(k) => format!("Key {}", short(k, 80)),
            View::Hot => "Hot keys".into(),
            View::Sessions(_) => "Sessions".into(),
            View::Elections(e) if e.is_empty() => "Elections".into(),
            View::Elections(e) => format!("Election {}", short(e, 80)),
            View::ForceRelease => "Force-release".into(),
            View::System => "System".into(),
        }
    }
}

fn serde_urlencoded_filter(query: &str) -> Filter {
    let mut f = Filter::default();
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        let v = short(v.trim(), 256);
        match k.as_ref() {
            "ns" => f.ns = v,
            "class" => f.class = v,
            "identity" => f.identity = v,
            _ => {}
        }
    }
    f
}

/// A page: signed in, then rendered.
async fn page(
    console: &Console,
    headers: &HeaderMap,
    uri: &axum::http::Uri,
    view: View,
) -> Response {
    let here = uri
        .path_and_query()
        .map_or("/keys", |p| p.as_str())
        .to_string();
    let who = match auth::who(console, headers, &here) {
        Ok(who) => who,
        Err(r) => return r,
    };
    // A render another page or stream made a moment ago costs nothing; a
    // new one reads the log, so a session's new renders are rate-limited.
    let main = match console.streams.shared(&view, who.operator) {
        Some(main) => main,
        None if !console.sessions.may_render(&who.id) => {
            return error_page(
                StatusCode::TOO_MANY_REQUESTS,
                "Slow down",
                "more than 5 new pages a second from this session: wait a moment (live pages update by themselves)",
            );
        }
        None => console.main_shared(&who, &view).await,
    };
    let extra = extra_of(console, &who, &view);
    Page::full(&who, &view, &main, &extra, true)
}

/// A filter as the pages use it: trimmed, each at most 256 characters.
fn trimmed(filter: Filter) -> Filter {
    Filter {
        ns: short(filter.ns.trim(), 256),
        class: short(filter.class.trim(), 256),
        identity: short(filter.identity.trim(), 256),
    }
}

pub(super) async fn keys(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
    Query(filter): Query<Filter>,
) -> Response {
    page(&console, &headers, &uri, View::Keys(trimmed(filter))).await
}

pub(super) async fn key(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
    Query(q): Query<KeyQuery>,
) -> Response {
    page(
        &console,
        &headers,
        &uri,
        View::Key(short(&q.k, MAX_KEY_CHARS)),
    )
    .await
}

pub(super) async fn hot(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    page(&console, &headers, &uri, View::Hot).await
}

pub(super) async fn sessions(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
    Query(filter): Query<Filter>,
) -> Response {
    page(&console, &headers, &uri, View::Sessions(trimmed(filter))).await
}

#[derive(Debug, Deserialize)]
pub(super) struct ElectionQuery {
    #[serde(default)]
    e: String,
}

pub(super) async fn elections(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
    Query(q): Query<ElectionQuery>,
) -> Response {
    let name = short(q.e.trim(), MAX_KEY_CHARS);
    page(&console, &headers, &uri, View::Elections(name)).await
}

pub(super) async fn system(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    page(&console, &headers, &uri, View::System).await
}

pub(super) async fn force_release(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    page(&console, &headers, &uri, View::ForceRelease).await
}

/// A view's `<main>`: what its page shows and its live stream sends. It
/// depends on who asks only by their role (streams of one page share it).
pub(super) async fn main_of(console: &Console, who: &Who, view: &View) -> String {
    if matches!(view, View::System | View::ForceRelease) && !who.operator {
        return format!(
            "<h1>{}</h1><p id=\"operators-only\">Operators only (the operator role): this page shows what GetStatus and ListForceReleases show operators.</p>",
            esc(&view.title())
        );
    }
    let rendered = match view {
        View::Keys(filter) => keys_main(console, who, filter).await,
        View::Key(key) => key_main(console, who, key).await,
        View::Hot => hot_main(console, who).await,
        View::Sessions(filter) => sessions_main(console, who, filter).await,
        View::Elections(name) => elections_main(console, name).await,
        View::ForceRelease => force_main(console, who).await,
        View::System => system_main(console).await,
    };
    match rendered {
        Ok(html) => html,
        Err(e) => format!(
            "<h1>{}</h1><p class=\"error\" id=\"unavailable\">The lock log cannot be read just now: {}. This page tries again by itself.</p>",
            esc(&view.title()),
            esc(&numberless(&e.to_string()))
        ),
    }
}

/// What a page shows outside its live `<main>`: forms someone may be
/// typing into, which a live update must not wipe.
fn extra_of(console: &Console, who: &Who, view: &View) -> String {
    match view {
        View::Keys(f) | View::Sessions(f) => {
            let action = view.nav();
            format!(
                "<section class=\"filter\"><form method=\"get\" action=\"{action}\">\
                 <label>namespace <input name=\"ns\" value=\"{}\"></label> \
                 <label>class <input name=\"class\" value=\"{}\"></label> \
                 <label>identity <input name=\"identity\" value=\"{}\"></label> \
                 <button>Filter</button></form></section>",
                esc(&f.ns),
                esc(&f.class),
                esc(&f.identity)
            )
        }
        View::Elections(name) => format!(
            "<section class=\"filter\"><form method=\"get\" action=\"/elections\"><label>election <input name=\"e\" value=\"{}\" size=\"50\"></label> <button>Show</button></form></section>",
            esc(name)
        ),
        View::Key(_) if who.operator && !console.force_release => {
            "<section class=\"act\"><p>Force-release is not offered in this console (the arbiter runs without --console-force-release): use <code>latchctl admin force-release</code>.</p></section>".into()
        }
        View::Key(key) if who.operator => format!(
            "<section class=\"act\"><h2>Request a force-release</h2>\
             <p>A second operator must approve it. Name a semaphore's slot or a shared holder's session (in hex) when the key has several holders.</p>\
             <form method=\"post\" action=\"/force-release/request\" id=\"request-form\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{csrf}\"><input type=\"hidden\" name=\"key\" value=\"{key}\">\
             <label>reason <input name=\"reason\" id=\"reason\" required maxlength=\"512\" size=\"60\"></label> \
             <label>slot <input name=\"slot\" size=\"4\"></label> \
             <label>shared session <input name=\"shared_session\" size=\"18\"></label> \
             <label><input type=\"checkbox\" name=\"revoke_session\" value=\"on\"> also revoke the holder's session</label> \
             <button id=\"request\">Request force-release</button></form></section>",
            csrf = esc(&who.csrf),
            key = esc(key)
        ),
        View::Key(_) => {
            "<section class=\"act\"><p>Only operators (the operator role) may request a force-release.</p></section>".into()
        }
        _ => String::new(),
    }
}

fn session_cell(who: &Who, session: i64) -> String {
    match who.operator {
        true => format!("{session:#x}"),
        false => "(operators only)".into(),
    }
}

fn renewal_cells(row: &HoldRow) -> String {
    match row.renewal {
        Some(r) => format!("<td>{}</td><td>{} ago</td>", ago(r.ttl_left), ago(r.ago)),
        None => "<td colspan=\"2\">not renewed on this arbiter</td>".into(),
    }
}

fn key_link(key: &str) -> String {
    format!(
        "<a href=\"/key?k={}\">{}</a>",
        esc(&url_encode(key)),
        esc(key)
    )
}

async fn keys_main(
    console: &Console,
    who: &Who,
    filter: &Filter,
) -> Result<String, crate::ArbiterError> {
    let holds = console.holds().await?;
    let queues = console.queues();
    let held: std::collections::HashSet<&str> = holds.rows.iter().map(|r| r.key.as_str()).collect();
    let waiting = |key: &str| {
        queues
            .iter()
            .find(|q| q.key == key)
            .map_or(0, |q| q.waiters.len() + q.durable_here as usize)
    };
    let rows: Vec<&HoldRow> = holds.rows.iter().filter(|r| filter.keeps(r)).collect();
    let mut html = format!(
        "<h1>Keys</h1><p id=\"count\">{} holds{}; showing {}.</p>",
        rows.len(),
        if filter == &Filter::default() {
            String::new()
        } else {
            format!(" match (of {})", holds.rows.len())
        },
        rows.len().min(MAX_ROWS)
    );
    html.push_str(
        "<table id=\"holds\"><thead><tr><th>key</th><th>holder</th><th>class</th><th>enforcement</th><th>mode</th><th>held for</th><th>session</th><th>TTL left</th><th>last renewal</th><th>waiters here</th></tr></thead><tbody>",
    );
    for row in rows.iter().take(MAX_ROWS) {
        let _ = write!(
            html,
            "<tr data-key=\"{k}\"><td>{link}</td><td class=\"identity\">{id}</td><td>{class}</td><td class=\"{enf}\">{enf}</td><td>{mode}</td><td>{age}</td><td>{session}</td>{renewal}<td class=\"waiters\">{waiters}</td></tr>",
            k = esc(&row.key),
            link = key_link(&row.key),
            id = esc(&row.identity),
            class = esc(&row.class),
            enf = row.enforcement,
            mode = row.mode(),
            age = ago(row.age()),
            session = session_cell(who, row.session),
            renewal = renewal_cells(row),
            waiters = waiting(&row.key),
        );
    }
    html.push_str("</tbody></table>");
    // Keys nobody holds that have waiters (a hand-over under way).
    let unheld: Vec<_> = queues
        .iter()
        .filter(|q| !held.contains(q.key.as_str()))
        .collect();
    if !unheld.is_empty() {
        html.push_str("<h2>Waited for, not held</h2><ul>");
        for q in unheld.iter().take(MAX_ROWS) {
            let _ = write!(
                html,
                "<li>{} — {} waiting here</li>",
                key_link(&q.key),
                q.waiters.len() + q.durable_here as usize
            );
        }
        html.push_str("</ul>");
    }
    Ok(html)
}

async fn key_main(console: &Console, who: &Who, key: &str) -> Result<String, crate::ArbiterError> {
    let holds = console.holds().await?;
    let holders: Vec<&HoldRow> = holds.rows.iter().filter(|r| r.key == key).collect();
    let mut html = format!("<h1>Key <code>{}</code></h1>", esc(key));
    html.push_str("<section id=\"why\"><h2>Why</h2>");
    if holders.is_empty() {
        let _ = write!(html, "<p id=\"holder\">{} is free.</p>", esc(key));
    }
    for h in &holders {
        let session = match who.operator {
            true => format!(" (session {:#x})", h.session),
            false => String::new(),
        };
        let _ = write!(
            html,
            "<p class=\"holder\" id=\"holder\">{} is held {} by <span class=\"identity\">{}</span>{session}, class {}, <span class=\"{enf}\">{enf}</span>, since {} ({} ago), on the {} cluster.</p>",
            esc(key),
            h.mode(),
            esc(&h.identity),
            esc(&h.class),
            latchkey_audit::text::utc(h.acquired_at_unix_ms),
            ago(h.age()),
            esc(&h.cluster),
            enf = h.enforcement,
        );
        let _ = write!(
            html,
            "<p>Session TTL left: {}.</p>",
            match h.renewal {
                Some(r) => format!(
                    "at least {} (renewed here {} ago)",
                    ago(r.ttl_left),
                    ago(r.ago)
                ),
                None => "not renewed on this arbiter".into(),
            }
        );
    }
    let queue = console.queue(key);
    let durable = console.durable_waiting(key).await;
    let _ = write!(
        html,
        "<p id=\"waiting\">{} waiting on this arbiter; {} durable waiters in the lock log (served in order by every arbiter).</p></section>",
        queue.waiters.len(),
        durable.map_or_else(|| "unknown".into(), |n| n.to_string())
    );
    html.push_str("<section><h2>Queue on this arbiter</h2>");
    if queue.waiters.is_empty() {
        html.push_str("<p>Nobody waits here.</p>");
    } else {
        html.push_str("<table id=\"queue\"><thead><tr><th>#</th><th>identity</th><th>class</th><th>mode</th><th>waiting for</th><th>durable</th><th>session</th></tr></thead><tbody>");
        for (i, w) in queue.waiters.iter().enumerate() {
            let _ = write!(
                html,
                "<tr><td>{}</td><td class=\"identity\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>no</td><td>{}</td></tr>",
                i + 1,
                esc(&w.identity),
                esc(&w.class),
                if w.shared { "shared" } else { "exclusive" },
                ago(w.waited),
                session_cell(who, w.session)
            );
        }
        html.push_str("</tbody></table>");
    }
    if queue.durable_here > 0 {
        let _ = write!(
            html,
            "<p>{} durable waiters are served by this arbiter (their places are in the lock log).</p>",
            queue.durable_here
        );
    }
    html.push_str("</section>");
    html.push_str(&timeline(console, who, key).await);
    Ok(html)
}

/// The key's last events from the audit store, as `latchctl audit` prints
/// them (one function makes both); session ids only to operators.
async fn timeline(console: &Console, who: &Who, key: &str) -> String {
    let Some(store) = &console.audit else {
        return "<section id=\"timeline\"><h2>Timeline</h2><p>No audit store configured (--console-audit-store).</p></section>".into();
    };
    let query = latchkey_audit::HistoryQuery {
        key: key.to_string(),
        since_unix_ms: None,
        limit: TIMELINE_EVENTS,
        cluster_id: None,
    };
    let events = match store.history(&query).await {
        Ok(events) => events,
        Err(e) => {
            return format!(
                "<section id=\"timeline\"><h2>Timeline</h2><p class=\"error\">The audit store cannot be read: {}</p></section>",
                esc(&numberless(&e))
            );
        }
    };
    let mut html = String::from("<section id=\"timeline\"><h2>Timeline</h2>");
    if events.is_empty() {
        html.push_str("<p>No events recorded.</p>");
    } else {
        html.push_str("<ol class=\"events\">");
        for e in &events {
            let line = latchkey_proto::text::Shown(&latchkey_audit::text::describe(e)).to_string();
            let line = match who.operator {
                true => line,
                false => hide_sessions(&line),
            };
            let _ = write!(html, "<li><pre>{}</pre></li>", esc(&line));
        }
        html.push_str("</ol>");
    }
    html.push_str("</section>");
    html
}

/// `session 0x…` → `session (operators only)`.
fn hide_sessions(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find("session 0x") {
        out.push_str(&rest[..at]);
        out.push_str("session (operators only)");
        let after = &rest[at + "session 0x".len()..];
        let end = after
            .find(|c: char| !c.is_ascii_hexdigit())
            .unwrap_or(after.len());
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

async fn hot_main(console: &Console, who: &Who) -> Result<String, crate::ArbiterError> {
    let holds = console.holds().await?;
    let mut queues = console.queues();
    let mut html = String::from("<h1>Hot keys</h1>");
    queues.sort_by_key(|q| std::cmp::Reverse(q.waiters.len() + q.durable_here as usize));
    html.push_str("<h2>Longest queues here</h2><table id=\"longest-queues\"><thead><tr><th>key</th><th>waiting</th><th>oldest wait</th></tr></thead><tbody>");
    for q in queues.iter().take(HOT_ROWS) {
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            key_link(&q.key),
            q.waiters.len() + q.durable_here as usize,
            ago(oldest(q))
        );
    }
    html.push_str("</tbody></table>");
    queues.sort_by_key(|q| std::cmp::Reverse(oldest(q)));
    html.push_str("<h2>Oldest waiters here</h2><table id=\"oldest-waiters\"><thead><tr><th>key</th><th>waiter</th><th>waiting for</th></tr></thead><tbody>");
    for q in queues
        .iter()
        .filter(|q| !q.waiters.is_empty())
        .take(HOT_ROWS)
    {
        if let Some(w) = q.waiters.iter().max_by_key(|w| w.waited) {
            let _ = write!(
                html,
                "<tr><td>{}</td><td class=\"identity\">{}</td><td>{}</td></tr>",
                key_link(&q.key),
                esc(&w.identity),
                ago(w.waited)
            );
        }
    }
    html.push_str("</tbody></table>");
    let mut longest: Vec<&HoldRow> = holds.rows.iter().collect();
    longest.sort_by_key(|r| r.acquired_at_unix_ms);
    html.push_str("<h2>Longest holds</h2><table id=\"longest-holds\"><thead><tr><th>key</th><th>holder</th><th>class</th><th>held for</th><th>session</th></tr></thead><tbody>");
    for r in longest.iter().take(HOT_ROWS) {
        let _ = write!(
            html,
            "<tr><td>{}</td><td class=\"identity\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            key_link(&r.key),
            esc(&r.identity),
            esc(&r.class),
            ago(r.age()),
            session_cell(who, r.session)
        );
    }
    html.push_str("</tbody></table>");
    Ok(html)
}

async fn sessions_main(
    console: &Console,
    who: &Who,
    filter: &Filter,
) -> Result<String, crate::ArbiterError> {
    let holds = console.holds().await?;
    let mut by: std::collections::BTreeMap<&str, std::collections::BTreeMap<i64, Vec<&HoldRow>>> =
        Default::default();
    for r in holds.rows.iter().filter(|r| filter.keeps(r)) {
        by.entry(&r.identity)
            .or_default()
            .entry(r.session)
            .or_default()
            .push(r);
    }
    let mut html = format!(
        "<h1>Sessions</h1><p>Sessions that hold something, by identity: {} identities.</p>",
        by.len()
    );
    for (identity, sessions) in by.iter().take(MAX_ROWS) {
        let _ = write!(
            html,
            "<section class=\"identity-sessions\"><h2 class=\"identity\">{}</h2><table><thead><tr><th>session</th><th>TTL left</th><th>last renewal</th><th>holds</th></tr></thead><tbody>",
            esc(identity)
        );
        for (session, rows) in sessions {
            let keys: Vec<String> = rows
                .iter()
                .map(|r| format!("{} ({})", key_link(&r.key), r.mode()))
                .collect();
            let _ = write!(
                html,
                "<tr><td>{}</td>{}<td>{}</td></tr>",
                session_cell(who, *session),
                renewal_cells(rows[0]),
                keys.join(", ")
            );
        }
        html.push_str("</tbody></table></section>");
    }
    Ok(html)
}

/// One election: its leader and its candidates in the order they would
/// lead. Never a candidacy's id nor a term's revision (with the epoch, a
/// revision is a token); the term is the number latchctl shows.
async fn elections_main(console: &Console, name: &str) -> Result<String, crate::ArbiterError> {
    let mut html = String::from("<h1>Elections</h1>");
    if name.is_empty() {
        html.push_str("<p>Name an election (its name is a lock key: <code>namespace/…</code>) to see its leader and candidates.</p>");
        return Ok(html);
    }
    let key = match latchkey_policies::LockKey::parse(name) {
        Ok(key) => key,
        Err(e) => {
            let _ = write!(html, "<p class=\"error\">{}</p>", esc(&e.to_string()));
            return Ok(html);
        }
    };
    let cluster = console.arbiter.tiers.for_key(&key).await?;
    let leader = cluster.elections.leader(key.as_str()).await?;
    let candidates = cluster.elections.candidates(key.as_str()).await?;
    let _ = write!(html, "<h2>Election <code>{}</code></h2>", esc(name));
    match leader {
        None => html.push_str("<p id=\"leader\">No leader: the election is vacant.</p>"),
        Some(l) => {
            let _ = write!(
                html,
                "<p id=\"leader\">Led by <span class=\"identity\">{}</span>, term {}, priority {}, value {}, since {} ({} ago).</p>",
                esc(&l.identity),
                l.term,
                l.priority,
                esc(&format!("{:?}", l.value)),
                latchkey_audit::text::utc(l.since_unix_ms),
                ago(std::time::Duration::from_millis(
                    u64::try_from(crate::records::now_unix_ms() - l.since_unix_ms).unwrap_or(0)
                ))
            );
        }
    }
    html.push_str("<table id=\"candidates\"><thead><tr><th>#</th><th>candidate</th><th>priority</th><th>value</th><th>standing since</th></tr></thead><tbody>");
    for (i, c) in candidates.iter().enumerate() {
        let _ = write!(
            html,
            "<tr><td>{}</td><td class=\"identity\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            i + 1,
            esc(&c.identity),
            c.priority,
            esc(&format!("{:?}", c.value)),
            latchkey_audit::text::utc(c.since_unix_ms)
        );
    }
    html.push_str("</tbody></table>");
    Ok(html)
}

async fn force_main(console: &Console, who: &Who) -> Result<String, crate::ArbiterError> {
    let (pending, done) = match console.arbiter.force_list().await {
        Ok(v) => v,
        Err(e) => {
            return Ok(format!(
                "<h1>Force-release</h1><p class=\"error\">{}</p>",
                esc(&numberless(&e.to_string()))
            ));
        }
    };
    let mut html = String::from(
        "<h1>Force-release</h1><p>A request names a hold; a different operator approves it. What the class's enforcement means for the resource is shown before anyone approves.</p><h2>Waiting for approval</h2>",
    );
    if pending.is_empty() {
        html.push_str("<p id=\"no-pending\">No pending requests.</p>");
    }
    for r in &pending {
        let enforcement = r.enforcement.to_uppercase();
        let warning = crate::force_release::warning_for(&r.enforcement);
        let approve = format!(
            "<p><a class=\"review\" href=\"/force-release/confirm?id={}\">Review and approve</a> (a different operator than {} must approve)</p>",
            esc(&url_encode(&r.id)),
            esc(&r.requester_subject)
        );
        let _ = write!(
            html,
            "<section class=\"request\" data-request=\"{id}\"><h3>{what} <code>{key}</code></h3>\
             <p class=\"enforcement {lower}\"><strong>{enforcement}</strong> {warning}</p>\
             <p>Held by <span class=\"identity\">{holder}</span>, class {class}, session {session}. Requested by {by} ({reason}); expires {expires}.{revoke}</p>{approve}</section>",
            id = esc(&r.id),
            what = if r.election {
                "Leadership of election"
            } else {
                "Hold on"
            },
            key = esc(crate::records::named_key(&r.key)),
            lower = esc(&r.enforcement),
            warning = esc(warning),
            holder = esc(&r.holder_identity),
            class = esc(&r.class),
            session = session_cell(who, r.holder_session),
            by = esc(&r.requester_subject),
            reason = esc(&format!("{:?}", r.reason)),
            expires = latchkey_audit::text::utc(r.expires_at_unix_ms),
            revoke = if r.revoke_session {
                " Approval also revokes the holder's session."
            } else {
                ""
            },
        );
    }
    html.push_str("<h2>Done (kept 24 h)</h2>");
    if done.is_empty() {
        html.push_str("<p>None.</p>");
    } else {
        html.push_str("<table id=\"done\"><thead><tr><th>key</th><th>holder</th><th>enforcement</th><th>requested by</th><th>approved by</th><th>at</th><th>reason</th></tr></thead><tbody>");
        for d in &done {
            let _ = write!(
                html,
                "<tr><td>{}</td><td class=\"identity\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(crate::records::named_key(&d.key)),
                esc(&d.holder_identity),
                esc(&d.enforcement.to_uppercase()),
                esc(&d.requested_by),
                esc(&d.approved_by),
                latchkey_audit::text::utc(d.approved_at_unix_ms),
                esc(&format!("{:?}", d.reason))
            );
        }
        html.push_str("</tbody></table>");
    }
    Ok(html)
}

async fn system_main(console: &Console) -> Result<String, crate::ArbiterError> {
    let arbiter = &console.arbiter;
    let mut html = String::from("<h1>System</h1>");
    for cluster in arbiter.tiers.all() {
        let _ = write!(
            html,
            "<section class=\"cluster\"><h2>{} cluster</h2>",
            esc(cluster.name())
        );
        match arbiter.status_of(&cluster).await {
            Ok(s) => {
                let _ = write!(
                    html,
                    "<dl><dt>epoch</dt><dd id=\"epoch\">{epoch}</dd><dt>sealed</dt><dd id=\"sealed\">{sealed}</dd>\
                     <dt>witness</dt><dd>{witness}</dd><dt>witnessed epoch</dt><dd>{wepoch}</dd>\
                     <dt>coord cluster's epoch</dt><dd>{cepoch}</dd><dt>quorum</dt><dd id=\"quorum\">{quorum}</dd>\
                     <dt>memory grants (quorum loss)</dt><dd>{memory}</dd><dt>policies</dt><dd>grants version {version}{perr}</dd></dl>",
                    epoch = s.epoch,
                    sealed = if s.sealed {
                        format!("yes: {}", esc(&numberless(&s.seal_reason)))
                    } else {
                        "no".into()
                    },
                    witness = esc(&s.witness),
                    wepoch = s.witnessed_epoch,
                    cepoch = s.coord_seen_epoch,
                    quorum = if s.quorum_lost {
                        format!(
                            "LOST for {} ({})",
                            ago(std::time::Duration::from_millis(s.quorum_lost_for_ms)),
                            esc(&numberless(&s.quorum_last_error))
                        )
                    } else {
                        "held".into()
                    },
                    memory = s.unprotected_memory_grants,
                    version = s.grants_version,
                    perr = if s.policy_error.is_empty() {
                        String::new()
                    } else {
                        format!(
                            "; the last reload failed: {}",
                            esc(&numberless(&s.policy_error))
                        )
                    },
                );
            }
            Err(e) => {
                let _ = write!(
                    html,
                    "<p class=\"error\">{}</p>",
                    esc(&numberless(&e.to_string()))
                );
            }
        }
        let (keys, waiters) = cluster.table.totals();
        let _ = write!(
            html,
            "<p>{waiters} waiting here on {keys} keys.</p></section>"
        );
    }
    match arbiter.shard_status().await {
        Ok(None) => html
            .push_str("<section><h2>Shards</h2><p>The entity tier is not sharded.</p></section>"),
        Ok(Some(status)) => {
            let _ = write!(
                html,
                "<section id=\"shards\"><h2>Shards (map version {})</h2><table><thead><tr><th>shard</th><th>weight</th><th>epoch</th><th>holds</th><th>moving</th><th>sealed</th><th>error</th></tr></thead><tbody>",
                status.version
            );
            for s in &status.shards {
                let _ = write!(
                    html,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    esc(&s.name),
                    s.weight,
                    s.epoch,
                    s.holds,
                    s.moving_holds,
                    if s.sealed { "yes" } else { "no" },
                    esc(&numberless(&s.error))
                );
            }
            html.push_str("</tbody></table>");
            if let Some(m) = &status.r#move {
                let _ = write!(
                    html,
                    "<p id=\"move\">A move is under way: phase {}, {} ({}).</p>",
                    esc(&m.phase),
                    esc(&numberless(&m.detail)),
                    esc(&m.reason)
                );
            }
            html.push_str("</section>");
        }
        Err(e) => {
            let _ = write!(
                html,
                "<section><h2>Shards</h2><p class=\"error\">{}</p></section>",
                esc(&numberless(&e.to_string()))
            );
        }
    }
    let _ = write!(
        html,
        "<section><h2>This console</h2><p>{} live streams open.</p></section>",
        console.streams.open()
    );
    Ok(html)
}

#[derive(Debug, Deserialize)]
pub(super) struct RequestForm {
    csrf: String,
    key: String,
    reason: String,
    #[serde(default)]
    slot: String,
    #[serde(default)]
    shared_session: String,
    #[serde(default)]
    revoke_session: Option<String>,
}

/// An operator's force-release request, signed in within the token age.
fn acting(console: &Console, headers: &HeaderMap, csrf: &str) -> Result<Who, Response> {
    let who = auth::who(console, headers, "/force-release")?;
    auth::checked_form(console, headers, &who, csrf)?;
    if !console.force_release {
        return Err(error_page(
            StatusCode::FORBIDDEN,
            "Refused",
            "force-release is not offered in this console (the arbiter runs without --console-force-release): use latchctl admin force-release. Nothing was done.",
        ));
    }
    if !who.operator {
        return Err(error_page(
            StatusCode::FORBIDDEN,
            "Refused",
            &format!(
                "{} lacks the operator role (or its second factor): only operators may request or approve a force-release. Nothing was done.",
                who.signed_in.subject
            ),
        ));
    }
    let oidc = console.verifier.config();
    let max_age = oidc.max_age;
    let age = auth::unix_now().saturating_sub(who.issued_unix);
    if age > max_age.as_secs().saturating_add(oidc.leeway.as_secs()) {
        return Err(error_page(
            StatusCode::UNAUTHORIZED,
            "Sign in again",
            &format!(
                "you signed in more than {} min ago, and acting needs a sign-in at most that old: sign in again, then retry. Nothing was done.",
                max_age.as_secs() / 60
            ),
        ));
    }
    Ok(who)
}

pub(super) async fn request_force(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    axum::Form(form): axum::Form<RequestForm>,
) -> Response {
    let who = match acting(&console, &headers, &form.csrf) {
        Ok(who) => who,
        Err(r) => return r,
    };
    let bad = |detail: String| error_page(StatusCode::BAD_REQUEST, "Not requested", &detail);
    let slot = match form.slot.trim() {
        "" => None,
        s => match s.parse::<u32>() {
            Ok(n) => Some(n),
            Err(_) => {
                return bad(format!(
                    "slot {:?} is not a number. Nothing was done.",
                    short(s, 32)
                ));
            }
        },
    };
    let shared_session = match form.shared_session.trim() {
        "" => None,
        s => match u64::from_str_radix(s.trim_start_matches("0x"), 16) {
            // A session id is a lease id's 64 bits, as `{:#x}` shows them.
            Ok(n) => Some(i64::from_ne_bytes(n.to_ne_bytes())),
            Err(_) => {
                return bad(format!(
                    "shared session {:?} is not a hex session id. Nothing was done.",
                    short(s, 32)
                ));
            }
        },
    };
    let request = latchkey_proto::adminv1::RequestForceReleaseRequest {
        key: form.key.clone(),
        reason: form.reason.clone(),
        revoke_session: form.revoke_session.is_some(),
        id_token: String::new(),
        election: false,
        slot,
        shared_session,
    };
    match console
        .arbiter
        .force_request_as(&who.signed_in, CONSOLE_CHANNEL, request)
        .await
    {
        Ok(r) => {
            let body = format!(
                "<p id=\"requested\">Requested the force-release of <code>{}</code> (held by {}). Request <code>{}</code> waits for a different operator's approval.</p><p class=\"enforcement {}\"><strong>{}</strong> {}</p><p><a href=\"/force-release\">Pending requests</a></p>",
                esc(&r.key),
                esc(&r.holder_identity),
                esc(&r.request_id),
                esc(&r.enforcement),
                esc(&r.enforcement.to_uppercase()),
                esc(&r.warning)
            );
            Page::full(&who, &View::ForceRelease, &body, "", false)
        }
        Err(status) => error_page(
            http_status(status.code()),
            "Not requested",
            &format!("{} Nothing was done.", numberless(status.message())),
        ),
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct ConfirmQuery {
    #[serde(default)]
    id: String,
}

/// One pending request on a page of its own, with its approve button: it
/// never updates live, so a click lands on the request the operator read.
pub(super) async fn confirm_force(
    State(console): State<Arc<Console>>,
    uri: Uri,
    headers: HeaderMap,
    Query(q): Query<ConfirmQuery>,
) -> Response {
    let here = uri
        .path_and_query()
        .map_or("/force-release", |p| p.as_str());
    let who = match auth::who(&console, &headers, here) {
        Ok(who) => who,
        Err(r) => return r,
    };
    let view = View::ForceRelease;
    if !who.operator {
        let main = main_of(&console, &who, &view).await;
        return Page::full(&who, &view, &main, "", false);
    }
    let pending = match console.arbiter.force_list().await {
        Ok((pending, _)) => pending,
        Err(e) => {
            return error_page(
                StatusCode::SERVICE_UNAVAILABLE,
                "Cannot read the requests",
                &numberless(&e.to_string()),
            );
        }
    };
    let Some(r) = pending.iter().find(|r| r.id == q.id.trim()) else {
        return error_page(
            StatusCode::NOT_FOUND,
            "No such request",
            "no pending force-release request has that id: it was approved already, or expired unapproved",
        );
    };
    let action = if !console.force_release {
        "<p>Force-release is not offered in this console (the arbiter runs without --console-force-release): approve with <code>latchctl admin force-release approve</code>.</p>".to_string()
    } else if r.requester_subject == who.signed_in.subject {
        "<p id=\"own-request\">You requested this: a different operator must approve it.</p>"
            .to_string()
    } else {
        format!(
            "<form method=\"post\" action=\"/force-release/approve\"><input type=\"hidden\" name=\"csrf\" value=\"{}\"><input type=\"hidden\" name=\"request_id\" value=\"{}\"><button class=\"approve\" id=\"approve\">Approve: force-release {}</button></form>",
            esc(&who.csrf),
            esc(&r.id),
            esc(crate::records::named_key(&r.key))
        )
    };
    let body = format!(
        "<h1>Approve a force-release?</h1><section class=\"request\" id=\"confirm\"><h3>{what} <code>{key}</code></h3>\
         <p class=\"enforcement {lower}\"><strong>{enforcement}</strong> {warning}</p>\
         <p>Held by <span class=\"identity\">{holder}</span>, class {class}, session {session:#x}. Requested by {by}: {reason}; expires {expires}.{revoke}</p>{action}</section>",
        what = if r.election {
            "Leadership of election"
        } else {
            "Hold on"
        },
        key = esc(crate::records::named_key(&r.key)),
        lower = esc(&r.enforcement),
        enforcement = esc(&r.enforcement.to_uppercase()),
        warning = esc(crate::force_release::warning_for(&r.enforcement)),
        holder = esc(&r.holder_identity),
        class = esc(&r.class),
        session = r.holder_session,
        by = esc(&r.requester_subject),
        reason = esc(&format!("{:?}", r.reason)),
        expires = latchkey_audit::text::utc(r.expires_at_unix_ms),
        revoke = if r.revoke_session {
            " Approval also revokes the holder's session."
        } else {
            ""
        },
    );
    Page::full(&who, &view, &body, "", false)
}

#[derive(Debug, Deserialize)]
pub(super) struct ApproveForm {
    csrf: String,
    request_id: String,
}

pub(super) async fn approve_force(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    axum::Form(form): axum::Form<ApproveForm>,
) -> Response {
    let who = match acting(&console, &headers, &form.csrf) {
        Ok(who) => who,
        Err(r) => return r,
    };
    match console
        .arbiter
        .force_approve_as(&who.signed_in, CONSOLE_CHANNEL, &form.request_id)
        .await
    {
        Ok(a) => {
            let request = a.request.unwrap_or_default();
            let revoked = match (request.revoke_session, a.session_revoked) {
                (false, _) => String::new(),
                (true, true) => " The holder's session was revoked.".into(),
                (true, false) => format!(
                    " The holder's session could not be revoked: {}",
                    esc(&numberless(&a.session_revoke_error))
                ),
            };
            let body = format!(
                "<p id=\"approved\">Force-released <code>{}</code> (held by {}), approved by {}.{revoked}</p><p><a href=\"/key?k={}\">The key now</a> · <a href=\"/force-release\">Force-release</a></p>",
                esc(&request.key),
                esc(&request.holder_identity),
                esc(&a.approver),
                esc(&url_encode(&request.key))
            );
            Page::full(&who, &View::ForceRelease, &body, "", false)
        }
        Err(status) => error_page(
            http_status(status.code()),
            "Not approved",
            &format!("{} Nothing was done.", numberless(status.message())),
        ),
    }
}

fn http_status(code: tonic::Code) -> StatusCode {
    use tonic::Code as C;
    match code {
        C::InvalidArgument | C::OutOfRange => StatusCode::BAD_REQUEST,
        C::NotFound => StatusCode::NOT_FOUND,
        C::PermissionDenied => StatusCode::FORBIDDEN,
        C::Unauthenticated => StatusCode::UNAUTHORIZED,
        C::FailedPrecondition | C::AlreadyExists | C::Aborted => StatusCode::CONFLICT,
        C::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        C::Unavailable | C::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn everything_shown_is_escaped() {
        assert_eq!(
            esc("<script>\"x\" & 'y'</script>"),
            "&lt;script&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/script&gt;"
        );
        assert_eq!(esc("a\u{1b}[2Jb"), "a\u{FFFD}[2Jb");
    }

    #[test]
    fn numbers_and_hex_words_never_reach_a_page() {
        assert_eq!(
            numberless("sealed: mark e3:r88 is behind 0x1b3f, abcdef and 0000000000abcdef"),
            "sealed: mark N:N is behind N, N and N"
        );
        assert_eq!(
            numberless("the lock log is sealed"),
            "the lock log is sealed"
        );
    }

    #[test]
    fn viewers_never_see_session_ids_in_the_timeline() {
        assert_eq!(
            hide_sessions("spiffe://td/a session 0x1f2e class c, hold 9a session 0xab]"),
            "spiffe://td/a session (operators only) class c, hold 9a session (operators only)]"
        );
    }

    #[test]
    fn a_live_stream_names_a_page() {
        assert_eq!(
            View::parse("/keys?ns=ledger&identity=bob"),
            Some(View::Keys(Filter {
                ns: "ledger".into(),
                class: String::new(),
                identity: "bob".into()
            }))
        );
        assert_eq!(View::parse("/key?k=a%2Fb"), Some(View::Key("a/b".into())));
        assert_eq!(View::parse("/force-release/approve"), None);
        assert_eq!(View::parse("https://evil/keys"), None);
    }
}
