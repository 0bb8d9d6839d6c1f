//! Memory straight from the kernel: anonymous private mappings.
//!
//! The pool maps its blocks itself instead of going through the global
//! allocator: it can align a block to its own size (which makes finding a
//! block from an object pointer a mask), and an anonymous mapping is
//! zero-filled lazily, page by page, so with TCP (no registration) a fresh
//! 4 MiB block costs no resident memory until it is written. With a real
//! RNIC it does: `ibv_reg_mr` pins every page of the block at registration,
//! so a registered block is resident, and counts against `RLIMIT_MEMLOCK`,
//! from then on (see `verbs::memlock`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// Maps `len` bytes aligned to `align` (both multiples of the page size,
/// `align` a power of two). The memory reads as zeros.
pub(crate) fn map_aligned(len: usize, align: usize) -> Option<NonNull<u8>> {
    let over = len.checked_add(align)?;
    // SAFETY: an anonymous private mapping with no address hint has no
    // preconditions; the result is checked against MAP_FAILED.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(align);
    let head = aligned - start;
    let tail = over - head - len;
    if head > 0 {
        // SAFETY: [start, aligned) is the unused head of the mapping made
        // above; nothing refers to it.
        unsafe { libc::munmap(raw, head) };
    }
    if tail > 0 {
        // SAFETY: [aligned + len, start + over) is the unused tail of the
        // same mapping.
        unsafe { libc::munmap((aligned + len) as *mut libc::c_void, tail) };
    }
    NonNull::new(aligned as *mut u8)
}

/// Unmaps memory returned by [`map_aligned`] with the same `len`.
pub(crate) fn unmap(ptr: usize, len: usize) {
    // SAFETY: callers pass a range obtained from `map_aligned` that no
    // buffer refers to any more.
    unsafe { libc::munmap(ptr as *mut libc::c_void, len) };
}

/// A memfd of `len` zero bytes (memory another process can map once it
/// holds the descriptor).
pub(crate) fn memfd(name: &str, len: usize) -> std::io::Result<OwnedFd> {
    use std::io;
    let name =
        std::ffi::CString::new(name).map_err(|_| io::Error::other("memfd name with a NUL byte"))?;
    // SAFETY: `name` is a valid NUL-terminated string.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let size = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "memfd too large"))?;
    // SAFETY: `fd` is an open memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Like [`map_aligned`], but the memory is a shared mapping of a fresh
/// memfd, returned with it (for providers that share registered memory with
/// other processes). Released with [`unmap`].
pub(crate) fn map_shared_aligned(len: usize, align: usize) -> Option<(NonNull<u8>, OwnedFd)> {
    let fd = memfd("tessera-pool", len).ok()?;
    let reserved = map_aligned(len, align)?;
    // SAFETY: MAP_FIXED over the range reserved just above (ours alone)
    // replaces it with a shared mapping of the memfd, which is `len` long.
    let raw = unsafe {
        libc::mmap(
            reserved.as_ptr().cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        unmap(reserved.as_ptr() as usize, len);
        return None;
    }
    Some((reserved, fd))
}
