//! The root context: one per VM (per worker, and again on every ECDS update).
//! Configuration is in `configure`, the grant table refresh (ticks and the
//! arbiter's answers) in `refresh`.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use std::rc::Rc;

use crate::profile::Profile;
use crate::stream::EdgeStream;
use crate::vm::SharedState;
use latchkey_filter_core::request::Method;

#[derive(Default)]
pub(crate) struct EdgeRoot {
    pub(crate) state: SharedState,
    pub(crate) refresh_in_flight: Option<u32>,
}

impl Context for EdgeRoot {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        self.refresh_answered(token_id, status_code, response_size);
    }
}

impl RootContext for EdgeRoot {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        self.configure()
    }

    fn on_tick(&mut self) {
        self.tick();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(EdgeStream {
            state: self.state.clone(),
            active: self.state.borrow().active.clone(),
            method: Method::Session,
            identity: Rc::from(""),
            bound: Rc::from(""),
            key_header: None,
            decided: false,
            held: None,
            stream: None,
            started: None,
            prof: Profile::default(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
