"""The online RL Service: Tasks, capture, rewards, trajectories, Training Runs and the rollout of what they train,
over Redis."""
