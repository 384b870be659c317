//! Section timing inside Envoy, for profiling only: built with
//! `--features profile` (never in the shipped module), each stream times the
//! sections of its callbacks with the host clock and records, once, at the
//! end of the stream, each section's time (ns) in the histogram
//! `latchkey_edge.profile.<section>_ns` (Envoy's `/stats` shows its
//! quantiles; medians are robust to the worker being preempted on a busy
//! machine) and adds it to the counters `latchkey_edge.profile.<section>_sum_ns`
//! and `..._calls` (mean = sum / calls). See docs/edge-filter-profile.md.
//!
//! Without the feature every method is empty and the type has no fields.
//! (`latchkey-filter`'s `profile` feature turns on this crate's.)

use crate::host::Host;

/// A timed section of the request path.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "profile"), allow(dead_code))]
pub enum Section {
    /// Two clock reads back to back: what one measurement itself costs.
    Clock,
    /// Peer properties and the SPIFFE ID.
    Identity,
    /// The request header map, the reserved-name check and the method.
    HeaderMap,
    /// Setting (and removing) request headers.
    HeaderSet,
    /// The identity's open-stream place (shared data).
    StreamPlace,
    /// Stat updates in the header phase.
    HeaderStats,
    /// From the end of the header phase to the body's end reaching the filter.
    WaitBody,
    /// Reading the buffered body from the host.
    BodyGet,
    /// Frame, decode, key, header match, grant lookup.
    Check,
    /// The routing key (filter state).
    RouteKey,
    /// A waiting Acquire's admission places (shared data).
    Admit,
    /// Stat updates in the body phase.
    BodyStats,
    /// The response-header callback.
    ResponseHeaders,
    /// Giving places back at the end of the stream.
    Release,
}

#[cfg(feature = "profile")]
const SECTIONS: usize = 14;

#[cfg(feature = "profile")]
impl Section {
    fn name(self) -> &'static str {
        match self {
            Section::Clock => "clock",
            Section::Identity => "identity",
            Section::HeaderMap => "header_map",
            Section::HeaderSet => "header_set",
            Section::StreamPlace => "stream_place",
            Section::HeaderStats => "header_stats",
            Section::WaitBody => "wait_body",
            Section::BodyGet => "body_get",
            Section::Check => "check",
            Section::RouteKey => "route_key",
            Section::Admit => "admit",
            Section::BodyStats => "body_stats",
            Section::ResponseHeaders => "response_headers",
            Section::Release => "release",
        }
    }

    const ALL: [Section; SECTIONS] = [
        Section::Clock,
        Section::Identity,
        Section::HeaderMap,
        Section::HeaderSet,
        Section::StreamPlace,
        Section::HeaderStats,
        Section::WaitBody,
        Section::BodyGet,
        Section::Check,
        Section::RouteKey,
        Section::Admit,
        Section::BodyStats,
        Section::ResponseHeaders,
        Section::Release,
    ];
}

/// Per-stream section times.
#[derive(Default)]
pub struct Profile {
    #[cfg(feature = "profile")]
    last: u64,
    #[cfg(feature = "profile")]
    ns: [u64; SECTIONS],
    #[cfg(feature = "profile")]
    calls: [u32; SECTIONS],
}

#[cfg(feature = "profile")]
fn now_ns(host: &impl Host) -> u64 {
    host.now()
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Profile {
    /// Starts timing from now.
    #[inline]
    pub fn start(&mut self, host: &impl Host) {
        #[cfg(feature = "profile")]
        {
            self.last = now_ns(host);
        }
        #[cfg(not(feature = "profile"))]
        let _ = host;
    }

    /// Charges the time since the last mark to `section`.
    #[inline]
    pub fn lap(&mut self, host: &impl Host, section: Section) {
        #[cfg(feature = "profile")]
        {
            let now = now_ns(host);
            let i = section as usize;
            if let (Some(ns), Some(calls)) = (self.ns.get_mut(i), self.calls.get_mut(i)) {
                *ns += now.saturating_sub(self.last);
                *calls += 1;
            }
            self.last = now;
        }
        #[cfg(not(feature = "profile"))]
        let _ = (host, section);
    }

    /// Records this stream's times, once: `record(name, ns)` into a
    /// histogram, `add(name, delta)` to a counter.
    pub fn flush(
        &mut self,
        host: &impl Host,
        record: impl FnMut(&str, u64),
        add: impl FnMut(&str, i64),
    ) {
        #[cfg(feature = "profile")]
        {
            let (mut record, mut add) = (record, add);
            self.start(host);
            self.lap(host, Section::Clock);
            for s in Section::ALL {
                let i = s as usize;
                let (ns, calls) = (
                    self.ns.get(i).copied().unwrap_or(0),
                    self.calls.get(i).copied().unwrap_or(0),
                );
                if calls > 0 {
                    record(&format!("latchkey_edge.profile.{}_ns", s.name()), ns);
                    add(
                        &format!("latchkey_edge.profile.{}_sum_ns", s.name()),
                        i64::try_from(ns).unwrap_or(i64::MAX),
                    );
                    add(
                        &format!("latchkey_edge.profile.{}_calls", s.name()),
                        i64::from(calls),
                    );
                }
            }
            *self = Profile::default();
        }
        #[cfg(not(feature = "profile"))]
        let _ = (host, record, add);
    }
}
