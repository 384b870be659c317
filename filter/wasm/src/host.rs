//! [`Host`] over `proxy_wasm::hostcalls`: one method, one host call.
//!
//! The `hostcalls` functions return `Result` (the SDK's trait helpers unwrap,
//! and a panic would take the VM down); what the filter does with a failure
//! is decided in the core, so each method only turns the host's answer into
//! the trait's.

use std::time::{Duration, UNIX_EPOCH};

use latchkey_filter_core::admission::{SharedStore, StoreError};
use latchkey_filter_core::host::{Buffer, HeaderMap, Host, HostError, LogLevel, MetricKind};
use latchkey_filter_core::status::GrpcCode;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, GrpcStatusCode, MapType, MetricType, Status};

/// Envoy, through the proxy-wasm ABI.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostCalls;

fn host_error(s: Status) -> HostError {
    HostError {
        status: format!("{s:?}"),
    }
}

/// Shared data through the host: one map per `vm_id`, across workers.
impl SharedStore for HostCalls {
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

impl Host for HostCalls {
    fn now(&self) -> Option<Duration> {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
    }

    fn log(&self, level: LogLevel, message: &str) {
        let level = match level {
            LogLevel::Warn => proxy_wasm::types::LogLevel::Warn,
            LogLevel::Error => proxy_wasm::types::LogLevel::Error,
        };
        let _ = hostcalls::log(level, message);
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        let _ = hostcalls::increment_metric(id, delta);
    }

    fn record_metric(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }

    fn buffer(&self, buffer: Buffer, start: usize, max: usize) -> Option<Vec<u8>> {
        let buffer = match buffer {
            Buffer::RequestBody => BufferType::HttpRequestBody,
            Buffer::PluginConfiguration => BufferType::PluginConfiguration,
            Buffer::GrpcReceive => BufferType::GrpcReceiveBuffer,
        };
        hostcalls::get_buffer(buffer, start, max).ok().flatten()
    }

    fn set_tick_period(&self, period: Duration) {
        let _ = hostcalls::set_tick_period(period);
    }

    fn dispatch_grpc_call(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError> {
        hostcalls::dispatch_grpc_call(cluster, service, method, Vec::new(), Some(message), timeout)
            .map_err(host_error)
    }

    fn grpc_status(&self) -> Option<(u32, Option<String>)> {
        hostcalls::get_grpc_status().ok()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn header_map(&self, map: HeaderMap) -> Vec<(String, Vec<u8>)> {
        // Bytes, not `get_map`: that unwraps UTF-8, and a header value need
        // not be UTF-8.
        let map = match map {
            HeaderMap::RequestHeaders => MapType::HttpRequestHeaders,
            HeaderMap::RequestTrailers => MapType::HttpRequestTrailers,
        };
        hostcalls::get_map_bytes(map).unwrap_or_default()
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).map_err(host_error)
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, None).map_err(host_error)
    }

    fn send_grpc_reply(
        &self,
        code: GrpcCode,
        message: &str,
        details_bin: &str,
    ) -> Result<(), HostError> {
        hostcalls::send_grpc_response(
            grpc_code(code),
            Some(message),
            vec![("grpc-status-details-bin", details_bin.as_bytes())],
        )
        .map_err(host_error)
    }

    fn reset_request(&self) {
        let _ = hostcalls::reset_http_request();
    }

    fn call_foreign_function(&self, name: &str, arguments: &[u8]) -> Result<(), HostError> {
        hostcalls::call_foreign_function(name, Some(arguments))
            .map(|_| ())
            .map_err(host_error)
    }
}

fn grpc_code(code: GrpcCode) -> GrpcStatusCode {
    match code {
        GrpcCode::InvalidArgument => GrpcStatusCode::InvalidArgument,
        GrpcCode::PermissionDenied => GrpcStatusCode::PermissionDenied,
        GrpcCode::ResourceExhausted => GrpcStatusCode::ResourceExhausted,
        GrpcCode::Unimplemented => GrpcStatusCode::Unimplemented,
        GrpcCode::Internal => GrpcStatusCode::Internal,
        GrpcCode::Unavailable => GrpcStatusCode::Unavailable,
        GrpcCode::Unauthenticated => GrpcStatusCode::Unauthenticated,
    }
}
