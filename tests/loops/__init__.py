"""Training loops as users write them (pmap, FSDP, explicit sharding, NNX, shard_map...),
killed in the middle of a checkpoint window and resumed: the acceptance tests of the
CheckpointManager across loop styles (see ``test_kill_resume.py``)."""
