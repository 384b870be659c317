//! The proxy-wasm 0.2.1 imports, served from [`HostState`].

use wasmtime::{Error, Linker, Module, Result, Val};

use super::memory::{C, addr, give, read, read_str, write};
use super::{
    BAD_ARGUMENT, GrpcCall, HostState, LocalReply, LogLevel, Metric, MetricKind, NOT_FOUND, OK,
};
use crate::wire::{deserialize_map, serialize_map};

/// proxy-wasm buffer types the filter reads.
const BUFFER_HTTP_REQUEST_BODY: i32 = 0;
const BUFFER_GRPC_RECEIVE: i32 = 5;
const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;
/// proxy-wasm map types the filter reads or changes.
const MAP_HTTP_REQUEST_HEADERS: i32 = 0;
const MAP_HTTP_REQUEST_TRAILERS: i32 = 1;
/// proxy-wasm stream types.
const STREAM_HTTP_REQUEST: i32 = 0;

/// Records a host call in [`HostState::calls`], and passes its answer on.
fn noted(c: &mut C<'_>, call: String, status: i32) -> Result<i32> {
    if c.data().tracing {
        let context = c.data().current;
        c.data_mut()
            .calls
            .push(format!("[{context}] {call} -> {status}"));
    }
    Ok(status)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).escape_debug().to_string()
}

/// The imports this host serves: the host calls `latchkey-filter`'s
/// `HostCalls` makes, and `proxy_set_effective_context` (the SDK's, before a
/// gRPC answer). `Linker::func_wrap` checks each signature against the
/// module's import when it is instantiated.
pub const SERVED: &[&str] = &[
    "proxy_log",
    "proxy_get_current_time_nanoseconds",
    "proxy_set_tick_period_milliseconds",
    "proxy_get_buffer_bytes",
    "proxy_get_header_map_pairs",
    "proxy_replace_header_map_value",
    "proxy_remove_header_map_value",
    "proxy_get_property",
    "proxy_get_shared_data",
    "proxy_set_shared_data",
    "proxy_send_local_response",
    "proxy_close_stream",
    "proxy_grpc_call",
    "proxy_get_status",
    "proxy_call_foreign_function",
    "proxy_define_metric",
    "proxy_increment_metric",
    "proxy_record_metric",
    "proxy_set_effective_context",
];

/// Serves [`SERVED`] and makes every other import of `module` trap.
pub fn link(linker: &mut Linker<HostState>, module: &Module) -> Result<()> {
    const ENV: &str = "env";
    linker.func_wrap(
        ENV,
        "proxy_log",
        |mut c: C<'_>, level: i32, ptr: i32, len: i32| -> Result<i32> {
            let message = String::from_utf8_lossy(&read(&mut c, ptr, len)?).into_owned();
            c.data_mut()
                .logs
                .push((LogLevel::of(level), message.clone()));
            noted(&mut c, format!("log({level}, {message:?})"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_current_time_nanoseconds",
        |mut c: C<'_>, out: i32| -> Result<i32> {
            let ns = u64::try_from(c.data().now.as_nanos()).unwrap_or(u64::MAX);
            write(&mut c, out, &ns.to_le_bytes())?;
            noted(&mut c, format!("get_current_time() = {ns}"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: C<'_>, ms: i32| -> Result<i32> {
            c.data_mut().tick_period_ms = Some(ms as u32);
            noted(&mut c, format!("set_tick_period({ms})"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: C<'_>,
         kind: i32,
         start: i32,
         max: i32,
         ptr_out: i32,
         size_out: i32|
         -> Result<i32> {
            let whole = match kind {
                BUFFER_HTTP_REQUEST_BODY => c.data_mut().stream()?.request_body.clone(),
                BUFFER_GRPC_RECEIVE => c.data().grpc_receive_buffer.clone(),
                BUFFER_PLUGIN_CONFIGURATION => c.data().plugin_configuration.clone(),
                _ => return noted(&mut c, format!("get_buffer({kind})"), NOT_FOUND),
            };
            let call = format!("get_buffer({kind}, {start}, {max})");
            let start = addr(start);
            if start > whole.len() {
                return noted(&mut c, call, BAD_ARGUMENT);
            }
            let end = start.saturating_add(addr(max)).min(whole.len());
            let part = whole.get(start..end).unwrap_or_default().to_vec();
            if !part.is_empty() {
                give(&mut c, &part, ptr_out, size_out)?;
            }
            noted(&mut c, format!("{call} = {}", text(&part)), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_pairs",
        |mut c: C<'_>, map: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            let pairs = match map {
                MAP_HTTP_REQUEST_HEADERS => c.data_mut().stream()?.request_headers.clone(),
                MAP_HTTP_REQUEST_TRAILERS => c.data_mut().stream()?.request_trailers.clone(),
                other => return Err(Error::msg(format!("header map {other} is not scripted"))),
            };
            give(&mut c, &serialize_map(&pairs), ptr_out, size_out)?;
            noted(
                &mut c,
                format!("get_header_map_pairs({map}) = {} pairs", pairs.len()),
                OK,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: C<'_>, map: i32, kp: i32, kl: i32, vp: i32, vl: i32| -> Result<i32> {
            if map != MAP_HTTP_REQUEST_HEADERS {
                return Err(Error::msg(format!("header map {map} is not scripted")));
            }
            let name = read_str(&mut c, kp, kl)?;
            let value = read(&mut c, vp, vl)?;
            let call = format!(
                "replace_header_map_value({map}, {name:?}, {})",
                text(&value)
            );
            let headers = &mut c.data_mut().stream()?.request_headers;
            headers.retain(|(n, _)| !n.eq_ignore_ascii_case(&name));
            headers.push((name, value));
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_remove_header_map_value",
        |mut c: C<'_>, map: i32, kp: i32, kl: i32| -> Result<i32> {
            if map != MAP_HTTP_REQUEST_HEADERS {
                return Err(Error::msg(format!("header map {map} is not scripted")));
            }
            let name = read_str(&mut c, kp, kl)?;
            let call = format!("remove_header_map_value({map}, {name:?})");
            let headers = &mut c.data_mut().stream()?.request_headers;
            headers.retain(|(n, _)| !n.eq_ignore_ascii_case(&name));
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_property",
        |mut c: C<'_>, pp: i32, pl: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            let path = read(&mut c, pp, pl)?;
            let path: Vec<String> = path
                .split(|b| *b == 0)
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect();
            let path = path.join(".");
            let value = c.data_mut().stream()?.properties.get(&path).cloned();
            let call = format!("get_property({path:?})");
            match value {
                Some(v) => {
                    give(&mut c, &v, ptr_out, size_out)?;
                    noted(&mut c, format!("{call} = {}", text(&v)), OK)
                }
                None => noted(&mut c, call, NOT_FOUND),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_shared_data",
        |mut c: C<'_>,
         kp: i32,
         kl: i32,
         ptr_out: i32,
         size_out: i32,
         cas_out: i32|
         -> Result<i32> {
            let key = read_str(&mut c, kp, kl)?;
            let entry = c.data().shared.borrow().entries.get(&key).cloned();
            let Some((value, cas)) = entry else {
                return noted(&mut c, format!("get_shared_data({key:?})"), NOT_FOUND);
            };
            if !value.is_empty() {
                give(&mut c, &value, ptr_out, size_out)?;
            }
            write(&mut c, cas_out, &cas.to_le_bytes())?;
            let call = format!(
                "get_shared_data({key:?}) = {} bytes, cas {cas}",
                value.len()
            );
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_shared_data",
        |mut c: C<'_>, kp: i32, kl: i32, vp: i32, vl: i32, cas: i32| -> Result<i32> {
            let key = read_str(&mut c, kp, kl)?;
            let value = if vl == 0 {
                Vec::new()
            } else {
                read(&mut c, vp, vl)?
            };
            let status = c.data().shared.borrow_mut().set(&key, &value, cas as u32);
            let call = format!("set_shared_data({key:?}, {} bytes, cas {cas})", value.len());
            noted(&mut c, call, status)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_send_local_response",
        |mut c: C<'_>,
         status: i32,
         _dp: i32,
         _dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         grpc_status: i32|
         -> Result<i32> {
            let body = read(&mut c, bp, bl)?;
            let headers = deserialize_map(&read(&mut c, hp, hl)?)
                .ok_or_else(|| Error::msg("malformed local reply headers"))?;
            let stream = c.data_mut().stream()?;
            if stream.local_reply.is_some() {
                return Err(Error::msg("a second local reply on one stream"));
            }
            let call = format!(
                "send_local_response({status}, grpc {grpc_status}, {}, {headers:?})",
                text(&body)
            );
            stream.local_reply = Some(LocalReply {
                http_status: status as u32,
                grpc_status,
                body,
                headers,
            });
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_close_stream",
        |mut c: C<'_>, kind: i32| -> Result<i32> {
            if kind != STREAM_HTTP_REQUEST {
                return Err(Error::msg(format!("close of stream type {kind}")));
            }
            c.data_mut().stream()?.reset = true;
            noted(&mut c, format!("close_stream({kind})"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_grpc_call",
        |mut c: C<'_>,
         up: i32,
         ul: i32,
         sp: i32,
         sl: i32,
         mp: i32,
         ml: i32,
         _metadata_p: i32,
         _metadata_l: i32,
         msgp: i32,
         msgl: i32,
         timeout_ms: i32,
         token_out: i32|
         -> Result<i32> {
            let cluster = read_str(&mut c, up, ul)?;
            let service = read_str(&mut c, sp, sl)?;
            let method = read_str(&mut c, mp, ml)?;
            let message = read(&mut c, msgp, msgl)?;
            let state = c.data_mut();
            state.next_token += 1;
            let token = state.next_token;
            state.grpc_calls.push(GrpcCall {
                token,
                cluster,
                service,
                method,
                message,
                timeout_ms: timeout_ms as u32,
            });
            write(&mut c, token_out, &token.to_le_bytes())?;
            let call = grpc_call_line(&c, token);
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_status",
        |mut c: C<'_>, code_out: i32, ptr_out: i32, size_out: i32| -> Result<i32> {
            let (code, message) = c.data().grpc_status.clone();
            write(&mut c, code_out, &code.to_le_bytes())?;
            if let Some(m) = &message {
                give(&mut c, m.as_bytes(), ptr_out, size_out)?;
            }
            noted(&mut c, format!("get_status() = {code}, {message:?}"), OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_call_foreign_function",
        |mut c: C<'_>,
         np: i32,
         nl: i32,
         ap: i32,
         al: i32,
         _ptr_out: i32,
         _size_out: i32|
         -> Result<i32> {
            let name = read_str(&mut c, np, nl)?;
            let args = read(&mut c, ap, al)?;
            let call = format!("call_foreign_function({name:?}, {})", text(&args));
            if name != "set_envoy_filter_state" {
                return noted(&mut c, call, NOT_FOUND);
            }
            // SetEnvoyFilterStateArguments{path = 1, value = 2, span = 3}
            let key = crate::wire::proto_string(&args, 1).unwrap_or_default();
            let value = crate::wire::proto_string(&args, 2).unwrap_or_default();
            c.data_mut().stream()?.filter_state.push((key, value));
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_define_metric",
        |mut c: C<'_>, kind: i32, np: i32, nl: i32, id_out: i32| -> Result<i32> {
            let name = read_str(&mut c, np, nl)?;
            let kind = match kind {
                0 => MetricKind::Counter,
                1 => MetricKind::Gauge,
                2 => MetricKind::Histogram,
                _ => return Ok(BAD_ARGUMENT),
            };
            let metrics = &mut c.data_mut().metrics;
            let id = match metrics.iter().position(|m| m.name == name) {
                Some(i) if metrics.get(i).is_some_and(|m| m.kind != kind) => {
                    return Err(Error::msg(format!("{name} defined as two kinds")));
                }
                Some(i) => i,
                None => {
                    metrics.push(Metric {
                        name: name.clone(),
                        kind,
                        value: 0,
                        samples: Vec::new(),
                    });
                    metrics.len() - 1
                }
            };
            let id = u32::try_from(id).map_err(|_| Error::msg("too many metrics"))?;
            write(&mut c, id_out, &id.to_le_bytes())?;
            noted(
                &mut c,
                format!("define_metric({kind:?}, {name:?}) = {id}"),
                OK,
            )
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_increment_metric",
        |mut c: C<'_>, id: i32, delta: i64| -> Result<i32> {
            let call = format!("increment_metric({id}, {delta})");
            let Some(m) = c.data_mut().metrics.get_mut(addr(id)) else {
                return noted(&mut c, call, NOT_FOUND);
            };
            if m.kind == MetricKind::Histogram {
                return noted(&mut c, call, BAD_ARGUMENT);
            }
            m.value += delta;
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_record_metric",
        |mut c: C<'_>, id: i32, value: i64| -> Result<i32> {
            let call = format!("record_metric({id}, {value})");
            let Some(m) = c.data_mut().metrics.get_mut(addr(id)) else {
                return noted(&mut c, call, NOT_FOUND);
            };
            match m.kind {
                MetricKind::Histogram => m.samples.push(value as u64),
                _ => m.value = value,
            }
            noted(&mut c, call, OK)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_effective_context",
        |mut c: C<'_>, id: i32| -> Result<i32> {
            c.data_mut().current = id as u32;
            noted(&mut c, format!("set_effective_context({id})"), OK)
        },
    )?;

    for import in module.imports() {
        if import.module() == ENV && SERVED.contains(&import.name()) {
            continue;
        }
        let name = format!("{}::{}", import.module(), import.name());
        let wasmtime::ExternType::Func(ty) = import.ty() else {
            return Err(Error::msg(format!("import {name} is not a function")));
        };
        linker.func_new(
            import.module(),
            import.name(),
            ty,
            move |_c: C<'_>, _params: &[Val], _results: &mut [Val]| {
                Err(Error::msg(format!(
                    "the filter called {name}, which the scripted host does not serve"
                )))
            },
        )?;
    }
    Ok(())
}

fn grpc_call_line(c: &C<'_>, token: u32) -> String {
    match c.data().grpc_calls.iter().find(|g| g.token == token) {
        Some(g) => format!(
            "grpc_call({:?}, {:?}, {:?}, {} bytes, {} ms) = {token}",
            g.cluster,
            g.service,
            g.method,
            g.message.len(),
            g.timeout_ms
        ),
        None => format!("grpc_call() = {token}"),
    }
}
