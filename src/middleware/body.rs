use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::error::{BoxError, LockError};
use crate::guard::LockGuard;

/// A response body the [`LockLayer`](super::LockLayer) can answer with, and
/// keep a lock in until it has been sent.
///
/// The layer's responses keep the inner service's body type, so it composes
/// like any tower-http middleware. Implemented for axum's `Body` (feature
/// `axum`) and for [`LockBody`], which wraps any body: under another
/// service (plain tower or hyper, tonic), map its responses with
/// [`LockBody::wrap`], as in
/// `ServiceBuilder::new().layer(lock_layer).map_response(|r: Response<_>| r.map(LockBody::wrap))`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a `LockLayer` response body",
    label = "the service under the `LockLayer` answers with this body",
    note = "wrap the inner service's response bodies in `tower_lock::LockBody`: \
            `ServiceBuilder::new().layer(lock_layer).map_response(|r: http::Response<_>| r.map(LockBody::wrap))` \
            (axum's `Body` needs nothing)"
)]
///
/// # Examples
///
/// ```
/// use tower_lock::{LockBody, LockableBody};
/// use http_body_util::Full;
/// use bytes::Bytes;
///
/// fn assert_lockable<B: LockableBody>() {}
/// assert_lockable::<axum::body::Body>();
/// assert_lockable::<LockBody<Full<Bytes>>>();
/// // assert_lockable::<Full<Bytes>>(); // error: wrap it in `LockBody`
/// ```
pub trait LockableBody: Body + Sized {
    /// A body of `text`, for the layer's own answers (rejections).
    fn from_text(text: Bytes) -> Self;

    /// This body, holding `guard` until it ends, fails or is dropped. With
    /// `abort_on_lost`, a lost lock ends the body with an error (the
    /// connection is reset) rather than let it stream on unlocked.
    fn holding(self, guard: LockGuard, abort_on_lost: bool) -> Self;
}

#[cfg(feature = "axum")]
impl LockableBody for axum::body::Body {
    fn from_text(text: Bytes) -> Self {
        axum::body::Body::from(text)
    }

    fn holding(self, guard: LockGuard, abort_on_lost: bool) -> Self {
        axum::body::Body::new(LockBody::wrap(self).holding(guard, abort_on_lost))
    }
}

pin_project! {
    /// A body that wraps any `B` so that it can be a
    /// [`LockService`](super::LockService) response: it carries the layer's
    /// rejection texts, and with
    /// [`LockLayer::hold_until_body_sent`](super::LockLayer::hold_until_body_sent)
    /// holds the lock until the body ends, fails or is dropped.
    ///
    /// With axum you never see it; for another inner service, map its
    /// response bodies with [`LockBody::wrap`].
    ///
    /// # Examples
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use bytes::Bytes;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tower_lock::{HeldLock, LockBody, LockLayer, MemoryBackend, QueryParam};
    ///
    /// // A plain tower service: no axum.
    /// let debit = tower::service_fn(|req: Request<()>| async move {
    ///     let held = HeldLock::current().expect("under the layer");
    ///     Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(format!("debited {}", held.key())))))
    /// });
    /// let service = ServiceBuilder::new()
    ///     .layer(LockLayer::new(MemoryBackend::new(), QueryParam("account")).namespace("acct"))
    ///     // The layer answers rejections in the inner service's body type:
    ///     // `LockBody` wraps any body so that it can.
    ///     .map_response(|res: Response<Full<Bytes>>| res.map(LockBody::wrap))
    ///     .service(debit);
    ///
    /// let res = service.clone().oneshot(Request::post("/debit?account=7").body(()).unwrap()).await.unwrap();
    /// assert_eq!(res.status(), 200);
    /// let res = service.oneshot(Request::post("/debit").body(()).unwrap()).await.unwrap();
    /// assert_eq!(res.status(), 400, "no key");
    /// # }
    /// ```
    pub struct LockBody<B> {
        #[pin]
        kind: Kind<B>,
        guard: Option<LockGuard>,
        abort_on_lost: bool,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner {
            #[pin]
            body: B,
        },
        Text {
            text: Option<Bytes>,
        },
    }
}

impl<B> LockBody<B> {
    /// Wraps `body`.
    pub fn wrap(body: B) -> Self {
        LockBody {
            kind: Kind::Inner { body },
            guard: None,
            abort_on_lost: false,
        }
    }
}

impl<B> LockableBody for LockBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    fn from_text(text: Bytes) -> Self {
        LockBody {
            kind: Kind::Text {
                text: (!text.is_empty()).then_some(text),
            },
            guard: None,
            abort_on_lost: false,
        }
    }

    fn holding(mut self, guard: LockGuard, abort_on_lost: bool) -> Self {
        self.guard = Some(guard);
        self.abort_on_lost = abort_on_lost;
        self
    }
}

impl<B> Body for LockBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if *this.abort_on_lost {
            if let Some(guard) = this.guard.as_ref() {
                if guard.held().lost_signal().poll_lost(cx).is_ready() {
                    let reason = guard.held().lost_signal().reason().unwrap_or("lock lost");
                    let error = LockError::Lost(reason.to_owned());
                    this.guard.take();
                    return Poll::Ready(Some(Err(error.into())));
                }
            }
        }
        let frame = match this.kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Text { text } => Poll::Ready(text.take().map(|t| Ok(Frame::data(t)))),
        };
        // The body is over: release now rather than when it is dropped.
        if let Poll::Ready(None | Some(Err(_))) = frame {
            this.guard.take();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Text { text } => text.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Text { text } => {
                SizeHint::with_exact(text.as_ref().map_or(0, |t| t.len() as u64))
            }
        }
    }
}

impl<B> fmt::Debug for LockBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockBody")
            .field("guard", &self.guard)
            .finish_non_exhaustive()
    }
}
