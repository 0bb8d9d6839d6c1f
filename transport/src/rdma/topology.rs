//! Topology (issue 36): each rail's I/O threads run on the CPUs of the
//! NUMA node its NIC hangs off, so that completions are polled, and the
//! bytes of small messages copied, next to the device and its memory.
//!
//! Every rail has its own completion queues and drivers already
//! (`rdma/rails.rs`); here a driver *thread* (`polling = "event"` or
//! `"busy"`) of a rail whose device names a node
//! (`/sys/class/infiniband/<dev>/device/numa_node`) is pinned to that
//! node's CPUs (`/sys/devices/system/node/node<N>/cpulist`) when it
//! starts. Runtime drivers (`polling = "runtime"`) run on the
//! application's tokio threads, which the application places. A device
//! that names no node (the soft NIC, Soft-RoCE in a VM, a one-node host)
//! leaves its threads where the scheduler puts them: the rails are equal.

/// The CPUs of NUMA node `node`, from sysfs; `None` where the host does
/// not say (no sysfs, no such node, an empty or unreadable list).
pub(crate) fn node_cpus(node: u32) -> Option<Vec<usize>> {
    let path = format!("/sys/devices/system/node/node{node}/cpulist");
    let cpus = parse_cpulist(std::fs::read_to_string(path).ok()?.trim())?;
    (!cpus.is_empty()).then_some(cpus)
}

/// A kernel CPU list (`0-3,8-11,16`) as CPU numbers, ascending; `None`
/// if it does not parse or names an absurd CPU (beyond 2^16).
pub(crate) fn parse_cpulist(list: &str) -> Option<Vec<usize>> {
    const MOST: usize = 1 << 16;
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (from, to) = match part.split_once('-') {
            Some((a, b)) => (
                a.trim().parse::<usize>().ok()?,
                b.trim().parse::<usize>().ok()?,
            ),
            None => {
                let cpu = part.parse::<usize>().ok()?;
                (cpu, cpu)
            }
        };
        if from > to || to >= MOST {
            return None;
        }
        cpus.extend(from..=to);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

/// Pins the calling thread to `cpus`.
pub(crate) fn pin_current_thread(cpus: &[usize]) -> Result<(), nix::Error> {
    let mut set = nix::sched::CpuSet::new();
    for &cpu in cpus {
        set.set(cpu)?;
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(
            parse_cpulist("0-3,8-11,16"),
            Some(vec![0, 1, 2, 3, 8, 9, 10, 11, 16])
        );
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("a-b"), None);
        assert_eq!(parse_cpulist("0-99999999"), None);
    }

    proptest! {
        #[test]
        fn any_text_parses_or_is_refused_without_panicking(list in ".{0,40}") {
            let _ = parse_cpulist(&list);
        }
    }

    /// A thread pinned to this host's node 0 (every Linux host has one)
    /// runs on exactly those CPUs.
    #[test]
    fn a_thread_pinned_to_node_zero_runs_on_its_cpus() {
        let Some(cpus) = node_cpus(0) else {
            eprintln!("SKIPPED: this host's sysfs lists no NUMA node 0");
            return;
        };
        let got = std::thread::spawn(move || {
            pin_current_thread(&cpus).unwrap();
            let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
            let on: Vec<usize> = (0..nix::sched::CpuSet::count())
                .filter(|&c| set.is_set(c).unwrap_or(false))
                .collect();
            (on, cpus)
        })
        .join()
        .unwrap();
        assert_eq!(got.0, got.1);
    }
}
