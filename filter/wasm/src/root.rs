//! The root context: each proxy-wasm callback forwarded to
//! [`latchkey_filter_core::edge::Root`] with the host.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use crate::host::HostCalls;
use crate::stream::EdgeStream;

#[derive(Default)]
pub(crate) struct EdgeRoot {
    core: latchkey_filter_core::edge::Root,
}

impl Context for EdgeRoot {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        self.core
            .on_grpc_call_response(&HostCalls, token_id, status_code, response_size);
    }
}

impl RootContext for EdgeRoot {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        self.core.on_configure(&HostCalls)
    }

    fn on_tick(&mut self) {
        self.core.on_tick(&HostCalls);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(EdgeStream::new(self.core.new_stream())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
