"""Redis keys, the packed sample codec, transactions and the trajectory store."""
