"""Per-GPU placement: the scheduler extender (filter, prioritize, preempt, bind) over watched
state.

``model`` wire types · ``request`` what a pod asks · ``inventory`` a node's GPUs · ``fit`` pure
fit/score · ``state`` the cluster view · ``sync`` list/watch · ``placer`` the verbs ·
``preempt`` victims per GPU · ``extender`` the HTTP edge and ``setup()``.
"""
