"""Everything that happens between ``Plan.groups``: groups of ranks (regions) that train apart and meet.

The runtime reaches it through one object, :class:`~tessera.across.membership.Membership`
(:func:`~tessera.across.membership.join`): the group's plan, its loss and batch weights, the outer sync
attached to the optimizer, and its checkpoint state. Inside:

- :mod:`.outer`: DiLoCo's outer step (and Streaming DiLoCo's turns), over :mod:`.fragments` of the model;
- :mod:`.slots`: what each rank sends, and canonical slots for groups that differ;
- :mod:`.meet`: how groups meet (the mesh's group axis); :mod:`.torchft`: torchft's quorum, for groups that
  fail and come back, :mod:`.heal`: what one coming back takes, :mod:`.lighthouse`: the launcher's side;
- :mod:`.compress`: bf16/int8/int4 outer gradients with error feedback;
- :mod:`.state`: the outer sync's checkpoint state and each group's folder;
- :mod:`.hierarchical`: gradients averaged across groups every step, hierarchically (a DDP hook).

Nothing here is imported by the package itself: modules outside import what they use (the runtime only
:mod:`.membership`), so the data-parallel wrapper can take :mod:`.hierarchical` without the rest.
"""
