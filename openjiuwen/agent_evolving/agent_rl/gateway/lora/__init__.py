"""LoRA lifecycle on the vLLM instances (CONTRACT §3.3-§3.9): the manager and its policy lines, the one switch
routine, canary candidates, adapter placement and paging, instance admission, routing by held adapters, leases and
the state file."""
