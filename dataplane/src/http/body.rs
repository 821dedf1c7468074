//! Reading a whole body, up to a limit. Every request body is read whole
//! (routing reads its view) and so is every answer that is not streamed;
//! most arrive as one frame, which is passed on as it is. What this saves
//! over `Limited` and `collect` is their wrapper and buffer list (an
//! allocation per body), on every request.

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

/// Why a body could not be read whole.
#[derive(Debug)]
pub enum ReadError<E> {
    /// It is longer than the limit.
    TooLarge,
    /// The connection failed in the middle of it.
    Body(E),
}

impl<E: std::fmt::Display> std::fmt::Display for ReadError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::TooLarge => f.write_str("the body is longer than the limit"),
            ReadError::Body(error) => error.fmt(f),
        }
    }
}

/// The whole of `body`, refused once it is longer than `limit` bytes.
/// Trailers are dropped.
pub async fn read_whole<B>(body: B, limit: usize) -> Result<Bytes, ReadError<B::Error>>
where
    B: http_body::Body<Data = Bytes>,
{
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut length = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(ReadError::Body)?.into_data() else { continue };
        length += data.len();
        if length > limit {
            return Err(ReadError::TooLarge);
        }
        if let Some(joined) = &mut joined {
            joined.extend_from_slice(&data);
        } else if let Some(before) = first.take() {
            let mut both = BytesMut::with_capacity(length);
            both.extend_from_slice(&before);
            both.extend_from_slice(&data);
            joined = Some(both);
        } else {
            first = Some(data);
        }
        // A body of known length is over with its last byte: not polled
        // again for an end it already knows (hyper's is a channel, and the
        // trailers another).
        if body.is_end_stream() {
            break;
        }
    }
    Ok(joined.map(BytesMut::freeze).or(first).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use http_body::Frame;
    use http_body_util::StreamBody;

    use super::*;

    type Chunks = StreamBody<tokio_stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

    fn body(chunks: &[&'static str]) -> Chunks {
        let frames: Vec<_> = chunks.iter().map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes())))).collect();
        StreamBody::new(tokio_stream::iter(frames))
    }

    #[tokio::test]
    async fn one_frame_is_passed_on_and_several_are_joined() {
        let chunk = "{\"model\":\"m\"}";
        let whole = read_whole(body(&[chunk]), 64).await.unwrap();
        assert_eq!(whole.as_ptr(), chunk.as_ptr(), "a single frame is not copied");
        assert_eq!(read_whole(body(&["ab", "cd", "e"]), 64).await.unwrap(), "abcde");
        assert_eq!(read_whole(body(&[]), 64).await.unwrap(), "");
    }

    /// One frame, and an end it announces: polling it again is a bug.
    struct KnownLength(Option<Bytes>);

    impl http_body::Body for KnownLength {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            let data = self.0.take().expect("not polled past its announced end");
            std::task::Poll::Ready(Some(Ok(Frame::data(data))))
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_none()
        }
    }

    #[tokio::test]
    async fn a_body_that_says_it_has_ended_is_not_polled_again() {
        let whole = read_whole(KnownLength(Some(Bytes::from_static(b"{}"))), 64).await.unwrap();
        assert_eq!(whole, "{}");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused() {
        assert!(matches!(read_whole(body(&["abc", "de"]), 4).await, Err(ReadError::TooLarge)));
        assert!(matches!(read_whole(body(&["abcde"]), 4).await, Err(ReadError::TooLarge)));
        assert_eq!(read_whole(body(&["ab", "cd"]), 4).await.unwrap(), "abcd");
    }
}
