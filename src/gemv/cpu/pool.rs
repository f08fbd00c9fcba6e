//! A small spinning thread pool for the single-token CPU GEMVs.
//!
//! A decode step runs ~120 GEMVs of 30–350 µs each. With rayon, every one of them wakes
//! the sleeping workers through a futex (an IPI on a VM: tens of µs, often more than the
//! split saves). Here `threads − 1` helpers spin on an atomic ticket for a while
//! ([`SPIN`]) after their last task, so back-to-back GEMVs find them awake, and park on
//! a condition variable once the process goes quiet.
//!
//! Protocol: the caller writes the job, then publishes `ticket = (epoch << 32) | tasks`
//! (Release). A helper claims a task by decrementing the low half with a CAS that also
//! checks the epoch (Acquire), so it only ever reads a job whose task it holds; the
//! caller takes tasks the same way and returns once `done == tasks`, so the job outlives
//! every claimed task. One caller at a time (a `try_lock`); a second concurrent caller,
//! or a pool of another size, gets `None` and uses rayon.

use candle_core::Result;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins before it parks.
const SPIN: Duration = Duration::from_millis(3);

/// The job: `f(task)` for `task < tasks`, the lifetime erased (see the module docs).
type Job = *const (dyn Fn(usize) -> Result<()> + Sync);

struct Shared {
    /// `(epoch << 32) | tasks not yet claimed`.
    ticket: AtomicU64,
    /// Tasks finished in the current epoch.
    done: AtomicUsize,
    /// Written by the caller between epochs only; read by holders of a claimed task.
    job: UnsafeCell<Option<Job>>,
    /// The first error of the current epoch.
    error: Mutex<Option<candle_core::Error>>,
    /// Parked helpers.
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the one caller (under `Pool::caller`) while no task of
// the epoch can be claimed, and read only by threads holding a claimed task, after the
// Acquire CAS that pairs with the caller's Release publication of the ticket.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// A pool of `threads − 1` spinning helpers (the caller is the last thread).
pub(super) struct Pool {
    threads: usize,
    shared: &'static Shared,
    caller: Mutex<()>,
}

impl Shared {
    /// Claims one task of `epoch`, if any is left.
    fn claim(&self, epoch: u64) -> Option<usize> {
        let mut cur = self.ticket.load(Ordering::Acquire);
        loop {
            if cur >> 32 != epoch || cur & 0xFFFF_FFFF == 0 {
                return None;
            }
            match self.ticket.compare_exchange_weak(
                cur,
                cur - 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some((cur & 0xFFFF_FFFF) as usize - 1),
                Err(now) => cur = now,
            }
        }
    }

    /// Runs the claimed `task` of the current job and counts it done.
    fn run(&self, task: usize) {
        // SAFETY: `task` is claimed and not yet counted done, so the caller is still in
        // `run_tasks` and the job it points to is alive (module docs).
        let job = unsafe { (*self.job.get()).map(|j| &*j) };
        let r = match job {
            Some(f) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(task)))
                .unwrap_or_else(|_| Err(candle_core::Error::Msg("gemv task panicked".into()))),
            None => Err(candle_core::Error::Msg("gemv pool: no job".into())),
        };
        if let Err(e) = r {
            if let Ok(mut slot) = self.error.lock() {
                slot.get_or_insert(e);
            }
        }
        self.done.fetch_add(1, Ordering::Release);
    }

    fn helper(&self) {
        let mut seen = self.ticket.load(Ordering::Acquire) >> 32;
        loop {
            // Spin until a new epoch, then park.
            let t0 = Instant::now();
            let mut spins = 0u32;
            let epoch = loop {
                let e = self.ticket.load(Ordering::Acquire) >> 32;
                if e != seen {
                    break e;
                }
                std::hint::spin_loop();
                spins += 1;
                if spins.is_multiple_of(64) {
                    // Let other runnable threads of this core (rayon's workers, which the
                    // CPU attention wakes every layer) run instead of waiting a time slice.
                    std::thread::yield_now();
                }
                if spins.is_multiple_of(1024) && t0.elapsed() > SPIN {
                    let Ok(mut g) = self.park.lock() else {
                        return;
                    };
                    self.sleepers.fetch_add(1, Ordering::SeqCst);
                    while self.ticket.load(Ordering::SeqCst) >> 32 == seen {
                        g = match self.wake.wait(g) {
                            Ok(g) => g,
                            Err(_) => return,
                        };
                    }
                    self.sleepers.fetch_sub(1, Ordering::SeqCst);
                    break self.ticket.load(Ordering::Acquire) >> 32;
                }
            };
            seen = epoch;
            while let Some(task) = self.claim(epoch) {
                self.run(task);
            }
        }
    }
}

impl Pool {
    /// The process-wide pool, sized by rayon's thread count at its first use; `None`
    /// when that count is 1 or a helper cannot be started.
    pub(super) fn global() -> Option<&'static Pool> {
        static POOL: OnceLock<Option<Pool>> = OnceLock::new();
        POOL.get_or_init(|| {
            let threads = rayon::current_num_threads();
            if threads < 2 {
                return None;
            }
            let shared: &'static Shared = Box::leak(Box::new(Shared {
                ticket: AtomicU64::new(0),
                done: AtomicUsize::new(0),
                job: UnsafeCell::new(None),
                error: Mutex::new(None),
                sleepers: AtomicUsize::new(0),
                park: Mutex::new(()),
                wake: Condvar::new(),
            }));
            for i in 1..threads {
                std::thread::Builder::new()
                    .name(format!("candle-fp4-gemv-{i}"))
                    .spawn(move || shared.helper())
                    .ok()?;
            }
            Some(Pool {
                threads,
                shared,
                caller: Mutex::new(()),
            })
        })
        .as_ref()
    }

    /// Threads that run tasks (helpers + the caller).
    pub(super) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0..tasks)` on the helpers and the calling thread; `None` when the pool is
    /// busy with another caller (then nothing ran).
    pub(super) fn run_tasks(
        &self,
        tasks: usize,
        f: &(dyn Fn(usize) -> Result<()> + Sync),
    ) -> Option<Result<()>> {
        if tasks == 0 || tasks > u32::MAX as usize {
            return Some(if tasks == 0 {
                Ok(())
            } else {
                Err(candle_core::Error::Msg("gemv pool: too many tasks".into()))
            });
        }
        let _guard = self.caller.try_lock().ok()?;
        let s = self.shared;
        let epoch = (s.ticket.load(Ordering::Acquire) >> 32) + 1;
        // SAFETY: only this caller writes `job`, and no task can be claimed now: the
        // previous epoch's are all done and the new ticket is not yet published. The
        // lifetime is erased; the pointer is only used by holders of a claimed task,
        // and this function returns only after every task is done.
        unsafe {
            let job: Job =
                std::mem::transmute::<*const (dyn Fn(usize) -> Result<()> + Sync + '_), Job>(f);
            *s.job.get() = Some(job);
        }
        s.done.store(0, Ordering::Relaxed);
        s.ticket
            .store((epoch << 32) | tasks as u64, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            if let Ok(_g) = s.park.lock() {
                s.wake.notify_all();
            }
        }
        while let Some(task) = s.claim(epoch) {
            s.run(task);
        }
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < tasks {
            spins += 1;
            if spins < 4096 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every task is done; nobody reads `job` until the next epoch.
        unsafe { *s.job.get() = None };
        let err = s.error.lock().ok().and_then(|mut e| e.take());
        Some(match err {
            Some(e) => Err(e),
            None => Ok(()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_task_runs_once_and_errors_come_back() {
        let Some(pool) = Pool::global() else {
            return; // one thread: the pool is not used
        };
        for round in 0..200 {
            let tasks = 1 + round % 13;
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            let f = |i: usize| -> candle_core::Result<()> {
                hits[i].fetch_add(1, Ordering::Relaxed);
                Ok(())
            };
            // Another test may hold the pool: then nothing ran.
            if let Some(r) = pool.run_tasks(tasks, &f) {
                r.unwrap();
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
        let f = |i: usize| -> candle_core::Result<()> {
            if i == 3 {
                candle_core::bail!("task 3 fails");
            }
            Ok(())
        };
        if let Some(r) = pool.run_tasks(8, &f) {
            assert!(r.unwrap_err().to_string().contains("task 3 fails"));
        }
        // The next job starts clean.
        if let Some(r) = pool.run_tasks(8, &|_| Ok(())) {
            r.unwrap();
        }
    }
}
