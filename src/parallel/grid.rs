//! The 3D process grid: world = TP x PP x DP, axes ordered innermost first (`tp-pp-dp` by default,
//! so that tensor-parallel ranks are consecutive and share a node and its shared memory).
//!
//! Invariants: the mapping rank <-> (tp, pp, dp) coordinates is a bijection fixed by the order;
//! every rank builds the same three sub-communicators in the same order (collective splits over
//! the world), each containing the ranks that differ only in that axis, ordered by that coordinate.

use crate::comm::Communicator;
use super::options::{Axis, ParallelConfig};
use crate::error::{Error, Result};

/// Sizes and order of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridShape {
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Axes, innermost first.
    pub order: [Axis; 3],
}

/// A rank's coordinates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    /// Tensor-parallel rank.
    pub tp: usize,
    /// Pipeline stage.
    pub pp: usize,
    /// Data-parallel rank.
    pub dp: usize,
}

impl GridShape {
    /// The grid of a job config.
    pub fn from_config(p: &ParallelConfig) -> Self {
        GridShape { tp: p.tp, pp: p.pp, dp: p.dp, order: p.order.0 }
    }

    fn size_of(&self, a: Axis) -> usize {
        match a {
            Axis::Tp => self.tp,
            Axis::Pp => self.pp,
            Axis::Dp => self.dp,
        }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// Coordinates of world rank `rank`.
    pub fn coords(&self, rank: usize) -> Coords {
        let mut rest = rank;
        let mut c = Coords { tp: 0, pp: 0, dp: 0 };
        for a in self.order {
            let n = self.size_of(a);
            let v = rest % n;
            rest /= n;
            match a {
                Axis::Tp => c.tp = v,
                Axis::Pp => c.pp = v,
                Axis::Dp => c.dp = v,
            }
        }
        c
    }

    /// World rank at `c`.
    pub fn rank(&self, c: Coords) -> usize {
        let mut rank = 0;
        for a in self.order.iter().rev() {
            let v = match a {
                Axis::Tp => c.tp,
                Axis::Pp => c.pp,
                Axis::Dp => c.dp,
            };
            rank = rank * self.size_of(*a) + v;
        }
        rank
    }

    /// One line for the log: `grid tp=2 pp=2 dp=2 (order tp-pp-dp)`.
    pub fn describe(&self) -> String {
        let names: Vec<&str> = self.order.iter().map(|a| match a {
            Axis::Tp => "tp",
            Axis::Pp => "pp",
            Axis::Dp => "dp",
        }).collect();
        format!("grid tp={} pp={} dp={} (order {}, innermost first)", self.tp, self.pp, self.dp, names.join("-"))
    }
}

/// This rank's place in the grid and the communicator of each axis.
pub struct Grid {
    /// The grid's shape.
    pub shape: GridShape,
    /// This rank's coordinates.
    pub coords: Coords,
    /// Ranks that differ only in the tensor-parallel coordinate.
    pub tp: Communicator,
    /// Ranks that differ only in the pipeline stage.
    pub pp: Communicator,
    /// Ranks that differ only in the data-parallel coordinate.
    pub dp: Communicator,
}

impl Grid {
    /// Builds the axis communicators; collective over `world`, whose size must match the shape.
    pub fn new(world: &Communicator, shape: GridShape) -> Result<Grid> {
        if world.size() != shape.world() {
            return Err(Error::config(
                "parallel",
                format!("tp*pp*dp = {} but the job has {} ranks", shape.world(), world.size()),
            ));
        }
        let c = shape.coords(world.rank());
        // Color = the rank with this axis' coordinate zeroed (unique per line of the grid).
        let line = |zeroed: Coords| shape.rank(zeroed) as u32;
        let tp = world.split(Some(line(Coords { tp: 0, ..c })), c.tp as i64)?.expect("joined");
        let pp = world.split(Some(line(Coords { pp: 0, ..c })), c.pp as i64)?.expect("joined");
        let dp = world.split(Some(line(Coords { dp: 0, ..c })), c.dp as i64)?.expect("joined");
        Ok(Grid { shape, coords: c, tp, pp, dp })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::testing::run_ranks;
    use crate::comm::{CommConfig, ReduceOp};

    #[test]
    fn coordinates_are_a_bijection_in_every_order() {
        let orders = [[Axis::Tp, Axis::Pp, Axis::Dp], [Axis::Dp, Axis::Tp, Axis::Pp], [Axis::Pp, Axis::Dp, Axis::Tp]];
        for order in orders {
            let g = GridShape { tp: 2, pp: 3, dp: 2, order };
            let mut coords: Vec<Coords> = (0..12).map(|r| g.coords(r)).collect();
            assert!(coords.iter().enumerate().all(|(r, &c)| g.rank(c) == r));
            coords.sort_by_key(|c| (c.tp, c.pp, c.dp));
            coords.dedup();
            assert_eq!(coords.len(), 12, "coordinates are distinct");
        }
        let g = GridShape { tp: 2, pp: 2, dp: 2, order: [Axis::Tp, Axis::Pp, Axis::Dp] };
        assert_eq!(g.coords(5), Coords { tp: 1, pp: 0, dp: 1 });
    }

    #[test]
    fn axis_communicators_hold_the_right_ranks() {
        let shape = GridShape { tp: 2, pp: 2, dp: 2, order: [Axis::Tp, Axis::Pp, Axis::Dp] };
        let out = run_ranks(8, CommConfig::default(), move |world| {
            let g = Grid::new(&world, shape).unwrap();
            let sum = |c: &Communicator| {
                let mut v = [world.rank() as i64];
                c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                v[0]
            };
            (g.coords, g.tp.rank(), g.pp.rank(), g.dp.rank(), sum(&g.tp), sum(&g.pp), sum(&g.dp))
        });
        // Rank 5 = (tp 1, pp 0, dp 1): tp line {4, 5}, pp line {5, 7}, dp line {1, 5}.
        assert_eq!(out[5], (Coords { tp: 1, pp: 0, dp: 1 }, 1, 0, 1, 9, 12, 6));
        assert!(Grid::new(&run_ranks(1, CommConfig::default(), |w| w).pop().unwrap(), shape).is_err());
    }
}
