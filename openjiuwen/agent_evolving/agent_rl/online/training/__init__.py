"""Training Runs: the fixed-batch runner, its Redis transactions and the trainer backends."""
