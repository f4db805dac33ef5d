//! Which members of a communicator share a node, as the hierarchical schedules (host and device)
//! need it: node indices numbered in the order of their first member, each member's place among
//! the members of its node, whether every node holds the same number of members, and whether the
//! members can run in stages at all.
//!
//! Why one place: the host collectives ([`crate::comm::communicator`]) and the device all-reduce
//! ([`crate::comm::device`]) both cut a communicator into "the members of my node" and "the
//! members holding my place on every node"; both must cut it the same way on every rank.
//!
//! Invariants: computed from the connector's node key of each member only (hostname and boot id,
//! known to every rank after bootstrap), so every member derives the same map without messages;
//! node `a`'s members are listed in member order, and place `p` on node `a` is the `p`-th of them.

/// The node layout of one communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMap {
    /// Node index (`0..nodes`) of each member.
    pub node: Vec<usize>,
    /// Members of each node, in member order.
    pub members: Vec<Vec<usize>>,
}

impl NodeMap {
    /// The map of members whose connector node keys are `keys` (one per member).
    pub fn new(keys: &[usize]) -> NodeMap {
        let mut ids: Vec<usize> = Vec::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        let node = keys
            .iter()
            .enumerate()
            .map(|(m, id)| {
                let a = ids.iter().position(|x| x == id).unwrap_or_else(|| {
                    ids.push(*id);
                    members.push(Vec::new());
                    ids.len() - 1
                });
                members[a].push(m);
                a
            })
            .collect();
        NodeMap { node, members }
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.members.len()
    }

    /// Member `m`'s place among the members of its node.
    pub fn place(&self, m: usize) -> usize {
        self.members[self.node[m]].iter().position(|&x| x == m).expect("a member is on its own node")
    }

    /// The member at place `p` of node `a`.
    pub fn member(&self, a: usize, p: usize) -> usize {
        self.members[a][p]
    }

    /// `(nodes, ranks per node)` when the members span at least two nodes with the same number
    /// `>= 2` of members each (where a hierarchical schedule differs from a flat one); otherwise
    /// why not, in words.
    pub fn uniform(&self) -> Result<(usize, usize), String> {
        let n = self.nodes();
        let per = self.members[0].len();
        if n < 2 {
            return Err("all members are on one node".into());
        }
        if let Some(other) = self.members.iter().find(|m| m.len() != per) {
            let counts: Vec<String> = self.members.iter().map(|m| m.len().to_string()).collect();
            return Err(format!(
                "nodes hold different numbers of members ({} and {}; per node: {})",
                per,
                other.len(),
                counts.join(" ")
            ));
        }
        if per < 2 {
            return Err("one member per node (the flat ring already crosses each link once)".into());
        }
        Ok((n, per))
    }
}

impl NodeMap {
    /// The number of nodes when the members span at least two nodes and some node holds `>= 2`
    /// of them (where the hierarchical host schedules differ from a flat one, even or uneven);
    /// otherwise why not, in words.
    pub fn staged(&self) -> Result<usize, String> {
        if self.nodes() < 2 {
            return Err("all members are on one node".into());
        }
        if self.members.iter().all(|m| m.len() == 1) {
            return Err("one member per node (the flat ring already crosses each link once)".into());
        }
        Ok(self.nodes())
    }
}

#[cfg(test)]
mod tests {
    use super::NodeMap;

    #[test]
    fn round_robin_and_blocked_layouts() {
        // Members alternate between hosts 7 and 3: node 0 is host 7 (member 0's).
        let m = NodeMap::new(&[7, 3, 7, 3, 7, 3]);
        assert_eq!(m.node, vec![0, 1, 0, 1, 0, 1]);
        assert_eq!(m.members, vec![vec![0, 2, 4], vec![1, 3, 5]]);
        assert_eq!((m.place(4), m.member(1, 2)), (2, 5));
        assert_eq!(m.uniform(), Ok((2, 3)));
        let m = NodeMap::new(&[1, 1, 2, 2]);
        assert_eq!((m.place(3), m.member(1, 0)), (1, 2));
        assert_eq!(m.uniform(), Ok((2, 2)));
    }

    #[test]
    fn layouts_without_a_hierarchy_say_why() {
        assert!(NodeMap::new(&[5, 5, 5]).uniform().unwrap_err().contains("one node"));
        assert!(NodeMap::new(&[1, 2, 3]).uniform().unwrap_err().contains("one member per node"));
        let e = NodeMap::new(&[1, 1, 2, 2, 2, 3]).uniform().unwrap_err();
        assert!(e.contains("per node: 2 3 1"), "{e}");
    }

    #[test]
    fn uneven_layouts_are_staged() {
        assert_eq!(NodeMap::new(&[1, 1, 2, 2, 2, 3]).staged(), Ok(3));
        assert_eq!(NodeMap::new(&[4, 4, 4, 9, 9]).staged(), Ok(2));
        assert_eq!(NodeMap::new(&[1, 2, 3, 3, 3]).staged(), Ok(3));
        assert!(NodeMap::new(&[5, 5, 5]).staged().unwrap_err().contains("one node"));
        assert!(NodeMap::new(&[1, 2, 3]).staged().unwrap_err().contains("one member per node"));
    }
}
