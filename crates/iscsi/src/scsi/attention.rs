//! Unit attention conditions (SAM-5 5.14, SPC-4 5.12.11): per I_T nexus of one logical unit,
//! reported once each, oldest first, by the next command that is not INQUIRY, REPORT LUNS or
//! REQUEST SENSE (REQUEST SENSE returns and clears one instead).
//!
//! Which nexuses a reservation change notifies is decided by [`after_reserve_out`], a pure
//! function of the state before and after the change.

use super::reservation::{PrState, Registration};
use super::sense::Sense;
use std::collections::{HashMap, HashSet, VecDeque};

/// Conditions queued for one I_T nexus; older ones are dropped past this (a nexus that never
/// sends a command cannot make the node hold more).
pub const MAX_PENDING_PER_NEXUS: usize = 8;

/// Nexuses remembered as told of the unit being served anew. Past this the memory starts
/// over: a nexus may then be told twice, which costs it one retried command and nothing else.
pub const MAX_TOLD_SERVED_ANEW: usize = 4096;

/// The pending conditions of every I_T nexus of one unit, and the nexuses now connected to it
/// (those a reset or a capacity change notifies).
#[derive(Debug, Default)]
pub struct Attentions {
    pending: HashMap<String, VecDeque<Sense>>,
    /// Sessions open to the unit per nexus (a nexus may reconnect before its old session
    /// has ended).
    connected: HashMap<String, usize>,
    /// Once the unit was served anew on this node ([`Attentions::served_anew`]): the nexuses
    /// that have reported a reset condition since. Every other nexus gets one when it joins.
    /// `None` while the unit was never served anew (a single node).
    told_since_served_anew: Option<HashSet<String>>,
}

impl Attentions {
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Queues `sense` for `nexus`. A reset condition (ASC 29h) replaces every older condition:
    /// the reset made them moot, and SAM-5 gives it the highest precedence.
    pub fn post(&mut self, nexus: &str, sense: Sense) {
        debug_assert_eq!(sense.key, super::sense::key::UNIT_ATTENTION);
        let queue = self.pending.entry(nexus.to_string()).or_default();
        if sense.asc == 0x29 {
            queue.clear();
        }
        if queue.contains(&sense) {
            return;
        }
        if queue.len() == MAX_PENDING_PER_NEXUS {
            queue.pop_front();
        }
        queue.push_back(sense);
    }

    /// Queues `sense` for every connected nexus.
    pub fn post_connected(&mut self, sense: Sense) {
        let nexuses: Vec<String> = self.connected.keys().cloned().collect();
        for nexus in nexuses {
            self.post(&nexus, sense);
        }
    }

    /// Takes the oldest condition of `nexus`.
    pub fn take(&mut self, nexus: &str) -> Option<Sense> {
        let queue = self.pending.get_mut(nexus)?;
        let sense = queue.pop_front();
        if queue.is_empty() {
            self.pending.remove(nexus);
        }
        if sense.is_some_and(|s| s.asc == 0x29) {
            self.told_of_reset(nexus);
        }
        sense
    }

    /// `nexus` reported a reset condition: that covers the unit being served anew too.
    fn told_of_reset(&mut self, nexus: &str) {
        if let Some(told) = &mut self.told_since_served_anew {
            if told.len() >= MAX_TOLD_SERVED_ANEW {
                told.clear();
            }
            told.insert(nexus.to_string());
        }
    }

    /// A session of `nexus` joined the unit; a nexus not told yet that the unit is served
    /// anew gets the reset condition now, for its first command.
    pub fn joined(&mut self, nexus: &str) {
        *self.connected.entry(nexus.to_string()).or_default() += 1;
        let untold = self
            .told_since_served_anew
            .as_ref()
            .is_some_and(|told| !told.contains(nexus));
        if untold {
            self.post(nexus, Sense::RESET_OCCURRED);
        }
    }

    /// The unit is served by this node anew (first served here, or another node may have
    /// served it since this node last did): as after a power on (SAM-5 6.3.1), every I_T
    /// nexus, connected now or joining later, gets POWER ON, RESET, OR BUS DEVICE RESET
    /// OCCURRED once, which replaces its older conditions (conditions another node held for
    /// it are lost; the reset tells it to look again).
    pub fn served_anew(&mut self) {
        self.told_since_served_anew = Some(HashSet::new());
        self.post_connected(Sense::RESET_OCCURRED);
    }

    /// A session of `nexus` ended. Once none is left, its pending conditions are dropped
    /// unless `keep` (it holds a registration: a preemption must still reach it when it
    /// comes back).
    pub fn left(&mut self, nexus: &str, keep: bool) {
        let Some(count) = self.connected.get_mut(nexus) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            self.connected.remove(nexus);
            if !keep {
                self.pending.remove(nexus);
            }
        }
    }
}

fn is_registrants_type(kind: u8) -> bool {
    use super::reservation::kind::*;
    matches!(
        kind,
        WRITE_EXCLUSIVE_REGISTRANTS_ONLY
            | EXCLUSIVE_ACCESS_REGISTRANTS_ONLY
            | WRITE_EXCLUSIVE_ALL_REGISTRANTS
            | EXCLUSIVE_ACCESS_ALL_REGISTRANTS
    )
}

fn others<'a>(
    registrations: &'a [Registration],
    issuer: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    registrations
        .iter()
        .map(|r| r.nexus.as_str())
        .filter(move |n| *n != issuer)
}

/// The unit attentions a successful PERSISTENT RESERVE OUT with service `action` causes
/// (SPC-4 5.14.11): every nexus but the issuer is told when
/// - a CLEAR removed its registration (RESERVATIONS PREEMPTED);
/// - a PREEMPT removed its registration (REGISTRATIONS PREEMPTED), or changed the type of the
///   reservation it stays registered under (RESERVATIONS RELEASED);
/// - a RELEASE, or the holder's unregistering, ended a registrants-only or all-registrants
///   reservation it was registered under (RESERVATIONS RELEASED).
pub fn after_reserve_out(
    before: &PrState,
    after: &PrState,
    action: u8,
    issuer: &str,
) -> Vec<(String, Sense)> {
    let mut out: Vec<(String, Sense)> = Vec::new();
    let mut tell = |nexus: &str, sense: Sense| out.push((nexus.to_string(), sense));
    match action {
        3 => others(&before.registrations, issuer)
            .for_each(|n| tell(n, Sense::RESERVATIONS_PREEMPTED)),
        4 | 5 => {
            let kept = |n: &str| after.registrations.iter().any(|r| r.nexus == n);
            for nexus in others(&before.registrations, issuer) {
                if !kept(nexus) {
                    tell(nexus, Sense::REGISTRATIONS_PREEMPTED);
                }
            }
            let changed = match (&before.reservation, &after.reservation) {
                (Some(b), Some(a)) => b.kind != a.kind,
                _ => false,
            };
            if changed {
                others(&after.registrations, issuer)
                    .for_each(|n| tell(n, Sense::RESERVATIONS_RELEASED));
            }
        }
        0 | 2 | 6 => {
            let released = match (&before.reservation, &after.reservation) {
                (Some(b), None) => is_registrants_type(b.kind),
                _ => false,
            };
            if released {
                others(&after.registrations, issuer)
                    .for_each(|n| tell(n, Sense::RESERVATIONS_RELEASED));
            }
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scsi::reservation::{kind, Reservation};

    const A: &str = "iqn.a,i,0x01";
    const B: &str = "iqn.b,i,0x02";
    const C: &str = "iqn.c,i,0x03";

    fn registered(nexuses: &[&str], reservation: Option<(&str, u8)>) -> PrState {
        PrState {
            registrations: nexuses
                .iter()
                .enumerate()
                .map(|(i, n)| Registration {
                    nexus: n.to_string(),
                    key: i as u64 + 1,
                })
                .collect(),
            reservation: reservation.map(|(holder, kind)| Reservation {
                holder: holder.to_string(),
                kind,
            }),
            ..PrState::default()
        }
    }

    #[test]
    fn preempt_tells_the_preempted_only() {
        let before = registered(&[A, B, C], Some((A, kind::WRITE_EXCLUSIVE)));
        let after = registered(&[B, C], Some((B, kind::WRITE_EXCLUSIVE)));
        assert_eq!(
            after_reserve_out(&before, &after, 4, B),
            vec![(A.to_string(), Sense::REGISTRATIONS_PREEMPTED)]
        );
    }

    #[test]
    fn preempt_changing_the_type_tells_the_remaining_registrants() {
        let before = registered(&[A, B], Some((A, kind::WRITE_EXCLUSIVE)));
        let after = registered(&[A, B], Some((A, kind::EXCLUSIVE_ACCESS)));
        assert_eq!(
            after_reserve_out(&before, &after, 4, A),
            vec![(B.to_string(), Sense::RESERVATIONS_RELEASED)]
        );
    }

    #[test]
    fn clear_tells_every_other_registrant() {
        let before = registered(&[A, B, C], Some((A, kind::EXCLUSIVE_ACCESS)));
        let after = PrState::default();
        let told = after_reserve_out(&before, &after, 3, C);
        assert_eq!(
            told,
            vec![
                (A.to_string(), Sense::RESERVATIONS_PREEMPTED),
                (B.to_string(), Sense::RESERVATIONS_PREEMPTED)
            ]
        );
    }

    #[test]
    fn release_tells_registrants_only_of_registrant_types() {
        let ro = registered(&[A, B], Some((A, kind::WRITE_EXCLUSIVE_REGISTRANTS_ONLY)));
        let none = registered(&[A, B], None);
        assert_eq!(
            after_reserve_out(&ro, &none, 2, A),
            vec![(B.to_string(), Sense::RESERVATIONS_RELEASED)]
        );
        let we = registered(&[A, B], Some((A, kind::WRITE_EXCLUSIVE)));
        assert!(after_reserve_out(&we, &none, 2, A).is_empty());
    }

    #[test]
    fn conditions_are_reported_once_oldest_first_and_resets_win() {
        let mut a = Attentions::default();
        a.joined(A);
        a.post(A, Sense::REGISTRATIONS_PREEMPTED);
        a.post(A, Sense::REGISTRATIONS_PREEMPTED);
        a.post(A, Sense::CAPACITY_DATA_CHANGED);
        assert_eq!(a.take(A), Some(Sense::REGISTRATIONS_PREEMPTED));
        assert_eq!(a.take(A), Some(Sense::CAPACITY_DATA_CHANGED));
        assert_eq!(a.take(A), None);
        assert!(a.is_empty());
        a.post(A, Sense::CAPACITY_DATA_CHANGED);
        a.post_connected(Sense::BUS_DEVICE_RESET_OCCURRED);
        assert_eq!(a.take(A), Some(Sense::BUS_DEVICE_RESET_OCCURRED));
        assert_eq!(a.take(A), None);
        for _ in 0..3 * MAX_PENDING_PER_NEXUS {
            a.post(B, Sense::RESERVATIONS_RELEASED);
            a.post(B, Sense::CAPACITY_DATA_CHANGED);
        }
        assert!(a.pending[B].len() <= MAX_PENDING_PER_NEXUS);
    }

    #[test]
    fn a_unit_served_anew_tells_every_nexus_once_connected_or_joining_later() {
        let mut a = Attentions::default();
        a.joined(A);
        // Never served anew (a single node): nobody is told anything.
        assert!(a.is_empty());
        a.post(A, Sense::CAPACITY_DATA_CHANGED);
        a.served_anew();
        // The connected nexus: the reset replaces what was queued.
        assert_eq!(a.take(A), Some(Sense::RESET_OCCURRED));
        assert_eq!(a.take(A), None);
        // A nexus joining later is told once, on its first command; again after rejoining
        // only if it never reported it.
        a.joined(B);
        assert_eq!(a.take(B), Some(Sense::RESET_OCCURRED));
        a.left(B, false);
        a.joined(B);
        assert_eq!(a.take(B), None, "told once");
        a.joined(C);
        a.left(C, false);
        a.joined(C);
        assert_eq!(a.take(C), Some(Sense::RESET_OCCURRED), "never reported it");
        // A condition after the reset follows it.
        a.joined(C);
        a.post(C, Sense::REGISTRATIONS_PREEMPTED);
        assert_eq!(a.take(C), Some(Sense::REGISTRATIONS_PREEMPTED));
        // Served anew again: everybody is told again.
        a.served_anew();
        assert_eq!(a.take(A), Some(Sense::RESET_OCCURRED));
        assert_eq!(a.take(B), Some(Sense::RESET_OCCURRED));
        a.left(A, false);
        a.joined(A);
        assert_eq!(a.take(A), None);
    }

    #[test]
    fn a_nexus_leaving_keeps_its_conditions_only_if_registered() {
        let mut a = Attentions::default();
        a.joined(A);
        a.joined(B);
        a.post_connected(Sense::CAPACITY_DATA_CHANGED);
        a.left(A, true);
        a.left(B, false);
        assert_eq!(a.take(A), Some(Sense::CAPACITY_DATA_CHANGED));
        assert_eq!(a.take(B), None);
        a.post_connected(Sense::CAPACITY_DATA_CHANGED);
        assert!(a.is_empty(), "nobody is connected any more");
    }
}
