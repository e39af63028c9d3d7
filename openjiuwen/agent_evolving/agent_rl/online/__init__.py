"""The online RL Service: Tasks, capture, rewards, trajectories and (later) Training Runs over Redis."""
