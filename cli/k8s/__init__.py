"""``meridian deploy k8s``: Kubernetes manifests rendered from a topology file.

Pure functions from a topology mapping (the YAML the processes read) and
``RenderOptions`` to manifest dicts (``render.render``), written one file per
kind group or tier instance (``render.write``). The same input gives the same
bytes, so the committed ``deploy/k8s/`` is checked against a fresh rendering.
"""
