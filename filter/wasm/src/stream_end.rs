//! The end of a stream: the arbiter's response headers end a waiter's wait,
//! and `on_log` (every way a stream ends) gives every place back.

use latchkey_filter_core::metrics;
use proxy_wasm::types::Action;

use crate::host_store::HostStore;
use crate::profile::Section;
use crate::stream::EdgeStream;

impl EdgeStream {
    pub(crate) fn response_headers(&mut self) -> Action {
        // The arbiter has answered: the wait is over, whether or not the
        // client ever reads the answer (a zero receive window must not keep
        // the place).
        self.prof.start();
        self.release_waiter();
        self.prof.lap(Section::ResponseHeaders);
        Action::Continue
    }

    /// Gives the waiter's places back (once): the wait is over.
    pub(crate) fn release_waiter(&mut self) {
        if let (Some((ticket, scope)), Some(active)) = (self.held.take(), self.active.as_ref()) {
            active.admission.release(&HostStore, &ticket);
            self.state
                .borrow_mut()
                .metrics
                .gauge_add(&metrics::waiters(&scope), -1);
        }
    }

    /// Gives every place back (once): the stream is over.
    pub(crate) fn release(&mut self) {
        let holding = self.held.is_some() || self.stream.is_some();
        self.prof.start();
        self.release_waiter();
        if let (Some(place), Some(active)) = (self.stream.take(), self.active.as_ref()) {
            active.admission.close_stream(&HostStore, &place);
            self.state
                .borrow_mut()
                .metrics
                .gauge_add(metrics::STREAMS_OPEN, -1);
        }
        if holding {
            self.prof.lap(Section::Release);
        }
        let state = &self.state;
        self.prof.flush(
            |name, ns| state.borrow_mut().metrics.histogram(name, ns),
            |name, delta| state.borrow_mut().metrics.add(name, delta),
        );
    }
}
