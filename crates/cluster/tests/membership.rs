//! Node registration, keep-alive and listing, on both stores.

#[path = "../../meta/tests/common/mod.rs"]
mod common;
mod support;

use std::time::Duration;

use ashlar_cluster::{
    claim, keep_registered, list_nodes, register, remove_member, MembershipConfig, NodeState,
    NodeStatus, Removal,
};
use ashlar_core::VdiskId;
use ashlar_meta::MetaStore;
use common::{Backend, Settings};
use support::{node_id, node_record};

fn config(ttl: Duration) -> MembershipConfig {
    MembershipConfig {
        lease_ttl: ttl,
        record_refresh_interval: ttl,
    }
}

fn state_of(nodes: &[NodeStatus], n: u16) -> Option<NodeState> {
    nodes
        .iter()
        .find(|s| s.record.node_id == node_id(n))
        .map(|s| s.state)
}

/// Waits until node `n` is in `state`, at most `limit`.
async fn wait_for_state<M: MetaStore>(store: &M, n: u16, state: NodeState, limit: Duration) {
    support::wait_until(&format!("node {n} {state:?}"), limit, || async {
        state_of(&list_nodes(store).await.expect("list"), n) == Some(state)
    })
    .await;
}

async fn registered_nodes_are_listed_up_with_their_records<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    assert!(list_nodes(&store).await.expect("list").is_empty());
    let long = config(Duration::from_secs(30));
    let one = register(store.clone(), node_record(1), long)
        .await
        .expect("register");
    let _two = register(store.clone(), node_record(2), long)
        .await
        .expect("register");
    for vdisk in [1, 2] {
        claim(&store, VdiskId(vdisk), one.node_id(), one.lease())
            .await
            .expect("claim");
    }
    let nodes = list_nodes(&store).await.expect("list");
    assert_eq!(nodes.len(), 2);
    for (status, n, owned) in [(&nodes[0], 1, 2), (&nodes[1], 2, 0)] {
        assert_eq!(status.record, node_record(n));
        assert_eq!(status.state, NodeState::Up);
        assert_eq!(status.vdisks_owned, owned);
    }
    assert!(nodes[1].record.storage_only);
}

async fn a_node_whose_lease_ends_is_listed_down_until_removed<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let short = register(store.clone(), node_record(1), config(B::TTL))
        .await
        .expect("register");
    let stays = register(
        store.clone(),
        node_record(2),
        config(Duration::from_secs(30)),
    )
    .await
    .expect("register");
    assert_eq!(
        remove_member(&store, short.node_id())
            .await
            .expect("remove"),
        Removal::StillUp
    );
    // No keep-alive for node 1: its lease ends, and with it its live record.
    wait_for_state(&store, 1, NodeState::Down, B::TTL * 10).await;
    let nodes = list_nodes(&store).await.expect("list");
    let down = nodes
        .iter()
        .find(|s| s.record.node_id == node_id(1))
        .expect("listed");
    assert_eq!(
        down.record,
        node_record(1),
        "a down node keeps its last record"
    );
    assert_eq!(state_of(&nodes, 2), Some(NodeState::Up));
    assert_eq!(
        remove_member(&store, node_id(1)).await.expect("remove"),
        Removal::Removed
    );
    assert_eq!(
        remove_member(&store, node_id(1)).await.expect("remove"),
        Removal::NotFound
    );
    let nodes = list_nodes(&store).await.expect("list");
    assert_eq!(state_of(&nodes, 1), None);
    assert_eq!(state_of(&nodes, 2), Some(NodeState::Up));
    // A clean stop ends the lease at once: down without waiting for a TTL.
    stays.deregister().await.expect("deregister");
    assert_eq!(
        state_of(&list_nodes(&store).await.expect("list"), 2),
        Some(NodeState::Down)
    );
}

async fn keep_alive_keeps_a_node_up_and_registers_it_again_after_a_lost_lease<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    // Two TTLs, so a keep-alive delayed on a busy machine does not end the lease early.
    let ttl = B::TTL * 2;
    let registration = register(store.clone(), node_record(1), config(ttl))
        .await
        .expect("register");
    let mut leases = registration.subscribe_lease();
    let first = registration.lease();
    let first_valid_until = leases.borrow().valid_until;
    assert!(first_valid_until > tokio::time::Instant::now());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut refreshed = node_record(1);
    refreshed.disks[0].free_bytes = 12345;
    let expected = refreshed.clone();
    let task = tokio::spawn(keep_registered(
        registration,
        move || refreshed.clone(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    // Well past the TTL, the node is still up thanks to the keep-alives.
    tokio::time::sleep(ttl * 3).await;
    let nodes = list_nodes(&store).await.expect("list");
    assert_eq!(state_of(&nodes, 1), Some(NodeState::Up));
    let kept = *leases.borrow_and_update();
    assert_eq!(kept.lease, first);
    assert!(
        kept.valid_until >= first_valid_until + ttl,
        "keep-alives move the lease's validity on"
    );
    assert!(kept.valid_until <= tokio::time::Instant::now() + ttl);
    assert_eq!(
        nodes[0].record, expected,
        "records are refreshed every interval"
    );
    // The lease vanishes behind the node's back (as when etcd loses its data): the loop
    // notices at its next keep-alive and registers on a new lease.
    store
        .revoke_lease(first)
        .await
        .expect("revoke the node's lease");
    tokio::time::timeout(ttl * 5, leases.wait_for(|status| status.lease != first))
        .await
        .expect("re-registered within 5 TTLs")
        .expect("lease channel open");
    wait_for_state(&store, 1, NodeState::Up, ttl * 5).await;
    // Stopping the loop ends the lease: the node is down at once.
    stop_tx.send(()).expect("loop running");
    task.await.expect("loop ends");
    assert_eq!(
        state_of(&list_nodes(&store).await.expect("list"), 1),
        Some(NodeState::Down)
    );
}

conformance!(
    registered_nodes_are_listed_up_with_their_records,
    a_node_whose_lease_ends_is_listed_down_until_removed,
    keep_alive_keeps_a_node_up_and_registers_it_again_after_a_lost_lease,
);
