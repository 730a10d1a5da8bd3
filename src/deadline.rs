//! A deadline on a future the browser must settle (an adapter or device request): in wasm the
//! page's (or worker's) timer races it; natively nothing in the engine waits on another process,
//! so the future runs to its end.

use std::future::Future;

/// `future`'s output, or None when it has not finished after `ms` milliseconds (wasm only).
pub async fn within<F: Future>(future: F, ms: u32) -> Option<F::Output> {
    #[cfg(target_arch = "wasm32")]
    {
        use std::task::Poll;
        let mut future = std::pin::pin!(future);
        let mut timer = std::pin::pin!(browser::sleep(ms));
        std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = future.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            if timer.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            Poll::Pending
        })
        .await
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = ms;
        Some(future.await)
    }
}

/// Says on the console (the browser's, or stderr) that something is being tried again.
pub fn warn(message: &str) {
    #[cfg(target_arch = "wasm32")]
    browser::warn(&format!("webgpu-llm: {message}"));
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("webgpu-llm: {message}");
}

#[cfg(target_arch = "wasm32")]
mod browser {
    use wasm_bindgen::prelude::*;

    #[wasm_bindgen]
    extern "C" {
        #[wasm_bindgen(js_name = setTimeout)]
        fn set_timeout(callback: &js_sys::Function, ms: u32) -> JsValue;
        #[wasm_bindgen(js_namespace = console, js_name = warn)]
        pub fn warn(message: &str);
    }

    /// Resolves after `ms` milliseconds.
    pub fn sleep(ms: u32) -> wasm_bindgen_futures::JsFuture {
        let promise = js_sys::Promise::new(&mut |resolve, _| {
            set_timeout(&resolve, ms);
        });
        wasm_bindgen_futures::JsFuture::from(promise)
    }
}
