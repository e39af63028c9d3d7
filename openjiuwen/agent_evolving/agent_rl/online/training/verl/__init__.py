"""The verl backend's pieces: config composition (service side, no verl import), and the Ray actor that runs
verl's FSDP engine on converted batches (training side)."""
