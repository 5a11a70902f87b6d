"""The planner's pieces: the profiler (measured per-layer costs) today; cost model, simulator and search next."""
