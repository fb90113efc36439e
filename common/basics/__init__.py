"""Vocabulary every room uses: the error model, geography, back-off,
background tasks, local processes (free ports, the embedded Redis)."""
