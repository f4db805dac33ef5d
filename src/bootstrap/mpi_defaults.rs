//! MCA defaults set before `MPI_Init` so that MPI, used only to bootstrap, opens no listener on
//! the wildcard address.
//!
//! Why: Open MPI's TCP transport (BTL) listens on `0.0.0.0` and `[::]` in every rank process
//! whatever `btl_tcp_if_include` says (that selects the interfaces it sends on, not the address it
//! binds), and held connections of random bytes open. meshtrain moves nothing through MPI but the
//! unique id and a node split, so:
//! - all ranks on one node (the launcher says so: `OMPI_COMM_WORLD_LOCAL_SIZE` equals
//!   `OMPI_COMM_WORLD_SIZE`, or Slurm's step has one node): `btl = self,vader` (shared memory,
//!   no TCP at all) and `pml = ob1` (no UCX, which may open its own sockets);
//! - several nodes: MPI needs a network, and `btl_tcp_if_include` / `oob_tcp_if_include` are set
//!   to `MESHTRAIN_SOCKET_IFNAME` when given, so MPI's traffic at least stays on the interface
//!   meshtrain uses; the TCP BTL's listener is on the wildcard address (Open MPI 4 has no
//!   setting for it) until training finalizes MPI right after start-up
//!   ([`super::World::end_mpi`]).
//!
//! Invariant: a value the user set (the `OMPI_MCA_*` variable exists, even empty) is never
//! changed; rank 0 logs the settings made. Other MPIs ignore these variables. Set before any
//! thread is started (the environment is process-wide).

/// What the launcher says about the node count, before MPI is up.
fn single_node() -> bool {
    let num = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<u64>().ok());
    if let (Some(local), Some(world)) = (num("OMPI_COMM_WORLD_LOCAL_SIZE"), num("OMPI_COMM_WORLD_SIZE")) {
        return local == world;
    }
    num("SLURM_STEP_NUM_NODES").or_else(|| num("SLURM_JOB_NUM_NODES")) == Some(1)
}

/// The settings for this launch: (MCA parameter, value).
fn defaults(single_node: bool, ifname: Option<String>) -> Vec<(&'static str, String)> {
    if single_node {
        return vec![("btl", "self,vader".into()), ("pml", "ob1".into())];
    }
    match ifname {
        Some(i) => vec![("btl_tcp_if_include", i.clone()), ("oob_tcp_if_include", i)],
        None => Vec::new(),
    }
}

/// Whether the user chose something for MCA parameter `param` (its variable, or for the
/// interface lists the matching `_exclude`).
fn user_set(param: &str) -> bool {
    let var = |p: &str| std::env::var_os(format!("OMPI_MCA_{p}")).is_some();
    var(param) || param.strip_suffix("_include").is_some_and(|base| var(&format!("{base}_exclude")))
}

/// Sets the defaults the user has not set (call before `MPI_Init`); returns what was set.
pub fn apply() -> Vec<String> {
    let mut set = Vec::new();
    for (param, value) in defaults(single_node(), crate::env::socket_ifname()) {
        if user_set(param) {
            continue;
        }
        std::env::set_var(format!("OMPI_MCA_{param}"), &value);
        set.push(format!("{param}={value}"));
    }
    set
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_node_gets_no_tcp_and_several_nodes_the_chosen_interface() {
        assert_eq!(defaults(true, Some("ib0".into())), [("btl", "self,vader".to_string()), ("pml", "ob1".to_string())]);
        assert_eq!(defaults(false, Some("ib0".into())), [("btl_tcp_if_include", "ib0".to_string()), ("oob_tcp_if_include", "ib0".to_string())]);
        assert!(defaults(false, None).is_empty());
    }
}
