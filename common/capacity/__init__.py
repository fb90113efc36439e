"""Capacity summaries: pure summary arithmetic, apart from the Redis streams
that carry it upward."""
