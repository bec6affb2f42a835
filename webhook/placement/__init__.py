"""Per-GPU placement: the scheduler extender (filter, prioritize, bind) over watched state.

``model`` wire types · ``request`` what a pod asks · ``inventory`` a node's GPUs · ``fit`` pure
fit/score · ``state`` the cluster view · ``sync`` list/watch · ``placer`` the verbs ·
``extender`` the HTTP edge and ``setup()``.
"""
