"""The save pipeline: jobs, the host-cache snapshot, the flush to each level, the commit protocol,
overload skips, failure handling, retention and peer replicas. ``pipeline.py`` builds the stages
once, in order (nothing is wired afterwards); only ``engine.py`` drives them."""
