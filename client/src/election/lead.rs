//! [`Client::lead`]: campaign, run the body while leading, drop it at the
//! loss, campaign again.

use std::future::Future;
use std::time::Duration;

use tokio::time::sleep;

use super::{CampaignOptions, Leadership};
use crate::Reason;
use crate::client::Client;
use crate::error::Error;

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub(super) async fn lead<F, Fut, T>(
    client: &Client,
    election: String,
    class: String,
    value: String,
    options: CampaignOptions,
    mut body: F,
) -> Result<T, Error>
where
    F: FnMut(Leadership) -> Fut,
    Fut: Future<Output = T>,
{
    let mut backoff = MIN_BACKOFF;
    loop {
        let campaigned = client
            .campaign(
                election.as_str(),
                class.as_str(),
                value.as_str(),
                options.clone(),
            )
            .await;
        let leadership = match campaigned {
            Ok(leadership) => {
                backoff = MIN_BACKOFF;
                leadership
            }
            // Someone else leads: stand again.
            Err(err) if err.reason() == Reason::WaitTimeout => continue,
            Err(err) if retryable(&err, &options) => {
                tracing::debug!(%election, error = %err, "campaign failed; retrying");
                sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            Err(err) => return Err(err),
        };
        let term = leadership.term();
        let lost = leadership.lost();
        tracing::info!(%election, term, "leading");
        tokio::select! {
            // A body that finished (after resigning, say) wins a tie.
            biased;
            out = body(leadership) => return Ok(out),
            reason = lost => {
                tracing::warn!(%election, term, %reason, "leadership lost; the body was stopped, campaigning again");
            }
        }
    }
}

/// Whether campaigning again can help: a temporary failure, or a session
/// that died (the next campaign opens another), unless the caller named
/// the session.
fn retryable(err: &Error, options: &CampaignOptions) -> bool {
    if err.retry_hint().is_some() {
        return true;
    }
    let dead_session = matches!(err, Error::Fenced { .. } | Error::LeadershipLost { .. })
        || matches!(
            err.reason(),
            Reason::SessionExpired | Reason::SessionClassMismatch
        );
    dead_session && options.session.is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FenceReason;

    #[test]
    fn only_failures_a_retry_can_mend_are_retried() {
        let options = CampaignOptions::default();
        let fenced = Error::Fenced {
            session_id: 1,
            reason: FenceReason::DeadlineExceeded,
        };
        assert!(retryable(&fenced, &options));
        let unavailable = Error::from(tonic::Status::unavailable("down"));
        assert!(retryable(&unavailable, &options));
        let denied = Error::from(tonic::Status::permission_denied("no grant"));
        assert!(!retryable(&denied, &options));
        let protocol = Error::Protocol {
            rpc: "Campaign",
            problem: "x",
        };
        assert!(!retryable(&protocol, &options));
    }
}
