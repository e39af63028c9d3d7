"""The versioned LoRA repository and the client of the gateway's LoRA routes."""
