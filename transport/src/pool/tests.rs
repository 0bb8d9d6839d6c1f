use std::sync::Arc;

use proptest::prelude::*;

use super::*;

fn pool_with(config: PoolConfig, access: Access) -> (Pool, Arc<CountingHook>) {
    let hook = Arc::new(CountingHook::new());
    let pool = Pool::new(config, access, hook.clone()).unwrap();
    (pool, hook)
}

fn pool() -> (Pool, Arc<CountingHook>) {
    pool_with(PoolConfig::named("test"), Access::LocalOnly)
}

fn check_lookup(buf: &PoolBuf, offset: usize) {
    let address = buf.as_ptr() as usize + offset;
    let info = lookup(&buf[offset..]).unwrap_or_else(|| panic!("no region for offset {offset}"));
    assert!(
        info.base <= address && address < info.base + info.len,
        "offset {offset}: {info:?}"
    );
    assert_eq!(Some(info), buf.region());
    assert_eq!(info.pool_id, buf.pool_id());
}

#[test]
fn extremes_allocate_and_are_writable() {
    let (pool, _) = pool();
    for len in [
        0usize,
        1,
        15,
        16,
        17,
        4096,
        1 << 20,
        (1 << 20) + 1,
        256 << 20,
    ] {
        let mut buf = pool.alloc(len).unwrap();
        assert_eq!(buf.len(), len);
        assert!(buf.capacity() >= len);
        if len > 0 {
            buf[0] = 0xab;
            assert_eq!(buf[0], 0xab);
            buf[len - 1] = 0xcd;
            assert_eq!(buf[len - 1], 0xcd);
            check_lookup(&buf, 0);
            check_lookup(&buf, len - 1);
        }
    }
}

#[test]
fn lookup_finds_the_region_of_every_byte() {
    let (pool, _) = pool();
    let bufs: Vec<PoolBuf> = [1usize, 100, 4096, 70_000]
        .iter()
        .map(|&n| pool.alloc(n).unwrap())
        .collect();
    for buf in &bufs {
        for offset in 0..buf.len() {
            check_lookup(buf, offset);
        }
    }
    let big = pool.alloc(3 << 20).unwrap();
    for offset in (0..big.len()).step_by(997).chain([big.len() - 1]) {
        check_lookup(&big, offset);
    }
    assert!(
        lookup(&[0u8; 16]).is_none(),
        "stack memory is not pool memory"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn any_size_allocates_writes_and_looks_up(exp in 0u32..28, frac in 0.0f64..1.0, probe in any::<prop::sample::Index>()) {
        // Log-uniform sizes from 1 byte to 256 MiB.
        let len = ((2f64.powi(exp as i32) * (1.0 + frac)) as usize).clamp(1, 256 << 20);
        let (pool, _) = pool();
        let mut buf = pool.alloc(len).unwrap();
        let offset = probe.index(len);
        buf[offset] = 7;
        prop_assert_eq!(buf[offset], 7);
        check_lookup(&buf, offset);
        prop_assert!(buf.capacity() >= len);
    }
}

#[test]
fn distinct_live_buffers_never_overlap() {
    let (pool, _) = pool();
    let mut bufs: Vec<PoolBuf> = (0..2000)
        .map(|i| pool.alloc(1 + (i * 37) % 5000).unwrap())
        .collect();
    for (i, buf) in bufs.iter_mut().enumerate() {
        buf.fill((i % 251) as u8);
    }
    for (i, buf) in bufs.iter().enumerate() {
        assert!(
            buf.iter().all(|&b| b == (i % 251) as u8),
            "buffer {i} was overwritten"
        );
    }
}

#[test]
fn frees_on_other_threads_return_to_the_pool() {
    let (pool, _) = pool();
    let bufs: Vec<PoolBuf> = (0..1000)
        .map(|i| pool.alloc(16 + i % 3000).unwrap())
        .collect();
    let bytes: Vec<bytes::Bytes> = (0..100)
        .map(|_| pool.alloc(2 << 20).unwrap().freeze())
        .collect();
    pool.flush_thread_cache();
    assert!(pool.stats().in_use_bytes > 0);
    std::thread::spawn(move || {
        drop(bufs);
        drop(bytes);
    })
    .join()
    .unwrap();
    pool.flush_thread_cache();
    assert_eq!(pool.stats().in_use_bytes, 0);
}

#[test]
fn pools_isolate_access_rights_and_hooks() {
    let (send, send_hook) = pool_with(PoolConfig::named("send"), Access::LocalOnly);
    let (recv, recv_hook) = pool_with(PoolConfig::named("recv"), Access::RemoteWrite);
    let a = send.alloc(4096).unwrap();
    let b = recv.alloc(4096).unwrap();
    let (ra, rb) = (a.region().unwrap(), b.region().unwrap());
    assert_eq!(ra.access, Access::LocalOnly);
    assert!(
        !ra.access.allows_remote_write(),
        "a peer may never write into the send pool"
    );
    assert_eq!(rb.access, Access::RemoteWrite);
    assert_ne!(ra.pool_id, rb.pool_id);
    assert_eq!(
        (send_hook.registrations(), recv_hook.registrations()),
        (1, 1)
    );
    assert_ne!(send.id(), recv.id());
}

#[test]
fn ceiling_refuses_growth_with_an_error() {
    let config = PoolConfig {
        max_registered_bytes: 8 << 20,
        ..PoolConfig::named("small")
    };
    let (pool, _) = pool_with(config, Access::LocalOnly);
    let mut held = Vec::new();
    let err = loop {
        match pool.alloc(512 << 10) {
            Ok(buf) => held.push(buf),
            Err(err) => break err,
        }
        assert!(held.len() < 100, "the ceiling never applied");
    };
    assert!(
        matches!(err, PoolError::CeilingExceeded { ceiling, .. } if ceiling == 8 << 20),
        "{err}"
    );
    assert!(pool.stats().registered_bytes <= 8 << 20);
    assert!(matches!(
        pool.alloc(9 << 20),
        Err(PoolError::CeilingExceeded { .. })
    ));
    // Freeing makes room again.
    held.clear();
    pool.flush_thread_cache();
    assert!(pool.alloc(512 << 10).is_ok());
}

#[test]
fn steady_state_registers_nothing_and_trim_deregisters_everything() {
    let (pool, hook) = pool();
    // A working set of class objects and dedicated mappings (80 MiB of them,
    // within the 256 MiB dedicated cache).
    let sizes: Vec<usize> = [16usize, 200, 3000, 64 << 10, 900 << 10]
        .iter()
        .flat_map(|&n| std::iter::repeat_n(n, 30))
        .chain(std::iter::repeat_n(3 << 20, 4))
        .chain(std::iter::repeat_n(17 << 20, 4))
        .collect();
    let mut registrations_after = Vec::new();
    for _round in 0..10 {
        let bufs: Vec<PoolBuf> = sizes.iter().map(|&n| pool.alloc(n).unwrap()).collect();
        drop(bufs);
        registrations_after.push(hook.registrations());
    }
    assert!(registrations_after[0] > 0);
    assert!(
        registrations_after.windows(2).all(|w| w[0] == w[1]),
        "registrations kept growing: {registrations_after:?}"
    );
    assert_eq!(pool.stats().registrations, hook.registrations());
    pool.flush_thread_cache();
    assert_eq!(pool.stats().in_use_bytes, 0);
    let released = pool.trim();
    assert!(released > 0);
    assert_eq!(pool.stats().registered_bytes, 0);
    assert_eq!(hook.registrations(), hook.deregistrations());
    assert_eq!(hook.registered_bytes(), 0);
}

#[test]
fn frozen_bytes_share_the_buffer_and_return_it_when_dropped() {
    let (pool, _) = pool();
    let mut buf = pool.alloc(1000).unwrap();
    buf.fill(9);
    let address = buf.as_ptr() as usize;
    let bytes = buf.freeze();
    let slice = bytes.slice(10..20);
    assert_eq!(bytes.as_ptr() as usize, address);
    assert_eq!(lookup(&slice[..]).map(|r| r.pool_id), Some(pool.id()));
    drop(bytes);
    drop(slice);
    pool.flush_thread_cache();
    assert_eq!(pool.stats().in_use_bytes, 0);
}

#[test]
fn dropping_the_pool_handle_keeps_live_buffers_valid() {
    let (pool, hook) = pool();
    let mut buf = pool.alloc(100).unwrap();
    drop(pool);
    buf.fill(1);
    assert!(buf.iter().all(|&b| b == 1));
    drop(buf);
    assert_eq!(
        hook.registrations(),
        hook.deregistrations(),
        "the last buffer released the pool"
    );
}

#[test]
fn invalid_configs_name_their_key() {
    for (config, key) in [
        (
            PoolConfig {
                block_size: 3 << 20,
                ..PoolConfig::default()
            },
            "block_size",
        ),
        (
            PoolConfig {
                max_class_size: 4 << 20,
                ..PoolConfig::default()
            },
            "max_class_size",
        ),
        (
            PoolConfig {
                max_registered_bytes: 1,
                ..PoolConfig::default()
            },
            "max_registered_bytes",
        ),
    ] {
        let err = Pool::new(config, Access::LocalOnly, Arc::new(CountingHook::new())).unwrap_err();
        assert_eq!(err.key(), Some(key));
    }
}

#[test]
fn a_dropped_pool_releases_memory_cached_by_other_threads_when_they_exit() {
    let (pool, hook) = pool();
    let bufs: Vec<PoolBuf> = (0..100).map(|_| pool.alloc(1000).unwrap()).collect();
    let (freed, wait_freed) = std::sync::mpsc::channel::<()>();
    let (go, wait_go) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        // Freed here, so the objects sit in this thread's cache...
        drop(bufs);
        freed.send(()).unwrap();
        wait_go.recv().unwrap();
    });
    wait_freed.recv().unwrap();
    drop(pool);
    assert!(hook.registered_bytes() > 0, "...which keeps their block");
    go.send(()).unwrap();
    worker.join().unwrap();
    assert_eq!(
        hook.registered_bytes(),
        0,
        "the exiting thread's flush released it"
    );
    assert_eq!(hook.registrations(), hook.deregistrations());
}

/// Refuses every registration.
#[derive(Debug)]
struct Refusing;

impl RegistrationHook for Refusing {
    fn register(
        &self,
        _addr: usize,
        len: usize,
        _access: Access,
    ) -> Result<RegisteredRegion, RegistrationError> {
        Err(RegistrationError {
            len,
            cause: RegistrationCause::Kernel { errno: 12 },
        })
    }

    fn deregister(&self, _addr: usize, _len: usize, _region: &RegisteredRegion) {
        unreachable!("nothing was registered");
    }
}

#[test]
fn a_pool_on_rails_registers_on_each_and_unwinds_a_refusal() {
    let (first, second) = (Arc::new(CountingHook::new()), Arc::new(CountingHook::new()));
    let pool = Pool::on_rails(
        PoolConfig::named("two-rails"),
        Access::RemoteWrite,
        vec![first.clone(), second.clone()],
    )
    .unwrap();
    let buf = pool.alloc(1000).unwrap();
    assert_eq!((first.registrations(), second.registrations()), (1, 1));
    let (on0, on1) = (buf.region_on(0).unwrap(), buf.region_on(1).unwrap());
    assert_eq!(buf.region(), Some(on0));
    assert_eq!((on0.base, on0.len), (on1.base, on1.len));
    assert_eq!(lookup_on(&buf, 1), Some(on1));
    assert_eq!(buf.region_on(2), None);
    drop(buf);
    pool.flush_thread_cache();
    pool.trim();
    assert_eq!((first.deregistrations(), second.deregistrations()), (1, 1));

    // The second rail refuses: the first's registration is taken back and
    // the allocation fails with the refusal.
    let lone = Arc::new(CountingHook::new());
    let pool = Pool::on_rails(
        PoolConfig::named("refused-rail"),
        Access::RemoteWrite,
        vec![lone.clone(), Arc::new(Refusing)],
    )
    .unwrap();
    assert!(matches!(pool.alloc(1000), Err(PoolError::Registration(_))));
    assert_eq!((lone.registrations(), lone.deregistrations()), (1, 1));
    assert_eq!(pool.stats().registered_bytes, 0);

    // No rails, or more than a pool registers on, is a configuration error.
    for hooks in [
        Vec::new(),
        vec![lone.clone() as Arc<dyn RegistrationHook>; MAX_RAILS + 1],
    ] {
        let err = Pool::on_rails(PoolConfig::named("none"), Access::LocalOnly, hooks).unwrap_err();
        assert_eq!(err.key(), Some("rdma.devices"));
    }
}

/// A pool's hooks (and the devices they hold) go once the pool is dropped
/// and its last region released, not with the process: the pool's shared
/// state is leaked by design, and before, the hooks with it, so every
/// pool ever made kept its devices open (the soft NIC's memory mappings
/// ran out after a few thousand transports in one process).
#[test]
fn a_dropped_pool_lets_go_of_its_hooks_once_its_buffers_are_back() {
    let (pool, hook) = pool();
    let inner = pool.inner();
    let buf = pool.alloc(4096).unwrap();
    let big = pool.alloc(8 << 20).unwrap();
    drop(pool);
    assert_eq!(inner.hook_count(), 1, "a buffer outlives the pool");
    drop(big);
    assert_eq!(inner.hook_count(), 1);
    // A closed pool's objects go straight back as they are freed.
    drop(buf);
    assert_eq!(inner.hook_count(), 0, "the closed pool kept its hooks");
    assert_eq!(Arc::strong_count(&hook), 1);
    assert_eq!(hook.registrations(), hook.deregistrations());
}
