"""Mechanism the three tiers share, in rooms whose imports point one way.

From the bottom up (a room imports only rooms below it, never a tier, never ``cli``):
``basics`` < ``config`` < ``capacity`` < ``request`` < ``tenancy`` < ``observability``
< ``operations`` < ``tier``. ``gen`` (generated protobuf code) sits under all of them.
``tests/test_layers.py`` checks the rule.
"""
