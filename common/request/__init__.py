"""The request path: routing hints, V2 helpers, children and their health,
balancers and leases, the forwarding loop, the proxy."""
