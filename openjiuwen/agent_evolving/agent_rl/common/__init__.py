"""Ground floor shared by the gateway, the RL Service and the agent library."""
