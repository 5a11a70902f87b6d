"""Optimizers: the Booster's optimizer facade, and sharding-aware LAMB and LARS."""

from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS

__all__ = ["LAMB", "LARS"]
