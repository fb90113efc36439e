"""Configuration as data: the topology and access settings, read from YAML once
and validated with errors that name the bad key."""
