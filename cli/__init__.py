"""The ``meridian`` command and the one-machine launcher: above the tiers, importing them all."""
