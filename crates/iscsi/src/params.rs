//! Operational parameters of a session and the negotiation rule of each key (RFC 7143
//! section 13): list keys pick the first value we support, numeric keys take the minimum or
//! maximum, boolean keys take OR or AND, declarative keys are recorded.

use crate::limits::Effective;

/// Smallest and largest data segment length the protocol allows (RFC 7143 13.12).
const MIN_SEGMENT_BYTES: u32 = 512;
const MAX_SEGMENT_BYTES: u32 = (1 << 24) - 1;

/// What a session negotiated. Defaults are the RFC's until a key changes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionParams {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment the initiator accepts: our Data-In and text PDUs are cut to it.
    pub initiator_max_recv_data_segment: u32,
    /// Largest data segment we accept (declared by us).
    pub target_max_recv_data_segment: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_outstanding_r2t: u32,
    pub default_time2wait: u32,
    pub default_time2retain: u32,
    /// Our offers, for the minimum/maximum rules.
    offer_max_burst: u32,
    offer_first_burst: u32,
}

impl SessionParams {
    pub fn initial(limits: &Effective) -> Self {
        SessionParams {
            header_digest: false,
            data_digest: false,
            initiator_max_recv_data_segment: 8192,
            target_max_recv_data_segment: limits.max_recv_data_segment,
            max_burst: 262_144.min(limits.max_burst),
            first_burst: 65_536.min(limits.first_burst),
            initial_r2t: true,
            immediate_data: true,
            max_outstanding_r2t: 1,
            default_time2wait: 2,
            default_time2retain: 20,
            offer_max_burst: limits.max_burst,
            offer_first_burst: limits.first_burst,
        }
    }

    /// Restores the invariants between keys once negotiation is over.
    pub fn settle(&mut self) {
        self.first_burst = self.first_burst.min(self.max_burst);
    }
}

fn number(value: &str) -> Option<u32> {
    if let Some(hex) = value.strip_prefix("0x") {
        u32::from_str_radix(hex, 16).ok()
    } else {
        value.parse().ok()
    }
}

fn boolean(value: &str) -> Option<bool> {
    match value {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn yes_no(value: bool) -> String {
    if value { "Yes" } else { "No" }.to_string()
}

/// Applies one operational key offered by the initiator; returns the answer to send, if the
/// key needs one (`Reject` for a value out of range, `NotUnderstood` for an unknown key).
pub fn negotiate_key(params: &mut SessionParams, key: &str, value: &str) -> Option<String> {
    let reject = || Some("Reject".to_string());
    match key {
        "HeaderDigest" | "DataDigest" => {
            let Some(choice) = value.split(',').find(|v| *v == "CRC32C" || *v == "None") else {
                return reject();
            };
            let on = choice == "CRC32C";
            if key == "HeaderDigest" {
                params.header_digest = on;
            } else {
                params.data_digest = on;
            }
            Some(choice.to_string())
        }
        "MaxRecvDataSegmentLength" => {
            match number(value).filter(|n| (MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(n)) {
                Some(n) => {
                    params.initiator_max_recv_data_segment = n;
                    None // declarative: no answer (ours is declared separately)
                }
                None => reject(),
            }
        }
        "MaxBurstLength" => {
            match number(value).filter(|n| (MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(n)) {
                Some(n) => {
                    params.max_burst = n.min(params.offer_max_burst);
                    Some(params.max_burst.to_string())
                }
                None => reject(),
            }
        }
        "FirstBurstLength" => {
            match number(value).filter(|n| (MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(n)) {
                Some(n) => {
                    params.first_burst = n.min(params.offer_first_burst);
                    Some(params.first_burst.to_string())
                }
                None => reject(),
            }
        }
        // OR: Yes if either side says Yes; we are happy with No.
        "InitialR2T" => match boolean(value) {
            Some(v) => {
                params.initial_r2t = v;
                Some(yes_no(v))
            }
            None => reject(),
        },
        // AND: we say Yes.
        "ImmediateData" => match boolean(value) {
            Some(v) => {
                params.immediate_data = v;
                Some(yes_no(v))
            }
            None => reject(),
        },
        // We issue one R2T at a time per command, whatever the initiator allows.
        "MaxOutstandingR2T" => match number(value).filter(|n| (1..=65535).contains(n)) {
            Some(_) => {
                params.max_outstanding_r2t = 1;
                Some("1".to_string())
            }
            None => reject(),
        },
        // OR with our Yes: data arrives in order.
        "DataPDUInOrder" | "DataSequenceInOrder" => match boolean(value) {
            Some(_) => Some("Yes".to_string()),
            None => reject(),
        },
        // Minimum with ours: level 0 only.
        "ErrorRecoveryLevel" => match number(value).filter(|n| *n <= 2) {
            Some(_) => Some("0".to_string()),
            None => reject(),
        },
        "DefaultTime2Wait" => match number(value).filter(|n| *n <= 3600) {
            Some(n) => {
                params.default_time2wait = n.max(2);
                Some(params.default_time2wait.to_string())
            }
            None => reject(),
        },
        "DefaultTime2Retain" => match number(value).filter(|n| *n <= 3600) {
            Some(_) => {
                // Level 0 keeps no connection state for recovery: the minimum is 0.
                params.default_time2retain = 0;
                Some(params.default_time2retain.to_string())
            }
            None => reject(),
        },
        "MaxConnections" => match number(value).filter(|n| (1..=65535).contains(n)) {
            Some(_) => Some("1".to_string()),
            None => reject(),
        },
        // RFC 3720 markers, removed by RFC 7143: never used.
        "IFMarker" | "OFMarker" => Some("No".to_string()),
        "IFMarkInt" | "OFMarkInt" => Some("Irrelevant".to_string()),
        "TaskReporting" => Some("RFC3720".to_string()),
        "iSCSIProtocolLevel" => match number(value) {
            Some(n) => Some(n.min(1).to_string()),
            None => reject(),
        },
        "TargetPortalGroupTag" | "TargetAddress" => reject(),
        _ => Some("NotUnderstood".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::IscsiLimits;

    fn params() -> SessionParams {
        SessionParams::initial(&Effective::from(&IscsiLimits::default()))
    }

    #[test]
    fn rules_of_each_key() {
        let mut p = params();
        assert_eq!(
            negotiate_key(&mut p, "HeaderDigest", "CRC32C,None").as_deref(),
            Some("CRC32C")
        );
        assert!(p.header_digest);
        assert_eq!(
            negotiate_key(&mut p, "DataDigest", "None").as_deref(),
            Some("None")
        );
        assert_eq!(
            negotiate_key(&mut p, "DataDigest", "MD5").as_deref(),
            Some("Reject")
        );
        assert_eq!(
            negotiate_key(&mut p, "MaxRecvDataSegmentLength", "4096"),
            None
        );
        assert_eq!(p.initiator_max_recv_data_segment, 4096);
        assert_eq!(
            negotiate_key(&mut p, "MaxRecvDataSegmentLength", "12").as_deref(),
            Some("Reject")
        );
        assert_eq!(
            negotiate_key(&mut p, "MaxBurstLength", "16776192").as_deref(),
            Some(p.offer_max_burst.to_string().as_str())
        );
        assert_eq!(
            negotiate_key(&mut p, "FirstBurstLength", "1024").as_deref(),
            Some("1024")
        );
        assert_eq!(
            negotiate_key(&mut p, "InitialR2T", "No").as_deref(),
            Some("No")
        );
        assert!(!p.initial_r2t);
        assert_eq!(
            negotiate_key(&mut p, "ImmediateData", "Maybe").as_deref(),
            Some("Reject")
        );
        assert_eq!(
            negotiate_key(&mut p, "ErrorRecoveryLevel", "2").as_deref(),
            Some("0")
        );
        assert_eq!(
            negotiate_key(&mut p, "MaxConnections", "8").as_deref(),
            Some("1")
        );
        assert_eq!(
            negotiate_key(&mut p, "DefaultTime2Wait", "0").as_deref(),
            Some("2")
        );
        assert_eq!(
            negotiate_key(&mut p, "DefaultTime2Retain", "20").as_deref(),
            Some("0")
        );
        assert_eq!(
            negotiate_key(&mut p, "X-com.example.thing", "1").as_deref(),
            Some("NotUnderstood")
        );
        p.first_burst = 1 << 20;
        p.max_burst = 4096;
        p.settle();
        assert_eq!(p.first_burst, 4096);
    }
}
