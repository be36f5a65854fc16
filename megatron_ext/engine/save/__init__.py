"""The save pipeline: jobs, the host-cache snapshot, the flush to each level, the commit protocol,
overload skips, failure handling, retention and peer replicas. Only ``engine.py`` drives it."""
