//! REPORT SUPPORTED OPERATION CODES: the commands `execute` serves, with the CDB bits each
//! one looks at (its usage data).

use super::{be16, be32, sense::Sense, ScsiResult};

/// One supported command: opcode, service action (for commands that have them) and usage
/// data (first byte the opcode, then a mask of the CDB bits the command uses).
struct Command {
    service_action: Option<u16>,
    usage: &'static [u8],
}

const fn cmd(usage: &'static [u8]) -> Command {
    Command {
        service_action: None,
        usage,
    }
}

const fn sa(service_action: u16, usage: &'static [u8]) -> Command {
    Command {
        service_action: Some(service_action),
        usage,
    }
}

const FF: u8 = 0xff;

static COMMANDS: &[Command] = &[
    cmd(&[0x00, 0, 0, 0, 0, 0x07]),
    cmd(&[0x03, 0x01, 0, 0, FF, 0x07]),
    cmd(&[0x08, 0x1f, FF, FF, FF, 0x07]),
    cmd(&[0x0a, 0x1f, FF, FF, FF, 0x07]),
    cmd(&[0x12, 0x01, FF, FF, FF, 0x07]),
    cmd(&[0x15, 0x11, 0, 0, FF, 0x07]),
    cmd(&[0x16, 0, 0, 0, 0, 0x07]),
    cmd(&[0x17, 0, 0, 0, 0, 0x07]),
    cmd(&[0x1a, 0x08, FF, FF, FF, 0x07]),
    cmd(&[0x1b, 0x01, 0, 0x0f, 0xf7, 0x07]),
    cmd(&[0x1e, 0, 0, 0, 0x03, 0x07]),
    cmd(&[0x25, 0, FF, FF, FF, FF, 0, 0, 0x01, 0x07]),
    cmd(&[0x28, 0xf8, FF, FF, FF, FF, 0x1f, FF, FF, 0x07]),
    cmd(&[0x2a, 0xf8, FF, FF, FF, FF, 0x1f, FF, FF, 0x07]),
    cmd(&[0x2e, 0xf2, FF, FF, FF, FF, 0x1f, FF, FF, 0x07]),
    cmd(&[0x2f, 0xf6, FF, FF, FF, FF, 0x1f, FF, FF, 0x07]),
    cmd(&[0x34, 0x02, FF, FF, FF, FF, 0x1f, FF, FF, 0x07]),
    cmd(&[0x35, 0x02, FF, FF, FF, FF, 0x1f, FF, FF, 0x07]),
    cmd(&[0x41, 0xf8, FF, FF, FF, FF, 0x1f, FF, FF, 0x07]),
    cmd(&[0x42, 0x01, 0, 0, 0, 0, 0x1f, FF, FF, 0x07]),
    cmd(&[0x55, 0x11, 0, 0, 0, 0, 0, FF, FF, 0x07]),
    cmd(&[0x5a, 0x18, FF, FF, 0, 0, 0, FF, FF, 0x07]),
    sa(0x00, &[0x5e, 0x1f, 0, 0, 0, 0, 0, FF, FF, 0x07]),
    sa(0x01, &[0x5e, 0x1f, 0, 0, 0, 0, 0, FF, FF, 0x07]),
    sa(0x02, &[0x5e, 0x1f, 0, 0, 0, 0, 0, FF, FF, 0x07]),
    sa(0x03, &[0x5e, 0x1f, 0, 0, 0, 0, 0, FF, FF, 0x07]),
    sa(0x00, &[0x5f, 0x1f, FF, 0, 0, FF, FF, FF, FF, 0x07]),
    sa(0x01, &[0x5f, 0x1f, FF, 0, 0, FF, FF, FF, FF, 0x07]),
    sa(0x02, &[0x5f, 0x1f, FF, 0, 0, FF, FF, FF, FF, 0x07]),
    sa(0x03, &[0x5f, 0x1f, FF, 0, 0, FF, FF, FF, FF, 0x07]),
    sa(0x04, &[0x5f, 0x1f, FF, 0, 0, FF, FF, FF, FF, 0x07]),
    sa(0x05, &[0x5f, 0x1f, FF, 0, 0, FF, FF, FF, FF, 0x07]),
    sa(0x06, &[0x5f, 0x1f, FF, 0, 0, FF, FF, FF, FF, 0x07]),
    cmd(&[
        0x88, 0xf8, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07,
    ]),
    cmd(&[
        0x89, 0xf8, FF, FF, FF, FF, FF, FF, FF, FF, 0, 0, 0, FF, 0x1f, 0x07,
    ]),
    cmd(&[
        0x8a, 0xf8, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07,
    ]),
    cmd(&[
        0x8e, 0xf2, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07,
    ]),
    cmd(&[
        0x8f, 0xf6, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07,
    ]),
    cmd(&[
        0x90, 0x02, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07,
    ]),
    cmd(&[
        0x91, 0x02, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07,
    ]),
    cmd(&[
        0x93, 0xf9, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07,
    ]),
    sa(
        0x10,
        &[
            0x9e, 0x1f, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0, 0x07,
        ],
    ),
    sa(
        0x12,
        &[
            0x9e, 0x1f, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, FF, 0, 0x07,
        ],
    ),
    cmd(&[0xa0, 0, FF, 0, 0, 0, FF, FF, FF, FF, 0, 0x07]),
    sa(
        0x0c,
        &[0xa3, 0x1f, 0x87, FF, FF, FF, FF, FF, FF, FF, 0, 0x07],
    ),
    cmd(&[0xa8, 0xf8, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07]),
    cmd(&[0xaa, 0xf8, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07]),
    cmd(&[0xae, 0xf2, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07]),
    cmd(&[0xaf, 0xf6, FF, FF, FF, FF, FF, FF, FF, FF, 0x1f, 0x07]),
];

/// Nominal and recommended command timeouts reported with RCTD, in seconds.
const TIMEOUT_SECONDS: u32 = 30;

fn timeouts() -> [u8; 12] {
    let mut t = [0u8; 12];
    t[1] = 0x0a;
    t[4..8].copy_from_slice(&TIMEOUT_SECONDS.to_be_bytes());
    t[8..12].copy_from_slice(&TIMEOUT_SECONDS.to_be_bytes());
    t
}

fn has_service_actions(opcode: u8) -> bool {
    COMMANDS
        .iter()
        .any(|c| c.usage[0] == opcode && c.service_action.is_some())
}

pub(super) fn report_supported(cdb: &[u8; 16]) -> ScsiResult {
    let rctd = cdb[2] & 0x80 != 0;
    let options = cdb[2] & 0x07;
    let opcode = cdb[3];
    let service_action = be16(&cdb[4..6]);
    let allocation = be32(&cdb[6..10]) as usize;
    let out = match options {
        0 => {
            let mut list = Vec::new();
            for c in COMMANDS {
                list.push(c.usage[0]);
                list.push(0);
                list.extend_from_slice(&c.service_action.unwrap_or(0).to_be_bytes());
                list.push(0);
                list.push(if rctd { 0x02 } else { 0 } | u8::from(c.service_action.is_some()));
                list.extend_from_slice(&(c.usage.len() as u16).to_be_bytes());
                if rctd {
                    list.extend_from_slice(&timeouts());
                }
            }
            let mut out = (list.len() as u32).to_be_bytes().to_vec();
            out.extend_from_slice(&list);
            out
        }
        1..=3 => {
            let with_sa = has_service_actions(opcode);
            if (options == 1 && with_sa) || (options == 2 && !with_sa) {
                return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB);
            }
            let found = COMMANDS.iter().find(|c| {
                c.usage[0] == opcode && (!with_sa || c.service_action == Some(service_action))
            });
            let mut out = vec![0u8, if rctd { 0x80 } else { 0 }];
            match found {
                Some(c) => {
                    out[1] |= 0x03; // supported, as the standard says
                    out.extend_from_slice(&(c.usage.len() as u16).to_be_bytes());
                    out.extend_from_slice(c.usage);
                }
                None => {
                    out[1] |= 0x01; // not supported
                    out.extend_from_slice(&[0, 0]);
                }
            }
            if rctd {
                out.extend_from_slice(&timeouts());
            }
            out
        }
        _ => return ScsiResult::check(Sense::INVALID_FIELD_IN_CDB),
    };
    ScsiResult::allocated(out, allocation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_data_lengths_match_cdb_sizes() {
        for c in COMMANDS {
            let expected = match c.usage[0] >> 5 {
                0 => 6,
                1 | 2 => 10,
                4 => 16,
                5 => 12,
                _ => unreachable!(),
            };
            assert_eq!(c.usage.len(), expected, "opcode {:#04x}", c.usage[0]);
        }
    }
}
