"""The gateway's side of the RL Service (CONTRACT §3.3-§3.5): supervision of the child, the client of its routes,
the control plane (service, Task start and stop), Task pinning with its session map, and the checks on a Task's
lineage."""
