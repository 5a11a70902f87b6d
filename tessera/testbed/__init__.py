"""Playing a cluster on this machine: for real on the testbed (CPU quotas and shaped links), or emulated.

The testbed:

- :mod:`~tessera.testbed.cpu`: one cgroup per rank, its quota the device's relative speed.
- :mod:`~tessera.testbed.network`: one network namespace per node, veth pairs shaped with tbf.
- :mod:`~tessera.testbed.testbed`: :class:`Testbed`, which sets both up for a job and tears them down.
- :mod:`~tessera.testbed.seat`: a rank's seat, checked against /proc.
- ``enter.py``: the script torchrun starts for each rank, which takes its seat and becomes the rank.

Emulation, beside it: :mod:`~tessera.testbed.emulate`, ranks that sleep to a cluster file's device speeds and
links and are held to its memory (cheaper, and declared as such).
"""

from tessera.testbed.seat import Seat, current_seat, verify_seat
from tessera.testbed.testbed import Testbed, clean_stale

__all__ = ["Seat", "Testbed", "clean_stale", "current_seat", "verify_seat"]
