//! The millisecond clock of deadlines and ages: binding TTLs and leases,
//! ejections, scrape staleness. It is read several times per request, so it
//! is the kernel's coarse monotonic clock (on Linux a plain memory read in
//! the vDSO, no timestamp counter): its resolution is the scheduler tick
//! (1–4 ms), far finer than any deadline it serves. Latencies (metrics,
//! traces) are measured with `Instant`.

use std::sync::OnceLock;

/// Milliseconds on a monotonic clock with an arbitrary origin: the coarse
/// clock where the kernel has it (checked once, so one process never mixes
/// two clocks' origins), else `Instant`.
fn raw_ms() -> u64 {
    static COARSE: OnceLock<bool> = OnceLock::new();
    if *COARSE.get_or_init(|| coarse_ms().is_some()) {
        coarse_ms().unwrap_or(0)
    } else {
        instant_ms()
    }
}

#[cfg(target_os = "linux")]
fn coarse_ms() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } == 0;
    ok.then(|| ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000)
}

#[cfg(not(target_os = "linux"))]
fn coarse_ms() -> Option<u64> {
    None
}

fn instant_ms() -> u64 {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// Wall-clock milliseconds since the Unix epoch (0 before it): for what
/// outlives the process or crosses to another one (state files, the fleet's
/// store), never for deadlines.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Milliseconds since the process first asked; never 0, so 0 can mean "never".
pub fn now_ms() -> u64 {
    static START: OnceLock<u64> = OnceLock::new();
    let start = *START.get_or_init(raw_ms);
    raw_ms().saturating_sub(start) + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_forward_in_milliseconds() {
        let a = now_ms();
        assert!(a >= 1);
        std::thread::sleep(std::time::Duration::from_millis(30));
        let b = now_ms();
        // Coarse: within a scheduler tick of the 30 ms slept.
        assert!(b >= a + 20 && b < a + 30_000, "{a} → {b}");
    }
}
