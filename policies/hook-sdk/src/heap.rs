//! The guest's allocator, built for one-shot calls (feature `allocator`, on
//! by default; `wasm32` only).
//!
//! Every hook call runs in a fresh instance that is thrown away afterwards
//! (policies/HOOKS.md), so an allocator pays only for what one call needs.
//! Rust's default `wasm32` allocator (dlmalloc) takes its first chunk with
//! `memory.grow` on the first allocation of every instance, which the host
//! answers with a resource-limiter call and an `mprotect`, and undoes with
//! another `mprotect` when the slot is reused: a few microseconds per call,
//! more than most hooks spend deciding. This one serves allocations from an
//! arena that is part of the module's initial memory (zero-filled `.bss`, so
//! it costs nothing in the module file) and grows memory only when the arena
//! is used up.
//!
//! Small blocks (up to 4 KiB) are sized in powers of two (16 B and up) and
//! a freed block goes to the free list of its size, so a hook that
//! allocates and frees in a loop reuses memory instead of exhausting it.
//! Larger blocks carry their size in a 16-byte header, are exactly as large
//! as asked (to 16 bytes) and are reused first-fit (a block at most twice
//! the size asked for). Freeing or resizing the block allocated last moves
//! the bump pointer back. Over-aligned requests (more than 16 bytes) are
//! bump-allocated and not reused. Memory is still capped by the class's
//! `memoryMib`: when it cannot grow, allocation fails and the hook traps
//! (`HOOK_OUT_OF_MEMORY`), as before.
//!
//! A hook that wants another allocator turns the feature off
//! (`default-features = false`) and declares its own `#[global_allocator]`.

#![allow(unsafe_code)]

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;

/// The arena in the initial memory; about what a hook with a regex, a JSON
/// config and a few strings uses in one call, several times over.
pub const ARENA_BYTES: usize = 256 * 1024;
const ALIGN: usize = 16;
const MIN_CLASS_LOG2: u32 = 4;
/// Size classes 16 B ..= 4 KiB; larger blocks have a header.
const CLASSES: usize = 9;
const MAX_SMALL: usize = 1 << (MIN_CLASS_LOG2 as usize + CLASSES - 1);
const HEADER: usize = 16;
const WASM_PAGE: usize = 65_536;

/// Where more memory comes from once the arena is used up.
pub trait Grow {
    /// Grows memory by `pages` Wasm pages; returns the old size in pages,
    /// or `None` when refused.
    fn grow(&self, pages: usize) -> Option<usize>;
}

struct State {
    next: usize,
    end: usize,
    /// Head of each small size class's free list (0 = empty); a free block
    /// holds the address of the next one in its first word.
    free: [usize; CLASSES],
    /// Free large blocks, linked the same way; sizes are in their headers.
    large: usize,
}

/// A size-class bump allocator over `[start, end)` plus whatever `G` grows.
pub struct Heap<G> {
    state: UnsafeCell<State>,
    grow: G,
}

// SAFETY: the allocator is used on `wasm32-unknown-unknown`, which runs one
// thread per instance; the native unit tests use one `Heap` per thread.
unsafe impl<G: Sync> Sync for Heap<G> {}

enum Kind {
    /// A power-of-two class: (index, block size).
    Small(usize, usize),
    /// Block size (a multiple of 16) after a header.
    Large(usize),
    /// Aligned above 16: bump only, (size, align).
    Aligned(usize, usize),
}

fn kind(layout: &Layout) -> Option<Kind> {
    let size = layout.size().max(1);
    if layout.align() > ALIGN {
        return Some(Kind::Aligned(align_up(size, ALIGN)?, layout.align()));
    }
    if size <= MAX_SMALL {
        let block = size.next_power_of_two().max(1 << MIN_CLASS_LOG2);
        return Some(Kind::Small(
            (block.trailing_zeros() - MIN_CLASS_LOG2) as usize,
            block,
        ));
    }
    Some(Kind::Large(align_up(size, ALIGN)?))
}

fn align_up(n: usize, align: usize) -> Option<usize> {
    n.checked_add(align - 1).map(|n| n & !(align - 1))
}

/// # Safety
/// `block` is a large block (its header lies just below it).
unsafe fn header(block: usize) -> *mut usize {
    (block - HEADER) as *mut usize
}

impl<G: Grow> Heap<G> {
    /// A heap over `[start, end)` (16-aligned) that grows through `grow`.
    pub const fn new(start: usize, end: usize, grow: G) -> Self {
        Self {
            state: UnsafeCell::new(State {
                next: start,
                end,
                free: [0; CLASSES],
                large: 0,
            }),
            grow,
        }
    }

    #[allow(clippy::mut_from_ref)]
    fn state(&self) -> &mut State {
        // SAFETY: one thread (see the `Sync` impl), and no caller keeps the
        // reference across another call into the heap.
        unsafe { &mut *self.state.get() }
    }

    /// `size` bytes at `align` from the bump region, growing memory if needed.
    fn bump(&self, size: usize, align: usize) -> Option<usize> {
        let s = self.state();
        let start = align_up(s.next, align)?;
        if let Some(end) = start.checked_add(size)
            && end <= s.end
        {
            s.next = end;
            return Some(start);
        }
        // Grow: enough pages for this block wherever the new memory lands.
        let pages = size.checked_add(align)?.div_ceil(WASM_PAGE).max(1);
        let old = self.grow.grow(pages)?;
        let base = old.checked_mul(WASM_PAGE)?;
        if base != s.end {
            // Not adjacent to the current region (the arena sits below the
            // end of memory): start over in the new pages.
            s.next = base;
        }
        s.end = base.checked_add(pages.checked_mul(WASM_PAGE)?)?;
        let start = align_up(s.next, align)?;
        let end = start.checked_add(size)?;
        if end > s.end {
            return None;
        }
        s.next = end;
        Some(start)
    }

    /// A large block of at least `size` bytes: a free one at most twice
    /// that size, or a new one.
    fn large(&self, size: usize) -> Option<usize> {
        let s = self.state();
        let mut link: *mut usize = &mut s.large;
        // SAFETY: the list holds free large blocks, each with a header and
        // its first word as the link.
        unsafe {
            while *link != 0 {
                let block = *link;
                let have = *header(block);
                if have >= size && have / 2 <= size {
                    *link = *(block as *const usize);
                    return Some(block);
                }
                link = block as *mut usize;
            }
            let block = self.bump(HEADER + size, ALIGN)? + HEADER;
            *header(block) = size;
            Some(block)
        }
    }
}

// SAFETY: blocks never overlap: each comes from the bump region once, or
// from a free list it was put on by `dealloc` of a block of that kind.
unsafe impl<G: Grow> GlobalAlloc for Heap<G> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let block = match kind(&layout) {
            None => None,
            Some(Kind::Aligned(size, align)) => self.bump(size, align),
            Some(Kind::Large(size)) => self.large(size),
            Some(Kind::Small(index, size)) => {
                let s = self.state();
                match s.free.get_mut(index) {
                    Some(head) if *head != 0 => {
                        let block = *head;
                        // SAFETY: a free block of at least 16 bytes holds
                        // the next link.
                        *head = unsafe { (block as *const usize).read() };
                        Some(block)
                    }
                    _ => self.bump(size, ALIGN),
                }
            }
        };
        block.map_or(core::ptr::null_mut(), |b| b as *mut u8)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let s = self.state();
        let addr = ptr as usize;
        match kind(&layout) {
            Some(Kind::Aligned(size, _)) if addr + size == s.next => s.next = addr,
            None | Some(Kind::Aligned(..)) => {}
            Some(Kind::Large(_)) => {
                // SAFETY: a large block has a header below it.
                let have = unsafe { *header(addr) };
                if addr + have == s.next {
                    s.next = addr - HEADER;
                } else {
                    // SAFETY: the block is free: its first word is the link.
                    unsafe { ptr.cast::<usize>().write(s.large) };
                    s.large = addr;
                }
            }
            Some(Kind::Small(index, size)) => {
                if addr + size == s.next {
                    s.next = addr;
                } else if let Some(head) = s.free.get_mut(index) {
                    // SAFETY: the block is at least 16 bytes, 16-aligned and
                    // no longer in use: its first word becomes the link.
                    unsafe { ptr.cast::<usize>().write(*head) };
                    *head = addr;
                }
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return core::ptr::null_mut();
        };
        let s = self.state();
        let addr = ptr as usize;
        match (kind(&layout), kind(&new_layout)) {
            (Some(Kind::Small(i, old)), Some(Kind::Small(j, new))) => {
                if i == j {
                    return ptr;
                }
                // The last block: resize it in place.
                if addr + old == s.next && addr + new <= s.end {
                    s.next = addr + new;
                    return ptr;
                }
            }
            (Some(Kind::Large(_)), Some(Kind::Large(new))) => {
                // SAFETY: a large block has a header below it.
                let have = unsafe { *header(addr) };
                if addr + have == s.next && addr + new <= s.end {
                    s.next = addr + new;
                    // SAFETY: as above.
                    unsafe { *header(addr) = new };
                    return ptr;
                }
                if new <= have {
                    return ptr;
                }
            }
            _ => {}
        }
        // SAFETY: as `GlobalAlloc::realloc`'s default: a new block, the
        // contents copied, the old block freed.
        unsafe {
            let new = self.alloc(new_layout);
            if !new.is_null() {
                core::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

#[cfg(all(target_arch = "wasm32", feature = "allocator"))]
mod wasm {
    use super::{ARENA_BYTES, Grow, Heap};
    use core::cell::UnsafeCell;

    #[repr(C, align(16))]
    pub struct Arena(UnsafeCell<[u8; ARENA_BYTES]>);

    // SAFETY: only the heap hands out parts of it, one thread.
    unsafe impl Sync for Arena {}

    pub static ARENA: Arena = Arena(UnsafeCell::new([0; ARENA_BYTES]));

    pub struct MemoryGrow;

    impl Grow for MemoryGrow {
        fn grow(&self, pages: usize) -> Option<usize> {
            let old = core::arch::wasm32::memory_grow(0, pages);
            (old != usize::MAX).then_some(old)
        }
    }

    /// The heap starts empty (`next == end == 0`) and takes the arena on
    /// first use: a `static` cannot hold the arena's address as an integer.
    pub struct Lazy(pub Heap<MemoryGrow>, UnsafeCell<bool>);

    // SAFETY: one thread.
    unsafe impl Sync for Lazy {}

    impl Lazy {
        pub const fn new() -> Self {
            Self(Heap::new(0, 0, MemoryGrow), UnsafeCell::new(false))
        }

        pub fn heap(&self) -> &Heap<MemoryGrow> {
            // SAFETY: one thread; the flag is only read and set here.
            let ready = unsafe { &mut *self.1.get() };
            if !*ready {
                *ready = true;
                let start = ARENA.0.get() as usize;
                let s = self.0.state();
                s.next = start;
                s.end = start + ARENA_BYTES;
            }
            &self.0
        }
    }

    // SAFETY: delegates to `Heap`.
    unsafe impl core::alloc::GlobalAlloc for Lazy {
        unsafe fn alloc(&self, layout: core::alloc::Layout) -> *mut u8 {
            unsafe { self.heap().alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: core::alloc::Layout) {
            unsafe { self.heap().dealloc(ptr, layout) }
        }
        unsafe fn realloc(
            &self,
            ptr: *mut u8,
            layout: core::alloc::Layout,
            new_size: usize,
        ) -> *mut u8 {
            unsafe { self.heap().realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: Lazy = Lazy::new();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A fake linear memory: `pages` of `WASM_PAGE` at a 64 KiB-aligned base.
    struct Fake {
        base: usize,
        pages: Cell<usize>,
        max: usize,
        _buf: Vec<u8>,
    }

    impl Fake {
        fn new(initial: usize, max: usize) -> Self {
            let buf = vec![0u8; (max + 1) * WASM_PAGE];
            let base = align_up(buf.as_ptr() as usize, WASM_PAGE).unwrap();
            Self {
                base,
                pages: Cell::new(initial),
                max,
                _buf: buf,
            }
        }
    }

    /// Grows the fake memory; "page numbers" are relative to address 0, so
    /// the fake reports `base / WASM_PAGE + pages`.
    struct FakeGrow<'a>(&'a Fake);

    impl Grow for FakeGrow<'_> {
        fn grow(&self, pages: usize) -> Option<usize> {
            let f = self.0;
            let old = f.pages.get();
            if old + pages > f.max {
                return None;
            }
            f.pages.set(old + pages);
            Some(f.base / WASM_PAGE + old)
        }
    }

    fn heap(f: &Fake, arena_pages: usize) -> Heap<FakeGrow<'_>> {
        // The "arena" is the first pages, below the end of memory.
        Heap::new(f.base, f.base + arena_pages * WASM_PAGE - 4096, FakeGrow(f))
    }

    fn lay(size: usize) -> Layout {
        Layout::from_size_align(size, 8).unwrap()
    }

    #[test]
    fn blocks_do_not_overlap_and_are_reused_by_class() {
        let f = Fake::new(1, 64);
        let h = heap(&f, 1);
        unsafe {
            let a = h.alloc(lay(24));
            let b = h.alloc(lay(24));
            assert_eq!(b as usize - a as usize, 32);
            a.write_bytes(0xaa, 24);
            b.write_bytes(0xbb, 24);
            assert_eq!(a.read(), 0xaa);
            h.dealloc(a, lay(24));
            // Same class: the freed block comes back.
            assert_eq!(h.alloc(lay(17)), a);
            // The last block is given back to the bump pointer.
            let c = h.alloc(lay(100));
            h.dealloc(c, lay(100));
            assert_eq!(h.alloc(lay(128)), c);
        }
    }

    #[test]
    fn the_last_block_grows_in_place_and_others_move() {
        let f = Fake::new(1, 64);
        let h = heap(&f, 1);
        unsafe {
            let a = h.alloc(lay(16));
            a.write_bytes(7, 16);
            let a2 = h.realloc(a, lay(16), 200);
            assert_eq!(a2, a);
            assert_eq!(a2.add(15).read(), 7);
            let b = h.alloc(lay(16));
            let a3 = h.realloc(a2, lay(200), 1000);
            assert_ne!(a3, a2);
            assert_eq!(a3.read(), 7);
            assert!(a3 as usize >= b as usize + 16);
            // Shrinking keeps the block.
            assert_eq!(h.realloc(a3, lay(1000), 10), a3);
        }
    }

    #[test]
    fn it_grows_past_the_arena_and_fails_at_the_cap() {
        let f = Fake::new(2, 8);
        let h = heap(&f, 1);
        unsafe {
            let big = h.alloc(lay(100_000));
            assert!(!big.is_null());
            // The new block lies in grown memory, past the arena.
            assert!(big as usize >= f.base + 2 * WASM_PAGE);
            big.write_bytes(1, 100_000);
            let more = h.alloc(lay(200_000));
            assert!(!more.is_null());
            more.write_bytes(2, 200_000);
            assert!(h.alloc(lay(300_000)).is_null(), "past the cap");
            // Small blocks still come from what is left.
            assert!(!h.alloc(lay(8)).is_null());
        }
    }

    #[test]
    fn churn_reuses_memory() {
        let f = Fake::new(1, 4);
        let h = heap(&f, 1);
        unsafe {
            for i in 0..100_000usize {
                let a = h.alloc(lay(1 + i % 3000));
                let b = h.alloc(lay(64));
                assert!(!a.is_null() && !b.is_null(), "exhausted at {i}");
                h.dealloc(a, lay(1 + i % 3000));
                h.dealloc(b, lay(64));
            }
            // Large blocks, freed out of order, come back too.
            for i in 0..10_000usize {
                let size = 5000 + (i % 7) * 1000;
                let a = h.alloc(lay(size));
                let b = h.alloc(lay(size + 3000));
                let keep = h.alloc(lay(16));
                assert!(!a.is_null() && !b.is_null(), "exhausted at {i}");
                a.write_bytes(1, size);
                b.write_bytes(2, size + 3000);
                h.dealloc(a, lay(size));
                h.dealloc(b, lay(size + 3000));
                h.dealloc(keep, lay(16));
            }
        }
    }

    #[test]
    fn over_aligned_blocks_are_aligned() {
        let f = Fake::new(1, 4);
        let h = heap(&f, 1);
        unsafe {
            let _ = h.alloc(lay(8));
            let l = Layout::from_size_align(100, 4096).unwrap();
            let p = h.alloc(l);
            assert_eq!(p as usize % 4096, 0);
            h.dealloc(p, l);
        }
    }
}
