//! Shared memory for the soft NIC: memfd-backed mappings that another
//! process can map too, once it holds the file descriptor.
//!
//! Everything a peer's soft NIC touches lives in such mappings — registered
//! pool memory, receive queues, completion queues, the table of registered
//! regions — so a WRITE from another process really lands in this
//! process's memory without this process's CPU taking part, as with a NIC.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

/// A shared mapping of a whole memfd.
#[derive(Debug)]
pub(crate) struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory, valid until drop; what is stored in
// it is accessed through atomics (or, for pool memory, under the ownership
// rules of the transport), so sharing the handle between threads is sound.
unsafe impl Send for SharedMapping {}
// SAFETY: as above.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// A new zero-filled memfd of `len` bytes, mapped.
    pub(crate) fn create(name: &str, len: usize) -> io::Result<Self> {
        let fd = crate::pool::os::memfd(name, len)?;
        Self::map(fd, len)
    }

    /// Maps all of `fd` (a memfd another process created); its length is
    /// the file's.
    pub(crate) fn open(fd: OwnedFd) -> io::Result<Self> {
        // SAFETY: an all-zero `stat` is a valid value for fstat to fill.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is an open descriptor and `stat` a valid out pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let len = usize::try_from(stat.st_size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "negative file size"))?;
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        // SAFETY: a shared mapping of an open file with no address hint has
        // no preconditions; the result is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null pointer"))?;
        Ok(Self { ptr, len, fd })
    }

    /// First byte.
    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The memfd (to hand to a peer).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: the range was mapped in `map` and nothing refers to it
        // once its owner is dropped (views borrow the mapping).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Raises this process's open-file limit to its hard limit: every pool
/// block and queue of the soft NIC is a memfd kept open to be handed to
/// peers.
pub(crate) fn raise_open_file_limit() {
    // SAFETY: an all-zero rlimit is a valid value for getrlimit to fill.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `limit` is a valid out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0
        && limit.rlim_cur < limit.rlim_max
    {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: `limit` is a valid rlimit read just above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    }
}
