//! Whether the ranks of a node are bound to cores, said once per node at start-up.
//!
//! Why: a waiting rank spins briefly, then sleeps on a futex (`transport::shm`); the kernel tends
//! to wake a sleeper on its waker's core, so unbound ranks of one node can end up sharing a core
//! for a whole run while others idle. On the 2-core development VM a 4 KiB collective on 2
//! unbound ranks took 4.7-7.2 us in most runs against 1.5-1.9 us bound (benches/README.md). A
//! launcher that binds (`srun --cpu-bind=cores`, `mpirun --bind-to core`) avoids it; meshtrain does
//! not bind by itself, since the launcher knows the job's placement and its wishes.
//!
//! Read from `/proc/self/status` (`Cpus_allowed_list`) and `/sys/devices/system/cpu/online`; where
//! either is missing nothing is said.

/// Number of CPUs in a kernel CPU list such as `0-3,8,10-11`; `None` if it does not parse.
pub fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => part.parse::<usize>().map(|_| 1).ok()?,
        };
    }
    Some(n)
}

/// The advice for a node whose `local` ranks may each run on `allowed` of its `online` CPUs:
/// `Some` when there are several ranks, they would fit one per core, and nothing restricted them.
pub fn unbound_advice(allowed: usize, online: usize, local: usize) -> Option<String> {
    (local > 1 && local <= online && allowed >= online).then(|| {
        format!(
            "bootstrap: the {local} ranks on this node are not bound to cores (each may run on all {online} CPUs); \
             waiting ranks can be woken onto one core, which makes small collectives several times slower: \
             bind them (srun --cpu-bind=cores, mpirun --bind-to core)"
        )
    })
}

/// [`unbound_advice`] for this process and `local` ranks on its node.
pub fn advice(local: usize) -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .and_then(cpu_list_len)?;
    let online = cpu_list_len(&std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?)?;
    unbound_advice(allowed, online, local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count_ranges_and_single_cpus() {
        assert_eq!(cpu_list_len("0-1\n"), Some(2));
        assert_eq!(cpu_list_len("\t0-3,8,10-11"), Some(7));
        assert_eq!(cpu_list_len("5"), Some(1));
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(cpu_list_len("a-b"), None);
    }

    #[test]
    fn advice_only_for_several_unbound_ranks_that_fit_the_cores() {
        assert!(unbound_advice(2, 2, 2)
            .is_some_and(|m| m.contains("2 ranks") && m.contains("--bind-to core")));
        assert_eq!(unbound_advice(1, 2, 2), None, "bound to one core");
        assert_eq!(unbound_advice(2, 2, 1), None, "one rank");
        assert_eq!(
            unbound_advice(2, 2, 4),
            None,
            "oversubscribed: no core each"
        );
        assert!(advice(1).is_none());
    }
}
