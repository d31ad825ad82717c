"""A fleet of agents' Kubernetes side against a real kube-apiserver + etcd (``bench/bench_fleet.py``).

``cluster``: the control plane, the generic overlay's RBAC and admission policies, realistic GPU
Node objects and the identities (impersonated service accounts, each agent's with its node's name
as a pod-bound token carries it). ``agents``: the agents' own effects code, ``NodeEffects`` with
its node watch, driven by the same ``EffectsWorker`` the DaemonSet's loop runs, plus the budget
counter. ``watchers``: the watches of the nodes whose agents are not simulated in full, opened
exactly as an agent opens its own. ``observe``: what a user would watch (every taint, in the API
server's order) and the API server's and etcd's own figures. ``scenarios``: the runs.
"""
