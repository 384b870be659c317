//! A campaign: the session's table first (a leadership this session has
//! already gets another guard), then Campaign; a leadership gets its fence
//! registration and its observer before the guard leaves.

use std::sync::Arc;

use latchkey_proto::electionv1::CampaignRequest;

use super::watch::{self, Watched};
use super::{CampaignOptions, Leadership, LeadershipLost};
use crate::Reason;
use crate::client::Client;
use crate::error::Error;
use crate::lock::stale_session;
use crate::session::{BeginCampaign, FenceCallback, FenceReason, Lead, SessionInner};
use crate::token::FencingToken;

pub(super) async fn campaign(
    client: &Client,
    election: &str,
    class: &str,
    value: &str,
    options: &CampaignOptions,
) -> Result<Leadership, Error> {
    let explicit = options.session.is_some();
    let mut session = match &options.session {
        Some(session) => Arc::clone(&session.inner),
        None => client.session_for_class(class).await?.inner,
    };
    let mut retried = false;
    loop {
        match campaign_on(&session, election, class, value, options).await {
            Err(err) if !explicit && !retried && stale_session(&err) => {
                // The class's session went away or its TTL changed since we
                // cached it: open (or be handed) the right one once.
                if err.reason() == Reason::SessionExpired {
                    session.core.fence(FenceReason::Expired);
                }
                client.forget_class(class, session.core.id);
                session = client.session_for_class(class).await?.inner;
                retried = true;
            }
            result => return result,
        }
    }
}

async fn campaign_on(
    session: &Arc<SessionInner>,
    election: &str,
    class: &str,
    value: &str,
    options: &CampaignOptions,
) -> Result<Leadership, Error> {
    let core = &session.core;
    loop {
        match core.begin_campaign(election)? {
            BeginCampaign::Reentered(lead) => {
                return Ok(Leadership::new(lead, Arc::clone(session)));
            }
            BeginCampaign::Wait(settled) => settled.await,
            BeginCampaign::Outermost => break,
        }
    }

    // From here the election is Campaigning in the table; whatever happens
    // to this future, the entry is settled (after a clean-up if the
    // arbiter may still have the candidacy).
    let _pending = PendingCampaign { session, election };
    let rpc = &session.rpc;
    let mut request = rpc.stream(CampaignRequest {
        election: election.to_owned(),
        class: class.to_owned(),
        session_id: core.id,
        value: value.to_owned(),
        priority: options.priority,
        instance: rpc.instance.clone(),
    });
    if let Some(wait) = options.wait {
        request.set_timeout(wait);
    }
    let led = match rpc.election().campaign(request).await {
        Ok(reply) => reply.into_inner().leadership,
        Err(status) => {
            let err = Error::from(status);
            // The arbiter withdraws the candidacy of a call that ends
            // without leading, answered or not.
            return Err(err);
        }
    };
    let led = led.ok_or(Error::Protocol {
        rpc: "Campaign",
        problem: "OK without a leadership",
    })?;
    if led.session_id != core.id || led.election != election || led.token == 0 {
        return Err(Error::Protocol {
            rpc: "Campaign",
            problem: "a leadership of another session or election",
        });
    }
    let lead = Arc::new(Lead::new(
        led.election,
        led.session_id,
        led.term,
        FencingToken::new(led.token),
        led.value,
    ));
    let weak = Arc::downgrade(&lead);
    let on_fence: FenceCallback = Arc::new(move |reason| {
        if let Some(lead) = weak.upgrade() {
            lead.lose(LeadershipLost::Fenced(reason));
        }
    });
    core.led(Arc::clone(&lead), &on_fence)?;
    let watcher = tokio::spawn(watch::run(Watched {
        rpc: rpc.clone(),
        core: Arc::clone(core),
        lead: Arc::downgrade(&lead),
        election: lead.election.clone(),
        term: lead.term,
        started_at: watch::started_at(lead.token.get()),
        max_backoff: core.keepalive_interval,
    }));
    lead.set_watcher(watcher.abort_handle());
    tracing::debug!(election = %lead.election, term = lead.term, session_id = core.id, "leads");
    Ok(Leadership::new(lead, Arc::clone(session)))
}

/// Settles the session's campaign entry for the election however the
/// campaign future ends.
struct PendingCampaign<'a> {
    session: &'a Arc<SessionInner>,
    election: &'a str,
}

impl Drop for PendingCampaign<'_> {
    fn drop(&mut self) {
        // A call dropped before its answer: the arbiter withdraws the
        // candidacy itself when the call goes (it notices the cancelled
        // RPC). Campaigning again to withdraw would stand once more, and
        // over a vacancy could lead.
        self.session.core.campaign_failed(self.election);
    }
}
