//! The codec every duet service and client uses (`codec_path` in `build.rs`): prost's, with
//! a check on the raw bytes of a `GenerateRequest` before it is decoded. A repeated field of
//! empty entries costs two bytes an entry on the wire and one whole struct (24-48 bytes) an
//! entry once decoded, so a request the byte limit lets in could decode to tens of megabytes
//! before validation counts its entries. Counting them on the wire first bounds that.

use crate::v1::GenerateRequest;
use prost::Message;
use prost::bytes::Buf;
use prost::encoding::{WireType, decode_key, decode_varint};
use std::any::TypeId;
use std::marker::PhantomData;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;

/// Chat messages a request may carry on the wire, whatever the server's own (lower) limit.
pub const MAX_CHAT_MESSAGES: usize = 4096;

/// prost's codec, whose decoder checks a `GenerateRequest`'s entry counts first.
#[derive(Debug)]
pub struct BoundedCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for BoundedCodec<T, U> {
    fn default() -> Self {
        Self(ProstCodec::default())
    }
}

impl<T, U> Codec for BoundedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = BoundedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        BoundedDecoder(self.0.decoder(), PhantomData)
    }
}

/// prost's decoder behind [`check_generate_request`].
#[derive(Debug)]
pub struct BoundedDecoder<U>(ProstDecoder<U>, PhantomData<U>);

impl<U: Message + Default + 'static> Decoder for BoundedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // The one message whose entries a caller controls; the rest are bounded by their
        // byte limits alone. A tonic decode buffer holds the whole message in one chunk.
        if TypeId::of::<U>() == TypeId::of::<GenerateRequest>()
            && buf.chunk().len() == buf.remaining()
        {
            check_generate_request(buf.chunk())?;
        }
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Refuses an encoded `GenerateRequest` with more than [`MAX_STOP_STRINGS`] stop strings or
/// [`MAX_CHAT_MESSAGES`] chat messages, naming the field as validation does. Bytes that are
/// not a valid message pass: prost's decode reports them.
pub fn check_generate_request(raw: &[u8]) -> Result<(), Status> {
    let (mut stop, mut messages) = (0, 0);
    for (field, value) in Fields(raw) {
        match (field, value) {
            (8, Some(_)) => stop += 1,
            // `Messages`: its field 1 is the repeated `ChatMessage`.
            (2, Some(inner)) => {
                messages += Fields(inner).filter(|(f, _)| *f == 1).count();
            }
            _ => {}
        }
        if stop > MAX_STOP_STRINGS {
            return Err(Status::invalid_argument(format!(
                "stop: more than {MAX_STOP_STRINGS} strings"
            )));
        }
        if messages > MAX_CHAT_MESSAGES {
            return Err(Status::invalid_argument(format!(
                "messages: more than {MAX_CHAT_MESSAGES} messages"
            )));
        }
    }
    Ok(())
}

/// The top-level fields of an encoded message: each field's number, and its bytes when it
/// is length-delimited. Ends at the first malformed field (or a group, which proto3 lacks).
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = (u32, Option<&'a [u8]>);

    fn next(&mut self) -> Option<Self::Item> {
        let buf = &mut self.0;
        if buf.is_empty() {
            return None;
        }
        let Ok((field, wire)) = decode_key(buf) else {
            *buf = &[];
            return None;
        };
        let skip = match wire {
            WireType::Varint => decode_varint(buf).ok().map(|_| 0),
            WireType::SixtyFourBit => Some(8),
            WireType::ThirtyTwoBit => Some(4),
            WireType::LengthDelimited => decode_varint(buf)
                .ok()
                .and_then(|n| usize::try_from(n).ok()),
            WireType::StartGroup | WireType::EndGroup => None,
        };
        let Some(len) = skip.filter(|&len| len <= buf.len()) else {
            *buf = &[];
            return None;
        };
        let (value, rest) = buf.split_at(len);
        *buf = rest;
        Some((field, (wire == WireType::LengthDelimited).then_some(value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{ChatMessage, Messages, generate_request::Input};
    use tonic::Code;

    fn chat(n: usize, stop: usize) -> Vec<u8> {
        GenerateRequest {
            input: Some(Input::Messages(Messages {
                messages: vec![ChatMessage::default(); n],
            })),
            stop: vec![String::new(); stop],
            max_tokens: 7,
            top_p: Some(0.5),
            seed: u64::MAX,
            ..Default::default()
        }
        .encode_to_vec()
    }

    fn refusal(raw: &[u8]) -> String {
        let status = check_generate_request(raw).unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        status.message().to_string()
    }

    #[test]
    fn counts_stop_strings_and_chat_messages_before_decoding() {
        assert!(check_generate_request(&chat(MAX_CHAT_MESSAGES, MAX_STOP_STRINGS)).is_ok());
        assert_eq!(
            refusal(&chat(MAX_CHAT_MESSAGES + 1, 0)),
            "messages: more than 4096 messages"
        );
        assert_eq!(
            refusal(&chat(1, MAX_STOP_STRINGS + 1)),
            "stop: more than 16 strings"
        );
    }

    #[test]
    fn messages_split_over_several_fields_count_together() {
        // A singular message field sent twice merges: its repeated entries add up.
        let half = Messages {
            messages: vec![ChatMessage::default(); MAX_CHAT_MESSAGES / 2 + 1],
        };
        let mut raw = Vec::new();
        for _ in 0..2 {
            prost::encoding::message::encode(2, &half, &mut raw);
        }
        assert_eq!(
            GenerateRequest::decode(raw.as_slice()).map(|r| match r.input {
                Some(Input::Messages(m)) => m.messages.len(),
                _ => 0,
            }),
            Ok(MAX_CHAT_MESSAGES + 2)
        );
        assert_eq!(refusal(&raw), "messages: more than 4096 messages");
    }

    #[test]
    fn malformed_bytes_are_left_to_prost() {
        let mut raw = chat(2, 2);
        raw.truncate(raw.len() - 3);
        assert!(check_generate_request(&raw).is_ok());
        assert!(GenerateRequest::decode(raw.as_slice()).is_err());
        assert!(check_generate_request(&[0xff; 11]).is_ok());
    }
}
