//! Ownership claims with epochs, on both stores.

#[path = "../../meta/tests/common/mod.rs"]
mod common;
mod support;

use std::time::Duration;

use ashlar_cluster::{
    claim, claim_to_serve, current_epoch, current_owner, release, watch_ownership, ClaimError,
    OwnershipEpoch, ReleaseError, ServeError, ServeRefusal,
};
use ashlar_core::VdiskId;
use ashlar_meta::MetaStore;
use common::{Backend, Settings};
use support::node_id;

const VDISK: VdiskId = VdiskId(7);

/// Waits until the vdisk has no owner (its owner's lease ended), at most `limit`.
async fn wait_unowned<M: MetaStore>(store: &M, limit: Duration) {
    support::wait_until("owner record gone", limit, || async {
        current_owner(store, VDISK)
            .await
            .expect("read owner")
            .is_none()
    })
    .await;
}

async fn racing_claims_have_exactly_one_winner<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let long = Duration::from_secs(30);
    // Some history first, so the race starts from epoch 3, not from nothing.
    let warmup = store.grant_lease(long).await.expect("grant");
    for expected in 1..=3 {
        let won = claim(&store, VDISK, node_id(9), warmup)
            .await
            .expect("claim");
        assert_eq!(won.epoch, OwnershipEpoch(expected));
        release(&store, &won).await.expect("release");
    }
    for round in 0..5u64 {
        let (lease_a, lease_b) = (
            store.grant_lease(long).await.expect("grant"),
            store.grant_lease(long).await.expect("grant"),
        );
        let (a, b) = tokio::join!(
            claim(&store, VDISK, node_id(1), lease_a),
            claim(&store, VDISK, node_id(2), lease_b)
        );
        let (winner, loser) = match (a, b) {
            (Ok(w), Err(l)) | (Err(l), Ok(w)) => (w, l),
            (a, b) => panic!("round {round}: expected one winner, got {a:?} and {b:?}"),
        };
        let expected = OwnershipEpoch(4 + round);
        assert_eq!(winner.epoch, expected);
        match loser {
            ClaimError::Owned { owner, epoch, .. } => {
                assert_eq!(owner, winner.node);
                assert_eq!(epoch, expected);
            }
            other => panic!("the loser should see the winner, got {other}"),
        }
        let owner = current_owner(&store, VDISK)
            .await
            .expect("owner")
            .expect("owned");
        assert_eq!(
            (owner.node, owner.epoch, owner.lease),
            (winner.node, expected, Some(winner.lease))
        );
        assert_eq!(current_epoch(&store, VDISK).await.expect("epoch"), expected);
        release(&store, &winner).await.expect("release");
    }
}

async fn expired_owner_is_replaced_with_a_greater_epoch<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let short = store.grant_lease(B::TTL).await.expect("grant");
    let first = claim(&store, VDISK, node_id(1), short)
        .await
        .expect("claim");
    assert_eq!(first.epoch, OwnershipEpoch(1));
    let other = store
        .grant_lease(Duration::from_secs(30))
        .await
        .expect("grant");
    let refused = claim(&store, VDISK, node_id(2), other).await.unwrap_err();
    assert!(
        matches!(refused, ClaimError::Owned { owner, .. } if owner == node_id(1)),
        "{refused}"
    );
    // No keep-alive: the first owner's lease ends by itself, and its owner key with it.
    wait_unowned(&store, B::TTL * 10).await;
    let second = claim(&store, VDISK, node_id(2), other)
        .await
        .expect("claim after expiry");
    assert!(
        second.epoch > first.epoch,
        "{:?} after {:?}",
        second.epoch,
        first.epoch
    );
    // The old owner's claim can neither be released nor renewed on its dead lease.
    assert!(matches!(
        release(&store, &first).await,
        Err(ReleaseError::NotOwner { .. })
    ));
    let dead = claim(&store, VdiskId(8), node_id(1), short)
        .await
        .unwrap_err();
    assert!(
        matches!(dead, ClaimError::LeaseNotFound(l) if l == short),
        "{dead}"
    );
    assert_eq!(
        current_epoch(&store, VdiskId(8)).await.expect("epoch"),
        OwnershipEpoch(0)
    );
}

async fn epochs_never_go_back<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let long = Duration::from_secs(60);
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(store.grant_lease(long).await.expect("grant"));
    }
    let mut last = OwnershipEpoch(0);
    for i in 0..40usize {
        let node = i % 3;
        let won = claim(&store, VDISK, node_id(node as u16), leases[node])
            .await
            .expect("claim");
        assert_eq!(won.epoch, OwnershipEpoch(last.0 + 1), "claim {i}");
        assert_eq!(
            current_epoch(&store, VDISK).await.expect("epoch"),
            won.epoch
        );
        last = won.epoch;
        if i % 5 == 4 {
            // The owner's lease ends (as when it crashes) instead of a release; the node
            // comes back on a new lease.
            store.revoke_lease(leases[node]).await.expect("revoke");
            assert_eq!(current_owner(&store, VDISK).await.expect("owner"), None);
            leases[node] = store.grant_lease(long).await.expect("grant");
        } else {
            release(&store, &won).await.expect("release");
        }
    }
    assert_eq!(last, OwnershipEpoch(40));
}

async fn release_then_reclaim_bumps_the_epoch<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let lease = store
        .grant_lease(Duration::from_secs(30))
        .await
        .expect("grant");
    let first = claim(&store, VDISK, node_id(1), lease)
        .await
        .expect("claim");
    let twice = claim(&store, VDISK, node_id(1), lease).await.unwrap_err();
    assert!(
        matches!(twice, ClaimError::Owned { epoch, .. } if epoch == first.epoch),
        "{twice}"
    );
    // Someone else's claim of the same epoch does not release ours.
    let forged = ashlar_cluster::OwnershipClaim {
        node: node_id(2),
        ..first.clone()
    };
    assert!(matches!(
        release(&store, &forged).await,
        Err(ReleaseError::NotOwner { .. })
    ));
    release(&store, &first).await.expect("release");
    assert_eq!(current_owner(&store, VDISK).await.expect("owner"), None);
    assert_eq!(
        current_epoch(&store, VDISK).await.expect("epoch"),
        first.epoch
    );
    let second = claim(&store, VDISK, node_id(1), lease)
        .await
        .expect("reclaim");
    assert_eq!(second.epoch, OwnershipEpoch(first.epoch.0 + 1));
    assert!(matches!(
        release(&store, &first).await,
        Err(ReleaseError::NotOwner { .. })
    ));
}

async fn watch_reports_claims_releases_and_expiry<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let mut watch = watch_ownership(&store, None, None).await.expect("watch");
    let long = store
        .grant_lease(Duration::from_secs(30))
        .await
        .expect("grant");
    let won = claim(&store, VDISK, node_id(1), long).await.expect("claim");
    let change = watch.next().await.expect("change");
    assert_eq!(change.vdisk, VDISK);
    assert_eq!(change.revision, won.revision);
    let owner = change.owner.expect("claimed");
    assert_eq!((owner.node, owner.epoch), (node_id(1), OwnershipEpoch(1)));
    release(&store, &won).await.expect("release");
    let change = watch.next().await.expect("change");
    assert_eq!((change.vdisk, change.owner), (VDISK, None));
    let short = store.grant_lease(B::TTL).await.expect("grant");
    let other = claim(&store, VdiskId(9), node_id(2), short)
        .await
        .expect("claim");
    assert_eq!(other.epoch, OwnershipEpoch(1));
    let change = watch.next().await.expect("change");
    assert_eq!(change.owner.map(|o| o.node), Some(node_id(2)));
    let expired = tokio::time::timeout(B::TTL * 10, watch.next())
        .await
        .expect("expiry within 10 TTLs")
        .expect("change");
    assert_eq!((expired.vdisk, expired.owner), (VdiskId(9), None));
}

async fn serving_claims_follow_the_last_owner<B: Backend>() {
    let (_guard, store) = B::open(Settings::default()).await;
    let long = Duration::from_secs(30);
    let (a, b) = (node_id(1), node_id(3));
    let lease_a = store.grant_lease(B::TTL).await.expect("grant");
    let lease_b = store.grant_lease(long).await.expect("grant");
    let first = claim_to_serve(&store, VDISK, a, lease_a, false)
        .await
        .expect("nobody ever owned it");
    assert_eq!(first.epoch, OwnershipEpoch(1));
    // A's earlier claim (a previous run of A) is taken over, with a higher epoch.
    let lease_a2 = store.grant_lease(long).await.expect("grant");
    let again = claim_to_serve(&store, VDISK, a, lease_a2, false)
        .await
        .expect("own claim taken over");
    assert_eq!((again.epoch, again.lease), (OwnershipEpoch(2), lease_a2));
    let refused = claim_to_serve(&store, VDISK, b, lease_b, false)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ServeError::Refused { refusal: ServeRefusal::OwnedElsewhere { owner, epoch }, .. }
            if *owner == a && *epoch == OwnershipEpoch(2)),
        "{refused}"
    );
    store.revoke_lease(lease_a2).await.expect("revoke");
    let refused = claim_to_serve(&store, VDISK, b, lease_b, false)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ServeError::Refused { refusal: ServeRefusal::DataOnDownNode { node }, .. } if *node == a),
        "{refused}"
    );
    assert!(refused.to_string().contains("which is down"), "{refused}");
    let storage_only = claim_to_serve(&store, VdiskId(8), b, lease_b, true)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &storage_only,
            ServeError::Refused {
                refusal: ServeRefusal::StorageOnly,
                ..
            }
        ),
        "{storage_only}"
    );
    assert_eq!(current_owner(&store, VdiskId(8)).await.expect("read"), None);
    // The last owner comes back: it claims again, at the next epoch; B saw nothing change.
    let back = claim_to_serve(&store, VDISK, a, lease_b, false)
        .await
        .expect("last owner claims");
    assert_eq!(back.epoch, OwnershipEpoch(3));
    assert_eq!(
        current_epoch(&store, VDISK).await.expect("read"),
        OwnershipEpoch(3)
    );
}

conformance!(
    serving_claims_follow_the_last_owner,
    racing_claims_have_exactly_one_winner,
    expired_owner_is_replaced_with_a_greater_epoch,
    epochs_never_go_back,
    release_then_reclaim_bumps_the_epoch,
    watch_reports_claims_releases_and_expiry,
);
