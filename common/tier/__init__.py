"""One tier process assembled: the server that owns every part, and the wiring
the three tiers share."""
