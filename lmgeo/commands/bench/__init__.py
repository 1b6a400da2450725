"""The benchmarks of SPEC §7: every figure is a ratio of two things measured side by side in one run.

The machines this runs on are shared and noisy (the 2-core development box has other engineers'
jobs on it), so a figure is never an absolute time compared with a number written down elsewhere:
- the two sides of a ratio run on the same data, interleaved `A B B A …` after an untimed warm-up,
  and the ratio is the median over repetitions of `A_i / B_i` (adjacent runs see the same load);
- each section runs in a fresh spawned process whose BLAS/OpenMP thread count is the one the stage's
  Ray task gets (`ray.tasks.<stage>.num_cpus`), as the stage itself does: an OpenMP team with more
  threads than free cores spins at its barriers and turns a 2 ms SVD into 100 ms;
- peak memory is the child's own high-water mark of its resident set (`VmHWM`, which sees torch's
  allocations, unlike `tracemalloc`; `ru_maxrss` would also count the parent's peak, which a spawned
  child inherits across exec), one fresh process per size.

This package's modules only measure and render; `command.py` (`lmgeo bench`) chooses what runs, starts Ray
for the fan-out benchmark and writes `bench.json` / `bench.md`.
"""
