//! Live updates: a page's `<main>` again whenever it changes, as
//! Server-Sent Events. The page's script opens `/live?path=<the page>`;
//! the stream renders that page's main every [`TICK`] with the same
//! function the page used, and sends it when it differs from the last.
//!
//! Streams are bounded in all and per person, and end with the session
//! (sign-out, expiry) and with the arbiter. Streams of the same page (and
//! the same role) share one render per tick: their cost is per page
//! followed, not per stream.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use serde::Deserialize;

use super::Console;
use super::auth;
use super::pages::{self, View};

/// How often a stream looks for a change.
const TICK: Duration = Duration::from_millis(500);
/// Live streams open at once, and per person (subject).
pub(super) const MAX_STREAMS: usize = 64;
pub(super) const MAX_STREAMS_PER_SUBJECT: usize = 4;

#[derive(Default)]
pub(super) struct Streams {
    open: AtomicUsize,
    per_subject: Mutex<std::collections::HashMap<Arc<str>, usize>>,
    /// The last render of each (page, operator) followed: shared by every
    /// stream of it within a tick. At most one entry per open stream.
    renders: Mutex<std::collections::HashMap<(View, bool), Rendered>>,
}

impl Streams {
    pub(super) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    fn admit(self: &Arc<Self>, subject: &Arc<str>) -> Option<Place> {
        let mut per = self.per_subject.lock();
        let mine = per.get(subject).copied().unwrap_or(0);
        if mine >= MAX_STREAMS_PER_SUBJECT || self.open.load(Ordering::Relaxed) >= MAX_STREAMS {
            return None;
        }
        per.insert(subject.clone(), mine + 1);
        self.open.fetch_add(1, Ordering::Relaxed);
        Some(Place {
            streams: self.clone(),
            subject: subject.clone(),
        })
    }

    /// A render of `view` for `operator` made within half a tick, if any.
    pub(super) fn shared(&self, view: &View, operator: bool) -> Option<Arc<String>> {
        let renders = self.renders.lock();
        let (at, html) = renders.get(&(view.clone(), operator))?;
        (at.elapsed() < TICK / 2).then(|| html.clone())
    }

    pub(super) fn keep(&self, view: &View, operator: bool, html: Arc<String>) {
        let mut renders = self.renders.lock();
        // Entries nobody asked for lately go (at most one per stream stays).
        renders.retain(|_, (at, _)| at.elapsed() < TICK * 4);
        renders.insert((view.clone(), operator), (Instant::now(), html));
    }
}

/// A page's `<main>` and when it was rendered.
type Rendered = (Instant, Arc<String>);

/// A stream's place among the bounded ones, given back when it ends.
struct Place {
    streams: Arc<Streams>,
    subject: Arc<str>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut per = self.streams.per_subject.lock();
        if let Some(n) = per.get_mut(&self.subject) {
            *n -= 1;
            if *n == 0 {
                per.remove(&self.subject);
            }
        }
        self.streams.open.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Deserialize)]
pub(super) struct LiveQuery {
    path: String,
}

impl Console {
    /// `view`'s `<main>` for someone of `who`'s role: a render made within
    /// half a tick for any page or stream of the same, or a new one.
    pub(super) async fn main_shared(&self, who: &auth::Who, view: &View) -> Arc<String> {
        if let Some(html) = self.streams.shared(view, who.operator) {
            return html;
        }
        let html = Arc::new(pages::main_of(self, who, view).await);
        self.streams.keep(view, who.operator, html.clone());
        html
    }
}

pub(super) async fn stream(
    State(console): State<Arc<Console>>,
    headers: HeaderMap,
    Query(q): Query<LiveQuery>,
) -> Response {
    let refused =
        |status: StatusCode, text: &'static str| pages::secured((status, text).into_response());
    let Some(id) = auth::cookie(&headers, console.cookie).map(Arc::<str>::from) else {
        return refused(StatusCode::UNAUTHORIZED, "sign in first\n");
    };
    let Some(who) = console.sessions.get(&id) else {
        return refused(StatusCode::UNAUTHORIZED, "sign in first\n");
    };
    let Some(view) = View::parse(&q.path) else {
        return refused(StatusCode::BAD_REQUEST, "no such page to follow\n");
    };
    let subject: Arc<str> = who.signed_in.subject.as_str().into();
    let Some(place) = console.streams.admit(&subject) else {
        return refused(
            StatusCode::TOO_MANY_REQUESTS,
            "too many live pages open: close some, or reload later\n",
        );
    };
    let events = futures::stream::unfold(
        (console, id, view, Arc::new(String::new()), place),
        |(console, id, view, last, place)| async move {
            let mut last = last;
            loop {
                // The first render goes at once; later ones a tick apart.
                if !last.is_empty() {
                    tokio::select! {
                        _ = console.stop.cancelled() => return None,
                        _ = tokio::time::sleep(TICK) => {}
                    }
                }
                // The session may have ended (signed out, expired): so does its stream.
                let who = console.sessions.get(&id)?;
                let main = console.main_shared(&who, &view).await;
                if main != last {
                    let event = Event::default().event("main").data(main.as_str());
                    return Some((
                        Ok::<Event, Infallible>(event),
                        (console, id, view, main, place),
                    ));
                }
                last = main;
            }
        },
    );
    pages::secured(
        Sse::new(events)
            .keep_alive(KeepAlive::default())
            .into_response(),
    )
}
