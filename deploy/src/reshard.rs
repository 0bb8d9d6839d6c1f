//! `tessera reshard`: an operator's handle on a cluster's shard map (etcd
//! mode). It plans a resize, cancels one (after its cut-over too, while
//! no receiving shard claimed its opening), or says
//! where the map stands; the resize itself is carried by the servers,
//! through the state machine stored in etcd (`tessera_coord::shard_map`),
//! so that the tool may exit, or die, at any point without leaving the
//! cluster half-changed. Each write is a compare-and-swap on the map's
//! revision (`EtcdCoordinator::update_shard_map`): two operators, or an
//! operator and a server, never both win from one state.

use std::fmt::Write as _;

use tessera_coord::{CoordError, CoordinatorConfig, EtcdCoordinator, ResizeState, ShardMap};

/// What `tessera reshard` was asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Plan a resize to this many shards.
    To(u32),
    /// Plan one whose cut-over waits for [`Action::CutOver`].
    ToHeld(u32),
    /// Release a held resize's cut-over.
    CutOver,
    /// Cancel the resize in progress (after its cut-over only while no
    /// receiving shard claimed its opening).
    Cancel,
    /// Say where the map stands.
    Status,
}

/// Does `action` on the cluster `config` names; returns the map as it
/// now is.
pub async fn run(config: &CoordinatorConfig, action: Action) -> Result<ShardMap, CoordError> {
    let coord = EtcdCoordinator::connect(config).await?;
    match action {
        Action::To(to) => coord.update_shard_map(|map| map.plan(to)).await,
        Action::ToHeld(to) => coord.update_shard_map(|map| map.plan_held(to)).await,
        Action::CutOver => coord.update_shard_map(ShardMap::release).await,
        Action::Cancel => coord.update_shard_map(ShardMap::cancel).await,
        Action::Status => {
            coord
                .shard_map()
                .await?
                .map(|(map, _)| map)
                .ok_or_else(|| CoordError::NoShardMap {
                    cluster: config.cluster.clone(),
                    endpoints: config.endpoints.join(","),
                })
        }
    }
}

/// The map in words, for an operator: the count keys are routed by, and
/// the resize in progress or last finished with its receiving shards.
pub fn describe(map: &ShardMap) -> String {
    let mut out = format!(
        "shard map version {}: keys routed to {} shards",
        map.version, map.num_shards
    );
    if let Some(r) = &map.resize {
        let state = match r.state {
            ResizeState::Planned => "planned (nothing moved yet)",
            ResizeState::Copying => "copying the moving keys",
            ResizeState::CutOver => "cut over (the new owners serve the moved keys)",
            ResizeState::Done => "done",
            ResizeState::Cancelled => "cancelled (the map is as it was)",
        };
        let _ = write!(
            out,
            "\nresize {} -> {} shards (planned at version {}): {state}",
            r.from, r.to, r.id
        );
        if map.active().is_some() && r.hold {
            out.push_str("; the cut-over is held (`tessera reshard --cut-over` releases it)");
        }
        if map.active().is_some() {
            let receiving: Vec<u32> = r.receiving().collect();
            let _ = write!(
                out,
                "\n  receiving shards {}; in step: {}",
                list(&receiving),
                if r.ready.is_empty() {
                    "none yet".to_owned()
                } else {
                    list(&r.ready)
                }
            );
            if r.state == ResizeState::CutOver {
                let _ = write!(
                    out,
                    "; serving the moved keys: {}",
                    if r.opened.is_empty() {
                        "none yet".to_owned()
                    } else {
                        list(&r.opened.keys().copied().collect::<Vec<_>>())
                    }
                );
                if r.opening.is_empty() && r.opened.is_empty() {
                    out.push_str(
                        "\n  no receiving shard claimed its opening: `tessera reshard --cancel` still gives it up",
                    );
                }
            }
        }
    }
    out
}

fn list(shards: &[u32]) -> String {
    shards
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_in_words_names_the_state_and_the_receiving_shards() {
        let map = ShardMap::new(2);
        assert_eq!(
            describe(&map),
            "shard map version 1: keys routed to 2 shards"
        );
        let copying = map
            .plan(4)
            .and_then(|m| m.start_copying())
            .and_then(|m| m.handle_ready(3, true))
            .unwrap();
        assert_eq!(
            describe(&copying),
            "shard map version 4: keys routed to 2 shards\n\
             resize 2 -> 4 shards (planned at version 2): copying the moving keys\n  \
             receiving shards 2, 3; in step: 3"
        );
        let held = map.plan_held(3).unwrap();
        assert!(
            describe(&held).ends_with("; the cut-over is held (`tessera reshard --cut-over` releases it)\n  receiving shards 2; in step: none yet"),
            "{}",
            describe(&held)
        );
        let cancelled = copying.cancel().unwrap();
        assert!(
            describe(&cancelled).ends_with(
                "resize 2 -> 4 shards (planned at version 2): cancelled (the map is as it was)"
            ),
            "{}",
            describe(&cancelled)
        );
    }
}
