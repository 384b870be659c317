//! Shared data through the host.

use latchkey_filter_core::admission::{SharedStore, StoreError};
use proxy_wasm::hostcalls;
use proxy_wasm::types::Status;

/// Shared data through the host: one map per `vm_id`, across workers.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        hostcalls::get_shared_data(key).map_err(|s| StoreError::Host(format!("{s:?}")))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("{s:?}"))),
        }
    }
}
