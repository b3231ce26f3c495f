//! Reading PDUs off a connection: the BHS first, then what follows it, either into a buffer
//! of its own ([`read_pdu`]) or, for a Data-Out whose data continues a write transfer,
//! straight into the transfer's buffer ([`read_data_segment_into`]), most of it from the
//! socket itself, so that data is not copied on its way from the kernel to the disk.

use crate::error::IscsiError;
use crate::pdu::{self, Bhs, Digests, FrameLayout, Pdu, BHS_LEN, DIGEST_LEN};
use ashlar_core::buffers::receive::{receive_payload, PayloadSource};
use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncBufRead, AsyncReadExt};

/// Reads one PDU; `Ok(None)` when the initiator closed the connection between PDUs.
pub(crate) async fn read_pdu<Rd: AsyncBufRead + Unpin>(
    reader: &mut Rd,
    digests: Digests,
    max_data: u32,
) -> Result<Option<Pdu>, IscsiError> {
    let Some(bhs) = read_bhs(reader).await? else {
        return Ok(None);
    };
    let layout = pdu::frame_layout(&bhs, digests, max_data)?;
    read_rest(reader, bhs, layout).await.map(Some)
}

/// Reads a BHS; `Ok(None)` when the initiator closed the connection before its first byte.
pub(crate) async fn read_bhs<Rd: AsyncBufRead + Unpin>(
    reader: &mut Rd,
) -> Result<Option<Bhs>, IscsiError> {
    let mut header = [0u8; BHS_LEN];
    // A clean close before the first byte is an orderly end.
    let first = reader.read(&mut header[..1]).await?;
    if first == 0 {
        return Ok(None);
    }
    reader
        .read_exact(&mut header[1..])
        .await
        .map_err(IscsiError::reading)?;
    Ok(Some(Bhs(header)))
}

/// Reads what follows `bhs` into a buffer of its own and decodes it, checking the digests.
pub(crate) async fn read_rest<Rd: AsyncBufRead + Unpin>(
    reader: &mut Rd,
    bhs: Bhs,
    layout: FrameLayout,
) -> Result<Pdu, IscsiError> {
    // Read into spare capacity: a large data segment is not zero-filled first.
    let length = layout.rest_len();
    let mut rest = BytesMut::with_capacity(length);
    while rest.len() < length {
        let want = length - rest.len();
        let read = reader
            .read_buf(&mut (&mut rest).limit(want))
            .await
            .map_err(IscsiError::reading)?;
        if read == 0 {
            return Err(IscsiError::reading(
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
    }
    Ok(pdu::decode_rest(bhs, layout, rest.freeze())?)
}

/// Reads what follows `bhs`, a PDU without AHS, putting its data segment into `target`
/// (exactly `layout.data_bytes` long) and checking the digests.
pub(crate) async fn read_data_segment_into<Rd: PayloadSource>(
    reader: &mut Rd,
    bhs: &Bhs,
    layout: &FrameLayout,
    target: &mut [u8],
) -> Result<(), IscsiError> {
    assert_eq!(
        layout.ahs_bytes, 0,
        "only a PDU without AHS is read in place"
    );
    assert_eq!(target.len(), layout.data_bytes);
    if layout.header_digest {
        let mut sent = [0u8; DIGEST_LEN];
        read_exactly(reader, &mut sent).await?;
        pdu::check_header_digest(bhs, &[], &sent)?;
    }
    receive_payload(reader, target)
        .await
        .map_err(IscsiError::reading)?;
    let mut padding = [0u8; 3];
    let padding = &mut padding[..layout.padding];
    read_exactly(reader, padding).await?;
    if layout.data_digest && layout.data_bytes > 0 {
        let mut sent = [0u8; DIGEST_LEN];
        read_exactly(reader, &mut sent).await?;
        pdu::check_data_digest(target, padding, &sent)?;
    }
    Ok(())
}

async fn read_exactly<Rd: AsyncBufRead + Unpin>(
    reader: &mut Rd,
    into: &mut [u8],
) -> Result<(), IscsiError> {
    reader
        .read_exact(into)
        .await
        .map(|_| ())
        .map_err(IscsiError::reading)
}
