use super::*;
use crate::testing::{unit, MemDevice};
use proptest::prelude::*;

const MIB: usize = 1 << 20;

fn nexus() -> Nexus {
    Nexus::new("iqn.i", [0x80, 0, 0, 0, 0, 1])
}

fn run(
    unit: Option<&LogicalUnit<MemDevice>>,
    cdb: &[u8],
    data: &[u8],
    expected: u32,
) -> ScsiResult {
    let mut full = [0u8; 16];
    full[..cdb.len()].copy_from_slice(cdb);
    let nexus = nexus();
    let ctx = Context {
        unit,
        nexus: &nexus,
        target_name: "iqn.t",
        lun_count: 1,
        max_transfer: 8 * MIB as u32,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(execute(&ctx, &full, Bytes::copy_from_slice(data), expected))
}

fn sense_of(result: &ScsiResult) -> (u8, u8, u8) {
    let s = result.sense.expect("sense data");
    (s.key, s.asc, s.ascq)
}

fn write10(lba: u32, blocks: u16) -> Vec<u8> {
    let mut cdb = vec![0x2a, 0];
    cdb.extend_from_slice(&lba.to_be_bytes());
    cdb.push(0);
    cdb.extend_from_slice(&blocks.to_be_bytes());
    cdb.push(0);
    cdb
}

fn read16(lba: u64, blocks: u32) -> Vec<u8> {
    let mut cdb = vec![0x88, 0];
    cdb.extend_from_slice(&lba.to_be_bytes());
    cdb.extend_from_slice(&blocks.to_be_bytes());
    cdb.extend_from_slice(&[0, 0]);
    cdb
}

#[test]
fn write_then_read_back() {
    let u = unit(MIB);
    let data = vec![0x5a; 1024];
    let w = run(Some(&u), &write10(4, 2), &data, 1024);
    assert_eq!(w.status, status::GOOD);
    let r = run(Some(&u), &read16(4, 2), &[], 1024);
    assert_eq!(r.status, status::GOOD);
    assert_eq!(&r.data_in[..], &data[..]);
    assert_eq!(r.transfer, 1024);
}

#[test]
fn out_of_range_is_lba_out_of_range() {
    let u = unit(MIB);
    let blocks = (MIB / 512) as u64;
    let r = run(Some(&u), &read16(blocks - 1, 2), &[], 1024);
    assert_eq!(r.status, status::CHECK_CONDITION);
    assert_eq!(sense_of(&r), (0x05, 0x21, 0x00));
    let r = run(Some(&u), &read16(u64::MAX, 1), &[], 512);
    assert_eq!(sense_of(&r), (0x05, 0x21, 0x00));
    let w = run(Some(&u), &write10(blocks as u32, 1), &[0; 512], 512);
    assert_eq!(sense_of(&w), (0x05, 0x21, 0x00));
}

#[test]
fn device_errors_map_to_sense() {
    let sense = |error: IoError, writing| {
        let s = io_sense(&error, writing);
        (s.key, s.asc, s.ascq)
    };
    assert_eq!(sense(IoError::Io("crc".into()), false), (0x03, 0x11, 0x00));
    assert_eq!(sense(IoError::Io("crc".into()), true), (0x03, 0x0c, 0x00));
    // A node whose ownership claim lapsed: not ready for now, nothing wrong with the blocks.
    for writing in [false, true] {
        assert_eq!(
            sense(IoError::NotServing("lapsed".into()), writing),
            (0x02, 0x04, 0x01)
        );
    }
    assert_eq!(sense(IoError::ShuttingDown, true), (0x02, 0x04, 0x12));
}

#[test]
fn short_write_data_writes_only_what_was_sent() {
    let u = unit(MIB);
    let w = run(Some(&u), &write10(0, 1), &[1; 200], 200);
    assert_eq!(w.status, status::GOOD);
    assert_eq!(w.transfer, 512, "the overflow is reported as a residual");
    let data = u.device.data.borrow();
    assert!(data[..200].iter().all(|&b| b == 1));
    assert!(data[200..512].iter().all(|&b| b == 0));
}

#[test]
fn capacity_reports_thin_provisioning() {
    let u = unit(MIB);
    let r = run(
        Some(&u),
        &[0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0],
        &[],
        32,
    );
    assert_eq!(r.status, status::GOOD);
    assert_eq!(
        u64::from_be_bytes(r.data_in[0..8].try_into().unwrap()),
        2047
    );
    assert_eq!(r.data_in[14] & 0x80, 0x80, "LBPME");
    let r = run(Some(&u), &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[], 8);
    assert_eq!(&r.data_in[..], &[0, 0, 0x07, 0xff, 0, 0, 0x02, 0]);
}

#[test]
fn inquiry_pages() {
    let u = unit(MIB);
    let r = run(Some(&u), &[0x12, 0, 0, 0, 96, 0], &[], 96);
    assert_eq!(&r.data_in[8..14], b"ASHLAR");
    let r = run(Some(&u), &[0x12, 1, 0, 0, 255, 0], &[], 255);
    assert_eq!(&r.data_in[4..], &[0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2]);
    for page in [0x80u8, 0x83, 0xb0, 0xb1, 0xb2] {
        let r = run(Some(&u), &[0x12, 1, page, 1, 0, 0], &[], 256);
        assert_eq!(r.status, status::GOOD, "page {page:#x}");
        assert_eq!(r.data_in[1], page);
        let length = u16::from_be_bytes([r.data_in[2], r.data_in[3]]) as usize;
        assert_eq!(r.data_in.len(), 4 + length);
    }
    let r = run(Some(&u), &[0x12, 1, 0x42, 0, 255, 0], &[], 255);
    assert_eq!(sense_of(&r), (0x05, 0x24, 0x00));
    // A LUN the target lacks: qualifier 011b.
    let r = run(None, &[0x12, 0, 0, 0, 36, 0], &[], 36);
    assert_eq!(r.data_in[0], 0x7f);
    let r = run(None, &[0x00, 0, 0, 0, 0, 0], &[], 0);
    assert_eq!(sense_of(&r), (0x05, 0x25, 0x00));
}

#[test]
fn unmap_and_write_same_zero_and_pattern() {
    let u = unit(MIB);
    run(Some(&u), &write10(0, 4), &[0xee; 2048], 2048);
    let mut params = vec![0, 22, 0, 16, 0, 0, 0, 0];
    params.extend_from_slice(&1u64.to_be_bytes());
    params.extend_from_slice(&2u32.to_be_bytes());
    params.extend_from_slice(&[0; 4]);
    let r = run(Some(&u), &[0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0], &params, 24);
    assert_eq!(r.status, status::GOOD);
    let data = u.device.data.borrow().clone();
    assert!(data[512..1536].iter().all(|&b| b == 0));
    assert!(data[1536..2048].iter().all(|&b| b == 0xee));
    let mut ws = vec![0x93, 0];
    ws.extend_from_slice(&10u64.to_be_bytes());
    ws.extend_from_slice(&3u32.to_be_bytes());
    ws.extend_from_slice(&[0, 0]);
    let r = run(Some(&u), &ws, &[7; 512], 512);
    assert_eq!(r.status, status::GOOD);
    assert!(u.device.data.borrow()[10 * 512..13 * 512]
        .iter()
        .all(|&b| b == 7));
    ws[13] = 0; // zero blocks: refused (WSNZ)
    let r = run(Some(&u), &ws, &[7; 512], 512);
    assert_eq!(sense_of(&r), (0x05, 0x24, 0x00));
}

#[test]
fn compare_and_write_miscompare_reports_offset() {
    let u = unit(MIB);
    run(Some(&u), &write10(0, 1), &[1; 512], 512);
    let mut cdb = vec![0x89, 0];
    cdb.extend_from_slice(&0u64.to_be_bytes());
    cdb.extend_from_slice(&[0, 0, 0, 1, 0, 0]);
    let mut data = vec![1u8; 512];
    data[100] = 9;
    data.extend_from_slice(&[2; 512]);
    let r = run(Some(&u), &cdb, &data, 1024);
    assert_eq!(sense_of(&r), (0x0e, 0x1d, 0x00));
    assert_eq!(r.sense.unwrap().information, Some(100));
    data[100] = 1;
    let r = run(Some(&u), &cdb, &data, 1024);
    assert_eq!(r.status, status::GOOD);
    assert!(u.device.data.borrow()[..512].iter().all(|&b| b == 2));
}

#[test]
fn mode_sense_and_select() {
    let u = unit(MIB);
    let r = run(Some(&u), &[0x1a, 0, 0x3f, 0, 255, 0], &[], 255);
    assert_eq!(r.status, status::GOOD);
    assert_eq!(usize::from(r.data_in[0]) + 1, r.data_in.len());
    let r = run(Some(&u), &[0x5a, 0, 0x08, 0, 0, 0, 0, 0, 255, 0], &[], 255);
    assert_eq!(r.status, status::GOOD);
    let r = run(Some(&u), &[0x1a, 0, 0xc8, 0, 255, 0], &[], 255);
    assert_eq!(sense_of(&r), (0x05, 0x39, 0x00));
    // Selecting the current caching page is accepted; changing it is not.
    let current = run(Some(&u), &[0x1a, 0x08, 0x08, 0, 255, 0], &[], 255);
    let mut params = vec![0u8, 0, 0, 0];
    params.extend_from_slice(&current.data_in[4..]);
    let r = run(
        Some(&u),
        &[0x15, 0x10, 0, 0, params.len() as u8, 0],
        &params,
        params.len() as u32,
    );
    assert_eq!(r.status, status::GOOD);
    params[6] ^= 0x04;
    let r = run(
        Some(&u),
        &[0x15, 0x10, 0, 0, params.len() as u8, 0],
        &params,
        params.len() as u32,
    );
    assert_eq!(sense_of(&r), (0x05, 0x26, 0x00));
}

#[test]
fn report_luns_and_opcodes() {
    let u = unit(MIB);
    let r = run(Some(&u), &[0xa0, 0, 0, 0, 0, 0, 0, 0, 0, 64, 0, 0], &[], 64);
    assert_eq!(&r.data_in[..4], &[0, 0, 0, 8]);
    let r = run(Some(&u), &[0xa0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0], &[], 4);
    assert_eq!(sense_of(&r), (0x05, 0x24, 0x00));
    let r = run(
        Some(&u),
        &[0xa3, 0x0c, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0],
        &[],
        4096,
    );
    assert_eq!(r.status, status::GOOD);
    let length = u32::from_be_bytes(r.data_in[0..4].try_into().unwrap()) as usize;
    assert_eq!(length % 8, 0);
    let r = run(
        Some(&u),
        &[0xa3, 0x0c, 0x01, 0x28, 0, 0, 0, 0, 1, 0, 0, 0],
        &[],
        256,
    );
    assert_eq!(r.data_in[1] & 0x07, 0x03);
    assert_eq!(r.data_in[4], 0x28);
}

#[test]
fn reservation_conflict_blocks_other_nexus() {
    let u = unit(MIB);
    let other = Nexus::new("iqn.other", [0; 6]);
    u.shared
        .update(|s| reservation::reserve6(s, &other.initiator_port));
    let w = run(Some(&u), &write10(0, 1), &[0; 512], 512);
    assert_eq!(w.status, status::RESERVATION_CONFLICT);
    let r = run(Some(&u), &[0x12, 0, 0, 0, 36, 0], &[], 36);
    assert_eq!(r.status, status::GOOD);
}

proptest! {
    #[test]
    fn random_cdbs_never_panic(cdb in proptest::collection::vec(any::<u8>(), 16),
                               data in proptest::collection::vec(any::<u8>(), 0..2048),
                               expected in 0u32..4096) {
        let u = unit(64 * 1024);
        let r = run(Some(&u), &cdb, &data, expected);
        prop_assert!(r.status == status::GOOD || r.sense.is_some()
            || r.status == status::RESERVATION_CONFLICT);
    }
}
