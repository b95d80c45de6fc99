use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::guard::LockGuard;

pin_project! {
    /// Response body of [`LockService`](super::LockService): the inner
    /// service's body, or the layer's own text for a rejection.
    ///
    /// With [`LockLayer::hold_until_body_sent`](super::LockLayer::hold_until_body_sent)
    /// it holds the lock until the body ends, fails or is dropped.
    pub struct LockBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
            guard: Option<LockGuard>,
        },
        Rejection {
            text: Option<Bytes>,
        },
    }
}

impl<B> LockBody<B> {
    pub(crate) fn new(body: B, guard: Option<LockGuard>) -> Self {
        LockBody {
            kind: Kind::Inner { body, guard },
        }
    }

    pub(crate) fn rejection(text: Bytes) -> Self {
        LockBody {
            kind: Kind::Rejection {
                text: (!text.is_empty()).then_some(text),
            },
        }
    }
}

impl<B> Body for LockBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            KindProj::Inner { body, guard } => {
                let frame = body.poll_frame(cx);
                if let Poll::Ready(None | Some(Err(_))) = frame {
                    guard.take();
                }
                frame
            }
            KindProj::Rejection { text } => Poll::Ready(text.take().map(|t| Ok(Frame::data(t)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body, .. } => body.is_end_stream(),
            Kind::Rejection { text } => text.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body, .. } => body.size_hint(),
            Kind::Rejection { text } => {
                SizeHint::with_exact(text.as_ref().map_or(0, |t| t.len() as u64))
            }
        }
    }
}

impl<B> fmt::Debug for LockBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { guard, .. } => f
                .debug_struct("LockBody::Inner")
                .field("guard", guard)
                .finish_non_exhaustive(),
            Kind::Rejection { text } => f
                .debug_struct("LockBody::Rejection")
                .field("text", text)
                .finish(),
        }
    }
}
