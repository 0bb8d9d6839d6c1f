//! Thread domains: a QP of its own doorbell, without libibverbs' locks,
//! reached through the extended verbs as verbs.h reaches them.

#[allow(clippy::wildcard_imports)]
use super::*;

/// A thread domain and the parent domain that puts the protection domain
/// and it together (§6.2: a QP created on it has its own doorbell and
/// skips libibverbs' locks, so I/O threads do not contend).
#[derive(Debug)]
pub(super) struct ThreadDomain {
    pub(super) td: *mut ibv_td,
    pub(super) parent: *mut ibv_pd,
}

impl ThreadDomain {
    /// A thread domain on `ctx`, or `None` where the device has none.
    pub(super) fn allocate(ctx: &Context) -> Option<Self> {
        // SAFETY: plain data; zeroed (comp_mask 0) is the default request.
        let mut td_attr: ibv_td_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open; `extended::alloc_td` finds the
        // operation as verbs.h does, or says the provider lacks it.
        let td = unsafe { extended::alloc_td(ctx.ctx, &mut td_attr) }?;
        // SAFETY: plain data; pd and td are set, no allocator callbacks.
        let mut pd_attr: ibv_parent_domain_init_attr = unsafe { std::mem::zeroed() };
        pd_attr.pd = ctx.pd;
        pd_attr.td = td;
        // SAFETY: the PD and TD are alive and `pd_attr` is fully set.
        let parent = unsafe { extended::alloc_parent_domain(ctx.ctx, &mut pd_attr) };
        match parent {
            Some(parent) => Some(Self { td, parent }),
            None => {
                // SAFETY: `td` was allocated above and is used by nothing.
                unsafe { extended::dealloc_td(td) };
                None
            }
        }
    }
}

/// The extended verbs (thread and parent domains), reached as verbs.h's
/// inline functions reach them. rdma-sys 0.3's own `verbs_get_ctx`
/// compares `abi_compat` with `u32::MAX` where libibverbs stores
/// `UINTPTR_MAX` (`__VERBS_ABI_IS_EXTENDED`), so through it every extended
/// verb reported "not supported" and no QP ever got a thread domain.
pub(super) mod extended {
    use rdma_sys::*;

    /// The `verbs_context` that `ctx` is the last field of, if the library
    /// made an extended one, and it is large enough to hold the field at
    /// `field_offset`.
    ///
    /// # Safety
    /// `ctx` is an open context.
    unsafe fn context(ctx: *mut ibv_context, field_offset: usize) -> Option<*mut verbs_context> {
        // SAFETY: the caller's context is valid to read.
        if unsafe { (*ctx).abi_compat } as usize != usize::MAX {
            return None;
        }
        let offset = std::mem::offset_of!(verbs_context, context);
        // SAFETY: an extended context is embedded as the last field of a
        // `verbs_context` (container_of in verbs.h), `offset` bytes in.
        let vctx = unsafe { ctx.cast::<u8>().sub(offset) }.cast::<verbs_context>();
        // `sz` counts the bytes of the structure the library filled, from
        // its end backwards (older libraries have fewer leading fields).
        // SAFETY: `sz` is the field right before `context`, always present.
        let size = unsafe { (*vctx).sz };
        (size >= std::mem::size_of::<verbs_context>() - field_offset).then_some(vctx)
    }

    /// `ibv_alloc_td`: `None` where the provider has no thread domains.
    ///
    /// # Safety
    /// `ctx` is an open context and `attr` a valid attribute block.
    pub(super) unsafe fn alloc_td(
        ctx: *mut ibv_context,
        attr: *mut ibv_td_init_attr,
    ) -> Option<*mut ibv_td> {
        // SAFETY: as the caller promises.
        let vctx = unsafe { context(ctx, std::mem::offset_of!(verbs_context, alloc_td)) }?;
        // SAFETY: `vctx` is the library's, holding this field (checked).
        let op = unsafe { (*vctx).alloc_td }?;
        // SAFETY: the provider's own entry point, called as verbs.h does.
        let td = unsafe { op(ctx, attr) };
        (!td.is_null()).then_some(td)
    }

    /// `ibv_alloc_parent_domain`: `None` where the provider has none.
    ///
    /// # Safety
    /// `ctx` is an open context and `attr` a valid attribute block.
    pub(super) unsafe fn alloc_parent_domain(
        ctx: *mut ibv_context,
        attr: *mut ibv_parent_domain_init_attr,
    ) -> Option<*mut ibv_pd> {
        // SAFETY: as the caller promises.
        let vctx = unsafe {
            context(
                ctx,
                std::mem::offset_of!(verbs_context, alloc_parent_domain),
            )
        }?;
        // SAFETY: `vctx` is the library's, holding this field (checked).
        let op = unsafe { (*vctx).alloc_parent_domain }?;
        // SAFETY: the provider's own entry point, called as verbs.h does.
        let pd = unsafe { op(ctx, attr) };
        (!pd.is_null()).then_some(pd)
    }

    /// `ibv_dealloc_td`.
    ///
    /// # Safety
    /// `td` was allocated by [`alloc_td`] and is used by nothing.
    pub(super) unsafe fn dealloc_td(td: *mut ibv_td) {
        // SAFETY: a live thread domain knows its context.
        let ctx = unsafe { (*td).context };
        // SAFETY: the context is open while the domain lives.
        let Some(vctx) = (unsafe { context(ctx, std::mem::offset_of!(verbs_context, dealloc_td)) })
        else {
            return;
        };
        // SAFETY: `vctx` is the library's, holding this field (checked).
        if let Some(op) = unsafe { (*vctx).dealloc_td } {
            // SAFETY: the provider's own entry point, for its own domain.
            unsafe { op(td) };
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// What the test provider's `alloc_td` hands out.
        const SENTINEL: usize = 0x7d00;

        unsafe extern "C" fn fake_alloc_td(
            _ctx: *mut ibv_context,
            _attr: *mut ibv_td_init_attr,
        ) -> *mut ibv_td {
            SENTINEL as *mut ibv_td
        }

        /// The lookup verbs.h does, on a context laid out as libibverbs
        /// lays one out: found where `abi_compat` is `UINTPTR_MAX` (what
        /// rdma-sys's check, against `u32::MAX`, never finds on 64-bit
        /// hosts), refused for a context too small to hold the field.
        #[test]
        fn extended_verbs_are_found_as_verbs_h_finds_them() {
            // SAFETY: plain data; zeroed is a valid value (null pointers,
            // no functions).
            let mut vctx: Box<verbs_context> = Box::new(unsafe { std::mem::zeroed() });
            vctx.sz = std::mem::size_of::<verbs_context>();
            vctx.alloc_td = Some(fake_alloc_td);
            vctx.context.abi_compat = usize::MAX as *mut libc::c_void;
            let ctx: *mut ibv_context = &mut vctx.context;
            // SAFETY: plain data; zeroed is the default request.
            let mut attr: ibv_td_init_attr = unsafe { std::mem::zeroed() };
            // SAFETY: `ctx` points into a live, fully laid out context.
            let td = unsafe { alloc_td(ctx, &mut attr) };
            assert_eq!(td.map(|p| p as usize), Some(SENTINEL));
            // rdma-sys's own finds nothing on the very same context (what
            // the provider called before).
            // SAFETY: as above.
            let theirs = unsafe { rdma_sys::ibv_alloc_td(ctx, &mut attr) };
            assert!(theirs.is_none_or(|p| p.is_null()));
            vctx.context.abi_compat = u32::MAX as usize as *mut libc::c_void;
            let ctx: *mut ibv_context = &mut vctx.context;
            // SAFETY: as above.
            assert!(unsafe { alloc_td(ctx, &mut attr) }.is_none());
            vctx.context.abi_compat = usize::MAX as *mut libc::c_void;
            vctx.sz = 16;
            let ctx: *mut ibv_context = &mut vctx.context;
            // SAFETY: as above.
            assert!(unsafe { alloc_td(ctx, &mut attr) }.is_none());
        }
    }
}

impl Drop for ThreadDomain {
    fn drop(&mut self) {
        // SAFETY: dropped after the QP created on the parent domain was
        // destroyed (field order in `IbvQp`'s drop), parent before TD.
        unsafe {
            ibv_dealloc_pd(self.parent);
            extended::dealloc_td(self.td);
        }
    }
}
