//! The root context: one per VM (per worker, and again for every ECDS
//! update). Its callbacks are in `configure` (`on_configure`) and `refresh`
//! (`on_tick`, `on_grpc_call_response`).

use crate::edge::stream::Stream;
use crate::edge::vm::SharedVm;

#[derive(Default)]
pub struct Root {
    pub(crate) vm: SharedVm,
    /// The token of the grant-table refresh the arbiter has not answered yet.
    pub(crate) refresh_in_flight: Option<u32>,
}

impl Root {
    /// A stream's context: it decides with the configuration and grant table
    /// active when it starts.
    pub fn new_stream(&self) -> Stream {
        let active = self.vm.borrow().active.clone();
        Stream::new(self.vm.clone(), active)
    }

    /// The VM's state (tests).
    #[cfg(test)]
    pub(crate) fn vm(&self) -> &SharedVm {
        &self.vm
    }
}
