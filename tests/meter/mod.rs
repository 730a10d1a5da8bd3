//! A counting global allocator for tests: what a closure allocates on the calling thread (the
//! largest single allocation and the peak of live bytes), with a ceiling above which an
//! allocation fails (the process aborts naming its size) instead of taking the machine's memory.
//! Including this module installs it as the test binary's allocator.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

pub struct Meter;

#[global_allocator]
static METER: Meter = Meter;

/// What one measured closure allocated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// The most bytes live at once, above what was live when the closure started.
    pub peak: usize,
    /// The largest single allocation (or reallocation's new size).
    pub largest: usize,
    /// Bytes still live at the end (what the closure returned or kept).
    pub live: usize,
}

#[derive(Clone, Copy)]
struct State {
    armed: bool,
    live: isize,
    peak: isize,
    largest: usize,
    ceiling: usize,
}

thread_local! {
    static STATE: Cell<State> =
        const { Cell::new(State { armed: false, live: 0, peak: 0, largest: 0, ceiling: usize::MAX }) };
}

/// Records `grow` more live bytes (negative: freed) from an allocation of `size` bytes; false when
/// the size is over the ceiling and the allocation must fail.
fn record(grow: isize, size: usize) -> bool {
    STATE
        .try_with(|cell| {
            let mut s = cell.get();
            if !s.armed {
                return true;
            }
            if size > s.ceiling {
                return false;
            }
            s.live += grow;
            s.peak = s.peak.max(s.live);
            s.largest = s.largest.max(size);
            cell.set(s);
            true
        })
        .unwrap_or(true)
}

unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !record(layout.size() as isize, layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !record(layout.size() as isize, layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        record(-(layout.size() as isize), 0);
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !record(new_size as isize - layout.size() as isize, new_size) {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }
}

/// Runs `f` and returns what it allocated on this thread; any single allocation over `ceiling`
/// bytes fails, which aborts the test binary with the allocation's size.
pub fn measure<R>(ceiling: usize, f: impl FnOnce() -> R) -> (R, Usage) {
    STATE.with(|cell| cell.set(State { armed: true, live: 0, peak: 0, largest: 0, ceiling }));
    let result = f();
    let s = STATE.with(|cell| {
        let s = cell.get();
        cell.set(State { armed: false, ..s });
        s
    });
    (result, Usage { peak: s.peak.max(0) as usize, largest: s.largest, live: s.live.max(0) as usize })
}
