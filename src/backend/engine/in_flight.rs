//! Releases in flight, for [`Backend::flush`](super::Backend::flush).

use std::future::Future;
use std::sync::Arc;

/// Releases sent and not yet answered, for [`Backend::flush`].
pub(crate) struct InFlight {
    count: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
    /// The runtime the backend was made on: a lock dropped where no runtime
    /// runs (a blocking thread, a struct dropped after its runtime) is
    /// released there. Its connections live there too, so once it has shut
    /// down they are closed, and every lock a session held goes with them.
    home: Option<tokio::runtime::Handle>,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight {
            count: Default::default(),
            idle: Default::default(),
            home: tokio::runtime::Handle::try_current().ok(),
        }
    }
}

impl InFlight {
    /// The runtime to finish a release on: the current one, else the
    /// backend's own.
    pub(crate) fn runtime(&self) -> Option<tokio::runtime::Handle> {
        tokio::runtime::Handle::try_current()
            .ok()
            .or_else(|| self.home.clone())
    }

    /// Runs `release` to its end on `rt`, counted until then.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        rt: &tokio::runtime::Handle,
        release: impl Future<Output = ()> + Send + 'static,
    ) {
        use std::sync::atomic::Ordering;

        /// Uncounts the release also when its task is dropped unfinished.
        struct Done(Arc<InFlight>);
        impl Drop for Done {
            fn drop(&mut self) {
                if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.0.idle.notify_waiters();
                }
            }
        }

        self.count.fetch_add(1, Ordering::AcqRel);
        let done = Done(self.clone());
        rt.spawn(async move {
            let _done = done;
            release.await;
        });
    }

    /// Completes once no release is in flight.
    pub(crate) async fn idle(&self) {
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            // Armed before the check, so a release ending in between is seen.
            idle.as_mut().enable();
            if self.count.load(std::sync::atomic::Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

cfg_remote! {
    impl InFlight {
        /// A backend's [`flush`](super::Backend::flush): completes once no
        /// release is in flight.
        pub(crate) fn flushed(self: &Arc<Self>) -> crate::backend::BackendFuture<()> {
            let this = self.clone();
            crate::backend::BackendFuture::new(async move { this.idle().await })
        }
    }
}
