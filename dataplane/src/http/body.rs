//! Reading a whole body, up to a limit. Every request body is read whole
//! (routing reads its view) and so is every answer that is not streamed;
//! most arrive as one frame, which is passed on as it is. What this saves
//! over `Limited` and `collect` is their wrapper and buffer list (an
//! allocation per body), on every request.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

use crate::shares::{Share, Whose};

/// The bytes a data plane holds of bodies read whole (requests, answers
/// that are not streamed), all its requests together, up to a limit: past
/// it a request is refused rather than the process run out of memory,
/// with every stream on it.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
}

impl Budget {
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget { limit, used: AtomicUsize::new(0) })
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Nothing held yet, against `budget` and, where the request has one,
    /// its caller's `share`.
    pub fn reservation(budget: &Arc<Budget>, share: Option<&Arc<Share>>) -> Reservation {
        Reservation { budget: Arc::clone(budget), share: share.cloned(), bytes: 0, slot: None }
    }
}

/// Whose bytes are all held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// The data plane's, all requests together.
    DataPlane,
    /// The caller's share, of its key or tenant.
    Share(Whose),
}

/// Bytes held against a [`Budget`] and a caller's [`Share`], given back
/// when dropped. It keeps the share (a request in flight) as long, and
/// the request's place in its flow's slot share.
pub struct Reservation {
    budget: Arc<Budget>,
    share: Option<Arc<Share>>,
    bytes: usize,
    slot: Option<Arc<crate::slot_shares::Hold>>,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation").field("bytes", &self.bytes).finish_non_exhaustive()
    }
}

impl Reservation {
    /// Holds `bytes` more; past the caller's share or the data plane's
    /// limit, holds nothing more and says whose.
    pub fn grow(&mut self, bytes: usize) -> Result<(), Full> {
        if let Some(share) = &self.share {
            share.grow(bytes).map_err(Full::Share)?;
        }
        let grown = self.budget.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
            used.checked_add(bytes).filter(|total| *total <= self.budget.limit)
        });
        if grown.is_err() {
            if let Some(share) = &self.share {
                share.shrink(bytes);
            }
            return Err(Full::DataPlane);
        }
        self.bytes += bytes;
        Ok(())
    }

    /// The caller's share this reservation keeps.
    pub fn share(&self) -> Option<&Arc<Share>> {
        self.share.as_ref()
    }

    /// Keeps the request's place in its flow's slot share as long.
    pub fn keep_slot(&mut self, slot: Arc<crate::slot_shares::Hold>) {
        self.slot = Some(slot);
    }

    pub fn slot(&self) -> Option<&Arc<crate::slot_shares::Hold>> {
        self.slot.as_ref()
    }

    /// Gives back the bytes held but keeps the caller's share: the request
    /// is still in flight.
    pub fn emptied(mut self) -> Reservation {
        self.give_back();
        self
    }

    fn give_back(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::Relaxed);
        if let Some(share) = &self.share {
            share.shrink(self.bytes);
        }
        self.bytes = 0;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.give_back();
    }
}

/// A body read whole, as a client is sent it: its bytes stay held against
/// the budget until they are written out. One longer than a frame is
/// handed out a frame at a time, each a copy: hyper's write buffer takes
/// a few frames at most, so a client that stops reading holds no more
/// than those outside the budget (never the whole answer, which a slice
/// of it would keep alive), and the rest, held, is counted against its
/// share; its connection sees an answer waiting on the client, and is
/// closed if it takes nothing for a while (`inferyes_net::serve`).
pub struct Held {
    bytes: Option<Bytes>,
    /// Handed out in frames, copied.
    framed: bool,
    _held: Reservation,
}

/// The largest frame of a body handed out whole.
pub const FRAME_BYTES: usize = 64 << 10;

impl Held {
    pub fn new(bytes: Bytes, held: Reservation) -> Held {
        let framed = bytes.len() > FRAME_BYTES;
        Held { bytes: Some(bytes).filter(|b| !b.is_empty()), framed, _held: held }
    }
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if !self.framed {
            return std::task::Poll::Ready(self.bytes.take().map(|bytes| Ok(http_body::Frame::data(bytes))));
        }
        let Some(bytes) = self.bytes.as_mut() else { return std::task::Poll::Ready(None) };
        let frame = Bytes::copy_from_slice(&bytes[..bytes.len().min(FRAME_BYTES)]);
        bytes::Buf::advance(bytes, frame.len());
        if bytes.is_empty() {
            self.bytes = None;
        }
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(frame))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.bytes.as_ref().map_or(0, |b| b.len() as u64))
    }
}

/// Why a body could not be read whole.
#[derive(Debug)]
pub enum ReadError<E> {
    /// It is longer than the limit.
    TooLarge,
    /// The data plane, or the caller's share, holds all the bytes it may.
    OverBudget(Full),
    /// The connection failed in the middle of it.
    Body(E),
}

impl<E: std::fmt::Display> std::fmt::Display for ReadError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::TooLarge => f.write_str("the body is longer than the limit"),
            ReadError::OverBudget(Full::DataPlane) => f.write_str("the data plane holds all the bytes it may"),
            ReadError::OverBudget(Full::Share(whose)) => write!(f, "the {} holds all the bytes it may", whose.as_str()),
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
    read_whole_within(body, limit, None).await
}

/// As [`read_whole`], each byte held against `held` as it arrives (so the
/// body is refused as soon as the budget is spent, not once it is read).
pub async fn read_whole_within<B>(
    body: B,
    limit: usize,
    mut held: Option<&mut Reservation>,
) -> Result<Bytes, ReadError<B::Error>>
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
        if let Some(held) = held.as_deref_mut() {
            held.grow(data.len()).map_err(ReadError::OverBudget)?;
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
    async fn bodies_are_held_against_one_budget_and_refused_past_it_and_given_back() {
        let budget = Budget::new(6);
        let mut first = Budget::reservation(&budget, None);
        assert_eq!(read_whole_within(body(&["abc", "d"]), 64, Some(&mut first)).await.unwrap(), "abcd");
        assert_eq!(budget.used(), 4);
        let mut second = Budget::reservation(&budget, None);
        let refused = read_whole_within(body(&["ef", "gh"]), 64, Some(&mut second)).await;
        assert!(matches!(refused, Err(ReadError::OverBudget(Full::DataPlane))), "4 + 4 is past 6");
        drop(second);
        assert_eq!(budget.used(), 4, "what the refused body held is given back");
        drop(first);
        assert_eq!(budget.used(), 0);
        let mut third = Budget::reservation(&budget, None);
        assert_eq!(read_whole_within(body(&["efgh"]), 64, Some(&mut third)).await.unwrap(), "efgh");
    }

    #[tokio::test]
    async fn a_keys_bodies_are_held_within_its_share_and_given_back_to_it() {
        use crate::shares::{Limits, Shares};
        let budget = Budget::new(9);
        let shares = Shares::new(Limits { requests: 4, bytes: 5 }, Limits { requests: 4, bytes: 5 });
        let key = |id: &str| Arc::new(inferyes_proto::v1::ApiKey { key_id: id.into(), ..Default::default() });
        let (a, b) = (Arc::new(shares.take(&key("a"), None).unwrap()), Arc::new(shares.take(&key("b"), None).unwrap()));
        let mut first = Budget::reservation(&budget, Some(&a));
        assert_eq!(read_whole_within(body(&["abc"]), 64, Some(&mut first)).await.unwrap(), "abc");
        let mut second = Budget::reservation(&budget, Some(&a));
        let refused = read_whole_within(body(&["def"]), 64, Some(&mut second)).await;
        assert!(matches!(refused, Err(ReadError::OverBudget(Full::Share(Whose::Key)))), "3 + 3 is past a's 5");
        let mut other = Budget::reservation(&budget, Some(&b));
        assert_eq!(read_whole_within(body(&["defgh"]), 64, Some(&mut other)).await.unwrap(), "defgh");
        let mut past = Budget::reservation(&budget, Some(&a));
        let refused = read_whole_within(body(&["i", "j"]), 64, Some(&mut past)).await;
        assert!(matches!(refused, Err(ReadError::OverBudget(Full::DataPlane))), "8 + 1 + 1 is past the 9");
        drop((second, past));
        assert_eq!((shares.of_key("a").1, budget.used()), (3, 8), "what refused bodies held is given back");
        let emptied = other.emptied();
        assert_eq!((shares.of_key("b"), budget.used()), ((1, 0), 3), "an emptied reservation keeps its request");
        drop(emptied);
        assert_eq!(shares.of_key("b"), (1, 0), "the request is b's own to give back");
        drop(first);
        assert_eq!(shares.of_key("a"), (1, 0));
    }

    #[tokio::test]
    async fn a_large_answer_is_handed_out_in_copied_frames_held_to_the_last() {
        use http_body_util::BodyExt as _;
        let budget = Budget::new(1 << 20);
        let small = Bytes::from(vec![7u8; FRAME_BYTES]);
        let mut reservation = Budget::reservation(&budget, None);
        reservation.grow(small.len()).unwrap();
        let mut one = Held::new(small.clone(), reservation);
        let frame = one.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(frame.as_ptr(), small.as_ptr(), "an answer of one frame is not copied");
        assert!(http_body::Body::is_end_stream(&one));
        drop(one);

        let large = Bytes::from((0..3 * FRAME_BYTES + 5).map(|i| i as u8).collect::<Vec<u8>>());
        let mut reservation = Budget::reservation(&budget, None);
        reservation.grow(large.len()).unwrap();
        let mut held = Held::new(large.clone(), reservation);
        let mut sent = Vec::new();
        while let Some(frame) = held.frame().await {
            let frame = frame.unwrap().into_data().unwrap();
            assert!(frame.len() <= FRAME_BYTES);
            let within = large.as_ptr_range();
            assert!(!within.contains(&frame.as_ptr()), "each frame a copy, keeping nothing of the answer alive");
            sent.extend_from_slice(&frame);
            assert_eq!(budget.used(), large.len(), "held until the body is done");
        }
        assert_eq!(sent, large);
        drop(held);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused() {
        assert!(matches!(read_whole(body(&["abc", "de"]), 4).await, Err(ReadError::TooLarge)));
        assert!(matches!(read_whole(body(&["abcde"]), 4).await, Err(ReadError::TooLarge)));
        assert_eq!(read_whole(body(&["ab", "cd"]), 4).await.unwrap(), "abcd");
    }
}
