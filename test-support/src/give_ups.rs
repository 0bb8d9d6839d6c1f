//! The RPC layer's record of calls that gave up, captured for a test to
//! print when one of its calls failed.
//!
//! A replica set logs every call it gives up on at debug level, with the
//! replica and failure of each attempt (`tessera_rpc::replicas`). A drill
//! that sees a failed call prints what it caught here: which attempts the
//! call made and why it stopped, where the error alone names only the last
//! attempt. Only those events pass the filter, so the rest of the process
//! logs nothing and pays nothing for it.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use tessera_transport::sync::LockExt;
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, SubscriberExt};

/// The give-up events of this process (see the module docs).
#[derive(Clone)]
pub struct GiveUps {
    events: Arc<Mutex<Vec<String>>>,
}

/// At most this many events are kept (the first ones: a drill prints the
/// first failure).
const KEPT: usize = 64;

impl GiveUps {
    /// Starts capturing (once per process: the subscriber is global, so
    /// that the runtime's every thread reports). Returns `None` if another
    /// global subscriber was installed first.
    pub fn install() -> Option<GiveUps> {
        static INSTALLED: OnceLock<Option<GiveUps>> = OnceLock::new();
        INSTALLED
            .get_or_init(|| {
                let give_ups = GiveUps {
                    events: Arc::default(),
                };
                let layer = Capture(give_ups.clone()).with_filter(filter_fn(|meta| {
                    meta.is_event()
                        && meta.target() == "tessera_rpc::replicas"
                        && *meta.level() == tracing::Level::DEBUG
                }));
                tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
                    .ok()
                    .map(|()| give_ups)
            })
            .clone()
    }

    /// The calls that gave up so far, one line each, oldest first.
    pub fn events(&self) -> Vec<String> {
        self.events.locked().clone()
    }
}

struct Capture(GiveUps);

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut line = Line::default();
        event.record(&mut line);
        if line.message != "giving up" {
            return;
        }
        let mut events = self.0.events.locked();
        if events.len() < KEPT {
            events.push(line.fields);
        }
    }
}

/// An event's message and its other fields as `name=value` pairs.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            let _ = write!(
                self.fields,
                "{}{}={value:?}",
                if self.fields.is_empty() { "" } else { " " },
                field.name()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_the_replica_sets_give_ups_and_nothing_else() {
        let give_ups = GiveUps::install().expect("no other subscriber in this test");
        tracing::debug!(target: "tessera_rpc::replicas", attempt = 2, "trying another replica");
        tracing::debug!(target: "tessera_rpc::other", "giving up");
        tracing::info!(target: "tessera_rpc::replicas", "giving up");
        tracing::debug!(target: "tessera_rpc::replicas", attempt = 3, why = %"attempts used up", "giving up");
        assert_eq!(
            give_ups.events(),
            vec!["attempt=3 why=attempts used up".to_string()]
        );
    }
}
