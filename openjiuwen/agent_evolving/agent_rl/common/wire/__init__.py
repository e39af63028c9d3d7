"""The wire between the gateway and the RL Service, written once (CONTRACT §2, §3.5): what one process sends and the
other reads. Both sides import these names instead of spelling them.

- headers.py: request header names the gateway sets and the RL Service reads;
- env.py: environment variables the gateway sets for its RL Service child;
- task_states.py: the Task statuses, finish reasons and reward modes that cross the wire;
- routes.py: the RL Service's route table with per-route flags (proxied by the gateway and for which key, a repeat
  answers the same, leader-only); the gateway's proxy table, its retry rule and the RL Service's leader relay are
  derived from it, and tests/unit/test_wire_routes.py holds it to both apps.
"""
