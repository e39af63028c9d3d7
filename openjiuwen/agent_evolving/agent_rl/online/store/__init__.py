"""Redis keys, the packed sample codec, transactions and the sample store, one part per job: a line's keys
(sample_line.py), publication, listing, documents, deletion, exclusion, outdated samples and the counters."""
