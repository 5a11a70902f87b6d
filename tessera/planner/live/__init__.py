"""Live profiles: a cluster measured on its own devices and links, for the planner.

- :mod:`.records`: what a profile holds (saved as JSON);
- :mod:`.measure`: measuring on live ranks; :mod:`.job`: the rank entry of ``tessera cluster profile``;
- :mod:`.inputs`: measurements turned into planner inputs (a measured cluster, measured part costs,
  FSDP's and tensor parallelism's overheads);
- :mod:`.quiet`: whether other processes used the CPU while the profile measured.
"""
