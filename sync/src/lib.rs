//! Locks that ignore poisoning, for every crate of the workspace.
//!
//! std's `Mutex` and `RwLock` are poisoned when a thread panics while
//! holding them, and every later `lock()` returns an error. In Tessera a
//! panic is a bug that is caught and reported where it happened (a
//! handler's panic is answered `Internal`, a task's is logged), and every
//! lock guards state that each critical section leaves consistent: an
//! insert or a removal, a counter, a whole entry replaced. Treating
//! poisoning as fatal would turn one failed call into the failure of every
//! later call that touches the same lock; so every lock is taken through
//! these helpers, which take the guard either way, instead of a copy of
//! `unwrap_or_else(PoisonError::into_inner)` at each site (there were 98,
//! and four local `fn lock`s).
//!
//! (`parking_lot`'s locks do not poison at all; std's are kept to avoid a
//! second lock implementation beside tokio's and std's.)
//!
//! ```
//! use std::sync::Mutex;
//! use tessera_sync::LockExt;
//!
//! let counter = Mutex::new(0);
//! *counter.locked() += 1;
//! assert_eq!(*counter.locked(), 1);
//! ```

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `mutex`, poisoned or not (module docs).
pub fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `Mutex::locked`: [`lock`] as a method.
pub trait LockExt<T: ?Sized> {
    /// Locks, poisoned or not (module docs).
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        lock(self)
    }
}

/// `RwLock::read_locked` and `write_locked`, poisoned or not.
pub trait RwLockExt<T: ?Sized> {
    /// Takes the lock shared, poisoned or not (module docs).
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    /// Takes the lock exclusive, poisoned or not (module docs).
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_still_taken() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let rw = std::sync::Arc::new(RwLock::new(2));
        let (m, r) = (mutex.clone(), rw.clone());
        let _ = std::thread::spawn(move || {
            let _a = m.lock().unwrap();
            let _b = r.write().unwrap();
            panic!("poison both");
        })
        .join();
        assert!(mutex.is_poisoned() && rw.is_poisoned());
        *mutex.locked() += 1;
        *rw.write_locked() += 1;
        assert_eq!(*lock(&mutex), 2);
        assert_eq!(*rw.read_locked(), 3);
    }
}
