//! SCSI status codes and fixed-format sense data (SPC-4 4.5.3).

/// SCSI status codes (SAM-5).
pub mod status {
    pub const GOOD: u8 = 0x00;
    pub const CHECK_CONDITION: u8 = 0x02;
    pub const RESERVATION_CONFLICT: u8 = 0x18;
}

/// Sense keys.
pub mod key {
    pub const NO_SENSE: u8 = 0x00;
    pub const NOT_READY: u8 = 0x02;
    pub const MEDIUM_ERROR: u8 = 0x03;
    pub const HARDWARE_ERROR: u8 = 0x04;
    pub const ILLEGAL_REQUEST: u8 = 0x05;
    pub const UNIT_ATTENTION: u8 = 0x06;
    pub const DATA_PROTECT: u8 = 0x07;
    pub const ABORTED_COMMAND: u8 = 0x0b;
    pub const MISCOMPARE: u8 = 0x0e;
}

/// One sense condition: key, additional sense code and qualifier, and optionally the
/// INFORMATION field (an LBA or byte offset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    pub information: Option<u32>,
}

/// Length of the fixed-format sense data we send.
pub const FIXED_SENSE_LEN: usize = 18;

impl Sense {
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Self {
        Sense {
            key,
            asc,
            ascq,
            information: None,
        }
    }

    pub const INVALID_OPCODE: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x20, 0x00);
    pub const LBA_OUT_OF_RANGE: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x21, 0x00);
    pub const INVALID_FIELD_IN_CDB: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x24, 0x00);
    pub const LUN_NOT_SUPPORTED: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x25, 0x00);
    pub const INVALID_FIELD_IN_PARAMETER_LIST: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x26, 0x00);
    pub const INVALID_RELEASE_OF_PR: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x26, 0x04);
    pub const PARAMETER_LIST_LENGTH_ERROR: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x1a, 0x00);
    pub const INVALID_FIELD_IN_INFORMATION_UNIT: Sense =
        Sense::new(key::ILLEGAL_REQUEST, 0x0e, 0x03);
    pub const SAVING_PARAMETERS_NOT_SUPPORTED: Sense = Sense::new(key::ILLEGAL_REQUEST, 0x39, 0x00);
    pub const INSUFFICIENT_REGISTRATION_RESOURCES: Sense =
        Sense::new(key::ILLEGAL_REQUEST, 0x55, 0x04);
    pub const UNRECOVERED_READ_ERROR: Sense = Sense::new(key::MEDIUM_ERROR, 0x11, 0x00);
    pub const WRITE_ERROR: Sense = Sense::new(key::MEDIUM_ERROR, 0x0c, 0x00);
    pub const SPACE_ALLOCATION_FAILED: Sense = Sense::new(key::DATA_PROTECT, 0x27, 0x07);
    pub const INTERNAL_TARGET_FAILURE: Sense = Sense::new(key::HARDWARE_ERROR, 0x44, 0x00);
    pub const MISCOMPARE_DURING_VERIFY: Sense = Sense::new(key::MISCOMPARE, 0x1d, 0x00);
    pub const LUN_NOT_READY_OFFLINE: Sense = Sense::new(key::NOT_READY, 0x04, 0x12);
    /// LOGICAL UNIT IS IN PROCESS OF BECOMING READY: the node is not serving the unit at
    /// this moment but may be soon (its ownership claim lapsed and is being made again).
    /// Initiators retry this one after a delay (Linux does), where a MEDIUM ERROR would
    /// mark the blocks bad.
    pub const LUN_BECOMING_READY: Sense = Sense::new(key::NOT_READY, 0x04, 0x01);
    pub const NO_SENSE: Sense = Sense::new(key::NO_SENSE, 0, 0);
    /// Write data that does not continue the transfer (wrong DataSN, offset or length).
    pub const DATA_PHASE_ERROR: Sense = Sense::new(key::ABORTED_COMMAND, 0x4b, 0x00);
    /// Unit attentions (SPC-4 annex D).
    pub const RESET_OCCURRED: Sense = Sense::new(key::UNIT_ATTENTION, 0x29, 0x00);
    pub const BUS_DEVICE_RESET_OCCURRED: Sense = Sense::new(key::UNIT_ATTENTION, 0x29, 0x03);
    pub const RESERVATIONS_PREEMPTED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x03);
    pub const RESERVATIONS_RELEASED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x04);
    pub const REGISTRATIONS_PREEMPTED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x05);
    pub const CAPACITY_DATA_CHANGED: Sense = Sense::new(key::UNIT_ATTENTION, 0x2a, 0x09);

    pub fn with_information(mut self, information: u32) -> Self {
        self.information = Some(information);
        self
    }

    /// Fixed format, current error (response code 0x70).
    pub fn fixed(&self) -> [u8; FIXED_SENSE_LEN] {
        let mut out = [0u8; FIXED_SENSE_LEN];
        out[0] = 0x70;
        out[2] = self.key & 0x0f;
        if let Some(information) = self.information {
            out[0] |= 0x80;
            out[3..7].copy_from_slice(&information.to_be_bytes());
        }
        out[7] = (FIXED_SENSE_LEN - 8) as u8;
        out[12] = self.asc;
        out[13] = self.ascq;
        out
    }

    /// Descriptor format (response code 0x72), without descriptors.
    pub fn descriptor(&self) -> [u8; 8] {
        [0x72, self.key & 0x0f, self.asc, self.ascq, 0, 0, 0, 0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_format_layout() {
        let sense = Sense::LBA_OUT_OF_RANGE.fixed();
        assert_eq!(sense[0], 0x70);
        assert_eq!(sense[2], 0x05);
        assert_eq!(sense[7], 10);
        assert_eq!((sense[12], sense[13]), (0x21, 0x00));
        let with_info = Sense::MISCOMPARE_DURING_VERIFY.with_information(7).fixed();
        assert_eq!(with_info[0], 0xf0);
        assert_eq!(&with_info[3..7], &[0, 0, 0, 7]);
    }
}
