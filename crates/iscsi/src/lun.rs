//! LUNs on the wire (SAM-5 4.7): the 8-byte LUN field, in the peripheral (LUN < 256) or flat
//! (LUN < 16384) addressing methods.

/// A logical unit number within one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lun(pub u16);

/// Largest LUN flat space addressing can name.
pub const MAX_LUN: u16 = 0x3fff;

impl Lun {
    /// Decodes the first level of an 8-byte LUN field; `None` for addressing methods or
    /// levels we do not use (such a LUN does not exist here).
    pub fn decode(field: [u8; 8]) -> Option<Lun> {
        if field[2..].iter().any(|&b| b != 0) {
            return None;
        }
        match field[0] >> 6 {
            0b00 if field[0] == 0 => Some(Lun(u16::from(field[1]))),
            0b01 => Some(Lun(u16::from(field[0] & 0x3f) << 8 | u16::from(field[1]))),
            _ => None,
        }
    }

    pub fn encode(self) -> [u8; 8] {
        let mut field = [0u8; 8];
        if self.0 < 256 {
            field[1] = self.0 as u8;
        } else {
            field[0] = 0x40 | ((self.0 >> 8) as u8 & 0x3f);
            field[1] = self.0 as u8;
        }
        field
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_both_methods() {
        for lun in [0u16, 1, 255, 256, MAX_LUN] {
            assert_eq!(Lun::decode(Lun(lun).encode()), Some(Lun(lun)));
        }
        assert_eq!(Lun::decode([0x80, 0, 0, 0, 0, 0, 0, 0]), None);
        assert_eq!(Lun::decode([0, 1, 0, 1, 0, 0, 0, 0]), None);
    }
}
